//! Declarative network rules through the real command line: `krunbox run --dns-static ...
//! --allow-domain ... --rules FILE` boots a microVM whose guest reaches an allowed name, and only
//! on its allowed port. Every origin is on 127.0.0.1, reached through a static DNS answer;
//! nothing else is ever dialled.

mod common;
#[path = "common/http_origin.rs"]
mod http_origin;

use std::process::Output;
use std::sync::Mutex;

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

/// One microVM: an allowed name reaches its origin, with the header `--inject-header` adds; a
/// name with a static answer but no allow, the allowed name on another port, and a name no
/// rule mentions do not; a rule from a `--rules` file lets its name through too.
#[test]
fn cli_rules_let_the_allowed_name_and_port_through_and_nothing_else() {
    common::run(async {
        let (port, heads) = http_origin::start().await;
        // The same name on a port no rule allows: must never see a request.
        let (other_port, other_heads) = http_origin::start().await;
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
        let script = format!(
            "wget -q -O - http://origin.test:{port}/allowed; echo rc-allowed=$?; \
             wget -q -O - http://other.test:{port}/other; echo rc-other=$?; \
             wget -q -O - http://origin.test:{other_port}/port; echo rc-port=$?; \
             wget -q -O - http://file.test:{port}/file; echo rc-file=$?; \
             nslookup unlisted.test 2>&1; echo rc-unlisted=$?"
        );
        let allow = format!("origin.test:{port}");
        let out = krunbox(&[
            "run",
            "--image",
            "busybox",
            "--memory",
            "256",
            "--timeout",
            "120",
            "--dns-static",
            "origin.test=127.0.0.1",
            "--dns-static",
            "other.test=127.0.0.1",
            "--allow-domain",
            &allow,
            "--rules",
            file.to_str().unwrap(),
            "--inject-header",
            "origin.test:X-Injected=KRUNBOX_TEST_INJECTED",
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
        assert!(stdout.contains("REFUSED"), "{context}");
        assert!(!stdout.contains("rc-unlisted=0"), "{context}");

        assert_eq!(paths(&heads), ["/allowed", "/file"], "{context}");
        assert!(other_heads.lock().unwrap().is_empty(), "{context}");
        // --inject-header: the origin.test request carried the host's value (the guest never
        // had it: it is not in the script), file.test's did not.
        let injected = |head: &str| {
            head.to_ascii_lowercase()
                .contains("x-injected: value-from-the-host")
        };
        let kept = heads.lock().unwrap().clone();
        assert!(injected(&kept[0]), "{}", kept[0]);
        assert!(!injected(&kept[1]), "{}", kept[1]);
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
