//! A network policy written in Python: a callable that gets each new `Flow` and returns a
//! `Verdict` (or `True` / `False`), directly or from a coroutine.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyTuple};

use super::flow::{Decision, Flow, Verdict};
use super::middleware::PythonMiddleware;
use crate::callback::{calls_bound, report, Callable, EventLoop};
use tokio::sync::Semaphore;

/// A Python callable as the library's policy. What it raises denies the flow it was asked
/// about, and nothing else.
pub(crate) struct PythonPolicy {
    callable: Arc<Callable>,
    event_loop: Arc<EventLoop>,
    /// The bound the policy and its middleware share.
    calls: Arc<Semaphore>,
}

impl PythonPolicy {
    pub(crate) fn new(function: Py<PyAny>, event_loop: Arc<EventLoop>) -> Self {
        let calls = calls_bound();
        let callable = Callable::new(function, Arc::clone(&event_loop), Arc::clone(&calls));
        PythonPolicy {
            callable: Arc::new(callable),
            event_loop,
            calls,
        }
    }
}

/// A grant of a flow as it is: for a DNS query, an answer from the host's own resolver.
fn accept(dns: bool) -> krunbox::net::Verdict {
    if dns {
        krunbox::net::Verdict::resolve(krunbox::net::Resolver::system())
    } else {
        krunbox::net::Verdict::accept()
    }
}

/// The verdict a policy's result stands for: a `Verdict`, or a bool (accept or deny), on a
/// flow that is a DNS query or not (`dns`).
fn verdict(
    result: &Bound<'_, PyAny>,
    dns: bool,
    event_loop: &Arc<EventLoop>,
    calls: &Arc<Semaphore>,
) -> PyResult<krunbox::net::Verdict> {
    if let Ok(granted) = result.cast::<PyBool>() {
        return Ok(if granted.is_true() {
            accept(dns)
        } else {
            krunbox::net::Verdict::deny()
        });
    }
    let verdict = result.cast::<Verdict>()?.get();
    Ok(match &verdict.decision {
        Decision::Ready(verdict) => verdict.clone(),
        Decision::Accept => accept(dns),
        Decision::Intercept(middleware) => {
            let py = result.py();
            let mut intercept = krunbox::net::Intercept::new();
            for function in middleware {
                let callable = Callable::new(
                    function.clone_ref(py),
                    Arc::clone(event_loop),
                    Arc::clone(calls),
                );
                intercept = intercept.middleware(PythonMiddleware(Arc::new(callable)));
            }
            krunbox::net::Verdict::intercept(intercept)
        }
    })
}

impl krunbox::net::Policy for PythonPolicy {
    fn decide(&self, flow: krunbox::net::Flow) -> krunbox::net::Decide {
        let callable = Arc::clone(&self.callable);
        let event_loop = Arc::clone(&self.event_loop);
        let calls = Arc::clone(&self.calls);
        let asked = Flow::from(&flow);
        let dns = flow.protocol() == krunbox::net::Protocol::Dns;
        Box::pin(async move {
            let decided = callable
                .call(
                    move |py| PyTuple::new(py, [Py::new(py, asked)?]),
                    move |result| verdict(result, dns, &event_loop, &calls),
                )
                .await;
            match decided {
                Ok(verdict) => verdict,
                Err(error) => {
                    report(error, "the network policy", "the flow is denied").await;
                    krunbox::net::Verdict::deny()
                }
            }
        })
    }
}
