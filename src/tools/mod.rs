//! Agent tools over an [`Instance`]: what a model calls, ready-made.
//!
//! A [`Toolbox`] offers `bash` (foreground with a timeout, or background), `process` (poll,
//! feed, kill background processes), `read`, `write`, `edit`, `ls`, `glob` and `grep`. Each
//! tool's arguments are one Rust type ([`call`](ToolCall)) that both parses the model's JSON and
//! gives the JSON Schema the model sees ([`definitions`], exported for MCP, OpenAI and
//! Anthropic). Every call passes the [`Permissions`] first (rules `allow` / `ask` / `deny`, then
//! a [`Mode`]); `ask` goes to the caller's [`Approver`]; each decision is an [`AuditEvent`].
//! Results are text, bounded, and say where they were cut.
//!
//! `ls`, `glob` and `grep` walk and search in the guest ([`Instance::search`]: ripgrep's own
//! crates, `.gitignore`-aware), one request each, mounts included.
//!
//! ```no_run
//! use krunbox::tools::{Mode, Permissions, Toolbox};
//! # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
//! let tools = Toolbox::builder(vm)
//!     .workspace("/workspace")
//!     .permissions(Permissions::mode(Mode::WorkspaceWrite).rule("ask bash(curl:*)".parse().unwrap()))
//!     .approver(|request: krunbox::tools::ApprovalRequest| async move {
//!         println!("the model wants to run {}", request.arguments);
//!         krunbox::tools::Approval::Refuse(Some("not today".into()))
//!     })
//!     .build();
//! // Hand `tools.definitions()` to the model; run what it calls:
//! let result = tools.call("grep", serde_json::json!({"pattern": "TODO", "glob": "*.rs"})).await;
//! println!("{}{}", if result.is_error { "error: " } else { "" }, result.text);
//! # Ok(()) }
//! ```

mod call;
mod files;
mod permissions;
mod search;
mod shell;
mod spec;
pub(crate) mod text;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::broadcast;

/// Re-exported so that [`Approver`] implementations can write `#[async_trait]` without
/// depending on the crate themselves.
pub use async_trait::async_trait;
pub use call::{
    ArgumentError, Bash, Edit, Glob, Grep, GrepOutput, Ls, Process, ProcessAction, Read,
    Replacement, ToolCall, Write,
};
pub use permissions::{
    Action, Approval, ApprovalRequest, Approver, AuditEvent, Decision, Mode, Pattern, Permissions,
    Rule,
};
pub use spec::{definitions, ToolDefinition, ToolResult, TOOL_NAMES};

use crate::Instance;
use permissions::{ApprovalGate, Subject};
use shell::Jobs;

/// Bytes of text one result shows unless [`ToolboxBuilder::output_cap`] says otherwise.
pub const DEFAULT_OUTPUT_CAP: usize = 30_000;
/// How long an `ask` waits for the approver unless [`ToolboxBuilder::approval_deadline`] says.
pub const DEFAULT_APPROVAL_DEADLINE: Duration = Duration::from_secs(300);

/// The tools over one instance, with their permissions. Cheap to clone (shared); background
/// processes it started are killed when the last clone is dropped.
#[derive(Clone)]
pub struct Toolbox {
    inner: Arc<Inner>,
}

struct Inner {
    vm: Instance,
    workspace: PathBuf,
    permissions: Permissions,
    gate: ApprovalGate,
    jobs: Mutex<Jobs>,
    output_cap: usize,
}

/// Configures a [`Toolbox`]: [`Toolbox::builder`].
pub struct ToolboxBuilder {
    vm: Instance,
    workspace: PathBuf,
    permissions: Permissions,
    approver: Option<Arc<dyn Approver>>,
    approval_deadline: Duration,
    output_cap: usize,
}

impl ToolboxBuilder {
    /// The directory relative paths start from, `bash` runs in, and `workspace-write` lets
    /// `write` and `edit` change (default `/`). Usually a mount of the project.
    pub fn workspace(mut self, dir: impl Into<PathBuf>) -> ToolboxBuilder {
        self.workspace = text::resolve(Path::new("/"), &dir.into().to_string_lossy())
            .unwrap_or_else(|_| PathBuf::from("/"));
        self
    }

