//! Calling the user's Python callables (a network policy, middleware) from the library's tasks.
//!
//! A callable is foreign code: it may be slow, raise, or return a coroutine. So a call
//! - never holds a tokio worker: the call itself (and turning its result into Rust values)
//!   runs on tokio's blocking pool, where waiting for the GIL blocks nothing else;
//! - awaits a coroutine on the event loop that booted the instance (the user's `asyncio`
//!   loop, where their objects live), without a thread waiting for it; under the sync API,
//!   which has no loop, `asyncio.run` runs it on the blocking pool;
//! - returns a raised exception as an `Err` for the caller to turn into the verdict its
//!   library call has for a failure (deny the flow, answer the request 500), after
//!   [`report`]ing it.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use pyo3_async_runtimes::TaskLocals;
use tokio::sync::Semaphore;

/// Where a sandbox's callables run their coroutines: the event loop of the `asyncio` task that
/// booted it last (none after a boot by the sync API). Shared by a sandbox and its callbacks;
/// a block store written in Python has its own, which follows the loop of each sandbox it is
/// given to (it serves one instance at a time).
#[derive(Default)]
pub(crate) struct EventLoop {
    locals: Mutex<Option<TaskLocals>>,
    followers: Mutex<Vec<std::sync::Weak<EventLoop>>>,
}

impl EventLoop {
    /// From now on, coroutines run on the loop of `locals` (or, for `None`, by `asyncio.run`),
    /// here and in every follower.
    pub(crate) fn set(&self, locals: Option<TaskLocals>) {
        let followers: Vec<Arc<EventLoop>> = {
            let mut followers = self.followers.lock().unwrap_or_else(|e| e.into_inner());
            followers.retain(|f| f.strong_count() > 0);
            followers
                .iter()
                .filter_map(std::sync::Weak::upgrade)
                .collect()
        };
        for follower in followers {
            follower.set(locals.clone());
        }
        *self.locals.lock().unwrap_or_else(|e| e.into_inner()) = locals;
    }

    /// Makes `follower` take this loop whenever it is set.
    pub(crate) fn lead(&self, follower: &Arc<EventLoop>) {
        let mut followers = self.followers.lock().unwrap_or_else(|e| e.into_inner());
        followers.push(Arc::downgrade(follower));
    }

    fn get(&self) -> Option<TaskLocals> {
        self.locals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// How many calls into one Python object (a filesystem, a store, a network's policy and
/// middleware) may wait or run at once; more wait for a turn. Each running plain call holds a
/// thread of tokio's blocking pool, which the library's own blocking work shares: a guest
/// cannot fill it through one mount or network.
pub(crate) const CALLS_AT_ONCE: usize = 64;

/// A fresh bound of [`CALLS_AT_ONCE`] calls, for one Python object's callables to share.
pub(crate) fn calls_bound() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(CALLS_AT_ONCE))
}

/// A user's Python callable, the loop its coroutines run on, and the bound it shares with
/// the other callables of its object.
pub(crate) struct Callable {
    function: Py<PyAny>,
    event_loop: Arc<EventLoop>,
    calls: Arc<Semaphore>,
}

type Pending = Pin<Box<dyn Future<Output = PyResult<Py<PyAny>>> + Send>>;

/// What calling the function gave: a value, or an awaitable under way on the event loop.
enum Called {
    Value(Py<PyAny>),
    Awaiting(Pending),
}

impl Callable {
    pub(crate) fn new(
        function: Py<PyAny>,
        event_loop: Arc<EventLoop>,
        calls: Arc<Semaphore>,
    ) -> Self {
        Callable {
            function,
            event_loop,
            calls,
        }
    }

    /// Calls the function with the arguments `args` makes, awaits what it returns if that is
    /// awaitable, and gives the result to `convert`; all of it off tokio's workers.
    pub(crate) async fn call<T, A, C>(self: &Arc<Self>, args: A, convert: C) -> PyResult<T>
    where
        T: Send + 'static,
        A: for<'py> FnOnce(Python<'py>) -> PyResult<Bound<'py, PyTuple>> + Send + 'static,
        C: for<'py> FnOnce(&Bound<'py, PyAny>) -> PyResult<T> + Send + 'static,
    {
        // The bound is never closed, so a turn always comes.
        let _turn = self.calls.acquire().await;
        let this = Arc::clone(self);
        let called = off_the_workers(move || Python::attach(|py| this.start(py, args))).await?;
        let value = match called {
            Called::Value(value) => value,
            Called::Awaiting(pending) => pending.await?,
        };
        off_the_workers(move || Python::attach(|py| convert(value.bind(py)))).await
    }

    fn start<'py, A>(&self, py: Python<'py>, args: A) -> PyResult<Called>
    where
        A: FnOnce(Python<'py>) -> PyResult<Bound<'py, PyTuple>>,
    {
        let result = self.function.bind(py).call1(args(py)?)?;
        let awaitable = py
            .import("inspect")?
            .call_method1("isawaitable", (&result,))?
            .is_truthy()?;
        if !awaitable {
            return Ok(Called::Value(result.unbind()));
        }
        match self.event_loop.get() {
            Some(locals) => {
                let pending = pyo3_async_runtimes::into_future_with_locals(&locals, result)?;
                Ok(Called::Awaiting(Box::pin(pending)))
            }
            None => {
                // asyncio.run takes only a coroutine: any awaitable is awaited in one.
                let coroutine = py
                    .import("krunbox._support")?
                    .call_method1("awaited", (result,))?;
                let value = py.import("asyncio")?.call_method1("run", (coroutine,))?;
                Ok(Called::Value(value.unbind()))
            }
        }
    }
}

/// Runs `inspect` with the GIL on tokio's blocking pool: how the callers look at what a
/// callback raised without taking the GIL on a worker.
pub(crate) async fn with_gil<T: Send + 'static>(
    inspect: impl FnOnce(Python<'_>) -> T + Send + 'static,
) -> PyResult<T> {
    off_the_workers(move || Ok(Python::attach(inspect))).await
}

/// Runs `work` on tokio's blocking pool (a panic in it, which PyO3 turns into an exception
/// first, still comes back as an error).
async fn off_the_workers<T: Send + 'static>(
    work: impl FnOnce() -> PyResult<T> + Send + 'static,
) -> PyResult<T> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|e| Err(PyRuntimeError::new_err(format!("a callback failed: {e}"))))
}

/// Reports what a callback raised on the `krunbox` logger (`logging.getLogger("krunbox")`),
/// with its traceback: `what` raised, so `consequence`. Off tokio's workers, as the call was.
pub(crate) async fn report(error: PyErr, what: &'static str, consequence: &'static str) {
    let logged = off_the_workers(move || {
        log(error, what, consequence);
        Ok(())
    });
    let _ = logged.await;
}

fn log(error: PyErr, what: &str, consequence: &str) {
    Python::attach(|py| {
        let logged = (|| -> PyResult<()> {
            let logger = py
                .import("logging")?
                .call_method1("getLogger", ("krunbox",))?;
            let kwargs = PyDict::new(py);
            kwargs.set_item("exc_info", error.clone_ref(py).into_value(py))?;
            logger.call_method(
                "error",
                ("%s raised %r: %s", what, error.value(py), consequence),
                Some(&kwargs),
            )?;
            Ok(())
        })();
        if logged.is_err() {
            // No logging to be had (the interpreter is shutting down): the library's log.
            tracing::error!(target: "krunbox::python", "{what} raised {error}: {consequence}");
        }
    })
}
