//! Guest memory in a file this process made, so that it can serve a device's queues itself
//! (and snapshot it: `snapshot::memory`, where a restore's or fork's memory is another file,
//! mapped copy-on-write).
//!
//! A device in the helper that forwarded each request to this process would cost a hop per request
//! both ways (a helper thread wakes, a socket, this process's task, and back), which under
//! nested emulation is most of a small request's time (docs/architecture.md, "Workspaces").
//! Instead the library makes the guest's memory here, a sealed memfd given to the helper,
//! which builds the VM in it (krun-vmm's `EMBEDDER_GUEST_MEMORY`, our patch); when a device
//! activates, the helper hands over where its rings lie and the eventfds KVM signals, and
//! this process maps the same file and serves the queues, as a vhost-user backend would.
//!
//! The helper, the guest's neighbour, is not trusted with this process's memory: what it
//! says about the layout is checked (each region within the file, page-aligned, at most
//! [`MAX_REGIONS`], none overlapping), and the file's size is sealed, so nothing the helper
//! does can make this process's mapping fault. The guest can change any byte of the mapping
//! at any time; every access goes through vm-memory's volatile copies and every ring is
//! parsed by bounded code (`krunbox_virtio::queue`).

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap};

pub(crate) use krunbox_virtio::memory::{MemoryRegion, MAX_REGIONS};

/// Room in the file beyond the guest's RAM, for libkrunfw's kernel (about 21 MiB, copied in
/// when the VM is built) and the pages lost to aligning each region. Unused room costs
/// nothing: the file is sparse.
const KERNEL_ROOM: u64 = 64 << 20;

const PAGE: u64 = 4096;

/// The guest's memory, in a sealed memfd of this process's.
#[derive(Debug)]
pub(crate) struct GuestMemoryFile {
    file: Arc<File>,
    len: u64,
}

impl GuestMemoryFile {
    /// A file for a guest of `memory_mib` MiB of RAM: sparse, its size sealed (it can neither
    /// grow nor shrink, in any process), so a mapping of it never faults.
    /// `later`: whether writes may be sealed later (a fork freezes its source's memory so).
    pub(crate) fn create(memory_mib: u32, later: LaterSeals) -> std::io::Result<Self> {
        let len = Self::len_for(memory_mib);
        Ok(GuestMemoryFile {
            file: Arc::new(sealed_memfd(c"krunbox-guest-memory", len, later)?),
            len,
        })
    }

    /// How long the file of a guest of `memory_mib` MiB of RAM is.
    pub(crate) fn len_for(memory_mib: u32) -> u64 {
        (u64::from(memory_mib) << 20) + KERNEL_ROOM
    }

    /// The file, to keep.
    pub(crate) fn shared_file(&self) -> Arc<File> {
        self.file.clone()
    }

    /// Maps `regions` of the file as guest memory, after checking them: at most
    /// [`MAX_REGIONS`], each non-empty, page-aligned and within the file, none overlapping
    /// another in guest addresses.
    pub(crate) fn map(&self, regions: &[MemoryRegion]) -> std::io::Result<GuestMemoryMmap> {
        let invalid = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
        if regions.is_empty() || regions.len() > MAX_REGIONS {
            return Err(invalid(format!(
                "{} regions of guest memory (1 to {MAX_REGIONS})",
                regions.len()
            )));
        }
        let mut ranges = Vec::with_capacity(regions.len());
        for region in regions {
            let end = region.file_offset.checked_add(region.len);
            let aligned = [region.guest_address, region.len, region.file_offset]
                .iter()
                .all(|value| value % PAGE == 0);
            let addressable = region.guest_address.checked_add(region.len).is_some();
            if region.len == 0 || !aligned || !addressable || end.is_none_or(|end| end > self.len) {
                return Err(invalid(format!(
                    "a region of guest memory outside the file of {} bytes or not page-aligned: {region:?}",
                    self.len
                )));
            }
            ranges.push((
                GuestAddress(region.guest_address),
                usize::try_from(region.len).map_err(|e| invalid(e.to_string()))?,
                Some(FileOffset::from_arc(self.file.clone(), region.file_offset)),
            ));
        }
        ranges.sort_by_key(|range| range.0);
        // vm-memory refuses overlapping regions.
        GuestMemoryMmap::from_ranges_with_files(ranges)
            .map_err(|e| invalid(format!("guest memory regions: {e}")))
    }
}

