//! `Sandbox`: a definition (root, resources, mounts, network), booted into instances as often
//! as wanted.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;

use crate::callback::EventLoop;
use crate::fs::Mounts;
use crate::instance::Instance;
use crate::rootfs::Rootfs;
use crate::runtime::{awaitable, block_on};

/// A sandbox definition: what each instance boots from. Cheap to boot many times.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct Sandbox {
    inner: krunbox::Sandbox,
    /// Where its callbacks (network, stores, filesystems) await their coroutines: the loop
    /// that booted it last.
    event_loop: Arc<EventLoop>,
}

/// The root a sandbox is given as: a built-in image's name, or a `Rootfs`.
fn root(image: &Bound<'_, PyAny>, event_loop: &Arc<EventLoop>) -> PyResult<krunbox::Rootfs> {
    if let Ok(name) = image.extract::<String>() {
        return Ok(krunbox::Rootfs::builtin(crate::rootfs::builtin(&name)?));
    }
    let rootfs = image.cast::<Rootfs>()?;
    Ok(rootfs.get().build(event_loop))
}

#[pymethods]
impl Sandbox {
    /// A definition booting `image` (a built-in image's name, "agent" or "busybox", or a
    /// `Rootfs`) with `cpus` vCPUs and `memory_mib` of memory (the library's defaults when
    /// not given), `hostname`, `mounts` ((guest path, filesystem) pairs) and `network` (none
    /// without).
    #[new]
    #[pyo3(signature = (
        image, *, cpus = None, memory_mib = None, hostname = None, mounts = Vec::new(),
        network = None, snapshots = false, snapshot_key_dir = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        image: &Bound<'_, PyAny>,
        cpus: Option<u8>,
        memory_mib: Option<u32>,
        hostname: Option<String>,
        mounts: Vec<(String, Bound<'_, PyAny>)>,
        network: Option<PyRef<'_, crate::net::Network>>,
        snapshots: bool,
        snapshot_key_dir: Option<PathBuf>,
    ) -> PyResult<Self> {
        let event_loop = Arc::new(EventLoop::default());
        let mut builder = krunbox::Sandbox::builder().rootfs(root(image, &event_loop)?);
        if let Some(cpus) = cpus {
            builder = builder.cpus(cpus);
        }
        if let Some(mib) = memory_mib {
            builder = builder.memory_mib(mib);
        }
        if let Some(hostname) = hostname {
            builder = builder.hostname(hostname);
        }
        builder = builder.with_mounts(crate::fs::mounts(mounts, &event_loop)?);
        if let Some(network) = network {
            builder = builder.network(network.build(py, &event_loop));
        }
        builder = builder.snapshots(snapshots);
        if let Some(dir) = snapshot_key_dir {
            builder = builder.snapshot_key_dir(dir);
        }
        let inner = builder.build().map_err(crate::errors::to_py)?;
        Ok(Sandbox { inner, event_loop })
    }

    /// Boots an instance (awaitable), with this boot's own `mounts`, `hostname` and working
    /// directory `cwd` if given. Callbacks' coroutines run on the loop awaiting this.
    #[pyo3(signature = (*, mounts = Vec::new(), hostname = None, cwd = None))]
    fn boot<'py>(
        &self,
        py: Python<'py>,
        mounts: Vec<(String, Bound<'py, PyAny>)>,
        hostname: Option<String>,
        cwd: Option<PathBuf>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let options = self.options(mounts, hostname, cwd)?;
        self.event_loop
            .set(Some(pyo3_async_runtimes::tokio::get_current_locals(py)?));
        let sandbox = self.inner.clone();
        awaitable(py, async move {
            sandbox.boot_with(options).await.map(Instance::new)
        })
    }

    /// `boot`, waiting here with the GIL released. Callbacks' coroutines run by
    /// `asyncio.run`.
    #[pyo3(signature = (*, mounts = Vec::new(), hostname = None, cwd = None))]
    fn boot_blocking(
        &self,
        py: Python<'_>,
        mounts: Vec<(String, Bound<'_, PyAny>)>,
        hostname: Option<String>,
        cwd: Option<PathBuf>,
    ) -> PyResult<Instance> {
        let options = self.options(mounts, hostname, cwd)?;
        self.event_loop.set(None);
        let sandbox = self.inner.clone();
        block_on(py, async move {
            sandbox.boot_with(options).await.map(Instance::new)
        })
    }

    /// Restores `snapshot` as a new instance (awaitable).
    fn restore<'py>(
        &self,
        py: Python<'py>,
        snapshot: PyRef<'py, crate::snapshot::Snapshot>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.event_loop
            .set(Some(pyo3_async_runtimes::tokio::get_current_locals(py)?));
        let (sandbox, snapshot) = (self.inner.clone(), snapshot.inner.clone());
        awaitable(py, crate::snapshot::restore(sandbox, snapshot))
    }

    /// `restore`, waiting here with the GIL released.
    fn restore_blocking(
        &self,
        py: Python<'_>,
        snapshot: PyRef<'_, crate::snapshot::Snapshot>,
    ) -> PyResult<Instance> {
        self.event_loop.set(None);
        let (sandbox, snapshot) = (self.inner.clone(), snapshot.inner.clone());
        block_on(py, crate::snapshot::restore(sandbox, snapshot))
    }

    /// A warm pool of `size` instances of this definition, booting in the background.
    /// Callbacks' coroutines run on the running loop, if any (else by `asyncio.run`).
    fn pool(&self, py: Python<'_>, size: usize) -> PyResult<crate::pool::Pool> {
        self.event_loop
            .set(pyo3_async_runtimes::tokio::get_current_locals(py).ok());
        crate::pool::Pool::new(&self.inner, size)
    }

    fn __repr__(&self) -> String {
        format!("Sandbox(rootfs={:?})", self.inner.rootfs())
    }
}

impl Sandbox {
    /// One boot's options.
    fn options(
        &self,
        mounts: Vec<(String, Bound<'_, PyAny>)>,
        hostname: Option<String>,
        cwd: Option<PathBuf>,
    ) -> PyResult<krunbox::BootOptions> {
        let mut options =
            krunbox::BootOptions::new().with_mounts(crate::fs::mounts(mounts, &self.event_loop)?);
        if let Some(hostname) = hostname {
            options = options.hostname(hostname);
        }
        if let Some(cwd) = cwd {
            options = options.current_dir(cwd);
        }
        Ok(options)
    }
}
