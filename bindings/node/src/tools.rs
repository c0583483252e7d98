//! The crate's agent tools (`krunbox::tools`) over an instance, for JavaScript agent
//! frameworks: definitions for a model, a dispatcher for its calls, permissions with a
//! JavaScript approver (a callback like the others: `callback.rs`), the audit events.

use std::sync::Arc;

use krunbox::tools::{Approval, ApprovalRequest, AuditEvent, Permissions, ToolDefinition};
use napi::bindgen_prelude::{Function, Promise};
use napi_derive::napi;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{broadcast, Mutex};

use crate::callback::{calls_bound, Callback};
use crate::errors::invalid;
use crate::instance::NativeInstance;

/// What the approver is asked about: one call an `ask` rule holds.
#[napi(object)]
pub struct ApprovalInfo {
    /// The tool: "bash", "write", ...
    pub tool: String,
    /// The call's arguments.
    pub arguments: serde_json::Value,
    /// The rule that asks, e.g. "ask bash(curl:*)".
    pub rule: String,
}

/// The approver's answer (the TypeScript API makes it from `true`, `false` or a reason).
#[napi(object)]
pub struct ApprovalAnswer {
    /// Run the call.
    pub approve: bool,
    /// Why not, shown to the model.
    pub reason: Option<String>,
}

/// Options of a toolbox.
#[napi(object)]
pub struct ToolboxOptions {
    /// Where relative paths start and `bash` runs (default "/").
    pub workspace: Option<String>,
    /// `{mode, rules}`, as the crate's `Permissions` serialize.
    pub permissions: Option<serde_json::Value>,
    /// Bytes of text one result shows at most.
    pub output_cap: Option<u32>,
}

struct JsApprover {
    callback: Callback<ApprovalInfo, ApprovalAnswer>,
}

#[krunbox::tools::async_trait]
impl krunbox::tools::Approver for JsApprover {
    async fn approve(&self, request: ApprovalRequest) -> Approval {
        let info = ApprovalInfo {
            tool: request.tool.to_owned(),
            arguments: request.arguments,
            rule: request.rule,
        };
        match self.callback.call(info).await {
            Ok(ApprovalAnswer { approve: true, .. }) => Approval::Approve,
            Ok(ApprovalAnswer { reason, .. }) => Approval::Refuse(reason),
            Err(why) => Approval::Refuse(Some(format!("the approver failed: {why}"))),
        }
    }
}

/// The tools over one instance.
#[napi]
pub struct NativeToolbox {
    inner: krunbox::tools::Toolbox,
}

/// What one call returned.
#[napi]
pub struct NativeToolResult {
    inner: krunbox::tools::ToolResult,
}

#[napi]
impl NativeToolbox {
    #[napi(constructor)]
    pub fn new(
        instance: &NativeInstance,
        options: ToolboxOptions,
        approver: Option<Function<'_, ApprovalInfo, Promise<ApprovalAnswer>>>,
    ) -> napi::Result<Self> {
        let permissions: Permissions = match options.permissions {
            Some(value) => {
                serde_json::from_value(value).map_err(|e| invalid(format!("permissions: {e}")))?
            }
            None => Permissions::default(),
        };
        let mut builder = krunbox::tools::Toolbox::builder(&instance.inner)
            .workspace(options.workspace.unwrap_or_else(|| "/".into()))
            .permissions(permissions);
        if let Some(cap) = options.output_cap {
            builder = builder.output_cap(cap as usize);
        }
        if let Some(function) = approver {
            // A person may be asked: the toolbox's own approval deadline, not a callback's minute.
            let callback = Callback::new(&function, calls_bound())?
                .with_deadline(krunbox::tools::DEFAULT_APPROVAL_DEADLINE);
            builder = builder.approver(JsApprover { callback });
        }
        Ok(NativeToolbox {
            inner: builder.build(),
        })
    }

    /// The tools' definitions in `format`: "mcp", "openai" or "anthropic".
    #[napi]
    pub fn definitions(&self, format: String) -> napi::Result<serde_json::Value> {
        let shape = shape(&format)?;
        Ok(self.inner.definitions().iter().map(shape).collect())
    }

    /// Runs one call; never rejects for what the model sent.
    #[napi]
    pub async fn call(&self, name: String, arguments: serde_json::Value) -> NativeToolResult {
        NativeToolResult {
            inner: self.inner.call(&name, arguments).await,
        }
    }

    /// Every permission decision from now on.
    #[napi]
    pub fn audit_events(&self) -> NativeAuditEvents {
        NativeAuditEvents {
            events: Arc::new(Mutex::new(self.inner.audit_events())),
        }
    }
}

#[napi]
impl NativeToolResult {
    /// The text for the model.
    #[napi(getter)]
    pub fn text(&self) -> String {
        self.inner.text.clone()
    }

    /// The call failed: the model should change course.
    #[napi(getter)]
    pub fn is_error(&self) -> bool {
        self.inner.is_error
    }

    /// An MCP `CallToolResult`.
    #[napi]
    pub fn to_mcp(&self) -> serde_json::Value {
        self.inner.to_mcp()
    }

    /// An OpenAI tool message answering `call_id`.
    #[napi]
    pub fn to_openai(&self, call_id: String) -> serde_json::Value {
        self.inner.to_openai(&call_id)
    }

    /// An Anthropic `tool_result` block answering `tool_use_id`.
    #[napi]
    pub fn to_anthropic(&self, tool_use_id: String) -> serde_json::Value {
        self.inner.to_anthropic(&tool_use_id)
    }
}

/// Every tool's definition in `format`, no instance needed.
// Exported to JavaScript by the macro; a test build of the crate has no caller.
#[cfg_attr(test, allow(dead_code))]
#[napi]
pub fn tool_definitions(format: String) -> napi::Result<serde_json::Value> {
    let shape = shape(&format)?;
    Ok(krunbox::tools::definitions().iter().map(shape).collect())
}

fn shape(format: &str) -> napi::Result<fn(&ToolDefinition) -> serde_json::Value> {
    Ok(match format {
        "mcp" => ToolDefinition::to_mcp,
        "openai" => ToolDefinition::to_openai,
        "anthropic" => ToolDefinition::to_anthropic,
        other => {
            return Err(invalid(format!(
                "format {other:?}: \"mcp\", \"openai\" or \"anthropic\""
            )))
        }
    })
}

/// A subscription to a toolbox's permission decisions.
#[napi]
pub struct NativeAuditEvents {
    events: Arc<Mutex<broadcast::Receiver<AuditEvent>>>,
}

#[napi]
impl NativeAuditEvents {
    /// The next decision (`{tool, subject, decision, by, reason, at}`), `{missed: n}` after
    /// falling behind, or null once the toolbox is gone.
    #[napi]
    pub async fn next(&self) -> Option<serde_json::Value> {
        match self.events.lock().await.recv().await {
            Ok(event) => serde_json::to_value(&event).ok(),
            Err(RecvError::Lagged(missed)) => Some(serde_json::json!({ "missed": missed })),
            Err(RecvError::Closed) => None,
        }
    }
}
