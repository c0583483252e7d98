//! The `krunbox-vmm` helper as the library runs it: started with its descriptors handed over
//! by role, watched until it exits, its log's tail read for errors. What runs inside it is
//! the `krunbox-vmm` crate (`vmm/`); what both sides agree on is `krunbox_protocol::vmm`.

use std::path::Path;
use std::process::Stdio;

use krunbox_protocol::vmm::Inherited;

use crate::error::{Error, Result};

/// Descriptors handed to the helper, each as (descriptor in this process, its role there).
pub(crate) type Handed = [(std::os::fd::RawFd, Inherited)];

/// Starts the helper with `args`. Each handed descriptor becomes its role's number in the
/// helper ([`Inherited::fd`]; for a VM: the root image, the lifeline, guest-init, the report
/// pipe, and what the definition adds). `log` becomes its stdout and stderr: for a VM the
/// write end of a pipe the library drains into a bounded log.
pub(crate) fn spawn(
    helper: &Path,
    libkrunfw_dir: &Path,
    args: &[&std::ffi::OsStr],
    handed: &Handed,
    log: std::os::fd::OwnedFd,
    cgroup_procs: Option<&std::os::fd::OwnedFd>,
) -> Result<tokio::process::Child> {
    use std::os::fd::AsRawFd;
    let inherited = handed
        .iter()
        .map(|(fd, role)| role.fd().map(|number| (*fd, number)).ok_or(role))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|role| Error::VmmSpawn {
            path: helper.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{role:?} is past what the helper takes"),
            ),
        })?;
    let cgroup_procs = cgroup_procs.map_or(-1, |fd| fd.as_raw_fd());
    const MAX_INHERITED: usize = 32;
    /// Above every target number: sources are moved here first.
    const OUT_OF_THE_WAY: libc::c_int = 64;
    assert!(
        inherited.len() <= MAX_INHERITED,
        "too many inherited descriptors"
    );
    assert!(
        inherited
            .iter()
            .all(|(_, target)| (3..OUT_OF_THE_WAY).contains(target)),
        "an inherited descriptor's number is not below {OUT_OF_THE_WAY}"
    );
    let mut plan = [(-1, -1); MAX_INHERITED];
    plan[..inherited.len()].copy_from_slice(&inherited);
    let count = inherited.len();
    let log_err = log
        .try_clone()
        .map_err(Error::io("duplicating the VMM log descriptor"))?;
    let mut cmd = tokio::process::Command::new(helper);
    cmd.args(args)
        .env_clear()
        .env("LD_LIBRARY_PATH", libkrunfw_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log_err))
        .kill_on_drop(true);
    if let Some(level) = std::env::var_os("RUST_LOG") {
        cmd.env("RUST_LOG", level);
    }
    // SAFETY: only async-signal-safe calls (fcntl, dup2) between fork and exec, on a copy of
    // the plan made before the fork (no allocation here).
    unsafe {
        cmd.pre_exec(move || {
            // Into the instance's cgroup before anything of the helper runs: `0` is this
            // process (the descriptor is CLOEXEC, and closed below anyway).
            if cgroup_procs >= 0 && libc::write(cgroup_procs, b"0".as_ptr().cast(), 1) != 1 {
                return Err(std::io::Error::last_os_error());
            }
            let mut plan = plan;
            // Move the sources out of the way first, so no dup2 clobbers another.
            for (source, _) in plan.iter_mut().take(count) {
                *source = libc::fcntl(*source, libc::F_DUPFD_CLOEXEC, OUT_OF_THE_WAY);
                if *source < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // Nothing else of this process goes along: a descriptor the caller (or its own
            // parent) left without CLOEXEC would pass every layer of the jail, as Landlock and
            // the empty root govern only what is opened later. First everything below the
            // moved sources (the targets' numbers and the gaps between them), then, once the
            // targets are in place, everything above them (the moved sources too).
            close_from_to(3, OUT_OF_THE_WAY as libc::c_uint - 1);
            let mut highest = 2;
            for (source, target) in plan.iter().take(count) {
                if libc::dup2(*source, *target) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                highest = highest.max(*target);
            }
            close_from_to((highest + 1) as libc::c_uint, libc::c_uint::MAX);
            Ok(())
        });
    }
    cmd.spawn().map_err(|source| Error::VmmSpawn {
        path: helper.to_path_buf(),
        source,
    })
}

