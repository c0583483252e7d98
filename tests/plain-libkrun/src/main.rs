//! `libkrun-plain-boot IMAGE.qcow2 PROGRAM [ARG]...`: boots the qcow2 disk image as the root
//! of a libkrun microVM, with libkrun's own init, and runs PROGRAM in it; the guest's console
//! (PROGRAM's output among it) is this process's stdout. libkrunfw must be on the library path
//! (`LD_LIBRARY_PATH`). Exits non-zero if libkrun refuses the configuration; on success
//! libkrun ends the process itself when the guest stops.
//!
//! Only libkrun's C API, as its header documents it, called in the order a C program would:
//! a context of 1 vCPU and 256 MiB, the image as a virtio-blk disk mounted as the root by
//! libkrun's init (`krun_set_root_disk_remount`), no network (the implicit vsock, which would
//! give the guest the host's sockets, is turned off), a fixed environment rather than ours.

use std::ffi::{c_char, CString};
use std::process::ExitCode;

const DISK_FORMAT_QCOW2: u32 = 1;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [image, program, ..] = args.as_slice() else {
        eprintln!("usage: libkrun-plain-boot IMAGE.qcow2 PROGRAM [ARG]...");
        return ExitCode::from(2);
    };
    match boot(image, program, &args[2..]) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("libkrun-plain-boot: {message}");
            ExitCode::FAILURE
        }
    }
}

fn cstring(s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{s:?} holds a NUL byte"))
}

/// A NULL-terminated array of pointers into `strings`, which must outlive it.
fn pointers(strings: &[CString]) -> Vec<*const c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

fn check(call: &str, rc: i32) -> Result<(), String> {
    if rc < 0 {
        Err(format!(
            "{call} failed: {}",
            std::io::Error::from_raw_os_error(-rc)
        ))
    } else {
        Ok(())
    }
}

fn boot(image: &str, program: &str, args: &[String]) -> Result<(), String> {
    let image = cstring(image)?;
    let program = cstring(program)?;
    let argv = args
        .iter()
        .map(|a| cstring(a))
        .collect::<Result<Vec<_>, _>>()?;
    let envp = vec![cstring(
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    )?];
    let (root_id, device, fstype) = (cstring("root")?, cstring("/dev/vda")?, cstring("ext4")?);
    let (argv_ptrs, envp_ptrs) = (pointers(&argv), pointers(&envp));
    // SAFETY: every pointer is to a NUL-terminated string or a NULL-terminated array of them,
    // alive until krun_start_enter, which does not return on success.
    unsafe {
        // Errors, warnings and libkrun's notes (a guest that triple-faults is one: "Received
        // KVM_EXIT_SHUTDOWN"), on stderr.
        check("krun_set_log_level", krun::krun_set_log_level(3))?;
        let ctx = krun::krun_create_ctx();
        check("krun_create_ctx", ctx)?;
        let ctx = ctx as u32;
        check("krun_set_vm_config", krun::krun_set_vm_config(ctx, 1, 256))?;
        check(
            "krun_disable_implicit_vsock",
            krun::krun_disable_implicit_vsock(ctx),
        )?;
        check(
            "krun_add_disk2",
            krun::krun_add_disk2(
                ctx,
                root_id.as_ptr(),
                image.as_ptr(),
                DISK_FORMAT_QCOW2,
                false,
            ),
        )?;
        check(
            "krun_set_root_disk_remount",
            krun::krun_set_root_disk_remount(
                ctx,
                device.as_ptr(),
                fstype.as_ptr(),
                std::ptr::null(),
            ),
        )?;
        check(
            "krun_set_exec",
            krun::krun_set_exec(
                ctx,
                program.as_ptr(),
                argv_ptrs.as_ptr(),
                envp_ptrs.as_ptr(),
            ),
        )?;
        check("krun_start_enter", krun::krun_start_enter(ctx))
    }
}
