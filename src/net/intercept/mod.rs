//! HTTP(S) interception: a granted connection the host answers itself, as the origin would,
//! so middleware can change each request (add a credential the guest never sees) before the
//! host sends it on upstream.
//!
//! The guest's connection is TLS if its first byte is a TLS handshake record, plain HTTP
//! otherwise. TLS is terminated with a certificate for the flow's *trusted* hostname, issued
//! by the sandbox's own CA ([`ca`]); the guest's server name (SNI) chooses nothing. Each
//! request's authority (`Host`, or HTTP/2's `:authority`) must be that hostname and port, or it
//! is answered `421 Misdirected Request` and never leaves the host. Requests go upstream to the
//! addresses the hostname's accepted DNS answer gave, over verified TLS when the guest spoke
//! TLS ([`upstream`]), after the middleware and the secrets' swap (`secrets.rs`). Bytes that
//! are not HTTP end the connection: nothing is forwarded.

mod body;
pub(crate) mod ca;
#[cfg(any(test, feature = "fuzzing"))]
mod fuzz;
#[cfg(test)]
mod tests;
mod upstream;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use ::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use ::http::uri::Scheme;
use ::http::{Method, Request, Response, StatusCode, Uri};
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;

use super::audit::{Audit, RequestOutcome, RequestRecord};
use super::relay::GuestStream;
use super::stack::{INTERCEPT_MAX_HEADERS, INTERCEPT_MAX_STREAMS};
use ca::CertificateAuthority;
pub use upstream::UpstreamTrust;

/// How a granted connection is intercepted: the middleware each request goes through, in
/// order. Given to [`Verdict::intercept`](crate::net::Verdict::intercept).
///
/// ```
/// use krunbox::net::{HeaderName, HeaderValue, Intercept};
///
/// let intercept = Intercept::new()
///     .set_header(
///         HeaderName::from_static("authorization"),
///         HeaderValue::from_static("Bearer sk-real-token"),
///     )
///     .remove_header(HeaderName::from_static("x-debug"));
/// ```
#[derive(Clone, Default)]
pub struct Intercept {
    middleware: Vec<Arc<dyn Middleware>>,
}

impl std::fmt::Debug for Intercept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Intercept")
            .field("middleware", &self.middleware.len())
            .finish()
    }
}

/// Interceptions are equal when they run the same middleware objects, in the same order.
impl PartialEq for Intercept {
    fn eq(&self, other: &Self) -> bool {
        self.middleware.len() == other.middleware.len()
            && self
                .middleware
                .iter()
                .zip(&other.middleware)
                .all(|(a, b)| std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b)))
    }
}

impl Eq for Intercept {}

impl Intercept {
    /// No middleware: requests go upstream as the guest sent them (still checked against the
    /// trusted hostname, still over verified TLS).
    ///
    /// ```
    /// let intercept = krunbox::net::Intercept::new();
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `middleware`, run after those added before it.
    ///
    /// ```
    /// use krunbox::net::{Intercept, RequestHead};
    /// let intercept = Intercept::new().middleware(|request: &mut RequestHead| {
    ///     if request.path().starts_with("/v1/") {
    ///         request.headers_mut().insert("x-team", "agents".parse().unwrap());
    ///     }
    /// });
    /// ```
    pub fn middleware(mut self, middleware: impl Middleware) -> Self {
        self.middleware.push(Arc::new(middleware));
        self
    }

    /// Adds middleware that answers the requests `answer` returns an [`Answer`] for itself (they
    /// never go upstream) and lets the others go on; run after the middleware added before it.
    ///
    /// ```
    /// use krunbox::net::{Answer, Intercept, Method, RequestHead};
    /// let intercept = Intercept::new().answer_with(|request: &RequestHead| {
    ///     (request.method() == Method::DELETE).then(|| Answer::forbidden("no deleting\n"))
    /// });
    /// ```
    pub fn answer_with(
        self,
        answer: impl Fn(&RequestHead) -> Option<Answer> + Send + Sync + 'static,
    ) -> Self {
        self.middleware(AnswerWith(answer))
    }

