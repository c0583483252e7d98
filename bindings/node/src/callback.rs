//! Calling the user's JavaScript callbacks (a network policy, HTTP middleware) from the
//! library's tasks.
//!
//! A callback is foreign code: it may be slow, throw, or return a Promise that rejects or
//! never settles. So:
//! - it is called through a thread-safe function, queued onto Node's event loop; no tokio
//!   worker waits for the loop, and the loop never waits for us;
//! - the TypeScript API hands us each callback wrapped so that it always returns a Promise
//!   (`ts/callback.ts`), which also reports what the user's code threw; a throw or a
//!   rejection comes back here as an `Err` for the caller to turn into its failure verdict
//!   (deny the flow, answer the request 500);
//! - its thread-safe function is weak: a sandbox definition holding a policy does not keep
//!   Node's process alive by itself;
//! - at most [`CALLS_AT_ONCE`] calls into one object wait or run at once, so that a guest
//!   opening flows cannot grow the loop's queue without bound;
//! - a call that has not settled after [`CALL_DEADLINE`] fails (its flow denied, its request
//!   answered 500, its file or store call EIO) and gives its turn back: a hung callback
//!   holds its own unit, and a turn, for a minute at most.

use std::sync::Arc;

use napi::bindgen_prelude::{FromNapiValue, Function, JsValuesTupleIntoVec, Promise};
use napi::threadsafe_function::{ThreadsafeFunction, ThreadsafeFunctionCallMode};
use napi::Status;
use tokio::sync::Semaphore;

/// How many calls into one JavaScript object (a network's policy and its middleware) may
/// wait or run at once; more wait for a turn.
pub(crate) const CALLS_AT_ONCE: usize = 64;

/// How long a callback may take before its call fails.
pub(crate) const CALL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

/// A thread-safe, weak JavaScript function taking `A` and returning a Promise of `R`.
type Tsfn<A, R> = ThreadsafeFunction<A, Promise<R>, A, Status, false, true>;

/// A JavaScript callback returning a Promise, callable from any tokio task.
pub(crate) struct Callback<A: 'static + JsValuesTupleIntoVec, R: 'static + FromNapiValue> {
    function: Tsfn<A, R>,
    calls: Arc<Semaphore>,
    deadline: std::time::Duration,
}

impl<A, R> Callback<A, R>
where
    A: 'static + JsValuesTupleIntoVec,
    R: 'static + FromNapiValue + Send,
{
    /// `function` as a callback sharing the bound `calls` with its object's others.
    pub(crate) fn new(
        function: &Function<'_, A, Promise<R>>,
        calls: Arc<Semaphore>,
    ) -> napi::Result<Self> {
        let function = function
            .build_threadsafe_function::<A>()
            .weak::<true>()
            .callee_handled::<false>()
            .build()?;
        Ok(Callback {
            function,
            calls,
            deadline: CALL_DEADLINE,
        })
    }

    /// The same, with a deadline of its own instead of [`CALL_DEADLINE`] (an approver waits
    /// for a person).
    pub(crate) fn with_deadline(mut self, deadline: std::time::Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// Calls it with `argument` and waits for its Promise, at most [`CALL_DEADLINE`]; `Err`
    /// says why it gave nothing (it threw, rejected or took too long, or Node is shutting
    /// down).
    pub(crate) async fn call(&self, argument: A) -> Result<R, String> {
        let called = async {
            let _turn = self.calls.acquire().await.map_err(|e| e.to_string())?;
            let promise = self
                .function
                .call_async_catch(argument)
                .await
                .map_err(|e| e.reason.clone())?;
            promise.await.map_err(|e| e.reason.clone())
        };
        let deadline = self.deadline;
        tokio::time::timeout(deadline, called)
            .await
            .unwrap_or_else(|_| Err(format!("it did not settle within {deadline:?}")))
    }
}

/// A fresh bound of [`CALLS_AT_ONCE`] calls, for one object's callbacks to share.
pub(crate) fn calls_bound() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(CALLS_AT_ONCE))
}

/// A JavaScript function told things and never asked anything back (releasing a
/// registration): called without waiting.
pub(crate) struct Notify<A: 'static + JsValuesTupleIntoVec> {
    function: ThreadsafeFunction<A, (), A, Status, false, true>,
}

impl<A: 'static + JsValuesTupleIntoVec> Notify<A> {
    pub(crate) fn new(function: &Function<'_, A, ()>) -> napi::Result<Self> {
        let function = function
            .build_threadsafe_function::<A>()
            .weak::<true>()
            .callee_handled::<false>()
            .build()?;
        Ok(Notify { function })
    }

    /// Queues a call with `argument` (dropped if Node is shutting down).
    pub(crate) fn send(&self, argument: A) {
        let _ = self
            .function
            .call(argument, ThreadsafeFunctionCallMode::NonBlocking);
    }
}
