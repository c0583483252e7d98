//! A running process ([`Child`]): signals, resizing, waiting, and how it ended
//! ([`ExitStatus`]); the host's backstop for a command's timeout; killing on drop.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use super::guest::Guest;
use super::stdio::{ChildStderr, ChildStdin, ChildStdout};
use crate::control::{Control, ProcessEnd};
use crate::error::{Error, Result};
use crate::protocol::{self, HostMessage, PtySize, Resize, SignalProcess};

/// How long the host waits past a command's own timeout for guest-init to report it, before
/// it kills the process group itself.
pub(super) const TIMEOUT_GRACE: Duration = Duration::from_secs(10);

/// A running process in the guest.
#[derive(Debug)]
pub struct Child {
    pub(super) instance: Arc<dyn Guest>,
    /// The control-channel process id (not the guest pid).
    pub(super) key: u32,
    pub(super) pid: u32,
    pub(super) is_pty: bool,
    /// The process's standard input, when it was spawned with [`Stdio::piped`](crate::Stdio::piped) or a pty.
    pub stdin: Option<ChildStdin>,
    /// The process's standard output, streaming (a pty's whole screen output).
    pub stdout: Option<ChildStdout>,
    /// The process's standard error, streaming.
    pub stderr: Option<ChildStderr>,
    pub(super) end: Option<oneshot::Receiver<ProcessEnd>>,
    pub(super) status: Option<ExitStatus>,
    pub(super) backstop: Backstop,
    /// The task that kills the process when its [`Command::cancel_on`](crate::Command::cancel_on)
    /// token is cancelled; stopped once the process has ended or the child is dropped.
    pub(super) cancel_watch: Option<tokio::task::AbortHandle>,
}

impl Child {
    /// The process id inside the guest.
    pub fn id(&self) -> u32 {
        self.pid
    }

    /// Whether it runs on a terminal (a pty: one output stream, resizable).
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let shell = vm.command("sh").pty(24, 80).spawn().await?;
    /// assert!(shell.is_terminal());
    /// # Ok(()) }
    /// ```
    pub fn is_terminal(&self) -> bool {
        self.is_pty
    }

    /// A handle that signals and resizes this process from another task while this one awaits
    /// [`wait`](Self::wait) (which holds the `Child` mutably): a supervisor's SIGTERM, a
    /// terminal's resize.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let mut child = vm.command("sleep").arg("600").spawn().await?;
    /// let control = child.control();
    /// const SIGTERM: i32 = 15;
    /// tokio::spawn(async move { control.signal(SIGTERM) });
    /// assert_eq!(child.wait().await?.signal(), Some(SIGTERM));
    /// # Ok(()) }
    /// ```
    pub fn control(&self) -> ChildControl {
        ChildControl {
            instance: self.instance.clone(),
            key: self.key,
            is_pty: self.is_pty,
        }
    }

    /// Sends `signal` (a Linux signal number, e.g. `libc::SIGTERM`) to the process group.
    pub fn signal(&self, signal: i32) -> Result<()> {
        if self.status.is_some() {
            return Ok(());
        }
        self.control().signal(signal)
    }

    /// Changes the size of the process's pty; the foreground process group gets SIGWINCH.
    /// An error if the command was not started with [`Command::pty`](crate::Command::pty).
    pub fn resize(&self, rows: u16, cols: u16) -> Result<()> {
        if self.is_pty && self.status.is_some() {
            return Ok(());
        }
        self.control().resize(rows, cols)
    }

    /// Kills the process group with SIGKILL and waits for the process to end.
    pub async fn kill(&mut self) -> Result<ExitStatus> {
        self.signal(libc::SIGKILL)?;
        self.wait().await
    }

    /// Waits for the process to exit. Output not yet read stays readable.
    pub async fn wait(&mut self) -> Result<ExitStatus> {
        if let Some(status) = self.status {
            return Ok(status);
        }
        let end = self
            .end
            .as_mut()
            .expect("end receiver present until a status is known");
        let result = self.backstop.run(end).await?;
        let result = result.map(|end| match end {
            // The command outlived its timeout so long that the host killed it.
            ProcessEnd::Exited(mut exited) if self.backstop.fired => {
                exited.timed_out = true;
                ProcessEnd::Exited(exited)
            }
            other => other,
        });
        let status = match result {
            Ok(ProcessEnd::Exited(exited)) => ExitStatus {
                raw: exited.status,
                timed_out: exited.timed_out,
            },
            Ok(ProcessEnd::Failed(failed)) => {
                return Err(Error::InstanceGone {
                    reason: format!("process failed after starting: {}", failed.message),
                })
            }
            Ok(ProcessEnd::Gone(reason)) => return Err(reason.error()),
            Err(_) => {
                return Err(Error::InstanceGone {
                    reason: "the control channel closed".into(),
                })
            }
        };
        self.end = None;
        self.status = Some(status);
        if let Some(watch) = self.cancel_watch.take() {
            watch.abort();
        }
        Ok(status)
    }
}

/// Kills process `id`'s group when `token` is cancelled, in a task of its own, so that a
/// spawned process nobody is waiting on still stops.
pub(super) fn watch_cancellation(
    token: tokio_util::sync::CancellationToken,
    control: Arc<Control>,
    id: u32,
) -> tokio::task::AbortHandle {
    tokio::spawn(async move {
        token.cancelled().await;
        send_kill(&control, id);
    })
    .abort_handle()
}