    /// Adds async middleware written as a function: it gets each request and returns
    /// `Box::pin(async move { .. })`, a future that may change the request, wait, and answer it
    /// (`Some`) or let it go on (`None`); run after the middleware added before it.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use krunbox::net::{Intercept, RequestHead};
    ///
    /// async fn token() -> String { "ghs_short_lived".into() } // the program's token service
    ///
    /// let intercept = Intercept::new().middleware_async(|request: &mut RequestHead| {
    ///     Box::pin(async move {
    ///         let value = format!("Bearer {}", token().await).parse().unwrap();
    ///         request.headers_mut().insert("authorization", value);
    ///         None
    ///     })
    /// });
    /// ```
    pub fn middleware_async<F>(self, middleware: F) -> Self
    where
        F: for<'a> Fn(&'a mut RequestHead) -> MiddlewareFuture<'a> + Send + Sync + 'static,
    {
        self.middleware(AsyncFn(middleware))
    }

    /// Sets header `name` to `value` on every request (replacing what the guest sent).
    ///
    /// ```
    /// use krunbox::net::{HeaderName, HeaderValue, Intercept};
    /// let intercept = Intercept::new().set_header(
    ///     HeaderName::from_static("x-api-key"),
    ///     HeaderValue::from_static("real-key"),
    /// );
    /// ```
    pub fn set_header(self, name: HeaderName, value: HeaderValue) -> Self {
        self.middleware(move |request: &mut RequestHead| {
            request.headers_mut().insert(name.clone(), value.clone());
        })
    }

    /// Removes header `name` from every request.
    ///
    /// ```
    /// use krunbox::net::{HeaderName, Intercept};
    /// let intercept = Intercept::new().remove_header(HeaderName::from_static("cookie"));
    /// ```
    pub fn remove_header(self, name: HeaderName) -> Self {
        self.middleware(move |request: &mut RequestHead| {
            request.headers_mut().remove(&name);
        })
    }
}

/// Changes a request on its way upstream, or answers it itself so it never goes upstream. Any
/// `Fn(&mut RequestHead)` that is `Send + Sync` is one (it changes requests); to answer, use
/// [`Intercept::answer_with`] or implement [`Middleware::handle`], which is async: it may wait
/// for a token service, a database, a person's approval. The whole chain gets
/// [`MIDDLEWARE_DEADLINE`] per request; past it the guest gets `504` and nothing goes upstream.
///
/// ```
/// use krunbox::net::{Middleware, RequestHead};
///
/// struct Bearer(String);
///
/// impl Middleware for Bearer {
///     fn on_request(&self, request: &mut RequestHead) {
///         let value = format!("Bearer {}", self.0).parse().unwrap();
///         request.headers_mut().insert("authorization", value);
///     }
/// }
/// ```
///
/// Middleware that refuses some requests with a status of its own (`handle` in place of
/// `on_request`):
///
/// ```
/// use krunbox::net::{async_trait, Answer, Method, Middleware, RequestHead};
///
/// /// Read-only access: anything but GET and HEAD is answered 403 and goes nowhere.
/// struct ReadOnly;
///
/// #[async_trait]
/// impl Middleware for ReadOnly {
///     async fn handle(&self, request: &mut RequestHead) -> Option<Answer> {
///         match *request.method() {
///             Method::GET | Method::HEAD => None,
///             _ => Some(Answer::forbidden("read-only access\n")),
///         }
///     }
/// }
/// ```
///
/// Middleware that waits for something before the request goes on, a short-lived token:
///
/// ```
/// use std::sync::Arc;
/// use krunbox::net::{async_trait, Answer, Middleware, RequestHead};
///
/// struct Tokens; // a token service of the program's
/// impl Tokens {
///     async fn token_for(&self, path: &str) -> String { format!("ghs_for_{}", path.len()) }
/// }
///
/// struct GitHubAuth(Arc<Tokens>);
///
/// #[async_trait]
/// impl Middleware for GitHubAuth {
///     async fn handle(&self, request: &mut RequestHead) -> Option<Answer> {
///         let token = self.0.token_for(request.path()).await;
///         let value = format!("Bearer {token}").parse().unwrap();
///         request.headers_mut().insert("authorization", value);
///         None
///     }
/// }
/// ```
#[async_trait::async_trait]
pub trait Middleware: Send + Sync + 'static {
    /// Called once per request, before it is sent upstream, by the default
    /// [`handle`](Middleware::handle). Does nothing unless implemented.
    fn on_request(&self, _request: &mut RequestHead) {}

    /// Called once per request, in the middleware's turn: `None` lets the request go on (to
    /// the next middleware, then upstream), an [`Answer`] is sent to the guest in place of
    /// the upstream's response, and then no later middleware runs, no secret is swapped in and
    /// nothing goes upstream; the connection stays open for the guest's next request. The
    /// default calls [`on_request`](Middleware::on_request) and lets the request go on.
    /// Implement it with `#[async_trait]` ([`async_trait`](crate::net::async_trait)) on the
    /// `impl` block.
    async fn handle(&self, request: &mut RequestHead) -> Option<Answer> {
        self.on_request(request);
        None
    }
}