/// Closes descriptors `first..=last`, between fork and exec (async-signal-safe: plain system
/// calls, no allocation). Kernels before 5.9 lack close_range: then one by one, up to the
/// descriptor limit.
fn close_from_to(first: libc::c_uint, last: libc::c_uint) {
    // SAFETY: close_range and close on numbers only; nothing in the child uses them after.
    unsafe {
        if libc::syscall(libc::SYS_close_range, first, last, 0 as libc::c_uint) != 0 {
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
            let end = (limit.rlim_cur.min(1 << 20) as libc::c_uint).min(last.saturating_add(1));
            for fd in first..end {
                libc::close(fd as libc::c_int);
            }
        }
    }
}

/// The last `lines` lines of the given log files, for error reports.
pub(crate) fn log_tail(paths: &[&Path], lines: usize) -> String {
    use std::io::{Read, Seek, SeekFrom};
    // The guest writes the console log: it can be huge. Only its end is read.
    const TAIL_BYTES: u64 = 64 * 1024;
    let mut out = String::new();
    for path in paths {
        let Ok(mut file) = std::fs::File::open(path) else {
            continue;
        };
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let mut bytes = Vec::new();
        if file
            .seek(SeekFrom::Start(len.saturating_sub(TAIL_BYTES)))
            .is_err()
            || file.take(TAIL_BYTES).read_to_end(&mut bytes).is_err()
        {
            continue;
        }
        let text = String::from_utf8_lossy(&bytes);
        let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let start = all.len().saturating_sub(lines);
        for line in &all[start..] {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The VMM process, watched through a pidfd from the moment its pid is known. With a pid
/// namespace it is not the helper the library started but that helper's child, which dies by
/// `PR_SET_PDEATHSIG` after the helper, asynchronously: waiting for it before letting go of
/// what it writes to (a persistent layer's lock, a store served in place) means no write of
/// its lands after the next holder took over.
pub(crate) struct VmmProcess(Option<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>>);

impl VmmProcess {
    /// Watches process `pid` (nothing to wait for where it cannot: a kernel without pidfds,
    /// before 5.3, or a process already gone).
    pub(crate) fn watch(pid: u32) -> VmmProcess {
        use std::os::fd::FromRawFd;
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            return VmmProcess(None);
        };
        // SAFETY: pidfd_open takes a pid and flags (none: the descriptor is close-on-exec
        // anyway) and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return VmmProcess(None);
        }
        // SAFETY: a descriptor pidfd_open just gave us, owned by nothing else.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
        // A pidfd is readable once its process has exited.
        // SAFETY: `fd` is an open descriptor the AsyncFd takes ownership of, so it stays open
        // and the same for the AsyncFd's whole life.
        let watched = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
        };
        VmmProcess(watched.ok())
    }

    /// Waits until the process has exited (a zombie counts: none of its threads runs), at most
    /// `deadline`; false if it is still running then.
    pub(crate) async fn exited_within(&self, deadline: std::time::Duration) -> bool {
        let Some(fd) = &self.0 else { return true };
        tokio::time::timeout(deadline, fd.readable()).await.is_ok()
    }

    /// Sends `signal` to the process through its pidfd, never to another process that reused
    /// its pid. Where it could not be watched (a kernel before 5.3) nothing is sent: the
    /// error says so.
    pub(crate) fn signal(&self, signal: libc::c_int) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let Some(fd) = &self.0 else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "the VMM process has no pidfd (Linux 5.3 or later has them)",
            ));
        };
        // SAFETY: pidfd_send_signal with a pidfd of ours, no siginfo and no flags.
        let sent = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd.as_raw_fd(),
                signal,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if sent < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Whether the process is known to have exited now (a zombie counts); false where it
    /// cannot be watched.
    pub(crate) fn has_exited(&self) -> bool {
        use std::os::fd::AsRawFd;
        let Some(fd) = &self.0 else { return false };
        let mut poll = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd of ours, a descriptor the AsyncFd keeps open; no waiting.
        let ready = unsafe { libc::poll(&mut poll, 1, 0) };
        ready == 1 && poll.revents & libc::POLLIN != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A watched process is seen running until it is killed, and exited right after, before
    /// anyone reaps it.
    #[tokio::test]
    async fn a_watched_process_is_waited_for_until_it_exits() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let watched = VmmProcess::watch(child.id());
        assert!(watched.0.is_some(), "pidfd_open");
        let short = std::time::Duration::from_millis(200);
        assert!(!watched.exited_within(short).await, "it still runs");
        assert!(!watched.has_exited());
        child.kill().unwrap();
        assert!(
            watched
                .exited_within(std::time::Duration::from_secs(10))
                .await
        );
        assert!(watched.has_exited(), "a zombie has exited");
        child.wait().unwrap();
        assert!(watched.has_exited(), "and a reaped process too");
    }
}
