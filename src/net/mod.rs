//! The guest's network: a virtio-net device whose other end is served here, in the library's
//! process, by a userspace TCP/IP stack acting as the guest's gateway.
//!
//! The VMM helper gets one end of a unix socket pair and hands it to libkrun as the device's
//! backend; the library keeps the other end and runs the network service on it, a tokio task
//! per instance (`service.rs`; the frame codec is `frame.rs`, the gateway `stack.rs`). Nothing
//! crosses the helper's
//! jail but that socket. A definition without a [`Network`] has no device at all.
//!
//! Default deny: the guest gets an address, a route and a resolver, and every flow is refused
//! or dropped unless a [`Policy`] grants it. A granted DNS query is resolved by the host and
//! recorded as the name's trusted answer ([`Flow::hostname`]); a granted connection is dialled
//! by the host (tokio) and relayed. The guest never reaches anything but the gateway.
//!
//! ```no_run
//! # async fn demo() -> krunbox::Result<()> {
//! use krunbox::net::{Flow, Network, Protocol, Resolver, Verdict};
//! use krunbox::{BuiltinImage, Rootfs, Sandbox};
//!
//! // `api.test` is a server on the host's loopback, port 8080.
//! let network = Network::with_policy(|flow: Flow| async move {
//!     match (flow.protocol(), flow.hostname()) {
//!         (Protocol::Dns, Some("api.test")) => {
//!             Verdict::resolve(Resolver::fixed(["127.0.0.1".parse().unwrap()]))
//!         }
//!         (Protocol::Tcp, Some("api.test")) if flow.destination().port() == 8080 => {
//!             Verdict::accept()
//!         }
//!         _ => Verdict::deny(),
//!     }
//! });
//! let sandbox = Sandbox::builder()
//!     .rootfs(Rootfs::builtin(BuiltinImage::Agent))
//!     .network(network)
//!     .build()?;
//! let vm = sandbox.boot().await?;
//! let out = vm.command("curl").args(["-s", "http://api.test:8080/"]).output().await?;
//! # Ok(()) }
//! ```

pub mod address;
mod audit;
pub(crate) mod dns;
pub(crate) mod dns_stream;
pub(crate) mod frame;
mod intercept;
pub(crate) use intercept::ca::SavedCa;

/// The sandbox CA a snapshot kept (see [`SavedCa`]).
pub(crate) fn intercept_ca_from_saved(
    saved: &SavedCa,
) -> crate::Result<intercept::ca::CertificateAuthority> {
    intercept::ca::CertificateAuthority::from_saved(saved)
}
mod names;
mod policy;
mod relay;
mod rules;
mod secrets;
pub(crate) mod service;
pub(crate) mod stack;

use std::net::Ipv4Addr;
use std::sync::Arc;

pub use ::http::{uri::Scheme, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
pub use address::{classify, AddressClass};
pub use audit::{NetworkEvent, Outcome, RequestOutcome};
pub(crate) use intercept::ca::CertificateAuthority;
pub use intercept::{
    Answer, Intercept, Middleware, MiddlewareFuture, RequestHead, UpstreamTrust,
    MIDDLEWARE_DEADLINE,
};

/// Re-exported so that [`Middleware`] implementations can write `#[async_trait]` without
/// depending on the crate themselves.
pub use async_trait::async_trait;
pub use policy::{Decide, Flow, Policy, Protocol, Resolver, Verdict};
pub use rules::{Action, Cidr, DomainPattern, Ports, Rule, RuleError, Rules, Target};
pub use secrets::Secret;

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
#[derive(Clone)]
pub struct Network {
    addressing: Addressing,
    /// `None`: deny all.
    policy: Option<Arc<dyn Policy>>,
    upstream_trust: UpstreamTrust,
    secrets: Vec<Secret>,
    published: Vec<Published>,
}

/// A guest TCP port made reachable on the host's loopback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Published {
    pub guest_port: u16,
    /// `0`: any free port.
    pub host_port: u16,
}

impl std::fmt::Debug for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Network")
            .field("addressing", &self.addressing)
            .field("policy", &self.policy.as_ref().map(|_| "callback"))
            .field("upstream_trust", &self.upstream_trust)
            .field("secrets", &self.secrets)
            .field("published", &self.published)
            .finish()
    }
}

