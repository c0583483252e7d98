//! Running commands: spawn, stream output, enforce timeouts, reap, report.
//!
//! Threads, not an async runtime: guest-init is PID 1 of a small VM and should stay a small,
//! obvious static binary. Each process gets one supervising thread plus one reader per output
//! stream; a single reaper thread collects every exit status.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use krunbox_protocol::{
    limits::MAX_CHUNK, Credit, Exec, ExecErrorKind, ExecFailed, ExitStatus, Exited, GuestMessage,
    Output, PtySize, Started, Stream, OUTPUT_WINDOW,
};
use serde_bytes::ByteBuf;

use crate::outbox::Outbox;
use crate::sys::check;

/// Used when the command's environment has no `PATH` of its own.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

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

/// How many output bytes a stream may still send before the host grants more.
struct Window {
    state: Mutex<WindowState>,
    changed: Condvar,
}

struct WindowState {
    available: u64,
    /// The stream was given up (see [`Streams::abandon`]): its reader stops.
    abandoned: bool,
}

impl Window {
    fn new() -> Arc<Window> {
        Arc::new(Window {
            state: Mutex::new(WindowState {
                available: u64::from(OUTPUT_WINDOW),
                abandoned: false,
            }),
            changed: Condvar::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WindowState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks until some credit is available; returns how much, or `None` once the stream is
    /// abandoned.
    fn wait(&self) -> Option<u64> {
        let mut state = self.lock();
        while state.available == 0 && !state.abandoned {
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        (!state.abandoned).then_some(state.available)
    }

    fn spend(&self, bytes: u64) {
        let mut state = self.lock();
        state.available = state.available.saturating_sub(bytes);
    }

    fn grant(&self, bytes: u64) {
        let mut state = self.lock();
        state.available = state.available.saturating_add(bytes);
        self.changed.notify_all();
    }

    fn abandon(&self) {
        self.lock().abandoned = true;
        self.changed.notify_all();
    }
}

/// How long a timed-out command's output streams may take to end after its process group was
/// killed. What the killed processes wrote is still sent (as the host reads it); a stream a
/// live process still writes to can only be held by one that left the group (its own
/// `setsid`), and is given up, as is output the host has not made room for by then.
const STREAM_GRACE: Duration = Duration::from_secs(2);

/// The output streams of one process: their reader threads, and a way to make them stop.
struct Streams {
    windows: [Arc<Window>; 2],
    /// The read ends, shared with the readers, to see whether any writer is still alive.
    sources: Vec<Arc<File>>,
    /// An eventfd each reader polls beside its pipe; written once to make every reader stop.
    stop: Arc<OwnedFd>,
    /// Each reader sends once here when it ends.
    done: std::sync::mpsc::Receiver<()>,
    running: usize,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Streams {
    /// Waits until every reader has ended, or until `deadline`; true if they all ended.
    fn wait(&mut self, deadline: Option<Instant>) -> bool {
        while self.running > 0 {
            let received = match deadline {
                None => self.done.recv().is_ok(),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match self.done.recv_timeout(left) {
                        Ok(()) => true,
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => return false,
                        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => false,
                    }
                }
            };
            if !received {
                // Every reader has gone (a panicked one never sent): nothing left to wait for.
                self.running = 0;
            } else {
                self.running -= 1;
            }
        }
        true
    }

    /// Like [`Streams::wait`], but at `deadline` only a stream that a live process still holds
    /// open counts as late (false). Streams whose writers are all gone only wait for the host
    /// to read them, which is not the command's doing: those are waited for.
    fn wait_for_writers(&mut self, deadline: Option<Instant>) -> bool {
        if self.wait(deadline) {
            return true;
        }
        if self.sources.iter().any(|source| has_writer(source)) {
            return false;
        }
        self.wait(None)
    }

    /// Makes every reader stop now, whatever is still unread.
    fn abandon(&self) {
        for window in &self.windows {
            window.abandon();
        }
        let one = 1u64;
        // SAFETY: an 8-byte write from a valid u64 to our eventfd.
        unsafe {
            libc::write(
                self.stop.as_raw_fd(),
                &one as *const u64 as *const libc::c_void,
                8,
            )
        };
    }

    fn join(self) {
        for thread in self.threads {
            let _ = thread.join();
        }
    }
}

/// What the control loop needs to reach a live process.
struct Entry {
    pgid: i32,
    /// Feeds the stdin writer thread; `None` once closed (or never opened).
    stdin: Option<Sender<Vec<u8>>>,
    /// Output credit per stream (indexed by `Stream as usize`).
    windows: [Arc<Window>; 2],
    /// The pty master, for resizing.
    pty: Option<Arc<OwnedFd>>,
}

/// Live processes by host id.
#[derive(Default, Clone)]
pub struct Table(Arc<Mutex<HashMap<u32, Entry>>>);

impl Table {
    fn with<R>(&self, id: u32, f: impl FnOnce(&mut Entry) -> R) -> Option<R> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&id)
            .map(f)
    }

    /// Whether a live process other than host id `id` leads process group `pgid`.
    fn has_group(&self, pgid: i32, id: u32) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|(&other, entry)| other != id && entry.pgid == pgid)
    }

