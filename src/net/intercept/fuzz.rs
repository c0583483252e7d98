//! The `http_request` fuzz harness (see [`crate::fuzzing::http_request`]): the bytes a guest
//! sends on an intercepted connection, served as production serves them ([`serve_http`]:
//! hyper-util's auto server, HTTP/1.1 and HTTP/2 with prior knowledge, each request through
//! [`handle`](super::handle)) with no network at all. The guest's end is an in-memory pipe, and
//! so is every upstream connection the client dials ([`upstream::Dialer::Memory`]); a fake
//! origin (hyper's HTTP/1.1 server) records what it got, byte for byte, and answers each request
//! with an echo of it (its headers, target and body; its `Authorization` in a header of its own;
//! a `Location` naming its target), as an error page or a redirect would.
//!
//! Each input is served twice: as a plain-HTTP connection (port 80), and as the bytes inside a
//! guest's TLS connection (port 443: the TLS the host terminates is not run, the requests go
//! upstream over real TLS, in memory, to the origin with a certificate from the sandbox CA).
//! The flow's trusted hostname is [`HOSTNAME`], with three secrets whose placeholders are fixed
//! so inputs can name them: [`BOUND_PLACEHOLDER`] (bound to the hostname, swapped in bodies
//! too), [`QUERY_PLACEHOLDER`] (bound to `*.test`, swapped in the query string too) and
//! [`OTHER_PLACEHOLDER`] (bound to another host, looked for in bodies). Three middleware run: the first tags each
//! request and records the head it sees; the second answers requests whose path starts with
//! [`REFUSED_PATH`] itself (`403`); the third tries to add every hop-by-hop header and a Host of
//! its own.
//!
//! One input runs on a current-thread tokio runtime, counted in scheduler turns (no clock):
//! the guest writes the input, the connection runs until it is idle, the guest finishes sending
//! (its write side closes), and the connection must then end, and the upstream connections
//! after it. Then the harness checks that every request the origin received:
//! - has one Host, the trusted hostname (so no request for another authority got there);
//! - has no hop-by-hop header (`Connection`, `Keep-Alive`, `Proxy-Authenticate`,
//!   `Proxy-Authorization`, `TE`, `Trailer`, `Upgrade`), and a `Transfer-Encoding` only as the
//!   client's own framing (`chunked`, and then no `Content-Length`);
//! - is one the middleware saw (by its tag over TLS; on plain HTTP, where a header middleware
//!   adds would have the request refused as a credential in clear, by its contents), and the
//!   only one for it, and not one the second middleware answered;
//! - on plain HTTP, holds no placeholder of a secret bound to the hostname where it would be
//!   swapped over TLS (such a request is refused, `403`);
//! - has the method, the target and the headers that request had and nothing else, but for
//!   the swap: over TLS, the bound secrets' placeholders are swapped for their values (in the
//!   query string only for the secret that opted in); on plain HTTP, none is. A body swapped
//!   into loses its `Content-Length` and goes chunked. (What the
//!   middleware saw is after `handle` stripped the guest's hop-by-hop headers, so that headers
//!   the guest's `Connection` named went too is checked by the seeds' test, not here.)
//!
//! and that a real value is on an upstream connection's wire exactly as often as it is in
//! those requests' headers, targets and bodies (when every body on it arrived whole), that the
//! other host's secret, and any on plain HTTP, is never on the wire at all, that none ever
//! reaches the guest (the origin echoes each request: the values it got go back to the guest as
//! placeholders), that requests ask for no compression (so the echo can be looked into), and that the origin's own hop-by-hop response headers never
//! reach the guest either. Nothing may panic, anywhere.

use std::collections::HashSet;
use std::convert::Infallible;
use std::panic::resume_unwind;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{ready, Context as TaskContext, Poll};

