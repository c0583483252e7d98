//! The network flags (`run`, `image build`): rules, header injection, published ports, and the
//! `Network` they describe.

use std::net::IpAddr;

use krunbox::net::{
    DomainPattern, Flow, HeaderName, HeaderValue, Network, Ports, Protocol, Rule, RuleError, Rules,
    UpstreamTrust, Verdict,
};

/// The network flags (`run`, `image build`).
#[derive(clap::Args)]
pub(crate) struct NetworkArgs {
    /// Allow DNS for, and connections to, the names PATTERN matches, on PORT (or a range
    /// FIRST-LAST; without it, any port).
    ///
    /// PATTERN is a name (`example.com`: that name only) or a wildcard (`*.example.com`: the
    /// names under example.com, not example.com itself). Their DNS queries are answered by the
    /// host's resolver, unless --dns-static names them. Repeatable.
    #[arg(long, value_name = "PATTERN[:PORT]", value_parser = parse_allow_domain)]
    allow_domain: Vec<Rule>,
    /// Allow connections to an IP address or CIDR block, on PORT (or a range FIRST-LAST).
    ///
    /// For a guest that dials the address itself rather than a name: 192.0.2.7:22,
    /// 10.0.0.0/8:8000-8100, IPv6 in brackets ([2001:db8::/32]:443). Repeatable.
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_allow_tcp)]
    allow_tcp: Vec<Rule>,
    /// Answer DNS for NAME with IP (connections to it still need --allow-domain).
    ///
    /// Like a hosts file: no DNS server is asked. Repeatable; a NAME given twice gets both
    /// addresses.
    #[arg(long, value_name = "NAME=IP", value_parser = parse_dns_static)]
    dns_static: Vec<(DomainPattern, IpAddr)>,
    /// Network rules from a JSON file.
    ///
    /// The file holds {"rules": [RULE, ...]}; each RULE is {"action": "allow" or "deny",
    /// "domain": PATTERN or "address": IP-or-CIDR, and optionally "ports": 443 or
    /// "8000-8100", "protocol": "dns", "tcp" or "udp", on a rule for names "methods": ["GET",
    /// ...] (the HTTP requests it decides: such connections are intercepted, and a request
    /// the rules refuse is answered 403), and on an allow rule for names "resolver":
    /// "system", {"static": ["IP", ...]} or {"upstream": ["IP:PORT", ...]}}. Unknown fields
    /// are refused. Repeatable.
    #[arg(long, value_name = "FILE", value_parser = parse_rules_file)]
    rules: Vec<Rules>,
    /// Set HEADER to the value of the host's environment variable ENVVAR on every HTTP(S)
    /// request to DOMAIN (a name or *.wildcard).
    ///
    /// The connection must still be allowed (--allow-domain); it is then intercepted: the host
    /// terminates the guest's TLS with the sandbox's own CA (which the guest trusts), adds the
    /// header, and sends the request on over verified TLS. The value never enters the guest,
    /// and never leaves the host in clear: a plain http:// request to DOMAIN is answered 403.
    /// Example: --inject-header 'api.github.com:Authorization=GITHUB_AUTH'. Repeatable.
    #[arg(long, value_name = "DOMAIN:HEADER=ENVVAR", value_parser = parse_inject_header)]
    inject_header: Vec<HeaderInjection>,
    /// Verify the upstreams of intercepted HTTPS (--inject-header, method rules) against the
    /// PEM certificates in FILE only, instead of the host's trust store: for origins with a
    /// private CA.
    #[arg(long, value_name = "FILE", value_parser = parse_upstream_ca)]
    upstream_ca: Option<UpstreamTrust>,
    /// Make the guest's TCP port GUEST reachable on the host at 127.0.0.1:HOST (a free port
    /// if HOST is left out; the address is printed on stderr). Repeatable.
    #[arg(long, value_name = "GUEST[:HOST]", value_parser = parse_publish)]
    pub(crate) publish: Vec<(u16, u16)>,
}

/// `--allow-domain PATTERN[:PORT]`.
fn parse_allow_domain(value: &str) -> Result<Rule, String> {
    let (pattern, ports) = match value.split_once(':') {
        Some((pattern, ports)) => (pattern, Ports::parse(ports).map_err(|e| e.to_string())?),
        None => (value, Ports::any()),
    };
    Ok(Rule::allow_domain(pattern)
        .map_err(|e| e.to_string())?
        .ports(ports))
}

