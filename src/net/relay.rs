//! One granted TCP connection's host side: the upstream socket, and the task that moves bytes
//! between it and the gateway's socket for the guest.
//!
//! Back-pressure both ways, so a connection holds a bounded amount whatever either end does:
//! - guest to upstream: the service reads the guest's socket only while the channel to the
//!   task has room ([`TO_UPSTREAM_CHUNKS`] chunks); otherwise the stack's receive buffer fills
//!   and the guest's window closes.
//! - upstream to guest: the task reads upstream only with credit ([`FROM_UPSTREAM_WINDOW`]
//!   bytes), which the service gives back as the guest's socket takes the bytes.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify, Semaphore};

use super::stack::FlowKey;

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
pub(crate) async fn dial(addresses: &[SocketAddr]) -> Result<TcpStream, String> {
    let mut failures = Vec::new();
    for address in addresses {
        match tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(address)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                return Ok(stream);
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

/// The service's side of a relayed connection.
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
    /// Whether the guest's socket was told to finish (after the last upstream byte).
    pub closed_to_guest: bool,
    pub task: tokio::task::AbortHandle,
}

impl Relay {
    /// Starts the task for `stream`, in `tasks`, reporting on `events` and waking the service
    /// with `wake` when the channel to upstream has room again.
    pub(crate) fn start(
        key: FlowKey,
        id: u64,
        stream: TcpStream,
        events: mpsc::Sender<FromUpstream>,
        wake: Arc<Notify>,
        tasks: &mut tokio::task::JoinSet<()>,
    ) -> Self {
        let (to_upstream, from_guest) = mpsc::channel(TO_UPSTREAM_CHUNKS);
        let credit = Arc::new(Semaphore::new(FROM_UPSTREAM_WINDOW));
        let task = tasks.spawn(run(
            key,
            id,
            stream,
            from_guest,
            events,
            credit.clone(),
            wake,
        ));
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

    /// Gives the task credit for `n` more bytes (the guest's socket took them).
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

async fn run(
    key: FlowKey,
    id: u64,
    stream: TcpStream,
    mut from_guest: mpsc::Receiver<Bytes>,
    events: mpsc::Sender<FromUpstream>,
    credit: Arc<Semaphore>,
    wake: Arc<Notify>,
) {
    let (mut reader, mut writer) = stream.into_split();
    let report = |what| FromUpstream { key, id, what };
    let write = async {
        while let Some(chunk) = from_guest.recv().await {
            writer.write_all(&chunk).await?;
            wake.notify_one();
        }
        // The guest finished sending: so does the host, upstream.
        writer.shutdown().await
    };
    let read = async {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let Ok(permit) = credit.acquire_many(CHUNK as u32).await else {
                return Ok(());
            };
            permit.forget();
            let n = reader.read(&mut buf).await?;
            credit.add_permits(CHUNK - n);
            if n == 0 {
                return Ok(());
            }
            let data = Bytes::copy_from_slice(&buf[..n]);
            if events.send(report(Upstream::Data(data))).await.is_err() {
                return Ok(());
            }
        }
    };
    let read = async {
        let outcome: std::io::Result<()> = read.await;
        let what = match outcome {
            Ok(()) => Upstream::Finished,
            Err(_) => Upstream::Failed,
        };
        let _ = events.send(report(what)).await;
    };
    let write = async {
        if write.await.is_err() {
            let _ = events.send(report(Upstream::Failed)).await;
        }
    };
    tokio::join!(read, write);
}
