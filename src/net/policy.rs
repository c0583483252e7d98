//! The policy: the caller's decision on each new flow the guest starts.
//!
//! A [`Flow`] says what the guest asked for (protocol, addresses, and the flow's trusted
//! hostname, if it has one); the [`Policy`] answers with a [`Verdict`]. The gateway asks once
//! per flow, in a task of that flow's own, so a slow or failing callback holds up nothing else.

use std::fmt;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use super::address::{classify, AddressClass};

/// What a guest flow is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Protocol {
    /// A DNS query to the sandbox's resolver (the gateway). [`Flow::hostname`] is the name
    /// asked; a [`Verdict::resolve`] answers it.
    Dns,
    /// A TCP connection. A [`Verdict::accept`] makes the host dial the upstream and splice it
    /// to the guest.
    Tcp,
    /// A UDP flow: datagrams between one guest port and one destination (anything but DNS to
    /// the gateway). A [`Verdict::accept`] makes the host send them on from a UDP socket of
    /// its own, and the answers back; the flow ends after a minute without a datagram.
    Udp,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Dns => "dns",
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        })
    }
}

/// A new flow from the guest, as the policy sees it.
///
/// The [`hostname`](Flow::hostname) of a connection comes only from a DNS answer this sandbox
/// accepted: the guest dialled an address the gateway handed out for that name. Nothing the
/// guest sends on the connection (a `Host` header, a TLS server name) sets or changes it.
///
/// ```
/// use krunbox::net::{Flow, Protocol, Verdict};
///
/// async fn decide(flow: Flow) -> Verdict {
///     match (flow.protocol(), flow.hostname()) {
///         (Protocol::Dns, Some("pypi.org" | "files.pythonhosted.org")) => {
///             Verdict::resolve(krunbox::net::Resolver::system())
///         }
///         (Protocol::Tcp, Some("pypi.org" | "files.pythonhosted.org"))
///             if flow.destination().port() == 443 && flow.upstream_class().is_public() =>
///         {
///             Verdict::accept()
///         }
///         _ => Verdict::deny(),
///     }
/// }
/// ```
#[derive(Debug, Clone)]
pub struct Flow {
    pub(crate) protocol: Protocol,
    pub(crate) source: SocketAddr,
    pub(crate) destination: SocketAddr,
    pub(crate) hostname: Option<Arc<str>>,
    pub(crate) upstream: Vec<IpAddr>,
}

impl Flow {
    /// Whether this is a DNS query, a TCP connection or a UDP flow.
    ///
    /// ```
    /// # fn f(flow: krunbox::net::Flow) -> bool {
    /// flow.protocol() == krunbox::net::Protocol::Tcp
    /// # }
    /// ```
    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// The guest's end: its address and port.
    ///
    /// ```
    /// # fn f(flow: krunbox::net::Flow) {
    /// println!("from {}", flow.source());
    /// # }
    /// ```
    pub fn source(&self) -> SocketAddr {
        self.source
    }

    /// The address and port the guest sent to. For a DNS query, the gateway's port 53. For a
    /// connection to a name, the address the gateway's DNS answer gave the guest for that name
    /// (an address of the sandbox's own, see [`Flow::upstream`] for the real one).
    ///
    /// ```
    /// # fn f(flow: krunbox::net::Flow) -> bool {
    /// flow.destination().port() == 443
    /// # }
    /// ```
    pub fn destination(&self) -> SocketAddr {
        self.destination
    }

    /// The flow's hostname, lower case without the final dot: for a DNS query, the name asked;
    /// for a connection, the name whose accepted DNS answer the guest dialled. `None` for a
    /// connection to an address the guest had from anywhere else.
    ///
    /// ```
    /// # fn f(flow: krunbox::net::Flow) -> bool {
    /// flow.hostname().is_some_and(|name| name == "example.com" || name.ends_with(".example.com"))
    /// # }
    /// ```
    pub fn hostname(&self) -> Option<&str> {
        self.hostname.as_deref()
    }

