//! Thin checked wrappers over the few syscalls guest-init needs that std does not offer.

use std::ffi::CString;
use std::io;

/// Turns a `-1` return into the current `errno`, naming what failed.
pub fn check(what: &str, ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        let err = io::Error::last_os_error();
        Err(io::Error::new(err.kind(), format!("{what}: {err}")))
    } else {
        Ok(ret)
    }
}

/// A C string from text we produced ourselves (paths, fs names): interior NULs are a bug here,
/// but are still reported rather than panicking.
pub fn c(s: &str) -> io::Result<CString> {
    CString::new(s)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("NUL in {s:?}")))
}

/// `mount(2)`.
pub fn mount(
    source: &str,
    target: &str,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let source_c = c(source)?;
    let target_c = c(target)?;
    let fstype_c = fstype.map(c).transpose()?;
    let data_c = data.map(c).transpose()?;
    // SAFETY: all pointers are valid NUL-terminated strings or NULL, alive for the call.
    let ret = unsafe {
        libc::mount(
            source_c.as_ptr(),
            target_c.as_ptr(),
            fstype_c.as_ref().map_or(std::ptr::null(), |f| f.as_ptr()),
            flags,
            data_c
                .as_ref()
                .map_or(std::ptr::null(), |d| d.as_ptr() as *const libc::c_void),
        )
    };
    check(&format!("mount {source} on {target}"), ret).map(drop)
}

/// `uname -r`.
pub fn kernel_release() -> String {
    // SAFETY: utsname is plain data; uname fills it.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a utsname.
    if unsafe { libc::uname(&mut uts) } != 0 {
        return String::from("unknown");
    }
    let bytes: Vec<u8> = uts
        .release
        .iter()
        .take_while(|&&b| b != 0)
        .map(|&b| b as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `sethostname(2)`.
pub fn set_hostname(name: &str) -> io::Result<()> {
    // SAFETY: pointer and length describe a valid buffer.
    let ret = unsafe { libc::sethostname(name.as_ptr() as *const libc::c_char, name.len()) };
    check("sethostname", ret).map(drop)
}

/// Flushes filesystems and ends the VM. Never returns.
///
/// libkrun's x86 machine has no ACPI power-off; its kernel runs with `reboot=k`, and the VMM
/// ends the VM when the guest resets through the keyboard controller. So "power off" is a reboot.
pub fn power_off() -> ! {
    // SAFETY: plain syscalls without pointer arguments.
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_AUTOBOOT);
    }
    // reboot only returns on failure (e.g. not PID 1 in a test run); exiting is all that's left.
    std::process::exit(1)
}