use ::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use ::http::{Method, Request, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::ca::CertificateAuthority;
use super::{serve_http, upstream, Intercept, InterceptJob, OneCertificate, RequestHead};
use crate::net::Secret;

/// The flow's trusted hostname (on port 80 for plain HTTP, 443 for TLS).
pub(crate) const HOSTNAME: &str = "origin.test";

fn port(tls: bool) -> u16 {
    if tls {
        443
    } else {
        80
    }
}

/// A secret bound to [`HOSTNAME`]: its placeholder, and its value.
pub(crate) const BOUND_PLACEHOLDER: &str = "krunbox-secret-00000000000000000000000000000001";
const BOUND_VALUE: &str = "REAL-bound-c0ffee";
/// A secret bound to `*.test` and swapped in query strings too.
pub(crate) const QUERY_PLACEHOLDER: &str = "krunbox-secret-00000000000000000000000000000002";
const QUERY_VALUE: &str = "REAL-query-5eed";
/// A secret bound to another host only.
pub(crate) const OTHER_PLACEHOLDER: &str = "krunbox-secret-00000000000000000000000000000003";
const OTHER_VALUE: &str = "REAL-other-bad";

/// Requests whose path starts with this are answered `403` by middleware: never sent upstream.
pub(crate) const REFUSED_PATH: &str = "/krunbox-refused";

/// Each way of each in-memory pipe.
const PIPE: usize = 64 * 1024;
/// The guest writes its input in pieces of at most this many bytes.
const WRITE_CHUNK: usize = 4096;
/// Scheduler turns without progress after which the connection is idle.
const IDLE_TURNS: usize = 64;
/// Scheduler turns one input may take in all; past it, something hung.
const TURN_LIMIT: usize = 100_000;
/// What the harness keeps of what the guest receives, of each upstream connection's bytes and
/// of each request's body.
const KEEP: usize = 1 << 20;

/// The header the first middleware tags each request with (its index in [`Log::seen`]).
const TAG: HeaderName = HeaderName::from_static("x-krunbox-fuzz-seq");
/// The origin's response header holding the request's `Authorization`, echoed.
const ECHO: HeaderName = HeaderName::from_static("x-echo-authorization");
/// Response headers of the origin that are hop-by-hop (`Connection` names the first).
const ORIGIN_HOP: HeaderName = HeaderName::from_static("x-upstream-hop");
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");

/// The header names that must never go upstream (the harness's own list, not `handle`'s).
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    KEEP_ALIVE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

/// Runs `data` as the guest's bytes, on plain HTTP and inside TLS, and checks the properties
/// in the module's documentation; panics on a violation.
pub(crate) fn fuzz_http(data: &[u8]) {
    run(data, false);
    run(data, true);
}

impl Intercept {
    /// [`fuzz_http`], where [`crate::fuzzing`] reaches it (`net` keeps `intercept` private).
    pub(crate) fn fuzz_http(data: &[u8]) {
        fuzz_http(data)
    }
}

/// What happened to one input.
#[derive(Debug, Default)]
struct Log {
    /// Bumped by everything that moves (the idle check watches it).
    progress: u64,
    /// The requests the middleware saw, by tag.
    seen: Vec<Seen>,
    /// The requests the origin received.
    received: Vec<Received>,
    /// The bytes of each upstream connection, as the origin read them.
    raw: Vec<Vec<u8>>,
    /// What the guest received.
    to_guest: Vec<u8>,
}

#[derive(Debug)]
struct Seen {
    method: Method,
    path: String,
    headers: HeaderMap,
}

#[derive(Debug)]
struct Received {
    connection: usize,
    method: Method,
    target: String,
    headers: HeaderMap,
    /// `None`: it did not end well (or was larger than [`KEEP`]).
    body: Option<Bytes>,
}

type Shared = Arc<Mutex<Log>>;

fn lock(log: &Shared) -> std::sync::MutexGuard<'_, Log> {
    log.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Serves `data` (as the bytes inside a TLS connection if `tls`) and checks the outcome.
/// `None`: an input production would not serve as HTTP (nothing, or, on plain HTTP, a TLS
/// handshake's first byte).
fn run(data: &[u8], tls: bool) -> Option<Log> {
    if data.first().is_none_or(|&first| first == 0x16 && !tls) {
        return None;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread runtime");
    let log = Shared::default();
    runtime.block_on(drive(data.to_vec(), tls, log.clone()));
    drop(runtime);
    let log = std::mem::take(&mut *lock(&log));
    check(&log, data, tls);
    Some(log)
}

struct Fixture {
    secrets: Arc<[Secret]>,
    authority: Arc<CertificateAuthority>,
    /// The upstream client's: trusts the sandbox CA, resumes no session (so an input runs the
    /// same every time).
    client_tls: Arc<rustls::ClientConfig>,
    /// The origin's: the sandbox CA's certificate for the hostname.
    origin_tls: Arc<rustls::ServerConfig>,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let secret = |env: &str, value: &str, placeholder: &str| {
            Secret::new(env, value)
                .expect("a valid secret")
                .with_placeholder(placeholder)
        };
        let provider = || Arc::new(rustls::crypto::ring::default_provider());
        let authority = CertificateAuthority::generate("fuzz").expect("a CA");
        let trust = super::UpstreamTrust::pem(authority.certificate_pem().as_bytes())
            .expect("the CA's certificate");
        let mut client_tls = (*trust.client_config().expect("a client config")).clone();
        client_tls.resumption = rustls::client::Resumption::disabled();
        let key = authority
            .certified_key(HOSTNAME)
            .expect("a certificate for the hostname");
        let mut origin_tls = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(OneCertificate(key)));
        origin_tls.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        origin_tls.send_tls13_tickets = 0;
        Fixture {
            secrets: [
                secret("TOKEN", BOUND_VALUE, BOUND_PLACEHOLDER)
                    .bind_to(HOSTNAME)
                    .in_body(),
                secret("MAPS_KEY", QUERY_VALUE, QUERY_PLACEHOLDER)
                    .bind_to("*.test")
                    .in_query_string(),
                secret("OTHER_TOKEN", OTHER_VALUE, OTHER_PLACEHOLDER)
                    .bind_to("api.other.test")
                    .in_body(),
            ]
            .into(),
            authority: Arc::new(authority),
            client_tls: Arc::new(client_tls),
            origin_tls: Arc::new(origin_tls),
        }
    })
}