/// `--allow-tcp HOST:PORT`, HOST an address or CIDR block, IPv6 in brackets.
fn parse_allow_tcp(value: &str) -> Result<Rule, String> {
    let split = match value.strip_prefix('[') {
        Some(rest) => rest.split_once("]:"),
        None => value
            .rsplit_once(':')
            .filter(|(host, _)| !host.contains(':')),
    };
    let Some((host, ports)) = split else {
        return Err(
            "expected HOST:PORT, such as 192.0.2.7:22 or 10.0.0.0/8:80-89 \
                    (IPv6 in brackets: [2001:db8::/32]:443)"
                .into(),
        );
    };
    let ports = Ports::parse(ports).map_err(|e| e.to_string())?;
    Ok(Rule::allow_address(host)
        .map_err(|e| e.to_string())?
        .ports(ports))
}

/// `--dns-static NAME=IP`.
fn parse_dns_static(value: &str) -> Result<(DomainPattern, IpAddr), String> {
    let (name, address) = value
        .split_once('=')
        .ok_or("expected NAME=IP, such as api.test=127.0.0.1")?;
    let name = DomainPattern::parse(name).map_err(|e| e.to_string())?;
    let address = address
        .parse()
        .map_err(|_| format!("`{address}` is not an IP address"))?;
    Ok((name, address))
}

/// `--inject-header DOMAIN:HEADER=ENVVAR`: the header's value is read from the host's
/// environment now, so a missing variable is a usage error before anything boots.
#[derive(Debug, Clone)]
struct HeaderInjection {
    domain: DomainPattern,
    header: HeaderName,
    value: HeaderValue,
}

fn parse_inject_header(value: &str) -> Result<HeaderInjection, String> {
    let usage = || format!("{value:?} must look like DOMAIN:HEADER=ENVVAR");
    let (domain, rest) = value.split_once(':').ok_or_else(usage)?;
    let (header, variable) = rest.split_once('=').ok_or_else(usage)?;
    let domain = DomainPattern::parse(domain).map_err(|e| e.to_string())?;
    let header = HeaderName::from_bytes(header.trim().as_bytes())
        .map_err(|_| format!("{header:?} is not a header name"))?;
    let secret = std::env::var(variable)
        .map_err(|_| format!("the host has no environment variable {variable}"))?;
    let mut value = HeaderValue::from_str(&secret)
        .map_err(|_| format!("the value of {variable} is not a valid header value"))?;
    value.set_sensitive(true);
    Ok(HeaderInjection {
        domain,
        header,
        value,
    })
}

/// `--publish GUEST[:HOST]`.
fn parse_publish(value: &str) -> Result<(u16, u16), String> {
    let port = |p: &str| {
        p.parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("{p:?} is not a port (1-65535)"))
    };
    match value.split_once(':') {
        Some((guest, host)) => Ok((port(guest)?, port(host)?)),
        None => Ok((port(value)?, 0)),
    }
}

/// The network the flags describe: the rules, with connections to a domain of an
/// --inject-header intercepted to add its headers (after the rules' own middleware, which
/// refuses requests by method, if they intercept it); published ports. `None`: no network.
pub(crate) fn network(args: &NetworkArgs) -> Result<Option<Network>, RuleError> {
    let rules = network_rules(args)?;
    if rules.is_none() && args.publish.is_empty() && args.inject_header.is_empty() {
        return Ok(None);
    }
    let rules = rules.unwrap_or_default();
    let injections = args.inject_header.clone();
    let mut network = Network::with_policy(move |flow: Flow| {
        let verdict = rules.verdict(&flow);
        let name = flow.hostname().unwrap_or_default().to_owned();
        let injections: Vec<HeaderInjection> = injections
            .iter()
            .filter(|i| i.domain.matches(&name))
            .cloned()
            .collect();
        async move {
            if flow.protocol() != Protocol::Tcp || !verdict.is_grant() || injections.is_empty() {
                return verdict;
            }
            let mut intercept = verdict.interception().cloned().unwrap_or_default();
            for i in injections {
                intercept = intercept.set_header(i.header, i.value);
            }
            Verdict::intercept(intercept)
        }
    });
    for (guest, host) in &args.publish {
        network = network.publish(*guest, *host);
    }
    if let Some(trust) = &args.upstream_ca {
        network = network.upstream_trust(trust.clone());
    }
    Ok(Some(network))
}

