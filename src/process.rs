//! Processes in the guest, shaped like `tokio::process`.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use serde_bytes::ByteBuf;
use tokio::io::{AsyncRead, AsyncReadExt, ReadBuf};
use tokio::sync::{mpsc, oneshot};

use crate::control::ProcessEnd;
use crate::error::{Error, Result};
use crate::instance::Instance;
use crate::protocol::{self, Exec, HostMessage, SignalProcess};

/// The guest environment a command starts from (the host's environment never crosses over).
const BASE_ENV: [(&str, &str); 2] = [
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ),
    ("HOME", "/root"),
];

/// How long the host waits past a command's own timeout for guest-init to report it, before
/// it kills the process group itself.
const TIMEOUT_GRACE: Duration = Duration::from_secs(10);

/// A command to run in a sandbox instance, built like [`tokio::process::Command`].
///
/// The environment starts as `PATH` (the usual system directories) and `HOME=/root` — never
/// the host's. Arguments are passed exactly, with no shell in between.
///
/// ```no_run
/// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
/// use std::time::Duration;
///
/// let out = vm
///     .command("sh")
///     .args(["-c", "echo $GREETING from $(pwd)"])
///     .env("GREETING", "hello")
///     .current_dir("/tmp")
///     .timeout(Duration::from_secs(10))
///     .output()
///     .await?;
/// assert!(out.status.success());
/// assert_eq!(out.stdout, b"hello from /tmp\n");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Command {
    instance: Instance,
    program: OsString,
    args: Vec<OsString>,
    env: BTreeMap<OsString, OsString>,
    cwd: Option<PathBuf>,
    uid: Option<u32>,
    gid: Option<u32>,
    timeout: Option<Duration>,
}