/// The host's backstop for a command's timeout, which guest-init enforces. Should guest-init
/// not have ended the command [`TIMEOUT_GRACE`] after the timeout, the host sends the kill
/// itself; should the guest still not end it within another grace period, it is unresponsive,
/// and waiting longer would hang the caller.
pub(super) struct Backstop {
    pub(super) control: Arc<Control>,
    pub(super) id: u32,
    /// When the host stops waiting for guest-init, in the guest's running time (a pause
    /// moves it); `None` without a timeout.
    pub(super) deadline: Option<crate::pause_clock::GuestDeadline>,
    /// The host had to send the kill itself.
    pub(super) fired: bool,
}

impl fmt::Debug for Backstop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backstop")
            .field("deadline", &self.deadline)
            .field("fired", &self.fired)
            .finish_non_exhaustive()
    }
}

impl Backstop {
    /// Runs `work` (reading the streams, or waiting for the end) under the backstop.
    pub(super) async fn run<F: std::future::Future>(&mut self, work: F) -> Result<F::Output> {
        let Some(deadline) = self.deadline.clone() else {
            return Ok(work.await);
        };
        tokio::pin!(work);
        tokio::select! {
            biased;
            done = &mut work => return Ok(done),
            _ = deadline.clone().elapsed() => {}
        }
        if !self.fired {
            self.fired = true;
            tracing::warn!(id = self.id, "guest did not enforce a timeout; killing");
            send_kill(&self.control, self.id);
        }
        tokio::select! {
            biased;
            done = work => Ok(done),
            _ = deadline.later_by(TIMEOUT_GRACE).elapsed() => Err(Error::GuestUnresponsive {
                after: TIMEOUT_GRACE * 2,
            }),
        }
    }
}

/// Asks guest-init to SIGKILL process `id`'s group (ignored if it has already ended).
pub(super) fn send_kill(control: &Control, id: u32) {
    let _ = control.send(&HostMessage::Signal(SignalProcess {
        id,
        signal: libc::SIGKILL,
    }));
}

/// Kills a process whose `Exec` was sent but whose [`Child`] does not exist yet, should the
/// spawn be abandoned (its future dropped) in between.
pub(super) struct KillOnDrop {
    pub(super) control: Arc<Control>,
    pub(super) id: u32,
    pub(super) armed: bool,
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.armed {
            send_kill(&self.control, self.id);
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if let Some(watch) = self.cancel_watch.take() {
            watch.abort();
        }
        // Cancellation: a process nobody waits for anymore is killed, group and all.
        if self.status.is_none() {
            if let Ok(control) = self.instance.control() {
                send_kill(&control, self.key);
            }
        }
    }
}

/// Signals and resizes a [`Child`] from anywhere ([`Child::control`]); cheap to clone. Once
/// the process has ended, what it sends is ignored by the guest (a process's number is never
/// given to another in the instance's life).
#[derive(Clone)]
pub struct ChildControl {
    instance: Arc<dyn Guest>,
    key: u32,
    is_pty: bool,
}

impl fmt::Debug for ChildControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChildControl")
            .field("key", &self.key)
            .field("is_pty", &self.is_pty)
            .finish_non_exhaustive()
    }
}

impl ChildControl {
    /// Sends `signal` to the process group, as [`Child::signal`] does.
    pub fn signal(&self, signal: i32) -> Result<()> {
        self.instance
            .control()?
            .send(&HostMessage::Signal(SignalProcess {
                id: self.key,
                signal,
            }))
    }

    /// Changes the size of the process's pty, as [`Child::resize`] does.
    pub fn resize(&self, rows: u16, cols: u16) -> Result<()> {
        if !self.is_pty {
            return Err(Error::InvalidConfig(
                "resize needs a command started with .pty(rows, cols)".into(),
            ));
        }
        self.instance.control()?.send(&HostMessage::Resize(Resize {
            id: self.key,
            size: PtySize { rows, cols },
        }))
    }
}

/// How a guest process ended.
///
/// ```
/// # use krunbox::ExitStatus;
/// fn describe(status: ExitStatus) -> String {
///     match (status.code(), status.signal()) {
///         (_, _) if status.timed_out() => "timed out (exit code 124)".into(),
///         (Some(code), _) => format!("exited with {code}"),
///         (None, Some(sig)) => format!("killed by signal {sig}"),
///         (None, None) => unreachable!(),
///     }
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    raw: protocol::ExitStatus,
    timed_out: bool,
}

/// The exit code reported for a command killed by its timeout (as coreutils `timeout` does).
pub const TIMEOUT_EXIT_CODE: i32 = 124;

impl ExitStatus {
    /// True for exit code 0.
    pub fn success(&self) -> bool {
        self.code() == Some(0)
    }

    /// The exit code; [`TIMEOUT_EXIT_CODE`] when the timeout killed it; `None` when a signal
    /// (other than the timeout's) ended it.
    pub fn code(&self) -> Option<i32> {
        if self.timed_out {
            return Some(TIMEOUT_EXIT_CODE);
        }
        match self.raw {
            protocol::ExitStatus::Code(code) => Some(code),
            protocol::ExitStatus::Signal(_) => None,
        }
    }

    /// The terminating signal, if a signal (not the timeout) ended it.
    pub fn signal(&self) -> Option<i32> {
        match self.raw {
            protocol::ExitStatus::Signal(sig) if !self.timed_out => Some(sig),
            _ => None,
        }
    }

    /// Whether the command's timeout killed it.
    pub fn timed_out(&self) -> bool {
        self.timed_out
    }
}

impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.timed_out {
            return write!(f, "timed out (exit code {TIMEOUT_EXIT_CODE})");
        }
        match self.raw {
            protocol::ExitStatus::Code(c) => write!(f, "exit code {c}"),
            protocol::ExitStatus::Signal(s) => write!(f, "signal {s}"),
        }
    }
}
