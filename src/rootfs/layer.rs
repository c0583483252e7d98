//! A writable root's layer: the block device the guest's overlay keeps its changes on.
//!
//! The image under a writable root stays what it was, read-only and verified; the guest writes
//! to an ext4 filesystem on a second disk that guest-init makes the upper layer of an overlay
//! over the image (docs/architecture.md, "Writable roots"). This module makes that disk.
//!
//! An ephemeral layer ([`MemoryLayer`]) is a memfd: sized to the quota, formatted, then sealed
//! so that it can neither grow nor shrink. The filesystem on it is exactly the quota, so a guest
//! that fills it gets `ENOSPC` from its own kernel, and the host memory it can make us hold is
//! the memfd's pages: at most the quota, whatever the guest does. It goes with the instance and
//! is never written to a host disk, but into a snapshot the caller takes (`layer.img`).

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Error, Result};

/// The smallest writable layer: room for ext4's own metadata and a useful amount of change.
pub(crate) const MIN_LAYER_BYTES: u64 = 16 << 20;

/// The largest writable layer (ext4 with 4 KiB blocks and no 64-bit feature tops out at
/// 16 TiB; a quota past this is more likely a unit mistake than a plan).
pub(crate) const MAX_LAYER_BYTES: u64 = 1 << 40;

/// The filesystem a layer holds, as the guest mounts it.
pub(crate) const LAYER_FSTYPE: &str = "ext4";

/// Checks a quota the way [`MemoryLayer::create`] would refuse it, so a definition fails at
/// `build()` and not at each boot.
pub(crate) fn check_quota(max_dirty_bytes: u64) -> Result<()> {
    if !(MIN_LAYER_BYTES..=MAX_LAYER_BYTES).contains(&max_dirty_bytes) {
        return Err(Error::InvalidConfig(format!(
            "a writable root's max_dirty_bytes must be between {} MiB and {} GiB, got {max_dirty_bytes} bytes",
            MIN_LAYER_BYTES >> 20,
            MAX_LAYER_BYTES >> 30
        )));
    }
    Ok(())
}

/// An ephemeral writable layer in host memory (a sealed memfd holding a fresh ext4).
#[derive(Debug)]
pub(crate) struct MemoryLayer {
    file: File,
    max_bytes: u64,
}

impl MemoryLayer {
    /// A fresh layer of `max_bytes` (rounded down to 4 KiB blocks): a memfd of that size,
    /// formatted ext4 with `mke2fs`, then sealed against growing and shrinking.
    pub(crate) fn create(max_bytes: u64) -> Result<MemoryLayer> {
        check_quota(max_bytes)?;
        let max_bytes = max_bytes & !4095;
        let file = formatted_memfd(max_bytes, Journal::Without)?;
        seal(&file)?;
        Ok(MemoryLayer { file, max_bytes })
    }

    /// An empty layer of `max_bytes` (all zeros, not formatted), sealed as [`create`]'s: a
    /// restore or a fork copies a snapshotted layer's data into it before its guest runs.
    ///
    /// [`create`]: MemoryLayer::create
    pub(crate) fn empty(max_bytes: u64) -> Result<MemoryLayer> {
        check_quota(max_bytes)?;
        let max_bytes = max_bytes & !4095;
        let file = crate::guest_memory::sealed_memfd(
            c"krunbox-layer",
            max_bytes,
            crate::guest_memory::LaterSeals::None,
        )
        .map_err(layer_error("creating the memfd"))?;
        Ok(MemoryLayer { file, max_bytes })
    }

    /// The layer on `file`, a memfd [`empty`](MemoryLayer::empty) made (and a fork's source
    /// filled).
    pub(crate) fn of_file(file: File) -> std::io::Result<MemoryLayer> {
        let max_bytes = file.metadata()?.len();
        Ok(MemoryLayer { file, max_bytes })
    }

