//! The one boundary between krunbox and libkrun.
//!
//! libkrun exposes a C API (`krun_*` functions returning `0` or a negative errno). The crates.io
//! `libkrun` crate builds that API from source and links it statically, so no system libkrun is
//! needed. Every `unsafe` call into it lives in this file, behind [`Context`], whose methods take
//! Rust types and return [`KrunError`] for negative returns.
//!
//! `krun_start_enter` takes over the calling process (it runs the VMM event loop and exits the
//! process when the guest powers off), so a [`Context`] is meant to be built and started in a
//! dedicated helper process — krunbox's `krunbox-vmm`.
//!
//! ```no_run
//! use krun_sys::{Context, LogLevel};
//!
//! krun_sys::set_log_level(LogLevel::Warn).unwrap();
//! let mut ctx = Context::new().unwrap();
//! ctx.set_vm_config(1, 512).unwrap();
//! ctx.add_virtual_fs(krun_sys::ROOT_FS_TAG, true).unwrap();
//! ctx.add_virtual_file(krun_sys::ROOT_FS_TAG, "init.krun", b"#!/bin/sh\n", 0o555).unwrap();
//! ctx.add_disk("root", "/path/to/image.erofs".as_ref(), true).unwrap();
//! let err = ctx.start_enter(); // only returns if the VM could not start
//! eprintln!("{err}");
//! ```

pub mod device;
pub mod machine;

use std::ffi::{CString, NulError};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The virtio-fs tag the guest kernel mounts as its root filesystem.
pub const ROOT_FS_TAG: &str = "/dev/root";

/// A libkrun call failed.
#[derive(Debug, thiserror::Error)]
pub enum KrunError {
    /// libkrun returned a negative errno.
    #[error("libkrun {call} failed: {} (errno {errno})", std::io::Error::from_raw_os_error(*errno))]
    Call {
        /// The C function.
        call: &'static str,
        /// The positive errno.
        errno: i32,
    },
    /// An argument could not be passed as a C string.
    #[error("argument to libkrun {call} contains a NUL byte: {source}")]
    Nul {
        /// The C function.
        call: &'static str,
        /// Where the NUL was.
        source: NulError,
    },
    /// A number did not fit the C type.
    #[error("argument to libkrun {call} is out of range: {detail}")]
    Range {
        /// The C function.
        call: &'static str,
        /// What was out of range.
        detail: String,
    },
}

impl KrunError {
    /// The errno, if libkrun returned one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            KrunError::Call { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

fn check(call: &'static str, ret: i32) -> Result<i32, KrunError> {
    if ret < 0 {
        Err(KrunError::Call { call, errno: -ret })
    } else {
        Ok(ret)
    }
}

fn cstr(call: &'static str, s: impl AsRef<[u8]>) -> Result<CString, KrunError> {
    CString::new(s.as_ref()).map_err(|source| KrunError::Nul { call, source })
}

fn cpath(call: &'static str, p: &Path) -> Result<CString, KrunError> {
    cstr(call, p.as_os_str().as_bytes())
}

/// A disk image's format (libkrun's `KRUN_DISK_FORMAT_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum DiskFormat {
    /// The bytes of the disk, as they are.
    Raw = 0,
    /// A qcow2 image (libkrun reads and writes it with the imago crate).
    Qcow2 = 1,
}

/// libkrun's log verbosity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum LogLevel {
    /// Nothing.
    Off = 0,
    /// Errors only.
    Error = 1,
    /// Errors and warnings.
    Warn = 2,
    /// Informational.
    Info = 3,
    /// Debugging.
    Debug = 4,
    /// Everything.
    Trace = 5,
}

/// Sets libkrun's global log level (logs go to the process's stderr).
pub fn set_log_level(level: LogLevel) -> Result<(), KrunError> {
    check("krun_set_log_level", krun::krun_set_log_level(level as u32)).map(drop)
}

