//! The sandbox's network as JavaScript defines it: declarative rules (JSON), or a policy
//! callback deciding each flow, with secrets, published ports and the trust for intercepted
//! upstreams.
//!
//! The callback's conveniences (`conn.matchDns()`, `matchHttp(...)?.accept(middleware)`)
//! live in TypeScript (`ts/network.ts`); what crosses here is plain data: a `FlowInfo` out,
//! a `VerdictSpec` back, and middleware as ids the TypeScript side registered.

mod middleware;
mod policy;

use std::sync::Arc;

use napi::bindgen_prelude::{Function, Promise};
use napi_derive::napi;

pub use middleware::{HttpRequestInfo, HttpRequestResult, ReleaseInfo};
pub use policy::{FlowInfo, VerdictSpec};

use crate::callback::{calls_bound, Callback, Notify};
use crate::errors::{invalid, OrNapi};

/// A secret the guest holds only as a placeholder: the gateway puts `value` in its place in
/// requests to `hosts`.
#[napi(object)]
pub struct SecretSpec {
    /// The environment variable the guest finds the placeholder in.
    pub name: String,
    pub value: String,
    /// The hosts it is sent to (patterns as the rules take them: `api.example.com`,
    /// `*.example.com`).
    pub hosts: Vec<String>,
    /// Also swapped in query strings.
    pub in_query: Option<bool>,
    /// Also swapped in request bodies.
    pub in_body: Option<bool>,
}

/// A guest port reachable on the host's loopback.
#[napi(object)]
pub struct PublishSpec {
    pub guest_port: u16,
    pub host_port: u16,
}

/// Everything but the callbacks.
#[napi(object)]
pub struct NetworkOptions {
    /// The rules as JSON (`{"rules": [...]}`); not with a policy.
    pub rules: Option<String>,
    pub secrets: Option<Vec<SecretSpec>>,
    pub publish: Option<Vec<PublishSpec>>,
    /// PEM certificates intercepted upstreams are verified against instead of the host's
    /// trust store.
    pub upstream_ca: Option<String>,
}

/// A network definition, the library's `Network` made once and shared by every sandbox
/// defined with it.
#[napi]
pub struct NativeNetwork {
    pub(crate) inner: krunbox::Network,
}

#[napi]
impl NativeNetwork {
    /// `policy` decides each flow; `middleware` runs the middleware the policy registered
    /// (by id) on each intercepted request; `release` is told when a registration is done.
    #[napi(constructor)]
    pub fn new(
        options: NetworkOptions,
        policy: Option<Function<'_, FlowInfo, Promise<VerdictSpec>>>,
        middleware: Option<Function<'_, HttpRequestInfo, Promise<HttpRequestResult>>>,
        release: Option<Function<'_, ReleaseInfo, ()>>,
    ) -> napi::Result<Self> {
        let mut network =
            match (&options.rules, policy) {
                (Some(_), Some(_)) => return Err(invalid(
                    "give a network rules or a policy, not both (a policy can ask rules itself)",
                )),
                (Some(rules), None) => krunbox::Network::with_policy(
                    krunbox::net::Rules::from_json(rules)
                        .map_err(|e| invalid(format!("network rules: {e}")))?,
                ),
                (None, Some(policy)) => {
                    let calls = calls_bound();
                    let hub = match (middleware, release) {
                        (Some(run), Some(release)) => Some(Arc::new(middleware::Hub::new(
                            Callback::new(&run, Arc::clone(&calls))?,
                            Notify::new(&release)?,
                        ))),
                        _ => None,
                    };
                    krunbox::Network::with_policy(policy::JsPolicy::new(
                        Callback::new(&policy, calls)?,
                        hub,
                    ))
                }
                (None, None) => krunbox::Network::deny_all(),
            };
        for secret in options.secrets.unwrap_or_default() {
            let mut made = krunbox::net::Secret::new(secret.name, secret.value).or_napi()?;
            for host in secret.hosts {
                made = made.bind_to(host);
            }
            if secret.in_query.unwrap_or(false) {
                made = made.in_query_string();
            }
            if secret.in_body.unwrap_or(false) {
                made = made.in_body();
            }
            network = network.secret(made);
        }
        for port in options.publish.unwrap_or_default() {
            network = network.publish(port.guest_port, port.host_port);
        }
        if let Some(pem) = options.upstream_ca {
            network =
                network.upstream_trust(krunbox::net::UpstreamTrust::pem(pem.as_bytes()).or_napi()?);
        }
        Ok(NativeNetwork { inner: network })
    }
}
