//! Interception served on the host alone: the guest's end is an in-memory pipe with hyper's
//! HTTP/1.1 client on it, and the origin a hyper server on in-memory pipes (or on loopback)
//! that records what reaches it. Over "TLS" the guest's bytes are what would be inside its TLS
//! connection (the host's TLS termination is not run), and the upstream side is real TLS to an
//! origin with a certificate from the sandbox CA.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use ::http::Request;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use tokio::io::DuplexStream;
use tokio::sync::mpsc;

use super::*;
use crate::net::Secret;

pub(super) const HOSTNAME: &str = "origin.test";

/// A request as the origin got it.
#[derive(Debug, Clone)]
pub(super) struct Received {
    pub method: Method,
    pub target: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// What the origin saw, and how many requests it had at once.
#[derive(Debug, Default)]
pub(super) struct OriginLog {
    pub received: Mutex<Vec<Received>>,
    pub in_flight: AtomicUsize,
    pub most_in_flight: AtomicUsize,
}

/// How long the origin holds each request before answering.
pub(super) type Hold = std::time::Duration;

/// Serves one upstream connection: records each request, holds it for `hold`, answers 200
/// with `origin says <target>`.
pub(super) async fn origin_connection<S>(stream: S, log: Arc<OriginLog>, hold: Hold)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let log = log.clone();
        async move {
            let now = log.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            log.most_in_flight.fetch_max(now, Ordering::SeqCst);
            let (parts, body) = request.into_parts();
            let body = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let target = parts.uri.to_string();
            log.received.lock().unwrap().push(Received {
                method: parts.method,
                target: target.clone(),
                headers: parts.headers,
                body,
            });
            tokio::time::sleep(hold).await;
            log.in_flight.fetch_sub(1, Ordering::SeqCst);
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(format!(
                "origin says {target}"
            )))))
        }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

/// The sandbox CA, the origin's TLS configuration (a certificate for [`HOSTNAME`] from it)
/// and the upstream client's (trusting it).
pub(super) struct Tls {
    pub authority: Arc<CertificateAuthority>,
    pub origin: Arc<rustls::ServerConfig>,
    pub client: Arc<rustls::ClientConfig>,
}

pub(super) fn tls() -> Tls {
    let authority = CertificateAuthority::generate("tests").unwrap();
    let client = UpstreamTrust::pem(authority.certificate_pem().as_bytes())
        .unwrap()
        .client_config()
        .unwrap();
    let key = authority.certified_key(HOSTNAME).unwrap();
    let origin = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_cert_resolver(Arc::new(OneCertificate(key)));
    Tls {
        authority: Arc::new(authority),
        origin: Arc::new(origin),
        client,
    }
}

/// The origin behind in-memory upstream connections (over TLS if `tls`).
async fn memory_origin(
    mut connections: mpsc::UnboundedReceiver<DuplexStream>,
    tls: Option<Arc<rustls::ServerConfig>>,
    log: Arc<OriginLog>,
) {
    while let Some(stream) = connections.recv().await {
        let (log, tls) = (log.clone(), tls.clone());
        tokio::spawn(async move {
            match tls {
                None => origin_connection(stream, log, Hold::ZERO).await,
                Some(config) => {
                    let acceptor = tokio_rustls::TlsAcceptor::from(config);
                    if let Ok(stream) = acceptor.accept(stream).await {
                        origin_connection(stream, log, Hold::ZERO).await;
                    }
                }
            }
        });
    }
}

/// One intercepted connection for [`HOSTNAME`] on port 443 (the guest spoke TLS) or 80.
pub(super) struct Harness {
    pub guest: SendRequest<Full<Bytes>>,
    pub origin: Arc<OriginLog>,
    pub stop: CancellationToken,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The job for one intercepted connection to [`HOSTNAME`].
pub(super) fn job(
    tls: &Tls,
    port: u16,
    intercept: Intercept,
    secrets: Vec<Secret>,
) -> InterceptJob {
    InterceptJob {
        hostname: HOSTNAME.into(),
        port,
        upstream: Vec::new(),
        intercept,
        secrets: secrets.into(),
        authority: tls.authority.clone(),
        client_tls: tls.client.clone(),
        audit: Audit::new(),
        upstream_permits: Arc::new(tokio::sync::Semaphore::new(
            crate::net::stack::MAX_UPSTREAM_REQUESTS,
        )),
        stop: CancellationToken::new(),
        budget: crate::budget::Budget::new(&crate::Limits::new()),
    }
}

/// Serves `job` on an in-memory connection whose guest end is hyper's HTTP/1.1 client, the
/// upstream an in-memory origin (over TLS when `job.port` is 443).
pub(super) async fn serve_in_memory(tls: &Tls, job: InterceptJob) -> Harness {
    let over_tls = job.port == 443;
    let origin = Arc::new(OriginLog::default());
    let (to_origin, connections) = mpsc::unbounded_channel();
    tokio::spawn(memory_origin(
        connections,
        over_tls.then(|| tls.origin.clone()),
        origin.clone(),
    ));
    let dialer = upstream::Dialer::Memory {
        buffer: 64 * 1024,
        to: to_origin,
    };
    let stop = job.stop.clone();
    let (guest, ours) = tokio::io::duplex(64 * 1024);
    tokio::spawn(serve_http(ours, over_tls, dialer, job));
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(guest))
        .await
        .unwrap();
    tokio::spawn(connection);
    Harness {
        guest: sender,
        origin,
        stop,
    }
}

