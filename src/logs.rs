//! What the guest and the VMM helper print, each drained into a log of bounded size.
//!
//! The guest controls what it prints on its console (any root process can write `/dev/console`
//! forever). libkrun writes it to a path; krunbox gives it a FIFO and drains that here into
//! `console.log` in the instance directory. The helper's own output (libkrun's log lines, the
//! helper's messages) is a pipe drained the same way into `vmm.log`: a guest can provoke log
//! lines too (every device error is one), and a file the helper wrote itself would be bounded
//! only by its `RLIMIT_FSIZE`, which a writable root raises to the size of its disk.
//!
//! When a log reaches half its bound it becomes `NAME.1` (replacing the previous one) and a new
//! log starts, so at most the bound is ever on disk and the latest output is always kept. A slow
//! drain only slows the writer (the FIFO or pipe fills and its write waits), never the host.

use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::Instrument;

use crate::error::{Error, Result};

/// The default bound on the console log's disk use: 8 MiB, two generations of 4 MiB.
pub const DEFAULT_CONSOLE_LOG_MAX: u64 = 8 << 20;

/// The values `console_log_max` may take.
pub(crate) const CONSOLE_LOG_MAX_RANGE: std::ops::RangeInclusive<u64> = (64 << 10)..=(1 << 30);

/// The FIFO's name in the instance directory.
pub(crate) const CONSOLE_FIFO: &str = "console.fifo";

/// Names of the console log files, older first.
pub(crate) const CONSOLE_LOGS: [&str; 2] = ["console.log.1", "console.log"];

/// Names of the VMM helper's log files, older first.
pub(crate) const VMM_LOGS: [&str; 2] = ["vmm.log.1", "vmm.log"];

/// The bound on the VMM helper's log: 16 MiB, two generations of 8 MiB (what the helper's
/// `RLIMIT_FSIZE` allowed its log file before the log became a pipe).
pub(crate) const VMM_LOG_MAX: u64 = 16 << 20;

/// A running drain of one log. Dropping it stops a FIFO's drain (which has no end); a pipe's
/// runs on to the pipe's end, so that [`BoundedLog::ended`] still tells when its writers exited.
#[derive(Debug)]
pub(crate) struct BoundedLog {
    #[cfg(test)]
    fifo: PathBuf,
    settle: mpsc::Sender<oneshot::Sender<()>>,
    ended: watch::Receiver<bool>,
    /// A FIFO opened read-write never ends: its drain stops when this is dropped.
    stop_on_drop: bool,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for BoundedLog {
    fn drop(&mut self) {
        if self.stop_on_drop {
            self.task.abort();
        }
    }
}

impl BoundedLog {
    /// The guest console: creates the FIFO `console.fifo` in `dir` (replacing one from an
    /// earlier boot attempt) and starts draining it into a fresh `console.log`.
    pub(crate) fn console(dir: &Path, max_bytes: u64) -> Result<BoundedLog> {
        let fifo = dir.join(CONSOLE_FIFO);
        let _ = std::fs::remove_file(&fifo);
        nix::unistd::mkfifo(
            &fifo,
            nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
        )
        .map_err(|e| Error::io("creating the console FIFO")(e.into()))?;
        // Opened read-write: the drain never sees EOF between writers, and opening never waits.
        let receiver = pipe::OpenOptions::new()
            .read_write(true)
            .open_receiver(&fifo)
            .map_err(Error::io("opening the console FIFO"))?;
        let mut log = Self::start(receiver, dir, CONSOLE_LOGS, max_bytes, "console")?;
        log.stop_on_drop = true;
        #[cfg(test)]
        {
            log.fifo = fifo;
        }
        Ok(log)
    }

