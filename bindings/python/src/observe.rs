//! What an instance tells about itself: its confinement, its resource use, its published
//! ports and its network's audit events.

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use krunbox::net::NetworkEvent;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{broadcast, Mutex};

use crate::instance::Instance;
use crate::net::Flow;
use crate::runtime::{awaitable, block_on};

/// `value` as Python objects, through JSON (what the library's report types serialize to).
pub(crate) fn to_python<'py>(
    py: Python<'py>,
    value: &impl serde::Serialize,
) -> PyResult<Bound<'py, PyAny>> {
    let text = serde_json::to_string(value).map_err(|e| {
        pyo3::exceptions::PyRuntimeError::new_err(format!("cannot serialize a report: {e}"))
    })?;
    py.import("json")?.call_method1("loads", (text,))
}

#[pymethods]
impl Instance {
    /// The VMM helper's confinement as a dict: each isolation layer (`layer`, `enforced`,
    /// `detail`), each canary the helper tried and whether it was `blocked`.
    fn isolation<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_python(py, self.inner.isolation())
    }

    /// What the instance uses now, as a dict: `cpu_time` (`secs`, `nanos`), `memory_bytes`,
    /// `memory_peak_bytes`, disk and network totals, host descriptors, the writable root's
    /// held bytes.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let metrics = self.inner.metrics().map_err(crate::errors::to_py)?;
        to_python(py, &metrics)
    }

    /// The host address (`("127.0.0.1", port)`) where the guest's TCP `guest_port` is
    /// published; `None` if it is not.
    fn published_address(&self, guest_port: u16) -> Option<(String, u16)> {
        let address = self.inner.published_address(guest_port)?;
        Some((address.ip().to_string(), address.port()))
    }

    /// The network's audit events from now on (`None` without a network).
    fn network_events(&self) -> Option<NetworkEvents> {
        let events = self.inner.network_events()?;
        Some(NetworkEvents(Arc::new(Mutex::new(events))))
    }
}

/// A subscription to an instance's network audit events.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct NetworkEvents(Arc<Mutex<broadcast::Receiver<NetworkEvent>>>);

/// An event, or how many were missed, or the end; made a dict with the GIL.
enum Next {
    Event(Box<NetworkEvent>),
    Missed(u64),
    End,
}

async fn next(events: Arc<Mutex<broadcast::Receiver<NetworkEvent>>>) -> krunbox::Result<Next> {
    Ok(match events.lock().await.recv().await {
        Ok(event) => Next::Event(Box::new(event)),
        Err(RecvError::Lagged(missed)) => Next::Missed(missed),
        Err(RecvError::Closed) => Next::End,
    })
}

fn seconds(at: std::time::SystemTime) -> f64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl<'py> IntoPyObject<'py> for Next {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let event = match self {
            Next::End => return Ok(py.None().into_bound(py)),
            Next::Missed(missed) => {
                let dict = PyDict::new(py);
                dict.set_item("type", "missed")?;
                dict.set_item("count", missed)?;
                return Ok(dict.into_any());
            }
            Next::Event(event) => event,
        };
        let dict = PyDict::new(py);
        match *event {
            NetworkEvent::Decided {
                at,
                flow,
                outcome,
                upstream,
            } => {
                dict.set_item("type", "decided")?;
                dict.set_item("at", seconds(at))?;
                dict.set_item("flow", Py::new(py, Flow::from(&flow))?)?;
                dict.set_item("outcome", outcome.to_string())?;
                dict.set_item("upstream", upstream.map(|a| a.to_string()))?;
            }
            NetworkEvent::Unreachable { at, flow, reason } => {
                dict.set_item("type", "unreachable")?;
                dict.set_item("at", seconds(at))?;
                dict.set_item("flow", Py::new(py, Flow::from(&flow))?)?;
                dict.set_item("reason", reason)?;
            }
            NetworkEvent::Published {
                at,
                guest_port,
                peer,
            } => {
                dict.set_item("type", "published")?;
                dict.set_item("at", seconds(at))?;
                dict.set_item("guest_port", guest_port)?;
                dict.set_item("peer", peer.to_string())?;
            }
            NetworkEvent::Request {
                at,
                hostname,
                port,
                method,
                path,
                status,
                outcome,
                secrets_swapped,
                placeholders_left,
                secrets_reflected,
            } => {
                dict.set_item("type", "request")?;
                dict.set_item("at", seconds(at))?;
                dict.set_item("hostname", hostname)?;
                dict.set_item("port", port)?;
                dict.set_item("method", method.as_str())?;
                dict.set_item("path", path)?;
                dict.set_item("status", status.map(|s| s.as_u16()))?;
                dict.set_item("outcome", outcome.to_string())?;
                dict.set_item("secrets_swapped", secrets_swapped)?;
                dict.set_item("placeholders_left", placeholders_left)?;
                dict.set_item("secrets_reflected", secrets_reflected)?;
            }
            _ => {
                dict.set_item("type", "other")?;
            }
        }
        Ok(dict.into_any())
    }
}

#[pymethods]
impl NetworkEvents {
    /// The next event as a dict (awaitable): `{"type": "decided" | "unreachable" |
    /// "published" | "request" | "missed", ...}`; `None` once the network has stopped.
    fn next<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, next(Arc::clone(&self.0)))
    }

    /// `next`, waiting here with the GIL released.
    fn next_blocking<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let next = block_on(py, next(Arc::clone(&self.0)))?;
        next.into_pyobject(py)
    }
}
