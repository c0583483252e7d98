//! `MemoryFs`: a filesystem in host memory, shared by the guest (through
//! [`VirtualFs`]) and the host program (through paths).
//!
//! `tree.rs` is the filesystem itself (inodes, names, handles, accounting; `tree/ops.rs` its
//! operations on attributes, file contents, listings and extended attributes), `data.rs` a
//! regular file's bytes; this file is the public face: the host's path API and the trait, each
//! call one short critical section under one lock (never held across an await).

mod data;
#[cfg(test)]
mod tests;
mod tree;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use self::data::FileData;
use self::tree::{Limits, NewNode, Tree};
use super::types::*;
use super::{VirtualFs, WriteData};

/// A POSIX filesystem held in host memory: mount it in a sandbox, seed it before the boot, read
/// what the guest wrote while it runs or after, change files the guest then sees.
///
/// Clones share one filesystem (keep a clone, mount another). Everything the guest can make it
/// allocate is counted and bounded ([`with_limits`](Self::with_limits)): past a bound its calls
/// fail with `ENOSPC` and host memory stops growing. Inode numbers are never reused; an unlinked
/// file stays readable and writable through the handles open on it, and its memory goes with the
/// last of them.
///
/// The guest sees what the host changes once its cache of the name or attributes expires
/// ([`MountOptions::cache`](super::MountOptions::cache), one second by default). The host's
/// calls take absolute paths within the filesystem (`"/src/main.py"`) and never follow a
/// symlink; what they make is owned by 0:0 (files `0o644`, directories `0o755`).
///
/// Device nodes (`mknod` of a character or block device) are stored like any other file, with
/// their device numbers: they mean nothing on the host, and in the guest they are the guest's
/// own devices, which its root could reach anyway.
///
/// ```
/// use krunbox::fs::MemoryFs;
///
/// let fs = MemoryFs::new();
/// fs.write_file("/project/README", b"hello\n")?;
/// let other = fs.clone(); // the same filesystem
/// assert_eq!(other.read_file("/project/README")?, b"hello\n");
/// assert_eq!(other.read_dir("/")?, ["project"]);
/// # Ok::<(), krunbox::fs::FsError>(())
/// ```
#[derive(Clone)]
pub struct MemoryFs {
    tree: Arc<Mutex<Tree>>,
}

impl MemoryFs {
    /// The default bound on bytes ([`new`](Self::new)): 1 GiB of file data, symlink targets,
    /// names and extended attributes together.
    ///
    /// ```
    /// assert_eq!(krunbox::fs::MemoryFs::DEFAULT_MAX_BYTES, 1 << 30);
    /// ```
    pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;

    /// The default bound on inodes ([`new`](Self::new)): a million files, directories and
    /// symlinks, the root included.
    ///
    /// ```
    /// assert_eq!(krunbox::fs::MemoryFs::DEFAULT_MAX_INODES, 1_000_000);
    /// ```
    pub const DEFAULT_MAX_INODES: u64 = 1_000_000;

    /// The largest file: 1 TiB. Writing or truncating past it fails with `EFBIG`. Holes cost
    /// nothing, so a sparse file can be this large within a small byte bound.
    ///
    /// ```
    /// assert_eq!(krunbox::fs::MemoryFs::MAX_FILE_SIZE, 1 << 40);
    /// ```
    pub const MAX_FILE_SIZE: u64 = 1 << 40;

    /// The most files and directories open at once (handles the guest has not released);
    /// one more fails with `ENFILE`.
    ///
    /// ```
    /// assert_eq!(krunbox::fs::MemoryFs::MAX_OPEN_HANDLES, 65_536);
    /// ```
    pub const MAX_OPEN_HANDLES: usize = 65_536;

    /// The largest extended attribute value, as Linux's (`E2BIG` past it).
    ///
    /// ```
    /// assert_eq!(krunbox::fs::MemoryFs::MAX_XATTR_VALUE, 64 * 1024);
    /// ```
    pub const MAX_XATTR_VALUE: usize = 64 * 1024;

