//! An HTTPS origin on 127.0.0.1 for the network tests: a CA of its own (which the sandbox's
//! network is told to trust upstream), a certificate for the names it serves, and hyper
//! serving HTTP/1.1 with a handler the test gives. Bodies are read whole: test traffic is
//! small.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// A running origin.
pub struct HttpsOrigin {
    pub port: u16,
    /// The origin's CA certificate, PEM: give it to `UpstreamTrust::pem`.
    pub ca_pem: String,
}

/// A request as the handler sees it: head and whole body.
pub type Handler = dyn Fn(Request<Bytes>) -> Response<Bytes> + Send + Sync;

/// Starts an origin for `names` on 127.0.0.1 (a free port), answering with `handler` (run on
/// a blocking thread: it may run a program).
pub async fn start(names: &[&str], handler: Arc<Handler>) -> HttpsOrigin {
    start_on(0, names, handler).await
}

/// [`start`] on a given port of 127.0.0.1 (0: a free one). A port below 1024 needs root, as
/// the VM tests have in the nested L1.
pub async fn start_on(port: u16, names: &[&str], handler: Arc<Handler>) -> HttpsOrigin {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "the test origin's CA");
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let cert = rcgen::CertificateParams::new(names)
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
    let listener = TcpListener::bind((IpAddr::V4(Ipv4Addr::LOCALHOST), port))
        .await
        .unwrap_or_else(|e| panic!("binding 127.0.0.1:{port} for the test's origin: {e}"));
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((conn, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, handler) = (acceptor.clone(), handler.clone());
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(conn).await else {
                    return;
                };
                let service =
                    hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                        let handler = handler.clone();
                        async move {
                            let (parts, body) = request.into_parts();
                            let body = body.collect().await?.to_bytes();
                            let request = Request::from_parts(parts, body);
                            let response = tokio::task::spawn_blocking(move || handler(request))
                                .await
                                .expect("the origin's handler panicked");
                            Ok::<_, hyper::Error>(response.map(Full::new))
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    HttpsOrigin {
        port,
        ca_pem: ca_cert.pem(),
    }
}

/// A plain response.
pub fn respond(status: u16, content_type: &str, body: impl Into<Bytes>) -> Response<Bytes> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(body.into())
        .unwrap()
}
