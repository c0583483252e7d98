//! The guest's gateway: a smoltcp interface on the guest's link, with a gate in front of it
//! that decides which frames reach it at all, and the DNS socket on the gateway's address.
//!
//! No I/O and no policy here: frames go in with [`Gateway::receive`], [`Gateway::poll`] runs
//! the stack at a given time, and what the gateway sends to the guest collects, already framed
//! for the stream, in [`Gateway::output`]. New flows come out as events for the service
//! (`service.rs`), which asks the policy and answers with [`Gateway::accept_tcp`],
//! [`Gateway::refuse_tcp`] and [`Gateway::send_dns`].
//!
//! Per protocol:
//! - **TCP**: a SYN for a new connection (to any address: smoltcp's AnyIP) is *held* and
//!   reported ([`Gateway::take_new_flows`]). Accepted, a socket listening on exactly the
//!   address dialled is made and the SYN is replayed into the stack; refused, the gateway
//!   answers a reset from the address dialled, so the guest's `connect` fails at once with
//!   "connection refused". Segments of no connection reach the stack, which resets them.
//! - **DNS** (UDP to the gateway, port 53) is handed to the service as datagrams
//!   ([`Gateway::take_dns_queries`]).
//! - **Other UDP**: a datagram of a new flow (guest port to destination) is *held* and
//!   reported ([`Gateway::take_new_udp_flows`]). Granted, it goes into the stack to a socket
//!   bound to the destination (one per destination, shared by its flows), and so do the
//!   flow's later datagrams; denied, it is dropped without an answer. Datagrams of a flow
//!   still waiting are dropped, as a network loses them.
//! - **ICMP** (ping included) is dropped without an answer: a gateway that answered pings for
//!   every address would tell the guest the world is up.
//! - **IPv6**, IPv4 fragments and other EtherTypes are dropped; ARP is answered for the
//!   gateway's address only, so the guest's link holds the gateway and nothing else.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddrV4;

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{ChecksumCapabilities, Device, DeviceCapabilities, Medium, RxToken, TxToken};
use smoltcp::socket::{tcp, udp};
use smoltcp::time::{Duration, Instant};
use smoltcp::wire::{
    ArpPacket, ArpRepr, EthernetAddress, EthernetFrame, EthernetProtocol, EthernetRepr,
    HardwareAddress, IpCidr, IpEndpoint, IpProtocol, Ipv4Packet, Ipv4Repr, TcpControl, TcpPacket,
    TcpRepr, TcpSeqNumber, UdpPacket,
};

use super::frame::{self, MAX_FRAME};
use super::Addressing;

/// Frames from the guest waiting for the stack. The service stops reading the socket while
/// this is full, which holds the guest back (its virtio queue fills).
pub(crate) const RX_QUEUE_FRAMES: usize = 64;

/// Bytes of framed output for the guest the gateway holds before it stops producing more
/// (smoltcp then gets no transmit token and holds back; the socket's own buffer comes after).
pub(crate) const OUTPUT_MAX: usize = 256 * 1024;

/// The DNS socket's buffers: queries waiting for an answer, answers waiting for the link.
const DNS_PACKETS: usize = 16;
const DNS_BYTES: usize = 16 * 1024;

/// New connections waiting for the policy. A SYN past it is refused at once.
pub(crate) const MAX_HELD: usize = 256;

/// Connections (held and open) per sandbox. A SYN past it is refused at once.
pub(crate) const MAX_CONNECTIONS: usize = 512;

/// HTTP/2 streams one intercepted connection may have open at once (hyper's default is 200);
/// the guest's client waits for one to end before it opens more.
pub(crate) const INTERCEPT_MAX_STREAMS: u32 = 64;

/// The most bytes of request head an intercepted connection takes: HTTP/1's read buffer (a
/// longer head is answered `431`), HTTP/2's header list (hyper's default is 16 KiB).
pub(crate) const INTERCEPT_MAX_HEADERS: usize = 64 * 1024;

/// Requests of one sandbox's intercepted connections in flight upstream at once, each with an
/// upstream connection of its own (those connections are not counted in [`MAX_CONNECTIONS`]:
/// the host makes them, not the guest). A request past it waits for one to end; one is in
/// flight from its send until the guest has taken its response's body.
pub(crate) const MAX_UPSTREAM_REQUESTS: usize = 64;

/// Idle upstream connections each intercepted connection's client keeps for its next requests,
/// and for how long.
pub(crate) const UPSTREAM_IDLE_PER_CONNECTION: usize = 2;
pub(crate) const UPSTREAM_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// UDP flows (held and open) per sandbox. A datagram of a new flow past it is dropped.
pub(crate) const MAX_UDP_FLOWS: usize = 256;

/// Each UDP destination socket's buffers in the stack, each way: datagrams and bytes.
const UDP_PACKETS: usize = 32;
const UDP_BYTES: usize = 64 * 1024;

/// Each connection's buffers in the stack, each way. With [`MAX_CONNECTIONS`] this bounds
/// the stack's memory at 64 MiB; the window the guest sees is this size.
pub(crate) const TCP_BUFFER: usize = 64 * 1024;

/// A connection whose guest end sends nothing for this long is aborted: smoltcp's timeout,
/// which with [`TCP_KEEP_ALIVE`] covers every state with a peer (a SYN-RECEIVED never
/// acknowledged, a guest that vanished from an established or half-closed connection). A live
/// guest kernel answers keep-alives and window probes, so an idle healthy connection stays.
const TCP_TIMEOUT: Duration = Duration::from_secs(75);

/// How often an idle connection asks the guest whether it is still there.
const TCP_KEEP_ALIVE: Duration = Duration::from_secs(20);

/// How long a connection may stay in FIN-WAIT-2 (the host finished, the guest acknowledged but
/// never finishes its side): Linux's own `tcp_fin_timeout`. A guest's kernel answers the
/// keep-alives of such a connection for ever, so [`TCP_TIMEOUT`] alone never ends it.
const FIN_WAIT_2_TIMEOUT: Duration = Duration::from_secs(60);

/// The ports the gateway's own connections into the guest (to published ports) come from.
const GATEWAY_PORTS: std::ops::Range<u16> = 49152..65535;

/// A TCP connection: the guest's end and the address and port it dialled (for a connection
/// the gateway makes to a published port: the guest's port, and the gateway's end).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct FlowKey {
    pub guest: SocketAddrV4,
    pub destination: SocketAddrV4,
}

/// Why a frame from the guest got nowhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dropped {
    /// Not a well-formed Ethernet/ARP/IPv4/UDP frame.
    Malformed,
    /// ARP for an address other than the gateway's.
    ArpNotForGateway,
    /// A datagram of a UDP flow past [`MAX_UDP_FLOWS`], or of one waiting for the policy
    /// (the first datagram is held; UDP loses the rest as a network would).
    Udp,
    /// A SYN for a connection that is already held or open (a retransmission: the held one
    /// is answered when the policy has decided, an open one by its socket).
    RepeatedSyn,
    /// A SYN past [`MAX_HELD`] or [`MAX_CONNECTIONS`]: answered with a reset.
    TooManyConnections,
    /// ICMP, including pings.
    Icmp,
    /// IPv6.
    Ipv6,
    /// An IPv4 fragment (the guest's MTU makes them unnecessary).
    Fragment,
    /// Another EtherType or IP protocol.
    Other,
    /// The queue to the stack was full.
    QueueFull,
}

/// What happened to the guest's frames, for tests and tracing.
#[derive(Debug, Default, Clone)]
pub(crate) struct Counters {
    pub admitted: u64,
    pub dropped: u64,
    pub tcp_refused: u64,
    pub last_drop: Option<Dropped>,
}

/// A frame from the guest waiting for the stack: for an accepted connection's replayed SYN,
/// whose it is.
struct Queued {
    frame: Vec<u8>,
    syn_of: Option<FlowKey>,
}

/// The smoltcp device: frames from the guest wait in `rx`; frames to it are framed into `out`.
struct Port {
    rx: VecDeque<Queued>,
    out: Vec<u8>,
    /// Accepted connections whose replayed SYN the stack took since the last look.
    offered: Vec<FlowKey>,
}

