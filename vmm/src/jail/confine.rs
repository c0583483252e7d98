//! The helper side of the jail: namespaces and the empty root, rlimits, `no_new_privs`,
//! capabilities, Landlock, then seccomp. Runs in `krunbox-vmm` before any thread is started and
//! before `krun_start_enter`, so every thread libkrun creates inherits all of it.
//!
//! Each layer is best effort on its own and reported as it went: the canaries decide whether the
//! whole holds, and the definition's required layers decide whether a missing one is fatal.

use std::path::{Path, PathBuf};

use krunbox_protocol::vmm::jail::{CgroupPlacement, Isolation, JailConfig, Layer};

/// Descriptors the jailed helper may hold open: libkrun uses about 60 for a VM with our devices
/// (eventfds per virtqueue, vCPU fds, epoll, sockets). Each guest vsock connection costs one,
/// so this also bounds what a guest can make the helper hold.
pub(crate) const MAX_OPEN_FILES: u64 = 512;

/// The largest file the helper may write where it serves no disk: past it, writes fail with
/// EFBIG instead of filling the disk. SIGXFSZ is ignored so that is all that happens. A VM's
/// helper logs to a pipe the library drains into a bounded log (src/logs.rs), so this bounds
/// only the isolation probe's log file and any file the jail would let it write.
pub(crate) const MAX_LOG_BYTES: u64 = 16 << 20;

/// Reports the cgroup layer: in force only if this process is where the library said it put it
/// (read from `/proc/self/cgroup`, before any namespace changes what it shows).
pub(crate) fn report_cgroup(placement: &CgroupPlacement, report: &mut Isolation) {
    match placement {
        CgroupPlacement::Placed { path, limits } => {
            let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
            let here = own
                .lines()
                .find_map(|l| l.strip_prefix("0::"))
                .unwrap_or("");
            if here == path {
                report.push_layer(Layer::Cgroup, true, limits.clone());
            } else {
                report.push_layer(
                    Layer::Cgroup,
                    false,
                    format!("the helper is in {here:?}, not the instance's cgroup {path:?}"),
                );
            }
        }
        CgroupPlacement::Unavailable { reason } => {
            report.push_layer(Layer::Cgroup, false, reason.clone())
        }
    }
}

/// Where libkrun finds what it opens. Before confinement these are host paths; after a
/// successful pivot they are paths inside the jail's root.
#[derive(Debug, Clone)]
pub(crate) struct JailPaths {
    /// `/dev/kvm`.
    pub kvm: PathBuf,
    /// The verified root image (by descriptor: `/proc/self/fd/N` on the host).
    pub image: PathBuf,
    /// The console FIFO the library drains.
    pub console: PathBuf,
    /// The control socket the library listens on.
    pub control_socket: PathBuf,
    /// A custom kernel, if any.
    pub kernel: Option<PathBuf>,
    /// Benchmarks only: the directory libkrun's virtio-fs passthrough serves, read-write
    /// (`SandboxBuilder::virtiofs_passthrough_for_benchmarks`).
    pub share: Option<PathBuf>,
    /// A writable root's layer disk, if any: its `/proc/self/fd/N` path (the layer is a memfd,
    /// which has no other name and cannot be bind-mounted; the jail binds the helper's
    /// `/proc/self/fd` instead) and its size in bytes.
    pub layer: Option<LayerPath>,
    /// The largest file the helper writes within that it was handed (0 for none): a disk it
    /// serves in place, or the private-pages file (as long as guest memory; sealed at that
    /// size). The helper's `RLIMIT_FSIZE` is at least this.
    pub served_file_bytes: u64,
}

/// A writable root's layer disk, as libkrun opens it.
#[derive(Debug, Clone)]
pub(crate) struct LayerPath {
    /// `/proc/self/fd/N`.
    pub path: PathBuf,
    /// The most bytes its file may take (the helper's `RLIMIT_FSIZE`).
    pub max_file_bytes: u64,
    /// A file on a host filesystem (a persistent layer's qcow2), which needs a Landlock rule;
    /// a memfd cannot have one (Landlock refuses rules on kernel-internal files) and needs none.
    pub on_host_filesystem: bool,
}

