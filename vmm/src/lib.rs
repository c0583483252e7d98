//! The `krunbox-vmm` helper: everything in this crate runs in it, one process per running VM,
//! never in the library's process (which starts it: the library's `helper.rs`).
//!
//! `krun_start_enter` takes over its calling process and exits it when the guest powers off, so
//! the library never calls it itself. The helper reads its [`VmmConfig`], takes the descriptors
//! the library handed it by their roles, jails itself (`jail/`), attaches its own devices
//! (`devices/`) and enters the VM. The services the guest talks to stay in the library's
//! process, reached through the descriptors it was handed and unix sockets that libkrun bridges
//! to guest vsock ports.

pub(crate) mod command;
pub(crate) mod devices;
pub(crate) mod jail;
pub(crate) mod queue;

/// The fuzz harness's entry point (not API), for `fuzz/`.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    /// A hostile guest's virtqueue on a copy-on-write root's virtio-blk device: any
    /// descriptor table, available ring, memory and disk size, served by the device's code over
    /// a socket pair to the library's real service over a real layer, and again in place from
    /// a memfd. Panics if anything panics or hangs, the service refuses what the device sent,
    /// a request still waits once the service answered all, or a completion names a chain the
    /// guest did not offer or says more than a request's data and status.
    pub fn virtio_blk_queue(data: &[u8]) {
        crate::devices::blk::fuzz::fuzz_queue(data)
    }
}

use std::path::{Path, PathBuf};

use krunbox_protocol::vmm::VmmConfig;
use krunbox_protocol::vmm::{Inherited, ISOLATION_EXIT_CODE, LIFELINE_EXIT_CODE, MAX_SERVED_DISKS};

use jail::JailPaths;
use krunbox_protocol::vmm::jail::Isolation;
use krunbox_protocol::CONTROL_PORT;

/// The numbers the library passes the helper's fixed roles at ([`Inherited`]).
const ROOT_IMAGE_FD: i32 = fixed(Inherited::RootImage);
const LIFELINE_FD: i32 = fixed(Inherited::Lifeline);
const GUEST_INIT_FD: i32 = fixed(Inherited::GuestInit);
const REPORT_FD: i32 = fixed(Inherited::Report);
const WRITABLE_LAYER_FD: i32 = fixed(Inherited::WritableLayer);

const fn fixed(role: Inherited) -> i32 {
    match role.fd() {
        Some(fd) => fd,
        None => panic!("every fixed role has a number"),
    }
}

