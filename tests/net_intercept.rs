//! Intercepted HTTPS with real microVMs and real clients (curl, Python's urllib) in the agent
//! image: the guest trusts the sandbox CA, the host terminates its TLS, middleware adds a
//! credential the guest never sees, and the request goes on to an HTTPS origin this test runs
//! on 127.0.0.1 with a CA of its own (given to the network as its upstream trust). A secret's
//! placeholder becomes its value only on the way to the host it is bound to. Spoofed server
//! names and Host headers reach nothing.

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use krunbox::net::{
    Flow, HeaderName, HeaderValue, Intercept, Network, Protocol, RequestHead, Resolver, Secret,
    UpstreamTrust, Verdict,
};
use krunbox::{BuiltinImage, Instance, Rootfs, Sandbox};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

async fn sh(vm: &Instance, script: &str) -> String {
    let out = vm
        .command("sh")
        .args(["-c", script])
        .timeout(Duration::from_secs(120))
        .output()
        .await
        .expect("running sh in the guest");
    format!("{}{}", out.stdout_text(), out.stderr_text())
}

/// An HTTPS origin on loopback for `origin.test` and `elsewhere.test`, with a CA of its own: answers every
/// request with `origin says <path>` and keeps each request's head. Returns its port, its CA
/// (PEM) and the heads.
async fn https_origin() -> (u16, String, Arc<Mutex<Vec<String>>>) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "the test origin's CA");
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert =
        rcgen::CertificateParams::new(vec!["origin.test".to_owned(), "elsewhere.test".to_owned()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
    )
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind((LOOPBACK, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let kept = heads.clone();
    tokio::spawn(async move {
        loop {
            let Ok((conn, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, kept) = (acceptor.clone(), kept.clone());
            tokio::spawn(async move {
                let Ok(mut conn) = acceptor.accept(conn).await else {
                    return;
                };
                // Requests one after another on the connection (keep-alive), each answered.
                loop {
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") && head.len() < 16 * 1024 {
                        if conn.read(&mut byte).await.unwrap_or(0) == 0 {
                            return;
                        }
                        head.push(byte[0]);
                    }
                    let head = String::from_utf8_lossy(&head).into_owned();
                    let path = head.split(' ').nth(1).unwrap_or("?").to_owned();
                    kept.lock().unwrap().push(head);
                    let body = format!("origin says {path}\n");
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if conn.write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, ca_cert.pem(), heads)
}

/// The header named `name` in an HTTP/1 request head, lower-cased names compared.
fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

#[test]
fn intercepted_https_carries_an_injected_credential_the_guest_never_held() {
    common::run(async {
        let (port, origin_ca, heads) = https_origin().await;
        // What the guest sent, as the first middleware saw it (before the credential).
        let sent_by_guest: Arc<Mutex<Vec<String>>> = Arc::default();
        let recorder = sent_by_guest.clone();
        let intercept = Intercept::new()
            .middleware(move |request: &mut RequestHead| {
                let mut seen = format!("{} {}", request.method(), request.path());
                for (name, value) in request.headers() {
                    seen.push_str(&format!("\n{name}: {}", value.to_str().unwrap_or("?")));
                }
                recorder.lock().unwrap().push(seen);
            })
            .set_header(
                HeaderName::from_static("authorization"),
                HeaderValue::from_static("Bearer real-credential"),
            );
        let secret = Secret::new("API_KEY", "real-api-key")
            .unwrap()
            .bind_to("origin.test");
        let placeholder = secret.placeholder().to_owned();
        let network = Network::with_policy(move |flow: Flow| {
            let intercept = intercept.clone();
            async move {
                match (flow.protocol(), flow.hostname()) {
                    (Protocol::Dns, Some("origin.test" | "other.test" | "elsewhere.test")) => {
                        Verdict::resolve(Resolver::fixed([LOOPBACK]))
                    }
                    (Protocol::Tcp, Some("origin.test")) => Verdict::intercept(intercept),
                    (Protocol::Tcp, Some("elsewhere.test")) => Verdict::intercept(Intercept::new()),
                    _ => Verdict::deny(),
                }
            }
        })
        .upstream_trust(UpstreamTrust::pem(origin_ca.as_bytes()).unwrap())
        .secret(secret);
        let vm = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Agent))
            .memory_mib(512)
            .network(network)
            .build()
            .expect("sandbox definition (run scripts/setup.sh)")
            .boot()
            .await
            .expect("boot");

        // curl, trusting the system bundle (which now holds the sandbox CA).
        let text = sh(
            &vm,
            &format!("curl -sS https://origin.test:{port}/curl; echo rc=$?"),
        )
        .await;
        assert!(text.contains("origin says /curl"), "{text}");
        // Python's urllib, trusting what SSL_CERT_FILE names.
        let text = sh(
            &vm,
            &format!(
                "python3 -c \"import urllib.request; \
                 print(urllib.request.urlopen('https://origin.test:{port}/python').read().decode())\""
            ),
        )
        .await;
        assert!(text.contains("origin says /python"), "{text}");
        {
            let heads = heads.lock().unwrap();
            assert_eq!(heads.len(), 2, "{heads:?}");
            for head in heads.iter() {
                assert_eq!(
                    header(head, "authorization"),
                    Some("Bearer real-credential"),
                    "the origin got the credential: {head}"
                );
                assert_eq!(header(head, "host"), Some(&*format!("origin.test:{port}")));
            }
            let sent = sent_by_guest.lock().unwrap();
            assert_eq!(sent.len(), 2, "{sent:?}");
            for request in sent.iter() {
                assert!(
                    !request.to_ascii_lowercase().contains("authorization"),
                    "the guest never sent it: {request}"
                );
            }
        }
        // The secret: the guest has its placeholder; the bound host gets the real value, any
        // other host the placeholder.
        let text = sh(
            &vm,
            &format!(
                "echo key=$API_KEY; \
                 curl -sS -H \"X-Api-Key: $API_KEY\" https://origin.test:{port}/bound; \
                 curl -sS -H \"X-Api-Key: $API_KEY\" https://elsewhere.test:{port}/elsewhere"
            ),
        )
        .await;
        assert!(text.contains(&format!("key={placeholder}")), "{text}");
        assert!(text.contains("origin says /bound") && text.contains("origin says /elsewhere"));
        {
            let heads = heads.lock().unwrap();
            assert_eq!(heads.len(), 4, "{heads:?}");
            assert_eq!(
                header(&heads[2], "x-api-key"),
                Some("real-api-key"),
                "{}",
                heads[2]
            );
            assert_eq!(
                header(&heads[3], "x-api-key"),
                Some(placeholder.as_str()),
                "unbound host: the placeholder, unreplaced: {}",
                heads[3]
            );
        }
        // Nowhere in the guest is a credential, nor the sandbox CA's key.
        let text = sh(
            &vm,
            "env; cat /etc/ssl/certs/ca-certificates.crt | tail -c 2000",
        )
        .await;
        assert!(!text.contains("real-credential"), "{text}");
        assert!(!text.contains("real-api-key"), "{text}");
        assert!(text.contains("SSL_CERT_FILE="), "{text}");
        assert!(!text.contains("PRIVATE KEY"), "{text}");

        // A server name for another host on the intercepted address: the certificate is the
        // trusted hostname's, so verification fails, and nothing reaches the origin.
        let text = sh(
            &vm,
            &format!(
                "addr=$(getent hosts origin.test | cut -d' ' -f1); \
                 curl -sS --resolve other.test:{port}:$addr https://other.test:{port}/sni; \
                 echo rc=$?"
            ),
        )
        .await;
        assert!(!text.contains("origin says"), "{text}");
        assert!(!text.contains("rc=0"), "{text}");
        // The same, not verifying (-k), and a Host header naming the other host: 421.
        let text = sh(
            &vm,
            &format!(
                "addr=$(getent hosts origin.test | cut -d' ' -f1); \
                 curl -sSk -o /dev/null -w '%{{http_code}}' \
                   --resolve other.test:{port}:$addr https://other.test:{port}/host; echo; \
                 curl -sS -o /dev/null -w '%{{http_code}}' -H 'Host: other.test' \
                   https://origin.test:{port}/host2"
            ),
        )
        .await;
        assert_eq!(text.lines().collect::<Vec<_>>(), ["421", "421"], "{text}");
        // Bytes that are neither TLS nor HTTP on the intercepted connection end it: whatever
        // comes back, nothing goes upstream.
        let text = sh(
            &vm,
            &format!(
                "python3 -c \"
import socket
s = socket.create_connection(('origin.test', {port}), timeout=20)
s.sendall(b'SSH-2.0-not-http\\r\\n\\r\\n' + bytes(range(256)))
data = b''
try:
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    print('closed after', len(data), 'bytes:', data[:12])
except ConnectionResetError:
    print('closed by a reset after', len(data), 'bytes')
\""
            ),
        )
        .await;
        assert!(
            text.contains("closed after") || text.contains("closed by a reset"),
            "{text}"
        );
        assert!(!text.contains("origin says"), "{text}");
        assert_eq!(
            heads.lock().unwrap().len(),
            4,
            "nothing more reached the origin"
        );
        vm.shutdown().await.unwrap();
    });
}