/// The middleware: one tags and records each request, one tries to add what it may not.
fn intercept(log: &Shared) -> Intercept {
    let log = log.clone();
    Intercept::new()
        .middleware(move |head: &mut RequestHead| {
            let mut log = lock(&log);
            let seq = log.seen.len();
            // On plain HTTP a header middleware adds would have the request refused (it could
            // be a credential): there the harness matches requests by their contents instead.
            if head.scheme() == &::http::uri::Scheme::HTTPS {
                head.headers_mut().insert(TAG, HeaderValue::from(seq));
            }
            log.progress += 1;
            log.seen.push(Seen {
                method: head.method().clone(),
                path: head.path().to_owned(),
                headers: head.headers().clone(),
            });
        })
        .answer_with(|head: &RequestHead| {
            head.path()
                .starts_with(REFUSED_PATH)
                .then(|| super::Answer::forbidden("refused by the fuzz harness\n"))
        })
        .middleware(|head: &mut RequestHead| {
            let headers = head.headers_mut();
            for (name, value) in [
                (header::CONNECTION, "keep-alive, upgrade, te"),
                (KEEP_ALIVE, "timeout=5"),
                (header::UPGRADE, "h2c"),
                (header::TE, "trailers"),
                (header::TRAILER, "x-checksum"),
                (header::PROXY_AUTHORIZATION, "Basic bWU6cGFzcw=="),
                (header::PROXY_AUTHENTICATE, "Basic"),
                (header::TRANSFER_ENCODING, "gzip"),
                (header::HOST, "evil.test"),
            ] {
                headers.insert(name, HeaderValue::from_static(value));
            }
        })
}

/// One scheduler turn of the `TURN_LIMIT` an input has.
async fn turn(turns: &mut usize, what: &str) {
    *turns += 1;
    assert!(*turns <= TURN_LIMIT, "{what} within {TURN_LIMIT} turns");
    tokio::task::yield_now().await;
}

fn joined<T>(result: Result<T, tokio::task::JoinError>) {
    if let Err(err) = result {
        if err.is_panic() {
            resume_unwind(err.into_panic());
        }
    }
}

async fn drive(data: Vec<u8>, tls: bool, log: Shared) {
    let fixture = fixture();
    let stop = CancellationToken::new();
    let (to_origin, connections) = mpsc::unbounded_channel();
    let job = InterceptJob {
        hostname: HOSTNAME.into(),
        port: port(tls),
        upstream: Vec::new(),
        intercept: intercept(&log),
        secrets: fixture.secrets.clone(),
        authority: fixture.authority.clone(),
        client_tls: fixture.client_tls.clone(),
        audit: crate::net::audit::Audit::new(),
        upstream_permits: Arc::new(tokio::sync::Semaphore::new(
            crate::net::stack::MAX_UPSTREAM_REQUESTS,
        )),
        stop: stop.clone(),
        budget: crate::budget::Budget::new(&crate::Limits::new()),
    };
    let dialer = upstream::Dialer::Memory {
        buffer: PIPE,
        to: to_origin,
    };
    let (guest, ours) = tokio::io::duplex(PIPE);
    let served = tokio::spawn(serve_http(guest, tls, dialer, job));
    let origin = tokio::spawn(origin(connections, tls, log.clone()));
    let (mut from_host, mut to_host) = tokio::io::split(ours);
    let reader = tokio::spawn({
        let log = log.clone();
        async move {
            let mut buf = vec![0; 16 * 1024];
            while let Ok(n @ 1..) = from_host.read(&mut buf).await {
                let mut log = lock(&log);
                log.progress += 1;
                keep(&mut log.to_guest, &buf[..n]);
            }
        }
    });
    let (close, mut closed) = oneshot::channel::<()>();
    let writer = tokio::spawn({
        let log = log.clone();
        async move {
            let write = async {
                for chunk in data.chunks(WRITE_CHUNK) {
                    if to_host.write_all(chunk).await.is_err() {
                        break;
                    }
                    lock(&log).progress += 1;
                }
            };
            let written = tokio::select! {
                _ = write => true,
                _ = &mut closed => false,
            };
            if written {
                let _ = closed.await;
            }
            // The guest finishes sending (a FIN).
            let _ = to_host.shutdown().await;
        }
    });
    let mut turns = 0;
    let (mut last, mut idle) = (u64::MAX, 0);
    while idle < IDLE_TURNS && !served.is_finished() {
        turn(&mut turns, "the connection's first phase").await;
        let now = lock(&log).progress;
        if now == last {
            idle += 1;
        } else {
            (last, idle) = (now, 0);
        }
    }
    let _ = close.send(());
    while !served.is_finished() {
        turn(
            &mut turns,
            "the intercepted connection ends after the guest finished sending",
        )
        .await;
    }
    joined(served.await);
    // As when the sandbox's network stops: hyper's tasks for the connection end.
    stop.cancel();
    let tasks: [&JoinHandle<()>; 3] = [&origin, &reader, &writer];
    while !tasks.iter().all(|task| task.is_finished()) {
        turn(
            &mut turns,
            "the upstream connections end after the intercepted one",
        )
        .await;
    }
    joined(origin.await);
    joined(reader.await);
    joined(writer.await);
}

fn keep(kept: &mut Vec<u8>, bytes: &[u8]) {
    let room = KEEP.saturating_sub(kept.len());
    kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
}