    /// The addresses the host would dial on [`Verdict::accept`]: the recorded answers of the
    /// hostname, or the destination address itself for a connection without one. Empty for a
    /// DNS query.
    ///
    /// ```
    /// # fn f(flow: krunbox::net::Flow) {
    /// for addr in flow.upstream() {
    ///     println!("would dial {addr}");
    /// }
    /// # }
    /// ```
    pub fn upstream(&self) -> &[IpAddr] {
        &self.upstream
    }

    /// The class of the addresses the host would dial (the least public of them, so one
    /// private answer among public ones makes the flow [`AddressClass::Private`]). For a DNS
    /// query, the class of the destination (the gateway: private).
    ///
    /// ```
    /// # fn f(flow: krunbox::net::Flow) -> krunbox::net::Verdict {
    /// use krunbox::net::{AddressClass, Verdict};
    /// match flow.upstream_class() {
    ///     AddressClass::Public => Verdict::accept(),
    ///     _ => Verdict::deny(), // loopback, private, link-local, cloud metadata, ...
    /// }
    /// # }
    /// ```
    pub fn upstream_class(&self) -> AddressClass {
        let mut classes = self.upstream.iter().map(|a| classify(*a));
        match classes.find(|c| !c.is_public()) {
            Some(internal) => internal,
            None if self.upstream.is_empty() => classify(self.destination.ip()),
            None => AddressClass::Public,
        }
    }
}

impl fmt::Display for Flow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} -> {}",
            self.protocol, self.source, self.destination
        )?;
        if let Some(name) = &self.hostname {
            write!(f, " ({name})")?;
        }
        Ok(())
    }
}

/// The policy's answer for one flow. Anything but a grant that fits the flow's protocol
/// blocks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict(pub(crate) Decision);

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    Deny,
    Accept,
    ConnectTo(SocketAddr),
    Resolve(Resolver),
    Intercept(super::Intercept),
}

impl Verdict {
    /// Blocks the flow: a DNS query is answered `REFUSED`, a connection is reset.
    ///
    /// ```
    /// let verdict = krunbox::net::Verdict::deny();
    /// assert!(!verdict.is_grant());
    /// ```
    pub fn deny() -> Self {
        Self(Decision::Deny)
    }

    /// Grants a connection as the guest asked: the host dials [`Flow::upstream`] on the
    /// destination port (each address in turn until one answers) and splices the two. The
    /// guest's connection is completed only once the upstream one is, so an upstream that
    /// refuses looks refused to the guest too. For a UDP flow, the host sends the guest's
    /// datagrams to the first of [`Flow::upstream`] from a socket of its own, and the
    /// answers back.
    ///
    /// ```
    /// assert!(krunbox::net::Verdict::accept().is_grant());
    /// ```
    pub fn accept() -> Self {
        Self(Decision::Accept)
    }

    /// Grants a connection (or a UDP flow), dialling `upstream` instead of what the guest
    /// asked for, e.g. a server on the host's loopback standing in for a name.
    ///
    /// ```
    /// let verdict = krunbox::net::Verdict::connect_to("127.0.0.1:8080".parse().unwrap());
    /// assert!(verdict.is_grant());
    /// ```
    pub fn connect_to(upstream: SocketAddr) -> Self {
        Self(Decision::ConnectTo(upstream))
    }

    /// Grants a DNS query: `resolver` resolves the name, the answer is recorded as the name's
    /// trusted addresses, and the guest gets an address of the sandbox's own standing for the
    /// name (so a later connection to it is known to be for this name and nothing else).
    ///
    /// ```
    /// use krunbox::net::{Resolver, Verdict};
    /// let verdict = Verdict::resolve(Resolver::fixed(["127.0.0.1".parse().unwrap()]));
    /// assert!(verdict.is_grant());
    /// ```
    pub fn resolve(resolver: Resolver) -> Self {
        Self(Decision::Resolve(resolver))
    }

