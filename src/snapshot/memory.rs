//! An instance's guest memory as its snapshots and forks see it (docs/architecture.md,
//! "Snapshots, restore and fork").
//!
//! The helper maps guest memory from a file of this process's: shared (the instance booted,
//! its memory in a memfd made for it) or copy-on-write (a restored instance maps the
//! snapshot's `memory.img`, a fork its source's frozen memory; a fork's source maps its own
//! memfd so once it is forked). Copy-on-write, the file never changes, pages the guest never
//! writes stay shared with every other instance mapping it, and guest memory is the file
//! overlaid with the pages the guest wrote, which only the helper has: it writes them into a
//! file of this process's on request ([`VmmCommand::WritePrivatePages`]
//! (krunbox_protocol::vmm::command::VmmCommand::WritePrivatePages)), and [`merge_into`]
//! lays them over the file's data.

use std::fs::File;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::guest_memory::LaterSeals;

/// An instance's guest memory: the file the helper maps, how, and where it writes the pages
/// the guest made its own.
#[derive(Debug)]
pub(crate) struct InstanceMemory {
    /// The file guest memory is mapped from.
    base: Arc<File>,
    /// The helper maps `base` copy-on-write: `base` no longer changes. Set before the helper
    /// is asked to map it so (a remap that failed half-way leaves some regions so: reading
    /// the helper's own pages over `base` is right for both kinds of region).
    private: AtomicBool,
    /// Where the helper writes the guest's own pages (`Inherited::PrivatePages`): as long as
    /// guest memory, its size sealed, emptied after each use.
    private_pages: Arc<File>,
    /// One snapshot or fork at a time: a fork decides from `private` which file its copies
    /// map, and must not be overtaken by another that freezes `base`.
    pub(crate) one_at_a_time: std::panic::AssertUnwindSafe<tokio::sync::Mutex<()>>,
}

impl InstanceMemory {
    /// Memory mapped from `base`, `private`ly or not, with a fresh private-pages file.
    pub(crate) fn new(base: Arc<File>, private: bool) -> std::io::Result<InstanceMemory> {
        let len = base.metadata()?.len();
        Ok(InstanceMemory {
            base,
            private: AtomicBool::new(private),
            private_pages: Arc::new(crate::guest_memory::sealed_memfd(
                c"krunbox-private-pages",
                len,
                LaterSeals::None,
            )?),
            // A lock of nothing: a panic under it leaves nothing half-changed.
            one_at_a_time: std::panic::AssertUnwindSafe(tokio::sync::Mutex::new(())),
        })
    }

    /// The file guest memory is mapped from, for the helper.
    pub(crate) fn base(&self) -> &Arc<File> {
        &self.base
    }

    /// The private-pages file, for the helper (and, once it wrote the guest's own pages
    /// there, for a fork's to lay over the same `base`).
    pub(crate) fn private_pages(&self) -> &Arc<File> {
        &self.private_pages
    }

    /// Fills the private-pages file (a fork's, all holes) with the pages its source's helper
    /// wrote into its own (`pages`): the fork's helper lays them over `base` at its gate.
    pub(crate) fn copy_private_pages_from(&self, pages: &File) -> std::io::Result<()> {
        copy_data(pages, &self.private_pages)
    }

    /// Empties the private-pages file once what the helper wrote there is used: each use
    /// has the helper write its pages afresh.
    pub(crate) fn forget_private_pages(&self) -> std::io::Result<()> {
        let len = self.private_pages.metadata()?.len() as i64;
        nix::fcntl::fallocate(
            self.private_pages.as_fd(),
            nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
            0,
            len,
        )?;
        Ok(())
    }

    /// Guest memory's length (the file's).
    pub(crate) fn len(&self) -> std::io::Result<u64> {
        Ok(self.base.metadata()?.len())
    }

    /// Whether the helper maps `base` copy-on-write.
    pub(crate) fn is_private(&self) -> bool {
        self.private.load(Ordering::SeqCst)
    }

    /// Records that the helper is asked to map `base` copy-on-write (before asking it).
    pub(crate) fn set_private(&self) {
        self.private.store(true, Ordering::SeqCst);
    }

