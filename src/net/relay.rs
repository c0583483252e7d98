//! One granted TCP connection's host side: a task that gets the guest's end as a stream
//! ([`GuestStream`]) and serves it, splicing it to an upstream socket ([`splice`]) or speaking
//! HTTP on it; the service moves the bytes between that stream and the gateway's socket.
//!
//! Back-pressure both ways, so a connection holds a bounded amount whatever either end does:
//! - guest to upstream: the service reads the guest's socket only while the channel to the
//!   task has room ([`TO_UPSTREAM_CHUNKS`] chunks); otherwise the stack's receive buffer fills
//!   and the guest's window closes.
//! - to the guest: the task writes only with credit ([`FROM_UPSTREAM_WINDOW`] bytes), which
//!   the service gives back as the guest's socket takes the bytes.

use std::collections::VecDeque;
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio_util::sync::{PollSemaphore, PollSender};
use tracing::Instrument;

use super::stack::FlowKey;
use crate::budget::{Budget, Descriptor};

/// The most read from either end at once.
pub(crate) const CHUNK: usize = 16 * 1024;

/// Chunks from the guest waiting to be written upstream.
pub(crate) const TO_UPSTREAM_CHUNKS: usize = 4;

/// Bytes read from upstream not yet taken by the guest's socket.
pub(crate) const FROM_UPSTREAM_WINDOW: usize = 256 * 1024;

/// How long one upstream address gets to accept the connection.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// What a connection's task tells the service.
#[derive(Debug)]
pub(crate) enum Upstream {
    /// Bytes for the guest.
    Data(Bytes),
    /// The upstream finished sending.
    Finished,
    /// The upstream connection failed or was reset; the guest's is reset too.
    Failed,
}

/// A message from a connection's task: which connection (`id` tells a connection from a later
/// one with the same addresses).
#[derive(Debug)]
pub(crate) struct FromUpstream {
    pub key: FlowKey,
    pub id: u64,
    pub what: Upstream,
}

/// Dials `addresses` in turn on `port` until one accepts.
pub(crate) async fn dial(
    addresses: &[SocketAddr],
    budget: &Arc<Budget>,
) -> Result<(TcpStream, Descriptor), String> {
    // Counted before it exists: a guest past its share of the process's descriptors gets a
    // refused connection, and nothing is opened.
    let Some(charge) = budget.descriptor() else {
        return Err(
            "the sandbox holds as many host descriptors as it may (Limits::host_descriptors)"
                .into(),
        );
    };
    let mut failures = Vec::new();
    for address in addresses {
        if address.ip().is_unspecified() {
            // Linux takes a connection to 0.0.0.0 or :: for one to the host itself: whatever
            // the policy meant by granting it, it was not the host's loopback.
            failures.push(format!(
                "{address}: the unspecified address is never dialled (it reaches the host's own \
                 loopback; grant connect_to(127.0.0.1:PORT) for that)"
            ));
            continue;
        }
        match tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(address)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                return Ok((stream, charge));
            }
            Ok(Err(err)) => failures.push(format!("{address}: {err}")),
            Err(_) => failures.push(format!("{address}: timed out")),
        }
    }
    if failures.is_empty() {
        failures.push("no address to dial".into());
    }
    Err(failures.join("; "))
}

/// The service's side of a granted connection.
#[derive(Debug)]
pub(crate) struct Relay {
    pub id: u64,
    /// To the task; dropped when the guest has finished sending.
    pub to_upstream: Option<mpsc::Sender<Bytes>>,
    /// From the task, waiting for room in the guest's socket.
    pub from_upstream: VecDeque<Bytes>,
    pub credit: Arc<Semaphore>,
    pub upstream_finished: bool,
    pub upstream_failed: bool,
    /// Whether the guest's socket was told to finish: a FIN after the last upstream byte, or a
    /// reset when the upstream failed.
    pub closed_to_guest: bool,
    pub task: tokio::task::AbortHandle,
}

impl Relay {
    /// Starts the connection's task in `tasks`: `serve` gets the guest's end as a stream (and
    /// is what the connection does: splice it to an upstream socket, or speak HTTP on it).
    /// The task reports on `events`, and wakes the service with `wake` when it took bytes
    /// from the guest (so there is room for more).
    pub(crate) fn start<F, Fut>(
        key: FlowKey,
        id: u64,
        events: mpsc::Sender<FromUpstream>,
        wake: Arc<Notify>,
        tasks: &mut tokio::task::JoinSet<()>,
        serve: F,
    ) -> Self
    where
        F: FnOnce(GuestStream) -> Fut,
        Fut: std::future::Future<Output = std::io::Result<()>> + Send + 'static,
    {
        let (to_upstream, from_guest) = mpsc::channel(TO_UPSTREAM_CHUNKS);
        let credit = Arc::new(Semaphore::new(FROM_UPSTREAM_WINDOW));
        let guest = GuestStream {
            key,
            id,
            from_guest,
            leftover: Bytes::new(),
            to_guest: PollSender::new(events.clone()),
            credit: PollSemaphore::new(credit.clone()),
            wake,
            finished: false,
        };
        let served = serve(guest);
        let task = tasks.spawn(
            async move {
                // However the task ends, the guest's connection ends with it: finished (a FIN,
                // after everything written), or reset. A second Finished is ignored.
                let what = match served.await {
                    Ok(()) => Upstream::Finished,
                    Err(_) => Upstream::Failed,
                };
                let _ = events.send(FromUpstream { key, id, what }).await;
            }
            .in_current_span(),
        );
        Self {
            id,
            to_upstream: Some(to_upstream),
            from_upstream: VecDeque::new(),
            credit,
            upstream_finished: false,
            upstream_failed: false,
            closed_to_guest: false,
            task,
        }
    }