/// Where the helper's own `/proc/self/fd` is bound in the jail when a directory is shared
/// (benchmarks only: libkrun's passthrough server opens that path when the guest activates
/// the device, to reopen the `O_PATH` descriptors it keeps for each inode) or a writable
/// root's layer is served (libkrun opens the layer's memfd by its `/proc/self/fd` path).
/// Nothing else of `/proc` is there. Reopening through it reaches only what the helper already
/// holds: Landlock checks a reopened file where it lies (the image stays read-only), and a
/// memfd or pipe has no path a rule could name.
const PROC_SELF_FD: &str = "/proc/self/fd";

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// Enters fresh namespaces. Must run while the process has a single thread (unshare of a user
/// namespace requires it). Returns whether a mount namespace was entered and whether a pid
/// namespace was unshared (then the caller must [`fork_into_pid_namespace`]).
pub(crate) fn enter_namespaces(report: &mut Isolation) -> (bool, bool) {
    // SAFETY: getters without arguments.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let others = libc::CLONE_NEWNS
        | libc::CLONE_NEWNET
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWPID;
    // SAFETY: unshare only changes this (single-threaded) process's namespaces.
    let user = unsafe { libc::unshare(libc::CLONE_NEWUSER | others) } == 0;
    let entered = if user {
        // Map our own ids to themselves, so files keep their owners as the kernel sees them.
        let maps = std::fs::write("/proc/self/setgroups", "deny")
            .and_then(|()| std::fs::write("/proc/self/uid_map", format!("{uid} {uid} 1")))
            .and_then(|()| std::fs::write("/proc/self/gid_map", format!("{gid} {gid} 1")));
        match maps {
            Ok(()) => report.push_layer(
                Layer::UserNamespace,
                true,
                format!("uid {uid} and gid {gid} mapped to themselves, nothing else"),
            ),
            Err(e) => report.push_layer(
                Layer::UserNamespace,
                true,
                format!("entered, but the id maps could not be written ({e}): ids are unmapped"),
            ),
        }
        true
    } else {
        let why = errno();
        report.push_layer(
            Layer::UserNamespace,
            false,
            format!("unshare(CLONE_NEWUSER) failed: {why} (unprivileged user namespaces off?)"),
        );
        // Root can have the other namespaces without a user namespace.
        // SAFETY: as above.
        unsafe { libc::unshare(others) == 0 }
    };
    let detail = |what: &str| {
        if entered {
            (true, what.to_string())
        } else {
            (false, format!("not entered: {}", errno()))
        }
    };
    let (on, d) = detail(
        "fresh; its root is a read-only tmpfs holding only /dev/kvm, the image, the console and the control socket",
    );
    report.push_layer(Layer::MountNamespace, on, d);
    let (on, d) = detail("fresh: no interfaces, loopback down");
    report.push_layer(Layer::NetworkNamespace, on, d);
    let (on, d) = detail("fresh ipc and uts namespaces");
    report.push_layer(Layer::IpcNamespace, on, d);
    let (on, d) = detail("fresh: the VMM is its pid 1 and sees no other process");
    report.push_layer(Layer::PidNamespace, on, d);
    (entered, entered)
}