/// The descriptor the library passed for `role`, taken over.
///
/// # Safety
/// The library must have passed `role` (the configuration says which roles it passed), and
/// nothing else in this process may own it: each role is taken once.
unsafe fn take(role: Inherited) -> std::result::Result<std::os::fd::OwnedFd, String> {
    use std::os::fd::FromRawFd;
    let fd = role
        .fd()
        .ok_or_else(|| format!("{role:?} is past what the helper takes"))?;
    // SAFETY: as the caller vouches.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// The largest guest-init binary the helper accepts (it is about 1 MiB).
const GUEST_INIT_MAX_BYTES: u64 = 64 << 20;

/// Mount points guest-init uses on its first root before it switches to the image.
/// `layers` holds the layers of a root image given mount points it lacks (guest-init's
/// mounts.rs).
const BOOT_DIRS: [&str; 5] = ["dev", "proc", "sys", "newroot", "layers"];

/// Entry point of the `krunbox-vmm` helper binary. Only returns (with an exit code) if the VM
/// could not be started; otherwise libkrun exits the process when the guest powers off.
///
/// `krunbox-vmm --probe-isolation CONFIG` applies the jail and runs the canaries, writes the
/// report, and exits without starting a VM (`krunbox doctor` uses it; no KVM needed).
pub fn helper_main() -> i32 {
    let args: Vec<String> = std::env::args().collect();
    let (probe, config_path) = match &args[..] {
        [_, config] => (false, config),
        [_, flag, config] if flag == "--probe-isolation" => (true, config),
        _ => {
            eprintln!(
                "usage: krunbox-vmm [--probe-isolation] CONFIG.json (started by the krunbox library, not by hand)"
            );
            return 2;
        }
    };
    let config: VmmConfig = match std::fs::read(config_path)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("krunbox-vmm: cannot read {config_path}: {e}");
            return 2;
        }
    };
    let guest_init = if probe {
        &[][..]
    } else {
        match read_guest_init() {
            Ok(bytes) => bytes,
            Err(e) => {
                eprintln!("krunbox-vmm: cannot read guest-init from fd {GUEST_INIT_FD}: {e}");
                return 2;
            }
        }
    };
    // The jail, in the order that works: namespaces while this process has one thread; libkrun's
    // context (it loads libkrunfw) while the host's tree is still there; then the empty root,
    // limits, privileges, Landlock and seccomp; then the canaries. No guest code has run yet.
    let mut isolation = Isolation::default();
    let jail_started = std::time::Instant::now();
    jail::report_cgroup(&config.jail.cgroup, &mut isolation);
    let (in_mount_namespace, in_pid_namespace) = jail::enter_namespaces(&mut isolation);
    // From here on this is the VMM process (with a pid namespace: a child, its pid 1).
    let vmm_pid = if in_pid_namespace {
        jail::fork_into_pid_namespace(&mut isolation)
    } else {
        std::process::id()
    };
    isolation.add_setup_time(jail_started.elapsed());
    let ctx = match new_context(&config) {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("krunbox-vmm: {e}");
            return 1;
        }
    };
    let image = if probe {
        PathBuf::from("/dev/null")
    } else if in_mount_namespace {
        match reopen_image(&config.root_image) {
            Ok(path) => path,
            Err(e) => {
                eprintln!("krunbox-vmm: {e}");
                return 1;
            }
        }
    } else {
        PathBuf::from(format!("/proc/self/fd/{ROOT_IMAGE_FD}"))
    };
    let host = JailPaths {
        kvm: PathBuf::from("/dev/kvm"),
        image,
        console: config.console.clone(),
        control_socket: config.control_socket.clone(),
        kernel: config.kernel.as_ref().map(|k| k.path.clone()),
        share: config.virtiofs_passthrough.as_ref().map(|s| s.dir.clone()),
        layer: config.writable_layer.map(|disk| jail::LayerPath {
            path: PathBuf::from(format!("/proc/self/fd/{WRITABLE_LAYER_FD}")),
            max_file_bytes: disk.max_file_bytes,
            on_host_filesystem: disk.qcow2,
        }),
        served_file_bytes: config
            .served_disks
            .iter()
            .filter(|disk| disk.in_place)
            .map(|disk| disk.size)
            .max()
            .unwrap_or(0)
            .max(private_pages_bytes(&config, probe)),
    };
    // Before the empty root: where a snapshot of memory mapped copy-on-write finds the pages
    // the guest made its own (this process's: after the fork into the pid namespace).
    let pagemap = (config.command_socket && config.guest_memory_file && !probe).then(|| {
        std::fs::File::open("/proc/self/pagemap")
            .inspect_err(|e| eprintln!("krunbox-vmm: /proc/self/pagemap: {e}"))
            .ok()
    });
    let root_started = std::time::Instant::now();
    let paths = jail::build_root(&config.jail, host, in_mount_namespace, &mut isolation);
    isolation.add_setup_time(root_started.elapsed());
    let configured = configure(ctx, &config, &paths, guest_init, pagemap.flatten());
    let rest_started = std::time::Instant::now();
    jail::restrict(&paths, &mut isolation);
    jail::run_canaries(&config.jail, &mut isolation);
    isolation.add_setup_time(rest_started.elapsed());
    let refusal = krunbox_protocol::vmm::jail::refusal(&config.jail, &isolation);
    write_report(vmm_pid, &isolation);
    if let Some(why) = refusal {
        eprintln!("krunbox-vmm: not starting the VM: {why}");
        return ISOLATION_EXIT_CODE;
    }
    if probe {
        return 0;
    }
    watch_lifeline();
    match configured {
        Ok(ctx) => {
            let err = ctx.start_enter();
            eprintln!("krunbox-vmm: the VM did not start: {err}");
            1
        }
        Err(e) => {
            eprintln!("krunbox-vmm: {e}");
            1
        }
    }
}

/// How long the private-pages file is (`Inherited::PrivatePages`, passed with the command
/// socket and the guest memory file; sealed at that size), which the helper writes within.
fn private_pages_bytes(config: &VmmConfig, probe: bool) -> u64 {
    if probe || !config.command_socket || !config.guest_memory_file {
        return 0;
    }
    // SAFETY: only borrowed for the fstat; `configure` takes it later.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fixed(Inherited::PrivatePages)) };
    nix::sys::stat::fstat(fd).map_or(0, |stat| stat.st_size as u64)
}

