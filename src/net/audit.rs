//! The network's audit record: every decision and what became of it, as `tracing` events
//! (target `krunbox::net`) and as [`NetworkEvent`]s the caller can consume
//! ([`Instance::network_events`](crate::Instance::network_events)).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use ::http::{Method, StatusCode};
use tokio::sync::broadcast;

use super::policy::{Decision, Flow};

/// Events kept for a slow consumer before the oldest are dropped (the consumer is told how
/// many it missed: `RecvError::Lagged`).
const EVENTS: usize = 4096;

/// What the network decided about a flow, or did for one.
///
/// ```no_run
/// # async fn demo(vm: &krunbox::Instance) {
/// use krunbox::net::NetworkEvent;
///
/// use tokio::sync::broadcast::error::RecvError;
///
/// let mut events = vm.network_events().expect("the instance has a network");
/// loop {
///     match events.recv().await {
///         Ok(NetworkEvent::Decided { flow, outcome, .. }) => println!("{flow}: {outcome}"),
///         Ok(_) => {}
///         Err(RecvError::Lagged(missed)) => eprintln!("missed {missed} events"),
///         Err(RecvError::Closed) => break, // the instance's network stopped
///     }
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum NetworkEvent {
    /// The policy decided a new flow (or it was denied without one: no policy, a sandbox
    /// address that stands for no name).
    Decided {
        /// When.
        at: SystemTime,
        /// The flow, as the policy saw it.
        flow: Flow,
        /// The decision.
        outcome: Outcome,
        /// The address the host connected to, for a connection it dialled.
        upstream: Option<SocketAddr>,
    },
    /// A granted connection whose upstream could not be reached: the guest's connection was
    /// refused.
    Unreachable {
        /// When.
        at: SystemTime,
        /// The flow.
        flow: Flow,
        /// Why, for people.
        reason: String,
    },
    /// A connection from the host to a published guest port.
    Published {
        /// When.
        at: SystemTime,
        /// The guest's port.
        guest_port: u16,
        /// Who connected, on the host's loopback.
        peer: SocketAddr,
    },
    /// A request on an intercepted connection (the connection itself is `Decided` with
    /// [`Outcome::Intercepted`]): what the guest asked for, what it got, and which secrets the
    /// host swapped in or found reflected. Sent once the guest has its answer's head, the
    /// request's body has gone upstream (or been dropped), and the response's body, when
    /// secrets are looked for in it, has gone to the guest.
    Request {
        /// When the event was sent.
        at: SystemTime,
        /// The connection's trusted hostname.
        hostname: String,
        /// The connection's destination port.
        port: u16,
        /// The request's method.
        method: Method,
        /// The request's path, without its query string (where credentials often are).
        path: String,
        /// The status the guest got; `None` if it got none (its connection ended first, or the
        /// sandbox's network stopped).
        status: Option<StatusCode>,
        /// What became of the request.
        outcome: RequestOutcome,
        /// The secrets (by their variable's name) whose placeholders were swapped for their
        /// values on the way upstream: in headers, the query string or the body.
        secrets_swapped: Vec<String>,
        /// The secrets (by their variable's name) whose placeholders were on the request and
        /// went out as they were: to a host the secret is not bound to, over plain HTTP, or in
        /// a part of the request the secret did not opt in to.
        placeholders_left: Vec<String>,
        /// The secrets (by their variable's name) whose values the bound host sent back (in the
        /// response's headers or body: an echo, an error page, a redirect, an object read
        /// back), which the guest got as placeholders instead.
        secrets_reflected: Vec<String>,
    },
}

/// What became of an intercepted request ([`NetworkEvent::Request`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequestOutcome {
    /// Sent upstream; the guest got the upstream's response.
    Forwarded,
    /// Answered by middleware (a rule's methods, or the caller's
    /// [`Middleware::handle`](crate::net::Middleware::handle)) without going upstream.
    Answered {
        /// The answer's text, for people.
        reason: String,
    },
    /// It named another authority than the connection's trusted hostname and port: answered
    /// `421`, sent nowhere.
    Misdirected {
        /// The authority it named.
        authority: String,
    },
    /// Its path is not one a request may have: answered `400`, sent nowhere.
    InvalidPath,
    /// The upstream could not be reached: answered `502`.
    Unreachable {
        /// Why, for people.
        reason: String,
    },
    /// The request was plain HTTP and would have carried a credential the host adds (a header
    /// middleware set, or a secret's value in place of its placeholder): answered `403`, sent
    /// nowhere. Credentials leave the host only over verified TLS.
    Cleartext {
        /// What it would have carried: the names of the headers middleware added or changed,
        /// and the variables of the secrets whose placeholders it held.
        credentials: Vec<String>,
    },
    /// The caller's middleware panicked on it: answered `500`, sent nowhere.
    MiddlewarePanicked {
        /// The panic's message.
        message: String,
    },
    /// The caller's middleware took longer than
    /// [`MIDDLEWARE_DEADLINE`](crate::net::MIDDLEWARE_DEADLINE): answered `504`, sent nowhere.
    MiddlewareTimedOut,
    /// The guest's connection ended (or the network stopped) before it was answered.
    Abandoned,
}