/// How long the middleware of one request may take together: past it the request is answered
/// `504` and nothing goes upstream (a middleware that waits for ever costs its request only).
pub const MIDDLEWARE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// The future [`Intercept::middleware_async`]'s function returns: `Box::pin(async move { .. })`.
pub type MiddlewareFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Option<Answer>> + Send + 'a>>;

/// What middleware answers a request with instead of sending it upstream
/// ([`Middleware::handle`]): a status and a short plain-text body for the guest.
///
/// ```
/// use krunbox::net::{Answer, StatusCode};
///
/// let answer = Answer::new(StatusCode::TOO_MANY_REQUESTS, "slow down\n");
/// assert_eq!(answer.status(), StatusCode::TOO_MANY_REQUESTS);
/// assert_eq!(Answer::forbidden("no").status(), StatusCode::FORBIDDEN);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    status: StatusCode,
    text: String,
}

impl Answer {
    /// An answer with `status` and `text` as its body (`text/plain; charset=utf-8`). `status`
    /// is a final one: an informational status (`1xx`) is sent as `500` saying so.
    ///
    /// ```
    /// let answer = krunbox::net::Answer::new(krunbox::net::StatusCode::NOT_FOUND, "none here\n");
    /// ```
    pub fn new(status: StatusCode, text: impl Into<String>) -> Self {
        Self {
            status,
            text: text.into(),
        }
    }

    /// `403 Forbidden` with `text`.
    ///
    /// ```
    /// let answer = krunbox::net::Answer::forbidden("POST is not allowed here\n");
    /// assert_eq!(answer.text(), "POST is not allowed here\n");
    /// ```
    pub fn forbidden(text: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, text)
    }

    /// The status the guest gets.
    ///
    /// ```
    /// assert_eq!(krunbox::net::Answer::forbidden("").status().as_u16(), 403);
    /// ```
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The body the guest gets.
    ///
    /// ```
    /// assert_eq!(krunbox::net::Answer::forbidden("no").text(), "no");
    /// ```
    pub fn text(&self) -> &str {
        &self.text
    }
}

/// [`Intercept::answer_with`]'s middleware.
struct AnswerWith<F>(F);

#[async_trait::async_trait]
impl<F> Middleware for AnswerWith<F>
where
    F: Fn(&RequestHead) -> Option<Answer> + Send + Sync + 'static,
{
    async fn handle(&self, request: &mut RequestHead) -> Option<Answer> {
        (self.0)(request)
    }
}

/// [`Intercept::middleware_async`]'s middleware.
struct AsyncFn<F>(F);

#[async_trait::async_trait]
impl<F> Middleware for AsyncFn<F>
where
    F: for<'a> Fn(&'a mut RequestHead) -> MiddlewareFuture<'a> + Send + Sync + 'static,
{
    async fn handle(&self, request: &mut RequestHead) -> Option<Answer> {
        (self.0)(request).await
    }
}

impl<F> Middleware for F
where
    F: Fn(&mut RequestHead) + Send + Sync + 'static,
{
    fn on_request(&self, request: &mut RequestHead) {
        self(request)
    }
}

/// A request's head as middleware sees it: its method, path and headers, and the trusted
/// hostname it goes to. Hop-by-hop headers are already gone and `Host` is set by the host
/// from the hostname, so neither can be changed here.
#[derive(Debug)]
pub struct RequestHead {
    hostname: Arc<str>,
    scheme: Scheme,
    method: Method,
    path_and_query: String,
    headers: HeaderMap,
}

impl RequestHead {
    /// The trusted hostname the request goes to (never taken from the request itself).
    ///
    /// ```
    /// # fn f(request: &krunbox::net::RequestHead) -> bool {
    /// request.hostname() == "api.example.com"
    /// # }
    /// ```
    pub fn hostname(&self) -> &str {
        &self.hostname
    }

    /// How the guest sent the request, and so how it goes upstream: [`Scheme::HTTPS`] inside
    /// the guest's TLS (sent on over TLS verified against
    /// [`Network::upstream_trust`](crate::net::Network::upstream_trust)), [`Scheme::HTTP`] in
    /// clear. A plain request that leaves middleware with a header it did not have is refused
    /// (`403`, [`RequestOutcome::Cleartext`](crate::net::RequestOutcome::Cleartext)), so a
    /// credential added here goes out only over TLS; middleware that adds something harmless
    /// to plain requests too can look here first.
    ///
    /// ```
    /// # fn f(request: &mut krunbox::net::RequestHead) {
    /// use krunbox::net::Scheme;
    /// if request.scheme() == &Scheme::HTTPS {
    ///     request.headers_mut().insert("authorization", "Bearer real".parse().unwrap());
    /// }
    /// # }
    /// ```
    pub fn scheme(&self) -> &Scheme {
        &self.scheme
    }