/// Two networks are equal when they have the same addressing and the same policy object (a
/// callback is compared by identity: clones of one `Network` are equal).
impl PartialEq for Network {
    fn eq(&self, other: &Self) -> bool {
        self.addressing == other.addressing
            && self.upstream_trust == other.upstream_trust
            && self.secrets == other.secrets
            && self.published == other.published
            && match (&self.policy, &other.policy) {
                (None, None) => true,
                (Some(a), Some(b)) => std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b)),
                _ => false,
            }
    }
}

impl Eq for Network {}

impl Network {
    /// A network on which the guest reaches nothing.
    ///
    /// ```
    /// assert!(krunbox::Network::deny_all().is_deny_all());
    /// ```
    pub fn deny_all() -> Self {
        Self {
            addressing: Addressing::default(),
            policy: None,
            upstream_trust: UpstreamTrust::system(),
            secrets: Vec::new(),
            published: Vec::new(),
        }
    }

    /// A network on which `policy` decides each new flow: every DNS query, every TCP
    /// connection and UDP flow the guest starts (see [`Policy`]). ICMP and IPv6 stay blocked.
    ///
    /// ```
    /// use krunbox::net::{Flow, Network, Verdict};
    /// let network = Network::with_policy(|flow: Flow| async move {
    ///     if flow.upstream_class().is_public() { Verdict::accept() } else { Verdict::deny() }
    /// });
    /// assert!(!network.is_deny_all());
    /// ```
    pub fn with_policy(policy: impl Policy) -> Self {
        Self {
            addressing: Addressing::default(),
            policy: Some(Arc::new(policy)),
            upstream_trust: UpstreamTrust::system(),
            secrets: Vec::new(),
            published: Vec::new(),
        }
    }

    /// The roots that upstream certificates of intercepted HTTPS flows are verified against
    /// (see [`Verdict::intercept`]). The default is the host's trust store.
    ///
    /// ```
    /// # fn f(private_ca_pem: &[u8]) -> krunbox::Result<()> {
    /// use krunbox::net::{Network, UpstreamTrust, Verdict};
    /// let network = Network::with_policy(|_| async { Verdict::deny() })
    ///     .upstream_trust(UpstreamTrust::pem(private_ca_pem)?);
    /// # Ok(()) }
    /// ```
    pub fn upstream_trust(mut self, trust: UpstreamTrust) -> Self {
        self.upstream_trust = trust;
        self
    }

    /// Adds a secret: the guest's commands see its placeholder in the secret's variable, and
    /// intercepted requests to the hosts it is bound to carry the real value instead (see
    /// [`Secret`]). A secret with the same variable as an earlier one replaces it.
    ///
    /// ```
    /// use krunbox::net::{Network, Secret, Verdict};
    /// let network = Network::with_policy(|_| async { Verdict::deny() })
    ///     .secret(Secret::new("GITHUB_TOKEN", "ghp_real")?.bind_to("api.github.com"));
    /// # Ok::<(), krunbox::Error>(())
    /// ```
    pub fn secret(mut self, secret: Secret) -> Self {
        self.secrets.retain(|s| s.env_var() != secret.env_var());
        self.secrets.push(secret);
        self
    }

    /// Makes the guest's TCP `guest_port` reachable from the host at `127.0.0.1:host_port`
    /// (`0`: a free port, see [`Instance::published_address`](crate::Instance::published_address)).
    /// Each connection to it becomes a connection from the gateway to the guest's port; the
    /// policy is not asked (this grant is the caller's own). Only the host's loopback listens:
    /// nothing off the host reaches the guest. Publishing the same guest port again replaces
    /// the earlier entry; a host port that is taken fails the boot with
    /// [`Error::NetworkSetup`](crate::Error::NetworkSetup).
    ///
    /// ```no_run
    /// # async fn demo() -> krunbox::Result<()> {
    /// use krunbox::{BuiltinImage, Network, Rootfs, Sandbox};
    ///
    /// let vm = Sandbox::builder()
    ///     .rootfs(Rootfs::builtin(BuiltinImage::Agent))
    ///     .network(Network::deny_all().publish(8000, 0))
    ///     .build()?
    ///     .boot()
    ///     .await?;
    /// let _server = vm.command("python3").args(["-m", "http.server", "8000"]).spawn().await?;
    /// let address = vm.published_address(8000).unwrap(); // 127.0.0.1:<a free port>
    /// # Ok(()) }
    /// ```
    pub fn publish(mut self, guest_port: u16, host_port: u16) -> Self {
        self.published.retain(|p| p.guest_port != guest_port);
        self.published.push(Published {
            guest_port,
            host_port,
        });
        self
    }