impl std::fmt::Display for RequestOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RequestOutcome::Forwarded => f.write_str("forwarded"),
            RequestOutcome::Answered { reason } => write!(f, "answered by middleware: {reason}"),
            RequestOutcome::Misdirected { authority } => {
                write!(f, "misdirected (it named {authority})")
            }
            RequestOutcome::InvalidPath => f.write_str("refused: not a valid path"),
            RequestOutcome::Unreachable { reason } => write!(f, "unreachable: {reason}"),
            RequestOutcome::Cleartext { credentials } => write!(
                f,
                "refused: plain HTTP that would carry {}",
                credentials.join(", ")
            ),
            RequestOutcome::MiddlewarePanicked { message } => {
                write!(f, "middleware panicked: {message}")
            }
            RequestOutcome::MiddlewareTimedOut => f.write_str("middleware took too long"),
            RequestOutcome::Abandoned => f.write_str("abandoned before its answer"),
        }
    }
}

/// A decision, as the audit names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// Denied.
    Denied,
    /// Connected to what the guest asked for.
    Accepted,
    /// Connected to another address the policy gave.
    ConnectedTo,
    /// A DNS query answered by a resolver.
    Resolved,
    /// An intercepted connection.
    Intercepted,
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Outcome::Denied => "deny",
            Outcome::Accepted => "accept",
            Outcome::ConnectedTo => "connect-to",
            Outcome::Resolved => "resolve",
            Outcome::Intercepted => "intercept",
        })
    }
}

impl From<&Decision> for Outcome {
    fn from(decision: &Decision) -> Self {
        match decision {
            Decision::Deny => Outcome::Denied,
            Decision::Accept => Outcome::Accepted,
            Decision::ConnectTo(_) => Outcome::ConnectedTo,
            Decision::Resolve(_) => Outcome::Resolved,
            Decision::Intercept(_) => Outcome::Intercepted,
        }
    }
}

/// Where one sandbox's audit events go, and its network's running totals.
#[derive(Debug, Clone)]
pub(crate) struct Audit {
    events: broadcast::Sender<NetworkEvent>,
    pub(crate) counters: Arc<Counters>,
}

/// A sandbox network's running totals, for [`Instance::metrics`](crate::Instance::metrics).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub bytes_from_guest: AtomicU64,
    pub bytes_to_guest: AtomicU64,
    pub flows_granted: AtomicU64,
    pub flows_denied: AtomicU64,
    pub requests: AtomicU64,
    pub open_connections: AtomicU64,
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// What they say now.
    pub(crate) fn read(&self) -> crate::metrics::NetworkMetrics {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        crate::metrics::NetworkMetrics {
            bytes_from_guest: get(&self.bytes_from_guest),
            bytes_to_guest: get(&self.bytes_to_guest),
            flows_granted: get(&self.flows_granted),
            flows_denied: get(&self.flows_denied),
            requests: get(&self.requests),
            open_connections: get(&self.open_connections),
        }
    }
}