impl Port {
    /// Whether `out` could not take one more frame within [`OUTPUT_MAX`]. Then the stack gets
    /// no tokens at all, not even to receive (an answer to a received frame needs room too), so
    /// `out` never passes the bound and the guest's frames wait in `rx`.
    fn output_full(&self) -> bool {
        self.out.len() + frame::LENGTH_PREFIX + MAX_FRAME > OUTPUT_MAX
    }
}

struct Rx(Vec<u8>);

impl RxToken for Rx {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(&self.0)
    }
}

struct Tx<'a>(&'a mut Vec<u8>);

impl TxToken for Tx<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut buf = vec![0u8; len];
        let result = f(&mut buf);
        if let Err(err) = frame::encode(&buf, self.0) {
            // The stack's MTU is the link's: this would be a bug, and libkrun must never see it.
            tracing::error!(target: "krunbox::net", "not sending a frame to the guest: {err}");
        }
        result
    }
}

impl Device for Port {
    type RxToken<'a> = Rx;
    type TxToken<'a> = Tx<'a>;

    fn receive(&mut self, _: Instant) -> Option<(Rx, Tx<'_>)> {
        if self.output_full() {
            return None;
        }
        let queued = self.rx.pop_front()?;
        self.offered.extend(queued.syn_of);
        Some((Rx(queued.frame), Tx(&mut self.out)))
    }

    fn transmit(&mut self, _: Instant) -> Option<Tx<'_>> {
        (!self.output_full()).then_some(Tx(&mut self.out))
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = MAX_FRAME;
        caps
    }
}

/// The gateway of one guest.
pub(crate) struct Gateway {
    addressing: Addressing,
    iface: Interface,
    port: Port,
    sockets: SocketSet<'static>,
    dns: SocketHandle,
    /// New connections' SYNs, waiting for a decision.
    held: HashMap<FlowKey, Vec<u8>>,
    /// Connections held since the last [`Gateway::take_new_flows`].
    new_flows: Vec<FlowKey>,
    /// Accepted connections and their sockets: each socket belongs to exactly one.
    open: HashMap<FlowKey, SocketHandle>,
    /// Accepted connections whose replayed SYN the stack has not taken yet: their sockets
    /// listen, rightly.
    awaiting_syn: std::collections::HashSet<FlowKey>,
    /// Connections seen in FIN-WAIT-2, and since when.
    fin_wait_2: HashMap<FlowKey, Instant>,
    /// New UDP flows' first datagrams, waiting for a decision.
    udp_held: HashMap<FlowKey, Vec<u8>>,
    /// UDP flows held since the last [`Gateway::take_new_udp_flows`].
    new_udp_flows: Vec<FlowKey>,
    /// Granted UDP flows.
    udp_open: std::collections::HashSet<FlowKey>,
    /// One socket per UDP destination the guest sends to, shared by the flows to it (a
    /// datagram's source says whose it is), with the number of flows using it.
    udp_sockets: HashMap<SocketAddrV4, (SocketHandle, usize)>,
    /// The next port to try in [`GATEWAY_PORTS`].
    next_gateway_port: u16,
    pub(crate) counters: Counters,
}

/// What the gate makes of a frame it lets in.
enum Admit {
    Stack,
    NewConnection(FlowKey),
    NewUdpFlow(FlowKey),
}

impl Gateway {
    pub(crate) fn new(addressing: Addressing, now: Instant) -> Self {
        let mut port = Port {
            rx: VecDeque::with_capacity(RX_QUEUE_FRAMES),
            out: Vec::new(),
            offered: Vec::new(),
        };
        let mut config = Config::new(HardwareAddress::Ethernet(EthernetAddress(
            addressing.gateway_mac,
        )));
        config.random_seed = rand_seed();
        let mut iface = Interface::new(config, &mut port, now);
        iface.update_ip_addrs(|addrs| {
            addrs
                .push(IpCidr::new(
                    addressing.gateway.into(),
                    addressing.prefix_len,
                ))
                .expect("one address fits");
        });
        // Every destination the guest routes through us reaches the stack, so a connection to
        // any address is refused by us rather than left to time out.
        iface.set_any_ip(true);
        let mut sockets = SocketSet::new(Vec::new());
        let buffer = || {
            udp::PacketBuffer::new(
                vec![udp::PacketMetadata::EMPTY; DNS_PACKETS],
                vec![0u8; DNS_BYTES],
            )
        };
        let mut dns = udp::Socket::new(buffer(), buffer());
        dns.bind((smoltcp::wire::IpAddress::from(addressing.gateway), 53))
            .expect("binding a fresh socket");
        let dns = sockets.add(dns);
        Self {
            addressing,
            iface,
            port,
            sockets,
            dns,
            held: HashMap::new(),
            new_flows: Vec::new(),
            open: HashMap::new(),
            awaiting_syn: std::collections::HashSet::new(),
            fin_wait_2: HashMap::new(),
            udp_held: HashMap::new(),
            new_udp_flows: Vec::new(),
            udp_open: std::collections::HashSet::new(),
            udp_sockets: HashMap::new(),
            next_gateway_port: GATEWAY_PORTS.start,
            counters: Counters::default(),
        }
    }

    /// Whether the queue to the stack has room for another frame.
    pub(crate) fn has_room(&self) -> bool {
        self.port.rx.len() < RX_QUEUE_FRAMES
    }

    /// A frame from the guest: queued for the stack if the gate admits it.
    pub(crate) fn receive(&mut self, frame: Vec<u8>) -> Result<(), Dropped> {
        let verdict = if self.has_room() {
            self.admit(&frame)
        } else {
            Err(Dropped::QueueFull)
        };
        let verdict = match verdict {
            Ok(Admit::NewConnection(_))
                if self.held.len() >= MAX_HELD
                    || self.held.len() + self.open.len() >= MAX_CONNECTIONS =>
            {
                self.reset(&frame);
                Err(Dropped::TooManyConnections)
            }
            other => other,
        };
        match verdict {
            Ok(Admit::Stack) => {
                self.counters.admitted += 1;
                self.port.rx.push_back(Queued {
                    frame,
                    syn_of: None,
                });
                Ok(())
            }
            Ok(Admit::NewConnection(key)) => {
                self.counters.admitted += 1;
                self.held.insert(key, frame);
                self.new_flows.push(key);
                Ok(())
            }
            Ok(Admit::NewUdpFlow(key)) => {
                self.counters.admitted += 1;
                self.udp_held.insert(key, frame);
                self.new_udp_flows.push(key);
                Ok(())
            }
            Err(why) => {
                self.counters.dropped += 1;
                self.counters.last_drop = Some(why);
                tracing::trace!(target: "krunbox::net", ?why, "dropped a frame from the guest");
                Err(why)
            }
        }
    }

