//! Root filesystems as Python defines them: a built-in or given image, and the writable roots
//! over one (ephemeral, persistent, copy-on-write over a block store, which may be written in
//! Python).

use std::path::PathBuf;
use std::sync::Arc;

use krunbox::rootfs::{StoreContext, StoreError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::callback::{calls_bound, report, with_gil, Callable, EventLoop};
use crate::errors::{to_py, InvalidConfig};

/// A root filesystem definition. Made by its static methods; a store written in Python is
/// bound to the sandbox's event loop when a `Sandbox` is defined with it.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct Rootfs {
    spec: Spec,
}

enum Spec {
    Ready(krunbox::Rootfs),
    Ephemeral(Py<Rootfs>, u64),
    Persistent(Py<Rootfs>, PathBuf),
    Cow(Py<Rootfs>, Store, u64),
}

/// A block store: one of the library's, or a Python object's (made into the library's store
/// once, so that every sandbox given this root shares its "attached" guard).
enum Store {
    Directory(krunbox::rootfs::DirectoryStore),
    Memory(krunbox::rootfs::MemoryStore),
    Python {
        handle: krunbox::rootfs::StoreHandle,
        /// Its callbacks' loop: that of the sandbox that booted it last.
        event_loop: Arc<EventLoop>,
    },
}

/// The built-in image of `name`.
pub(crate) fn builtin(name: &str) -> PyResult<krunbox::BuiltinImage> {
    match name {
        "busybox" => Ok(krunbox::BuiltinImage::Busybox),
        "agent" => Ok(krunbox::BuiltinImage::Agent),
        other => Err(InvalidConfig::new_err(format!(
            "{other:?} is not a built-in image: say \"agent\" (Debian with python3, node, git, \
             curl) or \"busybox\""
        ))),
    }
}

#[pymethods]
impl Rootfs {
    /// The built-in image `name` ("agent" or "busybox"), read-only.
    #[staticmethod]
    fn builtin(name: &str) -> PyResult<Self> {
        Ok(Rootfs::ready(krunbox::Rootfs::builtin(builtin(name)?)))
    }

    /// The filesystem image at `path` (`fstype`, e.g. "ext4"), read-only, checked against its
    /// `sha256` at each boot.
    #[staticmethod]
    #[pyo3(signature = (path, sha256, fstype = "ext4"))]
    fn image(path: PathBuf, sha256: &str, fstype: &str) -> Self {
        Rootfs::ready(krunbox::Rootfs::image(path, fstype, sha256))
    }

    /// `base` made writable; changes live in memory (at most `max_dirty_bytes` of them) and
    /// are gone with the instance.
    #[staticmethod]
    #[pyo3(signature = (base, max_dirty_bytes = 256 << 20))]
    fn ephemeral(base: Py<Rootfs>, max_dirty_bytes: u64) -> Self {
        Rootfs {
            spec: Spec::Ephemeral(base, max_dirty_bytes),
        }
    }

    /// `base` made writable; changes kept in the file at `path` across boots.
    #[staticmethod]
    fn persistent(base: Py<Rootfs>, path: PathBuf) -> Self {
        Rootfs {
            spec: Spec::Persistent(base, path),
        }
    }

    /// `base` made writable; changes kept in `store` (a `DirectoryStore`, a `MemoryStore`, or
    /// a Python object with the block store's methods), at most `max_dirty_bytes` of them in
    /// memory before they are written there.
    #[staticmethod]
    #[pyo3(signature = (base, store, max_dirty_bytes = 64 << 20))]
    fn cow(base: Py<Rootfs>, store: Bound<'_, PyAny>, max_dirty_bytes: u64) -> PyResult<Self> {
        let store = if let Ok(native) = store.cast::<DirectoryStore>() {
            Store::Directory(native.get().0.clone())
        } else if let Ok(native) = store.cast::<MemoryStore>() {
            Store::Memory(native.get().0.clone())
        } else {
            let event_loop = Arc::new(EventLoop::default());
            let python = PythonStore::new(&store, &event_loop)?;
            Store::Python {
                handle: krunbox::rootfs::StoreHandle::new(python),
                event_loop,
            }
        };
        Ok(Rootfs {
            spec: Spec::Cow(base, store, max_dirty_bytes),
        })
    }