/// One VM configuration, consumed by [`Context::start_enter`].
#[derive(Debug)]
pub struct Context {
    id: u32,
}

impl Context {
    /// Creates a configuration context.
    pub fn new() -> Result<Self, KrunError> {
        let id = check("krun_create_ctx", krun::krun_create_ctx())?;
        Ok(Self { id: id as u32 })
    }

    /// Number of vCPUs and guest RAM in MiB.
    pub fn set_vm_config(&mut self, vcpus: u8, ram_mib: u32) -> Result<(), KrunError> {
        check(
            "krun_set_vm_config",
            krun::krun_set_vm_config(self.id, vcpus, ram_mib),
        )
        .map(drop)
    }

    /// Attaches a raw disk image as a virtio-blk device (`/dev/vda`, `/dev/vdb`, … in order).
    pub fn add_disk(
        &mut self,
        block_id: &str,
        path: &Path,
        read_only: bool,
    ) -> Result<(), KrunError> {
        let id = cstr("krun_add_disk", block_id)?;
        let path = cpath("krun_add_disk", path)?;
        // SAFETY: both pointers are valid NUL-terminated strings for the duration of the call;
        // libkrun copies them.
        check("krun_add_disk", unsafe {
            krun::krun_add_disk(self.id, id.as_ptr(), path.as_ptr(), read_only)
        })
        .map(drop)
    }

    /// Attaches a disk image of `format` as a virtio-blk device (in order with
    /// [`Context::add_disk`]'s).
    pub fn add_disk_with_format(
        &mut self,
        block_id: &str,
        path: &Path,
        format: DiskFormat,
        read_only: bool,
    ) -> Result<(), KrunError> {
        let id = cstr("krun_add_disk2", block_id)?;
        let path = cpath("krun_add_disk2", path)?;
        // SAFETY: both pointers are valid NUL-terminated strings for the duration of the call;
        // libkrun copies them.
        check("krun_add_disk2", unsafe {
            krun::krun_add_disk2(
                self.id,
                id.as_ptr(),
                path.as_ptr(),
                format as u32,
                read_only,
            )
        })
        .map(drop)
    }

    /// Turns off libkrun's own init: the root filesystem's `/init.krun` is then the guest's
    /// first process.
    pub fn disable_implicit_init(&mut self) -> Result<(), KrunError> {
        check(
            "krun_disable_implicit_init",
            krun::krun_disable_implicit_init(self.id),
        )
        .map(drop)
    }

    /// Adds a virtio-fs device under `tag` that serves no host directory at all: only the
    /// entries added with [`add_virtual_dir`](Self::add_virtual_dir) and
    /// [`add_virtual_file`](Self::add_virtual_file), from this process's memory. With
    /// [`ROOT_FS_TAG`] it becomes the guest's root filesystem. Every other lookup is `ENOENT`,
    /// so nothing the guest can name on it maps to a host path.
    pub fn add_virtual_fs(&mut self, tag: &str, read_only: bool) -> Result<(), KrunError> {
        const CALL: &str = "krun_add_virtiofs4";
        let tag = cstr(CALL, tag)?;
        // SAFETY: a valid C string for the call (libkrun copies it); a NULL path asks for the
        // host-less NullFs. shm_size 0: no DAX window. Semantics 0: libkrun's default.
        check(CALL, unsafe {
            krun::krun_add_virtiofs4(self.id, tag.as_ptr(), std::ptr::null(), 0, read_only, 0)
        })
        .map(drop)
    }

    /// Adds an empty directory `path` (relative to the share's root, parents first) to a
    /// device from [`add_virtual_fs`](Self::add_virtual_fs).
    pub fn add_virtual_dir(&mut self, tag: &str, path: &str, mode: u32) -> Result<(), KrunError> {
        const CALL: &str = "krun_fs_add_overlay_dir";
        let tag = cstr(CALL, tag)?;
        let path = cstr(CALL, path)?;
        // SAFETY: valid C strings for the call; libkrun copies them.
        check(CALL, unsafe {
            krun::krun_fs_add_overlay_dir(self.id, tag.as_ptr(), path.as_ptr(), mode)
        })
        .map(drop)
    }

