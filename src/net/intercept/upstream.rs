//! The upstream side of interception: an HTTP client per intercepted connection that sends
//! every request to the addresses of the flow's accepted DNS answer (never resolving the name
//! again, never to an address the guest named), over TLS verified against the configured
//! roots with the trusted hostname as the server name.

use std::future::Future;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::InterceptJob;
use crate::budget::{Budget, Descriptor};
use crate::error::{Error, Result};
use crate::net::stack::{UPSTREAM_IDLE_PER_CONNECTION, UPSTREAM_IDLE_TIMEOUT};

/// The client of one intercepted connection.
pub(crate) type Client =
    hyper_util::client::legacy::Client<hyper_rustls::HttpsConnector<Dialer>, Body>;

/// A request body on its way upstream: the guest's, or that with secrets swapped in.
pub(crate) type Body = BoxBody<Bytes, hyper::Error>;

/// The roots upstream TLS certificates are verified against.
///
/// ```
/// use krunbox::net::UpstreamTrust;
/// // The host's own trust store (the default).
/// let trust = UpstreamTrust::system();
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UpstreamTrust {
    /// `None`: the host's trust store.
    roots: Option<Vec<CertificateDer<'static>>>,
}

impl UpstreamTrust {
    /// The host's trust store, as the platform's TLS libraries see it (read once per
    /// process).
    ///
    /// ```
    /// let trust = krunbox::net::UpstreamTrust::system();
    /// ```
    pub fn system() -> Self {
        Self { roots: None }
    }

    /// Exactly the certificates in `pem` (one or more `CERTIFICATE` blocks), e.g. a private
    /// CA's. An empty or unreadable bundle is an error: it would trust nothing.
    ///
    /// ```
    /// # fn f(pem: &[u8]) -> krunbox::Result<()> {
    /// let trust = krunbox::net::UpstreamTrust::pem(pem)?;
    /// # Ok(()) }
    /// ```
    pub fn pem(pem: &[u8]) -> Result<Self> {
        let roots = CertificateDer::pem_slice_iter(pem)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::InvalidConfig(format!("the upstream trust bundle: {e}")))?;
        if roots.is_empty() {
            return Err(Error::InvalidConfig(
                "the upstream trust bundle holds no certificate".into(),
            ));
        }
        Ok(Self { roots: Some(roots) })
    }

    /// The client TLS configuration for these roots.
    pub(crate) fn client_config(&self) -> Result<Arc<rustls::ClientConfig>> {
        let mut store = rustls::RootCertStore::empty();
        match &self.roots {
            Some(roots) => {
                for root in roots {
                    store.add(root.clone()).map_err(|e| {
                        Error::InvalidConfig(format!("an upstream trust root: {e}"))
                    })?;
                }
            }
            None => {
                for root in system_roots() {
                    // One unusable root in the host's store is not a reason to trust none.
                    let _ = store.add(root.clone());
                }
            }
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::NetworkSetup(format!("upstream TLS: {e}")))?
        .with_root_certificates(store)
        .with_no_client_auth();
        Ok(Arc::new(config))
    }
}

fn system_roots() -> &'static [CertificateDer<'static>] {
    static ROOTS: OnceLock<Vec<CertificateDer<'static>>> = OnceLock::new();
    ROOTS.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        for err in &found.errors {
            tracing::debug!(target: "krunbox::net", "reading the host's trust store: {err}");
        }
        found.certs
    })
}

/// A client for `job`'s upstream: HTTPS when the guest spoke TLS, plain HTTP otherwise; its
/// connections are `dialer`'s.
pub(crate) fn client(job: &InterceptJob, tls: bool, dialer: Dialer) -> Client {
    let builder =
        hyper_rustls::HttpsConnectorBuilder::new().with_tls_config((*job.client_tls).clone());
    let builder = if tls {
        builder.https_only()
    } else {
        builder.https_or_http()
    };
    let connector = builder.enable_http1().wrap_connector(dialer);
    hyper_util::client::legacy::Client::builder(Scoped(job.stop.clone()))
        .pool_max_idle_per_host(UPSTREAM_IDLE_PER_CONNECTION)
        .pool_idle_timeout(UPSTREAM_IDLE_TIMEOUT)
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .build(connector)
}

