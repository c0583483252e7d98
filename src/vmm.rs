//! The VMM backend: one helper process per running VM.
//!
//! `krun_start_enter` takes over its calling process and exits it when the guest powers off, so
//! the library never calls it itself. Each boot spawns the `krunbox-vmm` helper (this crate's
//! second binary), hands it a [`VmmConfig`] file and the already-verified root image as an
//! inherited file descriptor, and supervises it like any child process. The services the guest
//! talks to (the control channel today; filesystems and network later) stay in the library's
//! process, reached through unix sockets that libkrun bridges to guest vsock ports.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::protocol::CONTROL_PORT;

/// The file descriptor number the root image is passed on.
pub const ROOT_IMAGE_FD: i32 = 3;

/// The file descriptor of the helper's lifeline: the read end of a pipe whose write end only the
/// library's instance holds. EOF means the instance (or the whole library process) is gone, and
/// the helper exits at once. Unlike `PR_SET_PDEATHSIG`, this follows the process, not the thread
/// that happened to spawn the helper.
pub const LIFELINE_FD: i32 = 4;

/// The file descriptor guest-init's binary is passed on. The helper reads it into memory and
/// serves it as the guest's `/init.krun` from a virtio-fs device that has no host directory
/// behind it (see [`configure`]).
pub const GUEST_INIT_FD: i32 = 5;

/// The largest guest-init binary the helper accepts (it is about 1 MiB).
const GUEST_INIT_MAX_BYTES: u64 = 64 << 20;

/// Mount points guest-init uses on its first root before it switches to the image.
const BOOT_DIRS: [&str; 4] = ["dev", "proc", "sys", "newroot"];

/// The helper's exit code when its lifeline broke (the instance or the library process went).
pub const LIFELINE_EXIT_CODE: i32 = 70;

/// Everything the helper needs to configure libkrun. Written as JSON by the library, read by
/// `krunbox-vmm`; both are built from this crate, so the format is private to one build.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VmmConfig {
    /// vCPUs.
    pub cpus: u8,
    /// Guest RAM in MiB.
    pub memory_mib: u32,
    /// Filesystem type of the root image (on fd [`ROOT_IMAGE_FD`]).
    pub root_fstype: String,
    /// Host unix socket bridged to guest vsock port [`CONTROL_PORT`].
    pub control_socket: PathBuf,
    /// Where the guest console goes.
    pub console_log: PathBuf,
    /// A custom kernel instead of libkrunfw's.
    pub kernel: Option<KernelConfig>,
    /// libkrun log level (0 off … 5 trace).
    pub log_level: u32,
}

/// A custom guest kernel.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct KernelConfig {
    /// Kernel image.
    pub path: PathBuf,
    /// libkrun's `KRUN_KERNEL_FORMAT_*` number.
    pub format: u32,
    /// The whole kernel command line, or `None` for libkrun's default.
    pub cmdline: Option<String>,
}

