//! Running commands: spawn, stream output, enforce timeouts, reap, report.
//!
//! Threads, not an async runtime: guest-init is PID 1 of a small VM and should stay a small,
//! obvious static binary. Each process gets one supervising thread plus one reader per output
//! stream; a single reaper thread collects every exit status.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use krunbox_protocol::{
    limits::MAX_CHUNK, Exec, ExecErrorKind, ExecFailed, ExitStatus, Exited, GuestMessage, Output,
    Started, Stream,
};
use serde_bytes::ByteBuf;

use crate::sys::check;

/// Used when the command's environment has no `PATH` of its own.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Sends one message to the host (through the writer thread). Returns false once the host is
/// gone.
#[derive(Clone)]
pub struct Outbox(SyncSender<Vec<u8>>);

impl Outbox {
    /// Wraps the writer thread's channel.
    pub fn new(tx: SyncSender<Vec<u8>>) -> Self {
        Self(tx)
    }

    /// Encodes and queues a message; blocks while the queue is full (backpressure from the
    /// host's reading speed all the way to the process's pipe).
    pub fn send(&self, msg: &GuestMessage) -> bool {
        match msg.encode() {
            Ok(bytes) => self.0.send(bytes).is_ok(),
            Err(err) => {
                eprintln!("guest-init: cannot encode {msg:?}: {err}");
                true
            }
        }
    }
}

#[derive(Default)]
struct ReapState {
    /// Pids we spawned and still wait for.
    ours: HashSet<i32>,
    /// Exit statuses collected for those pids.
    exited: HashMap<i32, ExitStatus>,
}

/// Collects exit statuses of all children (including orphans re-parented to PID 1).
///
/// `std::process::Command::spawn` waits for its own child when `exec` fails, and panics if
/// someone else reaped it first. So reaping happens only under `state`'s lock, which
/// [`Reaper::spawn`] also holds across the whole spawn.
pub struct Reaper {
    state: Mutex<ReapState>,
    changed: Condvar,
}

impl Reaper {
    /// Blocks SIGCHLD in the calling thread (call from `main` before any thread starts, so
    /// every thread inherits the mask) and starts the reaper thread on a signalfd.
    pub fn start() -> io::Result<Arc<Reaper>> {
        // SAFETY: sigset manipulation on a local; pthread_sigmask and signalfd on valid args.
        let sfd = unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGCHLD);
            let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            if rc != 0 {
                return Err(io::Error::from_raw_os_error(rc));
            }
            check("signalfd", libc::signalfd(-1, &set, libc::SFD_CLOEXEC))?
        };
        let reaper = Arc::new(Reaper {
            state: Mutex::new(ReapState::default()),
            changed: Condvar::new(),
        });
        let r = reaper.clone();
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || r.run(sfd))?;
        Ok(reaper)
    }

    fn run(&self, sfd: libc::c_int) {
        let mut info = [0u8; std::mem::size_of::<libc::signalfd_siginfo>()];
        loop {
            // SAFETY: reading into a buffer of the right size from our signalfd.
            let n = unsafe { libc::read(sfd, info.as_mut_ptr() as *mut libc::c_void, info.len()) };
            if n < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                eprintln!(
                    "guest-init: signalfd read failed: {}",
                    io::Error::last_os_error()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                let mut status = 0;
                // SAFETY: waitpid with a valid status pointer.
                let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
                if pid <= 0 {
                    break;
                }
                if state.ours.remove(&pid) {
                    let status = if libc::WIFSIGNALED(status) {
                        ExitStatus::Signal(libc::WTERMSIG(status))
                    } else {
                        ExitStatus::Code(libc::WEXITSTATUS(status))
                    };
                    state.exited.insert(pid, status);
                }
            }
            drop(state);
            self.changed.notify_all();
        }
    }

    /// Spawns with reaping held off, and registers the pid.
    fn spawn(&self, cmd: &mut Command) -> io::Result<std::process::Child> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let child = cmd.spawn()?;
        state.ours.insert(child.id() as i32);
        Ok(child)
    }

    /// Waits for `pid`'s exit until `deadline`; `None` if the deadline passed first.
    fn wait(&self, pid: i32, deadline: Option<Instant>) -> Option<ExitStatus> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(status) = state.exited.remove(&pid) {
                return Some(status);
            }
            match deadline {
                None => state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return None;
                    }
                    state = self
                        .changed
                        .wait_timeout(state, deadline - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
    }
}

/// Live processes by host id, with their process-group ids.
#[derive(Default, Clone)]
pub struct Table(Arc<Mutex<HashMap<u32, i32>>>);

impl Table {
    /// Signals the process group of host id `id`. Unknown ids (already exited) are ignored.
    pub fn signal(&self, id: u32, signal: i32) {
        if !(1..=64).contains(&signal) {
            eprintln!("guest-init: refusing out-of-range signal {signal}");
            return;
        }
        if let Some(&pgid) = self.0.lock().unwrap_or_else(|p| p.into_inner()).get(&id) {
            // SAFETY: plain syscall.
            unsafe { libc::killpg(pgid, signal) };
        }
    }
}

