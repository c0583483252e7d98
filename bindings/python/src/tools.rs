//! `krunbox.Toolbox`: the crate's agent tools (`krunbox::tools`) over an instance, for Python
//! agent frameworks: the definitions to give a model, a dispatcher for its calls, permissions
//! with a Python approver, and the audit events.

use std::sync::Arc;

use krunbox::tools::{Approval, ApprovalRequest, AuditEvent, Permissions};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{broadcast, Mutex};

use crate::callback::{calls_bound, report, Callable, EventLoop};
use crate::instance::Instance;
use crate::observe::to_python;
use crate::runtime::{awaitable, block_on};

/// The tools over one instance.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct Toolbox {
    inner: krunbox::tools::Toolbox,
}

/// What one call returned: `text` for the model, `is_error` when it should change course.
#[pyclass(module = "krunbox._krunbox", frozen, get_all)]
pub(crate) struct ToolResult {
    /// The result's text (bounded; says where it was cut).
    text: String,
    /// The call failed.
    is_error: bool,
}

/// A Python callable answering `ask` rules: `approver(request) -> bool | str` (or a coroutine
/// of one); a string refuses with that reason; an exception refuses (and is logged).
struct PythonApprover {
    callable: Arc<Callable>,
}

#[krunbox::tools::async_trait]
impl krunbox::tools::Approver for PythonApprover {
    async fn approve(&self, request: ApprovalRequest) -> Approval {
        let fields = serde_json::json!({
            "tool": request.tool,
            "arguments": request.arguments,
            "rule": request.rule,
        });
        let answer = self
            .callable
            .call(
                move |py| PyTuple::new(py, [to_python(py, &fields)?]),
                |value| {
                    if let Ok(approved) = value.extract::<bool>() {
                        return Ok(if approved {
                            Approval::Approve
                        } else {
                            Approval::Refuse(None)
                        });
                    }
                    match value.extract::<String>() {
                        Ok(reason) => Ok(Approval::Refuse(Some(reason))),
                        Err(_) => Ok(Approval::Refuse(Some(format!(
                            "the approver returned {}, not a bool or a reason",
                            value.get_type().name()?
                        )))),
                    }
                },
            )
            .await;
        match answer {
            Ok(approval) => approval,
            Err(error) => {
                report(error, "the tools' approver", "the call was refused").await;
                Approval::Refuse(Some("the approver raised an exception".into()))
            }
        }
    }
}

#[pymethods]
impl Toolbox {
    /// `permissions` is the JSON of `krunbox::tools::Permissions` (`{"mode": ..., "rules":
    /// [...]}`); `approver` is called for `ask` rules.
    #[new]
    #[pyo3(signature = (instance, *, workspace = "/", permissions = None, approver = None, output_cap = None, blocking = false))]
    fn new(
        py: Python<'_>,
        instance: &Instance,
        workspace: &str,
        permissions: Option<&str>,
        approver: Option<Py<PyAny>>,
        output_cap: Option<usize>,
        blocking: bool,
    ) -> PyResult<Self> {
        let permissions: Permissions = match permissions {
            Some(json) => serde_json::from_str(json)
                .map_err(|e| PyValueError::new_err(format!("permissions: {e}")))?,
            None => Permissions::default(),
        };
        let mut builder = krunbox::tools::Toolbox::builder(&instance.inner)
            .workspace(workspace)
            .permissions(permissions);
        if let Some(cap) = output_cap {
            builder = builder.output_cap(cap);
        }
        if let Some(function) = approver {
            // Coroutines run on the loop that made the toolbox; under the sync API (whose calls
            // block the thread a loop would run on) by `asyncio.run`.
            let event_loop = Arc::new(EventLoop::default());
            if !blocking {
                event_loop.set(pyo3_async_runtimes::tokio::get_current_locals(py).ok());
            }
            let callable = Callable::new(function, event_loop, calls_bound());
            builder = builder.approver(PythonApprover {
                callable: Arc::new(callable),
            });
        }
        Ok(Toolbox {
            inner: builder.build(),
        })
    }