    pub(crate) fn published(&self) -> &[Published] {
        &self.published
    }

    pub(crate) fn secrets(&self) -> &[Secret] {
        &self.secrets
    }

    /// This network with each secret whose variable `placeholders` names given that
    /// placeholder: a restored guest's environment holds its source's placeholders, which its
    /// new network service must swap for the secrets.
    pub(crate) fn with_placeholders(&self, placeholders: &[(String, String)]) -> Network {
        let mut network = self.clone();
        for secret in &mut network.secrets {
            if let Some((_, placeholder)) = placeholders
                .iter()
                .find(|(env_var, _)| env_var == secret.env_var())
            {
                *secret = secret.clone().with_placeholder(placeholder);
            }
        }
        network
    }

    pub(crate) fn upstream_trust_roots(&self) -> &UpstreamTrust {
        &self.upstream_trust
    }

    pub(crate) fn policy(&self) -> Option<Arc<dyn Policy>> {
        self.policy.clone()
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

    /// What guest-init needs to configure the interface, and the sandbox CA it installs in
    /// the guest's trust store (if this network has one: a deny-all network intercepts
    /// nothing).
    pub(crate) fn guest_config(
        &self,
        authority: Option<&intercept::ca::CertificateAuthority>,
    ) -> crate::protocol::GuestNetwork {
        let a = &self.addressing;
        crate::protocol::GuestNetwork {
            mac: a.guest_mac,
            address: a.guest.octets(),
            prefix_len: a.prefix_len,
            gateway: a.gateway.octets(),
            nameservers: vec![a.dns.octets()],
            ca_certificate: authority.map(|ca| ca.certificate_pem().to_owned()),
            environment: self
                .secrets
                .iter()
                .map(|s| (s.env_var().to_owned(), s.placeholder().to_owned()))
                .collect(),
        }
    }

    /// The sandbox CA for one boot of this network: `None` for a deny-all network. Checks
    /// first that the network can be given to a guest (its secrets fit what guest-init
    /// takes), so a bad definition fails before any VM starts.
    pub(crate) fn certificate_authority(
        &self,
        sandbox: &str,
    ) -> crate::Result<Option<Arc<intercept::ca::CertificateAuthority>>> {
        if self.secrets.len() > crate::protocol::ENVIRONMENT_MAX {
            return Err(crate::Error::InvalidConfig(format!(
                "{} secrets; a network takes at most {}",
                self.secrets.len(),
                crate::protocol::ENVIRONMENT_MAX
            )));
        }
        if self.is_deny_all() {
            return Ok(None);
        }
        intercept::ca::CertificateAuthority::generate(sandbox).map(|ca| Some(Arc::new(ca)))
    }

    /// Whether this network has no policy, so lets nothing through.
    ///
    /// ```
    /// assert!(krunbox::Network::deny_all().is_deny_all());
    /// ```
    pub fn is_deny_all(&self) -> bool {
        self.policy.is_none()
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
/// advancing. A cut byte of [`fuzz_ops::FIRST`] or more is instead an op of a well-formed guest
/// ([`fuzz_ops`]): a TCP segment with valid checksums and, for an ACK, RST or data, sequence
/// numbers the gateway accepts, or a jump in time past its timers, which random bytes would
/// almost never reach. The service's part is played without I/O: new connections and UDP flows
/// are accepted or refused by their port's parity, accepted ones echo what the guest sends (UDP
/// flows are forgotten in batches), DNS datagrams are parsed and answered. Checks that nothing
/// panics, that the gateway's output stays within its bound and decodes into frames of at most
/// [`frame::MAX_FRAME`] bytes, that its connections stay within theirs, and that every
/// connection owns a socket of its own ([`stack::Gateway::check_invariants`]).
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn fuzz_link(data: &[u8]) {
    let mut gateway = stack::Gateway::new(Addressing::default(), smoltcp::time::Instant::ZERO);
    let mut decoder = frame::FrameDecoder::new();
    let mut guest = fuzz_ops::Guest::default();
    let mut open: Vec<stack::FlowKey> = Vec::new();
    let mut udp_open: Vec<stack::FlowKey> = Vec::new();
    let mut rest = data;
    let mut millis = 0;
    while let Some((&cut, tail)) = rest.split_first() {
        if cut >= fuzz_ops::FIRST {
            let (args, tail) = tail.split_at(2.min(tail.len()));
            rest = tail;
            let (a, b) = (
                args.first().copied().unwrap_or(0),
                args.get(1).copied().unwrap_or(0),
            );
            match guest.op(cut - fuzz_ops::FIRST, a, b) {
                fuzz_ops::Step::Frame(frame) => {
                    let _ = gateway.receive(frame);
                }
                fuzz_ops::Step::Wait(seconds) => millis += i64::from(seconds) * 1000,
            }
        } else {
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
        }
        let now = smoltcp::time::Instant::from_millis(millis);
        gateway.poll(now);
        gateway.check_invariants();
        for key in gateway.take_new_flows() {
            if key.destination.port() % 2 == 0 && gateway.accept_tcp(key) {
                open.push(key);
            } else {
                gateway.refuse_tcp(key);
            }
        }
        assert!(open.len() <= stack::MAX_CONNECTIONS);
        for key in gateway.take_new_udp_flows() {
            if key.destination.port() % 2 == 0 && gateway.accept_udp(key) {
                udp_open.push(key);
            } else {
                gateway.refuse_udp(key);
            }
        }
        assert!(udp_open.len() <= stack::MAX_UDP_FLOWS);
        for (key, datagram) in gateway.take_udp_datagrams() {
            gateway.send_udp(&key, &datagram);
        }
        if udp_open.len() > 8 {
            for key in udp_open.drain(..4) {
                gateway.remove_udp(&key);
            }
        }
        for (bytes, from) in gateway.take_dns_queries() {
            match dns::incoming(&bytes) {
                dns::Incoming::Query(query) => {
                    let answer = if query.name.len() % 2 == 0 {
                        query.answer(Ipv4Addr::new(198, 18, 0, 1), 60)
                    } else {
                        query.fail(hickory_proto::op::ResponseCode::Refused)
                    };
                    assert!(answer.as_ref().is_some_and(|a| a.len() <= dns::UDP_MAX));
                    gateway.send_dns(from, &answer.unwrap());
                }
                dns::Incoming::Answer(answer) => gateway.send_dns(from, &answer),
                dns::Incoming::Ignore => {}
            }
        }
        // The service's pump: echo, and forget what is over.
        open.retain(|key| {
            let Some(socket) = gateway.tcp(key) else {
                return false;
            };
            let mut echo = [0u8; 2048];
            if let Ok(n) = socket.recv_slice(&mut echo) {
                let _ = socket.send_slice(&echo[..n]);
            }
            let done = matches!(
                socket.state(),
                smoltcp::socket::tcp::State::Closed | smoltcp::socket::tcp::State::TimeWait
            );
            if done {
                gateway.remove_tcp(key);
            }
            !done
        });
        gateway.poll(now);
        gateway.check_invariants();
        let out = std::mem::take(gateway.output());
        assert!(out.len() <= stack::OUTPUT_MAX);
        let mut sent = frame::FrameDecoder::new();
        let mut input = &out[..];
        while let Some(item) = sent.decode(&mut input) {
            let frame = item.expect("the gateway sends only well-formed frames");
            assert!(frame.len() <= frame::MAX_FRAME);
            guest.saw(&frame);
        }
        sent.finish().expect("the gateway sends whole frames");
    }
}

/// The well-formed guest of [`fuzz_link`]: TCP segments from a few guest ports to a few
/// destinations, with valid checksums and the sequence numbers a real guest would use, so
/// that inputs reach every state of a connection (and a reset in each), not only the gate.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) mod fuzz_ops {
    use std::collections::HashMap;
    use std::net::Ipv4Addr;

    use smoltcp::phy::ChecksumCapabilities;
    use smoltcp::wire::{
        EthernetAddress, EthernetFrame, EthernetProtocol, EthernetRepr, IpProtocol, Ipv4Packet,
        Ipv4Repr, TcpControl, TcpPacket, TcpRepr, TcpSeqNumber,
    };

    use super::Addressing;

    /// The first cut byte that is an op.
    pub(crate) const FIRST: u8 = 0xf0;

    /// What an op does.
    pub(crate) enum Step {
        /// A frame from the guest.
        Frame(Vec<u8>),
        /// Time passes, in seconds (the gateway's timers are tens of seconds).
        Wait(u8),
    }

    /// The ops, by `cut - FIRST`.
    pub(crate) const SYN: u8 = 0;
    pub(crate) const ACK: u8 = 1;
    pub(crate) const RST: u8 = 2;
    pub(crate) const FIN: u8 = 3;
    pub(crate) const DATA: u8 = 4;
    pub(crate) const BAD_CHECKSUM_SYN: u8 = 5;
    pub(crate) const SYN_RST: u8 = 6;
    pub(crate) const WAIT: u8 = 7;

    /// The destinations, by index: even ports are accepted by the harness, odd refused.
    const DESTINATIONS: [(Ipv4Addr, u16); 4] = [
        (Ipv4Addr::new(192, 0, 2, 1), 80),
        (Ipv4Addr::new(192, 0, 2, 1), 8080),
        (Ipv4Addr::new(192, 0, 2, 2), 80),
        (Ipv4Addr::new(192, 0, 2, 1), 81),
    ];

    /// A connection as the guest knows it: its next sequence number, and the next it expects.
    #[derive(Default, Clone, Copy)]
    struct Flow {
        seq: u32,
        ack: Option<u32>,
    }

    /// The guest's side of its connections.
    #[derive(Default)]
    pub(crate) struct Guest {
        flows: HashMap<(u16, (Ipv4Addr, u16)), Flow>,
    }

    impl Guest {
        /// The frame (or wait) op `op` makes, from guest port `a` (one of 8) to destination
        /// `b` (one of [`DESTINATIONS`]); `b` is the seconds of a wait, or a data length.
        pub(crate) fn op(&mut self, op: u8, a: u8, b: u8) -> Step {
            let port = 40000 + u16::from(a & 7);
            let destination = DESTINATIONS[usize::from(b & 3)];
            let flow = self.flows.entry((port, destination)).or_default();
            let (control, payload_len, checksum_ok) = match op {
                SYN => {
                    // A new connection: a fresh sequence number, as after a close.
                    *flow = Flow {
                        seq: u32::from(a) << 20 | 1000,
                        ack: None,
                    };
                    (TcpControl::Syn, 0, true)
                }
                ACK => (TcpControl::None, 0, true),
                RST => (TcpControl::Rst, 0, true),
                FIN => (TcpControl::Fin, 0, true),
                DATA => (TcpControl::Psh, usize::from(b >> 2) * 8 + 1, true),
                BAD_CHECKSUM_SYN => (TcpControl::Syn, 0, false),
                SYN_RST => {
                    return Step::Frame(Self::raw_syn_rst(port, destination, flow.seq));
                }
                WAIT => return Step::Wait(b),
                _ => return Step::Wait(1),
            };
            let payload = vec![b'x'; payload_len];
            let repr = TcpRepr {
                src_port: port,
                dst_port: destination.1,
                control,
                seq_number: TcpSeqNumber(flow.seq as i32),
                ack_number: flow.ack.map(|a| TcpSeqNumber(a as i32)),
                window_len: 64240,
                window_scale: None,
                max_seg_size: (control == TcpControl::Syn).then_some(1460),
                sack_permitted: false,
                sack_ranges: [None; 3],
                timestamp: None,
                payload: &payload,
            };
            let advance = payload_len as u32
                + u32::from(matches!(control, TcpControl::Syn | TcpControl::Fin));
            flow.seq = flow.seq.wrapping_add(advance);
            Step::Frame(segment(&repr, destination.0, checksum_ok))
        }

        /// What the gateway sent: a SYN-ACK or a segment with data or FIN tells the guest what
        /// to acknowledge next.
        pub(crate) fn saw(&mut self, frame: &[u8]) {
            let Ok(eth) = EthernetFrame::new_checked(frame) else {
                return;
            };
            let Ok(ip) = Ipv4Packet::new_checked(eth.payload()) else {
                return;
            };
            let Ok(tcp) = TcpPacket::new_checked(ip.payload()) else {
                return;
            };
            let key = (tcp.dst_port(), (ip.src_addr(), tcp.src_port()));
            let Some(flow) = self.flows.get_mut(&key) else {
                return;
            };
            if tcp.rst() {
                flow.ack = None;
                return;
            }
            let data = ip
                .payload()
                .len()
                .saturating_sub(usize::from(tcp.header_len())) as u32;
            let end = (tcp.seq_number().0 as u32)
                .wrapping_add(data)
                .wrapping_add(u32::from(tcp.syn()) + u32::from(tcp.fin()));
            flow.ack = Some(end);
        }

        /// A SYN with RST set too, checksums valid: a frame `TcpRepr` cannot express.
        fn raw_syn_rst(port: u16, destination: (Ipv4Addr, u16), seq: u32) -> Vec<u8> {
            let repr = TcpRepr {
                src_port: port,
                dst_port: destination.1,
                control: TcpControl::Syn,
                seq_number: TcpSeqNumber(seq as i32),
                ack_number: None,
                window_len: 64240,
                window_scale: None,
                max_seg_size: None,
                sack_permitted: false,
                sack_ranges: [None; 3],
                timestamp: None,
                payload: &[],
            };
            let mut frame = segment(&repr, destination.0, true);
            // Set RST beside SYN and fill in the checksum again.
            let guest = Addressing::default().guest;
            let mut eth = EthernetFrame::new_unchecked(&mut frame[..]);
            let mut ip = Ipv4Packet::new_unchecked(eth.payload_mut());
            let mut tcp = TcpPacket::new_unchecked(ip.payload_mut());
            tcp.set_rst(true);
            tcp.fill_checksum(&guest.into(), &destination.0.into());
            frame
        }
    }

    /// `repr` from the guest to `to`, framed for the link; its TCP checksum broken unless
    /// `checksum_ok`.
    fn segment(repr: &TcpRepr<'_>, to: Ipv4Addr, checksum_ok: bool) -> Vec<u8> {
        let addressing = Addressing::default();
        let checksums = ChecksumCapabilities::default();
        let ip_repr = Ipv4Repr {
            src_addr: addressing.guest,
            dst_addr: to,
            next_header: IpProtocol::Tcp,
            payload_len: repr.buffer_len(),
            hop_limit: 64,
        };
        let eth_repr = EthernetRepr {
            src_addr: EthernetAddress(addressing.guest_mac),
            dst_addr: EthernetAddress(addressing.gateway_mac),
            ethertype: EthernetProtocol::Ipv4,
        };
        let mut buf = vec![0u8; eth_repr.buffer_len() + ip_repr.buffer_len() + repr.buffer_len()];
        let mut eth = EthernetFrame::new_unchecked(&mut buf[..]);
        eth_repr.emit(&mut eth);
        let mut ip = Ipv4Packet::new_unchecked(eth.payload_mut());
        ip_repr.emit(&mut ip, &checksums);
        let mut tcp = TcpPacket::new_unchecked(ip.payload_mut());
        repr.emit(&mut tcp, &addressing.guest.into(), &to.into(), &checksums);
        if !checksum_ok {
            let sum = tcp.checksum();
            tcp.set_checksum(sum ^ 0x5a5a);
        }
        buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restored_guests_placeholders_replace_those_its_new_network_made() {
        let network = Network::deny_all()
            .secret(Secret::new("API_KEY", "real").unwrap().bind_to("a.test"))
            .secret(Secret::new("OTHER", "kept").unwrap());
        let other = network.secrets()[1].placeholder().to_owned();
        let restored = network.with_placeholders(&[
            ("API_KEY".into(), "krunbox-secret-from-the-source".into()),
            ("GONE".into(), "krunbox-secret-nobody".into()),
        ]);
        let secrets = restored.secrets();
        assert_eq!(secrets[0].placeholder(), "krunbox-secret-from-the-source");
        assert_eq!(secrets[0].env_var(), "API_KEY");
        assert_eq!(secrets[1].placeholder(), other, "not named: its own");
        assert_eq!(secrets.len(), 2);
    }

    /// The fuzz property on a replayable sample: random streams with plausible lengths, and a
    /// stream of well-formed frames (ARP for the gateway, then SYNs to every port) cut finely.
    #[test]
    fn the_link_fuzz_property_holds_on_random_and_well_formed_streams() {
        let mut next = crate::fuzzing::xorshift(0x2545_f491_4f6c_dd1d);
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