    /// The rules and mode checked before each call (default: no rules, workspace-write).
    pub fn permissions(mut self, permissions: Permissions) -> ToolboxBuilder {
        self.permissions = permissions;
        self
    }

    /// Who answers `ask` rules (default: nobody, so `ask` refuses).
    pub fn approver(mut self, approver: impl Approver) -> ToolboxBuilder {
        self.approver = Some(Arc::new(approver));
        self
    }

    /// How long an `ask` waits for the approver before refusing (default 5 minutes).
    pub fn approval_deadline(mut self, deadline: Duration) -> ToolboxBuilder {
        self.approval_deadline = deadline;
        self
    }

    /// Bytes of text one result shows at most (default 30,000, at least 1,000): what does not
    /// fit is cut with a note.
    pub fn output_cap(mut self, bytes: usize) -> ToolboxBuilder {
        self.output_cap = bytes.max(1000);
        self
    }

    /// The toolbox.
    pub fn build(self) -> Toolbox {
        Toolbox {
            inner: Arc::new(Inner {
                vm: self.vm,
                workspace: self.workspace,
                permissions: self.permissions,
                gate: ApprovalGate::new(self.approver, self.approval_deadline),
                jobs: Mutex::new(Jobs::default()),
                output_cap: self.output_cap,
            }),
        }
    }
}

impl Toolbox {
    /// Starts configuring tools over `vm`.
    pub fn builder(vm: &Instance) -> ToolboxBuilder {
        ToolboxBuilder {
            vm: vm.clone(),
            workspace: PathBuf::from("/"),
            permissions: Permissions::default(),
            approver: None,
            approval_deadline: DEFAULT_APPROVAL_DEADLINE,
            output_cap: DEFAULT_OUTPUT_CAP,
        }
    }

    /// The tools' definitions, to hand to a model (see [`ToolDefinition::to_mcp`],
    /// [`to_openai`](ToolDefinition::to_openai), [`to_anthropic`](ToolDefinition::to_anthropic)).
    /// A tool no call of which can run (the first rule naming it is a bare `deny`, such as
    /// `{"deny": "bash"}`) is left out.
    pub fn definitions(&self) -> Vec<ToolDefinition> {
        let permissions = &self.inner.permissions;
        definitions()
            .into_iter()
            .filter(|tool| !permissions.refuses_outright(tool.name))
            .collect()
    }

    /// The directory relative paths start from.
    pub fn workspace(&self) -> &Path {
        &self.inner.workspace
    }

    /// Every permission decision from now on (allowed, denied, approved, refused).
    ///
    /// ```no_run
    /// # async fn demo(tools: krunbox::tools::Toolbox) {
    /// let mut audit = tools.audit_events();
    /// tokio::spawn(async move {
    ///     while let Ok(event) = audit.recv().await {
    ///         println!("{} {:?} by {}", event.tool, event.decision, event.by);
    ///     }
    /// });
    /// # }
    /// ```
    pub fn audit_events(&self) -> broadcast::Receiver<AuditEvent> {
        self.inner.gate.subscribe()
    }

    /// Runs a model's call by name with its JSON arguments. Never fails: bad arguments, refused
    /// permissions and failed commands are results with `is_error` and a message the model can
    /// act on.
    pub async fn call(&self, name: &str, arguments: serde_json::Value) -> ToolResult {
        match ToolCall::parse(name, arguments) {
            Ok(call) => self.run(call).await,
            Err(err) => ToolResult::error(err.message),
        }
    }

