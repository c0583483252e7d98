//! Filesystems addressed by paths: [`PathFs`], and [`ByPath`], which serves one as a
//! [`VirtualFs`] (which the guest's kernel drives by inode numbers).
//!
//! Implementations that think in paths (a binding's filesystem written in Python or
//! TypeScript, a key-value store, a remote tree) implement the few methods of `PathFs`;
//! `ByPath` keeps the inode table between them (bounded), a listing per open directory (so a
//! reader removing entries as it goes, like `rm -r`, still sees each name once), and the
//! checks the kernel's requests need.

mod inodes;

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use async_trait::async_trait;

use super::{
    Attr, Caller, DirEntry, Entry, FileHandle, FileKind, FsError, FsResult, InodeId, OpenFlags,
    RenameFlags, SetAttr, VirtualFs,
};
use inodes::{join, listed_ino, Inodes};

/// The most names one `list_dir` may give (as the library's own `read_dir` bounds them).
pub const MAX_LISTED: usize = 65_536;
/// The most directories the guest may hold open at once on one mount (each keeps its listing
/// until it is closed).
const MAX_OPEN_DIRS: usize = 1024;
/// The most entries one `readdir` answers (each is a `stat` call): the kernel asks again from
/// where it stopped.
const PAGE: usize = 128;
/// The most inodes the guest's kernel may hold at once on one mount (each one path in the
/// table); a lookup past it fails with `ENFILE` until the kernel forgets some.
pub const MAX_INODES: usize = 1 << 18;

/// What [`PathFs::stat`] says about a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathStat {
    /// File, directory or symlink.
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (e.g. `0o644`).
    pub mode: u32,
    /// Owner's user id, as the guest sees it.
    pub uid: u32,
    /// Owner's group id.
    pub gid: u32,
    /// Last modification.
    pub mtime: SystemTime,
}

impl PathStat {
    /// A `kind` of `size` bytes, mode 0o755 for a directory and 0o644 otherwise, owned by
    /// root, modified at the epoch.
    pub fn new(kind: FileKind, size: u64) -> Self {
        PathStat {
            kind,
            size,
            mode: if kind == FileKind::Directory {
                0o755
            } else {
                0o644
            },
            uid: 0,
            gid: 0,
            mtime: SystemTime::UNIX_EPOCH,
        }
    }

    fn attr(&self, ino: InodeId) -> Attr {
        Attr {
            ino,
            kind: self.kind,
            perm: self.mode & 0o7777,
            nlink: if self.kind == FileKind::Directory {
                2
            } else {
                1
            },
            uid: self.uid,
            gid: self.gid,
            size: self.size,
            blocks: self.size.div_ceil(512),
            atime: self.mtime,
            mtime: self.mtime,
            ctime: self.mtime,
            rdev: 0,
        }
    }
}

/// A filesystem addressed by absolute paths (`/`, `/notes/a.txt`): what a guest does with its
/// mount, one path at a time. Only [`stat`](PathFs::stat), [`list_dir`](PathFs::list_dir) and
/// [`read`](PathFs::read) are required; every other method is refused with `ENOSYS` unless
/// implemented (mount it read-only to have them refused with `EROFS`). Serve one with
/// [`ByPath`].
///
/// ```
/// use krunbox::fs::{async_trait, ByPath, FileKind, FsError, FsResult, PathFs, PathStat};
///
/// /// One read-only file, `/motd`.
/// struct Motd;
///
/// #[async_trait]
/// impl PathFs for Motd {
///     async fn stat(&self, path: &str) -> FsResult<PathStat> {
///         match path {
///             "/" => Ok(PathStat::new(FileKind::Directory, 0)),
///             "/motd" => Ok(PathStat::new(FileKind::File, 6)),
///             _ => Err(FsError::NOT_FOUND),
///         }
///     }
///     async fn list_dir(&self, _path: &str) -> FsResult<Vec<String>> {
///         Ok(vec!["motd".into()])
///     }
///     async fn read(&self, _path: &str, offset: u64, size: u32) -> FsResult<Vec<u8>> {
///         let text = b"hello\n";
///         let start = (offset as usize).min(text.len());
///         Ok(text[start..].iter().take(size as usize).copied().collect())
///     }
/// }
///
/// let sandbox = krunbox::Sandbox::builder().mount("/etc/motd.d", ByPath::new(Motd));
/// ```
#[async_trait]
pub trait PathFs: Send + Sync + 'static {
    /// What is at `path` (not following a symlink there).
    async fn stat(&self, path: &str) -> FsResult<PathStat>;
    /// The names in the directory `path` (without `.` and `..`), at most [`MAX_LISTED`].
    async fn list_dir(&self, path: &str) -> FsResult<Vec<String>>;
    /// Up to `size` bytes of the file `path` from `offset` (fewer at its end).
    async fn read(&self, path: &str, offset: u64, size: u32) -> FsResult<Vec<u8>>;
    /// Writes `data` into the file `path` at `offset`; returns how many bytes it wrote.
    async fn write(&self, path: &str, offset: u64, data: &[u8]) -> FsResult<u32> {
        let _ = (path, offset, data);
        Err(FsError::UNSUPPORTED)
    }
    /// Makes an empty file at `path` with permission bits `mode`.
    async fn create(&self, path: &str, mode: u32) -> FsResult<()> {
        let _ = (path, mode);
        Err(FsError::UNSUPPORTED)
    }
    /// Makes a directory at `path`.
    async fn make_dir(&self, path: &str, mode: u32) -> FsResult<()> {
        let _ = (path, mode);
        Err(FsError::UNSUPPORTED)
    }
    /// Removes the file (or symlink) `path`.
    async fn remove(&self, path: &str) -> FsResult<()> {
        let _ = path;
        Err(FsError::UNSUPPORTED)
    }
    /// Removes the empty directory `path` (`ENOTEMPTY` otherwise).
    async fn remove_dir(&self, path: &str) -> FsResult<()> {
        let _ = path;
        Err(FsError::UNSUPPORTED)
    }
    /// Moves `from` (and everything under it) to `to`, replacing what is there.
    async fn rename(&self, from: &str, to: &str) -> FsResult<()> {
        let _ = (from, to);
        Err(FsError::UNSUPPORTED)
    }
    /// Cuts or extends the file `path` to `size` bytes.
    async fn truncate(&self, path: &str, size: u64) -> FsResult<()> {
        let _ = (path, size);
        Err(FsError::UNSUPPORTED)
    }
    /// The target of the symlink `path`.
    async fn read_link(&self, path: &str) -> FsResult<String> {
        let _ = path;
        Err(FsError::UNSUPPORTED)
    }
}