    /// Signals the process group of host id `id`. Unknown ids (already exited) are ignored.
    pub fn signal(&self, id: u32, signal: i32) {
        if !(1..=64).contains(&signal) {
            eprintln!("guest-init: refusing out-of-range signal {signal}");
            return;
        }
        if let Some(pgid) = self.with(id, |e| e.pgid) {
            // SAFETY: plain syscall.
            unsafe { libc::killpg(pgid, signal) };
        }
    }

    /// Queues input for the process (never blocks the control loop: the host sends no more
    /// than the stdin window allows).
    pub fn stdin(&self, id: u32, data: Vec<u8>) {
        self.with(id, |e| {
            if let Some(tx) = &e.stdin {
                let _ = tx.send(data);
            }
        });
    }

    /// Closes the process's stdin once queued input is written.
    pub fn close_stdin(&self, id: u32) {
        self.with(id, |e| e.stdin = None);
    }

    /// The host consumed output: let that stream send more.
    pub fn credit(&self, id: u32, stream: Stream, bytes: u32) {
        if let Some(window) = self.with(id, |e| e.windows[stream as usize].clone()) {
            window.grant(u64::from(bytes));
        }
    }

    /// Resizes the process's pty (the kernel sends SIGWINCH to its foreground group).
    pub fn resize(&self, id: u32, size: PtySize) {
        if let Some(Some(master)) = self.with(id, |e| e.pty.clone()) {
            set_winsize(master.as_raw_fd(), size);
        }
    }
}

fn winsize(size: PtySize) -> libc::winsize {
    libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

fn set_winsize(fd: libc::c_int, size: PtySize) {
    let ws = winsize(size);
    // SAFETY: TIOCSWINSZ reads a valid winsize.
    unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) };
}

/// A new pseudo-terminal pair (master, slave) of the given size.
fn open_pty(size: PtySize) -> io::Result<(OwnedFd, OwnedFd)> {
    let (mut master, mut slave) = (-1, -1);
    let ws = winsize(size);
    // SAFETY: openpty writes two fds; name and termios are optional (NULL).
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &ws,
        )
    };
    check("openpty", rc)?;
    // SAFETY: both fds were just returned by openpty and are owned by nobody else.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    for fd in [&master, &slave] {
        // SAFETY: setting FD_CLOEXEC on fds we own.
        unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    Ok((master, slave))
}

fn exec_error_kind(err: &io::Error) -> ExecErrorKind {
    match err.kind() {
        io::ErrorKind::NotFound => ExecErrorKind::NotFound,
        io::ErrorKind::PermissionDenied => ExecErrorKind::PermissionDenied,
        _ => ExecErrorKind::Other,
    }
}

