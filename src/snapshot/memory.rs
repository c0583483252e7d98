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

use super::copy::copy_data;
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
    /// guest memory, its size sealed, emptied after each use. A fork's holds its source's
    /// pages until its helper has laid them over its memory.
    private_pages: Arc<File>,
    /// One snapshot or fork at a time, held by the stilling's own task (which outlives a
    /// caller that gave up): a fork decides from `private` how its copies map `base`, and
    /// must not be overtaken by another that freezes it or rewrites the pages file.
    one_at_a_time: std::panic::AssertUnwindSafe<Arc<tokio::sync::Mutex<()>>>,
}

impl InstanceMemory {
    /// Memory mapped from `base`, `private`ly or not, with a fresh private-pages file.
    pub(crate) fn new(base: Arc<File>, private: bool) -> std::io::Result<InstanceMemory> {
        let pages = Arc::new(Self::pages_file(base.metadata()?.len())?);
        Ok(Self::with_pages(base, private, pages))
    }

    /// Memory mapped from `base` with the private-pages file `pages` (a fork's, which its
    /// source filled).
    pub(crate) fn with_pages(base: Arc<File>, private: bool, pages: Arc<File>) -> InstanceMemory {
        InstanceMemory {
            base,
            private: AtomicBool::new(private),
            private_pages: pages,
            // A lock of nothing: a panic under it leaves nothing half-changed.
            one_at_a_time: std::panic::AssertUnwindSafe(Arc::new(tokio::sync::Mutex::new(()))),
        }
    }

    /// An empty private-pages file for guest memory of `len` bytes.
    pub(crate) fn pages_file(len: u64) -> std::io::Result<File> {
        crate::guest_memory::sealed_memfd(c"krunbox-private-pages", len, LaterSeals::None)
    }

    /// Waits for any other snapshot or fork of this instance to end; the guard lets the next
    /// one go when dropped (wherever it was moved).
    pub(crate) async fn one_at_a_time(&self) -> tokio::sync::OwnedMutexGuard<()> {
        self.one_at_a_time.0.clone().lock_owned().await
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

    /// Fills `into` (a fork's private-pages file, all holes) with the pages the helper wrote
    /// into this private-pages file: the fork's helper lays them over `base` at its gate.
    pub(crate) fn copy_private_pages_to(&self, into: &File) -> std::io::Result<()> {
        copy_data(&self.private_pages, into)
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
    /// mapped it shared before included, can change the pages they share from then on. Fails
    /// (`EBUSY`) while any process still maps it shared and writable.
    pub(crate) fn seal_base(&self) -> std::io::Result<()> {
        use nix::fcntl::{fcntl, FcntlArg, SealFlag};
        fcntl(
            self.base.as_fd(),
            FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_SEAL),
        )?;
        Ok(())
    }

    /// Makes sure no process can change `base` any more before forks map it: it is open
    /// read-only everywhere (a snapshot's `memory.img`, which the library opens so), or sealed
    /// against writes (sealed now if it is not yet; a remap that failed half-way, or a helper
    /// that keeps a writable shared mapping, makes that fail).
    pub(crate) fn ensure_frozen(&self) -> std::io::Result<()> {
        use nix::fcntl::{fcntl, FcntlArg, OFlag, SealFlag};
        let access = OFlag::from_bits_truncate(fcntl(self.base.as_fd(), FcntlArg::F_GETFL)?);
        if access & OFlag::O_ACCMODE == OFlag::O_RDONLY {
            return Ok(());
        }
        let seals = fcntl(self.base.as_fd(), FcntlArg::F_GET_SEALS)
            .map(SealFlag::from_bits_truncate)
            .unwrap_or(SealFlag::empty());
        if seals.contains(SealFlag::F_SEAL_WRITE) {
            return Ok(());
        }
        self.seal_base()
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
    fn memory_forks_would_share_is_frozen_first_or_the_fork_refused() {
        use std::os::fd::AsRawFd;
        // A snapshot's memory, open read-only: frozen as it is.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("memory.img"), [1u8; 4096]).unwrap();
        let read_only = File::open(dir.path().join("memory.img")).unwrap();
        InstanceMemory::new(Arc::new(read_only), true)
            .unwrap()
            .ensure_frozen()
            .unwrap();
        // A memfd not sealed yet is sealed now.
        let base = Arc::new(sealed_memfd(c"base", 1 << 20, LaterSeals::Write).unwrap());
        InstanceMemory::new(base.clone(), true)
            .unwrap()
            .ensure_frozen()
            .unwrap();
        assert!(base.write_all_at(b"x", 0).is_err(), "not sealed");
        // One a process still maps shared and writable cannot be: the fork is refused.
        let mapped = Arc::new(sealed_memfd(c"mapped", 1 << 20, LaterSeals::Write).unwrap());
        // SAFETY: a fresh shared mapping of one page, unmapped below, used only here.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                mapped.as_raw_fd(),
                0,
            )
        };
        assert_ne!(page, libc::MAP_FAILED);
        let memory = InstanceMemory::new(mapped.clone(), true).unwrap();
        assert!(memory.ensure_frozen().is_err());
        // SAFETY: the mapping made above, not used after.
        unsafe { libc::munmap(page, 4096) };
        memory.ensure_frozen().unwrap();
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