/// A [`PathFs`] served as a [`VirtualFs`], to mount.
pub struct ByPath<F: PathFs> {
    fs: F,
    inodes: Mutex<Inodes>,
    /// Each open directory's listing, taken when it was opened.
    listings: Mutex<HashMap<u64, Arc<Vec<String>>>>,
    next_handle: AtomicU64,
}

impl<F: PathFs> ByPath<F> {
    /// `fs`, ready to mount.
    pub fn new(fs: F) -> Self {
        ByPath {
            fs,
            inodes: Mutex::new(Inodes::new(MAX_INODES)),
            listings: Mutex::new(HashMap::new()),
            next_handle: AtomicU64::new(1),
        }
    }

    /// The filesystem it serves.
    pub fn get_ref(&self) -> &F {
        &self.fs
    }

    fn inodes(&self) -> MutexGuard<'_, Inodes> {
        self.inodes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn listings(&self) -> MutexGuard<'_, HashMap<u64, Arc<Vec<String>>>> {
        self.listings.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The path of `ino`: `ENOENT` once it was removed (or for an inode never handed out).
    fn path(&self, ino: InodeId) -> FsResult<String> {
        self.inodes().path(ino).ok_or(FsError::NOT_FOUND)
    }

    fn child(&self, parent: InodeId, name: &OsStr) -> FsResult<String> {
        let name = name.to_str().ok_or(FsError::INVALID)?;
        Ok(join(&self.path(parent)?, name))
    }

    /// The names in `path`, checked against the bound.
    async fn list(&self, path: &str) -> FsResult<Vec<String>> {
        let names = self.fs.list_dir(path).await?;
        if names.len() > MAX_LISTED {
            return Err(FsError::IO);
        }
        Ok(names)
    }

    /// Looks `path` up: its attributes under an inode the kernel now holds one more of.
    async fn entry(&self, path: String) -> FsResult<Entry> {
        let stat = self.fs.stat(&path).await?;
        let ino = self
            .inodes()
            .remember(&path)
            .ok_or(FsError::from_errno(libc::ENFILE))?;
        Ok(Entry {
            attr: stat.attr(ino),
            generation: 0,
        })
    }
}

#[async_trait]
impl<F: PathFs> VirtualFs for ByPath<F> {
    async fn lookup(&self, parent: InodeId, name: &OsStr) -> FsResult<Entry> {
        let path = self.child(parent, name)?;
        self.entry(path).await
    }

    async fn forget(&self, ino: InodeId, count: u64) {
        self.inodes().forget(ino, count);
    }

    async fn getattr(&self, ino: InodeId) -> FsResult<Attr> {
        let path = self.path(ino)?;
        Ok(self.fs.stat(&path).await?.attr(ino))
    }

    async fn setattr(&self, ino: InodeId, change: SetAttr, _caller: Caller) -> FsResult<Attr> {
        let path = self.path(ino)?;
        if let Some(size) = change.size {
            self.fs.truncate(&path, size).await?;
        }
        // Modes, owners and times are the filesystem's to report, not the guest's to set.
        Ok(self.fs.stat(&path).await?.attr(ino))
    }