    fn __repr__(&self) -> String {
        match &self.spec {
            Spec::Ready(rootfs) => format!("{rootfs:?}"),
            Spec::Ephemeral(base, _) => format!("Rootfs.ephemeral({})", base.get().__repr__()),
            Spec::Persistent(base, path) => {
                format!("Rootfs.persistent({}, {path:?})", base.get().__repr__())
            }
            Spec::Cow(base, _, _) => format!("Rootfs.cow({}, ...)", base.get().__repr__()),
        }
    }
}

impl Rootfs {
    pub(crate) fn ready(rootfs: krunbox::Rootfs) -> Self {
        Rootfs {
            spec: Spec::Ready(rootfs),
        }
    }

    /// The library's root for a sandbox whose callbacks run on `event_loop`.
    pub(crate) fn build(&self, event_loop: &Arc<EventLoop>) -> krunbox::Rootfs {
        match &self.spec {
            Spec::Ready(rootfs) => rootfs.clone(),
            Spec::Ephemeral(base, bytes) => {
                krunbox::Rootfs::ephemeral(base.get().build(event_loop), *bytes)
            }
            Spec::Persistent(base, path) => {
                krunbox::Rootfs::persistent(base.get().build(event_loop), path.clone())
            }
            Spec::Cow(base, store, bytes) => {
                let base = base.get().build(event_loop);
                match store {
                    Store::Directory(store) => krunbox::Rootfs::cow(base, store.clone(), *bytes),
                    Store::Memory(store) => krunbox::Rootfs::cow(base, store.clone(), *bytes),
                    Store::Python {
                        handle,
                        event_loop: own,
                    } => {
                        event_loop.lead(own);
                        krunbox::Rootfs::cow(base, handle.clone(), *bytes)
                    }
                }
            }
        }
    }
}

/// The library's store keeping its blocks as files in a directory (served in place: blocks
/// never pass through Python).
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct DirectoryStore(krunbox::rootfs::DirectoryStore);

#[pymethods]
impl DirectoryStore {
    #[new]
    fn new(path: PathBuf) -> PyResult<Self> {
        krunbox::rootfs::DirectoryStore::open(path)
            .map(DirectoryStore)
            .map_err(to_py)
    }
}

/// The library's store keeping its blocks in this process's memory.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct MemoryStore(krunbox::rootfs::MemoryStore);

#[pymethods]
impl MemoryStore {
    #[new]
    fn new() -> Self {
        MemoryStore(krunbox::rootfs::MemoryStore::new())
    }
}

/// A Python object with the block store's methods, as the library's `BlockStore`. What a
/// method raises fails that operation (`StoreError`; the guest's I/O gets EIO), and is logged.
struct PythonStore {
    block_size: u32,
    written_blocks: Arc<Callable>,
    read_blocks: Arc<Callable>,
    write_blocks: Arc<Callable>,
    flush: Arc<Callable>,
    attach: Option<Arc<Callable>>,
    detach: Option<Arc<Callable>>,
}

impl PythonStore {
    /// `object`'s methods and block size, checked once: a store lacking one is refused here.
    fn new(object: &Bound<'_, PyAny>, event_loop: &Arc<EventLoop>) -> PyResult<Self> {
        let block_size: u32 = object.getattr("block_size")?.extract()?;
        if !(block_size.is_power_of_two()
            && (krunbox::rootfs::MIN_BLOCK_SIZE..=krunbox::rootfs::MAX_BLOCK_SIZE)
                .contains(&block_size))
        {
            return Err(InvalidConfig::new_err(format!(
                "block_size={block_size}: a power of two from {} to {}",
                krunbox::rootfs::MIN_BLOCK_SIZE,
                krunbox::rootfs::MAX_BLOCK_SIZE
            )));
        }
        let calls = calls_bound();
        let optional = |name: &str| -> PyResult<Option<Arc<Callable>>> {
            if !object.hasattr(name)? {
                return Ok(None);
            }
            let function = object.getattr(name)?.unbind();
            let callable = Callable::new(function, Arc::clone(event_loop), Arc::clone(&calls));
            Ok(Some(Arc::new(callable)))
        };
        let required = |name: &str| -> PyResult<Arc<Callable>> {
            optional(name)?.ok_or_else(|| {
                InvalidConfig::new_err(format!("a block store needs a {name}() method"))
            })
        };
        Ok(PythonStore {
            block_size,
            written_blocks: required("written_blocks")?,
            read_blocks: required("read_blocks")?,
            write_blocks: required("write_blocks")?,
            flush: required("flush")?,
            attach: optional("attach")?,
            detach: optional("detach")?,
        })
    }
}