    /// Grants a connection to a named host as HTTP(S) the host answers itself: TLS is
    /// terminated with a certificate for the flow's trusted hostname from the sandbox's own CA
    /// (which the guest trusts), each request goes through `intercept`'s middleware, and is
    /// sent on to the name's recorded addresses, over TLS verified against the network's
    /// [`UpstreamTrust`](crate::net::UpstreamTrust) if the guest spoke TLS. A request for any
    /// other authority is answered `421` and goes nowhere; bytes that are not HTTP end the
    /// connection. A connection without a trusted hostname (an address the guest dialled
    /// directly) is refused.
    ///
    /// ```
    /// use krunbox::net::{HeaderName, HeaderValue, Intercept, Verdict};
    /// let verdict = Verdict::intercept(Intercept::new().set_header(
    ///     HeaderName::from_static("authorization"),
    ///     HeaderValue::from_static("Bearer real-token"),
    /// ));
    /// assert!(verdict.is_grant());
    /// ```
    pub fn intercept(intercept: super::Intercept) -> Self {
        Self(Decision::Intercept(intercept))
    }

    /// The interception this verdict grants, if it is [`Verdict::intercept`]: so a policy can
    /// add middleware to a verdict it was given (by [`Rules`](crate::net::Rules), say).
    ///
    /// ```
    /// use krunbox::net::{HeaderName, HeaderValue, Intercept, Verdict};
    /// # fn f(verdict: Verdict) -> Verdict {
    /// match verdict.interception() {
    ///     Some(intercept) => Verdict::intercept(intercept.clone().set_header(
    ///         HeaderName::from_static("x-team"),
    ///         HeaderValue::from_static("agents"),
    ///     )),
    ///     None => verdict,
    /// }
    /// # }
    /// assert!(Verdict::accept().interception().is_none());
    /// ```
    pub fn interception(&self) -> Option<&super::Intercept> {
        match &self.0 {
            Decision::Intercept(intercept) => Some(intercept),
            _ => None,
        }
    }

    /// Whether this lets the flow through (if its protocol fits the grant).
    ///
    /// ```
    /// assert!(!krunbox::net::Verdict::deny().is_grant());
    /// ```
    pub fn is_grant(&self) -> bool {
        !matches!(self.0, Decision::Deny)
    }
}

/// Where a granted DNS query's answer comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolver(pub(crate) ResolverKind);

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ResolverKind {
    /// Hosts-file style: these addresses, for as long as the sandbox lives.
    Fixed(Arc<[IpAddr]>),
    /// DNS servers the host queries over UDP, in turn.
    Upstream(Arc<[SocketAddr]>),
    /// The host's own resolver (`getaddrinfo`).
    System,
}

impl Resolver {
    /// Answers with `addresses`, like a hosts file (the record never expires). Empty answers
    /// are "no such name".
    ///
    /// ```
    /// let resolver = krunbox::net::Resolver::fixed(["127.0.0.1".parse().unwrap()]);
    /// ```
    pub fn fixed(addresses: impl IntoIterator<Item = IpAddr>) -> Self {
        Self(ResolverKind::Fixed(addresses.into_iter().collect()))
    }

    /// Asks these DNS servers (over UDP, each in turn until one answers) for the name's IPv4
    /// addresses, and keeps the answer for its TTL.
    ///
    /// ```
    /// let resolver = krunbox::net::Resolver::upstream(["127.0.0.53:53".parse().unwrap()]);
    /// ```
    pub fn upstream(servers: impl IntoIterator<Item = SocketAddr>) -> Self {
        Self(ResolverKind::Upstream(servers.into_iter().collect()))
    }

    /// Asks the host's own resolver (`getaddrinfo`, as any program on the host would), and
    /// keeps the answer for a minute (it comes without a TTL).
    ///
    /// ```
    /// let resolver = krunbox::net::Resolver::system();
    /// ```
    pub fn system() -> Self {
        Self(ResolverKind::System)
    }
}

