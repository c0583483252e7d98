//! The guest's network: a virtio-net device whose other end is served here, in the library's
//! process, by a userspace TCP/IP stack acting as the guest's gateway.
//!
//! The VMM helper gets one end of a unix socket pair and hands it to libkrun as the device's
//! backend; the library keeps the other end and runs [`service`] on it, a tokio task per
//! instance (the frame codec is [`frame`], the gateway [`stack`]). Nothing crosses the helper's
//! jail but that socket. A definition without a [`Network`] has no device at all.
//!
//! This slice is default deny: the guest gets an address, a route and a resolver, and every
//! flow is refused or dropped (see [`stack`] for each protocol). Nothing is forwarded and no
//! upstream connection is ever made.

pub(crate) mod frame;
pub(crate) mod service;
pub(crate) mod stack;

use std::net::Ipv4Addr;

/// A sandbox's network: the guest gets a network device (`eth0`) with an address, a default
/// route and a resolver, all pointing at a gateway the library serves, and the gateway decides
/// what the guest reaches. Given to [`SandboxBuilder::network`](crate::SandboxBuilder::network);
/// without it the guest has no network device at all.
///
/// [`Network::deny_all`] reaches nothing: TCP connections are refused at once (a reset from the
/// address dialled), DNS queries are answered `REFUSED`, other UDP, ICMP (ping) and IPv6 get no
/// answer. Nothing leaves the host.
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::{BuiltinImage, Network, Rootfs, Sandbox};
///
/// let sandbox = Sandbox::builder()
///     .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
///     .network(Network::deny_all())
///     .build()?;
/// let vm = sandbox.boot().await?;
/// let out = vm.command("nc").args(["10.0.2.2", "80"]).output().await?;
/// assert!(!out.status.success()); // connection refused
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Network {
    addressing: Addressing,
    policy: Policy,
}

/// What the gateway lets through. Later: a per-flow callback, grants, declarative rules.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Policy {
    /// Every flow refused or dropped.
    DenyAll,
}

impl Network {
    /// A network on which the guest reaches nothing.
    pub fn deny_all() -> Self {
        Self {
            addressing: Addressing::default(),
            policy: Policy::DenyAll,
        }
    }

    /// The guest's IPv4 address (`10.0.2.15`, on a `/24`).
    pub fn guest_address(&self) -> Ipv4Addr {
        self.addressing.guest
    }

    /// The gateway's address (`10.0.2.2`): the guest's default route and its DNS server.
    pub fn gateway_address(&self) -> Ipv4Addr {
        self.addressing.gateway
    }

    pub(crate) fn addressing(&self) -> &Addressing {
        &self.addressing
    }

    /// What guest-init needs to configure the interface.
    pub(crate) fn guest_config(&self) -> crate::protocol::GuestNetwork {
        let a = &self.addressing;
        crate::protocol::GuestNetwork {
            mac: a.guest_mac,
            address: a.guest.octets(),
            prefix_len: a.prefix_len,
            gateway: a.gateway.octets(),
            nameservers: vec![a.dns.octets()],
        }
    }

    /// Whether this network lets anything through (never, in this version).
    pub fn is_deny_all(&self) -> bool {
        matches!(self.policy, Policy::DenyAll)
    }
}

/// The guest's link: addresses and MACs of both ends. Fixed for now, like a user-mode QEMU
/// network; each sandbox has a link of its own, so the same addresses never meet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Addressing {
    pub guest: Ipv4Addr,
    pub gateway: Ipv4Addr,
    pub prefix_len: u8,
    pub dns: Ipv4Addr,
    /// Locally administered unicast addresses (second bit of the first byte set).
    pub guest_mac: [u8; 6],
    pub gateway_mac: [u8; 6],
}

impl Default for Addressing {
    fn default() -> Self {
        Self {
            guest: Ipv4Addr::new(10, 0, 2, 15),
            gateway: Ipv4Addr::new(10, 0, 2, 2),
            prefix_len: 24,
            dns: Ipv4Addr::new(10, 0, 2, 2),
            guest_mac: [0x02, 0x6b, 0x62, 0x00, 0x02, 0x0f],
            gateway_mac: [0x02, 0x6b, 0x62, 0x00, 0x02, 0x02],
        }
    }
}