/// `--upstream-ca FILE`.
fn parse_upstream_ca(path: &str) -> Result<UpstreamTrust, String> {
    let pem = std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    UpstreamTrust::pem(&pem).map_err(|e| format!("{path}: {e}"))
}

/// `--rules FILE`.
fn parse_rules_file(path: &str) -> Result<Rules, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    Rules::from_json(&text).map_err(|e| match e {
        RuleError::Json { .. } => format!("{path} is not a list of rules: {e}"),
        e => format!("{path}: {e}"),
    })
}

/// The rules the network flags give, in the documented order: `None` without any (then the
/// guest has no network).
fn network_rules(args: &NetworkArgs) -> Result<Option<Rules>, RuleError> {
    if args.dns_static.is_empty()
        && args.rules.is_empty()
        && args.allow_domain.is_empty()
        && args.allow_tcp.is_empty()
    {
        return Ok(None);
    }
    let mut rules = Rules::new();
    for (name, address) in &args.dns_static {
        rules = rules.dns_static(&name.to_string(), *address)?;
    }
    for file in &args.rules {
        rules = rules.extend(file.clone());
    }
    for rule in args.allow_domain.iter().chain(&args.allow_tcp) {
        rules = rules.rule(rule.clone())?;
    }
    Ok(Some(rules))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{args, refused};

    #[test]
    fn no_network_flag_means_no_network() {
        assert!(network_rules(&args(&[]).unwrap().sandbox.net)
            .unwrap()
            .is_none());
    }

    #[test]
    fn network_flags_parse_into_rules_in_their_order() {
        let args = args(&[
            "--allow-domain",
            "api.test:8080",
            "--allow-domain",
            "*.Example.com",
            "--allow-domain",
            "ports.test:8000-8100",
            "--allow-tcp",
            "10.0.0.0/8:80",
            "--allow-tcp",
            "[2001:db8::/32]:443",
            "--allow-tcp",
            "192.0.2.7:22",
            "--dns-static",
            "api.test=127.0.0.1",
            "--dns-static",
            "api.test=::1",
        ])
        .unwrap();
        let domains: Vec<String> = args
            .sandbox
            .net
            .allow_domain
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(
            domains,
            [
                "allow domain api.test port 8080",
                "allow domain *.example.com",
                "allow domain ports.test port 8000-8100",
            ]
        );
        let tcp: Vec<String> = args
            .sandbox
            .net
            .allow_tcp
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(
            tcp,
            [
                "allow address 10.0.0.0/8 port 80",
                "allow address 2001:db8::/32 port 443",
                "allow address 192.0.2.7/32 port 22",
            ]
        );
        assert_eq!(network_rules(&args.sandbox.net).unwrap().unwrap().len(), 7);
    }

    #[test]
    fn the_rules_come_in_the_documented_order() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rules.json");
        std::fs::write(
            &file,
            r#"{"rules": [{"action": "deny", "domain": "no.test"}]}"#,
        )
        .unwrap();
        let args = args(&[
            "--allow-tcp",
            "10.0.0.0/8:80",
            "--allow-domain",
            "*.test",
            "--rules",
            file.to_str().unwrap(),
            "--dns-static",
            "a.test=127.0.0.1",
        ])
        .unwrap();
        let rules = network_rules(&args.sandbox.net).unwrap().unwrap();
        let order: Vec<String> = rules.rules().iter().map(|r| r.to_string()).collect();
        assert_eq!(
            order,
            [
                "allow domain a.test (dns only) resolved as [127.0.0.1]",
                "deny domain no.test",
                "allow domain *.test",
                "allow address 10.0.0.0/8 port 80",
            ]
        );
    }

    #[test]
    fn inject_header_and_publish_parse_and_give_a_network() {
        // Only this test reads or writes this variable.
        std::env::set_var("KRUNBOX_TEST_INJECTED", "Bearer from-the-host");
        let parsed = args(&[
            "--inject-header",
            "*.example.com:Authorization=KRUNBOX_TEST_INJECTED",
            "--publish",
            "8000",
            "--publish",
            "8001:18001",
        ])
        .unwrap();
        assert_eq!(parsed.sandbox.net.inject_header.len(), 1);
        let injection = &parsed.sandbox.net.inject_header[0];
        assert_eq!(injection.header, "authorization");
        assert_eq!(injection.value, "Bearer from-the-host");
        assert!(injection.value.is_sensitive());
        assert!(injection.domain.matches("api.example.com"));
        assert_eq!(parsed.sandbox.net.publish, [(8000, 0), (8001, 18001)]);
        // Either flag alone gives a network (deny-all rules otherwise).
        assert!(network(&parsed.sandbox.net).unwrap().is_some());
        assert!(network(&args(&[]).unwrap().sandbox.net).unwrap().is_none());
        let cases: [(&[&str], &str); 6] = [
            (&["--inject-header", "api.test"], "DOMAIN:HEADER=ENVVAR"),
            (
                &["--inject-header", "api.test:X-Key"],
                "DOMAIN:HEADER=ENVVAR",
            ),
            (
                &["--inject-header", "api.test:X-Key=KRUNBOX_NO_SUCH_VARIABLE"],
                "no environment variable KRUNBOX_NO_SUCH_VARIABLE",
            ),
            (
                &["--inject-header", "api.test:Bad Header=PATH"],
                "not a header name",
            ),
            (&["--publish", "0"], "not a port"),
            (&["--publish", "80:http"], "not a port"),
        ];
        for (flags, says) in cases {
            let message = refused(flags);
            assert!(message.contains(says), "{flags:?}: {message}");
        }
    }

    #[test]
    fn bad_network_values_are_usage_errors_that_say_what_is_wrong() {
        let cases: [(&[&str], &str); 12] = [
            (&["--allow-domain", "a.*.com"], "first label"),
            (&["--allow-domain", "*."], "needs a domain after it"),
            (&["--allow-domain", "a..com"], "empty label"),
            (&["--allow-domain", "a.com:http"], "not a port"),
            (&["--allow-domain", "a.com:"], "not a port"),
            (&["--allow-domain", "a.com:90-80"], "empty"),
            (&["--allow-tcp", "10.0.0.1"], "HOST:PORT"),
            (&["--allow-tcp", "10.0.0.1/8:80"], "10.0.0.0/8"),
            (&["--allow-tcp", "example.com:80"], "not an IP address"),
            (&["--allow-tcp", "2001:db8::1:443"], "in brackets"),
            (&["--dns-static", "a.test"], "NAME=IP"),
            (&["--dns-static", "a.test=localhost"], "not an IP address"),
        ];
        for (flags, says) in cases {
            let message = refused(flags);
            assert!(message.contains(says), "{flags:?}: {message}");
        }
        let message = refused(&["--rules", "/no/such/rules.json"]);
        assert!(
            message.contains("cannot read /no/such/rules.json"),
            "{message}"
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rules.json");
        std::fs::write(&file, r#"{"rules": [{"action": "allow", "domain": "*"}]}"#).unwrap();
        let message = refused(&["--rules", file.to_str().unwrap()]);
        assert!(message.contains("rules[0]"), "{message}");
        std::fs::write(
            &file,
            r#"{"rules": [{"action": "allow", "domian": "a.test"}]}"#,
        )
        .unwrap();
        let message = refused(&["--rules", file.to_str().unwrap()]);
        assert!(message.contains("unknown field `domian`"), "{message}");
        std::fs::write(
            &file,
            r#"{"rules": [{"action": "allow", "domain": "a.test", "methods": ["get"]}]}"#,
        )
        .unwrap();
        let message = refused(&["--rules", file.to_str().unwrap()]);
        assert!(message.contains("not an HTTP method"), "{message}");
    }

    #[test]
    fn a_rules_file_can_limit_methods() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rules.json");
        std::fs::write(
            &file,
            r#"{"rules": [
                {"action": "deny", "domain": "api.test", "methods": ["POST", "DELETE"]},
                {"action": "allow", "domain": "api.test", "ports": 443, "methods": ["GET"]}
            ]}"#,
        )
        .unwrap();
        let args = args(&["--rules", file.to_str().unwrap()]).unwrap();
        let rules = network_rules(&args.sandbox.net).unwrap().unwrap();
        let order: Vec<String> = rules.rules().iter().map(|r| r.to_string()).collect();
        assert_eq!(
            order,
            [
                "deny domain api.test methods POST,DELETE",
                "allow domain api.test port 443 methods GET",
            ]
        );
        assert!(network(&args.sandbox.net).unwrap().is_some());
    }
}
