//! `ask` rules: the caller's approver decides one call at a time, and every decision (rule,
//! mode or approver) becomes an [`AuditEvent`].

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::Serialize;
use tokio::sync::broadcast;

use super::{Action, Verdict};
use crate::callback::guarded;

/// A call an `ask` rule holds until the [`Approver`] answers.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ApprovalRequest {
    /// The tool: `bash`, `write`, …
    pub tool: &'static str,
    /// The call's arguments, as the model sent them (parsed).
    pub arguments: serde_json::Value,
    /// The rule that asks, e.g. `ask bash(curl:*)`.
    pub rule: String,
}

/// The approver's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Approval {
    /// Run the call.
    Approve,
    /// Do not run it; the reason (if any) is shown to the model.
    Refuse(Option<String>),
}

/// Answers `ask` rules: a person at a prompt, a policy service, a test. Foreign code: a panic
/// refuses the call, and so does no answer within the toolbox's approval deadline
/// ([`ToolboxBuilder::approval_deadline`](crate::tools::ToolboxBuilder::approval_deadline)).
///
/// A closure `Fn(ApprovalRequest) -> impl Future<Output = Approval>` is an approver:
///
/// ```
/// use krunbox::tools::{Approval, ApprovalRequest};
/// let approver = |request: ApprovalRequest| async move {
///     if request.tool == "bash" && request.arguments["command"].as_str() == Some("curl localhost") {
///         Approval::Approve
///     } else {
///         Approval::Refuse(Some("only curl localhost".into()))
///     }
/// };
/// # fn takes(_: impl krunbox::tools::Approver) {}
/// takes(approver);
/// ```
#[async_trait::async_trait]
pub trait Approver: Send + Sync + 'static {
    /// Decides one call.
    async fn approve(&self, request: ApprovalRequest) -> Approval;
}

#[async_trait::async_trait]
impl<F, Fut> Approver for F
where
    F: Fn(ApprovalRequest) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Approval> + Send,
{
    async fn approve(&self, request: ApprovalRequest) -> Approval {
        self(request).await
    }
}

/// How a call was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// An `allow` rule or the mode let it run.
    Allowed,
    /// A `deny` rule or the mode refused it.
    Denied,
    /// An `ask` rule asked and the approver approved.
    Approved,
    /// An `ask` rule asked and the approver refused, failed, or did not answer in time (or
    /// there is no approver).
    Refused,
}

/// One permission decision, as [`Toolbox::audit_events`](crate::tools::Toolbox::audit_events)
/// reports it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct AuditEvent {
    /// The tool.
    pub tool: &'static str,
    /// What it acts on: the command line or the absolute path (at most 1 KiB of it), or empty.
    pub subject: String,
    /// The decision.
    pub decision: Decision,
    /// The rule that decided (`deny bash(curl:*)`) or the mode (`mode read-only`).
    pub by: String,
    /// Why the approver refused, when it said (or what went wrong with it).
    pub reason: Option<String>,
    /// When.
    #[serde(with = "unix_seconds")]
    pub at: SystemTime,
}

mod unix_seconds {
    use std::time::{SystemTime, UNIX_EPOCH};
    pub fn serialize<S: serde::Serializer>(at: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        let secs = at
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        s.serialize_f64(secs)
    }
}

/// Audit events kept for a slow subscriber before the oldest are dropped (it then sees
/// `Lagged`).
const AUDIT_BACKLOG: usize = 1024;
/// Bytes of a subject an event keeps.
const MAX_SUBJECT: usize = 1024;

/// The approver, its deadline and the audit channel: where a verdict becomes a run or a refusal.
pub(crate) struct ApprovalGate {
    approver: Option<Arc<dyn Approver>>,
    deadline: Duration,
    events: broadcast::Sender<AuditEvent>,
}

impl ApprovalGate {
    pub(crate) fn new(approver: Option<Arc<dyn Approver>>, deadline: Duration) -> ApprovalGate {
        ApprovalGate {
            approver,
            deadline,
            events: broadcast::channel(AUDIT_BACKLOG).0,
        }
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<AuditEvent> {
        self.events.subscribe()
    }

    /// Settles `verdict` for one call (asking the approver if it says ask), reports it, and
    /// returns the refusal's message for the model, if refused.
    pub(crate) async fn settle(
        &self,
        tool: &'static str,
        arguments: impl FnOnce() -> serde_json::Value,
        subject: &str,
        verdict: Verdict,
    ) -> Result<(), String> {
        let (decision, reason) = match verdict.action {
            Action::Allow => (Decision::Allowed, None),
            Action::Deny => (Decision::Denied, None),
            Action::Ask => self.ask(tool, arguments(), &verdict.by).await,
        };
        let mut subject = subject.to_owned();
        crate::tools::text::truncate_at_char(&mut subject, MAX_SUBJECT);
        tracing::info!(tool, %subject, ?decision, by = %verdict.by, "tool call decided");
        let _ = self.events.send(AuditEvent {
            tool,
            subject,
            decision,
            by: verdict.by.clone(),
            reason: reason.clone(),
            at: SystemTime::now(),
        });
        match decision {
            Decision::Allowed | Decision::Approved => Ok(()),
            Decision::Denied => Err(format!(
                "permission denied: `{}` forbids this {tool} call; do not retry it, try another \
                 way or ask the user",
                verdict.by
            )),
            Decision::Refused => Err(format!(
                "permission refused: this {tool} call needed approval (`{}`) and was refused{}",
                verdict.by,
                reason.map(|r| format!(": {r}")).unwrap_or_default()
            )),
        }
    }

    async fn ask(
        &self,
        tool: &'static str,
        arguments: serde_json::Value,
        rule: &str,
    ) -> (Decision, Option<String>) {
        let Some(approver) = self.approver.clone() else {
            return (Decision::Refused, Some("no approver is configured".into()));
        };
        let request = ApprovalRequest {
            tool,
            arguments,
            rule: rule.to_owned(),
        };
        let answer = tokio::time::timeout(
            self.deadline,
            guarded(move || async move { approver.approve(request).await }),
        )
        .await;
        match answer {
            Ok(Ok(Approval::Approve)) => (Decision::Approved, None),
            Ok(Ok(Approval::Refuse(reason))) => (Decision::Refused, reason),
            Ok(Err(panicked)) => (
                Decision::Refused,
                Some(format!("the approver failed: {panicked}")),
            ),
            Err(_) => (
                Decision::Refused,
                Some(format!("no answer within {:?}", self.deadline)),
            ),
        }
    }
}
