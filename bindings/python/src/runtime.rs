//! Where the library's futures run: one tokio runtime for the process (pyo3-async-runtimes'),
//! for awaitables and blocking calls alike.

use std::future::Future;

use pyo3::prelude::*;

use crate::errors::to_py;

/// Runs `future` to its end on the runtime, the GIL released meanwhile (other Python threads
/// go on; a callback of this future's that needs the GIL can take it).
pub(crate) fn block_on<T, F>(py: Python<'_>, future: F) -> PyResult<T>
where
    F: Future<Output = krunbox::Result<T>> + Send,
    T: Send,
{
    let runtime = pyo3_async_runtimes::tokio::get_runtime();
    py.detach(|| runtime.block_on(future)).map_err(to_py)
}

/// `future` as an asyncio awaitable. Cancelling the awaiting task drops the future, which the
/// library takes as cancellation (a command's process group is killed).
pub(crate) fn awaitable<'py, T, F>(py: Python<'py>, future: F) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = krunbox::Result<T>> + Send + 'static,
    T: for<'a> IntoPyObject<'a> + Send + 'static,
{
    pyo3_async_runtimes::tokio::future_into_py(py, async move { future.await.map_err(to_py) })
}
