//! The vsock connection to the host.

use std::fs::File;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::sys::check;

/// The host's context id in vsock addressing.
pub const HOST_CID: u32 = 2;

/// Receive buffer for the control connection (the `buf_alloc` the guest advertises).
///
/// Linux (since the fix for CVE-2026-23086, in 6.12.92 and in libkrunfw kernels that carry
/// it) resets a virtio-vsock connection once its queued packets' bookkeeping alone exceeds
/// the receive buffer: `queued packets x SKB_TRUESIZE(0)` (about 576 bytes each) over
/// `buf_alloc`. The host sends many tiny control messages (credits, signals) and libkrun
/// forwards each read of its socket as one packet, so with the 256 KiB default a burst of
/// about 455 small packets the guest has not read yet kills the connection. 4 MiB raises that
/// ceiling to thousands of packets; it is a bound, not an allocation (memory is only used by
/// data actually queued).
const CONTROL_RECEIVE_BUFFER: u64 = 4 << 20;

/// `<linux/vm_sockets.h>` socket options (level `AF_VSOCK`); the libc crate does not have them.
const SO_VM_SOCKETS_BUFFER_SIZE: libc::c_int = 0;
const SO_VM_SOCKETS_BUFFER_MAX_SIZE: libc::c_int = 2;

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
    // The maximum first: the size is clamped to it.
    for option in [SO_VM_SOCKETS_BUFFER_MAX_SIZE, SO_VM_SOCKETS_BUFFER_SIZE] {
        // SAFETY: setsockopt reads a u64 of the given size from a valid pointer.
        check("setsockopt(vsock buffer size)", unsafe {
            libc::setsockopt(
                fd,
                libc::AF_VSOCK,
                option,
                &CONTROL_RECEIVE_BUFFER as *const u64 as *const libc::c_void,
                std::mem::size_of::<u64>() as libc::socklen_t,
            )
        })?;
    }
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