    fn admit(&self, frame: &[u8]) -> Result<Admit, Dropped> {
        let eth = EthernetFrame::new_checked(frame).map_err(|_| Dropped::Malformed)?;
        match eth.ethertype() {
            EthernetProtocol::Arp => {
                let arp = ArpPacket::new_checked(eth.payload()).map_err(|_| Dropped::Malformed)?;
                match ArpRepr::parse(&arp).map_err(|_| Dropped::Malformed)? {
                    ArpRepr::EthernetIpv4 {
                        target_protocol_addr,
                        ..
                    } if target_protocol_addr == self.addressing.gateway => Ok(Admit::Stack),
                    _ => Err(Dropped::ArpNotForGateway),
                }
            }
            EthernetProtocol::Ipv4 => {
                let ip = Ipv4Packet::new_checked(eth.payload()).map_err(|_| Dropped::Malformed)?;
                if ip.more_frags() || ip.frag_offset() != 0 {
                    return Err(Dropped::Fragment);
                }
                match ip.next_header() {
                    IpProtocol::Tcp => {
                        let tcp =
                            TcpPacket::new_checked(ip.payload()).map_err(|_| Dropped::Malformed)?;
                        if !tcp.syn() || tcp.ack() {
                            return Ok(Admit::Stack);
                        }
                        // A SYN is held (and put to the policy) only if the stack will take
                        // it when it is replayed: a listener made for one it drops (a bad
                        // checksum, SYN with RST or FIN) would be left listening, and take
                        // another connection's SYN.
                        let checksums = ChecksumCapabilities::default();
                        if !ip.verify_checksum()
                            || TcpRepr::parse(
                                &tcp,
                                &ip.src_addr().into(),
                                &ip.dst_addr().into(),
                                &checksums,
                            )
                            .is_err()
                            || tcp.rst()
                            || tcp.fin()
                        {
                            return Err(Dropped::Malformed);
                        }
                        let key = FlowKey {
                            guest: SocketAddrV4::new(ip.src_addr(), tcp.src_port()),
                            destination: SocketAddrV4::new(ip.dst_addr(), tcp.dst_port()),
                        };
                        if self.held.contains_key(&key) || self.open.contains_key(&key) {
                            Err(Dropped::RepeatedSyn)
                        } else if ip.src_addr() != self.addressing.guest {
                            // Only the guest's own address starts connections: a reset to a
                            // spoofed source would go nowhere anyway.
                            Err(Dropped::Other)
                        } else {
                            Ok(Admit::NewConnection(key))
                        }
                    }
                    IpProtocol::Udp => {
                        let udp =
                            UdpPacket::new_checked(ip.payload()).map_err(|_| Dropped::Malformed)?;
                        if ip.dst_addr() == self.addressing.gateway && udp.dst_port() == 53 {
                            return Ok(Admit::Stack);
                        }
                        let key = FlowKey {
                            guest: SocketAddrV4::new(ip.src_addr(), udp.src_port()),
                            destination: SocketAddrV4::new(ip.dst_addr(), udp.dst_port()),
                        };
                        if self.udp_open.contains(&key) {
                            Ok(Admit::Stack)
                        } else if ip.src_addr() != self.addressing.guest || udp.dst_port() == 0 {
                            Err(Dropped::Other)
                        } else if self.udp_held.contains_key(&key)
                            || self.udp_held.len() + self.udp_open.len() >= MAX_UDP_FLOWS
                        {
                            Err(Dropped::Udp)
                        } else {
                            Ok(Admit::NewUdpFlow(key))
                        }
                    }
                    IpProtocol::Icmp => Err(Dropped::Icmp),
                    _ => Err(Dropped::Other),
                }
            }
            EthernetProtocol::Ipv6 => Err(Dropped::Ipv6),
            _ => Err(Dropped::Other),
        }
    }

    /// Runs the stack: takes the queued frames, moves data in and out of sockets, produces
    /// output.
    pub(crate) fn poll(&mut self, now: Instant) {
        self.iface.poll(now, &mut self.port, &mut self.sockets);
        for key in self.port.offered.drain(..) {
            self.awaiting_syn.remove(&key);
        }
        self.settle_sockets(now);
    }

    /// Connections held since the last call, for the policy.
    pub(crate) fn take_new_flows(&mut self) -> Vec<FlowKey> {
        std::mem::take(&mut self.new_flows)
    }

    /// Accepts a held connection: a socket listens on the address the guest dialled and its
    /// SYN is replayed into the stack, which completes the handshake at the next poll. `false`
    /// if `key` was not held.
    pub(crate) fn accept_tcp(&mut self, key: FlowKey) -> bool {
        let Some(syn) = self.held.remove(&key) else {
            return false;
        };
        let mut socket = new_socket();
        if socket.listen(IpEndpoint::from(key.destination)).is_err() {
            return false;
        }
        let handle = self.sockets.add(socket);
        self.open.insert(key, handle);
        self.awaiting_syn.insert(key);
        // Ahead of anything queued. Another listener on the same address may still take it
        // (one accepted in the same pass): `settle_sockets` gives each socket to its
        // connection after the poll.
        self.port.rx.push_front(Queued {
            frame: syn,
            syn_of: Some(key),
        });
        true
    }

    /// Opens a connection from the gateway to the guest's `guest_port` (a published port):
    /// the stack sends the SYN at the next poll. `None` when the connections are at their
    /// bound or no gateway port is free.
    pub(crate) fn connect_tcp(&mut self, guest_port: u16) -> Option<FlowKey> {
        if self.held.len() + self.open.len() >= MAX_CONNECTIONS {
            return None;
        }
        let span = GATEWAY_PORTS.end - GATEWAY_PORTS.start;
        let key = (0..span).find_map(|_| {
            let port = self.next_gateway_port;
            self.next_gateway_port = if port >= GATEWAY_PORTS.end - 1 {
                GATEWAY_PORTS.start
            } else {
                port + 1
            };
            let key = FlowKey {
                guest: SocketAddrV4::new(self.addressing.guest, guest_port),
                destination: SocketAddrV4::new(self.addressing.gateway, port),
            };
            (!self.open.contains_key(&key)).then_some(key)
        })?;
        let mut socket = new_socket();
        socket
            .connect(
                self.iface.context(),
                IpEndpoint::from(key.guest),
                IpEndpoint::from(key.destination),
            )
            .ok()?;
        let handle = self.sockets.add(socket);
        self.open.insert(key, handle);
        Some(key)
    }

    /// Refuses a held connection: the guest gets a reset from the address it dialled.
    pub(crate) fn refuse_tcp(&mut self, key: FlowKey) {
        if let Some(syn) = self.held.remove(&key) {
            self.reset(&syn);
        }
    }

