//! A real OCI registry on loopback for the pull tests: Debian's `docker-registry` (the CNCF
//! distribution registry), with token authentication served by a token service this module runs
//! in the test process, as Docker Hub's registry and auth service work. Images get into it with
//! `skopeo copy`.
//!
//! Who may do what (the token service's grants):
//! - `pusher` / [`PUSHER_PASSWORD`]: pull and push anywhere;
//! - `reader` / [`READER_PASSWORD`]: pull anywhere;
//! - anyone, without credentials: pull in `public/`.
//!
//! Tokens are JWTs signed ES256 by a key whose self-signed certificate the registry trusts
//! (`auth.token.rootcertbundle`), carried in the token's `x5c` header.

use std::convert::Infallible;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use base64::Engine;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response};
use ring::signature::{EcdsaKeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};

pub const PUSHER_PASSWORD: &str = "push-secret";
pub const READER_PASSWORD: &str = "read-secret";
const SERVICE: &str = "krunbox-test-registry";
const ISSUER: &str = "krunbox-test-token-service";

/// A running registry (killed, by pid, when dropped) and its token service.
pub struct Registry {
    child: Child,
    /// `127.0.0.1:PORT`.
    pub host: String,
    /// Where it stores blobs (`docker/registry/v2/blobs/sha256/XX/HEX/data`).
    #[allow(dead_code)] // each test binary uses some
    pub storage: PathBuf,
    _dir: tempfile::TempDir,
    token_service: tokio::task::JoinHandle<()>,
}

impl Registry {
    /// Starts the token service and the registry (call inside a tokio runtime).
    pub async fn start() -> Registry {
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["krunbox-token-signer".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let cert_path = dir.path().join("token-signer.pem");
        std::fs::write(&cert_path, cert.pem()).unwrap();
        let signer = Arc::new(Signer {
            key: EcdsaKeyPair::from_pkcs8(
                &ECDSA_P256_SHA256_FIXED_SIGNING,
                &key.serialize_der(),
                &ring::rand::SystemRandom::new(),
            )
            .unwrap(),
            x5c: base64::engine::general_purpose::STANDARD.encode(cert.der()),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let token_addr = listener.local_addr().unwrap();
        let token_service = tokio::spawn(serve_tokens(listener, signer));

        let storage = dir.path().join("storage");
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1
log:
  level: info
storage:
  filesystem:
    rootdirectory: {storage}
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:0
auth:
  token:
    realm: http://{token_addr}/token
    service: {SERVICE}
    issuer: {ISSUER}
    rootcertbundle: {cert}
",
                storage = storage.display(),
                cert = cert_path.display(),
            ),
        )
        .unwrap();
        let mut child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("docker-registry (Debian's package; scripts/setup.sh installs it)");
        // It logs the address it listens on (port 0 above: no race for a free port).
        let stderr = child.stderr.take().unwrap();
        let (found, listening) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut found = Some(found);
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(addr) = line
                    .split("listening on ")
                    .nth(1)
                    .and_then(|rest| rest.split(['"', ' ']).next())
                {
                    if let Some(found) = found.take() {
                        let _ = found.send(addr.to_string());
                    }
                }
                // Keep draining, so the registry never blocks on a full pipe.
            }
        });
        let host = tokio::task::spawn_blocking(move || {
            listening.recv_timeout(std::time::Duration::from_secs(60))
        })
        .await
        .unwrap()
        .expect("docker-registry did not say where it listens");
        Registry {
            child,
            host,
            storage,
            _dir: dir,
            token_service,
        }
    }

    /// Pushes the OCI layout at `layout` (tagged `latest`) as `repository:tag`, with `skopeo`.
    pub async fn push(&self, layout: &Path, repository: &str, tag: &str) {
        let tmp = tempfile::tempdir().unwrap();
        let out = tokio::process::Command::new("skopeo")
            .args([
                "--insecure-policy",
                "copy",
                "--quiet",
                "--dest-tls-verify=false",
            ])
            .arg(format!("--dest-creds=pusher:{PUSHER_PASSWORD}"))
            .arg(format!("oci:{}:latest", layout.display()))
            .arg(format!("docker://{}/{repository}:{tag}", self.host))
            .env("TMPDIR", tmp.path())
            .env("HOME", tmp.path())
            .stdin(Stdio::null())
            .output()
            .await
            .expect("skopeo (Debian's package; scripts/setup.sh installs it)");
        assert!(
            out.status.success(),
            "skopeo copy failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Puts the image index `index` as `repository:tag` (its manifests pushed already), as
    /// `pusher`: skopeo 1.9 does not push an index from an OCI layout.
    #[allow(dead_code)] // each test binary uses some
    pub async fn put_index(&self, repository: &str, tag: &str, index: &[u8]) {
        use oci_client::secrets::RegistryAuth;
        // reqwest under oci-client needs a process-wide rustls provider (krunbox installs ring
        // the same way when it pulls).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = oci_client::Client::new(oci_client::client::ClientConfig {
            protocol: oci_client::client::ClientProtocol::Http,
            ..Default::default()
        });
        let reference: oci_client::Reference =
            format!("{}/{repository}:{tag}", self.host).parse().unwrap();
        let auth = RegistryAuth::Basic("pusher".into(), PUSHER_PASSWORD.into());
        client
            .auth(&reference, &auth, oci_client::RegistryOperation::Push)
            .await
            .expect("a push token");
        client
            .push_manifest_raw(
                &reference,
                index.to_vec(),
                http::HeaderValue::from_static("application/vnd.oci.image.index.v1+json"),
            )
            .await
            .expect("putting the index");
    }

    /// The file the registry keeps the blob `digest` in.
    #[allow(dead_code)] // each test binary uses some
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap();
        self.storage
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.token_service.abort();
    }
}

