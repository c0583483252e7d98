//! `Flow` (what a policy is asked about) and `Verdict` (its answer), as Python sees them.

use std::net::{IpAddr, SocketAddr};

use pyo3::prelude::*;

use crate::errors::InvalidConfig;

/// A new connection or query from the guest, as the policy gets it.
#[pyclass(module = "krunbox._krunbox", frozen, get_all)]
pub(crate) struct Flow {
    /// "tcp", "udp" or "dns".
    protocol: &'static str,
    /// The name the guest resolved for the destination (for "dns", the name asked), if any.
    hostname: Option<String>,
    /// The guest's address and port.
    source: (String, u16),
    /// Where the guest sent it: an address and a port.
    destination: (String, u16),
    /// The addresses the gateway's DNS answered for `hostname`.
    upstream: Vec<String>,
}

impl From<&krunbox::net::Flow> for Flow {
    fn from(flow: &krunbox::net::Flow) -> Self {
        let address = |a: SocketAddr| (a.ip().to_string(), a.port());
        Flow {
            protocol: match flow.protocol() {
                krunbox::net::Protocol::Dns => "dns",
                krunbox::net::Protocol::Udp => "udp",
                _ => "tcp",
            },
            hostname: flow.hostname().map(str::to_owned),
            source: address(flow.source()),
            destination: address(flow.destination()),
            upstream: flow.upstream().iter().map(IpAddr::to_string).collect(),
        }
    }
}

#[pymethods]
impl Flow {
    fn __repr__(&self) -> String {
        format!(
            "Flow({} {:?} -> {}:{})",
            self.protocol, self.hostname, self.destination.0, self.destination.1
        )
    }
}

/// What the policy answers: made by `Verdict`'s static methods.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct Verdict {
    pub(crate) decision: Decision,
}

pub(crate) enum Decision {
    Ready(krunbox::net::Verdict),
    /// Granted as it is: a connection to where the guest sent it, a query answered by the
    /// host's resolver (the library's `accept` fits connections, `resolve` queries).
    Accept,
    /// Granted through the interception with this middleware (Python callables, run in order).
    Intercept(Vec<Py<PyAny>>),
}

fn address(text: &str) -> PyResult<IpAddr> {
    text.parse()
        .map_err(|_| InvalidConfig::new_err(format!("{text:?} is not an IP address")))
}

#[pymethods]
impl Verdict {
    /// Blocks the flow.
    #[staticmethod]
    fn deny() -> Self {
        Verdict::ready(krunbox::net::Verdict::deny())
    }

    /// Grants the flow to where the guest sent it (TCP, UDP), or answers a DNS query from the
    /// host's resolver.
    #[staticmethod]
    fn accept() -> Self {
        Verdict {
            decision: Decision::Accept,
        }
    }

    /// Grants a TCP or UDP flow, connecting it to `host` (an IP address) and `port` instead.
    #[staticmethod]
    fn connect_to(host: &str, port: u16) -> PyResult<Self> {
        let to = SocketAddr::new(address(host)?, port);
        Ok(Verdict::ready(krunbox::net::Verdict::connect_to(to)))
    }

    /// Answers a DNS query with `addresses`.
    #[staticmethod]
    fn resolve(addresses: Vec<String>) -> PyResult<Self> {
        let addresses = addresses
            .iter()
            .map(|a| address(a))
            .collect::<PyResult<Vec<_>>>()?;
        let resolver = krunbox::net::Resolver::fixed(addresses);
        Ok(Verdict::ready(krunbox::net::Verdict::resolve(resolver)))
    }

    /// Answers a DNS query by asking the DNS servers `servers` ((address, port) pairs).
    #[staticmethod]
    fn resolve_with(servers: Vec<(String, u16)>) -> PyResult<Self> {
        let servers = servers
            .iter()
            .map(|(host, port)| Ok(SocketAddr::new(address(host)?, *port)))
            .collect::<PyResult<Vec<_>>>()?;
        let resolver = krunbox::net::Resolver::upstream(servers);
        Ok(Verdict::ready(krunbox::net::Verdict::resolve(resolver)))
    }

    /// Grants a TCP flow through the host's HTTP(S) interception: each request goes through
    /// `middleware` (callables, run in order) before it goes upstream.
    #[staticmethod]
    #[pyo3(signature = (middleware = Vec::new()))]
    fn intercept(middleware: Vec<Py<PyAny>>) -> Self {
        Verdict {
            decision: Decision::Intercept(middleware),
        }
    }

    fn __repr__(&self) -> String {
        match &self.decision {
            Decision::Ready(verdict) => format!("{verdict:?}"),
            Decision::Accept => "Verdict.accept()".into(),
            Decision::Intercept(middleware) => {
                format!("Verdict.intercept({} middleware)", middleware.len())
            }
        }
    }
}

impl Verdict {
    fn ready(verdict: krunbox::net::Verdict) -> Self {
        Verdict {
            decision: Decision::Ready(verdict),
        }
    }
}