/// The seals a memfd whose size is sealed may still get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LaterSeals {
    /// None: no process holding it can seal it against anything more.
    None,
    /// A seal against writes (`F_SEAL_WRITE`), by whichever holder adds it first.
    Write,
}

/// A memfd of `len` bytes (sparse) whose size is sealed: whatever holds it can write within
/// it but neither grow nor shrink it, so a mapping of it never faults.
pub(crate) fn sealed_memfd(
    name: &std::ffi::CStr,
    len: u64,
    later: LaterSeals,
) -> std::io::Result<File> {
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    use nix::sys::memfd::{memfd_create, MFdFlags};
    let fd: OwnedFd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)?;
    let file = File::from(fd);
    file.set_len(len)?;
    let mut seals = SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SHRINK;
    if later == LaterSeals::None {
        seals |= SealFlag::F_SEAL_SEAL;
    }
    fcntl(file.as_fd(), FcntlArg::F_ADD_SEALS(seals))?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    fn region(guest_address: u64, len: u64, file_offset: u64) -> MemoryRegion {
        MemoryRegion {
            guest_address,
            len,
            file_offset,
        }
    }

    #[test]
    fn two_mappings_of_the_file_see_each_others_writes() {
        let file = GuestMemoryFile::create(16, LaterSeals::None).unwrap();
        let layout = [region(0, 1 << 20, 0), region(2 << 20, 1 << 20, 1 << 20)];
        let first = file.map(&layout).unwrap();
        let second = file.map(&layout).unwrap();
        first
            .write_slice(b"from the guest", GuestAddress((2 << 20) + 100))
            .unwrap();
        let mut seen = [0u8; 14];
        second
            .read_slice(&mut seen, GuestAddress((2 << 20) + 100))
            .unwrap();
        assert_eq!(&seen, b"from the guest");
    }

    #[test]
    fn the_file_cannot_be_resized() {
        let file = GuestMemoryFile::create(16, LaterSeals::None).unwrap();
        let len = file.file.metadata().unwrap().len();
        assert_eq!(len, (16 << 20) + KERNEL_ROOM);
        assert!(file.file.set_len(len / 2).is_err(), "shrunk");
        assert!(file.file.set_len(len * 2).is_err(), "grown");
    }

    #[test]
    fn a_layout_past_the_file_unaligned_overlapping_or_too_long_is_refused() {
        let file = GuestMemoryFile::create(16, LaterSeals::None).unwrap();
        let len = file.file.metadata().unwrap().len();
        let refused = [
            vec![],
            vec![region(0, len + PAGE, 0)],
            vec![region(0, PAGE, len)],
            vec![region(0, PAGE, u64::MAX - PAGE + 1)],
            vec![region(u64::MAX - PAGE + 1, PAGE * 2, 0)],
            vec![region(0, 100, 0)],
            vec![region(100, PAGE, 0)],
            vec![region(0, PAGE, 100)],
            vec![region(0, 0, 0)],
            vec![region(0, 2 * PAGE, 0), region(PAGE, PAGE, 4 * PAGE)],
            (0..MAX_REGIONS as u64 + 1)
                .map(|i| region(i * PAGE, PAGE, i * PAGE))
                .collect(),
        ];
        for layout in refused {
            assert!(file.map(&layout).is_err(), "{layout:?} was mapped");
        }
        let most: Vec<_> = (0..MAX_REGIONS as u64)
            .map(|i| region(i * 2 * PAGE, PAGE, i * PAGE))
            .collect();
        file.map(&most).unwrap();
    }
}