/// The fake origin: an HTTP/1.1 server (over TLS if `tls`) on each connection the client dials.
async fn origin(mut connections: mpsc::UnboundedReceiver<DuplexStream>, tls: bool, log: Shared) {
    let mut tasks = tokio::task::JoinSet::new();
    while let Some(stream) = connections.recv().await {
        let connection = {
            let mut log = lock(&log);
            log.raw.push(Vec::new());
            log.raw.len() - 1
        };
        let log = log.clone();
        tasks.spawn(async move {
            if !tls {
                return origin_connection(stream, connection, log).await;
            }
            let acceptor = tokio_rustls::TlsAcceptor::from(fixture().origin_tls.clone());
            if let Ok(stream) = acceptor.accept(stream).await {
                origin_connection(stream, connection, log).await;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        joined(done);
    }
}

/// Serves one upstream connection, `stream` (what is inside TLS, when it is TLS).
async fn origin_connection<S>(stream: S, connection: usize, log: Shared)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let io = Recorded {
        stream,
        connection,
        log: log.clone(),
    };
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let log = log.clone();
        async move {
            let (parts, body) = request.into_parts();
            let index = {
                let mut log = lock(&log);
                log.progress += 1;
                log.received.push(Received {
                    connection,
                    method: parts.method.clone(),
                    target: parts.uri.to_string(),
                    headers: parts.headers.clone(),
                    body: None,
                });
                log.received.len() - 1
            };
            let mut echo = b"upstream ok\n".to_vec();
            if let Ok(body) = Limited::new(body, KEEP).collect().await {
                let body = body.to_bytes();
                let mut log = lock(&log);
                log.progress += 1;
                log.received[index].body = Some(body.clone());
                // An origin that echoes what it got: the secrets' values must go back to the
                // guest as placeholders.
                echo.extend_from_slice(&body);
            }
            for (name, value) in &parts.headers {
                echo.extend_from_slice(name.as_str().as_bytes());
                echo.extend_from_slice(b": ");
                echo.extend_from_slice(value.as_bytes());
                echo.push(b'\n');
            }
            echo.extend_from_slice(parts.uri.to_string().as_bytes());
            let mut response = Response::new(Full::new(Bytes::from(echo)));
            let headers = response.headers_mut();
            if let Some(value) = parts.headers.get(header::AUTHORIZATION) {
                headers.insert(ECHO, value.clone());
            }
            headers.insert(
                header::LOCATION,
                HeaderValue::from_str(&format!("https://{HOSTNAME}{}", parts.uri))
                    .unwrap_or(HeaderValue::from_static("/")),
            );
            headers.insert(ORIGIN_HOP, HeaderValue::from_static("1"));
            headers.insert(
                header::CONNECTION,
                HeaderValue::from_static("x-upstream-hop"),
            );
            headers.insert(KEEP_ALIVE, HeaderValue::from_static("timeout=5"));
            Ok::<_, Infallible>(response)
        }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(io), service)
        .await;
}

/// The origin's end of an upstream connection, recording what it reads.
struct Recorded<S> {
    stream: S,
    connection: usize,
    log: Shared,
}

impl<S: AsyncRead + Unpin> AsyncRead for Recorded<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.stream).poll_read(cx, buf))?;
        let read = &buf.filled()[before..];
        if !read.is_empty() {
            let mut log = lock(&this.log);
            log.progress += 1;
            keep(&mut log.raw[this.connection], read);
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Recorded<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    count(haystack, needle) > 0
}

fn count(haystack: &[u8], needle: &[u8]) -> usize {
    if needle.is_empty() {
        return 0;
    }
    haystack
        .windows(needle.len())
        .filter(|w| *w == needle)
        .count()
}

fn trimmed(value: &[u8]) -> &[u8] {
    let start = value.iter().position(|b| !matches!(b, b' ' | b'\t'));
    let end = value.iter().rposition(|b| !matches!(b, b' ' | b'\t'));
    match (start, end) {
        (Some(start), Some(end)) => &value[start..=end],
        _ => &[],
    }
}

/// A header value the guest sent, as it should go upstream: over TLS, the bound secrets'
/// placeholders swapped for their values (in values that are text).
fn swapped(value: &HeaderValue, tls: bool) -> Vec<u8> {
    match value.to_str() {
        Ok(text) if tls => text
            .replace(BOUND_PLACEHOLDER, BOUND_VALUE)
            .replace(QUERY_PLACEHOLDER, QUERY_VALUE)
            .into_bytes(),
        _ => value.as_bytes().to_vec(),
    }
}

