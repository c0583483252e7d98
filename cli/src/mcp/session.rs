//! One MCP session: its own sandbox, booted when the session starts and stopped when it ends,
//! and the tools over it (`krunbox::tools`), served through rmcp's `ServerHandler`.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use krunbox::tools::{Approval, ApprovalRequest, Approver, Permissions, Toolbox};
use krunbox::{Instance, Sandbox};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ProtocolVersion, ServerCapabilities, ServerConfig,
    Tool,
};
use rmcp::service::{NotificationContext, RequestContext, RoleServer};
use rmcp::{ErrorData as McpError, Peer, ServerHandler};
use serde::Deserialize;

/// What every session is made from: the sandbox definition and the tools' settings.
pub(crate) struct Definition {
    pub(crate) sandbox: Sandbox,
    pub(crate) workspace: String,
    pub(crate) permissions: Permissions,
    /// One permit a live session's sandbox.
    pub(crate) sessions: Arc<tokio::sync::Semaphore>,
    pub(crate) max_sessions: usize,
}

/// How long a session's VM is given to shut down cleanly before it is killed.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// A session's sandbox once booted: the VM, its tools, and its place among the live sessions.
struct Sandboxed {
    vm: Instance,
    tools: Toolbox,
    _place: tokio::sync::OwnedSemaphorePermit,
}

/// A session's handler (rmcp clones it; the clones share one sandbox).
#[derive(Clone)]
pub(crate) struct Session {
    inner: Arc<Inner>,
}

struct Inner {
    definition: Arc<Definition>,
    /// Booted on the session's first need (or as soon as it is known to be a session: its
    /// `initialized`), never for a handler rmcp makes and throws away (a discovery probe). A
    /// failed boot is not kept: the next call tries again (another session may have ended).
    booted: tokio::sync::OnceCell<Sandboxed>,
    /// The client, for `ask` rules (elicitation): set on its first call.
    peer: Arc<Mutex<Option<Peer<RoleServer>>>>,
}

impl Session {
    /// A session that boots its sandbox when first needed.
    pub(crate) fn new(definition: &Arc<Definition>) -> Session {
        Session {
            inner: Arc::new(Inner {
                definition: definition.clone(),
                booted: tokio::sync::OnceCell::new(),
                peer: Arc::default(),
            }),
        }
    }

    /// Starts the boot in the background: the VM is ready, or nearly, when the first call
    /// comes.
    pub(crate) fn boot_soon(&self) {
        let session = self.clone();
        tokio::spawn(async move {
            if let Err(err) = session.booted().await {
                tracing::warn!("an MCP session's sandbox did not boot: {err}");
            }
        });
    }

    async fn booted(&self) -> Result<&Sandboxed, String> {
        self.inner.booted.get_or_try_init(|| self.boot()).await
    }

    async fn boot(&self) -> Result<Sandboxed, String> {
        let definition = &self.inner.definition;
        let place = definition
            .sessions
            .clone()
            .try_acquire_owned()
            .map_err(|_| {
                format!(
                "this server already runs {} sessions' sandboxes (--max-sessions): end one first",
                definition.max_sessions
            )
            })?;
        let vm = definition.sandbox.boot().await.map_err(|e| e.to_string())?;
        tracing::info!(instance = vm.id(), "MCP session's sandbox booted");
        let tools = Toolbox::builder(&vm)
            .workspace(definition.workspace.as_str())
            .permissions(definition.permissions.clone())
            .approver(Elicit {
                peer: self.inner.peer.clone(),
            })
            .build();
        Ok(Sandboxed {
            vm,
            tools,
            _place: place,
        })
    }

    /// Stops the sandbox now (its handler's drop would too; this waits for it).
    pub(crate) async fn stop(&self) {
        if let Some(sandboxed) = self.inner.booted.get() {
            shut_down(&sandboxed.vm).await;
        }
    }
}

