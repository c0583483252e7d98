//! Host filesystems in the guest: a FUSE mount per [`GuestMount`], its requests relayed to the
//! host unparsed.
//!
//! guest-init reads each request from `/dev/fuse` (one `read` is one request) and writes it to
//! the mount's vsock connection as is; the host answers with FUSE replies, each framed by its
//! own header's length, and each goes to `/dev/fuse` in one `write`, as the device requires.
//! Nothing here interprets a request: the host decodes and checks everything.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::time::Duration;

use krunbox_protocol::{GuestMount, FS_PORT};

use crate::sys::mount;
use crate::vsock;

/// The largest request the kernel sends: a 1 MiB write (the host negotiates 256 pages) plus
/// its headers, with room to spare. The kernel refuses reads into a smaller buffer.
const REQUEST_BUFFER: usize = (1 << 20) + 8192;

/// A FUSE reply header's length (`len: u32, error: i32, unique: u64`).
const REPLY_HEADER: usize = 16;

/// Mounts every host filesystem, in order (parents first), and starts its relay. Runs after
/// the switch to the root image, before the host is told the guest is ready; an error names the
/// mount and the guest's own error.
pub fn mount_all(mounts: &[GuestMount]) -> Result<(), String> {
    for (index, target) in mounts.iter().enumerate() {
        mount_one(index as u32, target).map_err(|e| format!("mounting {}: {e}", target.path))?;
    }
    Ok(())
}

/// Mounts one host filesystem, connection `index`, at `target` and starts its relay.
pub fn mount_one(index: u32, target: &GuestMount) -> io::Result<()> {
    std::fs::create_dir_all(&target.path)
        .map_err(|e| io::Error::new(e.kind(), format!("creating the mount point: {e}")))?;
    let device = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map_err(|e| io::Error::new(e.kind(), format!("opening /dev/fuse: {e}")))?;
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME;
    if target.read_only {
        flags |= libc::MS_RDONLY;
    }
    // default_permissions: the guest kernel checks modes and owners itself (the host's
    // implementation only reports them). allow_other: every guest user may use the mount.
    let options = format!(
        "fd={},rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other,max_read={}",
        device.as_raw_fd(),
        1 << 20
    );
    mount("krunbox", &target.path, Some("fuse"), flags, Some(&options))?;
    let mut connection = vsock::connect_host(FS_PORT, Duration::from_secs(30))
        .map_err(|e| io::Error::new(e.kind(), format!("connecting to the host: {e}")))?;
    connection.write_all(&index.to_le_bytes())?;
    let to_host = (device.try_clone()?, connection.try_clone()?);
    let from_host = (connection, device);
    let path = target.path.clone();
    std::thread::Builder::new()
        .name(format!("fuse-in-{index}"))
        .spawn(move || {
            io_flusher();
            let (device, connection) = to_host;
            if let Err(err) = requests_to_host(device, connection) {
                eprintln!("guest-init: the mount {path} stopped relaying requests: {err}");
            }
        })?;
    let path = target.path.clone();
    std::thread::Builder::new()
        .name(format!("fuse-out-{index}"))
        .spawn(move || {
            io_flusher();
            let (connection, device) = from_host;
            if let Err(err) = replies_to_kernel(connection, device) {
                eprintln!("guest-init: the mount {path} stopped relaying replies: {err}");
            }
        })?;
    // After the relay runs: finding the mount's device asks the host for its root's attributes.
    raise_readahead(&target.path);
    Ok(())
}

/// Marks the calling relay thread as one that block I/O depends on (`PR_SET_IO_FLUSHER`): a
/// loop device over a FUSE file (a copy-on-write root's layer) writes through this relay, so
/// the kernel must not make the relay itself wait for that writeback when it reclaims memory
/// for it. Best effort (it needs `CAP_SYS_RESOURCE`, which guest-init has).
fn io_flusher() {
    /// `PR_SET_IO_FLUSHER` from linux/prctl.h (the libc crate's musl target lacks it).
    const PR_SET_IO_FLUSHER: libc::c_int = 57;
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) };
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

fn requests_to_host(mut device: File, mut connection: File) -> io::Result<()> {
    let mut buffer = vec![0u8; REQUEST_BUFFER];
    loop {
        let n = match device.read(&mut buffer) {
            Ok(n) => n,
            // ENOENT: the request was interrupted before we read it; EINTR: a signal.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINTR)) => continue,
            // ENODEV: the filesystem was unmounted.
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(()),
            Err(e) => return Err(e),
        };
        connection.write_all(&buffer[..n])?;
    }
}

fn replies_to_kernel(mut connection: File, mut device: File) -> io::Result<()> {
    let mut reply = Vec::with_capacity(REQUEST_BUFFER);
    loop {
        let mut header = [0u8; REPLY_HEADER];
        connection.read_exact(&mut header)?;
        let length = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
        if !(REPLY_HEADER..=REQUEST_BUFFER).contains(&length) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a reply of {length} bytes"),
            ));
        }
        reply.clear();
        reply.extend_from_slice(&header);
        reply.resize(length, 0);
        connection.read_exact(&mut reply[REPLY_HEADER..])?;
        match device.write(&reply) {
            Ok(_) => {}
            // ENOENT: the request was interrupted and is gone; its reply has nowhere to go.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(()),
            // The kernel refused this one reply (EINVAL: malformed): the request it answered
            // fails, the mount goes on.
            Err(e) => eprintln!("guest-init: the kernel refused a FUSE reply: {e}"),
        }
    }
}