    /// Seals `base` (a memfd made with [`LaterSeals::Write`]) against writes, once the helper
    /// maps it copy-on-write: forks map it too, and no process holding it, the helper that
    /// mapped it shared before included, can change the pages they share from then on.
    pub(crate) fn seal_base(&self) -> std::io::Result<()> {
        use nix::fcntl::{fcntl, FcntlArg, SealFlag};
        fcntl(
            self.base.as_fd(),
            FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_SEAL),
        )?;
        Ok(())
    }

    /// Fills `into` (as long as guest memory, all zeros) with guest memory: `base`'s data
    /// overlaid with the pages the helper wrote into the private-pages file since the last
    /// merge (the guest's vCPUs paused since), then empties that file. In the kernel: the bytes
    /// do not pass through this process.
    pub(crate) fn merge_into(&self, into: &File) -> std::io::Result<()> {
        copy_data(&self.base, into)?;
        if self.is_private() {
            copy_data(&self.private_pages, into)?;
            self.forget_private_pages()?;
        }
        Ok(())
    }
}

/// Copies `from`'s data into `to` at the same offsets, in the kernel.
fn copy_data(from: &File, to: &File) -> std::io::Result<()> {
    super::copy::copy_extents(from, to, &crate::rootfs::layer::data_extents(from)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest_memory::sealed_memfd;
    use std::os::unix::fs::FileExt;

    #[test]
    fn a_merge_lays_the_guests_pages_over_the_base_and_empties_them() {
        let base = Arc::new(sealed_memfd(c"base", 1 << 20, LaterSeals::Write).unwrap());
        base.write_all_at(&[1u8; 8192], 0).unwrap();
        base.write_all_at(&[2u8; 4096], 65536).unwrap();
        let memory = InstanceMemory::new(base.clone(), true).unwrap();
        // The guest rewrote the second page and wrote one the base never had.
        memory
            .private_pages()
            .write_all_at(&[7u8; 4096], 4096)
            .unwrap();
        memory
            .private_pages()
            .write_all_at(&[9u8; 4096], 131072)
            .unwrap();
        let merged = sealed_memfd(c"merged", 1 << 20, LaterSeals::None).unwrap();
        memory.merge_into(&merged).unwrap();
        let page = |file: &File, at: u64| {
            let mut page = vec![0u8; 4096];
            file.read_exact_at(&mut page, at).unwrap();
            page
        };
        assert_eq!(page(&merged, 0), vec![1u8; 4096]);
        assert_eq!(page(&merged, 4096), vec![7u8; 4096]);
        assert_eq!(page(&merged, 65536), vec![2u8; 4096]);
        assert_eq!(page(&merged, 131072), vec![9u8; 4096]);
        assert_eq!(page(&merged, 8192), vec![0u8; 4096]);
        // The base is as it was, and the pages file empty for the next merge.
        assert_eq!(page(&base, 4096), vec![1u8; 4096]);
        assert!(crate::rootfs::layer::data_extents(memory.private_pages())
            .unwrap()
            .is_empty());
    }

    #[test]
    fn a_frozen_base_refuses_writes_and_still_maps_copy_on_write() {
        let base = Arc::new(sealed_memfd(c"base", 1 << 20, LaterSeals::Write).unwrap());
        base.write_all_at(b"before", 0).unwrap();
        let memory = InstanceMemory::new(base.clone(), false).unwrap();
        memory.seal_base().unwrap();
        assert!(base.write_all_at(b"after", 0).is_err());
        // As a fork's helper maps it: copy-on-write, its writes its own.
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh private mapping of one page, unmapped below, used only here.
        unsafe {
            let page = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                base.as_raw_fd(),
                0,
            );
            assert_ne!(
                page,
                libc::MAP_FAILED,
                "{}",
                std::io::Error::last_os_error()
            );
            std::ptr::copy_nonoverlapping(b"forked".as_ptr(), page.cast::<u8>(), 6);
            libc::munmap(page, 4096);
        }
        let mut seen = [0u8; 6];
        base.read_exact_at(&mut seen, 0).unwrap();
        assert_eq!(&seen, b"before");
    }

    #[test]
    fn the_private_pages_file_cannot_grow_past_guest_memory() {
        let base = Arc::new(sealed_memfd(c"base", 1 << 20, LaterSeals::Write).unwrap());
        let memory = InstanceMemory::new(base, false).unwrap();
        assert!(memory
            .private_pages()
            .write_all_at(b"past the end", 1 << 20)
            .is_err());
        assert!(memory.private_pages().set_len(2 << 20).is_err());
    }
}