struct Signer {
    key: EcdsaKeyPair,
    x5c: String,
}

async fn serve_tokens(listener: tokio::net::TcpListener, signer: Arc<Signer>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        let signer = signer.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let signer = signer.clone();
                async move { Ok::<_, Infallible>(token(&signer, &request)) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The user a request's basic credentials name: `Ok(None)` for none, `Err` for a wrong
/// password.
fn account<B>(request: &Request<B>) -> Result<Option<&'static str>, ()> {
    let Some(header) = request.headers().get(hyper::header::AUTHORIZATION) else {
        return Ok(None);
    };
    let encoded = header
        .to_str()
        .ok()
        .and_then(|h| h.strip_prefix("Basic "))
        .ok_or(())?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|_| ())?;
    match String::from_utf8_lossy(&decoded).split_once(':') {
        Some(("pusher", PUSHER_PASSWORD)) => Ok(Some("pusher")),
        Some(("reader", READER_PASSWORD)) => Ok(Some("reader")),
        _ => Err(()),
    }
}

/// `GET /token?service=…&scope=repository:NAME:ACTIONS…`: a token granting what the account
/// may of what it asks.
fn token<B>(signer: &Signer, request: &Request<B>) -> Response<Full<Bytes>> {
    let Ok(user) = account(request) else {
        return Response::builder()
            .status(401)
            .body(Full::new(Bytes::from_static(
                b"{\"details\":\"wrong credentials\"}",
            )))
            .unwrap();
    };
    let query = request.uri().query().unwrap_or_default();
    let mut access = Vec::new();
    for (key, value) in form_pairs(query) {
        if key != "scope" {
            continue;
        }
        let mut parts = value.splitn(3, ':');
        let (Some("repository"), Some(name), Some(actions)) =
            (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let granted: Vec<&str> = actions
            .split(',')
            .filter(|action| match (user, *action) {
                (Some("pusher"), _) => true,
                (Some("reader"), "pull") => true,
                (None, "pull") => name.starts_with("public/"),
                _ => false,
            })
            .collect();
        access.push(serde_json::json!({
            "type": "repository", "name": name, "actions": granted,
        }));
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let header = serde_json::json!({ "typ": "JWT", "alg": "ES256", "x5c": [signer.x5c] });
    let claims = serde_json::json!({
        "iss": ISSUER,
        "sub": user.unwrap_or(""),
        "aud": SERVICE,
        "exp": now + 300,
        "nbf": now - 10,
        "iat": now,
        "jti": format!("{now}-{}", access.len()),
        "access": access,
    });
    let url = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let signing_input = format!(
        "{}.{}",
        url.encode(header.to_string()),
        url.encode(claims.to_string())
    );
    let signature = signer
        .key
        .sign(&ring::rand::SystemRandom::new(), signing_input.as_bytes())
        .unwrap();
    let jwt = format!("{signing_input}.{}", url.encode(signature.as_ref()));
    let body = serde_json::json!({ "token": jwt, "access_token": jwt, "expires_in": 300 });
    Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

/// `application/x-www-form-urlencoded` pairs, decoded.
fn form_pairs(query: &str) -> impl Iterator<Item = (String, String)> + '_ {
    query.split('&').filter_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        Some((decode(key), decode(value)))
    })
}

fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(byte) => {
                        out.push(byte);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            byte => out.push(byte),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A registry on loopback holding the app image of tests/common/oci.rs, pushed as
/// `repository:tag`, and the runtime its token service runs on (keep both alive), for tests
/// that are not async themselves.
#[allow(dead_code)] // each test binary uses some
pub fn with_app(repository: &str, tag: &str) -> (tokio::runtime::Runtime, Registry) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let registry = runtime.block_on(Registry::start());
    let layout = tempfile::tempdir().unwrap();
    super::oci::oci_layout_dir(layout.path(), super::oci::Image::App);
    runtime.block_on(registry.push(layout.path(), repository, tag));
    (runtime, registry)
}