/// After `unshare(CLONE_NEWPID)` only a child enters the new pid namespace, so the helper forks:
/// the child (pid 1 there) goes on to run the VM and returns its pid as the host sees it; the
/// parent stays outside, waits for it and exits the way it did (the library supervises the
/// parent). The child dies with the parent (`PR_SET_PDEATHSIG`), so killing the helper the
/// library started still ends the VM. Must run while the process has a single thread.
pub(crate) fn fork_into_pid_namespace(report: &mut Isolation) -> u32 {
    let (ready_read, ready_write) = match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
        Ok(p) => p,
        Err(e) => return no_pid_namespace(report, format!("pipe: {e}")),
    };
    // SAFETY: the process has one thread; the child goes on with ordinary code.
    match unsafe { nix::unistd::fork() } {
        Err(e) => no_pid_namespace(report, format!("fork: {e}")),
        Ok(nix::unistd::ForkResult::Parent { child }) => {
            drop(ready_read);
            // Tell the child its pid as the host sees it (it is 1 to itself), then get out of
            // the way: the VM's descriptors (the report pipe above all: the library waits for
            // its EOF) must be held by the child alone.
            let pid = child.as_raw() as u32;
            let _ = nix::unistd::write(&ready_write, &pid.to_ne_bytes());
            // The write end stays open as long as this process lives: the child checks it, after
            // arming PDEATHSIG, to know this process had not died before.
            let keep = std::os::fd::AsRawFd::as_raw_fd(&ready_write);
            for fd in (3..1024).filter(|fd| *fd != keep) {
                // SAFETY: closing descriptors this process no longer uses.
                unsafe { libc::close(fd) };
            }
            wait_and_mirror(child)
        }
        Ok(nix::unistd::ForkResult::Child) => {
            drop(ready_write);
            // SAFETY: prctl with integer arguments.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
            let mut pid = [0u8; 4];
            let pid = match nix::unistd::read(&ready_read, &mut pid) {
                Ok(4) => u32::from_ne_bytes(pid),
                // EOF instead of a pid: the parent died before PDEATHSIG was set.
                _ => std::process::exit(krunbox_protocol::vmm::LIFELINE_EXIT_CODE),
            };
            // The parent may also have died after writing and before PDEATHSIG was armed: then
            // its end of the pipe is closed (hang-up), and nothing would ever kill this process.
            let mut poll = libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(&ready_read),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll on one valid pollfd, without waiting.
            let ready = unsafe { libc::poll(&mut poll, 1, 0) };
            if ready != 0 && poll.revents & libc::POLLHUP != 0 {
                std::process::exit(krunbox_protocol::vmm::LIFELINE_EXIT_CODE);
            }
            pid
        }
    }
}

fn no_pid_namespace(report: &mut Isolation, why: String) -> u32 {
    if let Some(l) = report.layer_mut(Layer::PidNamespace) {
        l.enforced = false;
        l.detail = format!("unshared, but the VMM could not be started in it: {why}");
    }
    std::process::id()
}

/// The parent's life: wait for the VMM child and end as it ended.
fn wait_and_mirror(child: nix::unistd::Pid) -> ! {
    use nix::sys::wait::{waitpid, WaitStatus};
    loop {
        match waitpid(child, None) {
            Ok(WaitStatus::Exited(_, code)) => std::process::exit(code),
            Ok(WaitStatus::Signaled(_, signal, _)) => {
                // SAFETY: restoring the default action and raising the same signal on ourselves,
                // so the library sees the same status the VMM had.
                unsafe {
                    libc::signal(signal as libc::c_int, libc::SIG_DFL);
                    libc::raise(signal as libc::c_int);
                }
                std::process::exit(128 + signal as i32)
            }
            Ok(_) => continue,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => std::process::exit(1),
        }
    }
}

