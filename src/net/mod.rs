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

/// The fuzz entry point over what the guest controls on its link (see
/// [`crate::fuzzing::net_link`]): `data` is the byte stream libkrun would write, cut into reads
/// at lengths taken from its own bytes, fed through the frame decoder into the gateway with time
/// advancing. Checks that nothing panics, that the gateway's output stays within its bound and
/// decodes into frames of at most [`frame::MAX_FRAME`] bytes.
pub(crate) fn fuzz_link(data: &[u8]) {
    let mut gateway = stack::Gateway::new(Addressing::default(), smoltcp::time::Instant::ZERO);
    let mut decoder = frame::FrameDecoder::new();
    let mut rest = data;
    let mut millis = 0;
    while let Some((&cut, tail)) = rest.split_first() {
        let (chunk, tail) = tail.split_at((cut as usize * 16).min(tail.len()));
        rest = tail;
        let mut input = chunk;
        while let Some(item) = decoder.decode(&mut input) {
            if let Ok(frame) = item {
                assert!(frame.len() <= frame::MAX_FRAME);
                let _ = gateway.receive(frame);
            }
            if !gateway.has_room() {
                gateway.poll(smoltcp::time::Instant::from_millis(millis));
            }
        }
        millis += i64::from(cut);
        gateway.poll(smoltcp::time::Instant::from_millis(millis));
        let out = std::mem::take(gateway.output());
        assert!(out.len() <= stack::OUTPUT_MAX);
        let mut sent = frame::FrameDecoder::new();
        let mut input = &out[..];
        while let Some(item) = sent.decode(&mut input) {
            let frame = item.expect("the gateway sends only well-formed frames");
            assert!(frame.len() <= frame::MAX_FRAME);
        }
        sent.finish().expect("the gateway sends whole frames");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fuzz property on a replayable sample: random streams with plausible lengths, and a
    /// stream of well-formed frames (ARP for the gateway, then SYNs to every port) cut finely.
    #[test]
    fn the_link_fuzz_property_holds_on_random_and_well_formed_streams() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..100 {
            let mut bytes: Vec<u8> = (0..(next() % 20_000)).map(|_| next() as u8).collect();
            for i in (0..bytes.len().saturating_sub(6)).step_by(211) {
                let len = 14 + (next() % 1500) as u32;
                bytes[i + 1..i + 5].copy_from_slice(&len.to_be_bytes());
            }
            fuzz_link(&bytes);
        }
        let a = Addressing::default();
        let mut arp = Vec::new();
        arp.extend_from_slice(&[0xff; 6]);
        arp.extend_from_slice(&a.guest_mac);
        arp.extend_from_slice(&[0x08, 0x06, 0, 1, 8, 0, 6, 4, 0, 1]);
        arp.extend_from_slice(&a.guest_mac);
        arp.extend_from_slice(&a.guest.octets());
        arp.extend_from_slice(&[0; 6]);
        arp.extend_from_slice(&a.gateway.octets());
        let mut stream = Vec::new();
        for _ in 0..200 {
            stream.push(3); // each read: 48 bytes
            let mut framed = Vec::new();
            frame::encode(&arp, &mut framed).unwrap();
            stream.extend(framed.iter().take(48));
        }
        fuzz_link(&stream);
    }
}