fn fail(outbox: &Outbox, id: u32, err: &io::Error, what: String) {
    let message =
        crate::files::truncate_text(format!("{what}: {err}"), krunbox_protocol::limits::MAX_TEXT);
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
    // A timeout too far away to represent is no timeout.
    let deadline = exec
        .timeout_ms
        .and_then(|ms| Instant::now().checked_add(Duration::from_millis(ms)));
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
        .current_dir(&cwd);
    let mut pty_master = None;
    if let Some(size) = exec.pty {
        let (master, slave) = match open_pty(size) {
            Ok(pair) => pair,
            Err(err) => return fail(outbox, id, &err, "allocating a pty".into()),
        };
        let dup = |fd: &OwnedFd| fd.try_clone().map(Stdio::from);
        match (dup(&slave), dup(&slave), dup(&slave)) {
            (Ok(i), Ok(o), Ok(e)) => {
                cmd.stdin(i).stdout(o).stderr(e);
            }
            (Err(err), _, _) | (_, Err(err), _) | (_, _, Err(err)) => {
                return fail(outbox, id, &err, "duplicating the pty".into())
            }
        }
        pty_master = Some(Arc::new(master));
    } else {
        cmd.stdin(if exec.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    }
    let is_pty = pty_master.is_some();
    if !exec.env.iter().any(|(k, _)| &k[..] == b"PATH") {
        cmd.env("PATH", DEFAULT_PATH);
    }
    for (name, value) in crate::net::environment() {
        if !exec.env.iter().any(|(k, _)| &k[..] == name.as_bytes()) {
            cmd.env(name, value);
        }
    }
    for (key, value) in &exec.env {
        cmd.env(OsStr::from_bytes(key), OsStr::from_bytes(value));
    }
    let uid = exec.uid.unwrap_or(0);
    cmd.gid(exec.gid.unwrap_or(uid)).uid(uid);
    // SAFETY: setsid and ioctl are async-signal-safe. A new session makes the child the leader
    // of its own process group, so a timeout or signal reaches everything it started; on a pty
    // the terminal (its stdin) becomes the session's controlling terminal, so Ctrl-C and
    // SIGWINCH reach the foreground group.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            if is_pty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }

    // SAFETY: eventfd with no pointers; the fd is owned below.
    let stop = match check("eventfd", unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) }) {
        // SAFETY: a new fd owned by nobody else.
        Ok(fd) => Arc::new(unsafe { OwnedFd::from_raw_fd(fd) }),
        Err(err) => return fail(outbox, id, &err, "creating the output stop signal".into()),
    };
    let mut child = match reaper.spawn(&mut cmd) {
        Ok(child) => child,
        Err(err) => return fail(outbox, id, &err, format!("spawn {program:?}")),
    };
    // The parent's copies of the pty slave must go now, or the master never sees EOF.
    drop(cmd);
    let pid = child.id() as i32;
    let windows = [Window::new(), Window::new()];

    // Input: a pipe, or the pty master; written by its own thread, credited back to the host.
    let stdin_sink: Option<Box<dyn Write + Send>> = match (&pty_master, child.stdin.take()) {
        (Some(master), _) => master
            .try_clone()
            .ok()
            .map(|fd| Box::new(File::from(fd)) as Box<dyn Write + Send>),
        (None, Some(pipe)) => Some(Box::new(pipe)),
        (None, None) => None,
    };
    let stdin_tx = stdin_sink.map(|sink| {
        let (tx, rx) = channel::<Vec<u8>>();
        let outbox = outbox.clone();
        std::thread::spawn(move || feed_stdin(id, sink, rx, &outbox));
        tx
    });

    table.0.lock().unwrap_or_else(|p| p.into_inner()).insert(
        id,
        Entry {
            pgid: pid,
            stdin: stdin_tx,
            windows: windows.clone(),
            pty: pty_master.clone(),
        },
    );
    outbox.send(&GuestMessage::Started(Started {
        id,
        pid: pid as u32,
    }));

    // Bigger pipes mean bigger reads, and fewer, bigger messages to the host.
    for pipe in [
        child.stdout.as_ref().map(|p| p.as_raw_fd()),
        child.stderr.as_ref().map(|p| p.as_raw_fd()),
    ]
    .into_iter()
    .flatten()
    {
        // SAFETY: F_SETPIPE_SZ on a pipe fd we own; failure just keeps the default size.
        unsafe { libc::fcntl(pipe, libc::F_SETPIPE_SZ, MAX_CHUNK as libc::c_int) };
    }
    let sources: Vec<(Stream, OwnedFd)> = match &pty_master {
        Some(master) => master
            .try_clone()
            .ok()
            .map(|fd| (Stream::Stdout, fd))
            .into_iter()
            .collect(),
        None => [
            child
                .stdout
                .take()
                .map(|s| (Stream::Stdout, OwnedFd::from(s))),
            child
                .stderr
                .take()
                .map(|s| (Stream::Stderr, OwnedFd::from(s))),
        ]
        .into_iter()
        .flatten()
        .collect(),
    };
    let (done_tx, done) = channel();
    let mut streams = Streams {
        windows: windows.clone(),
        sources: Vec::new(),
        stop: stop.clone(),
        done,
        running: sources.len(),
        threads: Vec::new(),
    };
    for (stream, source) in sources {
        let source = Arc::new(File::from(source));
        streams.sources.push(source.clone());
        let outbox = outbox.clone();
        let window = windows[stream as usize].clone();
        let (stop, done_tx) = (stop.clone(), done_tx.clone());
        streams.threads.push(std::thread::spawn(move || {
            pump(id, stream, &source, &stop, &window, &outbox);
            let _ = done_tx.send(());
        }));
    }
    drop(done_tx);

    let (reaper, table, outbox) = (reaper.clone(), table.clone(), outbox.clone());
    let supervise = move || {
        // The deadline covers the whole command: its first process, and its output streams,
        // which stay open as long as anything it started holds them.
        let mut status = reaper.wait(pid, deadline);
        let leader_alive = status.is_none();
        let timed_out = leader_alive || !streams.wait_for_writers(deadline);
        if timed_out {
            // pid is the group we created with setsid. Its number stays reserved while any
            // member lives; once the leader is reaped and the group may be empty, another
            // command's leader could have been given it (after the pid counter wrapped), and
            // its group is not ours to kill.
            let ours = leader_alive || !table.has_group(pid, id);
            if ours {
                // SAFETY: plain syscall.
                unsafe { libc::killpg(pid, libc::SIGKILL) };
            }
            if status.is_none() {
                status = reaper.wait(pid, None);
            }
            if ours {
                // Again, in case a fork raced the first kill into the group.
                // SAFETY: plain syscall.
                unsafe { libc::killpg(pid, libc::SIGKILL) };
            }
            if !streams.wait(Some(Instant::now() + STREAM_GRACE)) {
                streams.abandon();
                streams.wait(None);
            }
        }
        streams.join();
        let status = status.unwrap_or(ExitStatus::Signal(libc::SIGKILL));
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

/// Copies one pipe (or pty master) to the host in bounded chunks until EOF, never sending
/// more than the host has credited: when the host reads slowly, this thread stops reading, the
/// pipe fills, and the process's writes block. Once `stop` is signalled it still sends what
/// processes that have ended left in the pipe, but no more from one that lives on; it ends
/// at once when its window is abandoned.
fn pump(id: u32, stream: Stream, source: &File, stop: &OwnedFd, window: &Window, outbox: &Outbox) {
    // `Read` is implemented for `&File`: the file is shared with the supervisor's checks.
    let mut reader = source;
    let mut buf = vec![0u8; MAX_CHUNK];
    while let Some(allowed) = window.wait() {
        if !readable_before_stop(source, stop) {
            return;
        }
        let allowed = allowed.min(MAX_CHUNK as u64) as usize;
        match reader.read(&mut buf[..allowed]) {
            // EIO: a pty master whose slave side is closed — its end of file.
            Ok(0) => return,
            Err(err) if err.raw_os_error() == Some(libc::EIO) => return,
            Ok(n) => {
                window.spend(n as u64);
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

/// Waits until `source` can be read (data, end of file or an error to report). False once
/// `stop` is signalled while a live process still holds the stream open: from then on only
/// what ended processes left behind is read.
fn readable_before_stop(source: &File, stop: &OwnedFd) -> bool {
    let mut fds = [
        libc::pollfd {
            fd: source.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: stop.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: poll on two valid pollfd entries we own.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // Let the read report whatever is wrong.
            return true;
        }
        if fds[1].revents != 0 {
            return fds[0].revents & (libc::POLLHUP | libc::POLLERR) != 0;
        }
        if fds[0].revents != 0 {
            return true;
        }
    }
}

/// Whether some process still holds the write side of an output stream (a pipe, or a pty's
/// slave side) open: the read side does not report a hang-up yet.
fn has_writer(source: &File) -> bool {
    let mut fd = libc::pollfd {
        fd: source.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll on one valid pollfd, without blocking.
    let n = unsafe { libc::poll(&mut fd, 1, 0) };
    n >= 0 && fd.revents & (libc::POLLHUP | libc::POLLERR) == 0
}

/// Writes queued input to the process, crediting each chunk back to the host once written.
/// After the process stops reading (EPIPE), input is discarded but still credited, so the host
/// never waits forever.
fn feed_stdin(
    id: u32,
    mut sink: Box<dyn Write + Send>,
    rx: std::sync::mpsc::Receiver<Vec<u8>>,
    outbox: &Outbox,
) {
    let mut broken = false;
    for chunk in rx {
        if !broken && sink.write_all(&chunk).is_err() {
            broken = true;
        }
        let credit = GuestMessage::StdinCredit(Credit {
            id,
            stream: Stream::Stdout,
            bytes: chunk.len() as u32,
        });
        if !outbox.send(&credit) {
            return;
        }
    }
    // Channel closed (CloseStdin or the process ended): dropping the sink closes the pipe.
}
