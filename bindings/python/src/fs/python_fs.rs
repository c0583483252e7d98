//! A filesystem written in Python (`krunbox.VirtualFs`, path-based) as the library's
//! `VirtualFs` (inode-based): the inode table maps between them, each operation calls the
//! object's method for it off tokio's workers. An `OSError` the method raises is its errno
//! to the guest; anything else is `EIO`, logged.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use krunbox::fs::{
    Attr, Caller, DirEntry, Entry, FileHandle, FileKind, FsError, FsResult, InodeId, OpenFlags,
    RenameFlags, SetAttr,
};
use pyo3::exceptions::{
    PyFileExistsError, PyFileNotFoundError, PyIsADirectoryError, PyNotADirectoryError,
    PyNotImplementedError, PyOSError, PyPermissionError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use super::inodes::{join, listed_ino, Inodes};
use super::Stat;
use crate::callback::{calls_bound, report, with_gil, Callable, EventLoop};

/// The most names one `list_dir` may return (as the library's own `read_dir` bounds them).
const MAX_LISTED: usize = 65_536;
/// The most directories the guest may hold open at once on one mount (each keeps its
/// listing until it is closed).
const MAX_OPEN_DIRS: usize = 1024;
/// The most entries one `readdir` answers (each is a `stat` call): the kernel asks again from
/// where it stopped.
const PAGE: usize = 128;

/// The object's methods, each `None` when it has none (the operation is then `ENOSYS`, or for
/// a read-only filesystem `EROFS`).
pub(crate) struct PythonFs {
    stat: Option<Arc<Callable>>,
    list_dir: Option<Arc<Callable>>,
    read: Option<Arc<Callable>>,
    write: Option<Arc<Callable>>,
    create: Option<Arc<Callable>>,
    make_dir: Option<Arc<Callable>>,
    remove: Option<Arc<Callable>>,
    remove_dir: Option<Arc<Callable>>,
    rename: Option<Arc<Callable>>,
    truncate: Option<Arc<Callable>>,
    read_link: Option<Arc<Callable>>,
    inodes: Mutex<Inodes>,
    /// Each open directory's listing, taken when it was opened: a reader that removes entries
    /// as it goes (`rm -r`) still sees every name once, in one order.
    listings: Mutex<HashMap<u64, Arc<Vec<String>>>>,
    next_handle: AtomicU64,
}

impl PythonFs {
    pub(crate) fn new(object: &Bound<'_, PyAny>, event_loop: &Arc<EventLoop>) -> Self {
        let calls = calls_bound();
        let method = |name: &str| {
            let function = object.getattr(name).ok()?;
            function.is_callable().then(|| {
                let callable = Callable::new(
                    function.unbind(),
                    Arc::clone(event_loop),
                    Arc::clone(&calls),
                );
                Arc::new(callable)
            })
        };
        PythonFs {
            stat: method("stat"),
            list_dir: method("list_dir"),
            read: method("read"),
            write: method("write"),
            create: method("create"),
            make_dir: method("make_dir"),
            remove: method("remove"),
            remove_dir: method("remove_dir"),
            rename: method("rename"),
            truncate: method("truncate"),
            read_link: method("read_link"),
            inodes: Mutex::new(Inodes::new()),
            listings: Mutex::new(HashMap::new()),
            next_handle: AtomicU64::new(1),
        }
    }

    fn listings(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Vec<String>>>> {
        self.listings.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The names in the directory `path`, as `list_dir` gives them (bounded).
    async fn list(&self, path: String) -> FsResult<Vec<String>> {
        let names: Vec<String> = self
            .call(
                &self.list_dir,
                move |py| (path,).into_pyobject(py),
                |result| {
                    let mut names = Vec::new();
                    for name in result.try_iter()? {
                        if names.len() == MAX_LISTED {
                            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                                "list_dir returned more than {MAX_LISTED} names"
                            )));
                        }
                        names.push(name?.extract::<String>()?);
                    }
                    Ok(names)
                },
            )
            .await?;
        Ok(names)
    }

    fn inodes(&self) -> std::sync::MutexGuard<'_, Inodes> {
        self.inodes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The path of `ino`: `ENOENT` once it was removed (or for an inode it never handed out).
    fn path(&self, ino: InodeId) -> FsResult<String> {
        self.inodes().path(ino).ok_or(FsError::NOT_FOUND)
    }

    fn child(&self, parent: InodeId, name: &OsStr) -> FsResult<String> {
        let name = name.to_str().ok_or(FsError::INVALID)?;
        Ok(join(&self.path(parent)?, name))
    }

    /// Calls `method` (a method of the object's, if it has it) with `args`, `convert`ing its
    /// result; its `OSError` is the errno, any other exception `EIO` and logged.
    async fn call<T, A, C>(
        &self,
        method: &Option<Arc<Callable>>,
        args: A,
        convert: C,
    ) -> FsResult<T>
    where
        T: Send + 'static,
        A: for<'py> FnOnce(Python<'py>) -> PyResult<Bound<'py, PyTuple>> + Send + 'static,
        C: for<'py> FnOnce(&Bound<'py, PyAny>) -> PyResult<T> + Send + 'static,
    {
        let Some(method) = method else {
            return Err(FsError::UNSUPPORTED);
        };
        match method.call(args, convert).await {
            Ok(value) => Ok(value),
            Err(error) => Err(errno_of(error).await),
        }
    }

    /// What `stat(path)` says, as the attributes of `ino`.
    async fn attr(&self, path: String, ino: InodeId) -> FsResult<Attr> {
        let stat = self
            .call(
                &self.stat,
                move |py| (path,).into_pyobject(py),
                |result| Ok(result.cast::<Stat>()?.get().clone()),
            )
            .await?;
        Ok(stat.attr(ino))
    }

    /// Looks `path` up: its attributes under an inode the kernel now holds one more of.
    async fn entry(&self, path: String) -> FsResult<Entry> {
        let attr = self.attr(path.clone(), InodeId(0)).await?;
        let ino = self.inodes().remember(&path);
        Ok(Entry {
            attr: Attr { ino, ..attr },
            generation: 0,
        })
    }
}

