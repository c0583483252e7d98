//! The guest console, bounded.
//!
//! The guest controls what it prints on its console (any root process can write `/dev/console`
//! forever). libkrun writes it to a path; krunbox gives it a FIFO and drains that here into
//! `console.log` in the instance directory. When the log reaches half the definition's
//! `console_log_max` it becomes `console.log.1` (replacing the previous one) and a new log
//! starts, so at most `console_log_max` is ever on disk and the latest output is always kept. A slow drain only slows the
//! guest's console writes (the FIFO fills and the console device waits), never the host.

use std::io::Write;
use std::path::{Path, PathBuf};

use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};

/// The default bound on the console log's disk use: 8 MiB, two generations of 4 MiB.
pub const DEFAULT_CONSOLE_LOG_MAX: u64 = 8 << 20;

/// The values `console_log_max` may take.
pub(crate) const CONSOLE_LOG_MAX_RANGE: std::ops::RangeInclusive<u64> = (64 << 10)..=(1 << 30);

/// The FIFO's name in the instance directory.
pub(crate) const CONSOLE_FIFO: &str = "console.fifo";

/// Names of the console log files, older first.
pub(crate) const CONSOLE_LOGS: [&str; 2] = ["console.log.1", "console.log"];

/// A running drain of one VM's console FIFO. Dropping it stops the drain.
#[derive(Debug)]
pub(crate) struct ConsoleLog {
    #[cfg(test)]
    fifo: PathBuf,
    settle: mpsc::Sender<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ConsoleLog {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ConsoleLog {
    /// Creates the FIFO `console.fifo` in `dir` (replacing one from an earlier boot attempt)
    /// and starts draining it into a fresh `console.log`.
    pub(crate) fn start(dir: &Path, max_bytes: u64) -> Result<ConsoleLog> {
        let fifo = dir.join(CONSOLE_FIFO);
        for name in CONSOLE_LOGS.iter().chain([CONSOLE_FIFO].iter()) {
            let _ = std::fs::remove_file(dir.join(name));
        }
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
        let log = std::fs::File::create(dir.join("console.log"))
            .map_err(Error::io("creating the console log"))?;
        let (settle, requests) = mpsc::channel(4);
        let task = tokio::spawn(drain(
            receiver,
            log,
            dir.to_path_buf(),
            max_bytes / 2,
            requests,
        ));
        Ok(ConsoleLog {
            #[cfg(test)]
            fifo,
            settle,
            task,
        })
    }

    /// The FIFO the VMM helper writes the console to.
    #[cfg(test)]
    fn fifo(&self) -> &Path {
        &self.fifo
    }

    /// Waits (briefly) until everything already written to the FIFO is in the log files: call
    /// it after the VM stopped and before reading the log's tail.
    pub(crate) async fn settle(&self) {
        let (ack, done) = oneshot::channel();
        if self.settle.send(ack).await.is_ok() {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(1), done).await;
        }
    }
}

/// How many bytes the drain moves before it lets other tasks run: a guest that floods its
/// console must not hog a runtime thread (the liveness check runs on the same runtime).
const DRAIN_BUDGET: usize = 1 << 20;

async fn drain(
    receiver: pipe::Receiver,
    log: std::fs::File,
    dir: PathBuf,
    rotate_at: u64,
    mut requests: mpsc::Receiver<oneshot::Sender<()>>,
) {
    // `None` while a rotation failed: output is dropped rather than written past the bound,
    // and the next chunk tries to rotate again.
    let mut log = Some(log);
    let mut written = 0u64;
    let mut buf = vec![0u8; 64 * 1024];
    let mut budget = DRAIN_BUDGET;
    loop {
        let ack = tokio::select! {
            ready = receiver.readable() => { if ready.is_err() { return; } None }
            request = requests.recv() => match request { Some(ack) => Some(ack), None => return },
        };
        // Everything available now, without waiting for more.
        loop {
            match receiver.try_read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let mut rest = &buf[..n];
                    while !rest.is_empty() {
                        if log.is_none() || written >= rotate_at {
                            log = rotate(&dir);
                            written = 0;
                            if log.is_none() {
                                break;
                            }
                        }
                        let take = rest.len().min((rotate_at - written) as usize);
                        // A full disk loses console output, not the VM.
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
                Err(_) => return,
            }
        }
        if let Some(ack) = ack {
            let _ = ack.send(());
        }
    }
}

/// `console.log` → `console.log.1`, and a new `console.log`. `None` if either step failed
/// (then nothing is written until a later rotation succeeds).
fn rotate(dir: &Path) -> Option<std::fs::File> {
    let newer = dir.join(CONSOLE_LOGS[1]);
    if newer.exists() {
        std::fs::rename(&newer, dir.join(CONSOLE_LOGS[0])).ok()?;
    }
    std::fs::File::create(newer).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_log_rotates_and_never_holds_more_than_two_generations() {
        let dir = tempfile::tempdir().unwrap();
        const MAX: u64 = 256 << 10;
        let console = ConsoleLog::start(dir.path(), MAX).unwrap();
        let mut writer = std::fs::OpenOptions::new()
            .write(true)
            .open(console.fifo())
            .unwrap();
        // Three generations' worth of numbered lines, written by another thread (the FIFO
        // fills while the drain is not polled).
        let lines = (3 * MAX / 2 / 16) as usize;
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
}