    /// The layer's descriptor, handed to the VMM helper as the guest's second disk.
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// What the layer holds now: the bytes of host memory its pages take.
    pub(crate) fn usage(&self) -> RootUsage {
        RootUsage {
            held_bytes: allocated_bytes(&self.file),
            max_bytes: self.max_bytes,
        }
    }
}

/// The bytes `file` takes where it lives (memory for a memfd, disk for a file): its allocated
/// blocks, not its length, which counts holes.
/// A memfd of `bytes` (a multiple of 4 KiB) holding a fresh ext4 filesystem, formatted by
/// `mke2fs`: an ephemeral layer's disk, or the first contents of a copy-on-write one. It holds
/// only what `mke2fs` wrote (it assumes the storage reads as zeros).
pub(super) fn formatted_memfd(bytes: u64, journal: Journal) -> Result<File> {
    let fd = nix::sys::memfd::memfd_create(
        c"krunbox-layer",
        nix::sys::memfd::MFdFlags::MFD_CLOEXEC | nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING,
    )
    .map_err(|e| layer_error("creating the memfd")(e.into()))?;
    let file = File::from(fd);
    file.set_len(bytes)
        .map_err(layer_error("sizing the memfd"))?;
    // The child reaches the memfd through this process's descriptor table (the memfd has
    // no other name); it is close-on-exec, so the child holds nothing of ours after.
    let path = PathBuf::from(format!(
        "/proc/{}/fd/{}",
        std::process::id(),
        file.as_raw_fd()
    ));
    format_ext4(&path, journal)?;
    Ok(file)
}

/// The written extents (`start..end` byte ranges) of a sparse file, found with `SEEK_DATA` and
/// `SEEK_HOLE`: what a freshly formatted layer disk holds, to copy into its real home.
pub(crate) fn data_extents(file: &File) -> std::io::Result<Vec<(u64, u64)>> {
    use nix::unistd::{lseek, Whence};
    let size = file.metadata()?.len() as i64;
    let mut extents = Vec::new();
    let mut at = 0i64;
    while at < size {
        let start = match lseek(file.as_fd(), at, Whence::SeekData) {
            Ok(start) => start,
            Err(nix::errno::Errno::ENXIO) => break, // only a hole is left
            Err(e) => return Err(e.into()),
        };
        let end = lseek(file.as_fd(), start, Whence::SeekHole)?;
        extents.push((start as u64, end as u64));
        at = end;
    }
    Ok(extents)
}

pub(super) fn allocated_bytes(file: &File) -> u64 {
    nix::sys::stat::fstat(file.as_fd())
        .map(|st| st.st_blocks as u64 * 512)
        .unwrap_or(0)
}

/// How much of a writable root's quota is in use (see
/// [`Instance::root_usage`](crate::Instance::root_usage)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct RootUsage {
    /// Host memory the writable layer holds now (its filesystem's data and metadata).
    pub held_bytes: u64,
    /// The most it can ever hold: the quota the layer was made with.
    pub max_bytes: u64,
}

/// Seals a memfd at its size: neither the VMM helper nor anything else can grow it (a write
/// past the end fails) or shrink it.
fn seal(file: &File) -> Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    let seals = SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_SEAL;
    fcntl(file.as_fd(), FcntlArg::F_ADD_SEALS(seals))
        .map(drop)
        .map_err(|e| layer_error("sealing the memfd")(e.into()))
}

/// Where `mke2fs` may be: Debian keeps it in `/usr/sbin` (and `/sbin`), which an unprivileged
/// user's `PATH` may lack.
const MKE2FS: [&str; 2] = ["/usr/sbin/mke2fs", "/sbin/mke2fs"];

/// The `mke2fs` to run: the first of [`MKE2FS`] that exists, else whatever `PATH` finds.
pub(crate) fn mke2fs() -> Result<PathBuf> {
    if let Some(found) = MKE2FS.iter().map(Path::new).find(|p| p.is_file()) {
        return Ok(found.to_path_buf());
    }
    let in_path: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join("mke2fs"))
                .collect()
        })
        .unwrap_or_default();
    if let Some(found) = in_path.iter().find(|p| p.is_file()) {
        return Ok(found.clone());
    }
    Err(Error::MissingArtifact {
        what: "mke2fs (to format a writable root's layer)",
        looked_in: MKE2FS.iter().map(PathBuf::from).chain(in_path).collect(),
        fix: "install e2fsprogs (`apt-get install e2fsprogs`)".into(),
    })
}

