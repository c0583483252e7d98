//! The helper's seccomp allowlist (built with seccompiler, the crate Firecracker's jailer uses).
//!
//! The list is what `krun_start_enter` and libkrun's device threads were seen to call under
//! `strace -f` across the VM test suite (boot, exec, pty, files, streams, shutdown; see
//! docs/security.md), plus a few close relatives a different code path or libc version may pick
//! (`pwrite64` beside `pread64`, `ppoll` beside `poll`, …). Arguments are narrowed where a call
//! could reach beyond the VM: `socket` only for unix sockets, `ioctl` only KVM's and a few
//! terminal/fd ones, `setsockopt` only buffer sizes, `fcntl` only descriptor and status flags and duplication (no `F_SETOWN`:
//! signals through `O_ASYNC`), `clone` only threads, `prctl` only thread names, `prlimit64`
//! only reads, `tgkill` only this process's threads. `fallocate` is left out: with
//! `FALLOC_FL_KEEP_SIZE` it would grow the helper's log past `RLIMIT_FSIZE` on some
//! filesystems. Only a helper with a writable root's layer gets it, and then only in the two
//! modes libkrun's disk code (imago) uses on a raw disk: `PUNCH_HOLE | KEEP_SIZE` (the guest
//! discards blocks: the layer's memory is given back) and `ZERO_RANGE` without `KEEP_SIZE`
//! (which the kernel checks against `RLIMIT_FSIZE`); neither can grow a file past its limit.
//! Such a helper may also `ftruncate` (a qcow2 layer grows its file; `RLIMIT_FSIZE` bounds it).
//!
//! Anything else fails with `EPERM` rather than killing the helper: a call libkrun makes on a
//! rare path then fails like any refused call instead of taking the VM down, and what matters
//! for the boundary — that the call does not happen — holds either way. Left out on purpose:
//! `execve`, `ptrace`, `process_vm_*`, `kill`, `mount`, `unshare`, `setns`, `bpf`,
//! `perf_event_open`, `open` by path outside `openat` (Landlock narrows `openat`), network
//! sockets, `userfaultfd`, `keyctl`, module and kexec calls.
//!
//! Benchmarks only: a helper that serves a host directory through libkrun's own virtio-fs
//! passthrough (`SandboxBuilder::virtiofs_passthrough_for_benchmarks`, the baseline of
//! `benches/fs.rs`) gets three more, [`PASSTHROUGH_EXTRA`], and only that helper: listing,
//! making and removing entries beneath the shared directory (Landlock still confines each to
//! it). Everything else the passthrough server calls is on the list already (`openat`,
//! `newfstatat`, `statx`, `preadv`/`pwritev`, `fsync`, `close`), or fails with `EPERM` as
//! operations the bench does not use.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

use krunbox_protocol::vmm::jail::{Isolation, Layer};

/// KVM's ioctl type byte (`_IO(KVMIO, …)`, KVMIO = 0xAE).
const KVM_IOCTL_TYPE: u64 = 0xAE00;

/// Non-KVM ioctls libkrun and libc make on descriptors they hold: `TCGETS` (isatty),
/// `TIOCGWINSZ`, `FIONBIO`, `FIONREAD`, `FIOCLEX`, `FIONCLEX`.
const OTHER_IOCTLS: [u64; 6] = [0x5401, 0x5413, 0x5421, 0x541B, 0x5451, 0x5450];

fn cond(arg: u8, len: Len, op: Op, value: u64) -> SeccompCondition {
    SeccompCondition::new(arg, len, op, value).expect("a valid seccomp condition")
}

fn rule(conditions: Vec<SeccompCondition>) -> SeccompRule {
    SeccompRule::new(conditions).expect("a valid seccomp rule")
}

/// What libkrun's virtio-fs passthrough needs beyond [`allowlist`] for the bench's workloads
/// (`ls`, `mkdir`, `rm -r`; creating, reading and writing files needs nothing more): allowed
/// only in a helper that serves a benchmark's shared directory.
const PASSTHROUGH_EXTRA: [i64; 3] = [libc::SYS_getdents64, libc::SYS_mkdirat, libc::SYS_unlinkat];