    /// The request's method.
    ///
    /// ```
    /// # fn f(request: &krunbox::net::RequestHead) -> bool {
    /// request.method() == krunbox::net::Method::GET
    /// # }
    /// ```
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The path, with the query if there is one (`/v1/models?limit=1`).
    ///
    /// ```
    /// # fn f(request: &krunbox::net::RequestHead) -> bool {
    /// request.path().starts_with("/v1/")
    /// # }
    /// ```
    pub fn path(&self) -> &str {
        &self.path_and_query
    }

    /// The request's headers.
    ///
    /// ```
    /// # fn f(request: &krunbox::net::RequestHead) -> bool {
    /// request.headers().contains_key("authorization")
    /// # }
    /// ```
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The request's headers, to change.
    ///
    /// ```
    /// # fn f(request: &mut krunbox::net::RequestHead) {
    /// request.headers_mut().remove("cookie");
    /// # }
    /// ```
    pub fn headers_mut(&mut self) -> &mut HeaderMap {
        &mut self.headers
    }
}

/// Everything one intercepted connection needs.
pub(crate) struct InterceptJob {
    pub hostname: Arc<str>,
    pub port: u16,
    pub upstream: Vec<SocketAddr>,
    pub intercept: Intercept,
    pub secrets: Arc<[super::Secret]>,
    pub authority: Arc<CertificateAuthority>,
    pub client_tls: Arc<rustls::ClientConfig>,
    /// Where each request's audit event goes.
    pub audit: Audit,
    /// The sandbox's permits for requests in flight upstream
    /// ([`MAX_UPSTREAM_REQUESTS`](super::stack::MAX_UPSTREAM_REQUESTS)).
    pub upstream_permits: Arc<tokio::sync::Semaphore>,
    /// Ends every task hyper starts for this connection when the sandbox's network stops.
    pub stop: CancellationToken,
    /// The sandbox's share of the process's descriptors: each upstream connection is charged.
    pub budget: Arc<crate::budget::Budget>,
}

type Body = BoxBody<Bytes, hyper::Error>;

/// Serves one intercepted connection until the guest or the upstream ends it.
pub(crate) async fn serve(mut guest: GuestStream, job: InterceptJob) -> std::io::Result<()> {
    let Some(first) = guest.peek().await? else {
        return Ok(());
    };
    let tls = first == 0x16;
    let dialer = upstream::Dialer::addresses(&job.upstream, job.budget.clone());
    if tls {
        let key = job
            .authority
            .certified_key(&job.hostname)
            .map_err(std::io::Error::other)?;
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(OneCertificate(key)));
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let stream = tokio_rustls::TlsAcceptor::from(Arc::new(config))
            .accept(guest)
            .await?;
        serve_http(stream, tls, dialer, job).await
    } else {
        serve_http(guest, tls, dialer, job).await
    }
}

/// Serves HTTP on `guest`, the guest's end of an intercepted connection (the bytes inside its
/// TLS connection if `tls`, and then requests go upstream over TLS too), sending requests
/// upstream over `dialer`'s connections: for [`serve`], and for the fuzz harness ([`fuzz`]) on
/// in-memory streams.
async fn serve_http<S>(
    guest: S,
    tls: bool,
    dialer: upstream::Dialer,
    job: InterceptJob,
) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let context = Arc::new(Context {
        client: upstream::client(&job, tls, dialer),
        scheme: if tls { "https" } else { "http" },
        hostname: job.hostname.clone(),
        port: job.port,
        intercept: job.intercept.clone(),
        secrets: job.secrets.clone(),
        audit: job.audit.clone(),
        upstream_permits: job.upstream_permits.clone(),
    });
    let service = hyper::service::service_fn(move |request| handle(request, context.clone()));
    let mut server =
        hyper_util::server::conn::auto::Builder::new(upstream::Scoped(job.stop.clone()));
    server
        .http1()
        .max_buf_size(INTERCEPT_MAX_HEADERS)
        .http2()
        .max_concurrent_streams(INTERCEPT_MAX_STREAMS)
        .max_header_list_size(INTERCEPT_MAX_HEADERS as u32);
    server
        .serve_connection(TokioIo::new(guest), service)
        .await
        .map_err(std::io::Error::other)
}

/// The certificate for the flow's trusted hostname, whatever name the guest asked for.
#[derive(Debug)]
struct OneCertificate(Arc<rustls::sign::CertifiedKey>);

impl rustls::server::ResolvesServerCert for OneCertificate {
    fn resolve(
        &self,
        _: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }
}

