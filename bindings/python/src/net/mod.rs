//! The sandbox's network as Python gives it: declarative rules (JSON), or a policy callable
//! deciding each flow, with secrets, published ports and the trust for intercepted upstreams.

mod flow;
mod middleware;
mod policy;

use std::sync::Arc;

use pyo3::prelude::*;

pub(crate) use flow::{Flow, Verdict};
pub(crate) use middleware::{Answer, Request};

use crate::callback::EventLoop;
use crate::errors::{to_py, InvalidConfig};

/// A secret as `krunbox.Secret` hands it over: its variable, value, hosts, and whether it is
/// also swapped in query strings and bodies.
type SecretSpec = (String, String, Vec<String>, bool, bool);

/// A network definition, turned into the library's `Network` when a sandbox is defined.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct Network {
    rules: Option<krunbox::net::Rules>,
    policy: Option<Py<PyAny>>,
    secrets: Vec<krunbox::net::Secret>,
    publish: Vec<(u16, u16)>,
    upstream_trust: Option<krunbox::net::UpstreamTrust>,
}

#[pymethods]
impl Network {
    /// `rules`: the rules as JSON (`{"rules": [...]}`); `policy`: a callable deciding each
    /// flow; neither: every flow is denied. `secrets`: (variable, value, hosts, in_query,
    /// in_body); `publish`: (guest port, host port); `upstream_ca`: PEM certificates that
    /// intercepted upstreams are verified against instead of the host's trust store.
    #[new]
    #[pyo3(signature = (
        *, rules = None, policy = None, secrets = Vec::new(), publish = Vec::new(),
        upstream_ca = None
    ))]
    fn new(
        rules: Option<&str>,
        policy: Option<Py<PyAny>>,
        secrets: Vec<SecretSpec>,
        publish: Vec<(u16, u16)>,
        upstream_ca: Option<Vec<u8>>,
    ) -> PyResult<Self> {
        if rules.is_some() && policy.is_some() {
            return Err(InvalidConfig::new_err(
                "give a network rules or a policy, not both (a policy can ask rules itself)",
            ));
        }
        let rules = rules
            .map(krunbox::net::Rules::from_json)
            .transpose()
            .map_err(|e| InvalidConfig::new_err(format!("network rules: {e}")))?;
        let secrets = secrets
            .into_iter()
            .map(|(variable, value, hosts, in_query, in_body)| {
                let mut secret = krunbox::net::Secret::new(variable, value).map_err(to_py)?;
                for host in hosts {
                    secret = secret.bind_to(host);
                }
                if in_query {
                    secret = secret.in_query_string();
                }
                if in_body {
                    secret = secret.in_body();
                }
                Ok(secret)
            })
            .collect::<PyResult<Vec<_>>>()?;
        let upstream_trust = upstream_ca
            .map(|pem| krunbox::net::UpstreamTrust::pem(&pem))
            .transpose()
            .map_err(to_py)?;
        Ok(Network {
            rules,
            policy,
            secrets,
            publish,
            upstream_trust,
        })
    }
}

impl Network {
    /// The library's network for a sandbox whose callbacks run on `event_loop`.
    pub(crate) fn build(&self, py: Python<'_>, event_loop: &Arc<EventLoop>) -> krunbox::Network {
        let mut network = match (&self.rules, &self.policy) {
            (Some(rules), _) => krunbox::Network::with_policy(rules.clone()),
            (None, Some(policy)) => krunbox::Network::with_policy(policy::PythonPolicy::new(
                policy.clone_ref(py),
                Arc::clone(event_loop),
            )),
            (None, None) => krunbox::Network::deny_all(),
        };
        for secret in &self.secrets {
            network = network.secret(secret.clone());
        }
        for &(guest, host) in &self.publish {
            network = network.publish(guest, host);
        }
        if let Some(trust) = &self.upstream_trust {
            network = network.upstream_trust(trust.clone());
        }
        network
    }
}

/// Registers the network's classes in the module.
pub(crate) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<Network>()?;
    module.add_class::<Flow>()?;
    module.add_class::<Verdict>()?;
    module.add_class::<Request>()?;
    module.add_class::<Answer>()?;
    Ok(())
}