/// A request for [`HOSTNAME`].
pub(super) fn request(method: Method, path: &str, body: &[u8]) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, HOSTNAME)
        .body(Full::new(Bytes::copy_from_slice(body)))
        .unwrap()
}

/// Sends `request` on the harness's connection: the status, the `Connection` header and the
/// body the guest got.
pub(super) async fn send(
    harness: &mut Harness,
    request: Request<Full<Bytes>>,
) -> (StatusCode, Option<HeaderValue>, String) {
    harness.guest.ready().await.unwrap();
    let response = harness.guest.send_request(request).await.unwrap();
    let status = response.status();
    let connection = response.headers().get(header::CONNECTION).cloned();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        connection,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

fn refuse_posts() -> Intercept {
    Intercept::new().answer_with(|request: &RequestHead| {
        (request.method() == Method::POST).then(|| Answer::forbidden("krunbox: no posting\n"))
    })
}

#[tokio::test]
async fn middleware_answers_a_request_itself_and_the_connection_goes_on() {
    let tls = tls();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let after = seen.clone();
    // Middleware after the one that answers does not run for the answered request.
    let intercept = refuse_posts().middleware(move |request: &mut RequestHead| {
        after.lock().unwrap().push(request.method().clone());
    });
    let mut harness = serve_in_memory(&tls, job(&tls, 443, intercept, Vec::new())).await;
    let (status, connection, body) = send(&mut harness, request(Method::POST, "/a", b"x=1")).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(body, "krunbox: no posting\n");
    assert_eq!(connection, None, "the connection stays open");
    let (status, _, body) = send(&mut harness, request(Method::GET, "/b", b"")).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "origin says /b"));
    let received = harness.origin.received.lock().unwrap().clone();
    assert_eq!(received.len(), 1, "{received:?}");
    assert_eq!(received[0].method, Method::GET);
    assert_eq!(received[0].target, "/b");
    assert_eq!(received[0].headers[header::HOST], HOSTNAME);
    assert!(received[0].body.is_empty());
    assert_eq!(*seen.lock().unwrap(), [Method::GET]);
}

