//! The guest's files beyond whole reads and writes: listings, metadata, removal, renames,
//! directories, and streams for files too large to hold in memory.

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use pyo3::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;

use crate::errors::InvalidConfig;
use crate::instance::{Bytes, Instance};
use crate::runtime::{awaitable, block_on};

/// The library's typed error a stream's `io::Error` carries (see `GuestFileReader`), or the
/// `io::Error` itself as a host I/O error.
fn typed(error: std::io::Error, context: &str) -> krunbox::Error {
    if error.get_ref().is_some_and(|e| e.is::<krunbox::Error>()) {
        let inner = error.into_inner().expect("checked above");
        return *inner.downcast::<krunbox::Error>().expect("checked above");
    }
    krunbox::Error::Io {
        context: context.into(),
        source: error,
    }
}

/// The name of a file type, as Python gets it.
fn type_name(file_type: krunbox::FileType) -> &'static str {
    match file_type {
        krunbox::FileType::File => "file",
        krunbox::FileType::Dir => "dir",
        krunbox::FileType::Symlink => "symlink",
        _ => "other",
    }
}

/// What `stat` says about a guest path.
#[pyclass(module = "krunbox._krunbox", frozen, get_all)]
pub(crate) struct FileInfo {
    /// "file", "dir", "symlink" or "other".
    #[pyo3(name = "type")]
    file_type: &'static str,
    /// Size in bytes.
    size: u64,
    /// Permission bits (`0o644`).
    mode: u32,
    uid: u32,
    gid: u32,
    /// Last modification, seconds since the epoch (the guest's clock).
    mtime: f64,
}

impl From<krunbox::Metadata> for FileInfo {
    fn from(meta: krunbox::Metadata) -> Self {
        FileInfo {
            file_type: type_name(meta.file_type),
            size: meta.len,
            mode: meta.mode,
            uid: meta.uid,
            gid: meta.gid,
            mtime: meta
                .modified
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        }
    }
}

#[pymethods]
impl FileInfo {
    fn __repr__(&self) -> String {
        format!(
            "FileInfo(type={:?}, size={}, mode=0o{:o})",
            self.file_type, self.size, self.mode
        )
    }
}

/// One entry of a guest directory.
#[pyclass(module = "krunbox._krunbox", frozen, get_all)]
pub(crate) struct DirEntry {
    /// Its name (bytes that are not UTF-8 escaped as Python's `os.fsdecode` does, so
    /// `os.fsencode` gives them back).
    name: std::ffi::OsString,
    /// "file", "dir", "symlink" or "other" (a symlink is not followed).
    #[pyo3(name = "type")]
    file_type: &'static str,
}

impl From<krunbox::DirEntry> for DirEntry {
    fn from(entry: krunbox::DirEntry) -> Self {
        DirEntry {
            name: entry.name,
            file_type: type_name(entry.file_type),
        }
    }
}

#[pymethods]
impl DirEntry {
    fn __repr__(&self) -> String {
        format!("DirEntry({:?}, {:?})", self.name, self.file_type)
    }
}

/// A guest file being read in chunks (`Instance.open_reader`).
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct FileReader {
    inner: Arc<Mutex<krunbox::GuestFileReader>>,
}

impl FileReader {
    pub(crate) fn new(reader: krunbox::GuestFileReader) -> Self {
        FileReader {
            inner: Arc::new(Mutex::new(reader)),
        }
    }
}

/// The largest chunk one `read` returns.
const MAX_CHUNK: usize = 1 << 20;

fn chunk_size(max: usize) -> PyResult<usize> {
    if max == 0 || max > MAX_CHUNK {
        return Err(InvalidConfig::new_err(format!(
            "max={max}: read between 1 byte and {MAX_CHUNK} at a time"
        )));
    }
    Ok(max)
}

async fn read_chunk(
    reader: Arc<Mutex<krunbox::GuestFileReader>>,
    max: usize,
) -> krunbox::Result<Bytes> {
    let mut reader = reader.lock().await;
    let mut buf = vec![0; max];
    let n = reader
        .read(&mut buf)
        .await
        .map_err(|e| typed(e, "reading a guest file"))?;
    buf.truncate(n);
    Ok(Bytes(buf))
}

#[pymethods]
impl FileReader {
    /// Up to `max` bytes (awaitable); empty at the end of the file.
    #[pyo3(signature = (max = 65536))]
    fn read<'py>(&self, py: Python<'py>, max: usize) -> PyResult<Bound<'py, PyAny>> {
        let max = chunk_size(max)?;
        awaitable(py, read_chunk(Arc::clone(&self.inner), max))
    }

    /// `read`, waiting here with the GIL released.
    #[pyo3(signature = (max = 65536))]
    fn read_blocking(&self, py: Python<'_>, max: usize) -> PyResult<Bytes> {
        let max = chunk_size(max)?;
        block_on(py, read_chunk(Arc::clone(&self.inner), max))
    }
}

/// A guest file being written in chunks (`Instance.open_writer`); `finish` makes it whole.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct FileWriter {
    inner: Arc<Mutex<Option<krunbox::GuestFileWriter>>>,
}

impl FileWriter {
    pub(crate) fn new(writer: krunbox::GuestFileWriter) -> Self {
        FileWriter {
            inner: Arc::new(Mutex::new(Some(writer))),
        }
    }
}

