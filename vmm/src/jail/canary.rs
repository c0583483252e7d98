//! The canaries: after every layer is in place, the helper tries three things it must not be
//! able to do. Each costs one system call or two, so they run at every boot.

use std::io::Read;
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::time::Duration;

use krunbox_protocol::vmm::jail::{Canary, Isolation, JailConfig};

/// Runs every canary and records the outcomes.
pub(crate) fn run(config: &JailConfig, report: &mut Isolation) {
    host_file(config, report);
    host_loopback(config, report);
    host_unix_sockets(config, report);
    denied_syscall(report);
}

fn host_file(config: &JailConfig, report: &mut Isolation) {
    let outcome = std::fs::File::open(&config.canary_file).and_then(|mut f| {
        let mut byte = [0u8; 1];
        f.read(&mut byte)
    });
    match outcome {
        Ok(_) => report.push_canary(
            Canary::HostFile,
            false,
            format!("opened and read {}", config.canary_file.display()),
        ),
        Err(e) => report.push_canary(Canary::HostFile, true, e.to_string()),
    }
}

fn host_loopback(config: &JailConfig, report: &mut Isolation) {
    let addr = SocketAddrV4::new(Ipv4Addr::LOCALHOST, config.canary_port);
    match TcpStream::connect_timeout(&addr.into(), Duration::from_secs(2)) {
        Ok(_) => report.push_canary(Canary::HostLoopback, false, format!("connected to {addr}")),
        Err(e) => report.push_canary(Canary::HostLoopback, true, e.to_string()),
    }
}

fn host_unix_sockets(config: &JailConfig, report: &mut Isolation) {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixStream};
    match UnixStream::connect(&config.canary_socket) {
        Ok(_) => report.push_canary(
            Canary::HostUnixSocket,
            false,
            format!("connected to {}", config.canary_socket.display()),
        ),
        Err(e) => report.push_canary(Canary::HostUnixSocket, true, e.to_string()),
    }
    let outcome = SocketAddr::from_abstract_name(config.canary_abstract.as_bytes())
        .and_then(|addr| UnixStream::connect_addr(&addr));
    match outcome {
        Ok(_) => report.push_canary(
            Canary::HostAbstractSocket,
            false,
            format!("connected to @{}", config.canary_abstract),
        ),
        Err(e) => report.push_canary(Canary::HostAbstractSocket, true, e.to_string()),
    }
}

fn denied_syscall(report: &mut Isolation) {
    // Reading one byte of this process's own memory: harmless if it went through, and the kind
    // of call (cross-process memory access) the allowlist exists to refuse.
    let source = [0x5au8; 1];
    let mut target = [0u8; 1];
    let local = libc::iovec {
        iov_base: target.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let remote = libc::iovec {
        iov_base: source.as_ptr() as *mut libc::c_void,
        iov_len: 1,
    };
    // SAFETY: both iovecs point at one valid byte of this process's memory.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    if n < 0 {
        report.push_canary(
            Canary::DeniedSyscall,
            true,
            format!("process_vm_readv: {}", std::io::Error::last_os_error()),
        );
    } else {
        report.push_canary(
            Canary::DeniedSyscall,
            false,
            "process_vm_readv succeeded".into(),
        );
    }
}