    /// The socket of an accepted connection.
    pub(crate) fn tcp(&mut self, key: &FlowKey) -> Option<&mut tcp::Socket<'static>> {
        let handle = *self.open.get(key)?;
        Some(self.sockets.get_mut::<tcp::Socket>(handle))
    }

    /// Forgets a connection and its socket (its state is the caller's to judge: closed, or
    /// given up).
    pub(crate) fn remove_tcp(&mut self, key: &FlowKey) {
        self.awaiting_syn.remove(key);
        self.fin_wait_2.remove(key);
        if let Some(handle) = self.open.remove(key) {
            self.sockets.remove(handle);
        }
    }

    /// After a poll: gives each socket to the connection whose guest end it talks to, and
    /// aborts those that can no longer serve theirs, so that the service sees them closed.
    ///
    /// Listeners on one address are interchangeable to smoltcp: of two connections accepted to
    /// it in one pass either listener may take either SYN, and a listener left over takes the
    /// next one. A listener is left over when its SYN was taken and then reset by the guest
    /// (SYN-RECEIVED returns to LISTEN on a reset) or its SYN never took (the gate holds only
    /// SYNs the stack parses, so that is a bug's case): such a connection is over. Left as it
    /// was, two connections would own one socket, and the second `remove_tcp` of it panics.
    fn settle_sockets(&mut self, now: Instant) {
        let mut unsettled: Vec<SocketAddrV4> = Vec::new();
        for (key, handle) in &self.open {
            let socket = self.sockets.get::<tcp::Socket>(*handle);
            let wrong = match remote_of(socket) {
                Some(remote) => remote != key.guest,
                None => socket.state() == tcp::State::Listen && !self.awaiting_syn.contains(key),
            };
            if wrong && !unsettled.contains(&key.destination) {
                unsettled.push(key.destination);
            }
            if socket.state() == tcp::State::FinWait2 {
                self.fin_wait_2.entry(*key).or_insert(now);
            }
        }
        for destination in unsettled {
            self.reassign(destination);
        }
        let expired: Vec<FlowKey> = self
            .fin_wait_2
            .iter()
            .filter(|(_, since)| now >= **since + FIN_WAIT_2_TIMEOUT)
            .map(|(key, _)| *key)
            .collect();
        for key in expired {
            self.fin_wait_2.remove(&key);
            if let Some(handle) = self.open.get(&key) {
                let socket = self.sockets.get_mut::<tcp::Socket>(*handle);
                if socket.state() == tcp::State::FinWait2 {
                    tracing::debug!(target: "krunbox::net", ?key, "FIN-WAIT-2 expired");
                    socket.abort();
                }
            }
        }
    }

    /// The sockets of the connections to `destination`, each to the connection whose guest
    /// end it talks to; the rest to the rest, and those then wrong are aborted.
    fn reassign(&mut self, destination: SocketAddrV4) {
        let keys: Vec<FlowKey> = self
            .open
            .keys()
            .filter(|key| key.destination == destination)
            .copied()
            .collect();
        let mut handles: Vec<SocketHandle> = keys.iter().map(|key| self.open[key]).collect();
        let mut homeless: Vec<FlowKey> = Vec::new();
        for key in &keys {
            let talks_to_key = |handle: &SocketHandle| {
                remote_of(self.sockets.get::<tcp::Socket>(*handle)) == Some(key.guest)
            };
            match handles.iter().position(talks_to_key) {
                Some(i) => {
                    self.open.insert(*key, handles.swap_remove(i));
                }
                None => homeless.push(*key),
            }
        }
        for (key, handle) in homeless.into_iter().zip(handles) {
            self.open.insert(key, handle);
            let waiting = self.awaiting_syn.contains(&key);
            let socket = self.sockets.get_mut::<tcp::Socket>(handle);
            let listening = socket.state() == tcp::State::Listen;
            if !(listening && waiting) && socket.state() != tcp::State::Closed {
                tracing::debug!(
                    target: "krunbox::net",
                    ?key,
                    state = %socket.state(),
                    "a connection lost its socket (reset in SYN-RECEIVED, or its SYN never took)"
                );
                socket.abort();
            }
        }
    }

    /// Sends the guest a reset for `syn` (a frame the gate parsed: well-formed TCP over IPv4),
    /// from the address it was sent to.
    fn reset(&mut self, syn: &[u8]) {
        self.counters.tcp_refused += 1;
        if self.port.output_full() {
            // The guest will send its SYN again, and be refused then.
            return;
        }
        let Some(frame) = reset_for(syn, &self.addressing) else {
            return;
        };
        if let Err(err) = frame::encode(&frame, &mut self.port.out) {
            tracing::error!(target: "krunbox::net", "not sending a reset to the guest: {err}");
        }
    }

    /// UDP flows held since the last call, for the policy.
    pub(crate) fn take_new_udp_flows(&mut self) -> Vec<FlowKey> {
        std::mem::take(&mut self.new_udp_flows)
    }

    /// Grants a held UDP flow: its first datagram goes into the stack, to the destination's
    /// socket (made for the first flow to it), and later ones follow. `false` if `key` was
    /// not held.
    pub(crate) fn accept_udp(&mut self, key: FlowKey) -> bool {
        let Some(datagram) = self.udp_held.remove(&key) else {
            return false;
        };
        let entry = match self.udp_sockets.get_mut(&key.destination) {
            Some(entry) => entry,
            None => {
                let buffer = || {
                    udp::PacketBuffer::new(
                        vec![udp::PacketMetadata::EMPTY; UDP_PACKETS],
                        vec![0u8; UDP_BYTES],
                    )
                };
                let mut socket = udp::Socket::new(buffer(), buffer());
                if socket.bind(IpEndpoint::from(key.destination)).is_err() {
                    return false;
                }
                let handle = self.sockets.add(socket);
                self.udp_sockets
                    .entry(key.destination)
                    .or_insert((handle, 0))
            }
        };
        entry.1 += 1;
        self.udp_open.insert(key);
        self.port.rx.push_front(Queued {
            frame: datagram,
            syn_of: None,
        });
        true
    }

    /// Drops a held UDP flow's datagram (no answer: a network that drops says nothing).
    pub(crate) fn refuse_udp(&mut self, key: FlowKey) {
        self.udp_held.remove(&key);
    }

    /// Forgets a UDP flow (its destination's socket goes with its last flow).
    pub(crate) fn remove_udp(&mut self, key: &FlowKey) {
        if !self.udp_open.remove(key) {
            return;
        }
        if let Some(entry) = self.udp_sockets.get_mut(&key.destination) {
            entry.1 -= 1;
            if entry.1 == 0 {
                let (handle, _) = entry.to_owned();
                self.udp_sockets.remove(&key.destination);
                self.sockets.remove(handle);
            }
        }
    }

    /// Datagrams the guest sent on granted UDP flows since the last call.
    pub(crate) fn take_udp_datagrams(&mut self) -> Vec<(FlowKey, Vec<u8>)> {
        let mut datagrams = Vec::new();
        for (destination, (handle, _)) in &self.udp_sockets {
            let socket = self.sockets.get_mut::<udp::Socket>(*handle);
            while let Ok((bytes, meta)) = socket.recv() {
                let smoltcp::wire::IpAddress::Ipv4(addr) = meta.endpoint.addr;
                let key = FlowKey {
                    guest: SocketAddrV4::new(addr, meta.endpoint.port),
                    destination: *destination,
                };
                if self.udp_open.contains(&key) {
                    datagrams.push((key, bytes.to_vec()));
                }
            }
        }
        datagrams
    }

    /// Sends the guest a datagram on a granted UDP flow, from the address it sent to. Dropped
    /// if it does not fit the link or the socket's buffer (UDP loses, as a network would).
    pub(crate) fn send_udp(&mut self, key: &FlowKey, datagram: &[u8]) {
        if !self.udp_open.contains(key) {
            return;
        }
        if let Some((handle, _)) = self.udp_sockets.get(&key.destination) {
            let socket = self.sockets.get_mut::<udp::Socket>(*handle);
            let _ = socket.send_slice(datagram, IpEndpoint::from(key.guest));
        }
    }

    /// Datagrams to the DNS server since the last call, with where they came from.
    pub(crate) fn take_dns_queries(&mut self) -> Vec<(Vec<u8>, IpEndpoint)> {
        let socket = self.sockets.get_mut::<udp::Socket>(self.dns);
        let mut queries = Vec::new();
        while let Ok((bytes, meta)) = socket.recv() {
            queries.push((bytes.to_vec(), meta.endpoint));
        }
        queries
    }

    /// Sends a DNS answer to the guest (dropped if the socket's buffer is full: the guest's
    /// resolver asks again).
    pub(crate) fn send_dns(&mut self, to: IpEndpoint, answer: &[u8]) {
        let socket = self.sockets.get_mut::<udp::Socket>(self.dns);
        if socket.send_slice(answer, to).is_err() {
            tracing::debug!(target: "krunbox::net", "a DNS answer to the guest was dropped");
        }
    }

    /// How long until the stack next needs a poll with no new input (`None`: not before
    /// something arrives, or before the output drains when it is full: polling then would
    /// spin). At least a millisecond unless frames wait, which is smoltcp's own granularity.
    pub(crate) fn poll_delay(&mut self, now: Instant) -> Option<Duration> {
        if self.port.output_full() {
            return None;
        }
        if !self.port.rx.is_empty() {
            return Some(Duration::ZERO);
        }
        self.iface
            .poll_delay(now, &self.sockets)
            .map(|d| d.max(Duration::from_millis(1)))
    }

    /// Framed bytes for the guest, to be written to the stream and drained from the front.
    pub(crate) fn output(&mut self) -> &mut Vec<u8> {
        &mut self.port.out
    }

    /// Panics unless every accepted connection owns a socket of its own and the stack holds
    /// no socket that nothing owns (the fuzz harness and tests check this after every step).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn check_invariants(&self) {
        let mut owned: std::collections::HashSet<SocketHandle> =
            self.open.values().copied().collect();
        assert_eq!(
            owned.len(),
            self.open.len(),
            "two connections share a socket"
        );
        for (handle, _) in self.udp_sockets.values() {
            assert!(owned.insert(*handle), "a UDP socket is also a connection's");
        }
        owned.insert(self.dns);
        let all = self.sockets.iter().count();
        assert_eq!(all, owned.len(), "the stack holds a socket nothing owns");
        assert!(self.open.len() + self.held.len() <= MAX_CONNECTIONS);
        for key in &self.awaiting_syn {
            assert!(
                self.open.contains_key(key),
                "waiting for the SYN of no connection"
            );
        }
    }
}

/// A socket for one connection, with its buffers and timers.
fn new_socket() -> tcp::Socket<'static> {
    let buffer = || tcp::SocketBuffer::new(vec![0u8; TCP_BUFFER]);
    let mut socket = tcp::Socket::new(buffer(), buffer());
    // Data is relayed as it comes: coalescing is the upstream's and the guest's business.
    socket.set_nagle_enabled(false);
    socket.set_timeout(Some(TCP_TIMEOUT));
    socket.set_keep_alive(Some(TCP_KEEP_ALIVE));
    socket
}

/// The guest end a socket talks to, once it has one.
fn remote_of(socket: &tcp::Socket<'_>) -> Option<SocketAddrV4> {
    match socket.remote_endpoint()? {
        IpEndpoint {
            addr: smoltcp::wire::IpAddress::Ipv4(addr),
            port,
        } => Some(SocketAddrV4::new(addr, port)),
    }
}