impl Command {
    pub(crate) fn new(instance: Instance, program: &OsStr) -> Command {
        Command {
            instance,
            program: program.to_owned(),
            args: Vec::new(),
            env: BASE_ENV
                .iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v)))
                .collect(),
            cwd: None,
            uid: None,
            gid: None,
            timeout: None,
        }
    }

    /// Adds an argument.
    pub fn arg(&mut self, arg: impl AsRef<OsStr>) -> &mut Command {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    /// Adds arguments.
    pub fn args<I, S>(&mut self, args: I) -> &mut Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Sets an environment variable.
    pub fn env(&mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> &mut Command {
        self.env
            .insert(key.as_ref().to_owned(), value.as_ref().to_owned());
        self
    }

    /// Sets several environment variables.
    pub fn envs<I, K, V>(&mut self, vars: I) -> &mut Command
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        for (k, v) in vars {
            self.env(k, v);
        }
        self
    }

    /// Removes an environment variable.
    pub fn env_remove(&mut self, key: impl AsRef<OsStr>) -> &mut Command {
        self.env.remove(key.as_ref());
        self
    }

    /// Removes every environment variable, the defaults included.
    pub fn env_clear(&mut self) -> &mut Command {
        self.env.clear();
        self
    }

    /// The working directory in the guest (default `/`).
    pub fn current_dir(&mut self, dir: impl Into<PathBuf>) -> &mut Command {
        self.cwd = Some(dir.into());
        self
    }

    /// Runs as this user id (default 0, root inside the VM).
    pub fn uid(&mut self, uid: u32) -> &mut Command {
        self.uid = Some(uid);
        self
    }

    /// Runs with this group id (default: the same number as the uid).
    pub fn gid(&mut self, gid: u32) -> &mut Command {
        self.gid = Some(gid);
        self
    }

    /// Kills the command's whole process group after `timeout`; the status then reports exit
    /// code 124 and [`ExitStatus::timed_out`].
    pub fn timeout(&mut self, timeout: Duration) -> &mut Command {
        self.timeout = Some(timeout);
        self
    }

    fn to_exec(&self, id: u32) -> Exec {
        let bytes = |s: &OsStr| ByteBuf::from(s.as_bytes().to_vec());
        Exec {
            id,
            argv: std::iter::once(&self.program)
                .chain(&self.args)
                .map(|a| bytes(a))
                .collect(),
            env: self.env.iter().map(|(k, v)| (bytes(k), bytes(v))).collect(),
            cwd: self.cwd.as_ref().map(|c| bytes(c.as_os_str())),
            uid: self.uid,
            gid: self.gid,
            timeout_ms: self
                .timeout
                .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
        }
    }

    /// Starts the command, with stdout and stderr streaming back while it runs. Its stdin is
    /// empty (`/dev/null`).
    ///
    /// Dropping the [`Child`] before it exits kills its process group.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// use tokio::io::AsyncReadExt;
    ///
    /// let mut child = vm.command("sh").args(["-c", "echo one; sleep 1; echo two"]).spawn().await?;
    /// let mut stdout = child.stdout.take().unwrap();
    /// let mut text = String::new();
    /// stdout.read_to_string(&mut text).await.unwrap();
    /// assert_eq!(text, "one\ntwo\n");
    /// assert!(child.wait().await?.success());
    /// # Ok(()) }
    /// ```
    pub async fn spawn(&mut self) -> Result<Child> {
        let control = self.instance.control()?;
        let id = self.instance.next_process_id();
        let exec = self.to_exec(id);
        // Bounds are checked here so a bad argument is an error at the call, not in the guest.
        let message = HostMessage::Exec(exec);
        message
            .encode()
            .map_err(|e| Error::InvalidConfig(format!("command: {e}")))?;
        let channels = control.register(id)?;
        control.send(&message)?;
        let mut end = channels.end;
        let pid = tokio::select! {
            pid = channels.started => pid.ok(),
            end = &mut end => return Err(self.early_end(end)),
        };
        let Some(pid) = pid else {
            return Err(self.early_end(end.await));
        };
        Ok(Child {
            instance: self.instance.clone(),
            key: id,
            pid,
            stdout: Some(ChildStdout(Receiver::new(channels.stdout))),
            stderr: Some(ChildStderr(Receiver::new(channels.stderr))),
            end: Some(end),
            status: None,
            host_deadline: self.timeout.map(|t| t + TIMEOUT_GRACE),
        })
    }

    fn early_end(&self, end: std::result::Result<ProcessEnd, oneshot::error::RecvError>) -> Error {
        match end {
            Ok(ProcessEnd::Failed(failed)) => Error::Exec {
                program: self.program.to_string_lossy().into_owned(),
                kind: failed.kind,
                message: failed.message,
            },
            Ok(ProcessEnd::Gone(reason)) => Error::InstanceGone { reason },
            Ok(ProcessEnd::Exited(_)) | Err(_) => Error::InstanceGone {
                reason: "the guest ended the process before reporting it started".into(),
            },
        }
    }

    /// Runs the command to completion and collects its status and all of its output.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let out = vm.command("sh").args(["-c", "echo out; echo err >&2; exit 3"]).output().await?;
    /// assert_eq!(out.status.code(), Some(3));
    /// assert_eq!(out.stdout, b"out\n");
    /// assert_eq!(out.stderr, b"err\n");
    /// # Ok(()) }
    /// ```
    pub async fn output(&mut self) -> Result<Output> {
        let mut child = self.spawn().await?;
        let mut stdout = child.stdout.take().expect("fresh child has stdout");
        let mut stderr = child.stderr.take().expect("fresh child has stderr");
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let (r1, r2) = tokio::join!(stdout.read_to_end(&mut out), stderr.read_to_end(&mut err));
        r1.and(r2).map_err(Error::io("reading command output"))?;
        let status = child.wait().await?;
        Ok(Output {
            status,
            stdout: out,
            stderr: err,
        })
    }

    /// Runs the command to completion, discarding its output.
    pub async fn status(&mut self) -> Result<ExitStatus> {
        Ok(self.output().await?.status)
    }
}