/// Builds the jail's root: a tmpfs on `root_dir` holding bind mounts of exactly the files
/// libkrun opens, then `pivot_root` into it and detaches the host's tree. Returns the paths to
/// give libkrun inside it.
fn pivot_into_jail(root_dir: &Path, host: &JailPaths) -> Result<JailPaths, String> {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    let step = |what: String| move |e: nix::Error| format!("{what}: {e}");
    let io = |what: String| move |e: std::io::Error| format!("{what}: {e}");
    // Nothing we mount may propagate back to the host's mount namespace.
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(step("making / private".into()))?;
    mount(
        Some("krunbox-jail"),
        root_dir,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("size=64k,nr_inodes=64,mode=0755"),
    )
    .map_err(step(format!("mounting a tmpfs on {}", root_dir.display())))?;
    let inside = JailPaths {
        kvm: PathBuf::from("/dev/kvm"),
        image: PathBuf::from("/root.img"),
        console: PathBuf::from("/console"),
        control_socket: PathBuf::from("/control.sock"),
        kernel: host.kernel.as_ref().map(|_| PathBuf::from("/kernel")),
        share: host.share.as_ref().map(|_| PathBuf::from("/share")),
        // Reached through the bound /proc/self/fd, at the same path.
        layer: host.layer.clone(),
        served_file_bytes: host.served_file_bytes,
    };
    std::fs::create_dir(root_dir.join("dev")).map_err(io("creating dev".into()))?;
    // (source, target, read-only, a directory)
    let mut binds: Vec<(&Path, &Path, bool, bool)> = vec![
        (&host.kvm, &inside.kvm, false, false),
        (&host.image, &inside.image, true, false),
        (&host.console, &inside.console, false, false),
        (&host.control_socket, &inside.control_socket, false, false),
    ];
    if let (Some(h), Some(i)) = (&host.kernel, &inside.kernel) {
        binds.push((h, i, true, false));
    }
    // Benchmarks only: the shared directory, and the /proc/self/fd the passthrough server
    // needs (see PROC_SELF_FD). `/proc/self` resolves now, to this process.
    let proc_self_fd = Path::new(PROC_SELF_FD);
    if let (Some(h), Some(i)) = (&host.share, &inside.share) {
        binds.push((h, i, false, true));
    }
    if host.share.is_some() || host.layer.is_some() {
        binds.push((proc_self_fd, proc_self_fd, false, true));
    }
    for (source, target, read_only, directory) in binds {
        let target = root_dir.join(target.strip_prefix("/").unwrap_or(target));
        if directory {
            std::fs::create_dir_all(&target)
        } else {
            std::fs::File::create(&target).map(drop)
        }
        .map_err(io(format!("creating {}", target.display())))?;
        mount(
            Some(source),
            &target,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(step(format!(
            "binding {} to {}",
            source.display(),
            target.display()
        )))?;
        if read_only {
            mount(
                None::<&str>,
                &target,
                None::<&str>,
                MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY,
                None::<&str>,
            )
            .map_err(step(format!("making {} read-only", target.display())))?;
        }
    }
    // pivot_root(".", "."): the old root ends up stacked under the new one, and detaching it
    // leaves nothing of the host's tree reachable.
    std::env::set_current_dir(root_dir).map_err(io("entering the jail's root".into()))?;
    nix::unistd::pivot_root(".", ".").map_err(step("pivot_root".into()))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(step("detaching the host's tree".into()))?;
    std::env::set_current_dir("/").map_err(io("entering /".into()))?;
    // The root itself becomes read-only; the bound device, FIFO and socket still open.
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY,
        None::<&str>,
    )
    .map_err(step("making the jail's root read-only".into()))?;
    Ok(inside)
}

/// rlimits: no core dumps (guest memory would land on disk), bounded descriptors, bounded file
/// size ([`MAX_LOG_BYTES`]; with a writable layer or a disk served in place, the disk's size,
/// since the limit applies to every file the helper writes, its disks too).
pub(crate) fn set_rlimits(report: &mut Isolation, max_file_bytes: u64) {
    use nix::sys::resource::{setrlimit, Resource};
    // SAFETY: ignoring SIGXFSZ only makes oversized writes fail with EFBIG.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    let results = [
        (Resource::RLIMIT_CORE, 0, "no core dumps"),
        (Resource::RLIMIT_NOFILE, MAX_OPEN_FILES, "descriptors"),
        (Resource::RLIMIT_FSIZE, max_file_bytes, "file size"),
    ]
    .map(|(resource, limit, what)| (what, limit, setrlimit(resource, limit, limit)));
    let failed: Vec<String> = results
        .iter()
        .filter_map(|(what, _, r)| r.as_ref().err().map(|e| format!("{what}: {e}")))
        .collect();
    if failed.is_empty() {
        report.push_layer(
            Layer::Rlimits,
            true,
            format!(
                "no core dumps, at most {MAX_OPEN_FILES} descriptors, files at most {} MiB",
                max_file_bytes >> 20
            ),
        );
    } else {
        report.push_layer(Layer::Rlimits, false, failed.join("; "));
    }
}