    /// Adds a read-only file `path` with the given bytes to a device from
    /// [`add_virtual_fs`](Self::add_virtual_fs). libkrun keeps a pointer to the bytes for the
    /// life of the VM, hence `'static`.
    pub fn add_virtual_file(
        &mut self,
        tag: &str,
        path: &str,
        data: &'static [u8],
        mode: u32,
    ) -> Result<(), KrunError> {
        const CALL: &str = "krun_fs_add_overlay_file";
        let tag = cstr(CALL, tag)?;
        let path = cstr(CALL, path)?;
        // SAFETY: valid C strings for the call (copied); `data` lives for the rest of the
        // process, as libkrun requires. Not one-shot: the guest may open it more than once.
        check(CALL, unsafe {
            krun::krun_fs_add_overlay_file(
                self.id,
                tag.as_ptr(),
                path.as_ptr(),
                data.as_ptr(),
                data.len(),
                mode,
                false,
            )
        })
        .map(drop)
    }

    /// Shares a host directory with the guest over virtio-fs under `tag`, through libkrun's
    /// in-process passthrough server. That server does not jail itself (a hostile guest kernel
    /// can look up `..` past the share), so krunbox never uses it for a guest it runs; it is
    /// here as a baseline for benchmarks. `read_only` makes the device refuse every write.
    pub fn add_virtiofs(
        &mut self,
        tag: &str,
        dir: &Path,
        read_only: bool,
    ) -> Result<(), KrunError> {
        const CALL: &str = "krun_add_virtiofs3";
        let tag = cstr(CALL, tag)?;
        let dir = cpath(CALL, dir)?;
        // SAFETY: valid C strings for the call; libkrun copies them. shm_size 0: no DAX window.
        check(CALL, unsafe {
            krun::krun_add_virtiofs3(self.id, tag.as_ptr(), dir.as_ptr(), 0, read_only)
        })
        .map(drop)
    }

    /// Removes the implicit vsock device (which would carry TSI networking) and adds one with
    /// the given TSI feature bits; `0` gives a vsock with no network impersonation at all.
    pub fn set_vsock(&mut self, tsi_features: u32) -> Result<(), KrunError> {
        check(
            "krun_disable_implicit_vsock",
            krun::krun_disable_implicit_vsock(self.id),
        )?;
        check(
            "krun_add_vsock",
            krun::krun_add_vsock(self.id, tsi_features),
        )
        .map(drop)
    }

    /// Maps a guest vsock port to a host unix socket. With `listen == false` the guest
    /// connects and libkrun connects to the (already listening) host socket at `path`.
    pub fn add_vsock_port(
        &mut self,
        port: u32,
        path: &Path,
        listen: bool,
    ) -> Result<(), KrunError> {
        const CALL: &str = "krun_add_vsock_port2";
        let path = cpath(CALL, path)?;
        // SAFETY: valid C string for the call; libkrun copies it.
        check(CALL, unsafe {
            krun::krun_add_vsock_port2(self.id, port, path.as_ptr(), listen)
        })
        .map(drop)
    }

    /// Adds a virtio-net device (the guest's `eth0` for the first one) whose Ethernet frames
    /// travel over `socket`, a connected `AF_UNIX` `SOCK_STREAM` socket, each frame preceded
    /// by its length as a 4-byte big-endian number (the framing of passt and gvproxy's qemu
    /// mode). Whatever serves the other end is the guest's whole network.
    ///
    /// No offload features and no flags: the guest computes its own checksums and sends frames
    /// of at most its MTU (1500 bytes by default), and libkrun runs no DHCP client. libkrun
    /// takes `socket` over: it is closed when the VM ends, or now if the call fails.
    pub fn add_net_unixstream(&mut self, socket: OwnedFd, mac: [u8; 6]) -> Result<(), KrunError> {
        const CALL: &str = "krun_add_net_unixstream";
        let fd = socket.as_raw_fd();
        // SAFETY: a NULL path with a valid descriptor selects the fd backend; `mac` points at
        // six readable bytes for the call (libkrun copies them). On success libkrun owns `fd`
        // (it wraps it in an `OwnedFd` when the device starts), so ours is forgotten then.
        let ret = unsafe {
            krun::krun_add_net_unixstream(self.id, std::ptr::null(), fd, mac.as_ptr(), 0, 0)
        };
        check(CALL, ret)?;
        std::mem::forget(socket);
        Ok(())
    }

