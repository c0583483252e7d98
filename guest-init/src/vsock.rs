//! The vsock connection to the host.

use std::fs::File;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::sys::check;

/// The host's context id in vsock addressing.
pub const HOST_CID: u32 = 2;

/// Connects a stream socket to `port` on the host, retrying briefly: the VMM's vsock device can
/// come up a moment after the guest kernel.
pub fn connect_host(port: u32, patience: Duration) -> io::Result<File> {
    let deadline = Instant::now() + patience;
    loop {
        match connect_once(port) {
            Ok(file) => return Ok(file),
            Err(err) if Instant::now() < deadline => {
                let _ = err;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(err) => return Err(err),
        }
    }
}

fn connect_once(port: u32) -> io::Result<File> {
    // SAFETY: plain socket creation; the fd is owned immediately below.
    let fd = check("socket(AF_VSOCK)", unsafe {
        libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0)
    })?;
    // SAFETY: fd is a fresh, valid descriptor that nothing else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_vm is plain data.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = HOST_CID;
    addr.svm_port = port;
    // SAFETY: addr is a valid sockaddr_vm and its size is passed.
    check("connect(vsock host)", unsafe {
        libc::connect(
            fd,
            &addr as *const libc::sockaddr_vm as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        )
    })?;
    Ok(File::from(owned))
}