/// The reset answering `syn`: from its destination, acknowledging its sequence number.
fn reset_for(syn: &[u8], addressing: &Addressing) -> Option<Vec<u8>> {
    let checksums = ChecksumCapabilities::default();
    let eth = EthernetFrame::new_checked(syn).ok()?;
    let ip = Ipv4Packet::new_checked(eth.payload()).ok()?;
    let tcp = TcpPacket::new_checked(ip.payload()).ok()?;
    let payload_len = ip
        .payload()
        .len()
        .saturating_sub(usize::from(tcp.header_len()));
    let reset = TcpRepr {
        src_port: tcp.dst_port(),
        dst_port: tcp.src_port(),
        control: TcpControl::Rst,
        seq_number: TcpSeqNumber(0),
        ack_number: Some(tcp.seq_number() + 1 + payload_len),
        window_len: 0,
        window_scale: None,
        max_seg_size: None,
        sack_permitted: false,
        sack_ranges: [None; 3],
        timestamp: None,
        payload: &[],
    };
    let ip_repr = Ipv4Repr {
        src_addr: ip.dst_addr(),
        dst_addr: ip.src_addr(),
        next_header: IpProtocol::Tcp,
        payload_len: reset.buffer_len(),
        hop_limit: 64,
    };
    let eth_repr = EthernetRepr {
        src_addr: EthernetAddress(addressing.gateway_mac),
        dst_addr: eth.src_addr(),
        ethertype: EthernetProtocol::Ipv4,
    };
    let mut buf = vec![0u8; eth_repr.buffer_len() + ip_repr.buffer_len() + reset.buffer_len()];
    let mut out = EthernetFrame::new_unchecked(&mut buf[..]);
    eth_repr.emit(&mut out);
    let mut out_ip = Ipv4Packet::new_unchecked(out.payload_mut());
    ip_repr.emit(&mut out_ip, &checksums);
    reset.emit(
        &mut TcpPacket::new_unchecked(out_ip.payload_mut()),
        &ip.dst_addr().into(),
        &ip.src_addr().into(),
        &checksums,
    );
    Some(buf)
}

/// smoltcp's seed (initial TCP sequence numbers, ephemeral ports): different per gateway.
fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.finish()
}

/// The gateway's own address, for tests.
#[cfg(test)]
impl Gateway {
    fn gateway(&self) -> std::net::Ipv4Addr {
        self.addressing.gateway
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Message;
    use smoltcp::wire::{
        ArpOperation, EthernetRepr, Icmpv4Packet, Icmpv4Repr, Ipv4Repr, TcpControl, TcpPacket,
        TcpRepr, TcpSeqNumber, UdpRepr,
    };
    use std::net::Ipv4Addr;

    const GUEST: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 15);

    fn gateway() -> Gateway {
        Gateway::new(Addressing::default(), Instant::from_millis(0))
    }

    fn guest_mac() -> EthernetAddress {
        EthernetAddress(Addressing::default().guest_mac)
    }

    fn ethernet(dst: EthernetAddress, ethertype: EthernetProtocol, payload: &[u8]) -> Vec<u8> {
        let repr = EthernetRepr {
            src_addr: guest_mac(),
            dst_addr: dst,
            ethertype,
        };
        let mut buf = vec![0u8; repr.buffer_len() + payload.len()];
        let mut frame = EthernetFrame::new_unchecked(&mut buf);
        repr.emit(&mut frame);
        frame.payload_mut().copy_from_slice(payload);
        buf
    }

    fn ipv4(dst: Ipv4Addr, protocol: IpProtocol, payload: &[u8]) -> Vec<u8> {
        let repr = Ipv4Repr {
            src_addr: GUEST,
            dst_addr: dst,
            next_header: protocol,
            payload_len: payload.len(),
            hop_limit: 64,
        };
        let mut buf = vec![0u8; repr.buffer_len() + payload.len()];
        let mut packet = Ipv4Packet::new_unchecked(&mut buf);
        repr.emit(&mut packet, &ChecksumCapabilities::default());
        packet.payload_mut().copy_from_slice(payload);
        let gw = EthernetAddress(Addressing::default().gateway_mac);
        ethernet(gw, EthernetProtocol::Ipv4, &buf)
    }

    fn arp_request(target: Ipv4Addr) -> Vec<u8> {
        let repr = ArpRepr::EthernetIpv4 {
            operation: ArpOperation::Request,
            source_hardware_addr: guest_mac(),
            source_protocol_addr: GUEST,
            target_hardware_addr: EthernetAddress([0; 6]),
            target_protocol_addr: target,
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut ArpPacket::new_unchecked(&mut buf));
        ethernet(EthernetAddress::BROADCAST, EthernetProtocol::Arp, &buf)
    }

    fn syn(dst: Ipv4Addr, port: u16) -> Vec<u8> {
        syn_from(40000, dst, port)
    }

    fn syn_from(src_port: u16, dst: Ipv4Addr, port: u16) -> Vec<u8> {
        tcp_segment(src_port, dst, port, TcpControl::Syn, None)
    }

    /// A segment of no connection the gateway knows: the stack answers it with a reset.
    fn stray_ack(dst: Ipv4Addr, port: u16) -> Vec<u8> {
        tcp_segment(40000, dst, port, TcpControl::None, Some(TcpSeqNumber(77)))
    }