/// The errno for what a method raised: an `OSError`'s own, or its class's when it has none
/// (`FileNotFoundError("x")` is `ENOENT`), found off tokio's workers. Anything else is `EIO`
/// and is logged; an `OSError` is the filesystem's answer, not a failure, and is not.
async fn errno_of(error: PyErr) -> FsError {
    let classified = with_gil(move |py| {
        let errno = error
            .value(py)
            .getattr("errno")
            .ok()
            .and_then(|e| e.extract::<i32>().ok());
        let by_class = [
            (
                error.is_instance_of::<PyFileNotFoundError>(py),
                libc::ENOENT,
            ),
            (error.is_instance_of::<PyFileExistsError>(py), libc::EEXIST),
            (error.is_instance_of::<PyPermissionError>(py), libc::EACCES),
            (
                error.is_instance_of::<PyNotADirectoryError>(py),
                libc::ENOTDIR,
            ),
            (
                error.is_instance_of::<PyIsADirectoryError>(py),
                libc::EISDIR,
            ),
            (
                error.is_instance_of::<PyNotImplementedError>(py),
                libc::ENOSYS,
            ),
        ];
        let by_class = by_class.into_iter().find(|(is, _)| *is).map(|(_, e)| e);
        let os_error = error.is_instance_of::<PyOSError>(py);
        match (errno, by_class) {
            (Some(errno), _) if os_error => Ok(errno),
            (_, Some(errno)) => Ok(errno),
            _ => Err(error),
        }
    })
    .await;
    match classified {
        Ok(Ok(errno)) => FsError::from_errno(errno),
        Ok(Err(error)) | Err(error) => {
            report(
                error,
                "a VirtualFs method",
                "the guest's call fails with EIO",
            )
            .await;
            FsError::IO
        }
    }
}

fn none(_: &Bound<'_, PyAny>) -> PyResult<()> {
    Ok(())
}

#[krunbox::fs::async_trait]
impl krunbox::fs::VirtualFs for PythonFs {
    async fn lookup(&self, parent: InodeId, name: &OsStr) -> FsResult<Entry> {
        let path = self.child(parent, name)?;
        self.entry(path).await
    }

    async fn forget(&self, ino: InodeId, count: u64) {
        self.inodes().forget(ino, count);
    }

    async fn getattr(&self, ino: InodeId) -> FsResult<Attr> {
        let path = self.path(ino)?;
        self.attr(path, ino).await
    }

    async fn setattr(&self, ino: InodeId, change: SetAttr, _caller: Caller) -> FsResult<Attr> {
        let path = self.path(ino)?;
        if let Some(size) = change.size {
            let at = path.clone();
            self.call(&self.truncate, move |py| (at, size).into_pyobject(py), none)
                .await?;
        }
        // Modes, owners and times are the object's to report, not the guest's to set.
        self.attr(path, ino).await
    }