    /// The VMM helper's output: a pipe whose write end (returned) becomes the helper's stdout
    /// and stderr, drained into a fresh `vmm.log` in `dir` (replacing one from an earlier boot
    /// attempt). The drain reads to the end: until every holder of the write end (the helper,
    /// and the VMM process it starts in a pid namespace) has exited.
    pub(crate) fn vmm(dir: &Path, max_bytes: u64) -> Result<(BoundedLog, OwnedFd)> {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| Error::io("creating the VMM log pipe")(e.into()))?;
        let receiver =
            pipe::Receiver::from_owned_fd(read).map_err(Error::io("reading the VMM log pipe"))?;
        let log = Self::start(receiver, dir, VMM_LOGS, max_bytes, "VMM")?;
        Ok((log, write))
    }

    fn start(
        receiver: pipe::Receiver,
        dir: &Path,
        names: [&'static str; 2],
        max_bytes: u64,
        what: &str,
    ) -> Result<BoundedLog> {
        for name in names {
            let _ = std::fs::remove_file(dir.join(name));
        }
        let log = std::fs::File::create(dir.join(names[1]))
            .map_err(Error::io(format!("creating the {what} log")))?;
        let (settle, requests) = mpsc::channel(4);
        let (ended_tx, ended) = watch::channel(false);
        let task = tokio::spawn(
            drain(
                receiver,
                log,
                Generations {
                    dir: dir.to_path_buf(),
                    names,
                },
                max_bytes / 2,
                requests,
                ended_tx,
            )
            .in_current_span(),
        );
        Ok(BoundedLog {
            #[cfg(test)]
            fifo: PathBuf::new(),
            settle,
            ended,
            stop_on_drop: false,
            task,
        })
    }

    /// Becomes true when the pipe ended: every process that held its write end has exited (or
    /// closed it). For the helper's log that is the helper and the VMM both, whatever their
    /// pids. A FIFO's never does.
    pub(crate) fn ended(&self) -> watch::Receiver<bool> {
        self.ended.clone()
    }

    /// The FIFO the VMM helper writes the console to.
    #[cfg(test)]
    fn fifo(&self) -> &Path {
        &self.fifo
    }

    /// Waits (briefly) until everything already written to the FIFO or pipe is in the log
    /// files: call it after the VM stopped and before reading the log's tail.
    pub(crate) async fn settle(&self) {
        let (ack, done) = oneshot::channel();
        if self.settle.send(ack).await.is_ok() {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(1), done).await;
        }
    }
}

/// One instance's two logs, settled together before an error report reads their tails.
#[derive(Debug)]
pub(crate) struct InstanceLogs {
    pub(crate) console: BoundedLog,
    pub(crate) vmm: BoundedLog,
}

impl InstanceLogs {
    /// Waits (briefly) until what the guest and the helper already wrote is in the files.
    pub(crate) async fn settle(&self) {
        tokio::join!(self.console.settle(), self.vmm.settle());
    }

    /// After the helper exited: waits until the helper's log has ended (the VMM, dying by
    /// `PDEATHSIG`, may write a moment longer), so every line of theirs is in the file, at most
    /// [`LOG_END_WAIT`]; then settles what is there. The tail an error report reads, and the
    /// `KVM_EXIT_SHUTDOWN` the test harness looks for in it, must not depend on how soon the
    /// drain got its turn.
    pub(crate) async fn settle_after_exit(&self) {
        let mut ended = self.vmm.ended();
        let vmm = async {
            let _ = tokio::time::timeout(LOG_END_WAIT, ended.wait_for(|ended| *ended)).await;
            self.vmm.settle().await;
        };
        tokio::join!(self.console.settle(), vmm);
    }
}

/// How long [`InstanceLogs::settle_after_exit`] waits for the helper's log to end.
const LOG_END_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The last `lines` lines of the console's and the helper's logs in `dir`, for error reports.
pub(crate) fn tail(dir: &Path, lines: usize) -> String {
    let paths: Vec<PathBuf> = CONSOLE_LOGS
        .iter()
        .chain(VMM_LOGS.iter())
        .map(|name| dir.join(name))
        .collect();
    let paths: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
    crate::helper::log_tail(&paths, lines)
}