    /// The most extended attributes on one inode (`ENOSPC` past it).
    ///
    /// ```
    /// assert_eq!(krunbox::fs::MemoryFs::MAX_XATTRS, 128);
    /// ```
    pub const MAX_XATTRS: usize = 128;

    /// An empty filesystem (a root directory `0o755` owned by 0:0) with the default bounds,
    /// [`DEFAULT_MAX_BYTES`](Self::DEFAULT_MAX_BYTES) and
    /// [`DEFAULT_MAX_INODES`](Self::DEFAULT_MAX_INODES).
    ///
    /// ```
    /// let fs = krunbox::fs::MemoryFs::new();
    /// let root = fs.metadata("/").unwrap();
    /// assert_eq!((root.perm, root.uid, root.gid), (0o755, 0, 0));
    /// ```
    pub fn new() -> Self {
        Self::with_limits(Self::DEFAULT_MAX_BYTES, Self::DEFAULT_MAX_INODES)
    }

    /// An empty filesystem holding at most `max_bytes` and at most `max_inodes` inodes (the
    /// root included). Bytes are counted as allocated: file data by its buffers (holes are
    /// free) plus 64 bytes per 64 KiB chunk, symlink targets, extended attributes (name and
    /// value plus 64 bytes each) and directory entries (name plus 128 bytes each). The host's
    /// own calls count too. Host memory stays within about `max_bytes` plus 300 bytes per
    /// inode. `statfs` in the guest (`df`) reports both bounds and what is used.
    ///
    /// ```
    /// use krunbox::fs::{FsError, MemoryFs};
    ///
    /// let fs = MemoryFs::with_limits(1024 * 1024, 100);
    /// fs.write_file("/small", &[1; 1000])?;
    /// assert_eq!(fs.write_file("/big", &[1; 2 * 1024 * 1024]), Err(FsError::NO_SPACE));
    /// # Ok::<(), FsError>(())
    /// ```
    pub fn with_limits(max_bytes: u64, max_inodes: u64) -> Self {
        MemoryFs {
            tree: Arc::new(Mutex::new(Tree::new(Limits {
                max_bytes,
                max_inodes,
            }))),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Tree> {
        // Nothing under the lock panics; if something did, the tree is still whole (every
        // change checks before it mutates), so a poisoned lock is taken as is.
        self.tree.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Writes a whole file, making it (`0o644`, owned by 0:0) and its missing parent
    /// directories, or replacing the contents of the file already there: the same file, so
    /// what the guest has open on it reads the new contents.
    ///
    /// Fails with `EINVAL` for a path that is not absolute or holds `..` or NUL, `EISDIR` for a
    /// directory, `ELOOP` for a symlink, `ENOTDIR` when a parent is not a directory, and
    /// `ENOSPC` past the filesystem's bounds.
    ///
    /// ```
    /// let fs = krunbox::fs::MemoryFs::new();
    /// fs.write_file("/a/b/c.txt", b"one")?;
    /// fs.write_file("/a/b/c.txt", b"two")?;
    /// assert_eq!(fs.read_file("/a/b/c.txt")?, b"two");
    /// # Ok::<(), krunbox::fs::FsError>(())
    /// ```
    pub fn write_file(&self, path: &str, bytes: &[u8]) -> FsResult<()> {
        let path = components(path)?;
        let Some((name, parents)) = path.split_last() else {
            return Err(FsError::IS_DIRECTORY);
        };
        if bytes.len() as u64 > Self::MAX_FILE_SIZE {
            return Err(FsError::TOO_BIG);
        }
        let mut data = FileData::default();
        if !bytes.is_empty() {
            data.write(0, bytes);
        }
        let mut tree = self.lock();
        let parent = tree.make_dirs(parents)?;
        match tree.child(parent, name) {
            Ok(ino) => tree.replace_data(ino, data),
            Err(FsError::NOT_FOUND) => tree
                .make(parent, name, NewNode::File(data), 0o644, Caller::default())
                .map(drop),
            Err(err) => Err(err),
        }
    }

    /// A file's whole contents, as they are now (the guest's writes included).
    ///
    /// Fails with `ENOENT` if there is no such file, `EISDIR` for a directory, `ELOOP` for a
    /// symlink, `EINVAL` for another kind of file or a bad path.
    ///
    /// ```
    /// use krunbox::fs::{FsError, MemoryFs};
    ///
    /// let fs = MemoryFs::new();
    /// fs.write_file("/notes", b"hi")?;
    /// assert_eq!(fs.read_file("/notes")?, b"hi");
    /// assert_eq!(fs.read_file("/missing"), Err(FsError::NOT_FOUND));
    /// # Ok::<(), FsError>(())
    /// ```
    pub fn read_file(&self, path: &str) -> FsResult<Vec<u8>> {
        let path = components(path)?;
        let tree = self.lock();
        let ino = tree.resolve(&path)?;
        tree.contents(ino)
    }

    /// Makes a directory and its missing parents (`0o755`, owned by 0:0); an existing
    /// directory is fine, an existing file of another kind fails with `EEXIST`.
    ///
    /// ```
    /// let fs = krunbox::fs::MemoryFs::new();
    /// fs.create_dir_all("/src/pkg")?;
    /// fs.create_dir_all("/src/pkg")?;
    /// assert!(fs.metadata("/src/pkg")?.kind == krunbox::fs::FileKind::Directory);
    /// # Ok::<(), krunbox::fs::FsError>(())
    /// ```
    pub fn create_dir_all(&self, path: &str) -> FsResult<()> {
        let path = components(path)?;
        let mut tree = self.lock();
        match tree.make_dirs(&path) {
            Ok(_) => Ok(()),
            // The path itself is there, as something else.
            Err(FsError::NOT_DIRECTORY) if tree.resolve(&path).is_ok() => Err(FsError::EXISTS),
            Err(err) => Err(err),
        }
    }

    /// Makes a symlink at `path` (and its missing parents) pointing at `target`, which is
    /// stored as given and never resolved by the host (the guest resolves it, in its own
    /// namespace). Fails with `EEXIST` if the name is taken.
    ///
    /// ```
    /// let fs = krunbox::fs::MemoryFs::new();
    /// fs.symlink("/bin/python", "/usr/bin/python3")?;
    /// let link = fs.metadata("/bin/python")?;
    /// assert_eq!(link.kind, krunbox::fs::FileKind::Symlink);
    /// assert_eq!(link.size, "/usr/bin/python3".len() as u64);
    /// # Ok::<(), krunbox::fs::FsError>(())
    /// ```
    pub fn symlink(&self, path: &str, target: &str) -> FsResult<()> {
        let path = components(path)?;
        tree::check_target(target.as_bytes())?;
        let Some((name, parents)) = path.split_last() else {
            return Err(FsError::EXISTS);
        };
        let mut tree = self.lock();
        let parent = tree.make_dirs(parents)?;
        let target = NewNode::Symlink(target.as_bytes().into());
        tree.make(parent, name, target, 0o777, Caller::default())
            .map(drop)
    }

    /// Removes a file, a symlink or an empty directory (`ENOTEMPTY` otherwise). What the guest
    /// has open on a removed file keeps working until it closes it.
    ///
    /// ```
    /// use krunbox::fs::{FsError, MemoryFs};
    ///
    /// let fs = MemoryFs::new();
    /// fs.write_file("/dir/file", b"x")?;
    /// assert_eq!(fs.remove("/dir"), Err(FsError::NOT_EMPTY));
    /// fs.remove("/dir/file")?;
    /// fs.remove("/dir")?;
    /// assert!(fs.read_dir("/")?.is_empty());
    /// # Ok::<(), FsError>(())
    /// ```
    pub fn remove(&self, path: &str) -> FsResult<()> {
        let path = components(path)?;
        let Some((name, parents)) = path.split_last() else {
            return Err(FsError::from_errno(libc::EBUSY));
        };
        let mut tree = self.lock();
        let parent = tree.resolve(parents)?;
        let ino = tree.child(parent, name)?;
        let directory = tree.getattr(ino)?.kind == FileKind::Directory;
        tree.remove(parent, name, directory)
    }

    /// The names in a directory, sorted (without `.` and `..`; a name that is not UTF-8 comes
    /// back with U+FFFD in place of its bad bytes).
    ///
    /// ```
    /// let fs = krunbox::fs::MemoryFs::new();
    /// fs.write_file("/b", b"")?;
    /// fs.write_file("/a", b"")?;
    /// assert_eq!(fs.read_dir("/")?, ["a", "b"]);
    /// # Ok::<(), krunbox::fs::FsError>(())
    /// ```
    pub fn read_dir(&self, path: &str) -> FsResult<Vec<String>> {
        let path = components(path)?;
        let names = {
            let tree = self.lock();
            let ino = tree.resolve(&path)?;
            tree.names(ino)?
        };
        let mut names: Vec<String> = names
            .iter()
            .map(|name| String::from_utf8_lossy(name).into_owned())
            .collect();
        names.sort_unstable();
        Ok(names)
    }

    /// A file's attributes, as the guest's `lstat` shows them (a symlink's own).
    ///
    /// ```
    /// let fs = krunbox::fs::MemoryFs::new();
    /// fs.write_file("/data.bin", &[0; 100])?;
    /// let attr = fs.metadata("/data.bin")?;
    /// assert_eq!((attr.size, attr.perm, attr.nlink), (100, 0o644, 1));
    /// # Ok::<(), krunbox::fs::FsError>(())
    /// ```
    pub fn metadata(&self, path: &str) -> FsResult<Attr> {
        let path = components(path)?;
        let tree = self.lock();
        let ino = tree.resolve(&path)?;
        tree.getattr(ino)
    }
}

impl Default for MemoryFs {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (used, inodes, limits) = {
            let tree = self.lock();
            (tree.used_bytes(), tree.inode_count(), tree.limits())
        };
        f.debug_struct("MemoryFs")
            .field("used_bytes", &used)
            .field("max_bytes", &limits.max_bytes)
            .field("inodes", &inodes)
            .field("max_inodes", &limits.max_inodes)
            .finish()
    }
}

/// A host path's components: absolute, no `..`, no NUL; empty and `.` components skipped.
fn components(path: &str) -> FsResult<Vec<&[u8]>> {
    if !path.starts_with('/') || path.contains('\0') {
        return Err(FsError::INVALID);
    }
    let mut names = Vec::new();
    for name in path.split('/') {
        match name {
            "" | "." => {}
            ".." => return Err(FsError::INVALID),
            _ => {
                tree::check_name(name.as_bytes())?;
                names.push(name.as_bytes());
            }
        }
    }
    Ok(names)
}

#[async_trait::async_trait]
impl VirtualFs for MemoryFs {
    async fn lookup(&self, parent: InodeId, name: &OsStr) -> FsResult<Entry> {
        self.lock().lookup(parent.0, name.as_bytes())
    }

    async fn forget(&self, ino: InodeId, count: u64) {
        self.lock().forget(ino.0, count)
    }

    async fn getattr(&self, ino: InodeId) -> FsResult<Attr> {
        self.lock().getattr(ino.0)
    }

    async fn setattr(&self, ino: InodeId, change: SetAttr, _caller: Caller) -> FsResult<Attr> {
        self.lock().setattr(ino.0, &change)
    }

    async fn readlink(&self, ino: InodeId) -> FsResult<Vec<u8>> {
        self.lock().readlink(ino.0)
    }

    async fn mknod(
        &self,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> FsResult<Entry> {
        self.lock()
            .mknod(parent.0, name.as_bytes(), mode, rdev, caller)
    }

    async fn mkdir(
        &self,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        caller: Caller,
    ) -> FsResult<Entry> {
        self.lock()
            .make_entry(parent.0, name.as_bytes(), NewNode::Dir, mode, caller)
    }

    async fn unlink(&self, parent: InodeId, name: &OsStr) -> FsResult<()> {
        self.lock().remove(parent.0, name.as_bytes(), false)
    }

    async fn rmdir(&self, parent: InodeId, name: &OsStr) -> FsResult<()> {
        self.lock().remove(parent.0, name.as_bytes(), true)
    }

    async fn symlink(
        &self,
        parent: InodeId,
        name: &OsStr,
        target: &OsStr,
        caller: Caller,
    ) -> FsResult<Entry> {
        self.lock()
            .symlink(parent.0, name.as_bytes(), target.as_bytes(), caller)
    }

    async fn rename(
        &self,
        parent: InodeId,
        name: &OsStr,
        new_parent: InodeId,
        new_name: &OsStr,
        flags: RenameFlags,
    ) -> FsResult<()> {
        self.lock().rename(
            parent.0,
            name.as_bytes(),
            new_parent.0,
            new_name.as_bytes(),
            flags,
        )
    }

    async fn link(&self, ino: InodeId, new_parent: InodeId, new_name: &OsStr) -> FsResult<Entry> {
        self.lock().link(ino.0, new_parent.0, new_name.as_bytes())
    }

    async fn open(&self, ino: InodeId, flags: OpenFlags) -> FsResult<FileHandle> {
        self.lock().open(ino.0, flags).map(FileHandle)
    }

    async fn create(
        &self,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        flags: OpenFlags,
        caller: Caller,
    ) -> FsResult<(Entry, FileHandle)> {
        self.lock()
            .create(parent.0, name.as_bytes(), mode, flags, caller)
            .map(|(entry, handle)| (entry, FileHandle(handle)))
    }

    async fn read(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
        size: u32,
    ) -> FsResult<Vec<u8>> {
        self.lock().read(ino.0, handle.0, offset, size)
    }

    async fn write(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
        data: &[u8],
    ) -> FsResult<u32> {
        self.write_data(ino, handle, offset, WriteData::from_bytes(data))
            .await
    }

    async fn write_data(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
        data: WriteData<'_>,
    ) -> FsResult<u32> {
        // Straight from guest memory into the file's chunks.
        self.lock().write(ino.0, handle.0, offset, data)
    }

    async fn release(&self, ino: InodeId, handle: FileHandle) -> FsResult<()> {
        self.lock().release(ino.0, handle.0, false)
    }

    async fn fallocate(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
    ) -> FsResult<()> {
        self.lock().fallocate(ino.0, handle.0, offset, length, mode)
    }

    // No flush and no fsync: every write is in memory when `write` returns, and memory is as
    // durable as this filesystem gets. The defaults' ENOSYS tells the guest kernel so, and it
    // stops sending either (a close and an fsync in the guest then cost no round trip).

    async fn opendir(&self, ino: InodeId) -> FsResult<FileHandle> {
        self.lock().opendir(ino.0).map(FileHandle)
    }

    async fn readdir(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
    ) -> FsResult<Vec<DirEntry>> {
        self.lock().readdir(ino.0, handle.0, offset)
    }

    async fn releasedir(&self, ino: InodeId, handle: FileHandle) -> FsResult<()> {
        self.lock().release(ino.0, handle.0, true)
    }

    async fn statfs(&self) -> FsResult<StatFs> {
        Ok(self.lock().statfs())
    }

    async fn getxattr(&self, ino: InodeId, name: &OsStr) -> FsResult<Vec<u8>> {
        self.lock().getxattr(ino.0, name.as_bytes())
    }

    async fn setxattr(&self, ino: InodeId, name: &OsStr, value: &[u8], flags: i32) -> FsResult<()> {
        self.lock().setxattr(ino.0, name.as_bytes(), value, flags)
    }

    async fn listxattr(&self, ino: InodeId) -> FsResult<Vec<Vec<u8>>> {
        self.lock().listxattr(ino.0)
    }

    async fn removexattr(&self, ino: InodeId, name: &OsStr) -> FsResult<()> {
        self.lock().removexattr(ino.0, name.as_bytes())
    }
}