/// The allowlist: syscall number → rules (any rule matching allows; no rules: always allowed).
/// `passthrough`: the helper serves a benchmark's shared directory ([`PASSTHROUGH_EXTRA`]).
fn allowlist(passthrough: bool, writable_layer: bool) -> BTreeMap<i64, Vec<SeccompRule>> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let always = [
        libc::SYS_read,
        libc::SYS_write,
        libc::SYS_readv,
        libc::SYS_writev,
        libc::SYS_pread64,
        libc::SYS_pwrite64,
        libc::SYS_preadv,
        libc::SYS_pwritev,
        libc::SYS_preadv2,
        libc::SYS_pwritev2,
        libc::SYS_lseek,
        libc::SYS_close,
        libc::SYS_openat,
        libc::SYS_fstat,
        libc::SYS_newfstatat,
        libc::SYS_statx,
        libc::SYS_dup,
        libc::SYS_dup3,
        libc::SYS_fsync,
        libc::SYS_fdatasync,
        libc::SYS_mmap,
        libc::SYS_munmap,
        libc::SYS_mprotect,
        libc::SYS_mremap,
        libc::SYS_madvise,
        libc::SYS_brk,
        libc::SYS_rt_sigaction,
        libc::SYS_rt_sigprocmask,
        libc::SYS_rt_sigreturn,
        libc::SYS_sigaltstack,
        libc::SYS_futex,
        libc::SYS_set_robust_list,
        libc::SYS_get_robust_list,
        libc::SYS_rseq,
        libc::SYS_set_tid_address,
        libc::SYS_sched_yield,
        libc::SYS_sched_getaffinity,
        libc::SYS_getpid,
        libc::SYS_gettid,
        libc::SYS_getuid,
        libc::SYS_geteuid,
        libc::SYS_getgid,
        libc::SYS_getegid,
        libc::SYS_getrandom,
        libc::SYS_clock_gettime,
        libc::SYS_clock_getres,
        libc::SYS_clock_nanosleep,
        libc::SYS_nanosleep,
        libc::SYS_restart_syscall,
        libc::SYS_exit,
        libc::SYS_exit_group,
        libc::SYS_eventfd2,
        libc::SYS_epoll_create1,
        libc::SYS_epoll_ctl,
        libc::SYS_epoll_pwait,
        libc::SYS_ppoll,
        libc::SYS_pipe2,
        libc::SYS_timerfd_create,
        libc::SYS_timerfd_settime,
        libc::SYS_timerfd_gettime,
        libc::SYS_connect,
        libc::SYS_sendto,
        libc::SYS_recvfrom,
        libc::SYS_sendmsg,
        libc::SYS_recvmsg,
        libc::SYS_shutdown,
        libc::SYS_getsockopt,
        libc::SYS_getsockname,
        libc::SYS_getpeername,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_access,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_poll,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_epoll_wait,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_arch_prctl,
    ];
    for nr in always {
        rules.insert(nr, Vec::new());
    }
    if passthrough {
        for nr in PASSTHROUGH_EXTRA {
            rules.insert(nr, Vec::new());
        }
    }
    let mut ioctls = vec![rule(vec![cond(
        1,
        Len::Dword,
        Op::MaskedEq(0xff00),
        KVM_IOCTL_TYPE,
    )])];
    ioctls.extend(
        OTHER_IOCTLS
            .iter()
            .map(|req| rule(vec![cond(1, Len::Dword, Op::Eq, *req)])),
    );
    rules.insert(libc::SYS_ioctl, ioctls);
    // fcntl only for descriptor flags, status flags and duplication: F_SETOWN/F_SETSIG would
    // let a pipe's O_ASYNC signal any process of the same user.
    rules.insert(
        libc::SYS_fcntl,
        [
            libc::F_DUPFD,
            libc::F_GETFD,
            libc::F_SETFD,
            libc::F_GETFL,
            libc::F_SETFL,
            libc::F_DUPFD_CLOEXEC,
        ]
        .iter()
        .map(|cmd| rule(vec![cond(1, Len::Dword, Op::Eq, *cmd as u64)]))
        .collect(),
    );
    if writable_layer {
        // A qcow2 layer grows its file (imago sets the length when it zeroes past the end);
        // RLIMIT_FSIZE bounds how far.
        rules.insert(libc::SYS_ftruncate, Vec::new());
        rules.insert(
            libc::SYS_fallocate,
            [
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                libc::FALLOC_FL_ZERO_RANGE,
            ]
            .iter()
            .map(|mode| rule(vec![cond(1, Len::Dword, Op::Eq, *mode as u64)]))
            .collect(),
        );
    }
    // Allowed here only so that this filter does not answer it: the clone3 filter's ENOSYS must
    // be the answer (between two ERRNO results the later filter's errno would win).
    rules.insert(libc::SYS_clone3, Vec::new());
    // libkrun's net worker sizes its socket's buffers; nothing else of setsockopt.
    rules.insert(
        libc::SYS_setsockopt,
        [libc::SO_SNDBUF, libc::SO_RCVBUF]
            .iter()
            .map(|opt| {
                rule(vec![
                    cond(1, Len::Dword, Op::Eq, libc::SOL_SOCKET as u64),
                    cond(2, Len::Dword, Op::Eq, *opt as u64),
                ])
            })
            .collect(),
    );
    rules.insert(
        libc::SYS_socket,
        vec![rule(vec![cond(
            0,
            Len::Dword,
            Op::Eq,
            libc::AF_UNIX as u64,
        )])],
    );
    let thread = libc::CLONE_THREAD as u64;
    rules.insert(
        libc::SYS_clone,
        vec![rule(vec![cond(
            0,
            Len::Qword,
            Op::MaskedEq(thread),
            thread,
        )])],
    );
    rules.insert(
        libc::SYS_prctl,
        vec![
            rule(vec![cond(0, Len::Dword, Op::Eq, libc::PR_SET_NAME as u64)]),
            rule(vec![cond(0, Len::Dword, Op::Eq, libc::PR_GET_NAME as u64)]),
        ],
    );
    rules.insert(
        libc::SYS_prlimit64,
        vec![rule(vec![
            cond(0, Len::Dword, Op::Eq, 0),
            cond(2, Len::Qword, Op::Eq, 0),
        ])],
    );
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u64;
    rules.insert(
        libc::SYS_tgkill,
        vec![rule(vec![cond(0, Len::Dword, Op::Eq, pid)])],
    );
    rules
}

