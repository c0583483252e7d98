//! Calling the caller's code: network policies, middleware, `VirtualFs` and `BlockStore`
//! implementations are foreign code to the library. A panic there must cost only the one
//! flow, request or call it was made for (denied, answered with an error), never the task that
//! serves the whole sandbox; each such panic is reported with its message.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;

/// A callback panicked: its message, for the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Panicked(pub String);

impl std::fmt::Display for Panicked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The text of a panic's payload (`panic!` gives a `&str` or a `String`).
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a payload that is not text".into())
}

/// Runs `call` (which makes the callback's future) and awaits that future, turning a panic in
/// either into [`Panicked`].
pub(crate) async fn guarded<F, Fut>(call: F) -> Result<Fut::Output, Panicked>
where
    F: FnOnce() -> Fut,
    Fut: Future,
{
    match std::panic::catch_unwind(AssertUnwindSafe(call)) {
        Ok(future) => AssertUnwindSafe(future)
            .catch_unwind()
            .await
            .map_err(|payload| Panicked(panic_message(&*payload))),
        Err(payload) => Err(Panicked(panic_message(&*payload))),
    }
}

/// Runs a synchronous callback, turning a panic into [`Panicked`].
pub(crate) fn guarded_sync<T>(call: impl FnOnce() -> T) -> Result<T, Panicked> {
    std::panic::catch_unwind(AssertUnwindSafe(call))
        .map_err(|payload| Panicked(panic_message(&*payload)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_in_the_call_or_its_future_is_caught_with_its_message() {
        let made = guarded(|| -> std::future::Ready<u8> { panic!("in the call") }).await;
        assert_eq!(made, Err(Panicked("in the call".into())));
        let awaited = guarded(|| async {
            tokio::task::yield_now().await;
            panic!("in the future {}", 7)
        })
        .await;
        assert_eq!(awaited, Err::<(), _>(Panicked("in the future 7".into())));
        assert_eq!(guarded(|| async { 5 }).await, Ok(5));
        assert_eq!(guarded_sync(|| 6), Ok(6));
        assert_eq!(
            guarded_sync(|| -> u8 { panic!("sync") }),
            Err(Panicked("sync".into()))
        );
    }
}
