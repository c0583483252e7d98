//! The host end of the guest's network device: a tokio task that moves frames between the
//! socket libkrun writes to and the [`Gateway`], puts each new flow to the policy, and relays
//! granted connections and DNS answers. It stops with its instance, and every task it started
//! (decisions, lookups, dials, relays) stops with it.

use std::collections::HashMap;
use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::OwnedFd;
use std::sync::Arc;

use hickory_proto::op::ResponseCode;
use smoltcp::socket::tcp::State;
use smoltcp::wire::IpEndpoint;
use tokio::io::Interest;
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::audit::{Audit, Counters, NetworkEvent, Outcome};
use super::dns::{self, GuestQuery, Incoming, Resolved};
use super::dns_stream;
use super::frame::FrameDecoder;
use super::intercept::{self, ca::CertificateAuthority, InterceptJob};
use super::names::{self, Names};
use super::policy::{self, Decision, Flow, Policy, Protocol, Resolver};
use super::relay::{self, FromUpstream, Relay, Upstream, CHUNK};
use super::stack::{FlowKey, Gateway, MAX_UPSTREAM_REQUESTS};
use super::{Addressing, Network, Secret};
use crate::budget::{Budget, Descriptor};
use crate::error::{Error, Result};

/// Bytes read from the socket at once. Frames are decoded out of it only while the gateway's
/// queue has room, and the socket is not read again before they all were.
const READ_BUFFER: usize = 64 * 1024;

/// The longest the task sleeps when the stack has no timer pending.
const IDLE: std::time::Duration = std::time::Duration::from_secs(60);

/// DNS queries waiting for the policy or a resolver. Past it, queries are refused at once.
const MAX_PENDING_DNS: usize = 64;

/// Messages from connection tasks waiting for the service.
const EVENTS: usize = 1024;

/// Datagrams from the guest waiting for a UDP flow's task (more are dropped, as a full
/// network queue drops).
const UDP_QUEUE: usize = 64;

/// A UDP flow with no datagram either way for this long ends.
const UDP_IDLE: std::time::Duration = std::time::Duration::from_secs(60);

/// A running network service; dropping it stops the task (as does the VMM closing its end).
#[derive(Debug)]
pub(crate) struct NetService {
    cancel: CancellationToken,
    /// Each published guest port and the host address it listens on.
    published: Vec<(u16, SocketAddr)>,
    audit: Audit,
    #[cfg_attr(not(test), allow(dead_code))]
    task: tokio::task::JoinHandle<()>,
}

impl Drop for NetService {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl NetService {
    /// Serves the guest's link on `socket` (the library's end of the pair whose other end the
    /// VMM helper gave libkrun), under `network`'s policy; `authority` is the sandbox CA the
    /// guest was told to trust, for intercepted flows.
    pub(crate) fn start(
        network: &Network,
        socket: OwnedFd,
        authority: Option<Arc<CertificateAuthority>>,
        budget: Arc<Budget>,
    ) -> Result<Self> {
        let client_tls = match authority {
            Some(_) => Some(network.upstream_trust_roots().client_config()?),
            None => None,
        };
        let socket = std::os::unix::net::UnixStream::from(socket);
        socket
            .set_nonblocking(true)
            .map_err(Error::io("making the network socket non-blocking"))?;
        let stream =
            UnixStream::from_std(socket).map_err(Error::io("registering the network socket"))?;
        // Published ports listen before `boot()` returns, so a taken port fails the boot
        // (with the VM stopped) rather than a later connection.
        let mut listeners = Vec::new();
        let mut published = Vec::new();
        for p in network.published() {
            let address = SocketAddr::from((Ipv4Addr::LOCALHOST, p.host_port));
            let listener = std::net::TcpListener::bind(address)
                .and_then(|l| l.set_nonblocking(true).map(|()| l))
                .and_then(tokio::net::TcpListener::from_std)
                .map_err(|e| {
                    Error::NetworkSetup(format!(
                        "publishing guest port {} on {address}: {e}",
                        p.guest_port
                    ))
                })?;
            let bound = listener
                .local_addr()
                .map_err(Error::io("reading a published port's address"))?;
            published.push((p.guest_port, bound));
            listeners.push((p.guest_port, listener));
        }
        let cancel = CancellationToken::new();
        let interception = authority.zip(client_tls);
        let audit = Audit::new();
        let prepared = Prepared {
            addressing: network.addressing().clone(),
            policy: network.policy(),
            interception,
            secrets: network.secrets().into(),
            listeners,
            audit: audit.clone(),
            budget,
        };
        let task = tokio::spawn(run(stream, prepared, cancel.clone()).in_current_span());
        Ok(Self {
            cancel,
            published,
            audit,
            task,
        })
    }