/// `no_new_privs` (required for an unprivileged seccomp filter and for Landlock anyway), then
/// every capability gone: bounding set, ambient set, then effective/permitted/inheritable.
pub(crate) fn drop_privileges(report: &mut Isolation) {
    // SAFETY: prctl with integer arguments only.
    let nnp = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } == 0;
    report.push_layer(
        Layer::NoNewPrivs,
        nnp,
        if nnp {
            "set".to_string()
        } else {
            format!("prctl failed: {}", errno())
        },
    );
    // Past the kernel's last capability the call fails with EINVAL, which is harmless.
    for cap in 0..64 {
        // SAFETY: as above. Fails with EPERM without CAP_SETPCAP, which is fine: then the
        // bounding set cannot matter, as nothing can be gained (no_new_privs).
        unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
    }
    // SAFETY: as above.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    #[repr(C)]
    struct CapHeader {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct CapData {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [CapData::default(); 2];
    // SAFETY: capset with a valid v3 header and two zeroed data structs: drops everything.
    let dropped = unsafe {
        libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            data.as_ptr(),
        )
    } == 0;
    let mut now = [CapData::default(); 2];
    // SAFETY: capget with a valid v3 header into two data structs.
    let read = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut CapHeader,
            now.as_mut_ptr(),
        )
    } == 0;
    let none_left = read
        && now
            .iter()
            .all(|d| d.effective == 0 && d.permitted == 0 && d.inheritable == 0);
    let dropped = dropped && none_left;
    // SAFETY: prctl reads; past the kernel's last capability it fails with EINVAL (< 0).
    let bounding_left =
        (0..64).any(|cap| unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap, 0, 0, 0) } == 1);
    let detail = if dropped && !bounding_left {
        "all dropped (effective, permitted, inheritable, ambient, bounding)".to_string()
    } else if dropped {
        "effective, permitted, inheritable and ambient dropped; the bounding set stays (dropping \
         it needs CAP_SETPCAP), which no_new_privs and the absence of execve make moot"
            .to_string()
    } else if !none_left {
        "capget still shows capabilities".to_string()
    } else {
        format!("capset failed: {}", errno())
    };
    report.push_layer(Layer::Capabilities, dropped, detail);
}

/// Landlock: the handled filesystem rights are all the kernel knows; the only rules allow
/// `/dev/kvm`, the image, the console, the control socket and the kernel, each for what libkrun
/// does with it. TCP bind/connect are handled with no rule (denied), and scopes are set.
pub(crate) fn landlock(paths: &JailPaths, report: &mut Isolation) {
    use landlock::{
        Access, AccessFs, AccessNet, PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr,
        RulesetStatus, Scope, ABI,
    };
    let abi = ABI::V10;
    let read = AccessFs::ReadFile;
    let write = AccessFs::WriteFile | AccessFs::Truncate;
    let result =
        (|| -> Result<(landlock::RestrictionStatus, Vec<String>), landlock::RulesetError> {
            let mut ruleset = Ruleset::default()
                .handle_access(AccessFs::from_all(abi))?
                .handle_access(AccessNet::from_all(abi))?
                .scope(Scope::from_all(abi))?
                .create()?;
            let mut missing = Vec::new();
            let mut rules: Vec<(&Path, landlock::BitFlags<AccessFs>)> = vec![
                (&paths.kvm, read | AccessFs::WriteFile | AccessFs::IoctlDev),
                (&paths.image, read.into()),
                (&paths.console, write),
                (&paths.control_socket, AccessFs::ResolveUnix.into()),
            ];
            if let Some(kernel) = &paths.kernel {
                rules.push((kernel, read.into()));
            }
            // A writable root's layer: a memfd needs no rule (Landlock does not check files
            // on kernel-internal mounts), a persistent layer's qcow2 file does. The rule is on
            // the file the descriptor's path resolves to, so it names that one file.
            if let Some(layer) = paths.layer.as_ref().filter(|l| l.on_host_filesystem) {
                rules.push((&layer.path, write | read));
            }
            // Benchmarks only: what libkrun's passthrough does beneath the shared directory
            // (no devices, sockets, FIFOs or execution). Its /proc/self/fd needs no rule: the
            // server opens it `O_PATH`, which Landlock does not check, and a file reopened
            // through it is checked where it lies, beneath this directory.
            if let Some(share) = &paths.share {
                rules.push((
                    share,
                    write
                        | read
                        | AccessFs::ReadDir
                        | AccessFs::MakeReg
                        | AccessFs::MakeDir
                        | AccessFs::MakeSym
                        | AccessFs::RemoveFile
                        | AccessFs::RemoveDir
                        | AccessFs::Refer,
                ));
            }
            for (path, access) in rules {
                match PathFd::new(path) {
                    Ok(fd) => ruleset = ruleset.add_rule(PathBeneath::new(fd, access))?,
                    Err(e) => missing.push(format!("{}: {e}", path.display())),
                }
            }
            Ok((ruleset.restrict_self()?, missing))
        })();
    match result {
        Ok((status, missing)) => {
            let fs_on = status.ruleset != RulesetStatus::NotEnforced;
            let abi_found = landlock_abi();
            report.push_layer(
                Layer::Landlock,
                fs_on,
                if fs_on {
                    let mut d = format!(
                        "ABI {abi_found}: only /dev/kvm, the image, the console and the control socket"
                    );
                    if paths.share.is_some() {
                        d.push_str(", and a benchmark's shared directory");
                    }
                    if !missing.is_empty() {
                        d.push_str(&format!(" (no rule for {})", missing.join(", ")));
                    }
                    d
                } else {
                    "the kernel does not enforce Landlock (not built in or not in lsm=)".into()
                },
            );
            let net = fs_on && abi_found >= 4;
            report.push_layer(
                Layer::LandlockNetwork,
                net,
                if net {
                    "no TCP bind or connect".to_string()
                } else {
                    format!("needs Landlock ABI 4 (Linux 6.7); this kernel has ABI {abi_found}")
                },
            );
            let scope = fs_on && abi_found >= 6;
            report.push_layer(
                Layer::LandlockScope,
                scope,
                if scope {
                    "no signals or abstract unix sockets outside the jail".to_string()
                } else {
                    format!("needs Landlock ABI 6 (Linux 6.12); this kernel has ABI {abi_found}")
                },
            );
        }
        Err(e) => {
            for layer in [
                Layer::Landlock,
                Layer::LandlockNetwork,
                Layer::LandlockScope,
            ] {
                report.push_layer(layer, false, format!("Landlock failed: {e}"));
            }
        }
    }
}