    fn tcp_segment(
        src_port: u16,
        dst: Ipv4Addr,
        port: u16,
        control: TcpControl,
        ack_number: Option<TcpSeqNumber>,
    ) -> Vec<u8> {
        let repr = TcpRepr {
            src_port,
            dst_port: port,
            control,
            seq_number: TcpSeqNumber(1000),
            ack_number,
            window_len: 64240,
            window_scale: None,
            max_seg_size: Some(1460),
            sack_permitted: false,
            sack_ranges: [None; 3],
            timestamp: None,
            payload: &[],
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(
            &mut TcpPacket::new_unchecked(&mut buf),
            &GUEST.into(),
            &dst.into(),
            &ChecksumCapabilities::default(),
        );
        ipv4(dst, IpProtocol::Tcp, &buf)
    }

    fn udp(dst: Ipv4Addr, port: u16, payload: &[u8]) -> Vec<u8> {
        let repr = UdpRepr {
            src_port: 40001,
            dst_port: port,
        };
        let mut buf = vec![0u8; repr.header_len() + payload.len()];
        repr.emit(
            &mut UdpPacket::new_unchecked(&mut buf),
            &GUEST.into(),
            &dst.into(),
            payload.len(),
            |p| p.copy_from_slice(payload),
            &ChecksumCapabilities::default(),
        );
        ipv4(dst, IpProtocol::Udp, &buf)
    }

    /// The frames the gateway sent, decoded from its output.
    fn sent(gw: &mut Gateway) -> Vec<Vec<u8>> {
        let bytes = std::mem::take(gw.output());
        let mut decoder = frame::FrameDecoder::new();
        let mut input = &bytes[..];
        let mut frames = Vec::new();
        while let Some(f) = decoder.decode(&mut input) {
            frames.push(f.unwrap());
        }
        frames
    }

    /// ARP first, as the guest does: the gateway learns the guest's MAC from it.
    fn with_guest_known() -> Gateway {
        let mut gw = gateway();
        let target = gw.gateway();
        gw.receive(arp_request(target)).unwrap();
        gw.poll(Instant::from_millis(1));
        let replies = sent(&mut gw);
        assert_eq!(replies.len(), 1, "one ARP reply");
        let eth = EthernetFrame::new_checked(&replies[0][..]).unwrap();
        let arp = ArpRepr::parse(&ArpPacket::new_checked(eth.payload()).unwrap()).unwrap();
        let ArpRepr::EthernetIpv4 {
            operation,
            source_protocol_addr,
            ..
        } = arp
        else {
            panic!("{arp:?}")
        };
        assert_eq!(operation, ArpOperation::Reply);
        assert_eq!(source_protocol_addr, target);
        gw
    }

    fn tcp_reply(frame: &[u8]) -> (Ipv4Addr, TcpControl) {
        let eth = EthernetFrame::new_checked(frame).unwrap();
        let ip = Ipv4Packet::new_checked(eth.payload()).unwrap();
        let tcp = TcpPacket::new_checked(ip.payload()).unwrap();
        let repr = TcpRepr::parse(
            &tcp,
            &ip.src_addr().into(),
            &ip.dst_addr().into(),
            &ChecksumCapabilities::default(),
        )
        .unwrap();
        (ip.src_addr(), repr.control)
    }

    #[test]
    fn a_new_connection_is_held_until_decided_then_reset_or_answered_by_the_address_dialled() {
        let mut gw = with_guest_known();
        let far = Ipv4Addr::new(93, 184, 215, 14);
        let keys: Vec<FlowKey> = [gw.gateway(), far, Ipv4Addr::new(198, 18, 0, 1)]
            .into_iter()
            .map(|dst| {
                gw.receive(syn(dst, 443)).unwrap();
                FlowKey {
                    guest: SocketAddrV4::new(GUEST, 40000),
                    destination: SocketAddrV4::new(dst, 443),
                }
            })
            .collect();
        gw.poll(Instant::from_millis(2));
        assert!(sent(&mut gw).is_empty(), "held: no answer yet");
        assert_eq!(gw.take_new_flows(), keys);
        assert!(gw.take_new_flows().is_empty());
        // The guest sends its SYN again while the policy thinks: absorbed, not a new flow.
        assert_eq!(gw.receive(syn(far, 443)), Err(Dropped::RepeatedSyn));
        assert!(gw.take_new_flows().is_empty());
        // Refused: a reset from the address dialled, acknowledging the SYN.
        gw.refuse_tcp(keys[0]);
        let out = sent(&mut gw);
        assert_eq!(out.len(), 1);
        assert_eq!(tcp_reply(&out[0]), (gw.gateway(), TcpControl::Rst));
        // Addressed to the guest's port, acknowledging its SYN (else the guest ignores it).
        let eth = EthernetFrame::new_checked(&out[0][..]).unwrap();
        assert_eq!(eth.dst_addr(), guest_mac());
        let ip = Ipv4Packet::new_checked(eth.payload()).unwrap();
        assert_eq!(ip.dst_addr(), GUEST);
        let tcp = TcpPacket::new_checked(ip.payload()).unwrap();
        assert_eq!((tcp.src_port(), tcp.dst_port()), (443, 40000));
        assert!(tcp.ack() && tcp.rst());
        assert_eq!(tcp.ack_number(), TcpSeqNumber(1001));
        // Accepted: the stack answers the replayed SYN from the address dialled.
        assert!(gw.accept_tcp(keys[1]));
        assert!(!gw.accept_tcp(keys[1]), "no longer held");
        gw.poll(Instant::from_millis(3));
        let out = sent(&mut gw);
        assert_eq!(out.len(), 1);
        assert_eq!(tcp_reply(&out[0]), (far, TcpControl::Syn), "a SYN-ACK");
        let socket = gw.tcp(&keys[1]).unwrap();
        assert_eq!(socket.state(), tcp::State::SynReceived);
        // Now open: a repeated SYN is the socket's, not a new flow.
        assert_eq!(gw.receive(syn(far, 443)), Err(Dropped::RepeatedSyn));
        gw.remove_tcp(&keys[1]);
        assert!(gw.tcp(&keys[1]).is_none());
    }

    #[test]
    fn two_connections_accepted_to_one_address_each_get_their_own_socket() {
        let mut gw = with_guest_known();
        let far = Ipv4Addr::new(93, 184, 215, 14);
        let key = |port| FlowKey {
            guest: SocketAddrV4::new(GUEST, port),
            destination: SocketAddrV4::new(far, 443),
        };
        gw.receive(syn_from(40000, far, 443)).unwrap();
        gw.receive(syn_from(40001, far, 443)).unwrap();
        // Accepted in the opposite order to their arrival, in one pass.
        assert!(gw.accept_tcp(key(40001)));
        assert!(gw.accept_tcp(key(40000)));
        gw.poll(Instant::from_millis(2));
        for port in [40000, 40001] {
            let remote = gw.tcp(&key(port)).unwrap().remote_endpoint().unwrap();
            assert_eq!(remote.port, port);
        }
    }

    /// A guest of well-formed segments (the fuzz harness's), on the link to `gw`.
    struct Link {
        guest: crate::net::fuzz_ops::Guest,
        millis: i64,
    }

    impl Link {
        fn new() -> Self {
            Self {
                guest: crate::net::fuzz_ops::Guest::default(),
                millis: 10,
            }
        }

        /// Sends op `op` from guest port `40000 + port` to destination `to` (the harness's
        /// indices: 0 is 192.0.2.1:80), then polls and lets the guest see the answers.
        fn send(&mut self, gw: &mut Gateway, op: u8, port: u8, to: u8) -> Result<(), Dropped> {
            let crate::net::fuzz_ops::Step::Frame(frame) = self.guest.op(op, port, to) else {
                unreachable!("a frame op")
            };
            let result = gw.receive(frame);
            self.poll(gw);
            result
        }

        fn poll(&mut self, gw: &mut Gateway) {
            self.millis += 10;
            gw.poll(Instant::from_millis(self.millis));
            gw.check_invariants();
            for frame in sent(gw) {
                self.guest.saw(&frame);
            }
        }

        fn wait(&mut self, gw: &mut Gateway, seconds: i64) {
            self.millis += seconds * 1000;
            self.poll(gw);
        }
    }

    fn flow_key(port: u8) -> FlowKey {
        FlowKey {
            guest: SocketAddrV4::new(GUEST, 40000 + u16::from(port)),
            destination: SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 80),
        }
    }

    fn state(gw: &mut Gateway, key: &FlowKey) -> Option<tcp::State> {
        gw.tcp(key).map(|s| s.state())
    }

    /// Issue 33's panic: a reset in SYN-RECEIVED put the socket back to LISTEN, the next
    /// connection accepted to that address landed on it, both connections then owned it, and
    /// the second `remove_tcp` panicked in smoltcp. Now the reset ends its connection, and the
    /// next one gets its own socket.
    #[test]
    fn a_reset_in_syn_received_ends_its_connection_and_leaves_no_listener_behind() {
        use crate::net::fuzz_ops::{ACK, RST, SYN};
        let mut gw = with_guest_known();
        let mut link = Link::new();
        let (a, b) = (flow_key(0), flow_key(1));
        link.send(&mut gw, SYN, 0, 0).unwrap();
        assert_eq!(gw.take_new_flows(), [a]);
        assert!(gw.accept_tcp(a));
        link.poll(&mut gw);
        assert_eq!(state(&mut gw, &a), Some(tcp::State::SynReceived));
        link.send(&mut gw, RST, 0, 0).unwrap();
        assert_eq!(
            state(&mut gw, &a),
            Some(tcp::State::Closed),
            "no listener left"
        );
        // The service forgets a closed connection; the next one to the address is its own.
        gw.remove_tcp(&a);
        link.send(&mut gw, SYN, 1, 0).unwrap();
        assert_eq!(gw.take_new_flows(), [b]);
        assert!(gw.accept_tcp(b));
        link.poll(&mut gw);
        link.send(&mut gw, ACK, 1, 0).unwrap();
        assert_eq!(state(&mut gw, &b), Some(tcp::State::Established));
        gw.remove_tcp(&b);
        gw.check_invariants();
    }

    /// The same with the reset landing while the next connection's listener is already there:
    /// the old listener may take the new SYN; each connection still ends up with its own
    /// socket, and the one the guest reset is over.
    #[test]
    fn a_listener_left_by_a_reset_gives_the_next_syn_to_its_connection() {
        use crate::net::fuzz_ops::{ACK, RST, SYN};
        let mut gw = with_guest_known();
        let mut link = Link::new();
        let (a, b) = (flow_key(0), flow_key(1));
        link.send(&mut gw, SYN, 0, 0).unwrap();
        link.send(&mut gw, SYN, 1, 0).unwrap();
        assert_eq!(gw.take_new_flows(), [a, b]);
        assert!(gw.accept_tcp(a));
        link.poll(&mut gw);
        // B's listener is made before A's reset reaches the stack: both are polled at once.
        assert!(gw.accept_tcp(b));
        link.send(&mut gw, RST, 0, 0).unwrap();
        link.poll(&mut gw);
        link.send(&mut gw, ACK, 1, 0).unwrap();
        assert_eq!(state(&mut gw, &b), Some(tcp::State::Established));
        let remote = gw.tcp(&b).unwrap().remote_endpoint().unwrap();
        assert_eq!(remote.port, 40001);
        assert_eq!(state(&mut gw, &a), Some(tcp::State::Closed));
        gw.remove_tcp(&a);
        gw.remove_tcp(&b);
        gw.check_invariants();
    }