/// Whether `received` upstream is the request the middleware saw as `seen`: its method, its
/// target and its headers, but for the swap (over TLS) and the client's own framing (`te`:
/// its `Transfer-Encoding`).
fn compare(received: &Received, seen: &Seen, te: &[&[u8]], tls: bool) -> Result<(), String> {
    if received.method != seen.method {
        return Err(format!("its method, not {}", seen.method));
    }
    if received.method == Method::CONNECT {
        let target = format!("{HOSTNAME}:{}", port(tls));
        if received.target != target {
            return Err(format!("its target, not {target}"));
        }
    } else {
        let path = if tls {
            seen.path.replace(QUERY_PLACEHOLDER, QUERY_VALUE)
        } else {
            seen.path.clone()
        };
        // An HTTP/2 `:path` may be a bare query; the origin-form of a URI starts with /.
        let path = match path.as_bytes().first() {
            None | Some(b'?') => format!("/{path}"),
            Some(_) => path,
        };
        if received.target != path {
            return Err(format!("its target, not {path}"));
        }
    }
    let headers = &received.headers;
    let names: HashSet<&HeaderName> = seen.headers.keys().chain(headers.keys()).collect();
    for name in names {
        if name == header::HOST || name == header::TRANSFER_ENCODING {
            continue;
        }
        if name == header::ACCEPT_ENCODING {
            // Requests to a host secrets are bound to ask for no compression, so the secrets'
            // values can be looked for in what comes back.
            if headers.get(name).map(|v| v.as_bytes()) != Some(&b"identity"[..]) {
                return Err(format!(
                    "Accept-Encoding {:?}, not identity",
                    headers.get(name)
                ));
            }
            continue;
        }
        let got: Vec<&[u8]> = headers
            .get_all(name)
            .iter()
            .map(|v| trimmed(v.as_bytes()))
            .collect();
        let sent: Vec<Vec<u8>> = seen
            .headers
            .get_all(name)
            .iter()
            .map(|v| swapped(v, tls))
            .collect();
        let sent: Vec<&[u8]> = sent.iter().map(|v| trimmed(v)).collect();
        if name == header::CONTENT_LENGTH && sent.is_empty() {
            // The client's own framing.
            if got.len() > 1 {
                return Err(format!("Content-Length {got:?}"));
            }
            continue;
        }
        if name == header::CONTENT_LENGTH && got.is_empty() && tls {
            // A body secrets may be swapped into goes chunked.
            if te != [b"chunked"] {
                return Err("no Content-Length, and not chunked".into());
            }
            continue;
        }
        if got != sent {
            return Err(format!("header {name}: {got:?}, not {sent:?}"));
        }
    }
    Ok(())
}