    async fn readlink(&self, ino: InodeId) -> FsResult<Vec<u8>> {
        let path = self.path(ino)?;
        self.call(
            &self.read_link,
            move |py| (path,).into_pyobject(py),
            |result| Ok(result.extract::<String>()?.into_bytes()),
        )
        .await
    }

    async fn mkdir(
        &self,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        _caller: Caller,
    ) -> FsResult<Entry> {
        let path = self.child(parent, name)?;
        let at = path.clone();
        self.call(
            &self.make_dir,
            move |py| (at, mode & 0o7777).into_pyobject(py),
            none,
        )
        .await?;
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
        let at = path.clone();
        self.call(
            &self.create,
            move |py| (at, mode & 0o7777).into_pyobject(py),
            none,
        )
        .await?;
        Ok((self.entry(path).await?, FileHandle(0)))
    }

    async fn unlink(&self, parent: InodeId, name: &OsStr) -> FsResult<()> {
        let path = self.child(parent, name)?;
        let at = path.clone();
        self.call(&self.remove, move |py| (at,).into_pyobject(py), none)
            .await?;
        self.inodes().removed(&path);
        Ok(())
    }

    async fn rmdir(&self, parent: InodeId, name: &OsStr) -> FsResult<()> {
        let path = self.child(parent, name)?;
        let at = path.clone();
        self.call(&self.remove_dir, move |py| (at,).into_pyobject(py), none)
            .await?;
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
            match self.attr(to.clone(), InodeId(0)).await {
                Ok(_) => return Err(FsError::EXISTS),
                Err(e) if e == FsError::NOT_FOUND => {}
                Err(e) => return Err(e),
            }
        }
        let (source, destination) = (from.clone(), to.clone());
        self.call(
            &self.rename,
            move |py| (source, destination).into_pyobject(py),
            none,
        )
        .await?;
        self.inodes().rename(&from, &to);
        Ok(())
    }

    async fn open(&self, ino: InodeId, flags: OpenFlags) -> FsResult<FileHandle> {
        let path = self.path(ino)?;
        if flags.truncate() {
            self.call(
                &self.truncate,
                move |py| (path, 0u64).into_pyobject(py),
                none,
            )
            .await?;
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
        self.call(
            &self.read,
            move |py| (path, offset, size).into_pyobject(py),
            move |result| {
                let mut data = super::bytes_of(result)?;
                // More than was asked for is cut: the guest asked for `size`.
                data.truncate(size as usize);
                Ok(data)
            },
        )
        .await
    }

    async fn write(
        &self,
        ino: InodeId,
        _handle: FileHandle,
        offset: u64,
        data: &[u8],
    ) -> FsResult<u32> {
        let path = self.path(ino)?;
        let len = data.len() as u32;
        let data = data.to_vec();
        self.call(
            &self.write,
            move |py| (path, offset, PyBytes::new(py, &data)).into_pyobject(py),
            move |result| {
                if result.is_none() {
                    return Ok(len);
                }
                Ok(result.extract::<u32>()?.min(len))
            },
        )
        .await
    }

    async fn flush(&self, _ino: InodeId, _handle: FileHandle) -> FsResult<()> {
        Ok(())
    }

    async fn fsync(&self, _ino: InodeId, _handle: FileHandle, _data_only: bool) -> FsResult<()> {
        Ok(())
    }

    async fn opendir(&self, ino: InodeId) -> FsResult<FileHandle> {
        let names = self.list(self.path(ino)?).await?;
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
            None => Arc::new(self.list(path.clone()).await?),
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
            let kind = match self.attr(child.clone(), InodeId(0)).await {
                Ok(attr) => attr.kind,
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

impl Stat {
    /// As the library's attributes of `ino`.
    fn attr(&self, ino: InodeId) -> Attr {
        let kind = match self.kind {
            "dir" => FileKind::Directory,
            "symlink" => FileKind::Symlink,
            _ => FileKind::File,
        };
        let mtime = if self.mtime.is_finite() && self.mtime >= 0.0 {
            UNIX_EPOCH + Duration::from_secs_f64(self.mtime.min(1e11))
        } else {
            SystemTime::UNIX_EPOCH
        };
        Attr {
            ino,
            kind,
            perm: self.mode & 0o7777,
            nlink: if kind == FileKind::Directory { 2 } else { 1 },
            uid: self.uid,
            gid: self.gid,
            size: self.size,
            blocks: self.size.div_ceil(512),
            atime: mtime,
            mtime,
            ctime: mtime,
            rdev: 0,
        }
    }
}