    /// The guest's socket took `n` bytes from the front of the queue: the task gets credit
    /// for as many more.
    pub(crate) fn took(&mut self, n: usize) {
        self.credit.add_permits(n);
        let mut n = n;
        while n > 0 {
            let Some(front) = self.from_upstream.front_mut() else {
                break;
            };
            let step = n.min(front.len());
            front.advance(step);
            n -= step;
            if front.is_empty() {
                self.from_upstream.pop_front();
            }
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Splices the guest's end to an upstream socket until both directions have finished. Each
/// end's finish is passed on to the other (a half-close stays a half-close).
pub(crate) async fn splice(mut guest: GuestStream, mut upstream: TcpStream) -> std::io::Result<()> {
    tokio::io::copy_bidirectional_with_sizes(&mut guest, &mut upstream, CHUNK, CHUNK).await?;
    Ok(())
}

/// The guest's end of a granted connection, as its task sees it: what the guest sent (read),
/// and what goes to the guest (write), with the back-pressure described at the top. Shutting
/// it down finishes the guest's connection (a FIN); an error from the task resets it.
#[derive(Debug)]
pub(crate) struct GuestStream {
    key: FlowKey,
    id: u64,
    from_guest: mpsc::Receiver<Bytes>,
    leftover: Bytes,
    to_guest: PollSender<FromUpstream>,
    credit: PollSemaphore,
    wake: Arc<Notify>,
    finished: bool,
}

impl GuestStream {
    /// The first byte the guest sends, left to be read (`None`: it finished without one).
    pub(crate) async fn peek(&mut self) -> std::io::Result<Option<u8>> {
        if self.leftover.is_empty() {
            match self.from_guest.recv().await {
                Some(chunk) => {
                    self.leftover = chunk;
                    self.wake.notify_one();
                }
                None => return Ok(None),
            }
        }
        Ok(self.leftover.first().copied())
    }
}

fn gone() -> std::io::Error {
    std::io::Error::new(ErrorKind::BrokenPipe, "the network service stopped")
}

impl AsyncRead for GuestStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.leftover.is_empty() {
            match ready!(self.from_guest.poll_recv(cx)) {
                Some(chunk) => {
                    self.leftover = chunk;
                    // The service holds back the guest's bytes while the channel is full.
                    self.wake.notify_one();
                }
                None => return Poll::Ready(Ok(())),
            }
        }
        let n = buf.remaining().min(self.leftover.len());
        buf.put_slice(&self.leftover[..n]);
        self.leftover.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for GuestStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let n = data.len().min(CHUNK);
        ready!(self.to_guest.poll_reserve(cx)).map_err(|_| gone())?;
        let Some(permit) = ready!(self.credit.poll_acquire_many(cx, n as u32)) else {
            return Poll::Ready(Err(gone()));
        };
        permit.forget();
        let message = FromUpstream {
            key: self.key,
            id: self.id,
            what: Upstream::Data(Bytes::copy_from_slice(&data[..n])),
        };
        self.to_guest.send_item(message).map_err(|_| gone())?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if !self.finished {
            ready!(self.to_guest.poll_reserve(cx)).map_err(|_| gone())?;
            let message = FromUpstream {
                key: self.key,
                id: self.id,
                what: Upstream::Finished,
            };
            self.to_guest.send_item(message).map_err(|_| gone())?;
            self.finished = true;
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 33: a grant of 0.0.0.0 (an address rule, an `accept` of a guest that dialled it)
    /// reached the host's own loopback, where Linux sends connections to it. It is never
    /// dialled; the next address is.
    #[tokio::test]
    async fn the_unspecified_address_is_never_dialled() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let budget = Budget::new(&crate::Limits::new());
        let unspecified: SocketAddr = format!("0.0.0.0:{port}").parse().unwrap();
        let refused = dial(&[unspecified], &budget).await.unwrap_err();
        assert!(refused.contains("never dialled"), "{refused}");
        assert_eq!(
            budget.descriptors_held(),
            0,
            "nothing held for a refused dial"
        );
        let loopback: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let (stream, _charge) = dial(&[unspecified, loopback], &budget).await.unwrap();
        assert_eq!(stream.peer_addr().unwrap(), loopback);
    }
}