fn exec_error_kind(err: &io::Error) -> ExecErrorKind {
    match err.kind() {
        io::ErrorKind::NotFound => ExecErrorKind::NotFound,
        io::ErrorKind::PermissionDenied => ExecErrorKind::PermissionDenied,
        _ => ExecErrorKind::Other,
    }
}

fn fail(outbox: &Outbox, id: u32, err: &io::Error, what: String) {
    let mut message = format!("{what}: {err}");
    message.truncate(krunbox_protocol::limits::MAX_TEXT);
    outbox.send(&GuestMessage::ExecFailed(ExecFailed {
        id,
        kind: exec_error_kind(err),
        errno: err.raw_os_error().unwrap_or(0),
        message,
    }));
}

/// Starts `exec` and supervises it on its own thread; reports everything through `outbox`.
pub fn start(exec: Exec, reaper: &Arc<Reaper>, table: &Table, outbox: &Outbox) {
    let id = exec.id;
    let program = OsStr::from_bytes(&exec.argv[0]).to_owned();
    let cwd = exec
        .cwd
        .as_ref()
        .map(|c| OsStr::from_bytes(c).to_owned())
        .unwrap_or_else(|| "/".into());

    match std::fs::metadata(&cwd) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            let err = io::Error::from_raw_os_error(libc::ENOTDIR);
            return fail(outbox, id, &err, format!("working directory {cwd:?}"));
        }
        Err(err) => return fail(outbox, id, &err, format!("working directory {cwd:?}")),
    }

    let mut cmd = Command::new(&program);
    cmd.args(exec.argv[1..].iter().map(|a| OsStr::from_bytes(a)))
        .env_clear()
        .current_dir(&cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if !exec.env.iter().any(|(k, _)| &k[..] == b"PATH") {
        cmd.env("PATH", DEFAULT_PATH);
    }
    for (key, value) in &exec.env {
        cmd.env(OsStr::from_bytes(key), OsStr::from_bytes(value));
    }
    let uid = exec.uid.unwrap_or(0);
    cmd.gid(exec.gid.unwrap_or(uid)).uid(uid);
    // SAFETY: setsid is async-signal-safe. A new session makes the child the leader of its own
    // process group, so a timeout or signal reaches everything it started.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }

    let mut child = match reaper.spawn(&mut cmd) {
        Ok(child) => child,
        Err(err) => return fail(outbox, id, &err, format!("spawn {program:?}")),
    };
    let pid = child.id() as i32;
    table
        .0
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id, pid);
    outbox.send(&GuestMessage::Started(Started {
        id,
        pid: pid as u32,
    }));

    let readers: Vec<_> = [
        child
            .stdout
            .take()
            .map(|s| (Stream::Stdout, Box::new(s) as Box<dyn Read + Send>)),
        child
            .stderr
            .take()
            .map(|s| (Stream::Stderr, Box::new(s) as Box<dyn Read + Send>)),
    ]
    .into_iter()
    .flatten()
    .map(|(stream, pipe)| {
        let outbox = outbox.clone();
        std::thread::spawn(move || pump(id, stream, pipe, &outbox))
    })
    .collect();

    let deadline = exec
        .timeout_ms
        .map(|ms| Instant::now() + Duration::from_millis(ms));
    let (reaper, table, outbox) = (reaper.clone(), table.clone(), outbox.clone());
    let supervise = move || {
        let mut timed_out = false;
        let status = match reaper.wait(pid, deadline) {
            Some(status) => status,
            None => {
                timed_out = true;
                // SAFETY: plain syscall; pid is the group leader we created with setsid.
                unsafe { libc::killpg(pid, libc::SIGKILL) };
                reaper
                    .wait(pid, None)
                    .unwrap_or(ExitStatus::Signal(libc::SIGKILL))
            }
        };
        // The streams end when every holder of the pipes exits. After a timeout the whole
        // group was killed; kill it again in case something raced into it meanwhile.
        if timed_out {
            // SAFETY: plain syscall.
            unsafe { libc::killpg(pid, libc::SIGKILL) };
        }
        for reader in readers {
            let _ = reader.join();
        }
        table
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        outbox.send(&GuestMessage::Exited(Exited {
            id,
            status,
            timed_out,
        }));
    };
    if let Err(err) = std::thread::Builder::new()
        .name(format!("proc-{id}"))
        .spawn(supervise)
    {
        eprintln!("guest-init: cannot start supervisor thread: {err}");
    }
}

/// Copies one pipe to the host in bounded chunks until EOF.
fn pump(id: u32, stream: Stream, mut pipe: Box<dyn Read + Send>, outbox: &Outbox) {
    let mut buf = vec![0u8; MAX_CHUNK];
    loop {
        match pipe.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                let msg = GuestMessage::Output(Output {
                    id,
                    stream,
                    data: ByteBuf::from(buf[..n].to_vec()),
                });
                if !outbox.send(&msg) {
                    return;
                }
            }
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}