#[tokio::test]
async fn an_informational_answer_is_sent_as_a_server_error() {
    let tls = tls();
    let intercept = Intercept::new()
        .answer_with(|_: &RequestHead| Some(Answer::new(StatusCode::SWITCHING_PROTOCOLS, "")));
    let mut harness = serve_in_memory(&tls, job(&tls, 80, intercept, Vec::new())).await;
    let (status, _, body) = send(&mut harness, request(Method::GET, "/", b"")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(body.contains("not a final status"), "{body}");
    let (status, _, _) = send(&mut harness, request(Method::GET, "/", b"")).await;
    assert_eq!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "the connection goes on"
    );
    assert!(harness.origin.received.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_large_unsent_body_closes_the_connection_after_the_answer() {
    let tls = tls();
    let mut harness = serve_in_memory(&tls, job(&tls, 80, refuse_posts(), Vec::new())).await;
    let big = vec![b'x'; UNSENT_BODY_MAX + 1];
    let (status, connection, _) = send(&mut harness, request(Method::POST, "/", &big)).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(
        connection.as_ref().map(|v| v.as_bytes()),
        Some(&b"close"[..])
    );
    assert!(harness.origin.received.lock().unwrap().is_empty());
}

#[tokio::test]
async fn method_rules_refuse_requests_with_403_naming_the_rule() {
    use crate::net::{Flow, Protocol, Rule, Rules};
    let rules = Rules::new()
        .rule(Rule::deny_domain(HOSTNAME).unwrap().methods(["POST"]))
        .unwrap()
        .rule(
            Rule::allow_domain(HOSTNAME)
                .unwrap()
                .ports(443)
                .methods(["GET", "HEAD"]),
        )
        .unwrap();
    let flow = Flow {
        protocol: Protocol::Tcp,
        source: "10.0.2.15:40000".parse().unwrap(),
        destination: "198.18.0.1:443".parse().unwrap(),
        hostname: Some(HOSTNAME.into()),
        upstream: vec!["93.184.215.14".parse().unwrap()],
    };
    let intercept = rules
        .verdict(&flow)
        .interception()
        .expect("methods decide: intercepted")
        .clone();
    let tls = tls();
    let mut harness = serve_in_memory(&tls, job(&tls, 443, intercept, Vec::new())).await;
    let (status, _, body) = send(&mut harness, request(Method::GET, "/get", b"")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "origin says /get")
    );
    let (status, _, body) = send(&mut harness, request(Method::POST, "/post", b"a=1")).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(
        body,
        "krunbox: POST to origin.test:443 refused by network rule 0 \
         (deny domain origin.test methods POST)\n"
    );
    // Methods are compared without case: `post` is no way around a rule for POST.
    let lower = Method::from_bytes(b"post").unwrap();
    let (status, _, _) = send(&mut harness, request(lower, "/post", b"")).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _, body) = send(&mut harness, request(Method::DELETE, "/x", b"")).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(body.contains("no network rule allows it"), "{body}");
    let (status, _, _) = send(&mut harness, request(Method::HEAD, "/head", b"")).await;
    assert_eq!(status, StatusCode::OK, "the connection is still usable");
    let received: Vec<String> = harness
        .origin
        .received
        .lock()
        .unwrap()
        .iter()
        .map(|r| format!("{} {}", r.method, r.target))
        .collect();
    assert_eq!(received, ["GET /get", "HEAD /head"]);
}

/// The `Request` events sent so far.
fn request_events(
    events: &mut tokio::sync::broadcast::Receiver<crate::net::NetworkEvent>,
) -> Vec<crate::net::NetworkEvent> {
    let mut got = Vec::new();
    while let Ok(event) = events.try_recv() {
        if matches!(event, crate::net::NetworkEvent::Request { .. }) {
            got.push(event);
        }
    }
    got
}

#[tokio::test]
async fn each_intercepted_request_is_an_audit_event_without_its_query() {
    use crate::net::{NetworkEvent, RequestOutcome};
    let tls = tls();
    let bound = Secret::new("BOUND_KEY", "real-bound")
        .unwrap()
        .bind_to(HOSTNAME);
    let other = Secret::new("OTHER_KEY", "real-other")
        .unwrap()
        .bind_to("other.test");
    let job = job(
        &tls,
        443,
        refuse_posts(),
        vec![bound.clone(), other.clone()],
    );
    let mut events = job.audit.subscribe();
    let mut harness = serve_in_memory(&tls, job).await;
    let mut get = request(Method::GET, "/v1/items?key=hidden", b"");
    get.headers_mut().insert(
        "x-keys",
        format!("{} {}", bound.placeholder(), other.placeholder())
            .parse()
            .unwrap(),
    );
    let (status, _, _) = send(&mut harness, get).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = send(&mut harness, request(Method::POST, "/p?q=1", b"")).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let mut misdirected = request(Method::GET, "/elsewhere", b"");
    misdirected
        .headers_mut()
        .insert(header::HOST, "other.test".parse().unwrap());
    let (status, _, _) = send(&mut harness, misdirected).await;
    assert_eq!(status, StatusCode::MISDIRECTED_REQUEST);
    let received = harness.origin.received.lock().unwrap().clone();
    assert_eq!(
        received[0].headers["x-keys"],
        format!("real-bound {}", other.placeholder()).as_str()
    );
    let events = request_events(&mut events);
    assert_eq!(events.len(), 3, "{events:#?}");
    let NetworkEvent::Request {
        hostname,
        port,
        method,
        path,
        status,
        outcome,
        secrets_swapped,
        placeholders_left,
        ..
    } = &events[0]
    else {
        unreachable!()
    };
    assert_eq!((hostname.as_str(), *port), (HOSTNAME, 443));
    assert_eq!((method, path.as_str()), (&Method::GET, "/v1/items"));
    assert_eq!(*status, Some(StatusCode::OK));
    assert_eq!(*outcome, RequestOutcome::Forwarded);
    assert_eq!(*secrets_swapped, ["BOUND_KEY"]);
    assert_eq!(*placeholders_left, ["OTHER_KEY"]);
    let NetworkEvent::Request {
        path,
        status,
        outcome,
        secrets_swapped,
        ..
    } = &events[1]
    else {
        unreachable!()
    };
    assert_eq!(path, "/p");
    assert_eq!(*status, Some(StatusCode::FORBIDDEN));
    assert_eq!(
        *outcome,
        RequestOutcome::Answered {
            reason: "krunbox: no posting".into()
        }
    );
    assert!(secrets_swapped.is_empty());
    let NetworkEvent::Request {
        status, outcome, ..
    } = &events[2]
    else {
        unreachable!()
    };
    assert_eq!(*status, Some(StatusCode::MISDIRECTED_REQUEST));
    assert_eq!(
        *outcome,
        RequestOutcome::Misdirected {
            authority: "other.test".into()
        }
    );
    // Nothing in any event holds a query string or a value.
    let text = format!("{events:?}");
    assert!(
        !text.contains("hidden") && !text.contains("real-"),
        "{text}"
    );
}

