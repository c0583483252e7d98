//! Host filesystems in the guest: a virtio-fs mount per [`GuestMount`].
//!
//! Each mount is a virtio-fs device of the host's (krunbox's helper forwards its FUSE requests
//! to the library, which answers them), tagged [`mount_tag`]`(index)`. The guest kernel speaks
//! to the device directly: nothing here relays or interprets a request.

use std::io;

use krunbox_protocol::{mount_tag, GuestMount};

use crate::sys::mount;

/// Mounts every host filesystem, in order (parents first). Runs after the switch to the root
/// image, before the host is told the guest is ready; an error names the mount and the guest's
/// own error.
pub fn mount_all(mounts: &[GuestMount]) -> Result<(), String> {
    for (index, target) in mounts.iter().enumerate() {
        mount_one(index as u32, target).map_err(|e| format!("mounting {}: {e}", target.path))?;
    }
    Ok(())
}

/// Mounts host filesystem `index` at `target`.
pub fn mount_one(index: u32, target: &GuestMount) -> io::Result<()> {
    std::fs::create_dir_all(&target.path)
        .map_err(|e| io::Error::new(e.kind(), format!("creating the mount point: {e}")))?;
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME;
    if target.read_only {
        flags |= libc::MS_RDONLY;
    }
    // virtio-fs mounts are default_permissions (the guest kernel checks modes and owners
    // itself; the host's implementation only reports them) and allow_other by themselves.
    mount(
        &mount_tag(index),
        &target.path,
        Some("virtiofs"),
        flags,
        None,
    )?;
    raise_readahead(&target.path);
    Ok(())
}

/// The readahead a mount gets, in KiB: a sequential read then asks the host for 1 MiB at a
/// time (one round trip) instead of the kernel's default 128 KiB (eight). The kernel never
/// raises a FUSE mount's readahead past its default by itself: the INIT reply can only lower
/// it. Random reads are unaffected (readahead grows only on sequential access).
const READAHEAD_KIB: u32 = 1024;

/// Sets the mount's readahead through its backing device info in sysfs (named by the mount's
/// device number). Best effort: a guest without it only reads in smaller pieces.
fn raise_readahead(path: &str) {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::metadata(path) else {
        return;
    };
    let dev = meta.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let knob = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    if let Err(err) = std::fs::write(&knob, READAHEAD_KIB.to_string()) {
        eprintln!("guest-init: raising the readahead of {path} ({knob}): {err}");
    }
}