impl Audit {
    pub(crate) fn new() -> Self {
        Self {
            events: broadcast::channel(EVENTS).0,
            counters: Arc::default(),
        }
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<NetworkEvent> {
        self.events.subscribe()
    }

    fn send(&self, event: NetworkEvent) {
        // No subscriber: the tracing event is the record.
        let _ = self.events.send(event);
    }

    /// A decision on `flow`.
    pub(crate) fn decided(&self, flow: &Flow, outcome: Outcome, upstream: Option<SocketAddr>) {
        let counter = match outcome {
            Outcome::Denied => &self.counters.flows_denied,
            _ => &self.counters.flows_granted,
        };
        Counters::add(counter, 1);
        match upstream {
            Some(upstream) => tracing::info!(
                target: "krunbox::net",
                %flow,
                verdict = %outcome,
                %upstream,
                "network flow"
            ),
            None => {
                tracing::info!(target: "krunbox::net", %flow, verdict = %outcome, "network flow")
            }
        }
        self.send(NetworkEvent::Decided {
            at: SystemTime::now(),
            flow: flow.clone(),
            outcome,
            upstream,
        });
    }

    /// A granted connection that could not be made.
    pub(crate) fn unreachable(&self, flow: &Flow, reason: String) {
        tracing::info!(
            target: "krunbox::net",
            %flow,
            "the upstream could not be reached: {reason}"
        );
        self.send(NetworkEvent::Unreachable {
            at: SystemTime::now(),
            flow: flow.clone(),
            reason,
        });
    }

    /// The record of one intercepted request, sent when the last holder drops it.
    pub(crate) fn request(
        &self,
        hostname: &str,
        port: u16,
        method: Method,
        path: &str,
    ) -> Arc<RequestRecord> {
        Counters::add(&self.counters.requests, 1);
        Arc::new(RequestRecord {
            audit: self.clone(),
            hostname: hostname.to_owned(),
            port,
            method,
            path: path.to_owned(),
            state: Mutex::default(),
        })
    }

    /// A connection to a published port.
    pub(crate) fn published(&self, guest_port: u16, peer: SocketAddr) {
        tracing::info!(
            target: "krunbox::net",
            %peer,
            guest_port,
            "a connection to a published port"
        );
        self.send(NetworkEvent::Published {
            at: SystemTime::now(),
            guest_port,
            peer,
        });
    }
}

/// One intercepted request's audit event in the making. Its holders are the request's handler
/// (until the guest has its answer's head) and, when secrets are swapped in the body, the
/// body on its way upstream (until it is sent); the event goes out when the last lets go, so it
/// names the secrets swapped in the body too.
#[derive(Debug)]
pub(crate) struct RequestRecord {
    audit: Audit,
    hostname: String,
    port: u16,
    method: Method,
    path: String,
    state: Mutex<RequestState>,
}

#[derive(Debug, Default)]
struct RequestState {
    answered: Option<(StatusCode, RequestOutcome)>,
    swapped: Vec<String>,
    left: Vec<String>,
    reflected: Vec<String>,
}

impl RequestRecord {
    fn state(&self) -> std::sync::MutexGuard<'_, RequestState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The guest got `status`, because of `outcome`.
    pub(crate) fn answered(&self, status: StatusCode, outcome: RequestOutcome) {
        self.state().answered = Some((status, outcome));
    }

    /// Secrets swapped in (`swapped`) and placeholders left as they were (`left`), by variable.
    pub(crate) fn secrets(&self, swapped: &[String], left: &[String]) {
        let mut guard = self.state();
        let state = &mut *guard;
        add_names(&mut state.swapped, swapped);
        add_names(&mut state.left, left);
    }

    /// Secrets whose values the response held, given to the guest as placeholders.
    pub(crate) fn reflected(&self, reflected: &[String]) {
        add_names(&mut self.state().reflected, reflected);
    }
}

/// Adds the `names` not in `to` yet.
fn add_names(to: &mut Vec<String>, names: &[String]) {
    for name in names {
        if !to.contains(name) {
            to.push(name.clone());
        }
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        let state = std::mem::take(&mut *self.state());
        let (status, outcome) = match state.answered {
            Some((status, outcome)) => (Some(status), outcome),
            None => (None, RequestOutcome::Abandoned),
        };
        let status_code = status.map_or(0, |s| s.as_u16());
        let (hostname, port, method, path) = (&self.hostname, self.port, &self.method, &self.path);
        if !state.reflected.is_empty() {
            tracing::warn!(
                target: "krunbox::net",
                hostname, port, %method, path, status = status_code,
                reflected = ?state.reflected,
                "intercepted request: the host sent back the values of secrets; the guest got \
                 their placeholders"
            );
        }
        if !state.left.is_empty() {
            tracing::warn!(
                target: "krunbox::net",
                hostname, port, %method, path, status = status_code, %outcome,
                swapped = ?state.swapped, left = ?state.left,
                "intercepted request: placeholders of secrets went out as they were"
            );
        } else if outcome != RequestOutcome::Forwarded || !state.swapped.is_empty() {
            tracing::info!(
                target: "krunbox::net",
                hostname, port, %method, path, status = status_code, %outcome,
                swapped = ?state.swapped,
                "intercepted request"
            );
        } else {
            tracing::debug!(
                target: "krunbox::net",
                hostname, port, %method, path, status = status_code,
                "intercepted request"
            );
        }
        self.audit.send(NetworkEvent::Request {
            at: SystemTime::now(),
            hostname: std::mem::take(&mut self.hostname),
            port,
            method: self.method.clone(),
            path: std::mem::take(&mut self.path),
            status,
            outcome,
            secrets_swapped: state.swapped,
            placeholders_left: state.left,
            secrets_reflected: state.reflected,
        });
    }
}