    /// The tools' definitions as dicts in `format`: "mcp", "openai" or "anthropic".
    fn definitions<'py>(&self, py: Python<'py>, format: &str) -> PyResult<Bound<'py, PyAny>> {
        let shape = shape(format)?;
        let tools: Vec<serde_json::Value> = self.inner.definitions().iter().map(shape).collect();
        to_python(py, &tools)
    }

    /// Runs one call (awaitable): the tool's name and its arguments as JSON text.
    fn call<'py>(
        &self,
        py: Python<'py>,
        name: String,
        arguments: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let arguments = parse_arguments(arguments)?;
        let tools = self.inner.clone();
        awaitable(
            py,
            async move { Ok(result(tools.call(&name, arguments).await)) },
        )
    }

    /// `call`, waiting here with the GIL released.
    fn call_blocking(&self, py: Python<'_>, name: String, arguments: &str) -> PyResult<ToolResult> {
        let arguments = parse_arguments(arguments)?;
        let tools = self.inner.clone();
        block_on(
            py,
            async move { Ok(result(tools.call(&name, arguments).await)) },
        )
    }

    /// Every permission decision from now on.
    fn audit_events(&self) -> AuditEvents {
        AuditEvents(Arc::new(Mutex::new(self.inner.audit_events())))
    }
}

/// Every tool's definition in `format`, as JSON text (no instance needed).
#[pyfunction]
pub(crate) fn tool_definitions(format: &str) -> PyResult<String> {
    let shape = shape(format)?;
    let tools: Vec<serde_json::Value> = krunbox::tools::definitions().iter().map(shape).collect();
    Ok(serde_json::Value::Array(tools).to_string())
}

fn shape(format: &str) -> PyResult<fn(&krunbox::tools::ToolDefinition) -> serde_json::Value> {
    Ok(match format {
        "mcp" => krunbox::tools::ToolDefinition::to_mcp,
        "openai" => krunbox::tools::ToolDefinition::to_openai,
        "anthropic" => krunbox::tools::ToolDefinition::to_anthropic,
        other => {
            return Err(PyValueError::new_err(format!(
                "format {other:?}: \"mcp\", \"openai\" or \"anthropic\""
            )))
        }
    })
}

fn parse_arguments(arguments: &str) -> PyResult<serde_json::Value> {
    serde_json::from_str(arguments)
        .map_err(|e| PyValueError::new_err(format!("the arguments are not JSON: {e}")))
}

fn result(done: krunbox::tools::ToolResult) -> ToolResult {
    ToolResult {
        text: done.text,
        is_error: done.is_error,
    }
}

impl ToolResult {
    fn library(&self) -> krunbox::tools::ToolResult {
        krunbox::tools::ToolResult::new(self.text.clone(), self.is_error)
    }
}

#[pymethods]
impl ToolResult {
    #[new]
    #[pyo3(signature = (text, is_error = false))]
    fn py_new(text: String, is_error: bool) -> Self {
        ToolResult { text, is_error }
    }

    /// An MCP `CallToolResult` dict.
    fn to_mcp<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_python(py, &self.library().to_mcp())
    }

    /// An OpenAI tool message answering `call_id`.
    fn to_openai<'py>(&self, py: Python<'py>, call_id: &str) -> PyResult<Bound<'py, PyAny>> {
        to_python(py, &self.library().to_openai(call_id))
    }

    /// An Anthropic `tool_result` block answering `tool_use_id`.
    fn to_anthropic<'py>(&self, py: Python<'py>, tool_use_id: &str) -> PyResult<Bound<'py, PyAny>> {
        to_python(py, &self.library().to_anthropic(tool_use_id))
    }

    fn __repr__(&self) -> String {
        format!(
            "ToolResult(text={:?}, is_error={})",
            self.text, self.is_error
        )
    }
}

/// A subscription to a toolbox's permission decisions.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct AuditEvents(Arc<Mutex<broadcast::Receiver<AuditEvent>>>);

/// The next event as JSON-shaped data, a count of missed ones, or the end.
async fn next(
    events: Arc<Mutex<broadcast::Receiver<AuditEvent>>>,
) -> krunbox::Result<serde_json::Value> {
    Ok(match events.lock().await.recv().await {
        Ok(event) => serde_json::to_value(&event).unwrap_or(serde_json::Value::Null),
        Err(RecvError::Lagged(missed)) => serde_json::json!({"missed": missed}),
        Err(RecvError::Closed) => serde_json::Value::Null,
    })
}

/// JSON-shaped data that becomes Python objects when it reaches Python.
struct Json(serde_json::Value);

impl<'py> IntoPyObject<'py> for Json {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_python(py, &self.0)
    }
}

#[pymethods]
impl AuditEvents {
    /// The next decision (awaitable) as a dict (`tool`, `subject`, `decision`, `by`, `reason`,
    /// `at`); `{"missed": n}` after falling behind; `None` once the toolbox is gone.
    fn next<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let events = Arc::clone(&self.0);
        awaitable(py, async move { next(events).await.map(Json) })
    }

    /// `next`, waiting here with the GIL released.
    fn next_blocking<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let value = block_on(py, next(Arc::clone(&self.0)))?;
        to_python(py, &value)
    }
}
