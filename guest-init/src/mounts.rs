//! Filesystem setup: API filesystems first, then the switch into the root image.

use std::io;

use krunbox_protocol::RootMount;

use crate::sys::{c, check, mount};

/// Where libkrun's root virtio-fs provides an empty directory for the real root.
const NEW_ROOT: &str = "/newroot";

/// Mounts `/dev`, `/proc` and `/sys` on the initial (virtio-fs) root. Already-mounted targets
/// are fine: the kernel may have mounted devtmpfs itself.
pub fn mount_early() -> io::Result<()> {
    for (src, target, fstype) in [
        ("devtmpfs", "/dev", "devtmpfs"),
        ("proc", "/proc", "proc"),
        ("sysfs", "/sys", "sysfs"),
    ] {
        match mount(src, target, Some(fstype), libc::MS_NOSUID, None) {
            Ok(()) => {}
            // The kernel may have mounted devtmpfs itself (CONFIG_DEVTMPFS_MOUNT).
            Err(e) if e.kind() == io::ErrorKind::ResourceBusy => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Mounts the root image, moves the API filesystems into it, adds scratch tmpfs, and makes it
/// `/`. The old (virtio-fs) root is detached so nothing in the guest can reach it by path.
pub fn switch_root(root: &RootMount) -> io::Result<()> {
    let mut flags = libc::MS_NOATIME;
    if root.read_only {
        flags |= libc::MS_RDONLY;
    }
    mount(&root.device, NEW_ROOT, Some(&root.fstype), flags, None)?;

    for dir in ["/dev", "/proc", "/sys"] {
        let target = format!("{NEW_ROOT}{dir}");
        mount(dir, &target, None, libc::MS_MOVE, None)?;
    }

    let nosuid_nodev = libc::MS_NOSUID | libc::MS_NODEV;
    // /dev is the devtmpfs moved in above, so the mount point can always be made.
    std::fs::create_dir_all(format!("{NEW_ROOT}/dev/pts"))?;
    mount(
        "devpts",
        &format!("{NEW_ROOT}/dev/pts"),
        Some("devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("mode=620,ptmxmode=666,gid=5"),
    )?;
    std::fs::create_dir_all(format!("{NEW_ROOT}/dev/shm"))?;
    mount(
        "shm",
        &format!("{NEW_ROOT}/dev/shm"),
        Some("tmpfs"),
        nosuid_nodev,
        Some("mode=1777"),
    )?;
    // Scratch space on a read-only image. /tmp is required; the others only where the image
    // has the directory.
    mount(
        "tmpfs",
        &format!("{NEW_ROOT}/tmp"),
        Some("tmpfs"),
        nosuid_nodev,
        Some("mode=1777"),
    )?;
    for (dir, mode) in [
        ("/run", "755"),
        ("/var/tmp", "1777"),
        ("/root", "700"),
        ("/home", "755"),
    ] {
        let target = format!("{NEW_ROOT}{dir}");
        if std::path::Path::new(&target).is_dir() {
            mount(
                "tmpfs",
                &target,
                Some("tmpfs"),
                nosuid_nodev,
                Some(&format!("mode={mode}")),
            )?;
        }
    }

    // pivot_root(".", ".") stacks the old root under the new one at "/", and the detach
    // then drops it: the documented way to pivot without a spare mount-point directory.
    let new_root = c(NEW_ROOT)?;
    let dot = c(".")?;
    let slash = c("/")?;
    // SAFETY: valid C strings; plain syscalls.
    unsafe {
        check("chdir /newroot", libc::chdir(new_root.as_ptr()))?;
        check(
            "pivot_root",
            libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) as libc::c_int,
        )?;
        check(
            "umount old root",
            libc::umount2(dot.as_ptr(), libc::MNT_DETACH),
        )?;
        check("chdir /", libc::chdir(slash.as_ptr()))?;
    }
    Ok(())
}
