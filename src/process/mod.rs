//! Processes in the guest, shaped like `tokio::process`.
//!
//! One concern per file: this module builds and starts commands ([`Command`]); `child` has the
//! running process and how it ends, `stdio` its streams, `output` collecting them, `guest`
//! what they need of the instance they run in.

mod child;
mod guest;
mod output;
mod stdio;

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_bytes::ByteBuf;
use tokio::sync::oneshot;
use tokio_util::sync::{CancellationToken, PollSemaphore};

pub use child::{Child, ChildControl, ExitStatus, TIMEOUT_EXIT_CODE};
pub(crate) use guest::Guest;
pub use output::{Output, DEFAULT_MAX_OUTPUT};
pub use stdio::{ChildStderr, ChildStdin, ChildStdout};

use crate::control::{Control, ProcessEnd};
use crate::error::{Error, Result};
use crate::protocol::{Exec, HostMessage, PtySize, Stream};
use child::{Backstop, KillOnDrop, TIMEOUT_GRACE};
use stdio::Receiver;

/// The guest environment a command starts from (the host's environment never crosses over).
const BASE_ENV: [(&str, &str); 2] = [
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ),
    ("HOME", "/root"),
];

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
    instance: Arc<dyn Guest>,
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
    max_output: usize,
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
    pub(crate) fn new(instance: Arc<dyn Guest>, program: &OsStr) -> Command {
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
            max_output: DEFAULT_MAX_OUTPUT,
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

    /// Caps what [`output`](Self::output) collects of each stream at `bytes` (default
    /// [`DEFAULT_MAX_OUTPUT`], 64 MiB); past it the command is killed and `output()` fails
    /// with [`Error::OutputLimitExceeded`]. (With [`output_limit`](Self::output_limit), output
    /// is cut instead, and this cap does not apply.)
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let out = vm.command("cat").arg("/var/log/big.log").max_output(512 << 20).output().await?;
    /// # Ok(()) }
    /// ```
    pub fn max_output(&mut self, bytes: usize) -> &mut Command {
        self.max_output = bytes;
        self
    }

    /// Cancelling `token` kills the command's process group; [`output`](Self::output) and
    /// [`status`](Self::status) then return [`Error::Cancelled`]. (Dropping their future does
    /// the same without a token.) A command whose token is cancelled before it starts never
    /// starts: [`spawn`](Self::spawn) (with or without a pty) returns [`Error::Cancelled`]
    /// without sending it to the guest; once spawned, cancelling kills its process group as
    /// [`Child::kill`] does, and [`Child::wait`] reports how it ended.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let stop = krunbox::CancellationToken::new();
    /// let mut child = vm.command("sleep").arg("600").cancel_on(stop.clone()).spawn().await?;
    /// stop.cancel(); // e.g. the agent's user pressed stop
    /// assert_eq!(child.wait().await?.signal(), Some(9));
    /// # Ok(()) }
    /// ```
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
        use tracing::Instrument;
        let span = tracing::info_span!(
            parent: &self.instance.span(),
            "exec",
            program = %self.program.to_string_lossy()
        );
        self.spawn_now().instrument(span).await
    }

    async fn spawn_now(&mut self) -> Result<Child> {
        let cancel = self.cancel.clone();
        if cancel.as_ref().is_some_and(|token| token.is_cancelled()) {
            // Checked before anything reaches the guest: a cancelled command never starts.
            return Err(Error::Cancelled);
        }
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
            deadline: self
                .timeout
                .map(|t| control.deadline(t.saturating_add(TIMEOUT_GRACE))),
            fired: false,
        };
        // Cancelled while it starts: dropping `start` kills what it may have started.
        let started = match &cancel {
            Some(token) => tokio::select! {
                biased;
                _ = token.cancelled() => return Err(Error::Cancelled),
                started = start(&control, id, &message, &self.program) => started?,
            },
            None => start(&control, id, &message, &self.program).await?,
        };

        tracing::debug!(pid = started.pid, "process started");
        let has_stdin = self.stdin.piped || self.pty.is_some();
        let mut child = assemble(
            self.instance.clone(),
            &control,
            id,
            started.pid,
            started.channels,
            started.end,
            Streams {
                stdin: has_stdin,
                pty: self.pty.is_some(),
            },
        );
        child.backstop = backstop;
        child.cancel_watch =
            cancel.map(|token| child::watch_cancellation(token, control.clone(), id));
        Ok(child)
    }
}

/// Which of a process's streams its `Child` has.
struct Streams {
    stdin: bool,
    pty: bool,
}

