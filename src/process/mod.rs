//! Processes in the guest, shaped like `tokio::process`.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use std::sync::Arc;

use serde_bytes::ByteBuf;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio_util::sync::{CancellationToken, PollSemaphore};

use crate::control::{Control, Gone, OutputItem, ProcessEnd};
use crate::error::{Error, Result};
use crate::instance::Instance;
use crate::protocol::{
    self, limits::MAX_CHUNK, Exec, HostMessage, ProcessRef, PtySize, Resize, SignalProcess,
    StdinData, Stream, OUTPUT_WINDOW,
};

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
    stdin: Stdio,
    pty: Option<PtySize>,
    output_limit: Option<usize>,
    cancel: Option<CancellationToken>,
}

/// What a command's stdin is connected to.
///
/// ```
/// # fn demo(vm: &krunbox::Instance) {
/// use krunbox::Stdio;
/// let mut cmd = vm.command("cat");
/// cmd.stdin(Stdio::piped());
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stdio {
    piped: bool,
}

impl Stdio {
    /// `/dev/null` (the default).
    pub fn null() -> Stdio {
        Stdio { piped: false }
    }

    /// A pipe the host writes through [`Child::stdin`].
    pub fn piped() -> Stdio {
        Stdio { piped: true }
    }
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
            stdin: Stdio::null(),
            pty: None,
            output_limit: None,
            cancel: None,
        }
    }

    /// Connects stdin: [`Stdio::null`] (default) or [`Stdio::piped`] for [`Child::stdin`].
    pub fn stdin(&mut self, stdin: Stdio) -> &mut Command {
        self.stdin = stdin;
        self
    }

    /// Runs the command on a new pseudo-terminal of `rows` × `cols`: it sees a real terminal
    /// (`isatty`, `stty size`, job control, Ctrl-C as SIGINT). [`Child::stdin`] writes to the
    /// terminal, [`Child::stdout`] reads everything it displays (stderr included);
    /// [`Child::resize`] changes its size.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// use tokio::io::{AsyncReadExt, AsyncWriteExt};
    ///
    /// let mut shell = vm.command("sh").pty(24, 80).spawn().await?;
    /// let mut input = shell.stdin.take().unwrap();
    /// input.write_all(b"stty size; exit\n").await.unwrap();
    /// let mut screen = String::new();
    /// shell.stdout.take().unwrap().read_to_string(&mut screen).await.unwrap();
    /// assert!(screen.contains("24 80"));
    /// # Ok(()) }
    /// ```
    pub fn pty(&mut self, rows: u16, cols: u16) -> &mut Command {
        self.pty = Some(PtySize { rows, cols });
        self
    }

    /// Caps what [`output`](Self::output) keeps of each stream at `bytes`; the rest is read
    /// and dropped, and [`Output::stdout_truncated`] / [`Output::stderr_truncated`] say so.
    pub fn output_limit(&mut self, bytes: usize) -> &mut Command {
        self.output_limit = Some(bytes);
        self
    }

    /// Cancelling `token` kills the command's process group; [`output`](Self::output) and
    /// [`status`](Self::status) then return [`Error::Cancelled`]. (Dropping their future does
    /// the same without a token.)
    pub fn cancel_on(&mut self, token: CancellationToken) -> &mut Command {
        self.cancel = Some(token);
        self
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
    /// code 124 and [`ExitStatus::timed_out`]. The timeout covers the whole command: a
    /// command that exits while something it started still holds its output open times out
    /// too, and output written before the kill is kept.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// use std::time::Duration;
    ///
    /// let out = vm
    ///     .command("sh")
    ///     .args(["-c", "echo started; sleep 600"])
    ///     .timeout(Duration::from_secs(5))
    ///     .output()
    ///     .await?;
    /// assert_eq!(out.status.code(), Some(124));
    /// assert_eq!(out.stdout, b"started\n");
    /// # Ok(()) }
    /// ```
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
            stdin: self.stdin.piped,
            pty: self.pty,
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
        // The host's backstop counts from here, like guest-init's own deadline.
        let backstop = Backstop {
            control: control.clone(),
            id,
            deadline: self.timeout.and_then(|t| {
                tokio::time::Instant::now().checked_add(t.saturating_add(TIMEOUT_GRACE))
            }),
            fired: false,
        };
        let channels = control.register(id)?;
        control.send(&message)?;
        // From here the process may be running: if this future is dropped (cancelled) before
        // it returns a `Child`, the guard kills it.
        let mut guard = KillOnDrop {
            control: control.clone(),
            id,
            armed: true,
        };
        let mut end = channels.end;
        // guest-init sends Started before anything else about a process, and one connection
        // keeps the order; but a quick process can have both Started and its end waiting
        // here, so look at Started first.
        let pid = tokio::select! {
            biased;
            pid = channels.started => pid.ok(),
            end = &mut end => {
                guard.armed = false;
                return Err(self.early_end(end));
            }
        };
        let Some(pid) = pid else {
            let end = end.await;
            guard.armed = false;
            return Err(self.early_end(end));
        };
        // The Child takes over: dropping it kills the process.
        guard.armed = false;
        let has_stdin = self.stdin.piped || self.pty.is_some();
        Ok(Child {
            instance: self.instance.clone(),
            key: id,
            pid,
            stdin: has_stdin.then(|| ChildStdin {
                control: control.clone(),
                id,
                credit: PollSemaphore::new(channels.stdin_credit),
                closed: false,
            }),
            stdout: Some(ChildStdout(Receiver::new(
                channels.stdout,
                control.clone(),
                id,
                Stream::Stdout,
            ))),
            stderr: self.pty.is_none().then(|| {
                ChildStderr(Receiver::new(
                    channels.stderr,
                    control.clone(),
                    id,
                    Stream::Stderr,
                ))
            }),
            end: Some(end),
            status: None,
            backstop,
            is_pty: self.pty.is_some(),
        })
    }

    fn early_end(&self, end: std::result::Result<ProcessEnd, oneshot::error::RecvError>) -> Error {
        match end {
            Ok(ProcessEnd::Failed(failed)) => Error::Exec {
                program: self.program.to_string_lossy().into_owned(),
                kind: failed.kind,
                message: failed.message,
            },
            Ok(ProcessEnd::Gone(reason)) => reason.error(),
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
        let limit = self.output_limit.unwrap_or(usize::MAX);
        self.run_collecting(limit).await
    }

    /// Runs the command to completion, keeping at most `limit` bytes of each output stream.
    async fn run_collecting(&mut self, limit: usize) -> Result<Output> {
        let cancel = self.cancel.clone().unwrap_or_default();
        // Dropping this future drops the child, which kills its process group.
        let mut child = tokio::select! {
            child = self.spawn() => child?,
            _ = cancel.cancelled() => return Err(Error::Cancelled),
        };
        let stdout = child.stdout.take().expect("fresh child has stdout");
        let stderr = child.stderr.take();
        let collect = async {
            let streams = async {
                tokio::join!(read_capped(stdout, limit), async {
                    match stderr {
                        Some(s) => read_capped(s, limit).await,
                        None => Ok((Vec::new(), false)),
                    }
                })
            };
            // guest-init ends a timed-out command's streams too; should it not, the host kills
            // the process group itself.
            let (out, err) = child.backstop.run(streams).await?;
            let status = child.wait().await?;
            let ((stdout, stdout_truncated), (stderr, stderr_truncated)) = (
                out.map_err(Error::io("reading command output"))?,
                err.map_err(Error::io("reading command output"))?,
            );
            Ok(Output {
                status,
                stdout,
                stderr,
                stdout_truncated,
                stderr_truncated,
            })
        };
        tokio::select! {
            output = collect => output,
            _ = cancel.cancelled() => Err(Error::Cancelled),
        }
    }

    /// Runs the command to completion, discarding its output (read and dropped as it comes,
    /// so a command that writes without end costs no host memory).
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let status = vm.command("sh").args(["-c", "yes | head -c 100000000; exit 2"]).status().await?;
    /// assert_eq!(status.code(), Some(2));
    /// # Ok(()) }
    /// ```
    pub async fn status(&mut self) -> Result<ExitStatus> {
        Ok(self.run_collecting(0).await?.status)
    }
}