    /// A SYN the stack would not take is not put to the policy: a listener made for it would
    /// never get its SYN and take the next connection's instead.
    #[test]
    fn a_syn_with_a_bad_checksum_or_other_flags_is_not_held() {
        use crate::net::fuzz_ops::{BAD_CHECKSUM_SYN, SYN_RST};
        let mut gw = with_guest_known();
        let mut link = Link::new();
        assert_eq!(
            link.send(&mut gw, BAD_CHECKSUM_SYN, 0, 0),
            Err(Dropped::Malformed)
        );
        assert_eq!(link.send(&mut gw, SYN_RST, 1, 0), Err(Dropped::Malformed));
        assert!(gw.take_new_flows().is_empty());
    }

    /// The gateway's TCP timers: a SYN-RECEIVED the guest never acknowledges, and a
    /// FIN-WAIT-2 the guest never finishes, both end (the connection's slot is not held for
    /// ever), while an idle established connection stays, the guest answering keep-alives.
    #[test]
    fn half_open_and_half_closed_connections_expire_and_idle_ones_stay() {
        use crate::net::fuzz_ops::{ACK, SYN};
        let mut gw = with_guest_known();
        let mut link = Link::new();
        let (never_acked, half_closed, idle) = (flow_key(0), flow_key(1), flow_key(2));
        for (port, key) in [(0, never_acked), (1, half_closed), (2, idle)] {
            link.send(&mut gw, SYN, port, 0).unwrap();
            assert_eq!(gw.take_new_flows(), [key]);
            assert!(gw.accept_tcp(key));
            link.poll(&mut gw);
        }
        link.send(&mut gw, ACK, 1, 0).unwrap();
        link.send(&mut gw, ACK, 2, 0).unwrap();
        // The host finishes half_closed; the guest acknowledges the FIN and never sends its own.
        gw.tcp(&half_closed).unwrap().close();
        link.poll(&mut gw);
        link.send(&mut gw, ACK, 1, 0).unwrap();
        assert_eq!(state(&mut gw, &half_closed), Some(tcp::State::FinWait2));
        // Time passes in steps; the idle connection's guest answers each keep-alive.
        for _ in 0..10 {
            link.wait(&mut gw, 10);
            link.send(&mut gw, ACK, 2, 0).unwrap();
        }
        assert_eq!(state(&mut gw, &never_acked), Some(tcp::State::Closed));
        assert_eq!(state(&mut gw, &half_closed), Some(tcp::State::Closed));
        assert_eq!(state(&mut gw, &idle), Some(tcp::State::Established));
    }

    #[test]
    fn the_gateway_connects_to_a_published_port_from_a_port_of_its_own() {
        let mut gw = with_guest_known();
        let key = gw.connect_tcp(8080).unwrap();
        assert_eq!(key.guest, SocketAddrV4::new(GUEST, 8080));
        assert_eq!(*key.destination.ip(), gw.gateway());
        assert!(GATEWAY_PORTS.contains(&key.destination.port()));
        gw.poll(Instant::from_millis(2));
        let out = sent(&mut gw);
        assert_eq!(out.len(), 1);
        let eth = EthernetFrame::new_checked(&out[0][..]).unwrap();
        let ip = Ipv4Packet::new_checked(eth.payload()).unwrap();
        let tcp = TcpPacket::new_checked(ip.payload()).unwrap();
        assert_eq!((ip.src_addr(), ip.dst_addr()), (gw.gateway(), GUEST));
        assert!(tcp.syn() && !tcp.ack());
        assert_eq!(tcp.dst_port(), 8080);
        // A second connection gets another port.
        let second = gw.connect_tcp(8080).unwrap();
        assert_ne!(second.destination, key.destination);
    }

    #[test]
    fn a_udp_flow_is_held_then_carried_both_ways_from_the_address_sent_to() {
        let mut gw = with_guest_known();
        let far = Ipv4Addr::new(93, 184, 215, 14);
        gw.receive(udp(far, 3478, b"first")).unwrap();
        assert_eq!(
            gw.receive(udp(far, 3478, b"second")),
            Err(Dropped::Udp),
            "pending"
        );
        let keys = gw.take_new_udp_flows();
        assert_eq!(keys.len(), 1);
        let key = keys[0];
        assert_eq!(key.guest, SocketAddrV4::new(GUEST, 40001));
        assert_eq!(key.destination, SocketAddrV4::new(far, 3478));
        assert!(gw.accept_udp(key));
        gw.poll(Instant::from_millis(2));
        assert_eq!(gw.take_udp_datagrams(), [(key, b"first".to_vec())]);
        // Granted: later datagrams reach the socket directly.
        gw.receive(udp(far, 3478, b"third")).unwrap();
        gw.poll(Instant::from_millis(3));
        assert_eq!(gw.take_udp_datagrams(), [(key, b"third".to_vec())]);
        // An answer goes to the guest from the address it sent to.
        gw.send_udp(&key, b"answer");
        gw.poll(Instant::from_millis(4));
        let out = sent(&mut gw);
        assert_eq!(out.len(), 1);
        let eth = EthernetFrame::new_checked(&out[0][..]).unwrap();
        let ip = Ipv4Packet::new_checked(eth.payload()).unwrap();
        let packet = UdpPacket::new_checked(ip.payload()).unwrap();
        assert_eq!((ip.src_addr(), packet.src_port()), (far, 3478));
        assert_eq!((ip.dst_addr(), packet.dst_port()), (GUEST, 40001));
        assert_eq!(packet.payload(), b"answer");
        // Refused and removed flows carry nothing.
        gw.remove_udp(&key);
        gw.receive(udp(far, 3478, b"again")).unwrap();
        let again = gw.take_new_udp_flows();
        assert_eq!(again, [key], "a new flow after removal");
        gw.refuse_udp(key);
        gw.poll(Instant::from_millis(5));
        assert!(sent(&mut gw).is_empty());
        assert!(gw.take_udp_datagrams().is_empty());
    }

    #[test]
    fn connections_past_the_bound_are_reset_without_being_held() {
        let mut gw = with_guest_known();
        let far = Ipv4Addr::new(93, 184, 215, 14);
        for port in 0..MAX_HELD as u16 {
            gw.receive(syn_from(1000 + port, far, 443)).unwrap();
            if !gw.has_room() {
                gw.poll(Instant::from_millis(2));
            }
        }
        assert_eq!(gw.take_new_flows().len(), MAX_HELD);
        sent(&mut gw);
        assert_eq!(
            gw.receive(syn_from(9999, far, 443)),
            Err(Dropped::TooManyConnections)
        );
        let out = sent(&mut gw);
        assert_eq!(tcp_reply(&out[0]), (far, TcpControl::Rst));
    }

    #[test]
    fn dns_to_the_gateway_reaches_the_service_and_its_answer_the_guest() {
        let mut gw = with_guest_known();
        let query = crate::net::dns::tests::query("example.com.", hickory_proto::rr::RecordType::A);
        let dst = gw.gateway();
        gw.receive(udp(dst, 53, &query)).unwrap();
        gw.poll(Instant::from_millis(2));
        let queries = gw.take_dns_queries();
        assert_eq!(queries.len(), 1);
        assert_eq!(queries[0].0, query);
        assert_eq!(queries[0].1.port, 40001);
        gw.send_dns(queries[0].1, b"answer");
        gw.poll(Instant::from_millis(3));
        let out = sent(&mut gw);
        assert_eq!(out.len(), 1);
        let eth = EthernetFrame::new_checked(&out[0][..]).unwrap();
        let ip = Ipv4Packet::new_checked(eth.payload()).unwrap();
        let udp = UdpPacket::new_checked(ip.payload()).unwrap();
        assert_eq!(
            (ip.src_addr(), udp.src_port(), udp.dst_port()),
            (dst, 53, 40001)
        );
        assert_eq!(udp.payload(), b"answer");
    }

