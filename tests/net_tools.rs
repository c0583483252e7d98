//! Real tools through intercepted HTTPS in the agent image: `git clone` from a smart-HTTP
//! server (git's own `git http-backend`, run as CGI by the test's origin) and `pip install`
//! from a package index the test serves, both trusting the sandbox CA (installed in the image's
//! own trust store on this writable root, and kept by its `update-ca-certificates`, run first).
//! The origin runs on
//! 127.0.0.1 with a CA of its own; the guest reaches it only as `git.test` and `pypi.test`.

mod common;
#[path = "common/guest.rs"]
#[allow(dead_code)] // its `sh` only: this test builds its own sandbox (a writable root)
mod guest;
#[path = "common/https_origin.rs"]
mod https_origin;

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use guest::sh;
use hyper::{Request, Response};
use krunbox::net::{Flow, Intercept, Network, Protocol, Resolver, UpstreamTrust, Verdict};
use krunbox::{BuiltinImage, Rootfs};

/// How long one guest shell script may take (a clone, an install).
const SH_TIMEOUT: Duration = Duration::from_secs(180);

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("running a host tool");
    assert!(out.status.success(), "{cmd:?}: {out:?}");
}

/// A bare repository `repo.git` in `root` with one commit on `main` holding `hello.txt`.
fn make_repository(root: &Path) {
    let work = root.join("work");
    let git = |dir: &Path| {
        let mut cmd = Command::new("git");
        cmd.arg("-C").arg(dir).args([
            "-c",
            "user.name=test",
            "-c",
            "user.email=test@example.invalid",
            "-c",
            "init.defaultBranch=main",
        ]);
        cmd
    };
    run(git(root).args(["init", "-q", "--bare", "repo.git"]));
    run(git(root).args(["init", "-q", "work"]));
    std::fs::write(work.join("hello.txt"), "cloned through the sandbox\n").unwrap();
    run(git(&work).args(["add", "hello.txt"]));
    run(git(&work).args(["commit", "-q", "-m", "first"]));
    run(git(&work).args(["push", "-q", "../repo.git", "HEAD:refs/heads/main"]));
    run(git(&root.join("repo.git")).args(["symbolic-ref", "HEAD", "refs/heads/main"]));
}

/// Answers a request with `git http-backend` as CGI (RFC 3875), serving `root`.
fn git_http_backend(root: &Path, request: &Request<Bytes>) -> Response<Bytes> {
    let header = |name: &str| {
        request
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let mut child = Command::new("git")
        .arg("http-backend")
        .env("GIT_PROJECT_ROOT", root)
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .env("REQUEST_METHOD", request.method().as_str())
        .env("PATH_INFO", request.uri().path())
        .env("QUERY_STRING", request.uri().query().unwrap_or(""))
        .env("CONTENT_TYPE", header("content-type"))
        .env("CONTENT_LENGTH", request.body().len().to_string())
        .env("HTTP_CONTENT_ENCODING", header("content-encoding"))
        .env("GIT_PROTOCOL", header("git-protocol"))
        .env("REMOTE_ADDR", "127.0.0.1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("git http-backend");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(request.body())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    // CGI output: header lines, a blank line, the body.
    let split = out
        .stdout
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4))
        .or_else(|| {
            out.stdout
                .windows(2)
                .position(|w| w == b"\n\n")
                .map(|i| (i, 2))
        })
        .expect("CGI headers");
    let head = String::from_utf8_lossy(&out.stdout[..split.0]).into_owned();
    let mut response = Response::builder();
    for line in head.lines() {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        if name.eq_ignore_ascii_case("status") {
            let code = value.trim().split(' ').next().unwrap_or("200");
            response = response.status(code.parse::<u16>().unwrap());
        } else {
            response = response.header(name.trim(), value.trim());
        }
    }
    response
        .body(Bytes::copy_from_slice(&out.stdout[split.0 + split.1..]))
        .unwrap()
}

