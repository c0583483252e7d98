//! The trait a host program implements to be a filesystem the guest mounts.

use std::ffi::OsStr;

use super::types::*;
use super::WriteData;

/// A filesystem whose every operation the host implements: the guest sees it as an ordinary
/// POSIX directory tree at the path it is mounted on, and never sees a host path.
///
/// The shape is the kernel's own (inode numbers, lookups, open handles), so an implementation
/// can keep stable inode numbers, hard links and open-but-unlinked files right. Names are single
/// path components: never empty, never `.` or `..`, never containing `/` or NUL, at most 255
/// bytes (checked before a call reaches the implementation).
///
/// Every operation is async and returns errors as values ([`FsError`], an errno the guest's call
/// returns). An operation an implementation does not provide keeps its default, which fails with
/// `ENOSYS` (or, for extended attributes, `EOPNOTSUPP`): the guest's call fails at once, nothing
/// hangs. Permission checks are the guest kernel's (from the modes and owners an implementation
/// reports); [`Caller`] says who creates a file so that the implementation can own it.
///
/// Calls may run concurrently, also on the same inode: an implementation synchronises itself.
///
/// A call is first polled by the task that serves its mount (most calls are answered without
/// waiting, and a task each would cost them more than their work); only if it returns
/// `Pending` does it get a task of its own. So a call must not block its thread: one that
/// does holds up every request of its mount meanwhile (and, unless it is in `block_in_place`,
/// the runtime's other tasks on that thread). Make blocking work on tokio's blocking pool
/// (`spawn_blocking`, or `block_in_place` after a first `yield_now().await`), as
/// [`HostDir`](super::HostDir) does for its large writes; it makes a small write in
/// `block_in_place` without yielding, holding its mount for the write's microseconds.
///
/// # Example
///
/// A read-only filesystem of one file:
///
/// ```
/// use std::ffi::OsStr;
/// use std::time::SystemTime;
/// use krunbox::fs::*;
///
/// struct Hello;
///
/// const FILE: InodeId = InodeId(2);
/// const TEXT: &[u8] = b"hello from the host\n";
///
/// fn attr(ino: InodeId) -> Attr {
///     let (kind, perm, size) = if ino == InodeId::ROOT {
///         (FileKind::Directory, 0o555, 0)
///     } else {
///         (FileKind::File, 0o444, TEXT.len() as u64)
///     };
///     let t = SystemTime::UNIX_EPOCH;
///     Attr { ino, kind, perm, nlink: 1, uid: 0, gid: 0, size, blocks: 0,
///            atime: t, mtime: t, ctime: t, rdev: 0 }
/// }
///
/// #[krunbox::fs::async_trait]
/// impl VirtualFs for Hello {
///     async fn lookup(&self, parent: InodeId, name: &OsStr) -> FsResult<Entry> {
///         if parent == InodeId::ROOT && name == "hello.txt" {
///             Ok(Entry { attr: attr(FILE), generation: 0 })
///         } else {
///             Err(FsError::NOT_FOUND)
///         }
///     }
///     async fn getattr(&self, ino: InodeId) -> FsResult<Attr> {
///         Ok(attr(ino))
///     }
///     async fn readdir(&self, ino: InodeId, _fh: FileHandle, offset: u64) -> FsResult<Vec<DirEntry>> {
///         let all = [DirEntry { ino: FILE, offset: 1, kind: FileKind::File, name: "hello.txt".into() }];
///         Ok(all.into_iter().skip(offset as usize).collect())
///     }
///     async fn open(&self, _ino: InodeId, _flags: OpenFlags) -> FsResult<FileHandle> {
///         Ok(FileHandle(0))
///     }
///     async fn read(&self, _ino: InodeId, _fh: FileHandle, offset: u64, size: u32) -> FsResult<Vec<u8>> {
///         let start = (offset as usize).min(TEXT.len());
///         let end = (start + size as usize).min(TEXT.len());
///         Ok(TEXT[start..end].to_vec())
///     }
/// }
/// ```
#[async_trait::async_trait]
pub trait VirtualFs: Send + Sync + 'static {
    /// Finds `name` in the directory `parent`. Each successful lookup (and each `create`,
    /// `mkdir`, `mknod`, `symlink`, `link`) counts one reference the guest holds on the inode,
    /// given back by [`forget`](Self::forget).
    async fn lookup(&self, parent: InodeId, name: &OsStr) -> FsResult<Entry>;

    /// The guest dropped `count` references to `ino` (see [`lookup`](Self::lookup)). When an
    /// inode has no links and no references left, its storage can go. The default forgets
    /// nothing.
    async fn forget(&self, ino: InodeId, count: u64) {
        let _ = (ino, count);
    }

    /// An inode's attributes.
    async fn getattr(&self, ino: InodeId) -> FsResult<Attr>;

    /// Changes an inode's attributes (`chmod`, `chown`, `truncate`, `utimes`) and returns the
    /// new ones.
    async fn setattr(&self, ino: InodeId, change: SetAttr, caller: Caller) -> FsResult<Attr> {
        let _ = (ino, change, caller);
        Err(FsError::UNSUPPORTED)
    }

    /// A symlink's target.
    async fn readlink(&self, ino: InodeId) -> FsResult<Vec<u8>> {
        let _ = ino;
        Err(FsError::UNSUPPORTED)
    }

    /// Makes a file that is not a directory or a symlink (regular, fifo, socket, device).
    /// `mode` holds the kind's `S_IFMT` bits and the permission bits (umask applied).
    async fn mknod(
        &self,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> FsResult<Entry> {
        let _ = (parent, name, mode, rdev, caller);
        Err(FsError::UNSUPPORTED)
    }

    /// Makes a directory with permission bits `mode` (umask applied).
    async fn mkdir(
        &self,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        caller: Caller,
    ) -> FsResult<Entry> {
        let _ = (parent, name, mode, caller);
        Err(FsError::UNSUPPORTED)
    }

    /// Removes a name that is not a directory.
    async fn unlink(&self, parent: InodeId, name: &OsStr) -> FsResult<()> {
        let _ = (parent, name);
        Err(FsError::UNSUPPORTED)
    }

    /// Removes an empty directory.
    async fn rmdir(&self, parent: InodeId, name: &OsStr) -> FsResult<()> {
        let _ = (parent, name);
        Err(FsError::UNSUPPORTED)
    }

    /// Makes a symlink `name` whose target is `target` (any bytes but NUL; not resolved here).
    async fn symlink(
        &self,
        parent: InodeId,
        name: &OsStr,
        target: &OsStr,
        caller: Caller,
    ) -> FsResult<Entry> {
        let _ = (parent, name, target, caller);
        Err(FsError::UNSUPPORTED)
    }

    /// Renames `parent/name` to `new_parent/new_name`, atomically. Without flags an existing
    /// target is replaced (a directory only by an empty directory). An implementation that
    /// cannot honour a flag fails with `EINVAL`.
    async fn rename(
        &self,
        parent: InodeId,
        name: &OsStr,
        new_parent: InodeId,
        new_name: &OsStr,
        flags: RenameFlags,
    ) -> FsResult<()> {
        let _ = (parent, name, new_parent, new_name, flags);
        Err(FsError::UNSUPPORTED)
    }

    /// Makes `new_parent/new_name` another name of `ino` (not a directory).
    async fn link(&self, ino: InodeId, new_parent: InodeId, new_name: &OsStr) -> FsResult<Entry> {
        let _ = (ino, new_parent, new_name);
        Err(FsError::UNSUPPORTED)
    }

    /// Opens a file. `O_CREAT` and `O_EXCL` never reach this (see [`create`](Self::create));
    /// `O_TRUNC` does.
    async fn open(&self, ino: InodeId, flags: OpenFlags) -> FsResult<FileHandle> {
        let _ = (ino, flags);
        Err(FsError::UNSUPPORTED)
    }

    /// Creates and opens a regular file `name` with permission bits `mode` (umask applied).
    async fn create(
        &self,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        flags: OpenFlags,
        caller: Caller,
    ) -> FsResult<(Entry, FileHandle)> {
        let _ = (parent, name, mode, flags, caller);
        Err(FsError::UNSUPPORTED)
    }

    /// Reads up to `size` bytes at `offset`; fewer only at the end of the file.
    async fn read(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
        size: u32,
    ) -> FsResult<Vec<u8>> {
        let _ = (ino, handle, offset, size);
        Err(FsError::UNSUPPORTED)
    }

    /// Writes `data` at `offset` and returns how many bytes were written (all of them, unless
    /// the filesystem is full).
    async fn write(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
        data: &[u8],
    ) -> FsResult<u32> {
        let _ = (ino, handle, offset, data);
        Err(FsError::UNSUPPORTED)
    }

    /// Writes `data` at `offset`, as [`write`](VirtualFs::write) does, given the bytes where
    /// the guest put them: every write of the guest's arrives here. The default copies them
    /// into a buffer (where they are not in one already) and calls `write`.
    ///
    /// Implement it to save that copy: when the library serves a mount's queues, the data is
    /// still in guest memory, and [`WriteData::copy_to`] copies any part of it straight to
    /// where it goes.
    ///
    /// ```
    /// use krunbox::fs::{FileHandle, FsError, FsResult, InodeId, VirtualFs, WriteData};
    /// # use std::sync::Mutex;
    ///
    /// /// One file of at most 4 KiB, written in place.
    /// struct Page(Mutex<[u8; 4096]>);
    ///
    /// #[krunbox::fs::async_trait]
    /// impl VirtualFs for Page {
    /// #   async fn lookup(&self, _: InodeId, _: &std::ffi::OsStr) -> FsResult<krunbox::fs::Entry> {
    /// #       Err(FsError::NOT_FOUND)
    /// #   }
    /// #   async fn getattr(&self, _: InodeId) -> FsResult<krunbox::fs::Attr> { Err(FsError::NOT_FOUND) }
    /// #   async fn readdir(&self, _: InodeId, _: FileHandle, _: u64) -> FsResult<Vec<krunbox::fs::DirEntry>> {
    /// #       Ok(Vec::new())
    /// #   }
    ///     async fn write_data(
    ///         &self,
    ///         _ino: InodeId,
    ///         _handle: FileHandle,
    ///         offset: u64,
    ///         data: WriteData<'_>,
    ///     ) -> FsResult<u32> {
    ///         let mut page = self.0.lock().unwrap();
    ///         let start = usize::try_from(offset).map_err(|_| FsError::NO_SPACE)?;
    ///         let end = start.checked_add(data.len()).ok_or(FsError::NO_SPACE)?;
    ///         let target = page.get_mut(start..end).ok_or(FsError::NO_SPACE)?;
    ///         data.copy_to(0, target)?;
    ///         Ok(data.len() as u32)
    ///     }
    /// }
    /// ```
    async fn write_data(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
        data: WriteData<'_>,
    ) -> FsResult<u32> {
        match data.as_bytes() {
            Some(bytes) => self.write(ino, handle, offset, bytes).await,
            None => {
                let bytes = data.to_vec()?;
                self.write(ino, handle, offset, &bytes).await
            }
        }
    }

    /// A descriptor of the open file was closed (`close(2)`); the file stays open while others
    /// remain.
    ///
    /// The default fails with `ENOSYS`, which tells the guest kernel that this filesystem needs
    /// no flush: from then on every `close(2)` in the guest succeeds without a round trip to
    /// the host (a shell's `cmd > file` closes twice). Implement it only when a close must
    /// reach the filesystem, for example to report a write it deferred; an error returned here
    /// is what the guest's `close(2)` returns.
    async fn flush(&self, ino: InodeId, handle: FileHandle) -> FsResult<()> {
        let _ = (ino, handle);
        Err(FsError::UNSUPPORTED)
    }

    /// The last reference to the open file is gone: its handle is never used again.
    async fn release(&self, ino: InodeId, handle: FileHandle) -> FsResult<()> {
        let _ = (ino, handle);
        Ok(())
    }

    /// Makes the file's data (and, unless `data_only`, its metadata) durable; also called for
    /// a directory (`handle` then is the directory's).
    ///
    /// The default fails with `ENOSYS`: right for a filesystem with nothing durable behind it.
    /// The guest kernel takes it to mean that there is nothing to sync, so the guest's `fsync(2)`
    /// succeeds, and it stops asking (one flag for files, one for directories).
    async fn fsync(&self, ino: InodeId, handle: FileHandle, data_only: bool) -> FsResult<()> {
        let _ = (ino, handle, data_only);
        Err(FsError::UNSUPPORTED)
    }

    /// Allocates space for `length` bytes at `offset` of an open file (`fallocate(2)`,
    /// `posix_fallocate(3)`), so that writes there do not fail for want of space. `mode` is the
    /// guest's: 0 grows the size to cover the range, `libc::FALLOC_FL_KEEP_SIZE` keeps it; a
    /// mode an implementation does not support fails with `EOPNOTSUPP`. The range is checked
    /// first (`length` > 0, the end within `i64::MAX`).
    ///
    /// The default fails with `ENOSYS`: the guest's `fallocate(2)` then fails with
    /// `EOPNOTSUPP`, and its kernel stops asking.
    async fn fallocate(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
    ) -> FsResult<()> {
        let _ = (ino, handle, offset, length, mode);
        Err(FsError::UNSUPPORTED)
    }

    /// Opens a directory for listing. The default hands out handle 0.
    async fn opendir(&self, ino: InodeId) -> FsResult<FileHandle> {
        let _ = ino;
        Ok(FileHandle(0))
    }

    /// Lists a directory from the entry after the cookie `offset` (0: from the start). Return
    /// as many entries as is convenient; an empty list means the end. Each entry's
    /// [`DirEntry::offset`] resumes after it.
    async fn readdir(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
    ) -> FsResult<Vec<DirEntry>>;

    /// The directory handle is never used again.
    async fn releasedir(&self, ino: InodeId, handle: FileHandle) -> FsResult<()> {
        let _ = (ino, handle);
        Ok(())
    }

    /// Filesystem-wide numbers. The default reports an empty filesystem with 255-byte names.
    async fn statfs(&self) -> FsResult<StatFs> {
        Ok(StatFs {
            blocks: 0,
            blocks_free: 0,
            blocks_available: 0,
            files: 0,
            files_free: 0,
            block_size: 4096,
            name_max: 255,
        })
    }

    /// An extended attribute's value.
    async fn getxattr(&self, ino: InodeId, name: &OsStr) -> FsResult<Vec<u8>> {
        let _ = (ino, name);
        Err(FsError::NOT_SUPPORTED)
    }

    /// Sets an extended attribute. `flags` is `XATTR_CREATE`, `XATTR_REPLACE` or 0.
    async fn setxattr(&self, ino: InodeId, name: &OsStr, value: &[u8], flags: i32) -> FsResult<()> {
        let _ = (ino, name, value, flags);
        Err(FsError::NOT_SUPPORTED)
    }

    /// The names of an inode's extended attributes.
    async fn listxattr(&self, ino: InodeId) -> FsResult<Vec<Vec<u8>>> {
        let _ = ino;
        Err(FsError::NOT_SUPPORTED)
    }

    /// Removes an extended attribute.
    async fn removexattr(&self, ino: InodeId, name: &OsStr) -> FsResult<()> {
        let _ = (ino, name);
        Err(FsError::NOT_SUPPORTED)
    }
}