/// How long an answer from the system resolver (which gives no TTL) is kept.
pub(crate) const SYSTEM_TTL: Duration = Duration::from_secs(60);

/// The future a [`Policy`] returns.
pub type Decide = Pin<Box<dyn Future<Output = Verdict> + Send + 'static>>;

/// Decides each new flow. Any `Fn(Flow) -> impl Future<Output = Verdict>` that is `Send +
/// Sync` is one; implement the trait for a type when the decision needs state of its own.
///
/// The gateway calls it once per flow, in a task of that flow's own: while it waits, the
/// guest's connection waits (its SYN is held) and nothing else does. A callback that panics
/// denies its flow, and the panic is reported (`tracing`, target `krunbox::net`).
///
/// ```
/// use krunbox::net::{Flow, Network, Protocol, Resolver, Verdict};
///
/// let network = Network::with_policy(|flow: Flow| async move {
///     match (flow.protocol(), flow.hostname()) {
///         (Protocol::Dns, Some("origin.test")) => {
///             Verdict::resolve(Resolver::fixed(["127.0.0.1".parse().unwrap()]))
///         }
///         (Protocol::Tcp, Some("origin.test")) => Verdict::accept(),
///         _ => Verdict::deny(),
///     }
/// });
/// ```
pub trait Policy: Send + Sync + 'static {
    /// The verdict on `flow`.
    fn decide(&self, flow: Flow) -> Decide;
}

impl<F, Fut> Policy for F
where
    F: Fn(Flow) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Verdict> + Send + 'static,
{
    fn decide(&self, flow: Flow) -> Decide {
        Box::pin(self(flow))
    }
}

/// Asks `policy` about `flow`, turning a panic (in the call or in its future) into a denial
/// that is reported.
pub(crate) async fn ask(policy: &dyn Policy, flow: Flow) -> Verdict {
    let described = flow.to_string();
    crate::callback::guarded(|| policy.decide(flow))
        .await
        .unwrap_or_else(|panicked| {
            tracing::error!(
                target: "krunbox::net",
                flow = %described,
                "the network policy panicked ({panicked}); the flow is denied"
            );
            Verdict::deny()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(upstream: &[&str]) -> Flow {
        Flow {
            protocol: Protocol::Tcp,
            source: "10.0.2.15:40000".parse().unwrap(),
            destination: "198.18.0.1:443".parse().unwrap(),
            hostname: Some("origin.test".into()),
            upstream: upstream.iter().map(|a| a.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn the_upstream_class_is_the_least_public_of_the_answers() {
        assert_eq!(
            flow(&["93.184.215.14"]).upstream_class(),
            AddressClass::Public
        );
        assert_eq!(
            flow(&["93.184.215.14", "169.254.169.254"]).upstream_class(),
            AddressClass::CloudMetadata
        );
        assert_eq!(
            flow(&["127.0.0.1"]).upstream_class(),
            AddressClass::Loopback
        );
        // No upstream yet (a DNS query): the destination's class.
        assert_eq!(flow(&[]).upstream_class(), AddressClass::Benchmarking);
    }

    #[tokio::test]
    async fn a_panicking_policy_denies_and_a_working_one_decides() {
        let panics_in_call = |_: Flow| -> std::future::Ready<Verdict> { panic!("in the call") };
        assert_eq!(ask(&panics_in_call, flow(&[])).await, Verdict::deny());
        let panics_in_future = |_: Flow| async { panic!("in the future") };
        assert_eq!(ask(&panics_in_future, flow(&[])).await, Verdict::deny());
        let accepts = |flow: Flow| async move {
            if flow.hostname() == Some("origin.test") {
                Verdict::accept()
            } else {
                Verdict::deny()
            }
        };
        assert_eq!(ask(&accepts, flow(&[])).await, Verdict::accept());
    }
}
