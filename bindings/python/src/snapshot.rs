//! Snapshots for Python: `Snapshot` (opened and checked), an instance's `snapshot`, `fork`,
//! `processes` and `attach`, and a definition's `restore`.

use std::path::PathBuf;

use pyo3::prelude::*;

use crate::instance::Instance;
use crate::runtime::{awaitable, block_on};

/// A snapshot on disk, its manifest checked (`Snapshot.open`).
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct Snapshot {
    pub(crate) inner: krunbox::Snapshot,
}

#[pymethods]
impl Snapshot {
    /// Opens the snapshot in `dir`, checking its manifest with the key in `key_dir`.
    #[staticmethod]
    fn open(dir: PathBuf, key_dir: PathBuf) -> PyResult<Snapshot> {
        krunbox::Snapshot::open(dir, key_dir)
            .map(|inner| Snapshot { inner })
            .map_err(crate::errors::to_py)
    }

    /// Its directory.
    #[getter]
    fn dir(&self) -> PathBuf {
        self.inner.dir().to_path_buf()
    }

    /// SHA-256 of its manifest (hex).
    #[getter]
    fn digest(&self) -> String {
        self.inner.digest().to_owned()
    }

    /// Hashes every part (with the GIL released): `SnapshotTampered` names one that changed.
    fn verify(&self, py: Python<'_>) -> PyResult<()> {
        let snapshot = self.inner.clone();
        py.detach(move || snapshot.verify())
            .map_err(crate::errors::to_py)
    }

    fn __repr__(&self) -> String {
        format!("Snapshot({:?})", self.inner.dir())
    }
}

#[pymethods]
impl Instance {
    /// Writes a snapshot of the instance into the new directory `dir` (awaitable).
    fn snapshot<'py>(&self, py: Python<'py>, dir: PathBuf) -> PyResult<Bound<'py, PyAny>> {
        let instance = self.inner.clone();
        awaitable(py, async move {
            instance.snapshot(dir).await.map(|inner| Snapshot { inner })
        })
    }

    /// `snapshot`, waiting here with the GIL released.
    fn snapshot_blocking(&self, py: Python<'_>, dir: PathBuf) -> PyResult<Snapshot> {
        let instance = self.inner.clone();
        block_on(py, async move {
            instance.snapshot(dir).await.map(|inner| Snapshot { inner })
        })
    }

    /// Forks the instance into `n` new ones (awaitable).
    fn fork<'py>(&self, py: Python<'py>, n: usize) -> PyResult<Bound<'py, PyAny>> {
        let instance = self.inner.clone();
        awaitable(py, async move {
            let forks = instance.fork(n).await?;
            Ok(forks.into_iter().map(Instance::new).collect::<Vec<_>>())
        })
    }

    /// `fork`, waiting here with the GIL released.
    fn fork_blocking(&self, py: Python<'_>, n: usize) -> PyResult<Vec<Instance>> {
        let instance = self.inner.clone();
        block_on(py, async move {
            let forks = instance.fork(n).await?;
            Ok(forks.into_iter().map(Instance::new).collect())
        })
    }

    /// The guest pids of a restored instance's processes not attached yet.
    fn processes(&self) -> Vec<u32> {
        self.inner.processes()
    }

    /// Takes over process `pid` of a restored instance.
    fn attach(&self, pid: u32) -> PyResult<crate::process::Process> {
        let child = self.inner.attach(pid).map_err(crate::errors::to_py)?;
        Ok(crate::process::Process::new(
            child,
            krunbox::CancellationToken::new(),
        ))
    }
}

/// A definition's `restore`, for `sandbox.rs`.
pub(crate) async fn restore(
    sandbox: krunbox::Sandbox,
    snapshot: krunbox::Snapshot,
) -> krunbox::Result<Instance> {
    sandbox.restore(&snapshot).await.map(Instance::new)
}
