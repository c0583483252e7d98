//! `Sandbox`: a definition (root, resources), booted into instances as often as wanted.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;

use crate::callback::EventLoop;
use crate::errors::InvalidConfig;
use crate::instance::Instance;
use crate::runtime::{awaitable, block_on};

/// A sandbox definition: what each instance boots from. Cheap to boot many times.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct Sandbox {
    inner: krunbox::Sandbox,
    /// Where its network callbacks await their coroutines: the loop that booted it last.
    event_loop: Arc<EventLoop>,
}

/// The built-in image of `name`.
fn builtin(name: &str) -> PyResult<krunbox::BuiltinImage> {
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
impl Sandbox {
    /// A definition booting the built-in `image` ("agent" or "busybox") with `cpus` vCPUs and
    /// `memory_mib` of memory (the library's defaults when not given), and `hostname`.
    /// `artifacts` is the package's own directory of the run-time files it ships (the
    /// helper, guest-init): used where present, else the library's search order. `network`
    /// gives it a network (none without).
    #[new]
    #[pyo3(signature = (
        image = "agent", *, cpus = None, memory_mib = None, hostname = None, network = None,
        artifacts = None
    ))]
    fn new(
        py: Python<'_>,
        image: &str,
        cpus: Option<u8>,
        memory_mib: Option<u32>,
        hostname: Option<String>,
        network: Option<PyRef<'_, crate::net::Network>>,
        artifacts: Option<PathBuf>,
    ) -> PyResult<Self> {
        let event_loop = Arc::new(EventLoop::default());
        let mut builder =
            krunbox::Sandbox::builder().rootfs(krunbox::Rootfs::builtin(builtin(image)?));
        if let Some(dir) = artifacts {
            let (helper, guest_init) = (dir.join("bin/krunbox-vmm"), dir.join("guest-init"));
            if helper.is_file() {
                builder = builder.vmm_helper(helper);
            }
            if guest_init.is_file() {
                builder = builder.guest_init(guest_init);
            }
        }
        if let Some(cpus) = cpus {
            builder = builder.cpus(cpus);
        }
        if let Some(mib) = memory_mib {
            builder = builder.memory_mib(mib);
        }
        if let Some(hostname) = hostname {
            builder = builder.hostname(hostname);
        }
        if let Some(network) = network {
            builder = builder.network(network.build(py, &event_loop));
        }
        let inner = builder.build().map_err(crate::errors::to_py)?;
        Ok(Sandbox { inner, event_loop })
    }

    /// Boots an instance (awaitable). Its network callbacks' coroutines run on the loop
    /// awaiting this.
    fn boot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.event_loop
            .set(Some(pyo3_async_runtimes::tokio::get_current_locals(py)?));
        let sandbox = self.inner.clone();
        awaitable(py, async move { sandbox.boot().await.map(Instance::new) })
    }

    /// Boots an instance, waiting here with the GIL released. Its network callbacks'
    /// coroutines run by `asyncio.run`.
    fn boot_blocking(&self, py: Python<'_>) -> PyResult<Instance> {
        self.event_loop.set(None);
        let sandbox = self.inner.clone();
        block_on(py, async move { sandbox.boot().await.map(Instance::new) })
    }

    fn __repr__(&self) -> String {
        format!("Sandbox(rootfs={:?})", self.inner.rootfs())
    }
}