fn finished() -> krunbox::Error {
    krunbox::Error::InvalidConfig("the file writer is finished: open another".into())
}

async fn write_chunk(
    writer: Arc<Mutex<Option<krunbox::GuestFileWriter>>>,
    data: Vec<u8>,
) -> krunbox::Result<()> {
    let mut writer = writer.lock().await;
    let writer = writer.as_mut().ok_or_else(finished)?;
    writer
        .write_all(&data)
        .await
        .map_err(|e| typed(e, "writing a guest file"))
}

async fn finish(writer: Arc<Mutex<Option<krunbox::GuestFileWriter>>>) -> krunbox::Result<()> {
    let writer = writer.lock().await.take().ok_or_else(finished)?;
    writer.finish().await
}

#[pymethods]
impl FileWriter {
    /// Writes `data`, whole (awaitable).
    fn write<'py>(&self, py: Python<'py>, data: Vec<u8>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, write_chunk(Arc::clone(&self.inner), data))
    }

    /// `write`, waiting here with the GIL released.
    fn write_blocking(&self, py: Python<'_>, data: Vec<u8>) -> PyResult<()> {
        block_on(py, write_chunk(Arc::clone(&self.inner), data))
    }

    /// Sends what is buffered, waits until the guest has written it all and `fsync`ed the
    /// file, and reports any error on the way (awaitable).
    fn finish<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, finish(Arc::clone(&self.inner)))
    }

    /// `finish`, waiting here with the GIL released.
    fn finish_blocking(&self, py: Python<'_>) -> PyResult<()> {
        block_on(py, finish(Arc::clone(&self.inner)))
    }
}

/// An `Instance` method taking `(self, args...)` twice: `$name` awaitable, `$blocking` waiting
/// with the GIL released; both run `$body` (an async block using `instance` and the args) and
/// give back its `krunbox::Result<$out>`.
macro_rules! file_method {
    (
        $(#[$doc:meta])*
        fn $name:ident / $blocking:ident ($($arg:ident : $ty:ty $(= $default:expr)?),*) -> $out:ty
        = |$instance:ident| $body:expr;
    ) => {
        #[pymethods]
        impl Instance {
            $(#[$doc])*
            #[pyo3(signature = ($($arg $(= $default)?),*))]
            fn $name<'py>(&self, py: Python<'py>, $($arg: $ty),*) -> PyResult<Bound<'py, PyAny>> {
                let $instance = self.inner.clone();
                awaitable(py, async move { $body })
            }

            #[doc = concat!("`", stringify!($name), "`, waiting here with the GIL released.")]
            #[pyo3(signature = ($($arg $(= $default)?),*))]
            fn $blocking(&self, py: Python<'_>, $($arg: $ty),*) -> PyResult<$out> {
                let $instance = self.inner.clone();
                block_on(py, async move { $body })
            }
        }
    };
}

file_method! {
    /// The entries of the guest directory `path`, sorted by name (awaitable).
    fn list_dir / list_dir_blocking (path: String) -> Vec<DirEntry> = |vm| {
        let entries = vm.read_dir(path).await?;
        Ok(entries.into_iter().map(DirEntry::from).collect::<Vec<_>>())
    };
}

file_method! {
    /// What `stat` says about `path` (awaitable); `follow_symlinks=False` describes a symlink
    /// itself.
    fn stat / stat_blocking (path: String, follow_symlinks: bool = true) -> FileInfo = |vm| {
        let meta = if follow_symlinks {
            vm.metadata(path).await?
        } else {
            vm.symlink_metadata(path).await?
        };
        Ok(FileInfo::from(meta))
    };
}

file_method! {
    /// Removes a file, a symlink or an empty directory; `recursive=True` a whole tree
    /// (awaitable).
    fn remove / remove_blocking (path: String, recursive: bool = false) -> () = |vm| {
        if recursive {
            vm.remove_all(path).await
        } else {
            vm.remove(path).await
        }
    };
}

file_method! {
    /// Renames `source` to `destination`, replacing a file there atomically (awaitable).
    fn rename / rename_blocking (source: String, destination: String) -> () = |vm| {
        vm.rename(source, destination).await
    };
}

file_method! {
    /// Makes the directory `path` (with `mode`); `parents=True` also the missing ones above
    /// it (mode 0o755, each), and an existing directory is no error then (awaitable).
    fn make_dir / make_dir_blocking (path: String, mode: u32 = 0o755, parents: bool = false)
        -> () = |vm| {
        if parents {
            vm.create_dir_all(path).await
        } else {
            vm.create_dir(path, mode).await
        }
    };
}

file_method! {
    /// Opens the guest file `path` for reading in chunks (awaitable).
    fn open_reader / open_reader_blocking (path: String) -> FileReader = |vm| {
        vm.open_file(path).await.map(FileReader::new)
    };
}

file_method! {
    /// Creates (or truncates) the guest file `path` with `mode` for writing in chunks
    /// (awaitable).
    fn open_writer / open_writer_blocking (path: String, mode: u32 = 0o644) -> FileWriter = |vm| {
        vm.create_file(path, mode).await.map(FileWriter::new)
    };
}