    async fn readlink(&self, ino: InodeId) -> FsResult<Vec<u8>> {
        let path = self.path(ino)?;
        Ok(self.fs.read_link(&path).await?.into_bytes())
    }

    async fn mkdir(
        &self,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        _caller: Caller,
    ) -> FsResult<Entry> {
        let path = self.child(parent, name)?;
        self.fs.make_dir(&path, mode & 0o7777).await?;
        self.entry(path).await
    }

    async fn create(
        &self,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        _flags: OpenFlags,
        _caller: Caller,
    ) -> FsResult<(Entry, FileHandle)> {
        let path = self.child(parent, name)?;
        self.fs.create(&path, mode & 0o7777).await?;
        Ok((self.entry(path).await?, FileHandle(0)))
    }

    async fn unlink(&self, parent: InodeId, name: &OsStr) -> FsResult<()> {
        let path = self.child(parent, name)?;
        self.fs.remove(&path).await?;
        self.inodes().removed(&path);
        Ok(())
    }

    async fn rmdir(&self, parent: InodeId, name: &OsStr) -> FsResult<()> {
        let path = self.child(parent, name)?;
        self.fs.remove_dir(&path).await?;
        self.inodes().removed(&path);
        Ok(())
    }

    async fn rename(
        &self,
        parent: InodeId,
        name: &OsStr,
        new_parent: InodeId,
        new_name: &OsStr,
        flags: RenameFlags,
    ) -> FsResult<()> {
        if flags.exchange {
            return Err(FsError::INVALID);
        }
        let (from, to) = (self.child(parent, name)?, self.child(new_parent, new_name)?);
        // No replacing (`mv` asks so first): refused if the destination is there. Not atomic
        // against the host changing the tree meanwhile; the guest's kernel holds the
        // directories' locks against its own processes.
        if flags.no_replace {
            match self.fs.stat(&to).await {
                Ok(_) => return Err(FsError::EXISTS),
                Err(e) if e == FsError::NOT_FOUND => {}
                Err(e) => return Err(e),
            }
        }
        self.fs.rename(&from, &to).await?;
        self.inodes().rename(&from, &to);
        Ok(())
    }

    async fn open(&self, ino: InodeId, flags: OpenFlags) -> FsResult<FileHandle> {
        let path = self.path(ino)?;
        if flags.truncate() {
            self.fs.truncate(&path, 0).await?;
        }
        Ok(FileHandle(0))
    }

    async fn read(
        &self,
        ino: InodeId,
        _handle: FileHandle,
        offset: u64,
        size: u32,
    ) -> FsResult<Vec<u8>> {
        let path = self.path(ino)?;
        let mut data = self.fs.read(&path, offset, size).await?;
        // More than was asked for is cut: the guest asked for `size`.
        data.truncate(size as usize);
        Ok(data)
    }

    async fn write(
        &self,
        ino: InodeId,
        _handle: FileHandle,
        offset: u64,
        data: &[u8],
    ) -> FsResult<u32> {
        let path = self.path(ino)?;
        let wrote = self.fs.write(&path, offset, data).await?;
        Ok(wrote.min(data.len() as u32))
    }

    async fn flush(&self, _ino: InodeId, _handle: FileHandle) -> FsResult<()> {
        Ok(())
    }

    async fn fsync(&self, _ino: InodeId, _handle: FileHandle, _data_only: bool) -> FsResult<()> {
        Ok(())
    }

    async fn opendir(&self, ino: InodeId) -> FsResult<FileHandle> {
        let names = self.list(&self.path(ino)?).await?;
        let mut listings = self.listings();
        if listings.len() >= MAX_OPEN_DIRS {
            return Err(FsError::from_errno(libc::EMFILE));
        }
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        listings.insert(handle, Arc::new(names));
        Ok(FileHandle(handle))
    }

    async fn releasedir(&self, _ino: InodeId, handle: FileHandle) -> FsResult<()> {
        self.listings().remove(&handle.0);
        Ok(())
    }

    async fn readdir(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
    ) -> FsResult<Vec<DirEntry>> {
        let path = self.path(ino)?;
        let listed = self.listings().get(&handle.0).cloned();
        let names = match listed {
            Some(names) => names,
            None => Arc::new(self.list(&path).await?),
        };
        let mut entries = Vec::new();
        for (index, name) in names.iter().enumerate().skip(offset as usize) {
            if entries.len() == PAGE {
                break;
            }
            if name.is_empty() || name.contains(['/', '\0']) || name == "." || name == ".." {
                continue;
            }
            let child = join(&path, name);
            let known = self.inodes().existing(&child);
            let kind = match self.fs.stat(&child).await {
                Ok(stat) => stat.kind,
                Err(_) => continue, // gone since it was listed
            };
            entries.push(DirEntry {
                ino: known.unwrap_or_else(|| listed_ino(&child)),
                offset: index as u64 + 1,
                kind,
                name: name.into(),
            });
        }
        Ok(entries)
    }
}