/// How many bytes the drain moves before it lets other tasks run: a guest that floods its
/// console must not hog a runtime thread (the liveness check runs on the same runtime).
const DRAIN_BUDGET: usize = 1 << 20;

/// Where a log's two generations live.
struct Generations {
    dir: PathBuf,
    /// Older first.
    names: [&'static str; 2],
}

impl Generations {
    /// The newer → the older, and a new newer. `None` if either step failed (then nothing is
    /// written until a later rotation succeeds).
    fn rotate(&self) -> Option<std::fs::File> {
        let newer = self.dir.join(self.names[1]);
        if newer.exists() {
            std::fs::rename(&newer, self.dir.join(self.names[0])).ok()?;
        }
        std::fs::File::create(newer).ok()
    }
}

async fn drain(
    receiver: pipe::Receiver,
    log: std::fs::File,
    generations: Generations,
    rotate_at: u64,
    mut requests: mpsc::Receiver<oneshot::Sender<()>>,
    ended_tx: watch::Sender<bool>,
) {
    // `None` while a rotation failed: output is dropped rather than written past the bound,
    // and the next chunk tries to rotate again.
    let mut log = Some(log);
    let mut written = 0u64;
    let mut buf = vec![0u8; 64 * 1024];
    let mut budget = DRAIN_BUDGET;
    // A pipe whose writers all exited reads as its end; a FIFO opened read-write never does.
    // Past the end only settle requests are answered (at once: nothing more can come), until
    // the log's owner is gone.
    let mut ended = false;
    // The owner (and so the instance directory, or a later boot attempt's log in it) may be
    // gone: read on to the end only to tell `ended`, writing and rotating nothing.
    let mut orphaned = false;
    loop {
        // Requests first: a settle drains what is there before its answer anyway, and a log
        // dropped is seen before more bytes are written for it.
        let ack = tokio::select! {
            biased;
            request = requests.recv() => match request {
                Some(ack) => Some(ack),
                None if ended => return,
                // Dropped while the pipe still has writers: read on to its end.
                None => {
                    orphaned = true;
                    log = None;
                    if receiver.readable().await.is_err() {
                        ended = true;
                    }
                    None
                }
            },
            ready = receiver.readable(), if !ended => {
                if ready.is_err() {
                    ended = true;
                }
                None
            }
        };
        // Everything available now, without waiting for more.
        while !ended {
            let read = match receiver.try_read(&mut buf) {
                // tokio answers WouldBlock until its reactor has seen the pipe readable; a
                // settle must not miss bytes already written, so it asks the pipe itself.
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && ack.is_some() => {
                    read_now(&receiver, &mut buf)
                }
                other => other,
            };
            match read {
                Ok(0) => ended = true,
                Ok(n) => {
                    // Orphaned: nothing to write to.
                    let mut rest = if orphaned { &[][..] } else { &buf[..n] };
                    while !rest.is_empty() {
                        if log.is_none() || written >= rotate_at {
                            log = generations.rotate();
                            written = 0;
                            if log.is_none() {
                                break;
                            }
                        }
                        let take = rest.len().min((rotate_at - written) as usize);
                        // A full disk loses log output, not the VM.
                        if let Some(file) = log.as_mut() {
                            let _ = file.write_all(&rest[..take]);
                        }
                        written += take as u64;
                        rest = &rest[take..];
                    }
                    budget = budget.saturating_sub(n);
                    if budget == 0 {
                        budget = DRAIN_BUDGET;
                        tokio::task::yield_now().await;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => ended = true,
            }
        }
        if ended {
            ended_tx.send_replace(true);
        }
        if let Some(ack) = ack {
            let _ = ack.send(());
        }
    }
}

/// One `read(2)` of the non-blocking pipe, whatever tokio knows of its readiness.
fn read_now(receiver: &pipe::Receiver, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    // SAFETY: a read into our own buffer, of at most its length, from a descriptor the
    // receiver keeps open.
    let n = unsafe { libc::read(receiver.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes `lines` numbered 16-byte lines from another thread (the FIFO or pipe fills while
    /// the drain is not polled), then drops `writer`.
    async fn write_numbered_lines(mut writer: std::fs::File, lines: usize) {
        let writer_thread = std::thread::spawn(move || {
            for i in 0..lines {
                writer
                    .write_all(format!("line {i:010}\n").as_bytes())
                    .unwrap();
            }
        });
        while !writer_thread.is_finished() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        writer_thread.join().unwrap();
    }

    #[tokio::test]
    async fn the_log_rotates_and_never_holds_more_than_two_generations() {
        let dir = tempfile::tempdir().unwrap();
        const MAX: u64 = 256 << 10;
        let console = BoundedLog::console(dir.path(), MAX).unwrap();
        let writer = std::fs::OpenOptions::new()
            .write(true)
            .open(console.fifo())
            .unwrap();
        // Three generations' worth of numbered lines, written by another thread (the FIFO
        // fills while the drain is not polled).
        let lines = (3 * MAX / 2 / 16) as usize;
        write_numbered_lines(writer, lines).await;
        console.settle().await;
        let old = std::fs::metadata(dir.path().join("console.log.1"))
            .unwrap()
            .len();
        let new = std::fs::read_to_string(dir.path().join("console.log")).unwrap();
        assert!(old <= MAX / 2 && old > 0, "{old}");
        assert!(new.len() as u64 <= MAX / 2);
        // The latest output is kept.
        assert!(
            new.ends_with(&format!("line {:010}\n", lines - 1)),
            "{}",
            &new[new.len().saturating_sub(40)..]
        );
    }

    #[tokio::test]
    async fn the_helpers_pipe_is_drained_to_its_end_into_two_bounded_generations() {
        let dir = tempfile::tempdir().unwrap();
        const MAX: u64 = 128 << 10;
        let (log, write_end) = BoundedLog::vmm(dir.path(), MAX).unwrap();
        let writer = std::fs::File::from(write_end);
        // Two and a half generations' worth, then the writer exits: the pipe's end.
        let lines = (5 * MAX / 4 / 16) as usize;
        write_numbered_lines(writer, lines).await;
        log.settle().await;
        let old = std::fs::metadata(dir.path().join(VMM_LOGS[0]))
            .unwrap()
            .len();
        let new = std::fs::read_to_string(dir.path().join(VMM_LOGS[1])).unwrap();
        assert!(old == MAX / 2, "{old}");
        assert!(new.len() as u64 <= MAX / 2 && !new.is_empty());
        assert!(new.ends_with(&format!("line {:010}\n", lines - 1)));
        // Past the end the drain still answers, and the tail reads the helper's last line.
        log.settle().await;
        assert!(tail(dir.path(), 1).contains(&format!("line {:010}", lines - 1)));
    }

    /// A boot that fails drops its logs while the VMM may still run: the drain reads on, writes
    /// nothing more (the directory may be gone, or hold a later attempt's log), and still says
    /// when the pipe ended.
    #[tokio::test]
    async fn a_dropped_pipe_log_still_tells_its_end_and_writes_nothing_more() {
        let dir = tempfile::tempdir().unwrap();
        let (log, write_end) = BoundedLog::vmm(dir.path(), 1 << 20).unwrap();
        let mut writer = std::fs::File::from(write_end);
        writer.write_all(b"before\n").unwrap();
        log.settle().await;
        let mut ended = log.ended();
        drop(log);
        writer.write_all(b"after\n").unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(!*ended.borrow(), "ended while a writer still held the pipe");
        drop(writer);
        tokio::time::timeout(std::time::Duration::from_secs(10), ended.wait_for(|e| *e))
            .await
            .expect("the end of the pipe was never told")
            .unwrap();
        let text = std::fs::read_to_string(dir.path().join(VMM_LOGS[1])).unwrap();
        assert_eq!(text, "before\n");
    }
}