/// Waits (a little) for `n` request events: the last holder of a record may be the body,
/// dropped by the upstream connection's task after the guest has its answer.
async fn wait_for_request_events(
    events: &mut tokio::sync::broadcast::Receiver<crate::net::NetworkEvent>,
    n: usize,
) -> Vec<crate::net::NetworkEvent> {
    let mut got = Vec::new();
    for _ in 0..200 {
        got.extend(request_events(events));
        if got.len() >= n {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    got
}

#[tokio::test]
async fn secrets_opted_in_to_bodies_are_swapped_in_bodies_to_bound_hosts_over_tls() {
    use crate::net::NetworkEvent;
    let tls = tls();
    let bound = Secret::new("CLIENT_SECRET", "the-real-client-secret")
        .unwrap()
        .bind_to(HOSTNAME)
        .in_body();
    let other = Secret::new("OTHER", "the-real-other")
        .unwrap()
        .bind_to("other.test")
        .in_body();
    let headers_only = Secret::new("HEADERS_ONLY", "the-real-header-secret")
        .unwrap()
        .bind_to(HOSTNAME);
    let secrets = vec![bound.clone(), other.clone(), headers_only.clone()];
    let body = format!(
        "client_secret={}&other={}&h={}",
        bound.placeholder(),
        other.placeholder(),
        headers_only.placeholder()
    );
    // Over TLS: swapped, and sent chunked (the length changed).
    let job = job(&tls, 443, Intercept::new(), secrets.clone());
    let mut events = job.audit.subscribe();
    let mut harness = serve_in_memory(&tls, job).await;
    let (status, _, _) = send(
        &mut harness,
        request(Method::POST, "/token", body.as_bytes()),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let mut compressed = request(Method::POST, "/gz", body.as_bytes());
    compressed
        .headers_mut()
        .insert(header::CONTENT_ENCODING, "gzip".parse().unwrap());
    let (status, _, _) = send(&mut harness, compressed).await;
    assert_eq!(status, StatusCode::OK);
    let received = harness.origin.received.lock().unwrap().clone();
    assert_eq!(
        received[0].body,
        format!(
            "client_secret=the-real-client-secret&other={}&h={}",
            other.placeholder(),
            headers_only.placeholder()
        )
        .as_bytes()
    );
    assert!(!received[0].headers.contains_key(header::CONTENT_LENGTH));
    assert_eq!(received[0].headers[header::TRANSFER_ENCODING], "chunked");
    assert_eq!(
        received[1].body,
        body.as_bytes(),
        "a compressed body is left alone"
    );
    assert_eq!(
        received[1].headers[header::CONTENT_LENGTH],
        body.len().to_string().as_str()
    );
    let events = wait_for_request_events(&mut events, 2).await;
    let NetworkEvent::Request {
        secrets_swapped,
        placeholders_left,
        ..
    } = &events[0]
    else {
        unreachable!()
    };
    assert_eq!(*secrets_swapped, ["CLIENT_SECRET"]);
    assert_eq!(*placeholders_left, ["OTHER"]);
    drop(harness);

    // Plain HTTP: nothing swapped, the length kept, the placeholder reported.
    let job = job_for(&tls, 80, secrets);
    let mut events = job.audit.subscribe();
    let mut harness = serve_in_memory(&tls, job).await;
    let (status, _, _) = send(
        &mut harness,
        request(Method::POST, "/token", body.as_bytes()),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let received = harness.origin.received.lock().unwrap().clone();
    assert_eq!(received[0].body, body.as_bytes());
    assert_eq!(
        received[0].headers[header::CONTENT_LENGTH],
        body.len().to_string().as_str()
    );
    let events = wait_for_request_events(&mut events, 1).await;
    let NetworkEvent::Request {
        secrets_swapped,
        placeholders_left,
        ..
    } = &events[0]
    else {
        unreachable!()
    };
    assert!(secrets_swapped.is_empty());
    assert_eq!(*placeholders_left, ["CLIENT_SECRET", "OTHER"]);
}

fn job_for(tls: &Tls, port: u16, secrets: Vec<Secret>) -> InterceptJob {
    job(tls, port, Intercept::new(), secrets)
}

/// An HTTP origin on 127.0.0.1 that holds each request for `hold`.
async fn loopback_origin(hold: Hold) -> (SocketAddr, Arc<OriginLog>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let log = Arc::new(OriginLog::default());
    let kept = log.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(origin_connection(stream, kept.clone(), hold));
        }
    });
    (address, log)
}

/// Serves `job` (plain HTTP, upstream the loopback origin at `job.upstream`) on an in-memory
/// connection whose guest end speaks HTTP/2, and sends `requests` GETs on it at once: their
/// statuses.
async fn h2_requests(job: InterceptJob, requests: usize) -> Vec<StatusCode> {
    let dialer = upstream::Dialer::addresses(&job.upstream, job.budget.clone());
    let (guest, ours) = tokio::io::duplex(64 * 1024);
    tokio::spawn(serve_http(ours, false, dialer, job));
    let (sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(guest),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..requests {
        let mut sender = sender.clone();
        tasks.spawn(async move {
            let request = Request::builder()
                .uri(format!("http://{HOSTNAME}/{i}"))
                .body(Full::new(Bytes::new()))
                .unwrap();
            sender.ready().await.unwrap();
            let response = sender.send_request(request).await.unwrap();
            let status = response.status();
            response.into_body().collect().await.unwrap();
            status
        });
    }
    tasks.join_all().await
}

fn loopback_job(
    tls: &Tls,
    upstream: SocketAddr,
    permits: Arc<tokio::sync::Semaphore>,
) -> InterceptJob {
    InterceptJob {
        port: 80,
        upstream: vec![upstream],
        upstream_permits: permits,
        ..job(tls, 80, Intercept::new(), Vec::new())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_has_at_most_its_streams_in_flight() {
    use crate::net::stack::INTERCEPT_MAX_STREAMS;
    let (address, origin) = loopback_origin(Hold::from_millis(100)).await;
    let tls = tls();
    // Permits enough for all: only the connection's stream limit holds requests back.
    let permits = Arc::new(tokio::sync::Semaphore::new(1000));
    let statuses = h2_requests(loopback_job(&tls, address, permits), 100).await;
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    assert_eq!(origin.received.lock().unwrap().len(), 100);
    let most = origin.most_in_flight.load(Ordering::SeqCst);
    assert!(most <= INTERCEPT_MAX_STREAMS as usize, "{most} at once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_has_at_most_its_upstream_requests_in_flight() {
    use crate::net::stack::MAX_UPSTREAM_REQUESTS;
    let (address, origin) = loopback_origin(Hold::from_millis(100)).await;
    let tls = tls();
    // One sandbox: two intercepted connections sharing its permits, 60 requests at once on
    // each (within each connection's own stream limit).
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_UPSTREAM_REQUESTS));
    let (a, b) = tokio::join!(
        h2_requests(loopback_job(&tls, address, permits.clone()), 60),
        h2_requests(loopback_job(&tls, address, permits.clone()), 60),
    );
    assert!(
        a.iter().chain(&b).all(|s| *s == StatusCode::OK),
        "{a:?} {b:?}"
    );
    assert_eq!(origin.received.lock().unwrap().len(), 120);
    let most = origin.most_in_flight.load(Ordering::SeqCst);
    assert!(most <= MAX_UPSTREAM_REQUESTS, "{most} at once");
    assert!(
        most > MAX_UPSTREAM_REQUESTS / 2,
        "the bound was reached: {most} at once"
    );
    assert_eq!(
        permits.available_permits(),
        MAX_UPSTREAM_REQUESTS,
        "all given back"
    );
}

#[tokio::test]
async fn a_request_head_past_the_bound_is_refused() {
    use crate::net::stack::INTERCEPT_MAX_HEADERS;
    let tls = tls();
    let mut harness = serve_in_memory(&tls, job(&tls, 80, Intercept::new(), Vec::new())).await;
    let mut big = request(Method::GET, "/", b"");
    big.headers_mut()
        .insert("x-big", "a".repeat(INTERCEPT_MAX_HEADERS).parse().unwrap());
    harness.guest.ready().await.unwrap();
    let refused = harness.guest.send_request(big).await;
    assert!(
        refused.as_ref().map_or(true, |r| r.status()
            == StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE),
        "{refused:?}"
    );
    assert!(harness.origin.received.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_get_with_a_body_of_unknown_length_keeps_its_body() {
    let tls = tls();
    let secret = Secret::new("KEY", "real")
        .unwrap()
        .bind_to(HOSTNAME)
        .in_body();
    let body = format!("key={}", secret.placeholder());
    let mut harness = serve_in_memory(&tls, job(&tls, 443, Intercept::new(), vec![secret])).await;
    let (status, _, _) = send(&mut harness, request(Method::GET, "/", body.as_bytes())).await;
    assert_eq!(status, StatusCode::OK);
    let received = harness.origin.received.lock().unwrap().clone();
    assert_eq!(received[0].body, "key=real");
    assert_eq!(received[0].headers[header::TRANSFER_ENCODING], "chunked");
}

/// The finding of issue 33: middleware (as `--inject-header` adds) ran on plain HTTP too, and
/// the request went upstream in clear with the credential. Now a plain request that would carry
/// a credential (a header middleware added or changed, a bound secret's value) goes nowhere and
/// is answered 403; one that would carry none goes on, and middleware can tell the two apart.
#[tokio::test]
async fn a_plain_request_that_would_carry_a_credential_is_refused_and_goes_nowhere() {
    use crate::net::{NetworkEvent, RequestOutcome};
    let tls = tls();
    let bound = Secret::new("BOUND_KEY", "real-bound")
        .unwrap()
        .bind_to(HOSTNAME);
    let schemes = Arc::new(Mutex::new(Vec::new()));
    let seen = schemes.clone();
    let intercept = Intercept::new().middleware(move |request: &mut RequestHead| {
        seen.lock().unwrap().push(request.scheme().clone());
        if request.path().starts_with("/inject") {
            request
                .headers_mut()
                .insert("authorization", "Bearer real-token".parse().unwrap());
        }
        // Removing is no credential.
        request.headers_mut().remove("cookie");
    });
    let job = job(&tls, 80, intercept, vec![bound.clone()]);
    let mut events = job.audit.subscribe();
    let mut harness = serve_in_memory(&tls, job).await;

    let (status, connection, body) = send(&mut harness, request(Method::GET, "/inject", b"")).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert!(body.contains("only over HTTPS"), "{body}");
    assert_eq!(connection, None, "the connection goes on");
    // A changed value counts as much as a new header: the guest's own is replaced.
    let mut replaced = request(Method::POST, "/inject/x", b"a body");
    replaced
        .headers_mut()
        .insert(header::AUTHORIZATION, "Bearer guest".parse().unwrap());
    let (status, _, _) = send(&mut harness, replaced).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    // A bound secret's placeholder would become its value over TLS: refused here.
    let mut placeholder = request(Method::GET, "/key", b"");
    placeholder
        .headers_mut()
        .insert("x-key", bound.placeholder().parse().unwrap());
    let (status, _, _) = send(&mut harness, placeholder).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    // Nothing to add: through, in clear, with the guest's own header and without the cookie.
    let mut plain = request(Method::GET, "/public", b"");
    plain
        .headers_mut()
        .insert(header::AUTHORIZATION, "Bearer guest".parse().unwrap());
    plain
        .headers_mut()
        .insert(header::COOKIE, "a=1".parse().unwrap());
    let (status, _, body) = send(&mut harness, plain).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "origin says /public")
    );

    let received = harness.origin.received.lock().unwrap().clone();
    assert_eq!(
        received.len(),
        1,
        "only the request with nothing to add: {received:?}"
    );
    assert_eq!(received[0].headers[header::AUTHORIZATION], "Bearer guest");
    assert!(!received[0].headers.contains_key(header::COOKIE));
    assert!(schemes.lock().unwrap().iter().all(|s| *s == Scheme::HTTP));

    let events = wait_for_request_events(&mut events, 4).await;
    let outcomes: Vec<_> = events
        .iter()
        .map(|e| match e {
            NetworkEvent::Request {
                status, outcome, ..
            } => (*status, outcome.clone()),
            _ => unreachable!(),
        })
        .collect();
    let cleartext = |names: &[&str]| RequestOutcome::Cleartext {
        credentials: names.iter().map(|n| (*n).to_owned()).collect(),
    };
    assert_eq!(
        outcomes,
        [
            (Some(StatusCode::FORBIDDEN), cleartext(&["authorization"])),
            (Some(StatusCode::FORBIDDEN), cleartext(&["authorization"])),
            (Some(StatusCode::FORBIDDEN), cleartext(&["BOUND_KEY"])),
            (Some(StatusCode::OK), RequestOutcome::Forwarded),
        ]
    );
    let text = format!("{events:?}");
    assert!(!text.contains("real-"), "no value in the audit: {text}");
}

/// Over TLS the same middleware's header goes upstream, and the scheme it saw says so.
#[tokio::test]
async fn middleware_sees_https_and_its_credential_goes_upstream_over_tls() {
    let tls = tls();
    let schemes = Arc::new(Mutex::new(Vec::new()));
    let seen = schemes.clone();
    let intercept = Intercept::new().middleware(move |request: &mut RequestHead| {
        seen.lock().unwrap().push(request.scheme().clone());
        request
            .headers_mut()
            .insert("authorization", "Bearer real-token".parse().unwrap());
    });
    let mut harness = serve_in_memory(&tls, job(&tls, 443, intercept, Vec::new())).await;
    let (status, _, _) = send(&mut harness, request(Method::GET, "/inject", b"")).await;
    assert_eq!(status, StatusCode::OK);
    let received = harness.origin.received.lock().unwrap().clone();
    assert_eq!(
        received[0].headers[header::AUTHORIZATION],
        "Bearer real-token"
    );
    assert_eq!(*schemes.lock().unwrap(), [Scheme::HTTPS]);
}

/// Middleware is the caller's code: a panic in it answers its request `500` and the connection
/// carries the next request (on 88bb6c9 it ended the connection's task, whose slot leaked).
#[tokio::test]
async fn a_panicking_middleware_fails_only_its_request() {
    use crate::net::{NetworkEvent, RequestOutcome};
    let tls = tls();
    let intercept = Intercept::new().middleware(|request: &mut RequestHead| {
        if request.path() == "/boom" {
            panic!("middleware bug");
        }
    });
    let job = job(&tls, 443, intercept, Vec::new());
    let mut events = job.audit.subscribe();
    let mut harness = serve_in_memory(&tls, job).await;
    let (status, connection, body) = send(&mut harness, request(Method::GET, "/boom", b"")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert_eq!(connection, None, "the connection goes on");
    let (status, _, body) = send(&mut harness, request(Method::GET, "/fine", b"")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "origin says /fine")
    );
    let received = harness.origin.received.lock().unwrap().clone();
    assert_eq!(received.len(), 1, "{received:?}");
    let events = wait_for_request_events(&mut events, 2).await;
    let NetworkEvent::Request { outcome, .. } = &events[0] else {
        unreachable!()
    };
    assert_eq!(
        *outcome,
        RequestOutcome::MiddlewarePanicked {
            message: "middleware bug".into()
        }
    );
}

/// Issue 33: a bound host that echoes what it got handed the secret's value back to the guest.
/// Now the values of the secrets bound to the host go back as their placeholders, in the
/// headers and the streamed body, requests to it ask for no compression, and the audit names
/// the secret reflected.
#[tokio::test]
async fn a_bound_hosts_echo_of_a_secret_reaches_the_guest_as_its_placeholder() {
    use crate::net::NetworkEvent;
    let tls = tls();
    let secret = Secret::new("MAPS_KEY", "real-maps-key-value")
        .unwrap()
        .bind_to(HOSTNAME)
        .in_query_string();
    let job = job(&tls, 443, Intercept::new(), vec![secret.clone()]);
    let mut events = job.audit.subscribe();
    let mut harness = serve_in_memory(&tls, job).await;
    let path = format!("/geo?key={}", secret.placeholder());
    let mut get = request(Method::GET, &path, b"");
    get.headers_mut()
        .insert(header::ACCEPT_ENCODING, "gzip".parse().unwrap());
    // The origin answers `origin says <target>`: the target it got holds the value.
    let (status, _, body) = send(&mut harness, get).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, format!("origin says {path}"));
    let received = harness.origin.received.lock().unwrap().clone();
    assert_eq!(received[0].target, "/geo?key=real-maps-key-value");
    assert_eq!(received[0].headers[header::ACCEPT_ENCODING], "identity");
    let events = wait_for_request_events(&mut events, 1).await;
    let NetworkEvent::Request {
        secrets_swapped,
        secrets_reflected,
        ..
    } = &events[0]
    else {
        unreachable!()
    };
    assert_eq!(*secrets_swapped, ["MAPS_KEY"]);
    assert_eq!(*secrets_reflected, ["MAPS_KEY"]);
}

#[test]
fn values_in_response_headers_go_back_as_placeholders() {
    let secret = Secret::new("TOKEN", "real-token-1234")
        .unwrap()
        .bind_to(HOSTNAME);
    let short = Secret::new("PIN", "1234").unwrap().bind_to(HOSTNAME);
    let other = Secret::new("OTHER", "real-other-9999")
        .unwrap()
        .bind_to("other.test");
    let mut headers = HeaderMap::new();
    headers.insert(
        header::LOCATION,
        "https://x/?t=real-token-1234&o=real-other-9999"
            .parse()
            .unwrap(),
    );
    headers.insert("x-pin", "1234".parse().unwrap());
    let found = super::super::secrets::unswap_headers(
        &[secret.clone(), short, other],
        HOSTNAME,
        &mut headers,
    );
    assert_eq!(found, ["TOKEN"]);
    assert_eq!(
        headers[header::LOCATION],
        format!("https://x/?t={}&o=real-other-9999", secret.placeholder()).as_str(),
        "only the values of secrets bound to the host"
    );
    assert_eq!(
        headers["x-pin"], "1234",
        "a value this short is not looked for"
    );
}

/// Middleware is async (issue 35, the design's `accept(async (request) => ...)`): it waits for
/// something of the program's (here a token handed over a channel after the request arrived)
/// and the request goes upstream only then, with what it set.
#[tokio::test]
async fn async_middleware_waits_before_the_request_goes_upstream() {
    let tls = tls();
    let (tokens, waiting) = tokio::sync::mpsc::unbounded_channel::<String>();
    let waiting = Arc::new(tokio::sync::Mutex::new(waiting));
    let asked = Arc::new(tokio::sync::Notify::new());
    let told = asked.clone();
    let intercept = Intercept::new().middleware_async(move |request: &mut RequestHead| {
        let (waiting, told) = (waiting.clone(), told.clone());
        Box::pin(async move {
            told.notify_one();
            let token = waiting.lock().await.recv().await.expect("a token");
            let value = format!("Bearer {token}").parse().unwrap();
            request.headers_mut().insert("authorization", value);
            None
        })
    });
    let mut harness = serve_in_memory(&tls, job(&tls, 443, intercept, Vec::new())).await;
    let sent = tokio::spawn(async move {
        let answer = send(&mut harness, request(Method::GET, "/user", b"")).await;
        (answer, harness)
    });
    asked.notified().await;
    tokens.send("ghs_short_lived".into()).unwrap();
    let ((status, _, body), harness) = sent.await.unwrap();
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "origin says /user")
    );
    let received = harness.origin.received.lock().unwrap().clone();
    assert_eq!(received.len(), 1);
    assert_eq!(
        received[0].headers["authorization"],
        "Bearer ghs_short_lived"
    );
}

