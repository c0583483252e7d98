//! Declarative network rules through the real command line: `krunbox run --dns-static ...
//! --allow-domain ... --rules FILE` boots a microVM whose guest reaches an allowed name, and only
//! on its allowed port. Every origin is on 127.0.0.1, reached through a static DNS answer;
//! nothing else is ever dialled.

#[path = "../../tests/common/mod.rs"]
mod common;
#[path = "../../tests/common/http_origin.rs"]
mod http_origin;
#[path = "../../tests/common/https_origin.rs"]
mod https_origin;

use std::process::Output;
use std::sync::{Arc, Mutex};

/// The paths of the kept request heads.
fn paths(heads: &Mutex<Vec<String>>) -> Vec<String> {
    let heads = heads.lock().unwrap();
    heads
        .iter()
        .map(|h| h.split(' ').nth(1).unwrap_or("?").to_owned())
        .collect()
}

async fn krunbox(args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_krunbox"))
        .env("KRUNBOX_TEST_INJECTED", "value-from-the-host")
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .expect("running krunbox")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// One microVM: an allowed name reaches its origin; a name with a static answer but no allow,
/// the allowed name on another port, and a name no rule mentions do not; a rule from a
/// `--rules` file lets its name through too. `--inject-header` adds its header to HTTPS
/// requests, verified upstream against `--upstream-ca`, and refuses a plain HTTP request that
/// would carry it (issue 33: the host sent the credential in clear), which reaches nothing.
#[test]
fn cli_rules_let_the_allowed_name_and_port_through_and_nothing_else() {
    common::run(async {
        let (port, heads) = http_origin::start().await;
        // The same name on a port no rule allows: must never see a request.
        let (other_port, other_heads) = http_origin::start().await;
        let tls_heads: Arc<Mutex<Vec<String>>> = Arc::default();
        let kept = tls_heads.clone();
        let tls_origin = https_origin::start(
            &["origin.test"],
            Arc::new(move |request: hyper::Request<bytes::Bytes>| {
                let injected = request
                    .headers()
                    .get("x-injected")
                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
                kept.lock()
                    .unwrap()
                    .push(format!("{} x-injected={injected:?}", request.uri().path()));
                https_origin::respond(200, "text/plain", "tls origin says hi\n")
            }),
        )
        .await;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rules.json");
        std::fs::write(
            &file,
            format!(
                r#"{{"rules": [{{"action": "allow", "domain": "file.test", "ports": {port},
                                "resolver": {{"static": ["127.0.0.1"]}}}}]}}"#
            ),
        )
        .unwrap();
        let ca = dir.path().join("origin-ca.pem");
        std::fs::write(&ca, &tls_origin.ca_pem).unwrap();
        let tls_port = tls_origin.port;
        let script = format!(
            "curl -sS http://plain.test:{port}/allowed; echo rc-allowed=$?; \
             curl -sS http://other.test:{port}/other; echo rc-other=$?; \
             curl -sS http://plain.test:{other_port}/port; echo rc-port=$?; \
             curl -sS http://file.test:{port}/file; echo rc-file=$?; \
             getent hosts unlisted.test; echo rc-unlisted=$?; \
             curl -sS -w 'status=%{{http_code}}\\n' http://origin.test:{port}/cleartext; \
             curl -sS https://origin.test:{tls_port}/injected; echo rc-injected=$?"
        );
        let allow_plain = format!("plain.test:{port}");
        let allow_origin = format!("origin.test:{port}");
        let allow_tls = format!("origin.test:{tls_port}");
        let out = krunbox(&[
            "run",
            "--image",
            "agent",
            "--memory",
            "384",
            "--timeout",
            "120",
            "--dns-static",
            "plain.test=127.0.0.1",
            "--dns-static",
            "origin.test=127.0.0.1",
            "--dns-static",
            "other.test=127.0.0.1",
            "--allow-domain",
            &allow_plain,
            "--allow-domain",
            &allow_origin,
            "--allow-domain",
            &allow_tls,
            "--rules",
            file.to_str().unwrap(),
            "--inject-header",
            "origin.test:X-Injected=KRUNBOX_TEST_INJECTED",
            "--upstream-ca",
            ca.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            &script,
        ])
        .await;
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        let context = format!("stdout:\n{stdout}\nstderr:\n{stderr}");
        assert_eq!(out.status.code(), Some(0), "{context}");

        // The allowed name on the allowed port: through.
        assert!(stdout.contains("origin says /allowed"), "{context}");
        assert!(stdout.contains("rc-allowed=0"), "{context}");
        // A static answer is DNS only: without an allow, the connection is refused.
        assert!(!stdout.contains("origin says /other"), "{context}");
        assert!(!stdout.contains("rc-other=0"), "{context}");
        // The allowed name on a port the rule does not name: refused.
        assert!(!stdout.contains("origin says /port"), "{context}");
        assert!(!stdout.contains("rc-port=0"), "{context}");
        // The rule from the file: through.
        assert!(stdout.contains("origin says /file"), "{context}");
        assert!(stdout.contains("rc-file=0"), "{context}");
        // A name no rule mentions is refused at the DNS.
        assert!(!stdout.contains("rc-unlisted=0"), "{context}");
        assert!(stderr.contains("(unlisted.test) verdict=deny"), "{context}");

        // A plain request to the name a header is injected for: refused by the host (403,
        // saying why), sent nowhere.
        assert!(stdout.contains("only over HTTPS"), "{context}");
        assert!(stdout.contains("status=403"), "{context}");
        assert_eq!(paths(&heads), ["/allowed", "/file"], "{context}");
        assert!(other_heads.lock().unwrap().is_empty(), "{context}");
        // Over HTTPS: the origin got the host's value (the guest never had it: it is not in
        // the script), verified against the CA --upstream-ca named.
        assert!(stdout.contains("tls origin says hi"), "{context}");
        assert!(stdout.contains("rc-injected=0"), "{context}");
        assert_eq!(
            *tls_heads.lock().unwrap(),
            [r#"/injected x-injected=Some("value-from-the-host")"#],
            "{context}"
        );
        // The plain origin's requests carried no injected header.
        for head in heads.lock().unwrap().iter() {
            assert!(!head.to_ascii_lowercase().contains("x-injected"), "{head}");
        }
        // Each decision is logged where the user sees it, as plain text.
        assert!(stderr.contains("(other.test) verdict=deny"), "{context}");
    });
}

/// Bad rule values are usage errors, refused before anything boots, saying what is wrong.
#[test]
fn bad_rule_values_are_usage_errors() {
    common::run(async {
        for (flag, value, says) in [
            ("--allow-domain", "api.*.test:80", "first label"),
            ("--allow-tcp", "10.0.0.1/8:80", "10.0.0.0/8"),
            ("--dns-static", "api.test=localhost", "not an IP address"),
            ("--rules", "/no/such/rules.json", "cannot read"),
        ] {
            let out = krunbox(&["run", "--image", "busybox", flag, value, "--", "true"]).await;
            let stderr = text(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{flag} {value}: {stderr}");
            assert!(stderr.contains(says), "{flag} {value}: {stderr}");
        }
    });
}