/// The root image, opened again inside the helper's new mount namespace (a descriptor from the
/// library's namespace cannot be bind-mounted here), and checked to be the very file the library
/// verified: the same device and inode as [`ROOT_IMAGE_FD`]. Returns its `/proc/self/fd` path.
fn reopen_image(path: &Path) -> std::result::Result<PathBuf, String> {
    use std::os::fd::{AsRawFd, BorrowedFd};
    use std::os::unix::fs::MetadataExt;
    let file = std::fs::File::open(path)
        .map_err(|e| format!("cannot open the root image {}: {e}", path.display()))?;
    // SAFETY: the library passes ROOT_IMAGE_FD open for the helper's whole life.
    let verified = unsafe { BorrowedFd::borrow_raw(ROOT_IMAGE_FD) };
    let verified =
        nix::sys::stat::fstat(verified).map_err(|e| format!("fstat of fd {ROOT_IMAGE_FD}: {e}"))?;
    let reopened = file
        .metadata()
        .map_err(|e| format!("fstat of {}: {e}", path.display()))?;
    if reopened.dev() != verified.st_dev as u64 || reopened.ino() != verified.st_ino as u64 {
        return Err(format!(
            "{} is no longer the root image the library verified (it was replaced)",
            path.display()
        ));
    }
    let fd = file.as_raw_fd();
    // Kept open for the helper's life: libkrun opens the image through this path.
    std::mem::forget(file);
    Ok(PathBuf::from(format!("/proc/self/fd/{fd}")))
}

/// Waits until the library has filled the guest memory and the machine-state file of a
/// restore (it copies them while this process jails itself and builds the VM), and returns
/// the state's length, which the library then writes on the gate. EOF first means it could
/// not, and the restore fails. No deadline: the library is trusted, and the lifeline ends
/// this process if the library goes.
fn wait_at_gate(mut gate: std::fs::File) -> std::result::Result<u64, String> {
    let mut length = [0u8; 8];
    std::io::Read::read_exact(&mut gate, &mut length)
        .map_err(|e| format!("the library did not fill the restored memory: {e}"))?;
    Ok(u64::from_le_bytes(length))
}

/// Writes the isolation report on [`REPORT_FD`] and closes it, so the library sees EOF.
fn write_report(vmm_pid: u32, isolation: &Isolation) {
    use std::io::Write;
    use std::os::fd::FromRawFd;
    // SAFETY: the library hands this process fd REPORT_FD open on a pipe's write end; nothing
    // else in the helper owns it. If it was not passed, the write fails and nothing else breaks.
    let mut pipe = unsafe { std::fs::File::from_raw_fd(REPORT_FD) };
    let report = krunbox_protocol::vmm::jail::HelperReport {
        vmm_pid,
        isolation: isolation.clone(),
    };
    let json = serde_json::to_vec(&report).expect("the report serialises");
    if let Err(e) = pipe.write_all(&json) {
        eprintln!("krunbox-vmm: cannot write the isolation report: {e}");
    }
}

/// Exits the helper (and with it the VM) as soon as the library drops its end of the lifeline.
fn watch_lifeline() {
    std::thread::spawn(|| {
        let mut byte = 0u8;
        loop {
            // SAFETY: reading one byte into a valid buffer from the inherited lifeline fd.
            let n =
                unsafe { libc::read(LIFELINE_FD, &mut byte as *mut u8 as *mut libc::c_void, 1) };
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            // EOF, error (fd not passed), or unexpected data: the owner is gone or confused.
            // SAFETY: _exit skips atexit handlers, which libkrun's threads may be racing.
            unsafe { libc::_exit(LIFELINE_EXIT_CODE) };
        }
    });
}

/// guest-init's bytes, from the descriptor the library passed. Leaked: libkrun serves them for
/// the life of the VM, which is the life of this process.
fn read_guest_init() -> std::io::Result<&'static [u8]> {
    use std::os::fd::FromRawFd;
    // SAFETY: the library hands this process fd GUEST_INIT_FD open on guest-init; nothing else
    // in the helper owns it.
    let file = unsafe { std::fs::File::from_raw_fd(GUEST_INIT_FD) };
    Ok(Vec::leak(read_whole_guest_init(&file)?))
}