    /// A new consumer of the audit events (from now on).
    pub(crate) fn events(&self) -> tokio::sync::broadcast::Receiver<NetworkEvent> {
        self.audit.subscribe()
    }

    /// The network's running totals.
    pub(crate) fn metrics(&self) -> crate::metrics::NetworkMetrics {
        self.audit.counters.read()
    }

    /// The host address a published guest port listens on.
    pub(crate) fn published_address(&self, guest_port: u16) -> Option<SocketAddr> {
        self.published
            .iter()
            .find(|(port, _)| *port == guest_port)
            .map(|(_, address)| *address)
    }

    /// Whether the task has ended (the VMM closed its end, or the instance went).
    #[cfg(test)]
    pub(crate) fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// What the tasks a flow starts tell the service.
enum Event {
    /// A DNS query's outcome: no grant, or the grant's resolver and its answer.
    Dns {
        to: DnsReply,
        query: Box<GuestQuery>,
        outcome: Option<(Resolver, Resolved)>,
    },
    /// A connection is denied, or its upstream could not be reached.
    Refused(FlowKey),
    /// A connection's upstream is connected.
    Connected(FlowKey, TcpStream, Descriptor),
    /// A connection is granted for interception.
    Intercept(FlowKey, Box<InterceptJob>),
    /// A connection to a published port, from the host.
    Published(u16, TcpStream),
    /// A UDP flow is granted; its socket is connected to the upstream.
    UdpConnected(FlowKey, tokio::net::UdpSocket, Descriptor),
    /// A UDP flow is denied, or its upstream could not be reached.
    UdpRefused(FlowKey),
    /// A query the guest sent over TCP (from this address), for the policy.
    StreamQuery(
        Box<GuestQuery>,
        SocketAddr,
        tokio::sync::oneshot::Sender<Vec<u8>>,
    ),
}

/// Where the answer to a guest's DNS query goes.
enum DnsReply {
    /// A datagram to this address of the guest.
    Datagram(IpEndpoint),
    /// The connection the query came on (its task writes it).
    Stream(tokio::sync::oneshot::Sender<Vec<u8>>),
}

/// What a UDP flow's task tells the service.
struct FromUdp {
    key: FlowKey,
    id: u64,
    /// A datagram for the guest; `None`: the flow ended (idle).
    datagram: Option<bytes::Bytes>,
}

/// The service's side of a granted UDP flow.
struct UdpRelay {
    id: u64,
    to_upstream: mpsc::Sender<bytes::Bytes>,
    task: tokio::task::AbortHandle,
}

impl Drop for UdpRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The service's state, owned by its task.
struct Service {
    gateway: Gateway,
    names: Names,
    policy: Option<Arc<dyn Policy>>,
    /// The sandbox CA and the upstream TLS configuration, for intercepted flows.
    interception: Option<(Arc<CertificateAuthority>, Arc<rustls::ClientConfig>)>,
    /// The network's secrets, swapped in on intercepted requests.
    secrets: Arc<[Secret]>,
    /// Intercepted requests in flight upstream, for all the sandbox's connections.
    upstream_permits: Arc<tokio::sync::Semaphore>,
    audit: Audit,
    /// Cancelled when the service stops: ends the tasks hyper starts outside `tasks`.
    stop: CancellationToken,
    addressing: Addressing,
    /// Every task started for a flow; dropping the set aborts them all.
    tasks: JoinSet<()>,
    events: (mpsc::Sender<Event>, mpsc::Receiver<Event>),
    upstream: (mpsc::Sender<FromUpstream>, mpsc::Receiver<FromUpstream>),
    /// Woken when a relay's channel to upstream has room again.
    wake: Arc<Notify>,
    relays: HashMap<FlowKey, Relay>,
    udp: (mpsc::Sender<FromUdp>, mpsc::Receiver<FromUdp>),
    udp_relays: HashMap<FlowKey, UdpRelay>,
    next_relay: u64,
    pending_dns: usize,
    /// The sandbox's share of the process's descriptors and blocking threads: every upstream
    /// socket and system-resolver lookup is charged to it.
    budget: Arc<Budget>,
}

/// What [`NetService::start`] prepared for the task.
struct Prepared {
    addressing: Addressing,
    policy: Option<Arc<dyn Policy>>,
    interception: Option<(Arc<CertificateAuthority>, Arc<rustls::ClientConfig>)>,
    secrets: Arc<[Secret]>,
    listeners: Vec<(u16, tokio::net::TcpListener)>,
    audit: Audit,
    budget: Arc<Budget>,
}

async fn run(stream: UnixStream, prepared: Prepared, cancel: CancellationToken) {
    let Prepared {
        addressing,
        policy,
        interception,
        secrets,
        listeners,
        audit,
        budget,
    } = prepared;
    let started = std::time::Instant::now();
    let now = || smoltcp::time::Instant::from_micros(started.elapsed().as_micros() as i64);
    let mut service = Service {
        gateway: Gateway::new(addressing.clone(), now()),
        names: Names::new(),
        policy,
        interception,
        secrets,
        upstream_permits: Arc::new(tokio::sync::Semaphore::new(MAX_UPSTREAM_REQUESTS)),
        audit,
        stop: cancel.child_token(),
        addressing,
        tasks: JoinSet::new(),
        events: mpsc::channel(EVENTS),
        upstream: mpsc::channel(EVENTS),
        wake: Arc::new(Notify::new()),
        relays: HashMap::new(),
        udp: mpsc::channel(EVENTS),
        udp_relays: HashMap::new(),
        next_relay: 0,
        pending_dns: 0,
        budget,
    };
    for (guest_port, listener) in listeners {
        let events = service.events.0.clone();
        service.tasks.spawn(
            async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        // Out of descriptors, most likely: try again shortly rather than spin.
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    if events
                        .send(Event::Published(guest_port, stream))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            }
            .in_current_span(),
        );
    }
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; READ_BUFFER];
    // buf[start..end] was read and not yet decoded.
    let (mut start, mut end) = (0, 0);
    let outcome = loop {
        let mut input = &buf[start..end];
        while service.gateway.has_room() {
            match decoder.decode(&mut input) {
                Some(Ok(frame)) => {
                    let _ = service.gateway.receive(frame);
                }
                Some(Err(err)) => {
                    tracing::debug!(target: "krunbox::net", "refused a frame from the guest: {err}");
                }
                None => break,
            }
        }
        start = end - input.len();
        service.gateway.poll(now());
        service.start_flows();
        if service.pump() {
            service.gateway.poll(now());
        }
        while service.tasks.try_join_next().is_some() {}
        let gateway = &mut service.gateway;
        let mut interest = None;
        if start == end && gateway.has_room() {
            interest = Some(Interest::READABLE);
        }
        if !gateway.output().is_empty() {
            interest = Some(interest.map_or(Interest::WRITABLE, |i| i | Interest::WRITABLE));
        }
        let delay = gateway
            .poll_delay(now())
            .map_or(IDLE, |d| std::time::Duration::from_micros(d.total_micros()));
        let ready = async {
            match interest {
                Some(interest) => stream.ready(interest).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => break "the instance went",
            ready = ready => {
                let ready = match ready {
                    Ok(ready) => ready,
                    Err(_) => break "the socket failed",
                };
                if ready.is_readable() && start == end {
                    match stream.try_read(&mut buf) {
                        Ok(0) => {
                            if let Err(err) = decoder.finish() {
                                tracing::debug!(target: "krunbox::net", "at the link's end: {err}");
                            }
                            break "the VMM closed the link";
                        }
                        Ok(n) => (start, end) = (0, n),
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                        Err(_) => break "reading the socket failed",
                    }
                }
                let gateway = &mut service.gateway;
                if ready.is_writable() && !gateway.output().is_empty() {
                    match stream.try_write(gateway.output()) {
                        Ok(n) => {
                            gateway.output().drain(..n);
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                        Err(_) => break "writing the socket failed",
                    }
                }
            }
            Some(event) = service.events.1.recv() => service.handle(event),
            Some(message) = service.upstream.1.recv() => {
                service.on_upstream(message);
                // Take what else is waiting, so one pass of the stack carries it all.
                for _ in 0..64 {
                    let Ok(message) = service.upstream.1.try_recv() else { break };
                    service.on_upstream(message);
                }
            }
            Some(message) = service.udp.1.recv() => service.on_udp(message),
            _ = service.wake.notified() => {}
            _ = tokio::time::sleep(delay) => {}
        }
    };
    let counters = &service.gateway.counters;
    tracing::debug!(
        target: "krunbox::net",
        admitted = counters.admitted,
        dropped = counters.dropped,
        tcp_refused = counters.tcp_refused,
        "network service stopped: {outcome}"
    );
}

impl Service {
    /// Puts the flows the gateway held since the last pass to the policy.
    fn start_flows(&mut self) {
        for key in self.gateway.take_new_flows() {
            self.start_connection(key);
        }
        for key in self.gateway.take_new_udp_flows() {
            self.start_udp(key);
        }
        for (bytes, from) in self.gateway.take_dns_queries() {
            match dns::incoming(&bytes) {
                Incoming::Ignore => {}
                Incoming::Answer(answer) => self.gateway.send_dns(from, &answer),
                Incoming::Query(query) => {
                    self.start_query(DnsReply::Datagram(from), endpoint_addr(from), query)
                }
            }
        }
    }

    /// The flow `key` is as the policy sees it, and the resolver to ask again if its name's
    /// answer has expired; `None` (audited as denied) when there is no policy, or the guest
    /// sent to an address of the sandbox's pool that stands for no name (forgotten, or never
    /// given out: there is nothing to dial).
    fn flow_for(
        &mut self,
        key: FlowKey,
        protocol: Protocol,
    ) -> Option<(Arc<dyn Policy>, Flow, Option<Resolver>)> {
        let mut flow = Flow {
            protocol,
            source: key.guest.into(),
            destination: key.destination.into(),
            hostname: None,
            upstream: Vec::new(),
        };
        let Some(policy) = self.policy.clone() else {
            self.audit.decided(&flow, Outcome::Denied, None);
            return None;
        };
        let destination = *key.destination.ip();
        if !Names::is_pool_address(destination) {
            flow.upstream = vec![IpAddr::V4(destination)];
            return Some((policy, flow, None));
        }
        let now = std::time::Instant::now();
        let Some((name, record)) = self.names.lookup(destination, now) else {
            self.audit.decided(&flow, Outcome::Denied, None);
            return None;
        };
        let fresh = record.fresh_upstream(now);
        flow.upstream = fresh.map(<[IpAddr]>::to_vec).unwrap_or_default();
        flow.hostname = Some(name);
        let stale = fresh.is_none().then_some(record.resolver);
        Some((policy, flow, stale))
    }

    fn start_udp(&mut self, key: FlowKey) {
        let Some((policy, mut flow, stale)) = self.flow_for(key, Protocol::Udp) else {
            self.gateway.refuse_udp(key);
            return;
        };
        let flow_span = tracing::info_span!("flow", %flow);
        let events = self.events.0.clone();
        let audit = self.audit.clone();
        let budget = self.budget.clone();
        self.tasks.spawn(
            async move {
                if let (Some(resolver), Some(name)) = (stale, flow.hostname.clone()) {
                    if let Resolved::Addresses(addresses, _) =
                        dns::resolve(&resolver.0, &name, &budget).await
                    {
                        flow.upstream = addresses;
                    }
                }
                let port = key.destination.port();
                let verdict = policy::ask(&*policy, flow.clone()).await;
                let target = match verdict.0 {
                    Decision::Accept => flow.upstream.first().map(|ip| SocketAddr::new(*ip, port)),
                    Decision::ConnectTo(address) => Some(address),
                    _ => None,
                };
                let Some(target) = target else {
                    audit.decided(&flow, Outcome::Denied, None);
                    let _ = events.send(Event::UdpRefused(key)).await;
                    return;
                };
                let local: SocketAddr = match target {
                    SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
                    SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
                };
                let connected = async {
                    if target.ip().is_unspecified() {
                        // As for TCP (relay::dial): 0.0.0.0 would be the host itself.
                        return Err(std::io::Error::other(
                            "the unspecified address is never sent to (it reaches the host itself)",
                        ));
                    }
                    let charge = budget.descriptor().ok_or_else(|| {
                        std::io::Error::other(
                            "the sandbox holds as many host descriptors as it may \
                         (Limits::host_descriptors)",
                        )
                    })?;
                    let socket = tokio::net::UdpSocket::bind(local).await?;
                    socket.connect(target).await?;
                    Ok::<_, std::io::Error>((socket, charge))
                };
                match connected.await {
                    Ok((socket, charge)) => {
                        audit.decided(&flow, Outcome::from(&verdict.0), Some(target));
                        let _ = events.send(Event::UdpConnected(key, socket, charge)).await;
                    }
                    Err(err) => {
                        audit.unreachable(&flow, format!("{target}: {err}"));
                        let _ = events.send(Event::UdpRefused(key)).await;
                    }
                }
            }
            .instrument(flow_span),
        );
    }

    fn on_udp(&mut self, message: FromUdp) {
        if self.udp_relays.get(&message.key).map(|r| r.id) != Some(message.id) {
            return;
        }
        match message.datagram {
            Some(datagram) => {
                Counters::add(&self.audit.counters.bytes_to_guest, datagram.len() as u64);
                self.gateway.send_udp(&message.key, &datagram)
            }
            None => {
                self.udp_relays.remove(&message.key);
                self.gateway.remove_udp(&message.key);
            }
        }
    }

    fn start_connection(&mut self, key: FlowKey) {
        if key.destination == SocketAddrV4::new(self.addressing.dns, 53) {
            self.start_dns_stream(key);
            return;
        }
        let Some((policy, flow, stale)) = self.flow_for(key, Protocol::Tcp) else {
            self.gateway.refuse_tcp(key);
            return;
        };
        let flow_span = tracing::info_span!("flow", %flow);
        let events = self.events.0.clone();
        let interception = self.interception.clone();
        let secrets = self.secrets.clone();
        let upstream_permits = self.upstream_permits.clone();
        let audit = self.audit.clone();
        let stop = self.stop.clone();
        let budget = self.budget.clone();
        self.tasks.spawn(
            async move {
                let mut flow = flow;
                // The record expired: ask its resolver again, so the policy sees (and the host
                // dials) a current answer.
                if let (Some(resolver), Some(name)) = (stale, flow.hostname.clone()) {
                    if let Resolved::Addresses(addresses, _) =
                        dns::resolve(&resolver.0, &name, &budget).await
                    {
                        flow.upstream = addresses;
                    }
                }
                let port = key.destination.port();
                let mut verdict = policy::ask(&*policy, flow.clone()).await;
                // An accepted connection to a host a secret is bound to is intercepted, so the
                // secret's placeholder can be swapped for its value.
                let bound = flow
                    .hostname
                    .as_deref()
                    .is_some_and(|name| secrets.iter().any(|s| s.is_bound_to(name)));
                // Only on 443: the swap needs TLS (see intercept), and anything else to that host
                // (SSH, a plain port) must not be broken by an HTTP server in its way.
                if bound && verdict.0 == Decision::Accept && port == 443 {
                    verdict = policy::Verdict::intercept(intercept::Intercept::new());
                }
                let targets: Vec<SocketAddr> = match verdict.0 {
                    Decision::Accept => flow
                        .upstream
                        .iter()
                        .map(|ip| SocketAddr::new(*ip, port))
                        .collect(),
                    Decision::ConnectTo(address) => vec![address],
                    Decision::Intercept(ref intercept) => {
                        let event = match (&flow.hostname, interception) {
                            (Some(hostname), Some((authority, client_tls)))
                                if !flow.upstream.is_empty() =>
                            {
                                audit.decided(&flow, Outcome::Intercepted, None);
                                let job = InterceptJob {
                                    hostname: hostname.clone(),
                                    port,
                                    upstream: flow
                                        .upstream
                                        .iter()
                                        .map(|ip| SocketAddr::new(*ip, port))
                                        .collect(),
                                    intercept: intercept.clone(),
                                    secrets,
                                    authority,
                                    client_tls,
                                    audit: audit.clone(),
                                    upstream_permits,
                                    stop,
                                    budget: budget.clone(),
                                };
                                Event::Intercept(key, Box::new(job))
                            }
                            _ => {
                                // Interception needs a trusted hostname with an answer.
                                audit.decided(&flow, Outcome::Denied, None);
                                Event::Refused(key)
                            }
                        };
                        let _ = events.send(event).await;
                        return;
                    }
                    // Deny, or a grant that does not fit a connection (resolve).
                    _ => {
                        audit.decided(&flow, Outcome::Denied, None);
                        let _ = events.send(Event::Refused(key)).await;
                        return;
                    }
                };
                match relay::dial(&targets, &budget).await {
                    Ok((stream, charge)) => {
                        audit.decided(&flow, Outcome::from(&verdict.0), stream.peer_addr().ok());
                        let _ = events.send(Event::Connected(key, stream, charge)).await;
                    }
                    Err(why) => {
                        audit.unreachable(&flow, why);
                        let _ = events.send(Event::Refused(key)).await;
                    }
                }
            }
            .instrument(flow_span),
        );
    }

    /// Serves DNS over TCP on a connection to the resolver's port 53 (`dns_stream`): its
    /// queries come back to the service as [`Event::StreamQuery`], and go to the policy as a
    /// datagram's do.
    fn start_dns_stream(&mut self, key: FlowKey) {
        if !self.gateway.accept_tcp(key) {
            return;
        }
        let events = self.events.0.clone();
        let source = SocketAddr::from(key.guest);
        let ask = move |query: GuestQuery| {
            let events = events.clone();
            async move {
                let (answer, answered) = tokio::sync::oneshot::channel();
                let event = Event::StreamQuery(Box::new(query), source, answer);
                events.send(event).await.ok()?;
                answered.await.ok()
            }
        };
        self.start_relay(key, |guest| dns_stream::serve(guest, ask));
    }

    /// Sends the answer to a guest's DNS query where it goes.
    fn reply_dns(&mut self, to: DnsReply, answer: Option<Vec<u8>>) {
        let Some(answer) = answer else { return };
        match to {
            DnsReply::Datagram(to) => self.gateway.send_dns(to, &answer),
            // The connection may be gone: then nobody waits for it.
            DnsReply::Stream(answered) => drop(answered.send(answer)),
        }
    }

    fn start_query(&mut self, to: DnsReply, source: SocketAddr, query: GuestQuery) {
        let Some(policy) = self.policy.clone() else {
            self.reply_dns(to, query.fail(ResponseCode::Refused));
            return;
        };
        if self.pending_dns >= MAX_PENDING_DNS {
            tracing::debug!(target: "krunbox::net", "too many DNS queries pending: refused one");
            self.reply_dns(to, query.fail(ResponseCode::Refused));
            return;
        }
        self.pending_dns += 1;
        let events = self.events.0.clone();
        let audit = self.audit.clone();
        let budget = self.budget.clone();
        let flow = Flow {
            protocol: Protocol::Dns,
            source,
            destination: SocketAddrV4::new(self.addressing.dns, 53).into(),
            hostname: Some(query.name.as_str().into()),
            upstream: Vec::new(),
        };
        let flow_span = tracing::info_span!("flow", %flow);
        self.tasks.spawn(
            async move {
                let verdict = policy::ask(&*policy, flow.clone()).await;
                let outcome = match verdict.0 {
                    Decision::Resolve(resolver) => {
                        audit.decided(&flow, Outcome::Resolved, None);
                        // Only A queries are answered with an address: the rest of a granted
                        // name's types get no records, with no lookup.
                        let resolved = if query.record_type == hickory_proto::rr::RecordType::A {
                            dns::resolve(&resolver.0, &query.name, &budget).await
                        } else {
                            Resolved::Addresses(Vec::new(), None)
                        };
                        Some((resolver, resolved))
                    }
                    // Deny, or a grant that does not fit a query.
                    _ => {
                        audit.decided(&flow, Outcome::Denied, None);
                        None
                    }
                };
                let _ = events
                    .send(Event::Dns {
                        to,
                        query: Box::new(query),
                        outcome,
                    })
                    .await;
            }
            .instrument(flow_span),
        );
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Dns { to, query, outcome } => {
                self.pending_dns -= 1;
                let answer = match outcome {
                    None => query.fail(ResponseCode::Refused),
                    Some((_, Resolved::Addresses(addresses, _))) if addresses.is_empty() => {
                        query.fail(ResponseCode::NoError)
                    }
                    Some((resolver, Resolved::Addresses(addresses, ttl))) => {
                        let now = std::time::Instant::now();
                        let address = self
                            .names
                            .record(&query.name, addresses, ttl, resolver, now);
                        query.answer(address, names::guest_ttl(ttl))
                    }
                    Some((_, Resolved::NoSuchName)) => query.fail(ResponseCode::NXDomain),
                    Some((_, Resolved::Failed(why))) => {
                        tracing::info!(
                            target: "krunbox::net",
                            name = %query.name,
                            "a granted name could not be resolved: {why}"
                        );
                        query.fail(ResponseCode::ServFail)
                    }
                };
                self.reply_dns(to, answer);
            }
            Event::StreamQuery(query, source, answered) => {
                self.start_query(DnsReply::Stream(answered), source, *query)
            }
            Event::Refused(key) => self.gateway.refuse_tcp(key),
            Event::UdpRefused(key) => self.gateway.refuse_udp(key),
            Event::UdpConnected(key, socket, charge) => {
                if self.gateway.accept_udp(key) {
                    self.next_relay += 1;
                    let id = self.next_relay;
                    let (to_upstream, from_guest) = mpsc::channel(UDP_QUEUE);
                    let relayed = relay_udp(key, id, socket, from_guest, self.udp.0.clone());
                    let task = self.tasks.spawn(
                        async move {
                            let _charge = charge;
                            relayed.await
                        }
                        .in_current_span(),
                    );
                    self.udp_relays.insert(
                        key,
                        UdpRelay {
                            id,
                            to_upstream,
                            task,
                        },
                    );
                }
            }
            Event::Published(guest_port, stream) => {
                // Past the bound, the host's connection is closed at once (dropped), and is
                // not in the audit.
                if let Some(key) = self.gateway.connect_tcp(guest_port) {
                    if let Ok(peer) = stream.peer_addr() {
                        self.audit.published(guest_port, peer);
                    }
                    self.start_relay(key, |guest| relay::splice(guest, stream));
                }
            }
            Event::Intercept(key, job) => {
                if self.gateway.accept_tcp(key) {
                    self.start_relay(key, |guest| intercept::serve(guest, *job));
                }
            }
            Event::Connected(key, stream, charge) => {
                if self.gateway.accept_tcp(key) {
                    self.start_relay(key, |guest| async move {
                        let _charge = charge;
                        relay::splice(guest, stream).await
                    });
                }
            }
        }
    }

    /// Starts the task that serves connection `key`'s guest end with `serve`.
    fn start_relay<F, Fut>(&mut self, key: FlowKey, serve: F)
    where
        F: FnOnce(relay::GuestStream) -> Fut,
        Fut: std::future::Future<Output = std::io::Result<()>> + Send + 'static,
    {
        // The connection's own span (below the instance's): its relay task and what serves it
        // (an intercepted connection's requests) are traced in it.
        let span = tracing::info_span!(
            "connection",
            guest = %key.guest,
            destination = %key.destination
        );
        let _in_connection = span.enter();
        self.next_relay += 1;
        let relay = Relay::start(
            key,
            self.next_relay,
            self.upstream.0.clone(),
            self.wake.clone(),
            &mut self.tasks,
            serve,
        );
        self.relays.insert(key, relay);
    }

    fn on_upstream(&mut self, message: FromUpstream) {
        let Some(relay) = self.relays.get_mut(&message.key) else {
            return;
        };
        if relay.id != message.id {
            return;
        }
        match message.what {
            Upstream::Data(data) => relay.from_upstream.push_back(data),
            Upstream::Finished => relay.upstream_finished = true,
            Upstream::Failed => relay.upstream_failed = true,
        }
    }

    /// Moves bytes between each relayed connection's socket and its task, passes on each
    /// end's finish, and forgets connections that are over. Returns whether a socket changed
    /// (so the stack has something to send).
    fn pump(&mut self) -> bool {
        let mut changed = false;
        for (key, datagram) in self.gateway.take_udp_datagrams() {
            Counters::add(&self.audit.counters.bytes_from_guest, datagram.len() as u64);
            if let Some(relay) = self.udp_relays.get(&key) {
                // A full queue drops the datagram, as a congested network would.
                let _ = relay.to_upstream.try_send(datagram.into());
            }
        }
        let mut over = Vec::new();
        for (key, relay) in &mut self.relays {
            let Some(socket) = self.gateway.tcp(key) else {
                over.push(*key);
                continue;
            };
            // Guest to upstream, while the task's channel has room.
            if let Some(to_upstream) = &relay.to_upstream {
                while socket.can_recv() {
                    let Ok(permit) = to_upstream.try_reserve() else {
                        break;
                    };
                    let Ok(chunk) = socket.recv(|buf| {
                        let n = buf.len().min(CHUNK);
                        (n, bytes::Bytes::copy_from_slice(&buf[..n]))
                    }) else {
                        break;
                    };
                    Counters::add(&self.audit.counters.bytes_from_guest, chunk.len() as u64);
                    permit.send(chunk);
                    changed = true;
                }
                let guest_finished = matches!(
                    socket.state(),
                    State::CloseWait | State::LastAck | State::Closing | State::TimeWait
                ) && !socket.can_recv();
                if guest_finished || to_upstream.is_closed() {
                    relay.to_upstream = None;
                }
            }
            // Upstream to guest, as far as the socket takes it.
            while let Some(front) = relay.from_upstream.front() {
                match socket.send_slice(front) {
                    Ok(n) if n > 0 => {
                        Counters::add(&self.audit.counters.bytes_to_guest, n as u64);
                        relay.took(n);
                        changed = true;
                    }
                    _ => break,
                }
            }
            if relay.upstream_failed && !relay.closed_to_guest {
                // The reset goes out at the next poll: the socket must outlive this pass, or
                // the guest never hears of it and waits on a connection that is gone.
                socket.abort();
                relay.closed_to_guest = true;
                changed = true;
                continue;
            } else if relay.upstream_finished
                && relay.from_upstream.is_empty()
                && !relay.closed_to_guest
                && socket.may_send()
            {
                socket.close();
                relay.closed_to_guest = true;
                changed = true;
            }
            if matches!(socket.state(), State::Closed | State::TimeWait) {
                over.push(*key);
            }
        }
        for key in over {
            self.relays.remove(&key);
            self.gateway.remove_tcp(&key);
        }
        self.audit.counters.open_connections.store(
            self.relays.len() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        changed
    }
}

/// One granted UDP flow's task: datagrams from the guest go out on `socket` (connected to the
/// upstream), datagrams from the upstream back to the service; it ends after [`UDP_IDLE`]
/// without either.
async fn relay_udp(
    key: FlowKey,
    id: u64,
    socket: tokio::net::UdpSocket,
    mut from_guest: mpsc::Receiver<bytes::Bytes>,
    to_service: mpsc::Sender<FromUdp>,
) {
    // The largest datagram the guest's link can carry back (an IPv4 MTU of 1500).
    let mut buf = vec![0u8; 1472];
    loop {
        tokio::select! {
            datagram = from_guest.recv() => match datagram {
                Some(datagram) => {
                    let _ = socket.send(&datagram).await;
                }
                None => break,
            },
            received = socket.recv(&mut buf) => {
                // Errors (an ICMP unreachable for an earlier datagram) lose nothing: go on.
                if let Ok(n) = received {
                    let message = FromUdp {
                        key,
                        id,
                        datagram: Some(bytes::Bytes::copy_from_slice(&buf[..n])),
                    };
                    // A busy service drops the datagram rather than hold the socket.
                    let _ = to_service.try_send(message);
                }
            }
            _ = tokio::time::sleep(UDP_IDLE) => break,
        }
    }
    let _ = to_service
        .send(FromUdp {
            key,
            id,
            datagram: None,
        })
        .await;
}

fn endpoint_addr(endpoint: IpEndpoint) -> SocketAddr {
    match endpoint.addr {
        smoltcp::wire::IpAddress::Ipv4(addr) => SocketAddrV4::new(addr, endpoint.port).into(),
        #[allow(unreachable_patterns)]
        _ => SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, endpoint.port).into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::frame;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn the_service_answers_over_the_stream_and_stops_when_the_vmm_end_closes() {
        let (ours, mut vmm) = UnixStream::pair().unwrap();
        let ours = OwnedFd::from(ours.into_std().unwrap());
        let budget = crate::budget::Budget::new(&crate::Limits::new());
        let service = NetService::start(&Network::deny_all(), ours, None, budget).unwrap();
        // An ARP request for the gateway, framed as libkrun frames it; then garbage lengths.
        let addressing = Addressing::default();
        let mut arp = Vec::new();
        arp.extend_from_slice(&[0xff; 6]);
        arp.extend_from_slice(&addressing.guest_mac);
        arp.extend_from_slice(&[0x08, 0x06, 0, 1, 8, 0, 6, 4, 0, 1]);
        arp.extend_from_slice(&addressing.guest_mac);
        arp.extend_from_slice(&addressing.guest.octets());
        arp.extend_from_slice(&[0; 6]);
        arp.extend_from_slice(&addressing.gateway.octets());
        let mut stream = Vec::new();
        stream.extend_from_slice(&3u32.to_be_bytes());
        stream.extend_from_slice(&[1, 2, 3]);
        frame::encode(&arp, &mut stream).unwrap();
        vmm.write_all(&stream).await.unwrap();
        let mut len = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(5), vmm.read_exact(&mut len))
            .await
            .unwrap()
            .unwrap();
        let mut reply = vec![0u8; u32::from_be_bytes(len) as usize];
        vmm.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply[..6], &addressing.guest_mac, "addressed to the guest");
        assert_eq!(&reply[20..22], &[0, 2], "an ARP reply");
        drop(vmm);
        tokio::time::timeout(Duration::from_secs(5), async {
            while !service.is_finished() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the task ends when the VMM's end closes");
    }

    #[tokio::test]
    async fn dropping_the_service_stops_its_task_and_closes_the_link() {
        let (ours, mut vmm) = UnixStream::pair().unwrap();
        let service = NetService::start(
            &Network::deny_all(),
            OwnedFd::from(ours.into_std().unwrap()),
            None,
            crate::budget::Budget::new(&crate::Limits::new()),
        )
        .unwrap();
        drop(service);
        // The task ended and dropped its end: the VMM's end reads EOF.
        let mut byte = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), vmm.read(&mut byte))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n, 0);
    }
}