async fn shut_down(vm: &Instance) {
    tracing::info!(
        instance = vm.id(),
        "MCP session ended: stopping its sandbox"
    );
    match tokio::time::timeout(SHUTDOWN_GRACE, vm.shutdown()).await {
        Ok(Ok(())) => tracing::info!(instance = vm.id(), "MCP session ended: sandbox stopped"),
        _ => tracing::warn!(instance = vm.id(), "MCP session ended: sandbox killed"),
    }
}

impl Drop for Inner {
    /// The session ended (the client closed stdin, sent DELETE, or went away): the VM stops
    /// with it (killed, if no runtime is left to shut it down in).
    fn drop(&mut self) {
        let Some(sandboxed) = self.booted.take() else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let Sandboxed { vm, tools, _place } = sandboxed;
                drop(tools);
                shut_down(&vm).await;
            });
        }
    }
}

impl ServerHandler for Session {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("krunbox", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Tools over a Linux microVM of this session's own: run commands with bash, \
                 change files with write and edit, find them with ls, glob and grep. The \
                 sandbox stops when the session ends.",
            )
    }

    async fn on_initialized(&self, _context: NotificationContext<RoleServer>) {
        self.boot_soon();
    }

    /// Sessions own a VM each, and 2026-07-28 has no sessions: the versions up to
    /// 2025-11-25 (a newer client falls back to the initialize handshake).
    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(ProtocolVersion::known_up_to(&ProtocolVersion::V_2025_11_25))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        // What the permissions offer: no VM needed to say it.
        let permissions = &self.inner.definition.permissions;
        let tools: Vec<Tool> = krunbox::tools::definitions()
            .iter()
            .filter(|tool| permissions.offers(tool.name))
            .map(to_mcp)
            .collect();
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        *self.inner.peer.lock().unwrap_or_else(|p| p.into_inner()) = Some(context.peer.clone());
        let tools = match self.booted().await {
            Ok(sandboxed) => &sandboxed.tools,
            Err(err) => {
                return Ok(CallToolResult::error(vec![ContentBlock::text(format!(
                    "the sandbox failed to boot: {err}"
                ))])
                .into())
            }
        };
        let arguments = request
            .arguments
            .map(serde_json::Value::Object)
            .unwrap_or(serde_json::Value::Null);
        let result = tools.call(&request.name, arguments).await;
        let content = vec![ContentBlock::text(result.text)];
        Ok(if result.is_error {
            CallToolResult::error(content)
        } else {
            CallToolResult::success(content)
        }
        .into())
    }
}

fn to_mcp(tool: &krunbox::tools::ToolDefinition) -> Tool {
    let schema = match &tool.input_schema {
        serde_json::Value::Object(object) => object.clone(),
        _ => Default::default(),
    };
    Tool::new(tool.name, tool.description, Arc::new(schema))
}

/// `ask` rules answered by the MCP client's user, through elicitation.
struct Elicit {
    peer: Arc<Mutex<Option<Peer<RoleServer>>>>,
}

/// What the client's user is asked to fill in.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
struct Consent {
    /// Run this call?
    approve: bool,
}

rmcp::elicit_safe!(Consent);

#[krunbox::tools::async_trait]
impl Approver for Elicit {
    async fn approve(&self, request: ApprovalRequest) -> Approval {
        {
            let peer = self.peer.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let Some(peer) = peer else {
                return Approval::Refuse(Some("no MCP client to ask".into()));
            };
            let message = format!(
                "The model wants to call {} with {}. Allow it? (rule `{}`)",
                request.tool, request.arguments, request.rule
            );
            match peer.elicit::<Consent>(message).await {
                Ok(Some(Consent { approve: true })) => Approval::Approve,
                Ok(_) => Approval::Refuse(Some("the user did not approve".into())),
                Err(err) => Approval::Refuse(Some(format!("the client could not ask: {err}"))),
            }
        }
    }
}
