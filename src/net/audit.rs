//! The network's audit record: every decision and what became of it, as `tracing` events
//! (target `krunbox::net`) and as [`NetworkEvent`]s the caller can consume
//! ([`Instance::network_events`](crate::Instance::network_events)).

use std::net::SocketAddr;
use std::time::SystemTime;

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

/// Where one sandbox's audit events go.
#[derive(Debug, Clone)]
pub(crate) struct Audit {
    events: broadcast::Sender<NetworkEvent>,
}

impl Audit {
    pub(crate) fn new() -> Self {
        Self {
            events: broadcast::channel(EVENTS).0,
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