/// A middleware that never finishes costs its request only: past the deadline the chain ends
/// (`TimedOut`, answered 504 by the caller), and later middleware never ran.
#[tokio::test]
async fn middleware_past_its_deadline_fails_its_request() {
    let later = Arc::new(AtomicUsize::new(0));
    let counted = later.clone();
    let intercept = Intercept::new()
        .middleware_async(|_: &mut RequestHead| Box::pin(std::future::pending()))
        .middleware(move |_: &mut RequestHead| {
            counted.fetch_add(1, Ordering::SeqCst);
        });
    let mut head = RequestHead {
        hostname: HOSTNAME.into(),
        scheme: Scheme::HTTPS,
        method: Method::GET,
        path_and_query: "/".into(),
        headers: HeaderMap::new(),
    };
    let ran = run_middleware(&intercept, &mut head, std::time::Duration::from_millis(50)).await;
    assert!(matches!(ran, Err(MiddlewareFailure::TimedOut)));
    assert_eq!(later.load(Ordering::SeqCst), 0);
    // A panic inside the async part is caught as one.
    let panicking = Intercept::new()
        .middleware_async(|_: &mut RequestHead| Box::pin(async { panic!("async bug") }));
    let ran = run_middleware(&panicking, &mut head, MIDDLEWARE_DEADLINE).await;
    assert!(matches!(ran, Err(MiddlewareFailure::Panicked(p)) if p.0 == "async bug"));
}