    /// An ICMP echo request (a ping), without its IP header.
    fn echo_request() -> Vec<u8> {
        let repr = Icmpv4Repr::EchoRequest {
            ident: 1,
            seq_no: 1,
            data: b"ping",
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(
            &mut Icmpv4Packet::new_unchecked(&mut buf),
            &ChecksumCapabilities::default(),
        );
        buf
    }

    #[test]
    fn icmp_ipv6_and_foreign_arp_get_nothing() {
        let mut gw = with_guest_known();
        let far = Ipv4Addr::new(1, 1, 1, 1);
        let echo = echo_request();
        let gw_addr = gw.gateway();
        let gw_mac = EthernetAddress(Addressing::default().gateway_mac);
        let cases = [
            (ipv4(gw_addr, IpProtocol::Icmp, &echo), Dropped::Icmp),
            (ipv4(far, IpProtocol::Icmp, &echo), Dropped::Icmp),
            (
                ethernet(gw_mac, EthernetProtocol::Ipv6, &[0x60; 40]),
                Dropped::Ipv6,
            ),
            (
                arp_request(Ipv4Addr::new(10, 0, 2, 3)),
                Dropped::ArpNotForGateway,
            ),
            (
                ethernet(gw_mac, EthernetProtocol::Ipv4, &[0x45; 3]),
                Dropped::Malformed,
            ),
            (ipv4(far, IpProtocol::Unknown(132), b"sctp"), Dropped::Other),
        ];
        for (frame, why) in cases {
            assert_eq!(gw.receive(frame), Err(why));
            gw.poll(Instant::from_millis(2));
            assert!(sent(&mut gw).is_empty(), "{why:?}");
        }
    }

    /// Link streams that reach past the gate: what a guest sends first (ARP for the gateway),
    /// then SYNs near and far, DNS queries, pings, stray UDP, IPv6. Each is a `net_link` input:
    /// one read of the whole framed stream.
    fn net_link_seeds() -> Vec<Vec<u8>> {
        let gw = Addressing::default().gateway;
        let far = Ipv4Addr::new(192, 0, 2, 1);
        // A fixed id: the seeds are committed and must come out the same every time.
        let mut query = Message::new(
            0x5eed,
            hickory_proto::op::MessageType::Query,
            hickory_proto::op::OpCode::Query,
        );
        query.add_query(hickory_proto::op::Query::query(
            "example.com.".parse().unwrap(),
            hickory_proto::rr::RecordType::AAAA,
        ));
        let query = query.to_vec().unwrap();
        let echo = echo_request();
        let gw_mac = EthernetAddress(Addressing::default().gateway_mac);
        let sessions: Vec<Vec<Vec<u8>>> = vec![
            vec![arp_request(gw), syn(gw, 80)],
            vec![arp_request(gw), syn(far, 443), syn(far, 443)],
            vec![
                arp_request(gw),
                udp(gw, 53, &query),
                udp(gw, 53, &query[..5]),
            ],
            vec![
                arp_request(gw),
                ipv4(far, IpProtocol::Icmp, &echo),
                udp(far, 123, b"ntp"),
            ],
            vec![
                ethernet(gw_mac, EthernetProtocol::Ipv6, &[0x60; 48]),
                arp_request(Ipv4Addr::new(10, 0, 2, 3)),
                syn(gw, 22),
            ],
        ];
        let framed = |frames: &[Vec<u8>]| {
            let mut stream = Vec::new();
            for f in frames {
                frame::encode(f, &mut stream).unwrap();
            }
            let cut = stream.len().div_ceil(16);
            assert!(
                cut < usize::from(crate::net::fuzz_ops::FIRST),
                "a seed's read is one cut"
            );
            let mut input = vec![cut as u8];
            input.extend(stream);
            input
        };
        let mut seeds: Vec<Vec<u8>> = sessions.iter().map(|frames| framed(frames)).collect();
        // Well-formed TCP from the harness's guest (ops: `fuzz_ops`), after ARP for the gateway:
        // (op, guest port index, destination index or seconds or data length).
        use crate::net::fuzz_ops::{
            ACK, BAD_CHECKSUM_SYN, DATA, FIN, FIRST, RST, SYN, SYN_RST, WAIT,
        };
        let scripts: [&[(u8, u8, u8)]; 2] = [
            // A reset in SYN-RECEIVED, then the next connection to that address, which a
            // listener left behind would take (issue 33's panic); it carries data, finishes,
            // and the timers run out.
            &[
                (SYN, 0, 0),
                (RST, 0, 0),
                (SYN, 1, 0),
                (ACK, 1, 0),
                (DATA, 1, 40),
                (FIN, 1, 0),
                (WAIT, 0, 80),
            ],
            // Two connections to one address at once, SYNs the gate must not hold, a refused
            // port, and one never acknowledged past the timeout.
            &[
                (SYN, 0, 0),
                (SYN, 1, 0),
                (BAD_CHECKSUM_SYN, 2, 0),
                (SYN_RST, 3, 0),
                (SYN, 4, 3),
                (ACK, 0, 0),
                (WAIT, 0, 90),
                (ACK, 1, 0),
                (RST, 0, 0),
            ],
        ];
        // The ARP frame padded (as Ethernet pads short frames) to a whole cut, so that its read
        // ends where the ops begin.
        let mut arp = arp_request(gw);
        while !(arp.len() + frame::LENGTH_PREFIX).is_multiple_of(16) {
            arp.push(0);
        }
        for script in scripts {
            let mut input = framed(&[arp.clone()]);
            for (op, a, b) in script {
                input.extend([FIRST + op, *a, *b]);
            }
            seeds.push(input);
        }
        seeds
    }

    #[test]
    fn the_link_seeds_hold_the_fuzz_property_and_reach_past_the_gate() {
        for seed in net_link_seeds() {
            crate::net::fuzz_link(&seed);
        }
        // They are answered: an ARP reply, and the SYN is held for the policy.
        let mut gw = gateway();
        let seed = &net_link_seeds()[0];
        let mut input = &seed[1..];
        let mut decoder = frame::FrameDecoder::new();
        while let Some(f) = decoder.decode(&mut input) {
            gw.receive(f.unwrap()).unwrap();
        }
        gw.poll(Instant::from_millis(1));
        assert_eq!(sent(&mut gw).len(), 1);
        assert_eq!(gw.take_new_flows().len(), 1);
    }

    /// The committed corpus, replayed on every test run.
    #[test]
    fn the_link_fuzz_corpus_holds_the_property() {
        crate::fuzzing::replay_corpus("net_link", crate::net::fuzz_link);
    }

    /// The corpus holds the seeds as they are generated now (`seed-NN`). After changing them,
    /// write them with `KRUNBOX_WRITE_FUZZ_SEEDS=1 cargo test --lib committed_net_link_seeds`.
    #[test]
    fn committed_net_link_seeds_are_the_generated_ones() {
        crate::fuzzing::assert_committed_seeds("net_link", &net_link_seeds());
    }

    #[test]
    fn a_full_output_holds_the_guests_frames_back_instead_of_growing() {
        let mut gw = with_guest_known();
        let far = Ipv4Addr::new(1, 1, 1, 1);
        // Fill the output as if the socket stopped taking bytes.
        gw.output().resize(OUTPUT_MAX - MAX_FRAME, 0);
        gw.receive(stray_ack(far, 80)).unwrap();
        gw.poll(Instant::from_millis(2));
        assert_eq!(gw.port.rx.len(), 1, "the segment waits");
        assert_eq!(
            gw.output().len(),
            OUTPUT_MAX - MAX_FRAME,
            "nothing was added"
        );
        assert_eq!(
            gw.poll_delay(Instant::from_millis(2)),
            None,
            "no spinning while full"
        );
        // The socket took the bytes: the segment of no connection is answered.
        gw.output().clear();
        assert_eq!(gw.poll_delay(Instant::from_millis(3)), Some(Duration::ZERO));
        gw.poll(Instant::from_millis(3));
        assert_eq!(tcp_reply(&sent(&mut gw)[0]), (far, TcpControl::Rst));
    }

    #[test]
    fn the_queue_to_the_stack_is_bounded() {
        let mut gw = with_guest_known();
        let far = Ipv4Addr::new(1, 1, 1, 1);
        for _ in 0..RX_QUEUE_FRAMES {
            gw.receive(stray_ack(far, 80)).unwrap();
        }
        assert!(!gw.has_room());
        assert_eq!(gw.receive(stray_ack(far, 80)), Err(Dropped::QueueFull));
        gw.poll(Instant::from_millis(2));
        assert!(gw.has_room());
        assert!(gw.output().len() <= OUTPUT_MAX);
    }
}