    /// Writes the guest console (kernel messages, init's stdout/stderr) to a file.
    pub fn set_console_output(&mut self, path: &Path) -> Result<(), KrunError> {
        const CALL: &str = "krun_set_console_output";
        let path = cpath(CALL, path)?;
        // SAFETY: valid C string for the call; libkrun copies it.
        check(CALL, unsafe {
            krun::krun_set_console_output(self.id, path.as_ptr())
        })
        .map(drop)
    }

    /// Uses a kernel file instead of libkrunfw's bundled one.
    ///
    /// `format` is libkrun's `KRUN_KERNEL_FORMAT_*` number (0 raw, 1 ELF, 2 PE+gzip,
    /// 3 image+bz2, 4 image+gzip, 5 image+zstd).
    pub fn set_kernel(
        &mut self,
        kernel: &Path,
        format: u32,
        initramfs: Option<&Path>,
        cmdline: Option<&str>,
    ) -> Result<(), KrunError> {
        const CALL: &str = "krun_set_kernel";
        let kernel = cpath(CALL, kernel)?;
        let initramfs = initramfs.map(|p| cpath(CALL, p)).transpose()?;
        let cmdline = cmdline.map(|c| cstr(CALL, c)).transpose()?;
        // SAFETY: valid C strings or NULL for the call's duration; libkrun copies them.
        check(CALL, unsafe {
            krun::krun_set_kernel(
                self.id,
                kernel.as_ptr(),
                format,
                initramfs.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
                cmdline.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            )
        })
        .map(drop)
    }

    /// Sets environment variables passed to the guest's init (on the kernel command line,
    /// so they are visible to the guest: never put secrets here).
    pub fn set_env(&mut self, vars: &[(&str, &str)]) -> Result<(), KrunError> {
        const CALL: &str = "krun_set_env";
        let owned = vars
            .iter()
            .map(|(k, v)| cstr(CALL, format!("{k}={v}")))
            .collect::<Result<Vec<_>, _>>()?;
        let mut ptrs: Vec<*const libc::c_char> = owned.iter().map(|c| c.as_ptr()).collect();
        ptrs.push(std::ptr::null());
        // SAFETY: a NULL-terminated array of valid C strings, alive for the call; libkrun
        // copies the strings.
        check(CALL, unsafe { krun::krun_set_env(self.id, ptrs.as_ptr()) }).map(drop)
    }