/// A `Child` for process `id` (guest pid `pid`) from its channels; no backstop, no
/// cancellation watch.
fn assemble(
    instance: Arc<dyn Guest>,
    control: &Arc<Control>,
    id: u32,
    pid: u32,
    channels: StartedChannels,
    end: oneshot::Receiver<ProcessEnd>,
    streams: Streams,
) -> Child {
    Child {
        instance,
        key: id,
        pid,
        stdin: streams.stdin.then(|| ChildStdin {
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
        stderr: (!streams.pty).then(|| {
            ChildStderr(Receiver::new(
                channels.stderr,
                control.clone(),
                id,
                Stream::Stderr,
            ))
        }),
        end: Some(end),
        status: None,
        backstop: Backstop {
            control: control.clone(),
            id,
            deadline: None,
            fired: false,
        },
        is_pty: streams.pty,
        cancel_watch: None,
    }
}

/// A `Child` for a process a restored instance took over from its snapshot
/// ([`Instance::attach`](crate::Instance::attach)): its stdin, output and end, as the process
/// had them (what the snapshotted host had received and not handed out stays with that host).
pub(crate) fn adopt(
    instance: Arc<dyn Guest>,
    control: &Arc<Control>,
    saved: &crate::control::SavedProcess,
    channels: crate::control::ProcessChannels,
) -> Child {
    let pid = saved.pid.unwrap_or(0);
    assemble(
        instance,
        control,
        saved.key,
        pid,
        StartedChannels {
            stdout: channels.stdout,
            stderr: channels.stderr,
            stdin_credit: channels.stdin_credit,
        },
        channels.end,
        Streams {
            stdin: true,
            pty: saved.pty,
        },
    )
}

/// A process guest-init reported started, and the host's ends of its channels.
struct Started {
    pid: u32,
    channels: StartedChannels,
    end: oneshot::Receiver<ProcessEnd>,
}

struct StartedChannels {
    stdout: crate::output_queue::OutputReceiver<crate::control::OutputItem>,
    stderr: crate::output_queue::OutputReceiver<crate::control::OutputItem>,
    stdin_credit: std::sync::Arc<tokio::sync::Semaphore>,
}

/// Registers process `id`, sends its `Exec` (`message`) and waits for guest-init to report it
/// started, at most [`Limits::request_timeout`](crate::Limits::request_timeout) (then
/// [`Error::RequestTimeout`]). Ended any other way than with the process started (an error,
/// the deadline, or this future dropped), the process is killed.
async fn start(
    control: &std::sync::Arc<Control>,
    id: u32,
    message: &HostMessage,
    program: &OsStr,
) -> Result<Started> {
    let pty = matches!(message, HostMessage::Exec(exec) if exec.pty.is_some());
    let channels = control.register_and_send(id, pty, message)?;
    // From here the process may be running: if this future is dropped (cancelled) or gives up
    // before it returns, the guard kills it.
    let mut guard = KillOnDrop {
        control: control.clone(),
        id,
        armed: true,
    };
    let mut end = channels.end;
    let mut started = channels.started;
    let timeout = control.limits.request_timeout;
    // In the guest's running time: a pause while the process starts does not use it up.
    let deadline = control.deadline(timeout).elapsed();
    let pid = timeout_on(deadline, async {
        // guest-init sends Started before anything else about a process, and one connection
        // keeps the order; but a quick process can have both Started and its end waiting
        // here, so look at Started first.
        let pid = tokio::select! {
            biased;
            pid = &mut started => pid.ok(),
            ended = &mut end => {
                guard.armed = false;
                return Err(early_end(program, ended));
            }
        };
        let Some(pid) = pid else {
            let ended = (&mut end).await;
            guard.armed = false;
            return Err(early_end(program, ended));
        };
        Ok(pid)
    })
    .await
    .ok_or_else(|| Error::RequestTimeout {
        request: format!("spawn {program:?} (waiting for the process to start)"),
        after: timeout,
    })??;
    // The caller's Child takes over: dropping it kills the process.
    guard.armed = false;
    Ok(Started {
        pid,
        channels: StartedChannels {
            stdout: channels.stdout,
            stderr: channels.stderr,
            stdin_credit: channels.stdin_credit,
        },
        end,
    })
}

fn early_end(
    program: &OsStr,
    end: std::result::Result<ProcessEnd, oneshot::error::RecvError>,
) -> Error {
    match end {
        Ok(ProcessEnd::Failed(failed)) => Error::Exec {
            program: program.to_string_lossy().into_owned(),
            kind: failed.kind,
            message: failed.message,
        },
        Ok(ProcessEnd::Gone(reason)) => reason.error(),
        Ok(ProcessEnd::Exited(_)) | Err(_) => Error::InstanceGone {
            reason: "the guest ended the process before reporting it started".into(),
        },
    }
}

/// `work`'s output, or `None` if `deadline` comes first.
async fn timeout_on<T>(
    deadline: impl std::future::Future<Output = ()>,
    work: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        biased;
        done = work => Some(done),
        _ = deadline => None,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::*;
    use crate::limits::Limits;
    use crate::protocol::{GuestMessage, SignalProcess};
    use crate::scripted_guest;

    fn exec(id: u32) -> HostMessage {
        HostMessage::Exec(Exec {
            id,
            argv: vec![ByteBuf::from(b"sleep".to_vec())],
            env: vec![],
            cwd: None,
            uid: None,
            gid: None,
            timeout_ms: None,
            stdin: false,
            pty: None,
        })
    }

    /// A guest that answers pings but never reports the process started: `spawn` fails at its
    /// deadline (not when the liveness check would, which it never does here), and the process
    /// it may have started is killed.
    #[tokio::test(start_paused = true)]
    async fn a_spawn_the_guest_never_answers_fails_at_its_deadline_and_kills() {
        let timeout = Duration::from_secs(45);
        let (control, log) =
            scripted_guest::start(Limits::new().request_timeout(timeout), |_| vec![]);
        let started = Instant::now();
        let result = tokio::time::timeout(
            timeout * 10,
            start(&control, 7, &exec(7), OsStr::new("sleep")),
        )
        .await
        .expect("spawn must not wait forever");
        let waited = started.elapsed();
        match result {
            Err(Error::RequestTimeout { request, after }) => {
                assert_eq!(after, timeout);
                assert!(request.starts_with("spawn \"sleep\""), "{request}");
            }
            other => panic!("expected RequestTimeout, got {:?}", other.err()),
        }
        assert!(
            waited >= timeout && waited < timeout + Duration::from_secs(1),
            "{waited:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
        let log = log.lock().unwrap();
        assert!(matches!(log[0], HostMessage::Exec(_)), "{log:?}");
        assert!(
            log.contains(&HostMessage::Signal(SignalProcess {
                id: 7,
                signal: libc::SIGKILL
            })),
            "{log:?}"
        );
        assert!(control.gone().is_none(), "the instance stays usable");
    }

    /// The host tracks at most `max_processes` processes the guest has not reported ended;
    /// one more fails at once, before anything is sent.
    #[tokio::test(start_paused = true)]
    async fn processes_past_the_cap_fail_at_once() {
        let (control, log) =
            scripted_guest::start(Limits::new().max_processes(2), |message| match message {
                HostMessage::Exec(exec) => vec![GuestMessage::Started(crate::protocol::Started {
                    id: exec.id,
                    pid: 100 + exec.id,
                })],
                _ => vec![],
            });
        let a = start(&control, 1, &exec(1), OsStr::new("sleep"))
            .await
            .unwrap();
        let b = start(&control, 2, &exec(2), OsStr::new("sleep"))
            .await
            .unwrap();
        assert_eq!((a.pid, b.pid), (101, 102));
        let err = start(&control, 3, &exec(3), OsStr::new("sleep"))
            .await
            .err()
            .unwrap();
        assert!(
            matches!(
                err,
                Error::TooMany {
                    limit: 2,
                    knob: "max_processes",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("max_processes"), "{err}");
        tokio::time::sleep(Duration::from_millis(10)).await;
        let execs = log
            .lock()
            .unwrap()
            .iter()
            .filter(|m| matches!(m, HostMessage::Exec(_)))
            .count();
        assert_eq!(execs, 2, "nothing past the cap was sent");
    }

    /// A guest for whole commands: the scripted control channel and fresh ids.
    struct Scripted(Arc<Control>, std::sync::atomic::AtomicU32);

    impl std::fmt::Debug for Scripted {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Scripted")
        }
    }

    impl Guest for Scripted {
        fn control(&self) -> Result<Arc<Control>> {
            Ok(self.0.clone())
        }
        fn next_process_id(&self) -> u32 {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        }
        fn span(&self) -> tracing::Span {
            tracing::Span::none()
        }
    }

    /// A command whose token is cancelled before it starts never reaches the guest, with or
    /// without a pty; one cancelled once started is killed, group and all, with nobody waiting.
    #[tokio::test(start_paused = true)]
    async fn a_cancelled_token_starts_nothing_and_kills_what_started() {
        let (control, log) = scripted_guest::start(Limits::new(), |message| match message {
            HostMessage::Exec(exec) => vec![GuestMessage::Started(crate::protocol::Started {
                id: exec.id,
                pid: 100 + exec.id,
            })],
            _ => vec![],
        });
        let guest: Arc<dyn Guest> = Arc::new(Scripted(control, 1.into()));
        let cancelled = CancellationToken::new();
        cancelled.cancel();
        for pty in [false, true] {
            let mut command = Command::new(guest.clone(), OsStr::new("sleep"));
            command.cancel_on(cancelled.clone());
            if pty {
                command.pty(24, 80);
            }
            assert!(matches!(command.spawn().await, Err(Error::Cancelled)));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(
            log.lock().unwrap().is_empty(),
            "sent: {:?}",
            log.lock().unwrap()
        );

        let stop = CancellationToken::new();
        let child = Command::new(guest.clone(), OsStr::new("sleep"))
            .cancel_on(stop.clone())
            .spawn()
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        let kill = HostMessage::Signal(SignalProcess {
            id: child.key,
            signal: libc::SIGKILL,
        });
        assert!(
            !log.lock().unwrap().contains(&kill),
            "killed before the cancel"
        );
        stop.cancel();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(
            log.lock().unwrap().contains(&kill),
            "{:?}",
            log.lock().unwrap()
        );
        drop(child);
    }
}
