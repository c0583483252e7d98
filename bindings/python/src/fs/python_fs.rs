//! A filesystem written in Python (`krunbox.VirtualFs`, path-based) as the library's
//! `PathFs` (served to the guest by `krunbox::fs::ByPath`, which keeps the inode table and
//! the open directories' listings): each operation calls the object's method for it off
//! tokio's workers. An `OSError` the method raises is its errno to the guest; anything else
//! is `EIO`, logged.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use krunbox::fs::{FileKind, FsError, FsResult, PathFs, PathStat, MAX_LISTED};
use pyo3::exceptions::{
    PyFileExistsError, PyFileNotFoundError, PyIsADirectoryError, PyNotADirectoryError,
    PyNotImplementedError, PyOSError, PyPermissionError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use super::Stat;
use crate::callback::{calls_bound, report, with_gil, Callable, EventLoop};

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
        }
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
impl PathFs for PythonFs {
    async fn stat(&self, path: &str) -> FsResult<PathStat> {
        let path = path.to_owned();
        self.call(
            &self.stat,
            move |py| (path,).into_pyobject(py),
            |result| Ok(result.cast::<Stat>()?.get().path_stat()),
        )
        .await
    }

    async fn list_dir(&self, path: &str) -> FsResult<Vec<String>> {
        let path = path.to_owned();
        self.call(
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
        .await
    }

    async fn read(&self, path: &str, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        let path = path.to_owned();
        self.call(
            &self.read,
            move |py| (path, offset, size).into_pyobject(py),
            move |result| {
                let mut data = super::bytes_of(result)?;
                data.truncate(size as usize);
                Ok(data)
            },
        )
        .await
    }

    async fn write(&self, path: &str, offset: u64, data: &[u8]) -> FsResult<u32> {
        let path = path.to_owned();
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

    async fn create(&self, path: &str, mode: u32) -> FsResult<()> {
        let path = path.to_owned();
        self.call(&self.create, move |py| (path, mode).into_pyobject(py), none)
            .await
    }

    async fn make_dir(&self, path: &str, mode: u32) -> FsResult<()> {
        let path = path.to_owned();
        self.call(
            &self.make_dir,
            move |py| (path, mode).into_pyobject(py),
            none,
        )
        .await
    }

    async fn remove(&self, path: &str) -> FsResult<()> {
        let path = path.to_owned();
        self.call(&self.remove, move |py| (path,).into_pyobject(py), none)
            .await
    }

    async fn remove_dir(&self, path: &str) -> FsResult<()> {
        let path = path.to_owned();
        self.call(&self.remove_dir, move |py| (path,).into_pyobject(py), none)
            .await
    }

    async fn rename(&self, from: &str, to: &str) -> FsResult<()> {
        let (from, to) = (from.to_owned(), to.to_owned());
        self.call(&self.rename, move |py| (from, to).into_pyobject(py), none)
            .await
    }

    async fn truncate(&self, path: &str, size: u64) -> FsResult<()> {
        let path = path.to_owned();
        self.call(
            &self.truncate,
            move |py| (path, size).into_pyobject(py),
            none,
        )
        .await
    }

    async fn read_link(&self, path: &str) -> FsResult<String> {
        let path = path.to_owned();
        self.call(
            &self.read_link,
            move |py| (path,).into_pyobject(py),
            |result| result.extract::<String>(),
        )
        .await
    }
}

impl Stat {
    /// As the library's `PathStat`.
    fn path_stat(&self) -> PathStat {
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
        PathStat {
            kind,
            size: self.size,
            mode: self.mode & 0o7777,
            uid: self.uid,
            gid: self.gid,
            mtime,
        }
    }
}