/// The properties of the module's documentation.
fn check(log: &Log, data: &[u8], tls: bool) {
    let values = [BOUND_VALUE, QUERY_VALUE, OTHER_VALUE];
    // A value the guest wrote itself proves nothing by being somewhere.
    let guest_wrote = |value: &str| contains(data, value.as_bytes());
    let mut tags = HashSet::new();
    for (i, received) in log.received.iter().enumerate() {
        let at = format!(
            "upstream request {i} ({} {})",
            received.method, received.target
        );
        let headers = &received.headers;
        let hosts: Vec<&[u8]> = headers
            .get_all(header::HOST)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect();
        assert_eq!(hosts, [HOSTNAME.as_bytes()], "{at}: its Host");
        for name in &HOP_BY_HOP {
            assert!(!headers.contains_key(name), "{at}: a {name} header");
        }
        let te: Vec<&[u8]> = headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect();
        assert!(
            te.is_empty() || te == [b"chunked"],
            "{at}: Transfer-Encoding {te:?}"
        );
        assert!(
            te.is_empty() || !headers.contains_key(header::CONTENT_LENGTH),
            "{at}: both Transfer-Encoding and Content-Length"
        );
        let seen = if tls {
            let tag: Vec<&[u8]> = headers.get_all(TAG).iter().map(|v| v.as_bytes()).collect();
            let tag = match tag[..] {
                [tag] => std::str::from_utf8(tag)
                    .ok()
                    .and_then(|t| t.parse::<usize>().ok()),
                _ => None,
            };
            let Some(seen) = tag.and_then(|tag| log.seen.get(tag).map(|seen| (tag, seen))) else {
                panic!("{at}: not a request the middleware saw: {headers:?}");
            };
            if let Err(why) = compare(received, seen.1, &te, tls) {
                panic!("{at}: {why}");
            }
            seen
        } else {
            // Untagged: the first request the middleware saw that this one is, and no other
            // upstream request was.
            let found = log.seen.iter().enumerate().find(|(tag, seen)| {
                !tags.contains(tag) && compare(received, seen, &te, tls).is_ok()
            });
            let Some(seen) = found else {
                panic!("{at}: not a request the middleware saw: {headers:?}");
            };
            // Nothing a bound secret's value would replace goes out in clear.
            for placeholder in [BOUND_PLACEHOLDER, QUERY_PLACEHOLDER] {
                assert!(
                    !headers
                        .values()
                        .any(|v| contains(v.as_bytes(), placeholder.as_bytes())),
                    "{at}: a bound secret's placeholder went upstream over plain HTTP"
                );
            }
            assert!(
                !received.target.contains(QUERY_PLACEHOLDER),
                "{at}: a query secret's placeholder went upstream over plain HTTP"
            );
            seen
        };
        assert!(
            tags.insert(seen.0),
            "{at}: a second upstream request for one the guest sent"
        );
        assert!(
            !seen.1.path.starts_with(REFUSED_PATH),
            "{at}: a request middleware answered went upstream"
        );
    }
    for (connection, raw) in log.raw.iter().enumerate() {
        for value in values {
            if guest_wrote(value) {
                continue;
            }
            let needle = value.as_bytes();
            if value == OTHER_VALUE {
                assert_eq!(
                    count(raw, needle),
                    0,
                    "a secret went to a host it is not bound to"
                );
            }
            if !tls {
                assert_eq!(
                    count(raw, needle),
                    0,
                    "a secret went upstream over plain HTTP"
                );
            }
            let requests = || log.received.iter().filter(|r| r.connection == connection);
            if raw.len() >= KEEP || requests().any(|r| r.body.is_none()) {
                continue;
            }
            let in_requests: usize = requests()
                .map(|r| {
                    count(r.target.as_bytes(), needle)
                        + r.body.as_deref().map_or(0, |b| count(b, needle))
                        + r.headers
                            .values()
                            .map(|v| count(v.as_bytes(), needle))
                            .sum::<usize>()
                })
                .sum();
            assert_eq!(
                count(raw, needle),
                in_requests,
                "upstream connection {connection}: {value} outside the swapped headers, query \
                 and bodies"
            );
        }
    }
    for value in values {
        assert!(
            guest_wrote(value) || !contains(&log.to_guest, value.as_bytes()),
            "the guest received the real value {value}"
        );
    }
    let to_guest = log.to_guest.to_ascii_lowercase();
    for line in [&b"\r\nx-upstream-hop:"[..], b"\r\nkeep-alive:"] {
        assert!(
            !contains(&to_guest, line),
            "the origin's hop-by-hop header {:?} reached the guest",
            String::from_utf8_lossy(line)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An HTTP/2 frame.
    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut frame = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        frame.extend_from_slice(&[kind, flags]);
        frame.extend_from_slice(&stream.to_be_bytes());
        frame.extend_from_slice(payload);
        frame
    }

    /// An HPACK string literal, not Huffman-coded (shorter than 127 bytes).
    fn string(text: &str) -> Vec<u8> {
        assert!(text.len() < 127);
        let mut out = vec![text.len() as u8];
        out.extend_from_slice(text.as_bytes());
        out
    }

    /// A header block: `indexed` entries of HPACK's static table, then literals (without
    /// indexing) whose name is a static entry (`Ok(index)`) or a literal (`Err(name)`).
    fn header_block(indexed: &[u8], literals: &[(Result<u8, &str>, &str)]) -> Vec<u8> {
        let mut block: Vec<u8> = indexed.iter().map(|i| 0x80 | i).collect();
        for (name, value) in literals {
            match name {
                Ok(index) => block.push(*index),
                Err(name) => {
                    block.push(0);
                    block.extend(string(name));
                }
            }
            block.extend(string(value));
        }
        block
    }

    /// An HTTP/2 stream of a seed: its id, its header block, and its body if it has one.
    type H2Stream<'a> = (u32, Vec<u8>, Option<&'a [u8]>);

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    const HEADERS: u8 = 1;
    const DATA: u8 = 0;
    const SETTINGS: u8 = 4;
    const END_STREAM: u8 = 1;
    const END_HEADERS: u8 = 4;
    // HPACK's static table: :authority, :method GET, :method POST, :path /, :scheme http.
    const AUTHORITY: u8 = 1;
    const GET: u8 = 2;
    const POST: u8 = 3;
    const PATH_ROOT: u8 = 4;
    const PATH: u8 = 4;
    const SCHEME_HTTP: u8 = 6;

    /// What a guest sends on an intercepted connection, and some it should not: each is an
    /// `http_request` input. Fixed bytes: the seeds are committed.
    pub(crate) fn http_request_seeds() -> Vec<Vec<u8>> {
        let h2 = |streams: &[H2Stream]| {
            let mut bytes = PREFACE.to_vec();
            bytes.extend(frame(SETTINGS, 0, 0, &[]));
            for (stream, block, body) in streams {
                let flags = END_HEADERS | if body.is_some() { 0 } else { END_STREAM };
                bytes.extend(frame(HEADERS, flags, *stream, block));
                if let Some(body) = body {
                    bytes.extend(frame(DATA, END_STREAM, *stream, body));
                }
            }
            bytes
        };
        let bearer = format!("Bearer {BOUND_PLACEHOLDER}");
        vec![
            // 0: a plain GET.
            b"GET /v1/models?limit=1 HTTP/1.1\r\nHost: origin.test\r\nUser-Agent: curl/8.5.0\r\n\
              Accept: */*\r\n\r\n"
                .to_vec(),
            // 1: HTTP/1.0, keep-alive asked for.
            b"GET / HTTP/1.0\r\nHost: origin.test:80\r\nConnection: keep-alive\r\n\r\n".to_vec(),
            // 2: pipelined requests with hop-by-hop headers, one named by Connection; the
            // last closes.
            b"GET /a HTTP/1.1\r\nHost: origin.test\r\nConnection: keep-alive, x-private\r\n\
              X-Private: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nUpgrade: websocket\r\n\
              Proxy-Authorization: Basic eDp5\r\n\r\n\
              HEAD /b HTTP/1.1\r\nHost: ORIGIN.test.\r\n\r\n\
              DELETE /c HTTP/1.1\r\nHost: origin.test\r\nConnection: close\r\n\r\n"
                .to_vec(),
            // 3: a chunked POST with a trailer, then one with a length and 100-continue.
            b"POST /upload HTTP/1.1\r\nHost: origin.test\r\nTransfer-Encoding: chunked\r\n\
              Content-Type: text/plain\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\nX-Sum: 1\r\n\r\n\
              PUT /file HTTP/1.1\r\nHost: origin.test\r\nContent-Length: 4\r\n\
              Expect: 100-continue\r\n\r\nbody"
                .to_vec(),
            // 4: another host, then the right host on another port: both 421.
            b"GET / HTTP/1.1\r\nHost: evil.test\r\n\r\n\
              GET / HTTP/1.1\r\nHost: origin.test:8080\r\n\r\n"
                .to_vec(),
            // 5: absolute-form: its authority decides, not Host.
            b"GET http://origin.test/abs?q=1 HTTP/1.1\r\nHost: evil.test\r\n\r\n\
              GET http://evil.test/ HTTP/1.1\r\nHost: origin.test\r\n\r\n"
                .to_vec(),
            // 6: CONNECT to the hostname, and to another.
            b"CONNECT origin.test:80 HTTP/1.1\r\nHost: origin.test:80\r\n\r\n\
              CONNECT evil.test:443 HTTP/1.1\r\nHost: evil.test:443\r\n\r\n"
                .to_vec(),
            // 7: HTTP/2 with prior knowledge: a GET, and a POST with a placeholder and a body.
            h2(&[
                (
                    1,
                    header_block(&[GET, SCHEME_HTTP, PATH_ROOT], &[(Ok(AUTHORITY), HOSTNAME)]),
                    None,
                ),
                (
                    3,
                    header_block(
                        &[POST, SCHEME_HTTP],
                        &[
                            (Ok(PATH), "/v1/chat?x=1"),
                            (Ok(AUTHORITY), HOSTNAME),
                            (Err("authorization"), &bearer),
                            (Err("content-type"), "application/json"),
                        ],
                    ),
                    Some(b"{\"model\":\"m\"}"),
                ),
            ]),
            // 8: HTTP/2 for another authority: 421.
            h2(&[(
                1,
                header_block(
                    &[GET, SCHEME_HTTP, PATH_ROOT],
                    &[(Ok(AUTHORITY), "evil.test")],
                ),
                None,
            )]),
            // 9: not HTTP.
            b"\x00\xffGARBAGE \x7f\r\n\r\nGET\r\n".to_vec(),
            // 10: placeholders: one bound here (in two headers), one bound here and opted in
            // to the query, one bound elsewhere.
            format!(
                "GET /maps?key={QUERY_PLACEHOLDER}&z=1 HTTP/1.1\r\nHost: origin.test\r\n\
                 Authorization: {bearer}\r\nX-Copy: a{BOUND_PLACEHOLDER}b{BOUND_PLACEHOLDER}\r\n\
                 X-Maps-Key: {QUERY_PLACEHOLDER}\r\nX-Other-Key: {OTHER_PLACEHOLDER}\r\n\r\n"
            )
            .into_bytes(),
            // 11: Content-Length and chunked together, with a request hidden in the body.
            b"POST / HTTP/1.1\r\nHost: origin.test\r\nContent-Length: 4\r\n\
              Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n\
              GET /smuggled HTTP/1.1\r\nHost: evil.test\r\n\r\n"
                .to_vec(),
            // 12: asterisk-form, which goes upstream as it came.
            b"OPTIONS * HTTP/1.1\r\nHost: origin.test\r\n\r\n".to_vec(),
            // 13: a POST middleware answers (its body is read and dropped), then a request on
            // the same connection that goes upstream.
            format!(
                "POST {REFUSED_PATH}/x HTTP/1.1\r\nHost: origin.test\r\nContent-Length: 5\r\n\r\n\
                 hello\
                 GET /after HTTP/1.1\r\nHost: origin.test\r\n\r\n"
            )
            .into_bytes(),
            // 14: a chunked body with the bound placeholder cut between two chunks and the other
            // host's in one, then the bound placeholder in a compressed body (left alone).
            {
                let (head, tail) = BOUND_PLACEHOLDER.split_at(20);
                let first = format!("token={head}");
                let second = format!("{tail}&other={OTHER_PLACEHOLDER}");
                let gzip = format!("x={BOUND_PLACEHOLDER}");
                format!(
                    "POST /form HTTP/1.1\r\nHost: origin.test\r\nTransfer-Encoding: chunked\r\n\r\n\
                     {:x}\r\n{first}\r\n{:x}\r\n{second}\r\n0\r\n\r\n\
                     POST /gz HTTP/1.1\r\nHost: origin.test\r\nContent-Encoding: gzip\r\n\
                     Content-Length: {}\r\n\r\n{gzip}",
                    first.len(),
                    second.len(),
                    gzip.len()
                )
                .into_bytes()
            },
        ]
    }

    fn upstream_targets(log: &Log) -> Vec<String> {
        log.received
            .iter()
            .map(|r| format!("{} {}", r.method, r.target))
            .collect()
    }

    #[test]
    fn the_seeds_hold_the_property_and_take_each_path() {
        let seeds = http_request_seeds();
        let logs: Vec<Log> = seeds
            .iter()
            .map(|s| run(s, false).expect("served"))
            .collect();
        let statuses = |log: &Log| -> Vec<String> {
            let text = String::from_utf8_lossy(&log.to_guest).into_owned();
            text.split("HTTP/1.")
                .skip(1)
                .map(|r| r.get(2..5).unwrap_or("").to_owned())
                .collect()
        };
        let targets: Vec<Vec<String>> = logs.iter().map(upstream_targets).collect();
        assert_eq!(targets[0], ["GET /v1/models?limit=1"]);
        assert_eq!(statuses(&logs[0]), ["200"]);
        assert_eq!(targets[1], ["GET /"]);
        assert_eq!(targets[2], ["GET /a", "HEAD /b", "DELETE /c"]);
        assert_eq!(statuses(&logs[2]), ["200", "200", "200"]);
        // The harness checks requests against what the middleware saw, after the first strip:
        // that the header the guest's Connection named went too is checked here.
        // (On plain HTTP the middleware adds no tag: the guest's request had only that header.)
        assert!(logs[2].seen[0].headers.is_empty(), "{:?}", logs[2].seen[0]);
        assert!(!logs[2].received[0].headers.contains_key("x-private"));
        assert_eq!(targets[3], ["POST /upload", "PUT /file"]);
        assert_eq!(
            logs[3].received[0].body.as_deref(),
            Some(&b"hello world"[..])
        );
        assert_eq!(logs[3].received[1].body.as_deref(), Some(&b"body"[..]));
        assert!(targets[4].is_empty());
        assert_eq!(statuses(&logs[4]), ["421", "421"]);
        assert_eq!(targets[5], ["GET /abs?q=1"]);
        assert_eq!(statuses(&logs[5]), ["200", "421"]);
        assert_eq!(targets[6], ["CONNECT origin.test:80"]);
        // On plain HTTP a bound secret's placeholder would be a value in clear: the POST that
        // holds one is refused, and goes nowhere.
        assert_eq!(targets[7], ["GET /"]);
        let bearer = |value: &str| format!("Bearer {value}");
        assert!(targets[8].is_empty());
        assert!(
            !logs[8].to_guest.is_empty(),
            "the 421 goes back in HTTP/2 frames"
        );
        assert!(targets[9].is_empty());
        assert_eq!(statuses(&logs[9]), ["400"]);
        assert!(targets[10].is_empty(), "{:?}", targets[10]);
        assert_eq!(statuses(&logs[10]), ["403"]);
        assert!(
            !targets[11].iter().any(|t| t.contains("smuggled")),
            "{:?}",
            targets[11]
        );
        assert_eq!(targets[12], ["OPTIONS *"]);
        assert_eq!(targets[13], ["GET /after"]);
        assert_eq!(statuses(&logs[13]), ["403", "200"]);
        assert_eq!(targets[14], ["POST /form", "POST /gz"]);
        let form = format!("token={BOUND_PLACEHOLDER}&other={OTHER_PLACEHOLDER}");
        assert_eq!(logs[14].received[0].body.as_deref(), Some(form.as_bytes()));
        // Not served as plain HTTP: nothing, and a TLS handshake.
        assert!(run(b"", false).is_none() && run(b"\x16\x03\x01", false).is_none());

        // Inside TLS (port 443): the same, but where a seed names port 80, and the swaps.
        let tls: Vec<Log> = seeds
            .iter()
            .map(|s| run(s, true).expect("served"))
            .collect();
        for i in [0, 2, 3, 5, 8, 9, 11, 12, 13, 14] {
            let swapped: Vec<String> = targets[i]
                .iter()
                .map(|t| t.replace(QUERY_PLACEHOLDER, QUERY_VALUE))
                .collect();
            assert_eq!(upstream_targets(&tls[i]), swapped, "seed {i}");
        }
        assert!(upstream_targets(&tls[1]).is_empty());
        assert_eq!(statuses(&tls[1]), ["421"]);
        assert!(upstream_targets(&tls[6]).is_empty());
        assert_eq!(upstream_targets(&tls[7]), ["GET /", "POST /v1/chat?x=1"]);
        assert_eq!(
            tls[7].received[1].headers["authorization"],
            bearer(BOUND_VALUE)
        );
        assert_eq!(
            upstream_targets(&tls[10]),
            [format!("GET /maps?key={QUERY_VALUE}&z=1")]
        );
        let swapped = &tls[10].received[0].headers;
        assert_eq!(swapped["authorization"], bearer(BOUND_VALUE));
        assert_eq!(
            swapped["x-copy"],
            format!("a{BOUND_VALUE}b{BOUND_VALUE}").as_str()
        );
        assert_eq!(swapped["x-maps-key"], QUERY_VALUE);
        assert_eq!(swapped["x-other-key"], OTHER_PLACEHOLDER);
        // Over TLS the bound placeholder is swapped in the body, cut between chunks as it was;
        // the other host's is not, nor is anything in a compressed body.
        let form = &tls[14].received[0];
        let swapped = format!("token={BOUND_VALUE}&other={OTHER_PLACEHOLDER}");
        assert_eq!(form.body.as_deref(), Some(swapped.as_bytes()));
        assert!(!form.headers.contains_key(header::CONTENT_LENGTH));
        let gzip = format!("x={BOUND_PLACEHOLDER}");
        assert_eq!(tls[14].received[1].body.as_deref(), Some(gzip.as_bytes()));
    }

    /// The fuzz property on a replayable sample: the seeds with bytes overwritten, cut short
    /// and repeated.
    #[test]
    fn the_http_fuzz_property_holds_on_mutated_seeds() {
        crate::fuzzing::mutate_seeds(&http_request_seeds(), 300, 0x2545_f491_4f6c_dd1d, fuzz_http);
    }

    /// The committed corpus, replayed on every test run.
    #[test]
    fn the_http_fuzz_corpus_holds_the_property() {
        crate::fuzzing::replay_corpus("http_request", fuzz_http);
    }

    /// The corpus holds the seeds as they are generated now (`seed-NN`). After changing them,
    /// write them with
    /// `KRUNBOX_WRITE_FUZZ_SEEDS=1 cargo test --lib committed_http_request_seeds`.
    #[test]
    fn committed_http_request_seeds_are_the_generated_ones() {
        crate::fuzzing::assert_committed_seeds("http_request", &http_request_seeds());
    }
}
