//! The guest's network interface, configured from the host's `Setup`: the address and the
//! default route with the classic `SIOC*` ioctls (no netlink library, nothing to add to a
//! static binary), loopback up, and `/etc/resolv.conf` bind-mounted over the read-only image.

use std::io;
use std::net::Ipv4Addr;

use krunbox_protocol::GuestNetwork;

use crate::sys::{c, check, mount};

/// `struct rtentry` from `<net/route.h>` (declared here: the libc crate has it for musl only,
/// and guest-init's tests build for the host's libc too).
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

/// Configures the interface with `network.mac`, brings up loopback, adds the default route
/// and the resolver file. Returns the interface's name.
pub fn configure(network: &GuestNetwork) -> io::Result<String> {
    let name = interface_with_mac(&network.mac)?;
    let socket = Socket::new()?;
    socket.set_up("lo")?;
    socket.set_address(&name, libc::SIOCSIFADDR, Ipv4Addr::from(network.address))?;
    let mask = u32::MAX << (32 - u32::from(network.prefix_len.clamp(1, 32)));
    socket.set_address(&name, libc::SIOCSIFNETMASK, Ipv4Addr::from(mask))?;
    socket.set_up(&name)?;
    socket.add_default_route(Ipv4Addr::from(network.gateway))?;
    write_resolv_conf(&network.nameservers)?;
    let _ = ENVIRONMENT.set(network.environment.clone());
    Ok(name)
}

/// Brings up loopback (with or without a network device: programs talk to themselves over it).
pub fn loopback_up() -> io::Result<()> {
    Socket::new()?.set_up("lo")
}

/// Variables every command gets unless it sets them (the host's secret placeholders).
static ENVIRONMENT: std::sync::OnceLock<Vec<(String, String)>> = std::sync::OnceLock::new();

/// Environment variables for the commands that do not set them themselves: the host's
/// (secret placeholders), and those that point TLS clients at the bundle holding the sandbox
/// CA (`trust.rs`): OpenSSL (Python's `ssl`, ...), curl, git, requests and pip, Node.
pub fn environment() -> Vec<(&'static str, &'static str)> {
    let mut variables: Vec<(&'static str, &'static str)> = ENVIRONMENT
        .get()
        .map(|vars| vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect())
        .unwrap_or_default();
    let Some(bundle) = crate::trust::bundle() else {
        return variables;
    };
    variables.extend(
        [
            "SSL_CERT_FILE",
            "CURL_CA_BUNDLE",
            "GIT_SSL_CAINFO",
            "REQUESTS_CA_BUNDLE",
            "PIP_CERT",
            "NODE_EXTRA_CA_CERTS",
        ]
        .into_iter()
        .map(|name| (name, bundle)),
    );
    variables
}

/// The interface whose `/sys/class/net/NAME/address` is `mac`.
fn interface_with_mac(mac: &[u8; 6]) -> io::Result<String> {
    let wanted = mac
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":");
    for entry in std::fs::read_dir("/sys/class/net")? {
        let entry = entry?;
        let address = std::fs::read_to_string(entry.path().join("address")).unwrap_or_default();
        if address.trim() == wanted {
            return Ok(entry.file_name().to_string_lossy().into_owned());
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("no network interface has MAC {wanted}"),
    ))
}

struct Socket(libc::c_int);

impl Drop for Socket {
    fn drop(&mut self) {
        // SAFETY: closing the descriptor this value owns.
        unsafe { libc::close(self.0) };
    }
}

fn sockaddr_in(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size (16 bytes) on Linux.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

impl Socket {
    fn new() -> io::Result<Self> {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        check("socket", fd).map(Socket)
    }

    fn ifreq(name: &str) -> io::Result<libc::ifreq> {
        // SAFETY: ifreq is plain data; all zeroes is a valid value.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        if name.len() >= req.ifr_name.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("interface name {name:?} too long"),
            ));
        }
        for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
            *dst = src as libc::c_char;
        }
        Ok(req)
    }

    fn set_address(&self, name: &str, request: libc::c_ulong, addr: Ipv4Addr) -> io::Result<()> {
        let mut req = Self::ifreq(name)?;
        req.ifr_ifru.ifru_addr = sockaddr_in(addr);
        // SAFETY: a valid ifreq for this request, alive for the call.
        let ret = unsafe { libc::ioctl(self.0, request as _, &mut req) };
        check(&format!("setting {addr} on {name}"), ret).map(drop)
    }

    fn set_up(&self, name: &str) -> io::Result<()> {
        let mut req = Self::ifreq(name)?;
        // SAFETY: valid ifreq for SIOCGIFFLAGS/SIOCSIFFLAGS; the flags member is the one read.
        unsafe {
            check(
                &format!("reading {name}'s flags"),
                libc::ioctl(self.0, libc::SIOCGIFFLAGS as _, &mut req),
            )?;
            req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            check(
                &format!("bringing {name} up"),
                libc::ioctl(self.0, libc::SIOCSIFFLAGS as _, &mut req),
            )?;
        }
        Ok(())
    }

    fn add_default_route(&self, gateway: Ipv4Addr) -> io::Result<()> {
        let mut route = RtEntry {
            rt_pad1: 0,
            rt_dst: sockaddr_in(Ipv4Addr::UNSPECIFIED),
            rt_gateway: sockaddr_in(gateway),
            rt_genmask: sockaddr_in(Ipv4Addr::UNSPECIFIED),
            rt_flags: libc::RTF_UP | libc::RTF_GATEWAY,
            rt_pad2: 0,
            rt_pad3: 0,
            rt_pad4: std::ptr::null_mut(),
            rt_metric: 0,
            rt_dev: std::ptr::null_mut(),
            rt_mtu: 0,
            rt_window: 0,
            rt_irtt: 0,
        };
        // SAFETY: a valid rtentry for SIOCADDRT, alive for the call; no device name pointer.
        let ret = unsafe { libc::ioctl(self.0, libc::SIOCADDRT as _, &mut route) };
        check(&format!("adding the default route via {gateway}"), ret).map(drop)
    }
}

/// The image is read-only, so the resolver file is written on the scratch tmpfs, bind-mounted
/// (read-only) over `/etc/resolv.conf`, and its scratch name removed: nothing in the guest can
/// name it but `/etc/resolv.conf`. Needs an image with `/etc/resolv.conf` (both built-in images
/// have an empty one); without it the interface still works and the console says why.
fn write_resolv_conf(nameservers: &[[u8; 4]]) -> io::Result<()> {
    const TARGET: &str = "/etc/resolv.conf";
    const SCRATCH: &str = "/tmp/.krunbox-resolv.conf";
    if !std::path::Path::new(TARGET).is_file() {
        eprintln!("guest-init: the image has no {TARGET}: no resolver configured");
        return Ok(());
    }
    let mut text = String::new();
    for ns in nameservers {
        text.push_str(&format!("nameserver {}\n", Ipv4Addr::from(*ns)));
    }
    std::fs::write(SCRATCH, text)?;
    let result = mount(SCRATCH, TARGET, None, libc::MS_BIND, None).and_then(|()| {
        mount(
            "none",
            TARGET,
            None,
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
            None,
        )
    });
    let scratch = c(SCRATCH)?;
    // SAFETY: a valid C string; the bind mount keeps the file itself alive.
    unsafe { libc::unlink(scratch.as_ptr()) };
    result
}