/// A store method's exception as the library's store error, logged first.
async fn failed(error: PyErr, what: &'static str) -> StoreError {
    let (message, error) = with_gil(move |py| (format!("{what}: {}", error.value(py)), error))
        .await
        .unwrap_or_else(|e| (format!("{what}: {e}"), e));
    report(error, what, "the store operation fails (EIO in the guest)").await;
    StoreError::Failed(message)
}

#[krunbox::rootfs::async_trait]
impl krunbox::rootfs::BlockStore for PythonStore {
    fn block_size(&self) -> u32 {
        self.block_size
    }

    async fn attach(&self, context: &StoreContext) -> Result<(), StoreError> {
        let Some(attach) = &self.attach else {
            return Ok(());
        };
        let (base, bytes) = (context.base_sha256.clone(), context.disk_bytes);
        let called = attach
            .call(move |py| (base, bytes).into_pyobject(py), |_| Ok(()))
            .await;
        match called {
            Ok(()) => Ok(()),
            Err(error) => Err(failed(error, "the block store's attach()").await),
        }
    }

    async fn written_blocks(&self) -> Result<Vec<u64>, StoreError> {
        let called = self
            .written_blocks
            .call(
                |py| Ok(PyTuple::empty(py)),
                |result| {
                    result
                        .try_iter()?
                        .map(|index| index?.extract::<u64>())
                        .collect::<PyResult<Vec<u64>>>()
                },
            )
            .await;
        match called {
            Ok(blocks) => Ok(blocks),
            Err(error) => Err(failed(error, "the block store's written_blocks()").await),
        }
    }

    async fn read_blocks(&self, first: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let count = (buf.len() / self.block_size as usize) as u64;
        let wanted = buf.len();
        let called = self
            .read_blocks
            .call(
                move |py| (first, count).into_pyobject(py),
                move |result| {
                    let data = crate::fs::bytes_of(result)?;
                    if data.len() != wanted {
                        return Err(InvalidConfig::new_err(format!(
                            "read_blocks({first}, {count}) returned {} bytes, not {wanted}",
                            data.len()
                        )));
                    }
                    Ok(data)
                },
            )
            .await;
        match called {
            Ok(data) => {
                buf.copy_from_slice(&data);
                Ok(())
            }
            Err(error) => Err(failed(error, "the block store's read_blocks()").await),
        }
    }

    async fn write_blocks(&self, first: u64, data: &[u8]) -> Result<(), StoreError> {
        let data = data.to_vec();
        let called = self
            .write_blocks
            .call(
                move |py| (first, PyBytes::new(py, &data)).into_pyobject(py),
                |_| Ok(()),
            )
            .await;
        match called {
            Ok(()) => Ok(()),
            Err(error) => Err(failed(error, "the block store's write_blocks()").await),
        }
    }

    async fn flush(&self) -> Result<(), StoreError> {
        let called = self
            .flush
            .call(|py| Ok(PyTuple::empty(py)), |_| Ok(()))
            .await;
        match called {
            Ok(()) => Ok(()),
            Err(error) => Err(failed(error, "the block store's flush()").await),
        }
    }

    async fn detach(&self) -> Result<(), StoreError> {
        let Some(detach) = &self.detach else {
            return Ok(());
        };
        let called = detach.call(|py| Ok(PyTuple::empty(py)), |_| Ok(())).await;
        match called {
            Ok(()) => Ok(()),
            Err(error) => Err(failed(error, "the block store's detach()").await),
        }
    }
}