/// Whether a layer's ext4 gets a journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Journal {
    /// A persistent layer: it must come through a crash of the VM consistent.
    With,
    /// An ephemeral layer: it does not outlive the VM, so the journal's writes buy nothing.
    Without,
}

/// Formats `path` (a fresh, all-zero file) as ext4 for a layer.
///
/// Why these options: `assume_storage_prezeroed` (the file reads as zeros) lets mke2fs skip
/// zeroing and marks the inode tables initialised, so neither mke2fs nor the guest kernel's
/// lazy-init thread writes them: an untouched layer holds a few hundred KiB of host memory (or
/// disk), not its inode tables. `-m 0`: the space is all the guest's (root is the guest's
/// user). `-i 8192`: package trees are many small files, so twice ext4's default inodes.
pub(crate) fn format_ext4(path: &Path, journal: Journal) -> Result<()> {
    let mke2fs = mke2fs()?;
    let features = match journal {
        Journal::With => "has_journal",
        Journal::Without => "^has_journal",
    };
    let output = Command::new(&mke2fs)
        .args([
            "-q",
            "-F",
            "-t",
            LAYER_FSTYPE,
            "-b",
            "4096",
            "-i",
            "8192",
            "-m",
            "0",
            "-O",
            features,
            "-E",
            "assume_storage_prezeroed=1,nodiscard,root_owner=0:0",
            "-L",
            "krunbox-layer",
        ])
        .arg(path)
        .env_clear()
        .output()
        .map_err(layer_error(&format!("running {}", mke2fs.display())))?;
    if !output.status.success() {
        return Err(Error::WritableLayer(format!(
            "{} failed ({}): {}",
            mke2fs.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(())
}

fn layer_error(what: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::WritableLayer(format!("{what}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer is a sealed memfd of the quota holding an ext4 filesystem, and holds little
    /// memory until written.
    #[test]
    fn a_memory_layer_is_a_sealed_ext4_of_the_quota() {
        let layer = MemoryLayer::create((64 << 20) + 123).unwrap();
        let file = layer.file();
        assert_eq!(file.metadata().unwrap().len(), 64 << 20, "rounded to 4 KiB");
        // ext4's magic 0xEF53 at byte 1080 (superblock at 1024, s_magic at 56).
        let mut magic = [0u8; 2];
        std::os::unix::fs::FileExt::read_exact_at(file, &mut magic, 1080).unwrap();
        assert_eq!(u16::from_le_bytes(magic), 0xEF53);
        let usage = layer.usage();
        assert_eq!(usage.max_bytes, 64 << 20);
        assert!(
            usage.held_bytes < 4 << 20,
            "a fresh layer holds {} bytes",
            usage.held_bytes
        );
        // Sealed: no growing, no shrinking, no new seals.
        assert!(file.set_len(128 << 20).is_err());
        assert!(file.set_len(1 << 20).is_err());
        let past_end = std::os::unix::fs::FileExt::write_at(file, b"x", 64 << 20);
        assert!(past_end.is_err(), "a write past the end grew the layer");
        let inside = std::os::unix::fs::FileExt::write_at(file, b"x", (64 << 20) - 1);
        assert_eq!(inside.unwrap(), 1);
    }

    #[test]
    fn quotas_outside_the_bounds_are_refused() {
        for bad in [0, MIN_LAYER_BYTES - 1, MAX_LAYER_BYTES + 1, u64::MAX] {
            assert!(
                matches!(MemoryLayer::create(bad), Err(Error::InvalidConfig(_))),
                "{bad}"
            );
        }
    }
}