/// Makes the client's connections, whatever the URI names.
#[derive(Clone, Debug)]
pub(crate) enum Dialer {
    /// Dials the flow's recorded addresses in turn, each connection charged to the budget.
    Addresses(Arc<[SocketAddr]>, Arc<Budget>),
    /// An in-memory pipe per connection (of `buffer` bytes each way), whose other end goes to
    /// `to`: the fuzz harness's upstream. A dial fails once the receiver is gone.
    #[cfg(any(test, feature = "fuzzing"))]
    Memory {
        buffer: usize,
        to: tokio::sync::mpsc::UnboundedSender<tokio::io::DuplexStream>,
    },
}

impl Dialer {
    /// Dials `addresses`, as production does.
    pub(crate) fn addresses(addresses: &[SocketAddr], budget: Arc<Budget>) -> Self {
        Self::Addresses(addresses.into(), budget)
    }
}

impl tower_service::Service<hyper::Uri> for Dialer {
    type Response = TokioIo<UpstreamStream>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Self::Response>> + Send + 'static>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: hyper::Uri) -> Self::Future {
        match self {
            Self::Addresses(addresses, budget) => {
                let (addresses, budget) = (addresses.clone(), budget.clone());
                Box::pin(async move {
                    crate::net::relay::dial(&addresses, &budget)
                        .await
                        .map(|(stream, charge)| {
                            TokioIo::new(UpstreamStream::Tcp {
                                stream,
                                _charge: charge,
                            })
                        })
                        .map_err(std::io::Error::other)
                })
            }
            #[cfg(any(test, feature = "fuzzing"))]
            Self::Memory { buffer, to } => {
                let (ours, theirs) = tokio::io::duplex(*buffer);
                let sent = to.send(theirs);
                Box::pin(async move {
                    sent.map_err(|_| std::io::Error::other("the in-memory upstream is gone"))?;
                    Ok(TokioIo::new(UpstreamStream::Memory(ours)))
                })
            }
        }
    }
}

/// One upstream connection: a TCP socket, or the fuzz harness's in-memory pipe. Reads, writes
/// and what hyper learns about the connection are the socket's own.
#[derive(Debug)]
pub(crate) enum UpstreamStream {
    /// A socket, and its charge to the sandbox's budget (given back when it closes).
    Tcp {
        stream: TcpStream,
        _charge: Descriptor,
    },
    #[cfg(any(test, feature = "fuzzing"))]
    Memory(tokio::io::DuplexStream),
}

impl AsyncRead for UpstreamStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Tcp { stream: s, .. } => Pin::new(s).poll_read(cx, buf),
            #[cfg(any(test, feature = "fuzzing"))]
            Self::Memory(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for UpstreamStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp { stream: s, .. } => Pin::new(s).poll_write(cx, data),
            #[cfg(any(test, feature = "fuzzing"))]
            Self::Memory(s) => Pin::new(s).poll_write(cx, data),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp { stream: s, .. } => Pin::new(s).poll_write_vectored(cx, bufs),
            #[cfg(any(test, feature = "fuzzing"))]
            Self::Memory(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Tcp { stream: s, .. } => s.is_write_vectored(),
            #[cfg(any(test, feature = "fuzzing"))]
            Self::Memory(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Tcp { stream: s, .. } => Pin::new(s).poll_flush(cx),
            #[cfg(any(test, feature = "fuzzing"))]
            Self::Memory(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Tcp { stream: s, .. } => Pin::new(s).poll_shutdown(cx),
            #[cfg(any(test, feature = "fuzzing"))]
            Self::Memory(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

impl Connection for UpstreamStream {
    fn connected(&self) -> Connected {
        match self {
            Self::Tcp { stream: s, .. } => s.connected(),
            #[cfg(any(test, feature = "fuzzing"))]
            Self::Memory(_) => Connected::new(),
        }
    }
}

/// Runs hyper's background tasks (connection drivers, HTTP/2 streams) until the sandbox's
/// network stops, so none outlives it.
#[derive(Clone, Debug)]
pub(crate) struct Scoped(pub CancellationToken);

impl<F> hyper::rt::Executor<F> for Scoped
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, future: F) {
        let stop = self.0.clone();
        tokio::spawn(
            async move {
                tokio::select! {
                    _ = future => {}
                    _ = stop.cancelled() => {}
                }
            }
            .in_current_span(),
        );
    }
}