/// guest-init's bytes, read from the file's start whatever its offset: a retried boot hands
/// the next helper the same open file (one file description, one offset), which the first
/// helper's reads left at its end.
fn read_whole_guest_init(file: &std::fs::File) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let mut bytes = Vec::new();
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        let n = file.read_at(&mut chunk, bytes.len() as u64)?;
        if n == 0 || bytes.len() as u64 > GUEST_INIT_MAX_BYTES {
            break;
        }
        bytes.extend_from_slice(&chunk[..n]);
    }
    if bytes.len() as u64 > GUEST_INIT_MAX_BYTES || bytes.is_empty() {
        return Err(std::io::Error::other(format!(
            "{} bytes: not a guest-init binary",
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// libkrun's context. Creating it loads libkrunfw, so it happens before the jail's root
/// replaces the host's tree.
fn new_context(config: &VmmConfig) -> std::result::Result<krun_sys::Context, String> {
    use krun_sys::LogLevel;
    let level = match config.log_level {
        0 => LogLevel::Off,
        1 => LogLevel::Error,
        2 => LogLevel::Warn,
        3 => LogLevel::Info,
        4 => LogLevel::Debug,
        _ => LogLevel::Trace,
    };
    krun_sys::set_log_level(level).map_err(|e| e.to_string())?;
    krun_sys::Context::new().map_err(|e| e.to_string())
}

/// Configures the VM with the paths libkrun will open (inside the jail when it pivoted).
fn configure(
    mut ctx: krun_sys::Context,
    config: &VmmConfig,
    paths: &JailPaths,
    guest_init: &'static [u8],
    pagemap: Option<std::fs::File>,
) -> std::result::Result<krun_sys::Context, String> {
    use krun_sys::ROOT_FS_TAG;
    let step = |r: std::result::Result<(), krun_sys::KrunError>| r.map_err(|e| e.to_string());
    step(ctx.set_vm_config(config.cpus, config.memory_mib))?;
    if let (Some(kernel), Some(path)) = (&config.kernel, &paths.kernel) {
        // No initramfs: its /init would run instead of guest-init.
        step(ctx.set_kernel(path, kernel.format, None, kernel.cmdline.as_deref()))?;
    }
    // The image arrives as an inherited, already-verified descriptor, opened by that fd (or a
    // bind mount of it inside the jail), so a path swap after verification cannot substitute
    // another file.
    let image = &paths.image;
    // The guest's first root holds guest-init and its mount points and nothing else: a
    // virtio-fs device with no host directory behind it, served from this process's memory.
    // libkrun's passthrough server does not jail itself (a hostile guest kernel could look up
    // `..` past a shared directory), so no host directory is shared at all. guest-init detaches
    // it once it has switched to the image.
    step(ctx.add_virtual_fs(ROOT_FS_TAG, true))?;
    for dir in BOOT_DIRS {
        step(ctx.add_virtual_dir(ROOT_FS_TAG, dir, 0o755))?;
    }
    step(ctx.add_virtual_file(ROOT_FS_TAG, "init.krun", guest_init, 0o555))?;
    if config.root_qcow2 {
        step(ctx.add_disk_with_format("root", image, krun_sys::DiskFormat::Qcow2, true))?;
    } else {
        step(ctx.add_disk("root", image, true))?;
    }
    if let (Some(layer), Some(disk)) = (&paths.layer, &config.writable_layer) {
        // The guest's /dev/vdb: the upper layer of its overlay root.
        let format = if disk.qcow2 {
            krun_sys::DiskFormat::Qcow2
        } else {
            krun_sys::DiskFormat::Raw
        };
        step(ctx.add_disk_with_format("layer", &layer.path, format, false))?;
    }
    if let (Some(share), Some(dir)) = (&config.virtiofs_passthrough, &paths.share) {
        // Benchmarks only: libkrun's passthrough of a host directory, the baseline our own
        // filesystems are measured against. It does not jail itself; the helper's jail holds
        // only this directory (and the helper's own /proc/self/fd, which the server reopens
        // files through).
        step(ctx.add_virtiofs(&share.tag, dir, false))?;
    }
    step(ctx.disable_implicit_init())?;
    // No TSI: the guest gets no network through the vsock device, only our port.
    step(ctx.set_vsock(0))?;
    step(ctx.add_vsock_port(CONTROL_PORT, &paths.control_socket, false))?;
    // A mount's device hands its queues over to the library, which maps guest memory from
    // its own file: mounts without that file are a library that is not ours.
    if config.fs_devices > 0 && !config.guest_memory_file {
        return Err("filesystem devices without the guest memory file".into());
    }
    for index in 0..config.fs_devices {
        // SAFETY: the library passes a socket for each of the `fs_devices` mounts, and
        // nothing else in the helper owns them.
        let socket = std::os::unix::net::UnixStream::from(unsafe {
            take(Inherited::FsDevice(index as usize))?
        });
        let tag = krunbox_protocol::mount_tag(index);
        let device = devices::fs::HandOverFs::new(&tag, socket);
        krun_sys::device::attach_served_elsewhere(
            &tag,
            std::sync::Arc::new(std::sync::Mutex::new(device)),
        );
    }
    if config.command_socket {
        // SAFETY: the library passes its command socket exactly when `command_socket` is
        // set, and nothing else in the helper owns it.
        // SAFETY: the library passes the machine-state file with the command socket.
        let state_file = std::sync::Arc::new(std::fs::File::from(unsafe {
            take(Inherited::MachineState)?
        }));
        let private_pages = if config.guest_memory_file {
            // SAFETY: the library passes the private-pages file with the command socket when
            // it passes the guest memory file.
            let into = std::fs::File::from(unsafe { take(Inherited::PrivatePages)? });
            Some(command::PrivatePages { into, pagemap })
        } else {
            None
        };
        if config.restore {
            if !config.guest_memory_file {
                return Err("a restore without the guest memory file".into());
            }
            // SAFETY: the library passes the gate with every restore.
            let gate = std::fs::File::from(unsafe { take(Inherited::RestoreGate)? });
            let state_file = state_file.clone();
            // A fork's source's own pages, laid over guest memory at the gate.
            let own_pages = match &private_pages {
                Some(pages) => Some(pages.into.try_clone().map_err(|e| e.to_string())?),
                None => None,
            };
            krun_sys::machine::restore_on_build(
                move || {
                    let bytes = wait_at_gate(gate)?;
                    command::read_state(&state_file, bytes)
                },
                own_pages,
            );
        }
        command::serve(
            unsafe { take(Inherited::Command)? },
            state_file,
            private_pages,
        );
    }
    if config.guest_memory_private && config.fs_devices > 0 {
        return Err("filesystem devices in guest memory mapped copy-on-write".into());
    }
    if config.guest_memory_file {
        // SAFETY: the library passes its memfd exactly when `guest_memory_file` is set, and
        // nothing else in the helper owns it.
        let file = std::fs::File::from(unsafe { take(Inherited::GuestMemory)? });
        krun_sys::device::use_guest_memory_file(file, config.guest_memory_private);
    }
    if config.served_disks.len() > MAX_SERVED_DISKS {
        return Err(format!(
            "{} served disks (at most {MAX_SERVED_DISKS})",
            config.served_disks.len()
        ));
    }
    for (index, disk) in config.served_disks.iter().enumerate() {
        use devices::blk::{Backing, ServedBlock};
        // SAFETY: the library passes a socket (or a regular file, for a disk served in place)
        // for each `served_disks` entry, and for a disk served in place its failure count's
        // eventfd too; nothing else in the helper owns them.
        let disk_fd = unsafe { take(Inherited::ServedDisk(index))? };
        let backing = if disk.in_place {
            let failures = unsafe { take(Inherited::ServedDiskFailures(index))? };
            Backing::File(std::fs::File::from(disk_fd), std::fs::File::from(failures))
        } else {
            Backing::Library(std::os::unix::net::UnixStream::from(disk_fd))
        };
        let device = ServedBlock::new(disk.size, &disk.serial, backing)
            .map_err(|e| format!("the served disk {}: {e}", disk.serial))?;
        krun_sys::device::attach(
            &format!("kbdisk{index}"),
            std::sync::Arc::new(std::sync::Mutex::new(device)),
        );
    }
    // Explicitly empty: nothing of this process's environment reaches the guest.
    step(ctx.set_env(&[]))?;
    step(ctx.set_console_output(&paths.console))?;
    if let Some(net) = &config.network {
        // SAFETY: the library passes its socket exactly when `network` is set, and nothing
        // else in the helper owns it; libkrun takes it over.
        let socket = unsafe { take(Inherited::Network)? };
        step(ctx.add_net_unixstream(socket, net.mac))?;
    }
    Ok(ctx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CI saw a retried boot fail with "cannot read guest-init from fd 5: 0 bytes": the
    /// retry's helper got the same open file, its offset at the end. Reads start at 0 now.
    #[test]
    fn guest_init_is_read_whole_from_a_file_already_read_to_its_end() {
        use std::io::{Read, Write};
        let mut file = tempfile::tempfile().unwrap();
        let binary: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        file.write_all(&binary).unwrap();
        let mut first = Vec::new();
        (&file).read_to_end(&mut first).unwrap();
        assert_eq!(
            first.len(),
            0,
            "the offset is at the end, as a first helper leaves it"
        );
        assert_eq!(read_whole_guest_init(&file).unwrap(), binary);
        let empty = tempfile::tempfile().unwrap();
        assert!(read_whole_guest_init(&empty).is_err());
    }
}