/// Entry point of the `krunbox-vmm` helper binary. Only returns (with an exit code) if the VM
/// could not be started; otherwise libkrun exits the process when the guest powers off.
#[doc(hidden)]
pub fn helper_main() -> i32 {
    let args: Vec<String> = std::env::args().collect();
    let [_, config_path] = &args[..] else {
        eprintln!("usage: krunbox-vmm CONFIG.json (started by the krunbox library, not by hand)");
        return 2;
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
    watch_lifeline();
    let guest_init = match read_guest_init() {
        Ok(bytes) => bytes,
        Err(e) => {
            eprintln!("krunbox-vmm: cannot read guest-init from fd {GUEST_INIT_FD}: {e}");
            return 2;
        }
    };
    match configure(&config, guest_init) {
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
    use std::io::Read;
    use std::os::fd::FromRawFd;
    // SAFETY: the library hands this process fd GUEST_INIT_FD open on guest-init; nothing else
    // in the helper owns it.
    let file = unsafe { std::fs::File::from_raw_fd(GUEST_INIT_FD) };
    let mut bytes = Vec::new();
    file.take(GUEST_INIT_MAX_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > GUEST_INIT_MAX_BYTES || bytes.is_empty() {
        return Err(std::io::Error::other(format!(
            "{} bytes: not a guest-init binary",
            bytes.len()
        )));
    }
    Ok(Vec::leak(bytes))
}

fn configure(
    config: &VmmConfig,
    guest_init: &'static [u8],
) -> std::result::Result<krun_sys::Context, String> {
    use krun_sys::{Context, LogLevel, ROOT_FS_TAG};
    let level = match config.log_level {
        0 => LogLevel::Off,
        1 => LogLevel::Error,
        2 => LogLevel::Warn,
        3 => LogLevel::Info,
        4 => LogLevel::Debug,
        _ => LogLevel::Trace,
    };
    krun_sys::set_log_level(level).map_err(|e| e.to_string())?;
    let mut ctx = Context::new().map_err(|e| e.to_string())?;
    let step = |r: std::result::Result<(), krun_sys::KrunError>| r.map_err(|e| e.to_string());
    step(ctx.set_vm_config(config.cpus, config.memory_mib))?;
    if let Some(kernel) = &config.kernel {
        // No initramfs: its /init would run instead of guest-init.
        step(ctx.set_kernel(&kernel.path, kernel.format, None, kernel.cmdline.as_deref()))?;
    }
    // The image arrives as an inherited, already-verified descriptor: open it by that fd so a
    // path swap after verification cannot substitute another file.
    let image = PathBuf::from(format!("/proc/self/fd/{ROOT_IMAGE_FD}"));
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
    step(ctx.add_disk("root", &image, true))?;
    step(ctx.disable_implicit_init())?;
    // No TSI: the guest gets no network through the vsock device, only our port.
    step(ctx.set_vsock(0))?;
    step(ctx.add_vsock_port(CONTROL_PORT, &config.control_socket, false))?;
    // Explicitly empty: nothing of this process's environment reaches the guest.
    step(ctx.set_env(&[]))?;
    step(ctx.set_console_output(&config.console_log))?;
    Ok(ctx)
}

/// Starts the helper for one VM. The root image descriptor becomes the helper's fd
/// [`ROOT_IMAGE_FD`], the lifeline's read end fd [`LIFELINE_FD`], guest-init fd
/// [`GUEST_INIT_FD`].
pub(crate) fn spawn(
    helper: &Path,
    libkrunfw_dir: &Path,
    config_path: &Path,
    root_image: &std::fs::File,
    guest_init: &std::fs::File,
    lifeline: &impl AsRawFd,
    log: std::fs::File,
) -> Result<tokio::process::Child> {
    let image_fd = root_image.as_raw_fd();
    let init_fd = guest_init.as_raw_fd();
    let lifeline_fd = lifeline.as_raw_fd();
    let log_err = log
        .try_clone()
        .map_err(Error::io("duplicating the VMM log file"))?;
    let mut cmd = tokio::process::Command::new(helper);
    cmd.arg(config_path)
        .env_clear()
        .env("LD_LIBRARY_PATH", libkrunfw_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log_err))
        .kill_on_drop(true);
    if let Some(level) = std::env::var_os("RUST_LOG") {
        cmd.env("RUST_LOG", level);
    }
    // SAFETY: only async-signal-safe calls (dup, dup2, fcntl) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            // Move the sources out of the way first, so no dup2 clobbers another.
            let image = libc::fcntl(image_fd, libc::F_DUPFD_CLOEXEC, 10);
            let lifeline = libc::fcntl(lifeline_fd, libc::F_DUPFD_CLOEXEC, 10);
            let init = libc::fcntl(init_fd, libc::F_DUPFD_CLOEXEC, 10);
            if image < 0
                || lifeline < 0
                || init < 0
                || libc::dup2(image, ROOT_IMAGE_FD) < 0
                || libc::dup2(lifeline, LIFELINE_FD) < 0
                || libc::dup2(init, GUEST_INIT_FD) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn().map_err(|source| Error::VmmSpawn {
        path: helper.to_path_buf(),
        source,
    })
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
