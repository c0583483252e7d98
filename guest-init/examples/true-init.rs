//! The "bare libkrun" baseline of krunbox's boot benchmark: the least a VM must do to run
//! `/bin/true` from the root image, then stop. Same VMM, kernel and root image as a real boot,
//! none of guest-init's work (vsock handshake, scratch filesystems, root switch, supervision).
//!
//! It says on the console how `/bin/true` ended, so the benchmark can check it really ran.

use std::io;
use std::os::unix::process::CommandExt;
use std::process::Command;

use guest_init::sys;

fn main() {
    match run_true() {
        Ok(status) => println!("true-init: /bin/true from the root image: {status}"),
        Err(err) => println!("true-init: failed: {err}"),
    }
    sys::power_off();
}

fn run_true() -> io::Result<std::process::ExitStatus> {
    match sys::mount("devtmpfs", "/dev", Some("devtmpfs"), 0, None) {
        // The kernel may have mounted devtmpfs itself (CONFIG_DEVTMPFS_MOUNT).
        Err(err) if err.kind() != io::ErrorKind::ResourceBusy => return Err(err),
        _ => {}
    }
    // The built-in images are erofs on the VM's first disk.
    sys::mount("/dev/vda", "/newroot", Some("erofs"), libc::MS_RDONLY, None)?;
    let mut cmd = Command::new("/bin/true");
    // SAFETY: chroot and chdir are async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            sys::check("chroot", libc::chroot(c"/newroot".as_ptr()))?;
            sys::check("chdir", libc::chdir(c"/".as_ptr()))?;
            Ok(())
        });
    }
    cmd.env_clear().status()
}