/// A running process in the guest.
#[derive(Debug)]
pub struct Child {
    instance: Instance,
    /// The control-channel process id (not the guest pid).
    key: u32,
    pid: u32,
    /// The process's standard output, streaming.
    pub stdout: Option<ChildStdout>,
    /// The process's standard error, streaming.
    pub stderr: Option<ChildStderr>,
    end: Option<oneshot::Receiver<ProcessEnd>>,
    status: Option<ExitStatus>,
    host_deadline: Option<Duration>,
}

impl Child {
    /// The process id inside the guest.
    pub fn id(&self) -> u32 {
        self.pid
    }

    /// Sends `signal` (a Linux signal number, e.g. `libc::SIGTERM`) to the process group.
    pub fn signal(&self, signal: i32) -> Result<()> {
        if self.status.is_some() {
            return Ok(());
        }
        self.instance
            .control()?
            .send(&HostMessage::Signal(SignalProcess {
                id: self.key,
                signal,
            }))
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
        let result = match self.host_deadline {
            None => end.await,
            Some(deadline) => match tokio::time::timeout(deadline, &mut *end).await {
                Ok(result) => result,
                Err(_) => {
                    // guest-init should have reported the timeout long ago; enforce it here.
                    tracing::warn!(id = self.key, "guest did not report a timeout; killing");
                    let _ = self
                        .instance
                        .control()?
                        .send(&HostMessage::Signal(SignalProcess {
                            id: self.key,
                            signal: libc::SIGKILL,
                        }));
                    end.await.map(|e| match e {
                        ProcessEnd::Exited(mut exited) => {
                            exited.timed_out = true;
                            ProcessEnd::Exited(exited)
                        }
                        other => other,
                    })
                }
            },
        };
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
            Ok(ProcessEnd::Gone(reason)) => return Err(Error::InstanceGone { reason }),
            Err(_) => {
                return Err(Error::InstanceGone {
                    reason: "the control channel closed".into(),
                })
            }
        };
        self.end = None;
        self.status = Some(status);
        Ok(status)
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        // Cancellation: a process nobody waits for anymore is killed, group and all.
        if self.status.is_none() {
            if let Ok(control) = self.instance.control() {
                let _ = control.send(&HostMessage::Signal(SignalProcess {
                    id: self.key,
                    signal: libc::SIGKILL,
                }));
            }
        }
    }
}

/// Chunks from the control channel, read as a byte stream.
#[derive(Debug)]
struct Receiver {
    rx: mpsc::UnboundedReceiver<Vec<u8>>,
    chunk: Vec<u8>,
    pos: usize,
}

impl Receiver {
    fn new(rx: mpsc::UnboundedReceiver<Vec<u8>>) -> Self {
        Receiver {
            rx,
            chunk: Vec::new(),
            pos: 0,
        }
    }

    fn poll_read(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        while self.pos == self.chunk.len() {
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(chunk)) => {
                    self.chunk = chunk;
                    self.pos = 0;
                }
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
        let n = buf.remaining().min(self.chunk.len() - self.pos);
        buf.put_slice(&self.chunk[self.pos..self.pos + n]);
        self.pos += n;
        Poll::Ready(Ok(()))
    }
}

/// A child's standard output ([`AsyncRead`]); ends when the process and everything it started
/// have closed it.
#[derive(Debug)]
pub struct ChildStdout(Receiver);

/// A child's standard error ([`AsyncRead`]).
#[derive(Debug)]
pub struct ChildStderr(Receiver);

impl AsyncRead for ChildStdout {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.get_mut().0.poll_read(cx, buf)
    }
}

impl AsyncRead for ChildStderr {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.get_mut().0.poll_read(cx, buf)
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

/// The result of [`Command::output`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// How it ended.
    pub status: ExitStatus,
    /// Everything written to stdout.
    pub stdout: Vec<u8>,
    /// Everything written to stderr.
    pub stderr: Vec<u8>,
}

impl Output {
    /// Stdout as text (lossy UTF-8).
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// Stderr as text (lossy UTF-8).
    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}
