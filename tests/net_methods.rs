//! Network rules that decide HTTP requests by method, and a secret swapped into request
//! bodies, with a real microVM and real curl in the agent image. The origin is an HTTPS server
//! this test runs on 127.0.0.1 with a CA of its own (the network's upstream trust), reached
//! through static DNS answers for `origin.test` and `elsewhere.test`.

mod common;
#[path = "common/guest.rs"]
mod guest;
#[path = "common/https_origin.rs"]
mod https_origin;

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use guest::sh;
use hyper::{Method, Request};
use krunbox::net::{
    Network, NetworkEvent, RequestOutcome, Rule, Rules, Secret, StatusCode, UpstreamTrust,
};
use krunbox::BuiltinImage;

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// How long one guest shell script may take.
const SH_TIMEOUT: Duration = Duration::from_secs(120);

/// What the origin got: method, path, the Host header's port-less name, and the body.
#[derive(Debug, Clone)]
struct Got {
    method: Method,
    host: String,
    path: String,
    body: Bytes,
}

#[test]
fn method_rules_refuse_requests_and_body_secrets_reach_only_bound_hosts() {
    common::run(async {
        let got: Arc<Mutex<Vec<Got>>> = Arc::default();
        let kept = got.clone();
        let handler = move |request: Request<Bytes>| {
            let host = request
                .headers()
                .get("host")
                .and_then(|h| h.to_str().ok())
                .unwrap_or("")
                .split(':')
                .next()
                .unwrap_or("")
                .to_owned();
            kept.lock().unwrap().push(Got {
                method: request.method().clone(),
                host,
                path: request.uri().path().to_owned(),
                body: request.body().clone(),
            });
            https_origin::respond(
                200,
                "text/plain",
                format!("origin says {}\n", request.uri()),
            )
        };
        let origin =
            https_origin::start(&["origin.test", "elsewhere.test"], Arc::new(handler)).await;
        let port = origin.port;
        let rules = Rules::new()
            .dns_static("origin.test", LOOPBACK)
            .unwrap()
            .dns_static("elsewhere.test", LOOPBACK)
            .unwrap()
            // origin.test: anything but POST.
            .rule(Rule::deny_domain("origin.test").unwrap().methods(["POST"]))
            .unwrap()
            .allow_domain_ports("origin.test", port)
            .unwrap()
            // elsewhere.test: PUT only (so it is intercepted too).
            .rule(
                Rule::allow_domain("elsewhere.test")
                    .unwrap()
                    .ports(port)
                    .methods(["PUT"]),
            )
            .unwrap();
        let secret = Secret::new("API_KEY", "real-body-value")
            .unwrap()
            .bind_to("origin.test")
            .in_body();
        let placeholder = secret.placeholder().to_owned();
        let network = Network::with_policy(rules)
            .upstream_trust(UpstreamTrust::pem(origin.ca_pem.as_bytes()).unwrap())
            .secret(secret);
        let vm = guest::sandbox(BuiltinImage::Agent, Some(network))
            .boot()
            .await
            .expect("boot");
        let mut events = vm.network_events().expect("a network");

        let url = |host: &str, path: &str| format!("https://{host}:{port}{path}");
        // GET passes; POST is refused with 403; on HTTP/1.1 a refused POST and a GET after it
        // share one connection (num_connects 0 for the second); PUT carries the secret in its
        // body to the bound host, and the placeholder to the other.
        let script = format!(
            "curl -sS -o /dev/null -w 'get=%{{http_code}}\\n' {get}; \
             curl -sS -w '\\npost=%{{http_code}}\\n' --data x=1 {post}; \
             curl -sS --http1.1 -o /dev/null -w 'again=%{{http_code}},%{{num_connects}}\\n' \
               --data x=2 {post2} --next -sS --http1.1 -o /dev/null \
               -w 'after=%{{http_code}},%{{num_connects}}\\n' {after}; \
             curl -sS -o /dev/null -w 'put=%{{http_code}}\\n' -X PUT --data \"key=$API_KEY\" {put}; \
             curl -sS -o /dev/null -w 'put2=%{{http_code}}\\n' -X PUT --data \"key=$API_KEY\" {put2}",
            get = url("origin.test", "/get"),
            post = url("origin.test", "/post"),
            post2 = url("origin.test", "/post2"),
            after = url("origin.test", "/after"),
            put = url("origin.test", "/put"),
            put2 = url("elsewhere.test", "/put2"),
        );
        let (text, _) = sh(&vm, &script, SH_TIMEOUT).await;
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.contains(&"get=200"), "{text}");
        assert!(lines.contains(&"post=403"), "{text}");
        assert!(
            text.contains("refused by network rule 2 (deny domain origin.test methods POST)"),
            "the 403 names the rule: {text}"
        );
        assert!(lines.contains(&"again=403,1"), "{text}");
        assert!(
            lines.contains(&"after=200,0"),
            "the connection stayed usable: {text}"
        );
        assert!(lines.contains(&"put=200"), "{text}");
        assert!(lines.contains(&"put2=200"), "{text}");

        let got = got.lock().unwrap().clone();
        let seen: Vec<String> = got
            .iter()
            .map(|g| format!("{} {} {}", g.method, g.host, g.path))
            .collect();
        assert_eq!(
            seen,
            [
                "GET origin.test /get",
                "GET origin.test /after",
                "PUT origin.test /put",
                "PUT elsewhere.test /put2",
            ],
            "no POST reached the origin"
        );
        assert_eq!(
            got[2].body, "key=real-body-value",
            "the bound host gets the value"
        );
        assert_eq!(
            got[3].body,
            format!("key={placeholder}").as_bytes(),
            "another host gets the placeholder"
        );

        // The audit: each request, the refused ones with why, and the secret by name.
        let mut requests = Vec::new();
        while let Ok(event) = events.try_recv() {
            if let NetworkEvent::Request {
                method,
                path,
                status,
                outcome,
                secrets_swapped,
                placeholders_left,
                ..
            } = event
            {
                requests.push((
                    format!("{method} {path}"),
                    status,
                    outcome,
                    secrets_swapped,
                    placeholders_left,
                ));
            }
        }
        let find = |request: &str| {
            requests
                .iter()
                .find(|r| r.0 == request)
                .unwrap_or_else(|| panic!("no event for {request}: {requests:#?}"))
        };
        let post = find("POST /post");
        assert_eq!(post.1, Some(StatusCode::FORBIDDEN));
        assert!(
            matches!(&post.2, RequestOutcome::Answered { reason } if reason.contains("rule 2")),
            "{post:?}"
        );
        let put = find("PUT /put");
        assert_eq!(
            (put.1, &put.3),
            (Some(StatusCode::OK), &vec!["API_KEY".to_owned()])
        );
        let put2 = find("PUT /put2");
        assert_eq!(put2.4, ["API_KEY"], "{put2:?}");
        vm.shutdown().await.unwrap();
    });
}
