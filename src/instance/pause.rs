//! Pausing a running instance and resuming it: the VM's vCPUs and devices stop where they are
//! and use no CPU until resumed.
//!
//! The VMM process is stopped with `SIGSTOP` (through its pidfd; it is pid 1 of its own pid
//! namespace, where `SIGSTOP` from an ancestor namespace still applies) and continued with
//! `SIGCONT`; `/proc/PID/task/*/stat` says when every thread has stopped. A vCPU's `KVM_RUN`
//! returns `EINTR`, which libkrun's vCPU loop treats as a pause in its run, and the guest finds
//! itself where it was. (Not the cgroup freezer: KVM attaches a kernel worker of each VM to its
//! VMM's cgroup, and a kernel thread never freezes, so `cgroup.events` never said `frozen 1`
//! although every thread of the VMM slept: seen under the nested test host's kernel. A stop is
//! also plain to see: state `T`.)
//!
//! The guest's clocks, its monotonic clock too (kvmclock follows the host's), jump forward by
//! the pause: a command's own timeout, which guest-init enforces, counts the pause, and one
//! that passed meanwhile ends the command right after the resume (exit code 124).
//!
//! The host side stays up: the liveness check sends no pings and blames no silence while
//! paused; new commands and file operations fail at once with [`Error::Paused`] (nothing new
//! is sent to a guest that cannot answer); work already under way waits: processes stay
//! running (their output waits in the guest), a file operation's requests and a spawn waiting
//! for its process to start keep their deadlines in the guest's running time
//! (`crate::pause_clock`), so the pause does not use them up, and so does the host's backstop
//! of a command's timeout. Network connections stay open on the host; a remote peer may give
//! up in the meantime.

use std::time::{Duration, Instant};

use super::Instance;
use crate::error::{Error, Result};

/// How long the kernel may take to stop (or start) every thread of the VM.
const SETTLE_DEADLINE: Duration = Duration::from_secs(5);

/// How often a pause checks whether every thread has stopped.
const SETTLE_POLL: Duration = Duration::from_millis(5);

impl Instance {
    /// Pauses the VM: its vCPUs and devices stop and use no CPU until [`resume`](Self::resume).
    /// Returns once every thread of the VM has stopped. New commands and file operations fail
    /// with [`Error::Paused`] meanwhile; processes already running continue after the resume
    /// (see the module's documentation in docs/architecture.md, "Pause and resume"). Pausing a
    /// paused instance does nothing.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.pause().await?;
    /// assert!(vm.is_paused());
    /// // ... the VM uses no CPU here ...
    /// vm.resume().await?;
    /// vm.command("true").status().await?;
    /// # Ok(()) }
    /// ```
    pub async fn pause(&self) -> Result<()> {
        // One pause or resume at a time: a second waits for the first to settle.
        let _one_at_a_time = self.inner.pausing.lock().await;
        let control = self.control()?;
        if control.is_paused() {
            return Ok(());
        }
        // Refuse new work first: nothing is sent to a guest that is about to stop answering.
        control.set_paused(true);
        if let Err(e) = self.stop_vm(true).await {
            // Started again, whatever had stopped: the instance goes on as before.
            let _ = self.stop_vm(false).await;
            control.set_paused(false);
            return Err(e);
        }
        tracing::debug!("paused");
        Ok(())
    }

    /// Resumes a paused VM where it stopped. Resuming a running instance does nothing.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// if vm.is_paused() {
    ///     vm.resume().await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn resume(&self) -> Result<()> {
        let _one_at_a_time = self.inner.pausing.lock().await;
        let control = self.control()?;
        if !control.is_paused() {
            return Ok(());
        }
        self.stop_vm(false).await?;
        control.set_paused(false);
        tracing::debug!("resumed");
        Ok(())
    }

    /// Whether the instance is paused ([`pause`](Self::pause)).
    ///
    /// ```no_run
    /// # fn demo(vm: &krunbox::Instance) {
    /// println!("paused: {}", vm.is_paused());
    /// # }
    /// ```
    pub fn is_paused(&self) -> bool {
        self.inner.control.is_paused()
    }

    /// Stops (or starts again) every thread of the VM and waits until the kernel says they are.
    pub(super) async fn stop_vm(&self, stop: bool) -> Result<()> {
        let what = if stop { "pausing" } else { "resuming" };
        let io = |e: std::io::Error| Error::Io {
            context: format!("{what} the VM"),
            source: e,
        };
        let pid = self.vmm_pid().ok_or_else(|| Error::InstanceGone {
            reason: "the VM stopped".into(),
        })?;
        let signal = if stop { libc::SIGSTOP } else { libc::SIGCONT };
        self.inner.vmm_process.signal(signal).map_err(io)?;
        let done = || all_threads_stopped(pid).map(|stopped| stopped == stop);
        settle(what, done, || {
            format!("the VMM's threads: {}", thread_states(pid))
        })
        .await
    }
}

/// Waits until `done` says so, within [`SETTLE_DEADLINE`]; a timeout's error ends with what
/// `describe` says of the VM's threads.
async fn settle(
    what: &str,
    done: impl Fn() -> std::io::Result<bool>,
    describe: impl Fn() -> String,
) -> Result<()> {
    let start = Instant::now();
    loop {
        match done() {
            Ok(true) => return Ok(()),
            Ok(false) if start.elapsed() < SETTLE_DEADLINE => tokio::time::sleep(SETTLE_POLL).await,
            Ok(false) => {
                return Err(Error::Io {
                    context: format!("{what} the VM"),
                    source: std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "the kernel did not stop or start every thread of the VM within {SETTLE_DEADLINE:?} ({})",
                            describe()
                        ),
                    ),
                })
            }
            Err(e) => {
                return Err(Error::Io {
                    context: format!("{what} the VM"),
                    source: e,
                })
            }
        }
    }
}

/// Each thread's state letter, for an error's message.
fn thread_states(pid: u32) -> String {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return "unreadable".into();
    };
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("stat")).ok())
        .filter_map(|stat| {
            let (head, rest) = stat.rsplit_once(')')?;
            let name = head.split_once('(')?.1;
            Some(format!("{name}:{}", rest.split_whitespace().next()?))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Whether every thread of process `pid` is stopped (state `T` in `/proc/PID/task/*/stat`).
/// A thread that ended while it was looked at is not in the way.
fn all_threads_stopped(pid: u32) -> std::io::Result<bool> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let stat = match std::fs::read_to_string(task?.path().join("stat")) {
            Ok(stat) => stat,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => continue,
            Err(e) => return Err(e),
        };
        // The state follows the command name, which is in parentheses and may hold any byte.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        if state != Some("T") {
            return Ok(false);
        }
    }
    Ok(true)
}