/// A wheel of `demo-pkg` 1.0 (`import demo_pkg; demo_pkg.VALUE == 42`), made with Python's
/// zipfile on the host. Returns its file name and bytes.
fn make_wheel(dir: &Path) -> (String, Vec<u8>) {
    let name = "demo_pkg-1.0-py3-none-any.whl";
    let script = r#"
import base64, hashlib, sys, zipfile
files = {
    "demo_pkg/__init__.py": "VALUE = 42\n",
    "demo_pkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n",
    "demo_pkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: krunbox-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = []
for path, text in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record.append(f"{path},sha256={digest},{len(text.encode())}")
record.append("demo_pkg-1.0.dist-info/RECORD,,")
files["demo_pkg-1.0.dist-info/RECORD"] = "\n".join(record) + "\n"
with zipfile.ZipFile(sys.argv[1], "w") as wheel:
    for path, text in files.items():
        wheel.writestr(path, text)
"#;
    let path = dir.join(name);
    run(Command::new("python3").arg("-c").arg(script).arg(&path));
    (name.to_owned(), std::fs::read(&path).unwrap())
}

#[test]
fn git_clone_and_pip_install_work_over_intercepted_https() {
    common::run(async {
        let dir = tempfile::tempdir().unwrap();
        let root: PathBuf = dir.path().to_owned();
        make_repository(&root);
        let (wheel_name, wheel) = make_wheel(&root);
        let wheel_sha256 = {
            use sha2::Digest;
            hex::encode(sha2::Sha256::digest(&wheel))
        };
        let paths: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen = paths.clone();
        let handler = move |request: Request<Bytes>| -> Response<Bytes> {
            let path = request.uri().path().to_owned();
            seen.lock().unwrap().push(format!(
                "{} {}",
                request.headers()["host"].to_str().unwrap_or("?"),
                path
            ));
            if path.starts_with("/repo.git/") {
                return git_http_backend(&root, &request);
            }
            match path.as_str() {
                "/simple/demo-pkg/" => {
                    let page = format!(
                        "<!DOCTYPE html><html><body>\
                         <a href=\"/files/{wheel_name}#sha256={wheel_sha256}\">{wheel_name}</a>\
                         </body></html>"
                    );
                    https_origin::respond(200, "text/html", page)
                }
                p if p == format!("/files/{wheel_name}") => {
                    https_origin::respond(200, "application/octet-stream", wheel.clone())
                }
                _ => https_origin::respond(404, "text/plain", "not here\n"),
            }
        };
        let origin = https_origin::start(&["git.test", "pypi.test"], Arc::new(handler)).await;
        let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let network = Network::with_policy(move |flow: Flow| async move {
            match (flow.protocol(), flow.hostname()) {
                (Protocol::Dns, Some("git.test" | "pypi.test")) => {
                    Verdict::resolve(Resolver::fixed([loopback]))
                }
                (Protocol::Tcp, Some("git.test" | "pypi.test")) => {
                    Verdict::intercept(Intercept::new())
                }
                _ => Verdict::deny(),
            }
        })
        .upstream_trust(UpstreamTrust::pem(origin.ca_pem.as_bytes()).unwrap());
        // A writable root (issue 35): the sandbox CA is installed in the image's own trust
        // store there, so the image's `update-ca-certificates` keeps working and keeps it.
        let vm = krunbox::Sandbox::builder()
            .rootfs(Rootfs::ephemeral(
                Rootfs::builtin(BuiltinImage::Agent),
                128 << 20,
            ))
            .memory_mib(512)
            .network(network)
            .build()
            .expect("sandbox definition")
            .boot()
            .await
            .expect("boot");
        let port = origin.port;
        let (text, _) = sh(
            &vm,
            "update-ca-certificates >/dev/null 2>&1; echo rc=$?; \
             test -f /usr/local/share/ca-certificates/krunbox-sandbox.crt && echo local-ca; \
             key=$(sed -n 2p /usr/local/share/ca-certificates/krunbox-sandbox.crt); \
             grep -qF \"$key\" /etc/ssl/certs/ca-certificates.crt && echo ca-in-bundle; \
             grep -q ca-certificates.crt /proc/self/mountinfo && echo bound || echo a-plain-file",
            SH_TIMEOUT,
        )
        .await;
        for line in ["rc=0", "local-ca", "ca-in-bundle", "a-plain-file"] {
            assert!(text.lines().any(|l| l == line), "{line}: {text}");
        }

        let (text, _) = sh(
            &vm,
            &format!(
                "cd /tmp && git clone -q https://git.test:{port}/repo.git && cat repo/hello.txt \
                 && git -C repo log --format=%s"
            ),
            SH_TIMEOUT,
        )
        .await;
        assert!(text.contains("cloned through the sandbox"), "{text}");
        assert!(text.contains("first"), "{text}");

        let (text, _) = sh(
            &vm,
            &format!(
                "pip install --quiet --no-cache-dir --disable-pip-version-check \
                   --break-system-packages --index-url https://pypi.test:{port}/simple/ demo-pkg \
                 && python3 -c 'import demo_pkg; print(\"value\", demo_pkg.VALUE)'"
            ),
            SH_TIMEOUT,
        )
        .await;
        assert!(text.contains("value 42"), "{text}");

        // Both went through the origin, under the names the guest used.
        {
            let paths = paths.lock().unwrap();
            let git_host = format!("git.test:{port}");
            let pypi_host = format!("pypi.test:{port}");
            assert!(
                paths
                    .iter()
                    .any(|p| p.starts_with(&git_host) && p.contains("git-upload-pack")),
                "{paths:?}"
            );
            assert!(
                paths
                    .iter()
                    .any(|p| p.starts_with(&pypi_host) && p.ends_with(".whl")),
                "{paths:?}"
            );
        }
        vm.shutdown().await.unwrap();
    });
}