fn arch() -> Result<TargetArch, seccompiler::BackendError> {
    TargetArch::try_from(std::env::consts::ARCH)
}

/// `clone3` passes its flags in memory seccomp cannot read, so it gets `ENOSYS`: glibc then
/// falls back to `clone`, whose flags the allowlist checks. A separate filter, installed first,
/// because one seccompiler filter has a single action for every match.
fn clone3_filter() -> Result<BpfProgram, String> {
    let mut rules = BTreeMap::new();
    rules.insert(libc::SYS_clone3, Vec::new());
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch().map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())
}

fn allowlist_filter(passthrough: bool, writable_layer: bool) -> Result<BpfProgram, String> {
    let filter = SeccompFilter::new(
        allowlist(passthrough, writable_layer),
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        arch().map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())
}

/// Installs both filters on the calling thread (the helper has only one when this runs; every
/// thread libkrun starts later inherits them). `passthrough`: the helper serves a benchmark's
/// shared directory; `writable_layer`: it serves a writable root's layer disk.
pub(crate) fn install(report: &mut Isolation, passthrough: bool, writable_layer: bool) {
    let result = clone3_filter()
        .and_then(|p| seccompiler::apply_filter(&p).map_err(|e| e.to_string()))
        .and_then(|()| allowlist_filter(passthrough, writable_layer))
        .and_then(|p| seccompiler::apply_filter(&p).map_err(|e| e.to_string()));
    match result {
        Ok(()) => report.push_layer(
            Layer::Seccomp,
            true,
            format!(
                "{} system calls allowed (some only with narrowed arguments{}), others EPERM",
                allowlist(passthrough, writable_layer).len(),
                if passthrough {
                    "; 3 of them for a benchmark's shared directory"
                } else {
                    ""
                }
            ),
        ),
        Err(e) => report.push_layer(Layer::Seccomp, false, format!("not installed: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` in a forked child with both filters installed; returns the child's exit code.
    fn in_filtered_child(f: fn() -> i32) -> i32 {
        in_filtered_child_of(false, f)
    }

    /// [`in_filtered_child`] for a helper with (or without) a writable layer.
    fn in_filtered_child_of(writable_layer: bool, f: fn() -> i32) -> i32 {
        // SAFETY: the child only installs filters, makes raw calls and _exits.
        match unsafe { libc::fork() } {
            0 => {
                unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
                let mut report = Isolation::default();
                install(&mut report, false, writable_layer);
                if !report.is_enforced(Layer::Seccomp) {
                    unsafe { libc::_exit(100) };
                }
                unsafe { libc::_exit(f()) }
            }
            pid => {
                let mut status = 0;
                unsafe { libc::waitpid(pid, &mut status, 0) };
                assert!(libc::WIFEXITED(status), "child status {status:#x}");
                libc::WEXITSTATUS(status)
            }
        }
    }

    #[test]
    fn clone3_gets_enosys_so_threads_fall_back_to_clone() {
        let code = in_filtered_child(|| {
            let r = unsafe { libc::syscall(libc::SYS_clone3, std::ptr::null::<u8>(), 0usize) };
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            if r == -1 && errno == libc::ENOSYS {
                // A thread still starts (glibc falls back to clone with CLONE_THREAD).
                match std::thread::Builder::new().spawn(|| 7) {
                    Ok(t) => t.join().unwrap_or(1),
                    Err(_) => 2,
                }
            } else {
                3
            }
        });
        assert_eq!(code, 7);
    }

    #[test]
    fn a_denied_call_fails_with_eperm_and_a_process_cannot_fork() {
        let code = in_filtered_child(|| {
            let r = unsafe { libc::syscall(libc::SYS_getppid) };
            let denied =
                r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
            // fork() is clone without CLONE_THREAD.
            let forked = unsafe { libc::fork() };
            if forked == 0 {
                unsafe { libc::_exit(0) };
            }
            match (denied, forked) {
                (true, -1) => 0,
                (false, _) => 1,
                _ => 2,
            }
        });
        assert_eq!(code, 0);
    }

    #[test]
    fn the_filters_compile_for_this_architecture() {
        let allow = allowlist_filter(false, false).unwrap();
        assert!(allow.len() > 50, "{} instructions", allow.len());
        allowlist_filter(true, false).unwrap();
        allowlist_filter(false, true).unwrap();
        clone3_filter().unwrap();
    }

    #[test]
    fn calls_that_reach_beyond_the_vm_are_not_listed() {
        for passthrough in [false, true] {
            calls_that_reach_beyond_the_vm_are_not_listed_in(allowlist(passthrough, false));
        }
    }

    #[test]
    fn only_a_benchmark_share_adds_the_passthrough_calls() {
        let (plain, shared) = (allowlist(false, false), allowlist(true, false));
        for nr in PASSTHROUGH_EXTRA {
            assert!(
                !plain.contains_key(&nr),
                "syscall {nr} is allowed without a share"
            );
            assert!(
                shared.contains_key(&nr),
                "syscall {nr} is missing with a share"
            );
        }
        assert_eq!(plain.len() + PASSTHROUGH_EXTRA.len(), shared.len());
    }

    fn calls_that_reach_beyond_the_vm_are_not_listed_in(list: BTreeMap<i64, Vec<SeccompRule>>) {
        for nr in [
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_ptrace,
            libc::SYS_process_vm_readv,
            libc::SYS_process_vm_writev,
            libc::SYS_kill,
            libc::SYS_mount,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_bpf,
            libc::SYS_perf_event_open,
            libc::SYS_userfaultfd,
            libc::SYS_socketpair,
            libc::SYS_bind,
            libc::SYS_listen,
            libc::SYS_fallocate,
        ] {
            assert!(!list.contains_key(&nr), "syscall {nr} is allowed");
        }
    }

    /// A helper with a writable layer may punch holes and zero ranges (what its disk code
    /// does for the guest's discards and zeroing), and nothing else of fallocate; one without
    /// may not even that.
    #[test]
    fn fallocate_only_punches_holes_and_zeroes_and_only_with_a_writable_layer() {
        // Made before the filters (neither memfd_create nor ftruncate is on the list); the
        // forked child inherits it.
        static FILE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
        let fd = unsafe { libc::memfd_create(c"seccomp-test".as_ptr(), 0) };
        assert!(fd >= 0 && unsafe { libc::ftruncate(fd, 1 << 20) } == 0);
        FILE.store(fd, std::sync::atomic::Ordering::SeqCst);
        fn try_modes() -> i32 {
            let fd = FILE.load(std::sync::atomic::Ordering::SeqCst);
            let errno_of = |mode: i32| {
                let r = unsafe { libc::fallocate(fd, mode, 0, 4096) };
                if r == 0 {
                    0
                } else {
                    std::io::Error::last_os_error().raw_os_error().unwrap_or(-1)
                }
            };
            let punch = errno_of(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE);
            let keep_size = errno_of(libc::FALLOC_FL_KEEP_SIZE);
            let plain = errno_of(0);
            match (punch, keep_size, plain) {
                (0, libc::EPERM, libc::EPERM) => 0,
                (libc::EPERM, libc::EPERM, libc::EPERM) => 1,
                _ => 2,
            }
        }
        assert_eq!(in_filtered_child_of(true, try_modes), 0, "with a layer");
        assert_eq!(in_filtered_child_of(false, try_modes), 1, "without one");
        unsafe { libc::close(fd) };
    }
}
