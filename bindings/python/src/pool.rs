//! `Pool`: instances of one definition booted ahead of need, each handed out once.

use std::sync::Mutex;

use pyo3::prelude::*;

use crate::instance::Instance;
use crate::runtime::{awaitable, block_on};

/// A warm pool (the crate's `krunbox::Pool`).
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct Pool {
    /// `None` once shut down.
    inner: Mutex<Option<std::sync::Arc<krunbox::Pool>>>,
}

impl Pool {
    pub(crate) fn new(sandbox: &krunbox::Sandbox, size: usize) -> PyResult<Pool> {
        // The pool's task runs on the one runtime every call of this module uses.
        let _entered = pyo3_async_runtimes::tokio::get_runtime().enter();
        let pool = krunbox::Pool::new(sandbox, size).map_err(crate::errors::to_py)?;
        Ok(Pool {
            inner: Mutex::new(Some(std::sync::Arc::new(pool))),
        })
    }

    fn pool(&self) -> PyResult<std::sync::Arc<krunbox::Pool>> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| crate::errors::InvalidConfig::new_err("this pool was shut down"))
    }
}

#[pymethods]
impl Pool {
    /// A running instance that never ran anything (awaitable).
    fn take<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let pool = self.pool()?;
        awaitable(py, async move { pool.take().await.map(Instance::new) })
    }

    /// `take`, waiting here with the GIL released.
    fn take_blocking(&self, py: Python<'_>) -> PyResult<Instance> {
        let pool = self.pool()?;
        block_on(py, async move { pool.take().await.map(Instance::new) })
    }

    /// How many instances are ready now.
    fn ready(&self) -> PyResult<usize> {
        Ok(self.pool()?.ready())
    }

    /// Why the last boot in the background failed, if it did.
    fn last_failure(&self) -> PyResult<Option<String>> {
        Ok(self.pool()?.last_failure())
    }

    /// Stops the pool and shuts down the instances still in it (awaitable). Idempotent.
    fn shutdown<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let pool = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        awaitable(py, async move {
            shut_down(pool).await;
            Ok(())
        })
    }

    /// `shutdown`, waiting here with the GIL released.
    fn shutdown_blocking(&self, py: Python<'_>) -> PyResult<()> {
        let pool = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        block_on(py, async move {
            shut_down(pool).await;
            Ok(())
        })
    }
}

/// Shuts `pool` down, also while a `take` under way holds it too.
async fn shut_down(pool: Option<std::sync::Arc<krunbox::Pool>>) {
    if let Some(pool) = pool {
        pool.close().await;
    }
}
