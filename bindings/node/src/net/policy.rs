//! A network policy written in JavaScript: a callback that gets each new flow as a
//! `FlowInfo` and resolves to a `VerdictSpec`.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use napi_derive::napi;

use super::middleware::{Hub, JsMiddleware};
use crate::callback::Callback;

/// A new connection or query from the guest, as the policy gets it.
#[napi(object)]
pub struct FlowInfo {
    /// This policy call's number: the middleware it registers is kept under it until the
    /// native side takes the verdict, or is told it never will (`settle`).
    pub call: u32,
    /// "tcp", "udp" or "dns" ("other" for a kind this package does not know, which only a
    /// denial fits).
    pub protocol: String,
    /// The name the guest resolved for the destination (for "dns", the name asked), if any:
    /// from the gateway's own DNS answers, never from the guest's bytes.
    pub hostname: Option<String>,
    pub src_ip: String,
    pub src_port: u16,
    pub dst_ip: String,
    pub dst_port: u16,
    /// The addresses the gateway's DNS answered for `hostname`.
    pub upstream: Vec<String>,
}

impl FlowInfo {
    fn new(call: u32, flow: &krunbox::net::Flow) -> Self {
        FlowInfo {
            call,
            protocol: match flow.protocol() {
                krunbox::net::Protocol::Dns => "dns",
                krunbox::net::Protocol::Udp => "udp",
                krunbox::net::Protocol::Tcp => "tcp",
                _ => "other",
            }
            .into(),
            hostname: flow.hostname().map(str::to_owned),
            src_ip: flow.source().ip().to_string(),
            src_port: flow.source().port(),
            dst_ip: flow.destination().ip().to_string(),
            dst_port: flow.destination().port(),
            upstream: flow.upstream().iter().map(IpAddr::to_string).collect(),
        }
    }
}

/// The policy's answer.
#[napi(object)]
pub struct VerdictSpec {
    /// "deny", "accept", "connectTo" (`to`), "resolve" (`addresses`), "resolveWith"
    /// (`servers`) or "intercept" (`middleware`).
    pub kind: String,
    /// "connectTo": where the flow goes instead, "address:port".
    pub to: Option<String>,
    /// "resolve": the addresses a DNS query is answered with.
    pub addresses: Option<Vec<String>>,
    /// "resolveWith": the DNS servers asked, "address" (port 53) or "address:port".
    pub servers: Option<Vec<String>>,
    /// "intercept": the registered middleware each request goes through, in order.
    pub middleware: Option<Vec<u32>>,
}

fn address(text: &str) -> Result<IpAddr, String> {
    text.parse()
        .map_err(|_| format!("{text:?} is not an IP address"))
}

fn server(text: &str) -> Result<SocketAddr, String> {
    if let Ok(with_port) = text.parse::<SocketAddr>() {
        return Ok(with_port);
    }
    Ok(SocketAddr::new(address(text)?, 53))
}

impl VerdictSpec {
    /// The library's verdict on a flow of `protocol`. Middleware ids are taken first, so that
    /// each is released even when the verdict is refused.
    fn verdict(
        self,
        protocol: krunbox::net::Protocol,
        hub: Option<&Arc<Hub>>,
    ) -> Result<krunbox::net::Verdict, String> {
        use krunbox::net::{Intercept, Resolver, Verdict};
        let middleware: Vec<JsMiddleware> = match (self.middleware, hub) {
            (Some(ids), Some(hub)) => ids.into_iter().map(|id| hub.middleware(id)).collect(),
            (Some(ids), None) if !ids.is_empty() => {
                return Err("middleware was given to a network without a middleware runner".into())
            }
            _ => Vec::new(),
        };
        Ok(match self.kind.as_str() {
            "deny" => Verdict::deny(),
            // A query granted as it is: answered by the host's own resolver.
            "accept" if protocol == krunbox::net::Protocol::Dns => {
                Verdict::resolve(Resolver::system())
            }
            "accept" => Verdict::accept(),
            "connectTo" => {
                let to = self.to.ok_or("connectTo needs `to`")?;
                Verdict::connect_to(
                    to.parse::<SocketAddr>()
                        .map_err(|_| format!("{to:?} is not an address:port"))?,
                )
            }
            "resolve" => {
                let addresses = self.addresses.unwrap_or_default();
                let addresses = addresses
                    .iter()
                    .map(|a| address(a))
                    .collect::<Result<Vec<_>, _>>()?;
                Verdict::resolve(Resolver::fixed(addresses))
            }
            "resolveWith" => {
                let servers = self.servers.unwrap_or_default();
                if servers.is_empty() {
                    return Err("resolveWith needs at least one server".into());
                }
                let servers = servers
                    .iter()
                    .map(|s| server(s))
                    .collect::<Result<Vec<_>, _>>()?;
                Verdict::resolve(Resolver::upstream(servers))
            }
            "intercept" => {
                let mut intercept = Intercept::new();
                for each in middleware {
                    intercept = intercept.middleware(each);
                }
                Verdict::intercept(intercept)
            }
            other => return Err(format!("{other:?} is not a verdict")),
        })
    }
}

/// A JavaScript callback as the library's policy. What it throws or rejects denies the flow
/// it was asked about, and nothing else.
pub(crate) struct JsPolicy {
    callback: Arc<Callback<FlowInfo, VerdictSpec>>,
    hub: Option<Arc<Hub>>,
    next_call: AtomicU32,
}

impl JsPolicy {
    pub(crate) fn new(callback: Callback<FlowInfo, VerdictSpec>, hub: Option<Arc<Hub>>) -> Self {
        JsPolicy {
            callback: Arc::new(callback),
            hub,
            next_call: AtomicU32::new(0),
        }
    }
}

/// Tells the TypeScript side, whatever becomes of a policy call (a verdict taken, a failure,
/// its flow dropped while it ran), that it is over: middleware it registered and the native
/// side did not take is released then.
struct Settle {
    call: u32,
    hub: Option<Arc<Hub>>,
    taken: bool,
}

impl Drop for Settle {
    fn drop(&mut self) {
        if let Some(hub) = &self.hub {
            hub.settle(self.call, self.taken);
        }
    }
}

impl krunbox::net::Policy for JsPolicy {
    fn decide(&self, flow: krunbox::net::Flow) -> krunbox::net::Decide {
        let callback = Arc::clone(&self.callback);
        let call = self.next_call.fetch_add(1, Ordering::Relaxed);
        let mut settle = Settle {
            call,
            hub: self.hub.clone(),
            taken: false,
        };
        let asked = FlowInfo::new(call, &flow);
        let protocol = flow.protocol();
        Box::pin(async move {
            let decided = match callback.call(asked).await {
                Ok(spec) => {
                    settle.taken = true;
                    spec.verdict(protocol, settle.hub.as_ref())
                }
                Err(error) => Err(error),
            };
            drop(settle);
            decided.unwrap_or_else(|error| {
                tracing::warn!(%error, "the network policy failed; the flow is denied");
                krunbox::net::Verdict::deny()
            })
        })
    }
}