struct Context {
    client: upstream::Client,
    scheme: &'static str,
    hostname: Arc<str>,
    port: u16,
    intercept: Intercept,
    secrets: Arc<[super::Secret]>,
    audit: Audit,
    upstream_permits: Arc<tokio::sync::Semaphore>,
}

/// Headers that belong to one connection, not to the request (RFC 9110 7.6.1).
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Headers the Connection header names are hop-by-hop too.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(&HOP_BY_HOP) {
        headers.remove(name);
    }
    headers.remove(header::TRANSFER_ENCODING);
}

fn answer(status: StatusCode, text: String) -> Response<Body> {
    let body = Full::new(Bytes::from(text))
        .map_err(|never| match never {})
        .boxed();
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Whether `authority` (`host` or `host:port`) names `hostname` on `port` (`default_port` if
/// it names none).
fn authority_matches(authority: &str, hostname: &str, port: u16, default_port: u16) -> bool {
    // A Host header has no user part; an authority with one is not taken apart here.
    if authority.contains('@') {
        return false;
    }
    let Ok(parsed) = authority.parse::<::http::uri::Authority>() else {
        return false;
    };
    parsed
        .host()
        .trim_end_matches('.')
        .eq_ignore_ascii_case(hostname)
        && parsed.port_u16().unwrap_or(default_port) == port
}

/// The URI a request goes upstream with: the trusted hostname and port, and the request's path
/// and query. Built from its parts, so nothing the guest wrote can become part of the authority
/// (in `scheme://hostname:port` + path, parsed again, a path `*` made the port `80*`, and an
/// HTTP/2 `:path` `@other.example/` named another host, which `http` before 1.4.1 let through).
/// `None`: the path is neither origin-form (`/…`, or a bare query) nor `*`.
fn upstream_uri(scheme: &str, hostname: &str, port: u16, path_and_query: &str) -> Option<Uri> {
    let path_and_query = match path_and_query.as_bytes().first() {
        None | Some(b'?') => format!("/{path_and_query}"),
        Some(b'/') => path_and_query.to_owned(),
        Some(b'*') if path_and_query == "*" => path_and_query.to_owned(),
        Some(_) => return None,
    };
    Uri::builder()
        .scheme(scheme)
        .authority(format!("{hostname}:{port}"))
        .path_and_query(path_and_query)
        .build()
        .ok()
}

/// The most of a request's body the host reads and drops after answering the request itself,
/// so the guest's HTTP/1.1 connection can carry its next request.
const UNSENT_BODY_MAX: usize = 64 * 1024;

/// How long the host waits for that body.
const UNSENT_BODY_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Reads and drops the body of a request answered without going upstream (at most
/// [`UNSENT_BODY_MAX`] bytes within [`UNSENT_BODY_WAIT`]), so that on HTTP/1 the connection
/// is in step for the next request. `false`: the connection cannot go on (a larger, slower or
/// broken body, or one the guest sends only after a `100 Continue` it will not get), and is to
/// be closed after the answer. HTTP/2 ends the one stream and needs none of it.
async fn drain_unsent(version: ::http::Version, expects_continue: bool, body: Incoming) -> bool {
    use hyper::body::Body as _;
    if version >= ::http::Version::HTTP_2 || body.is_end_stream() {
        return true;
    }
    if expects_continue {
        return false;
    }
    let read = async move {
        let mut body = body;
        let mut left = UNSENT_BODY_MAX;
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else {
                return false;
            };
            if let Some(data) = frame.data_ref() {
                let Some(rest) = left.checked_sub(data.len()) else {
                    return false;
                };
                left = rest;
            }
        }
        true
    };
    tokio::time::timeout(UNSENT_BODY_WAIT, read)
        .await
        .unwrap_or(false)
}

/// A bound host's response with the values of its secrets swapped back for their
/// placeholders, in the headers and, streamed, in the body: an origin that echoes what it got
/// (an error page, a redirect's `Location`, an object stored and read back) must not hand the
/// guest a value. A compressed body is left alone (its bytes hide the value; requests to bound
/// hosts ask for no compression, so an origin that honours `Accept-Encoding` sends none);
/// a body swapped in loses its `Content-Length`.
fn without_reflected_secrets(
    context: &Context,
    record: &Arc<RequestRecord>,
    headers: &mut HeaderMap,
    body: Incoming,
) -> Body {
    let reflected = super::secrets::unswap_headers(&context.secrets, &context.hostname, headers);
    record.reflected(&reflected);
    let Some(swap) = super::secrets::StreamSwap::for_response(&context.secrets, &context.hostname)
    else {
        return body.boxed();
    };
    if hyper::body::Body::is_end_stream(&body) {
        return body.boxed();
    }
    let encoded = headers
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    if encoded {
        tracing::debug!(
            target: "krunbox::net",
            hostname = %context.hostname,
            "a compressed response from a host secrets are bound to is not looked into"
        );
        return body.boxed();
    }
    headers.remove(header::CONTENT_LENGTH);
    body::SwapBody::response(body, swap, record.clone()).boxed()
}

/// What became of a request's middleware when it did not finish: the caller's code panicked,
/// or took longer than [`MIDDLEWARE_DEADLINE`].
enum MiddlewareFailure {
    Panicked(crate::callback::Panicked),
    TimedOut,
}

/// Runs the middleware in order until one answers, all of them within `deadline`. A panic in
/// one (the caller's code) or the deadline fails the request, not the connection's task.
async fn run_middleware(
    intercept: &Intercept,
    head: &mut RequestHead,
    deadline: std::time::Duration,
) -> Result<Option<Answer>, MiddlewareFailure> {
    let chain = async {
        for middleware in &intercept.middleware {
            let answered = crate::callback::guarded(|| middleware.handle(head))
                .await
                .map_err(MiddlewareFailure::Panicked)?;
            if answered.is_some() {
                return Ok(answered);
            }
        }
        Ok(None)
    };
    tokio::time::timeout(deadline, chain)
        .await
        .unwrap_or(Err(MiddlewareFailure::TimedOut))
}

/// The answer to a request that goes nowhere: its body is read and dropped first where that
/// keeps an HTTP/1 connection usable ([`drain_unsent`]), else the connection closes after it.
async fn answer_unsent(
    version: ::http::Version,
    expects_continue: bool,
    body: Incoming,
    status: StatusCode,
    text: String,
) -> Response<Body> {
    let reusable = drain_unsent(version, expects_continue, body).await;
    let mut response = answer(status, text);
    if !reusable {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// The credentials a plain HTTP request would carry upstream: the headers middleware added or
/// changed (`head` against what the guest sent, `guest_headers`), and the secrets bound to the
/// hostname whose placeholders it holds where they would be swapped over TLS. Such a request
/// is refused: in clear, anyone on the path (or behind a forged DNS answer) would read them.
fn cleartext_credentials(
    context: &Context,
    guest_headers: &HeaderMap,
    head: &RequestHead,
) -> Vec<String> {
    let mut credentials: Vec<String> = Vec::new();
    for (name, value) in &head.headers {
        let sent = guest_headers.get_all(name).iter().any(|v| v == value);
        if !sent && !credentials.iter().any(|c| c == name.as_str()) {
            credentials.push(name.as_str().to_owned());
        }
    }
    // The swap as it would run over TLS, on copies: what it would put in is a credential.
    let (mut headers, mut path) = (head.headers.clone(), head.path_and_query.clone());
    let would = super::secrets::swap(&context.secrets, &context.hostname, &mut headers, &mut path);
    credentials.extend(would.replaced);
    credentials
}

/// A path without its query string (which may hold credentials), for logs and the audit.
fn without_query(path_and_query: &str) -> &str {
    path_and_query
        .split_once('?')
        .map_or(path_and_query, |(path, _)| path)
}

async fn handle(
    request: Request<Incoming>,
    context: Arc<Context>,
) -> Result<Response<Body>, Infallible> {
    let path = request
        .uri()
        .path_and_query()
        .map_or("/", |p| without_query(p.as_str()));
    let record = context.audit.request(
        &context.hostname,
        context.port,
        request.method().clone(),
        path,
    );
    Ok(forward(request, &context, &record).await)
}

/// Answers one request of an intercepted connection: from middleware, from krunbox itself
/// (another authority, a bad path, an unreachable upstream), or from upstream; says which in
/// `record`.
async fn forward(
    request: Request<Incoming>,
    context: &Context,
    record: &Arc<RequestRecord>,
) -> Response<Body> {
    let default_port = if context.scheme == "https" { 443 } else { 80 };
    let authority = request
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| {
            request
                .headers()
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_owned)
        });
    let matches = authority
        .as_deref()
        .is_some_and(|a| authority_matches(a, &context.hostname, context.port, default_port));
    if !matches {
        let authority = authority.unwrap_or_else(|| "(no authority)".into());
        let text = format!(
            "krunbox: this connection is for {}:{}, not {authority}\n",
            context.hostname, context.port,
        );
        record.answered(
            StatusCode::MISDIRECTED_REQUEST,
            RequestOutcome::Misdirected { authority },
        );
        return answer(StatusCode::MISDIRECTED_REQUEST, text);
    }
    let (mut parts, body) = request.into_parts();
    // What the guest sent, kept for a request middleware answers (the head's copy is gone).
    let expects_continue = parts
        .headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    strip_hop_by_hop(&mut parts.headers);
    // The client sets Host from the URI it is given, which names the trusted hostname.
    parts.headers.remove(header::HOST);
    let tls = context.scheme == "https";
    let mut head = RequestHead {
        hostname: context.hostname.clone(),
        scheme: if tls { Scheme::HTTPS } else { Scheme::HTTP },
        method: parts.method.clone(),
        path_and_query: parts
            .uri
            .path_and_query()
            .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned()),
        headers: std::mem::take(&mut parts.headers),
    };
    // On plain HTTP, what the guest sent, to tell what middleware added.
    let guest_headers = (!tls).then(|| head.headers.clone());
    let answered = match run_middleware(&context.intercept, &mut head, MIDDLEWARE_DEADLINE).await {
        Ok(answered) => answered,
        Err(MiddlewareFailure::TimedOut) => {
            // The caller's code waited too long: this request only gets a 504.
            tracing::error!(
                target: "krunbox::net",
                hostname = %context.hostname,
                "middleware took longer than {MIDDLEWARE_DEADLINE:?}; the request is answered 504"
            );
            record.answered(
                StatusCode::GATEWAY_TIMEOUT,
                RequestOutcome::MiddlewareTimedOut,
            );
            let text = format!(
                "krunbox: the host's middleware took longer than {} s on this request\n",
                MIDDLEWARE_DEADLINE.as_secs()
            );
            return answer_unsent(
                parts.version,
                expects_continue,
                body,
                StatusCode::GATEWAY_TIMEOUT,
                text,
            )
            .await;
        }
        Err(MiddlewareFailure::Panicked(panicked)) => {
            // The caller's code failed: this request only gets a 500, the connection goes on.
            tracing::error!(
                target: "krunbox::net",
                hostname = %context.hostname,
                "middleware panicked ({panicked}); the request is answered 500"
            );
            record.answered(
                StatusCode::INTERNAL_SERVER_ERROR,
                RequestOutcome::MiddlewarePanicked {
                    message: panicked.0.clone(),
                },
            );
            let text = "krunbox: the host's middleware failed on this request\n".to_owned();
            return answer_unsent(
                parts.version,
                expects_continue,
                body,
                StatusCode::INTERNAL_SERVER_ERROR,
                text,
            )
            .await;
        }
    };
    if let Some(mut answered) = answered {
        // A final status only: a 1xx is not an answer to send in place of a response.
        if answered.status.is_informational() {
            answered = Answer::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "krunbox: middleware answered with {}, which is not a final status\n",
                    answered.status
                ),
            );
        }
        record.answered(
            answered.status,
            RequestOutcome::Answered {
                reason: answered.text.trim_end().to_owned(),
            },
        );
        return answer_unsent(
            parts.version,
            expects_continue,
            body,
            answered.status,
            answered.text,
        )
        .await;
    }
    strip_hop_by_hop(&mut head.headers);
    head.headers.remove(header::HOST);
    if let Some(guest_headers) = guest_headers {
        let credentials = cleartext_credentials(context, &guest_headers, &head);
        if !credentials.is_empty() {
            tracing::warn!(
                target: "krunbox::net",
                hostname = %context.hostname,
                port = context.port,
                credentials = %credentials.join(", "),
                "refused a plain HTTP request that would carry a credential: credentials go \
                 only over TLS"
            );
            let text = format!(
                "krunbox: requests to {}:{} carry a credential the host adds, which goes only \
                 over HTTPS; this one was plain HTTP and went nowhere\n",
                context.hostname, context.port,
            );
            record.answered(
                StatusCode::FORBIDDEN,
                RequestOutcome::Cleartext { credentials },
            );
            return answer_unsent(
                parts.version,
                expects_continue,
                body,
                StatusCode::FORBIDDEN,
                text,
            )
            .await;
        }
    }
    // What a host secrets are bound to sends back is looked into for their values
    // (`without_reflected_secrets`): ask it for bytes that can be, not compressed ones.
    if context
        .secrets
        .iter()
        .any(|s| s.is_bound_to(&context.hostname))
    {
        head.headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
    }
    // Secrets go upstream only over TLS (a plain request holding a bound secret's placeholder
    // was refused just above).
    let swap_for = if tls { &*context.hostname } else { "" };
    let swapped = super::secrets::swap(
        &context.secrets,
        swap_for,
        &mut head.headers,
        &mut head.path_and_query,
    );
    record.secrets(&swapped.replaced, &swapped.left);
    // The body, for the secrets that opted in to bodies: streamed through the swap (which
    // changes its length, so it goes chunked), unless it is compressed (then left alone).
    let encoded = head
        .headers
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    let body: Body = match super::secrets::StreamSwap::for_body(&context.secrets, swap_for) {
        Some(swap) if !encoded && !hyper::body::Body::is_end_stream(&body) => {
            if swap.swaps() {
                head.headers.remove(header::CONTENT_LENGTH);
            }
            body::SwapBody::new(body, swap, record.clone()).boxed()
        }
        _ => body.boxed(),
    };
    // A body of unknown length (swapped into, or sent chunked or on HTTP/2 without a length)
    // goes chunked, said outright: hyper's client would send a GET's, HEAD's or CONNECT's as
    // no body at all (found by the http_request fuzz target:
    // fuzz/corpus/http_request/regression-get-body).
    if !hyper::body::Body::is_end_stream(&body)
        && hyper::body::Body::size_hint(&body).exact().is_none()
    {
        head.headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
    }
    let Some(uri) = upstream_uri(
        context.scheme,
        &context.hostname,
        context.port,
        &head.path_and_query,
    ) else {
        record.answered(StatusCode::BAD_REQUEST, RequestOutcome::InvalidPath);
        return answer(
            StatusCode::BAD_REQUEST,
            "krunbox: the request's path is not valid\n".into(),
        );
    };
    parts.uri = uri;
    parts.headers = head.headers;
    parts.version = ::http::Version::HTTP_11;
    // The semaphore is never closed.
    let Ok(permit) = context.upstream_permits.clone().acquire_owned().await else {
        unreachable!("the upstream permits are never closed")
    };
    match context
        .client
        .request(Request::from_parts(parts, body))
        .await
    {
        Ok(response) => {
            let (mut parts, body) = response.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            let body = without_reflected_secrets(context, record, &mut parts.headers, body);
            record.answered(parts.status, RequestOutcome::Forwarded);
            Response::from_parts(parts, body::Permitted::new(body, permit).boxed())
        }
        Err(err) => {
            record.answered(
                StatusCode::BAD_GATEWAY,
                RequestOutcome::Unreachable {
                    reason: format!("{err:?}"),
                },
            );
            answer(
                StatusCode::BAD_GATEWAY,
                format!(
                    "krunbox: the upstream {} could not be reached\n",
                    context.hostname
                ),
            )
        }
    }
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn the_authority_must_name_the_trusted_hostname_and_port() {
        assert!(authority_matches(
            "origin.test:8443",
            "origin.test",
            8443,
            443
        ));
        assert!(authority_matches(
            "ORIGIN.test.:8443",
            "origin.test",
            8443,
            443
        ));
        assert!(authority_matches("origin.test", "origin.test", 443, 443));
        assert!(!authority_matches("origin.test", "origin.test", 8443, 443));
        assert!(!authority_matches(
            "other.test:8443",
            "origin.test",
            8443,
            443
        ));
        assert!(!authority_matches(
            "origin.test.evil:8443",
            "origin.test",
            8443,
            443
        ));
        assert!(!authority_matches(
            "user@origin.test:8443",
            "origin.test",
            8443,
            443
        ));
        assert!(!authority_matches("", "origin.test", 443, 443));
    }

    #[test]
    fn the_upstream_uri_names_the_trusted_hostname_whatever_the_path() {
        let uri = |path| upstream_uri("https", "origin.test", 8443, path);
        for (path, sent) in [
            ("/v1/models?limit=1", "/v1/models?limit=1"),
            ("/x@other.test/", "/x@other.test/"),
            ("?q=1", "/?q=1"),
            ("", "/"),
            ("*", "*"),
        ] {
            let uri = uri(path).unwrap();
            assert_eq!(uri.scheme_str(), Some("https"));
            assert_eq!(uri.host(), Some("origin.test"), "{path}");
            assert_eq!(uri.port_u16(), Some(8443), "{path}");
            assert_eq!(uri.path_and_query().unwrap().as_str(), sent);
        }
        for path in ["@other.test/x", "0/x", ".other.test/", ":1/", "**"] {
            assert_eq!(uri(path), None, "{path}");
        }
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_removed() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, "keep-alive, x-secret".parse().unwrap());
        headers.insert("x-secret", "1".parse().unwrap());
        headers.insert(header::PROXY_AUTHORIZATION, "basic x".parse().unwrap());
        headers.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        headers.insert(header::AUTHORIZATION, "kept".parse().unwrap());
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1, "{headers:?}");
        assert!(headers.contains_key(header::AUTHORIZATION));
    }
}