    /// Runs a parsed call (typed Rust callers use this directly).
    pub async fn run(&self, call: ToolCall) -> ToolResult {
        let inner = &*self.inner;
        let path = match self.subject_path(&call) {
            Ok(path) => path,
            Err(why) => return ToolResult::error(format!("{}: {why}", call.name())),
        };
        // Input written to a background process is commands too (a shell reads it): the bash
        // rules decide it, or `process` would run what they refuse.
        let (ruled_as, subject, subject_text) = match (&call, &path) {
            (ToolCall::Bash(bash), _) => ("bash", None, bash.command.clone()),
            (ToolCall::Process(process), _) if process.action == ProcessAction::Write => {
                let input = process.input.as_deref().unwrap_or("");
                let line = match process.id {
                    Some(id) => Jobs::line_with(&inner.jobs, id, input),
                    None => input.to_owned(),
                };
                ("bash", None, line)
            }
            (_, Some(path)) => (
                call.name(),
                Some(path.as_path()),
                path.display().to_string(),
            ),
            (_, None) => (call.name(), None, String::new()),
        };
        let subject = match (ruled_as, subject) {
            ("bash", _) => Subject::Command(&subject_text),
            (_, Some(path)) => Subject::Path(path),
            (_, None) => Subject::Nothing,
        };
        let verdict = inner
            .permissions
            .decide(ruled_as, &subject, &inner.workspace);
        let settled = inner
            .gate
            .settle(call.name(), || call.arguments(), &subject_text, verdict)
            .await;
        if let Err(refusal) = settled {
            return ToolResult::error(refusal);
        }
        let (vm, cap) = (&inner.vm, inner.output_cap);
        let path = path.as_deref().unwrap_or(&inner.workspace);
        let hidden = |tool: &'static str| {
            move |found: &Path| {
                inner.permissions.rule_denies(tool, found)
                    || inner.permissions.rule_denies("read", found)
            }
        };
        let result = match &call {
            ToolCall::Bash(args) if args.background => {
                Jobs::start(&inner.jobs, vm, args, path).await
            }
            ToolCall::Bash(args) => shell::foreground(vm, args, path, cap).await,
            ToolCall::Process(args) => Jobs::act(&inner.jobs, args, cap).await,
            ToolCall::Read(args) => files::read(vm, path, args, cap).await,
            ToolCall::Write(args) => files::write(vm, path, args).await,
            ToolCall::Edit(args) => files::edit(vm, path, args).await,
            ToolCall::Ls(args) => search::ls(vm, path, args, cap, &hidden("ls")).await,
            ToolCall::Glob(args) => search::glob(vm, path, args, cap, &hidden("glob")).await,
            ToolCall::Grep(args) => search::grep(vm, path, args, cap, &hidden("grep")).await,
        };
        within_cap(result, cap)
    }

    /// The absolute guest path a call acts on (for `bash`, its working directory).
    ///
    /// (A method of the toolbox: relative paths start at its workspace.)
    fn subject_path(&self, call: &ToolCall) -> Result<Option<PathBuf>, String> {
        let given = match call {
            ToolCall::Bash(args) => args.cwd.as_deref(),
            ToolCall::Process(_) => return Ok(None),
            ToolCall::Read(args) => Some(args.path.as_str()),
            ToolCall::Write(args) => Some(args.path.as_str()),
            ToolCall::Edit(args) => Some(args.path.as_str()),
            ToolCall::Ls(args) => args.path.as_deref(),
            ToolCall::Glob(args) => args.path.as_deref(),
            ToolCall::Grep(args) => args.path.as_deref(),
        };
        match given {
            Some(path) => text::resolve(&self.inner.workspace, path).map(Some),
            None => Ok(Some(self.inner.workspace.clone())),
        }
    }
}

/// Slack over the cap for the notes a tool adds to what it cut (and lossy UTF-8's growth).
const NOTE_ROOM: usize = 1000;

/// The backstop of every result: at most `cap` bytes and its notes. Tools cut their output
/// themselves, saying how to get the rest; this catches what grows past that (invalid UTF-8
/// shown as replacement characters takes three bytes for one).
fn within_cap(mut result: ToolResult, cap: usize) -> ToolResult {
    if result.text.len() > cap + NOTE_ROOM {
        let total = result.text.len();
        text::truncate_at_char(&mut result.text, cap);
        result.text += &format!(
            "\n[cut at {} of {} bytes]\n",
            text::count(cap as u64),
            text::count(total as u64)
        );
    }
    result
}

impl std::fmt::Debug for Toolbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Toolbox")
            .field("instance", &self.inner.vm.id())
            .field("workspace", &self.inner.workspace)
            .field("permissions", &self.inner.permissions)
            .finish_non_exhaustive()
    }
}