    /// Starts the VM. On success this never returns: libkrun runs the VMM in this process and
    /// exits the process when the guest powers off. It returns only the error that kept the VM
    /// from starting.
    pub fn start_enter(self) -> KrunError {
        let ret = krun::krun_start_enter(self.id);
        std::mem::forget(self);
        KrunError::Call {
            call: "krun_start_enter",
            errno: if ret < 0 { -ret } else { libc::EINVAL },
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // A context that was never started is freed; errors here have no one to report to.
        let _ = krun::krun_free_ctx(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configuration_calls_map_errno_to_typed_errors() {
        let mut ctx = Context::new().unwrap();
        ctx.set_vm_config(1, 256).unwrap();
        // A vsock port needs a vsock device: libkrun says ENODEV after it was disabled.
        check(
            "krun_disable_implicit_vsock",
            krun::krun_disable_implicit_vsock(ctx.id),
        )
        .unwrap();
        let err = ctx
            .add_vsock_port(1024, Path::new("/tmp/x.sock"), false)
            .unwrap_err();
        assert_eq!(err.errno(), Some(libc::ENODEV), "{err}");
        assert!(err.to_string().contains("krun_add_vsock_port2"), "{err}");
        // NUL bytes never reach C.
        assert!(matches!(
            ctx.add_disk("ro\0ot", Path::new("/x"), true),
            Err(KrunError::Nul { .. })
        ));
    }

    #[test]
    fn a_listening_vsock_port_on_an_existing_path_is_refused() {
        let dir = std::env::temp_dir();
        let mut ctx = Context::new().unwrap();
        ctx.set_vsock(0).unwrap();
        // listen = true means libkrun creates the socket: an existing path is EEXIST.
        let err = ctx.add_vsock_port(1025, &dir, true).unwrap_err();
        assert_eq!(err.errno(), Some(libc::EEXIST), "{err}");
    }

    #[test]
    fn virtual_entries_need_their_device_and_their_parents() {
        let mut ctx = Context::new().unwrap();
        // No device with that tag yet.
        let err = ctx.add_virtual_dir("work", "a", 0o755).unwrap_err();
        assert_eq!(err.errno(), Some(libc::ENOENT), "{err}");
        ctx.add_virtual_fs("work", true).unwrap();
        ctx.add_virtual_dir("work", "a", 0o755).unwrap();
        ctx.add_virtual_file("work", "a/f", b"x", 0o444).unwrap();
        // A parent that does not exist is refused, not created.
        assert!(ctx.add_virtual_file("work", "b/f", b"x", 0o444).is_err());
    }

    #[test]
    fn a_net_device_takes_a_socket_and_refuses_a_context_it_does_not_know() {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut ctx = Context::new().unwrap();
        ctx.add_net_unixstream(OwnedFd::from(theirs), [0x5a, 0x94, 0xef, 0, 0, 1])
            .unwrap();
        drop(ctx);
        // A freed context: ENOENT, and the socket is closed, not leaked (the peer sees EOF).
        let (other, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut gone = Context { id: u32::MAX };
        let err = gone
            .add_net_unixstream(OwnedFd::from(theirs), [0x5a, 0x94, 0xef, 0, 0, 1])
            .unwrap_err();
        std::mem::forget(gone);
        assert_eq!(err.errno(), Some(libc::ENOENT), "{err}");
        let mut byte = [0u8; 1];
        assert_eq!(std::io::Read::read(&mut &other, &mut byte).unwrap(), 0);
        drop(ours);
    }

    #[test]
    fn the_krunbox_configuration_is_accepted() {
        let mut ctx = Context::new().unwrap();
        ctx.set_vm_config(2, 512).unwrap();
        ctx.add_virtual_fs(ROOT_FS_TAG, true).unwrap();
        for name in ["dev", "proc", "sys", "newroot"] {
            ctx.add_virtual_dir(ROOT_FS_TAG, name, 0o755).unwrap();
        }
        ctx.add_virtual_file(ROOT_FS_TAG, "init.krun", b"init", 0o555)
            .unwrap();
        ctx.add_disk("root", Path::new("/nonexistent.img"), true)
            .unwrap();
        ctx.disable_implicit_init().unwrap();
        ctx.set_vsock(0).unwrap();
        ctx.add_vsock_port(1024, Path::new("/tmp/x.sock"), false)
            .unwrap();
        ctx.set_env(&[]).unwrap();
        ctx.set_console_output(Path::new("/tmp/console.log"))
            .unwrap();
        // A context id that was freed is unknown to libkrun.
        let id = ctx.id;
        drop(ctx);
        assert_eq!(
            check("krun_set_vm_config", krun::krun_set_vm_config(id, 1, 256))
                .unwrap_err()
                .errno(),
            Some(libc::ENOENT)
        );
    }
}