/// The Landlock ABI version the kernel offers (0: none).
fn landlock_abi() -> i64 {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: the version query takes no ruleset attribute and returns a number.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    v.max(0)
}

/// The jail's root: with a mount namespace, an empty tmpfs holding only what libkrun opens (see
/// [`pivot_into_jail`]); without one, the host's paths as they are (Landlock then stands alone).
/// Returns the paths to configure libkrun with.
pub(crate) fn build_root(
    config: &JailConfig,
    host: JailPaths,
    in_mount_namespace: bool,
    report: &mut Isolation,
) -> JailPaths {
    if !in_mount_namespace {
        return host;
    }
    match pivot_into_jail(&config.root_dir, &host) {
        Ok(inside) => {
            let also = if inside.share.is_some() {
                Some(", and (benchmarks only) a shared directory and the helper's /proc/self/fd")
            } else if inside.layer.is_some() {
                Some(", and the helper's /proc/self/fd (a writable root's layer disk is opened by it)")
            } else {
                None
            };
            if let (Some(also), Some(l)) = (also, mount_namespace(report)) {
                l.detail.push_str(also);
            }
            inside
        }
        Err(e) => {
            // Keep the namespace, but say the root could not be emptied.
            if let Some(l) = mount_namespace(report) {
                l.enforced = false;
                l.detail = format!("entered, but the empty root could not be built: {e}");
            }
            host
        }
    }
}

/// The report's mount-namespace layer, whose detail the root's contents complete.
fn mount_namespace(
    report: &mut Isolation,
) -> Option<&mut krunbox_protocol::vmm::jail::LayerReport> {
    report.layer_mut(Layer::MountNamespace)
}

/// Everything after the root: rlimits, privileges, Landlock, seccomp, in that order (seccomp
/// last, so the calls the others make need not be on its list).
pub(crate) fn restrict(paths: &JailPaths, report: &mut Isolation) {
    let layer_bytes = paths.layer.as_ref().map_or(0, |l| l.max_file_bytes);
    set_rlimits(
        report,
        MAX_LOG_BYTES.max(layer_bytes).max(paths.served_file_bytes),
    );
    drop_privileges(report);
    landlock(paths, report);
    super::seccomp::install(report, paths.share.is_some(), paths.layer.is_some());
}
