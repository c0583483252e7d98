//! HTTP middleware written in Python: a callable that gets each intercepted request as a
//! `Request` and returns `None` (let it go on) or an `Answer` (sent to the guest instead).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use krunbox::net::{HeaderMap, HeaderName, HeaderValue, RequestHead, StatusCode};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::callback::{report, Callable};
use crate::errors::InvalidConfig;

/// An intercepted request on its way upstream. Its headers can be changed
/// (`set_header`, `remove_header`) until the middleware returns.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct Request {
    /// The trusted hostname it goes to (never taken from the request).
    #[pyo3(get)]
    hostname: String,
    /// "https" or "http".
    #[pyo3(get)]
    scheme: String,
    /// The method: "GET", "POST", ...
    #[pyo3(get)]
    method: String,
    /// The path and query.
    #[pyo3(get)]
    path: String,
    /// Shared with the call that made it, which copies them back onto the request.
    headers: Arc<Mutex<HeaderMap>>,
}

fn header_name(name: &str) -> PyResult<HeaderName> {
    HeaderName::try_from(name)
        .map_err(|_| InvalidConfig::new_err(format!("{name:?} is not an HTTP header name")))
}

#[pymethods]
impl Request {
    /// The headers, as a dict of name (lowercase) to value (several values joined by ", ";
    /// values that are not text left out).
    #[getter]
    fn headers(&self) -> BTreeMap<String, String> {
        let headers = self.headers.lock().unwrap_or_else(|e| e.into_inner());
        let mut joined = BTreeMap::new();
        for name in headers.keys() {
            let values: Vec<&str> = headers
                .get_all(name)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            if !values.is_empty() {
                joined.insert(name.as_str().to_owned(), values.join(", "));
            }
        }
        joined
    }

    /// Sets header `name` to `value`, replacing what the guest sent.
    fn set_header(&self, name: &str, value: &str) -> PyResult<()> {
        let value = HeaderValue::from_str(value).map_err(|_| {
            InvalidConfig::new_err(format!("the value for {name:?} is not a header value"))
        })?;
        let name = header_name(name)?;
        self.headers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name, value);
        Ok(())
    }

    /// Removes header `name`.
    fn remove_header(&self, name: &str) -> PyResult<()> {
        let name = header_name(name)?;
        self.headers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "Request({} {}://{}{})",
            self.method, self.scheme, self.hostname, self.path
        )
    }
}

/// What middleware answers a request with instead of sending it upstream: an HTTP status and
/// a short text.
#[pyclass(module = "krunbox._krunbox", frozen, get_all)]
pub(crate) struct Answer {
    status: u16,
    text: String,
}

#[pymethods]
impl Answer {
    #[new]
    #[pyo3(signature = (status, text = String::new()))]
    fn new(status: u16, text: String) -> PyResult<Self> {
        // 1xx are not final answers: a request answered so could not end.
        if !(200..=999).contains(&status) || StatusCode::from_u16(status).is_err() {
            return Err(InvalidConfig::new_err(format!(
                "{status} is not an HTTP status an answer can have (200 to 999)"
            )));
        }
        Ok(Answer { status, text })
    }

    fn __repr__(&self) -> String {
        format!("Answer({}, {:?})", self.status, self.text)
    }
}

/// A Python callable as the library's middleware.
pub(crate) struct PythonMiddleware(pub(crate) Arc<Callable>);

#[krunbox::net::async_trait]
impl krunbox::net::Middleware for PythonMiddleware {
    async fn handle(&self, head: &mut RequestHead) -> Option<krunbox::net::Answer> {
        let headers = Arc::new(Mutex::new(head.headers().clone()));
        let request = Request {
            hostname: head.hostname().to_owned(),
            scheme: head.scheme().as_str().to_owned(),
            method: head.method().as_str().to_owned(),
            path: head.path().to_owned(),
            headers: Arc::clone(&headers),
        };
        let answered = self
            .0
            .call(
                move |py| PyTuple::new(py, [Py::new(py, request)?]),
                |result| {
                    if result.is_none() {
                        return Ok(None);
                    }
                    let answer = result.cast::<Answer>()?.get();
                    let status = StatusCode::from_u16(answer.status).expect("checked in new");
                    Ok(Some(krunbox::net::Answer::new(status, answer.text.clone())))
                },
            )
            .await;
        match answered {
            Ok(answer) => {
                *head.headers_mut() =
                    std::mem::take(&mut *headers.lock().unwrap_or_else(|e| e.into_inner()));
                answer
            }
            Err(error) => {
                report(error, "HTTP middleware", "the request is answered 500").await;
                Some(krunbox::net::Answer::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the sandbox's middleware failed on this request\n",
                ))
            }
        }
    }
}