/// Reads a stream to its end, keeping at most `limit` bytes.
async fn read_capped<R: AsyncRead + Unpin>(
    mut reader: R,
    limit: usize,
) -> std::io::Result<(Vec<u8>, bool)> {
    let mut kept = Vec::new();
    let mut truncated = false;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = reader.read(&mut buf).await?;
        if n == 0 {
            return Ok((kept, truncated));
        }
        let room = limit.saturating_sub(kept.len());
        kept.extend_from_slice(&buf[..n.min(room)]);
        truncated |= n > room;
    }
}

/// A running process in the guest.
#[derive(Debug)]
pub struct Child {
    instance: Instance,
    /// The control-channel process id (not the guest pid).
    key: u32,
    pid: u32,
    is_pty: bool,
    /// The process's standard input, when it was spawned with [`Stdio::piped`] or a pty.
    pub stdin: Option<ChildStdin>,
    /// The process's standard output, streaming (a pty's whole screen output).
    pub stdout: Option<ChildStdout>,
    /// The process's standard error, streaming.
    pub stderr: Option<ChildStderr>,
    end: Option<oneshot::Receiver<ProcessEnd>>,
    status: Option<ExitStatus>,
    backstop: Backstop,
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

    /// Changes the size of the process's pty; the foreground process group gets SIGWINCH.
    /// An error if the command was not started with [`Command::pty`].
    pub fn resize(&self, rows: u16, cols: u16) -> Result<()> {
        if !self.is_pty {
            return Err(Error::InvalidConfig(
                "resize needs a command started with .pty(rows, cols)".into(),
            ));
        }
        if self.status.is_some() {
            return Ok(());
        }
        self.instance.control()?.send(&HostMessage::Resize(Resize {
            id: self.key,
            size: PtySize { rows, cols },
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
        Ok(status)
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        // Bytes read but not yet credited, plus whatever arrives later, are released so the
        // process is not stalled by a reader that went away (the control task discards them).
        if self.uncredited > 0 {
            self.control.credit(self.id, self.stream, self.uncredited);
        }
        self.rx.close();
        while let Ok(item) = self.rx.try_recv() {
            if let OutputItem::Data(chunk) = item {
                self.control
                    .credit(self.id, self.stream, chunk.len() as u32);
            }
        }
    }
}

/// A child's standard input ([`AsyncWrite`]), for commands spawned with [`Stdio::piped`] or a
/// pty. Writes wait while the guest has not yet consumed earlier input (bounded memory on both
/// sides). Shutting it down (or dropping it) closes the process's stdin.
pub struct ChildStdin {
    control: Arc<Control>,
    id: u32,
    credit: PollSemaphore,
    closed: bool,
}

impl fmt::Debug for ChildStdin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChildStdin")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

fn broken_pipe() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::BrokenPipe,
        "the guest process has ended",
    )
}

impl AsyncWrite for ChildStdin {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.closed {
            return Poll::Ready(Err(broken_pipe()));
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        // One permit is one byte the guest has room for.
        let first = match this.credit.poll_acquire(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(None) => return Poll::Ready(Err(broken_pipe())),
            Poll::Ready(Some(permit)) => permit,
        };
        let semaphore: &Semaphore = this.credit.as_ref();
        let extra = buf
            .len()
            .min(MAX_CHUNK)
            .saturating_sub(1)
            .min(semaphore.available_permits());
        let n = 1 + match semaphore.try_acquire_many(extra as u32) {
            Ok(permits) => {
                permits.forget();
                extra
            }
            Err(_) => 0,
        };
        first.forget();
        let message = HostMessage::Stdin(StdinData {
            id: this.id,
            data: ByteBuf::from(buf[..n].to_vec()),
        });
        match this.control.send(&message) {
            Ok(()) => Poll::Ready(Ok(n)),
            Err(_) => Poll::Ready(Err(broken_pipe())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if !this.closed {
            this.closed = true;
            let _ = this
                .control
                .send(&HostMessage::CloseStdin(ProcessRef { id: this.id }));
        }
        Poll::Ready(Ok(()))
    }
}

impl Drop for ChildStdin {
    fn drop(&mut self) {
        if !self.closed {
            let _ = self
                .control
                .send(&HostMessage::CloseStdin(ProcessRef { id: self.id }));
        }
    }
}

/// The host's backstop for a command's timeout, which guest-init enforces. Should guest-init
/// not have ended the command [`TIMEOUT_GRACE`] after the timeout, the host sends the kill
/// itself; should the guest still not end it within another grace period, it is unresponsive,
/// and waiting longer would hang the caller.
struct Backstop {
    control: Arc<Control>,
    id: u32,
    /// When the host stops waiting for guest-init; `None` without a timeout.
    deadline: Option<tokio::time::Instant>,
    /// The host had to send the kill itself.
    fired: bool,
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
    async fn run<F: std::future::Future>(&mut self, work: F) -> Result<F::Output> {
        let Some(deadline) = self.deadline else {
            return Ok(work.await);
        };
        tokio::pin!(work);
        if let Ok(done) = tokio::time::timeout_at(deadline, &mut work).await {
            return Ok(done);
        }
        if !self.fired {
            self.fired = true;
            tracing::warn!(id = self.id, "guest did not enforce a timeout; killing");
            send_kill(&self.control, self.id);
        }
        let Some(last) = deadline.checked_add(TIMEOUT_GRACE) else {
            return Ok(work.await);
        };
        tokio::time::timeout_at(last, work)
            .await
            .map_err(|_| Error::GuestUnresponsive {
                after: TIMEOUT_GRACE * 2,
            })
    }
}

/// Asks guest-init to SIGKILL process `id`'s group (ignored if it has already ended).
fn send_kill(control: &Control, id: u32) {
    let _ = control.send(&HostMessage::Signal(SignalProcess {
        id,
        signal: libc::SIGKILL,
    }));
}

/// Kills a process whose `Exec` was sent but whose [`Child`] does not exist yet, should the
/// spawn be abandoned (its future dropped) in between.
struct KillOnDrop {
    control: Arc<Control>,
    id: u32,
    armed: bool,
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
        // Cancellation: a process nobody waits for anymore is killed, group and all.
        if self.status.is_none() {
            if let Ok(control) = self.instance.control() {
                send_kill(&control, self.key);
            }
        }
    }
}

/// Chunks from the control channel, read as a byte stream. Consumed bytes are credited back
/// to the guest in batches, so at most [`OUTPUT_WINDOW`] bytes per stream wait in host memory.
struct Receiver {
    rx: mpsc::UnboundedReceiver<OutputItem>,
    chunk: Vec<u8>,
    /// Why the stream broke off, once it did: every later read reports it again.
    broken: Option<Gone>,
    pos: usize,
    control: Arc<Control>,
    id: u32,
    stream: Stream,
    uncredited: u32,
}

impl fmt::Debug for Receiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver")
            .field("id", &self.id)
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl Receiver {
    fn new(
        rx: mpsc::UnboundedReceiver<OutputItem>,
        control: Arc<Control>,
        id: u32,
        stream: Stream,
    ) -> Self {
        Receiver {
            rx,
            chunk: Vec::new(),
            broken: None,
            pos: 0,
            control,
            id,
            stream,
            uncredited: 0,
        }
    }

    fn poll_read(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        while self.pos == self.chunk.len() {
            if let Some(reason) = &self.broken {
                return Poll::Ready(Err(std::io::Error::other(reason.error())));
            }
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(OutputItem::Broken(reason))) => self.broken = Some(reason),
                Poll::Ready(Some(OutputItem::Data(chunk))) => {
                    // The chunk left the channel: credit once a quarter window accumulated.
                    self.uncredited += chunk.len() as u32;
                    if self.uncredited >= OUTPUT_WINDOW / 4 {
                        self.control.credit(self.id, self.stream, self.uncredited);
                        self.uncredited = 0;
                    }
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
///
/// If the VM stops before the process ends, the stream is incomplete: reads then fail with an
/// [`std::io::Error`] whose inner error is [`Error::InstanceGone`], never a clean end of file.
///
/// ```no_run
/// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
/// use tokio::io::AsyncReadExt;
///
/// let mut child = vm.command("ls").arg("/").spawn().await?;
/// let mut listing = String::new();
/// match child.stdout.take().unwrap().read_to_string(&mut listing).await {
///     Ok(_) => println!("{listing}"),
///     Err(err) => match err.get_ref().and_then(|e| e.downcast_ref::<krunbox::Error>()) {
///         Some(krunbox::Error::InstanceGone { reason }) => eprintln!("VM stopped: {reason}"),
///         _ => eprintln!("reading failed: {err}"),
///     },
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct ChildStdout(Receiver);

/// A child's standard error ([`AsyncRead`]); behaves like [`ChildStdout`].
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
    /// Everything written to stdout (up to [`Command::output_limit`]).
    pub stdout: Vec<u8>,
    /// Everything written to stderr (up to [`Command::output_limit`]).
    pub stderr: Vec<u8>,
    /// Whether stdout was cut at the output limit.
    pub stdout_truncated: bool,
    /// Whether stderr was cut at the output limit.
    pub stderr_truncated: bool,
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
