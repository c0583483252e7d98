//! The host end of the guest's network device: a tokio task that moves frames between the
//! socket libkrun writes to and the [`Gateway`], and stops with its instance.

use std::io::ErrorKind;
use std::os::fd::OwnedFd;

use tokio::io::Interest;
use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;

use super::frame::FrameDecoder;
use super::stack::Gateway;
use super::Addressing;
use crate::error::{Error, Result};

/// Bytes read from the socket at once. Frames are decoded out of it only while the gateway's
/// queue has room, and the socket is not read again before they all were.
const READ_BUFFER: usize = 64 * 1024;

/// The longest the task sleeps when the stack has no timer pending.
const IDLE: std::time::Duration = std::time::Duration::from_secs(60);

/// A running network service; dropping it stops the task (as does the VMM closing its end).
#[derive(Debug)]
pub(crate) struct NetService {
    cancel: CancellationToken,
    #[cfg_attr(not(test), allow(dead_code))]
    task: tokio::task::JoinHandle<()>,
}

impl Drop for NetService {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl NetService {
    /// Serves the guest's link on `socket` (the library's end of the pair whose other end the
    /// VMM helper gave libkrun).
    pub(crate) fn start(addressing: Addressing, socket: OwnedFd) -> Result<Self> {
        let socket = std::os::unix::net::UnixStream::from(socket);
        socket
            .set_nonblocking(true)
            .map_err(Error::io("making the network socket non-blocking"))?;
        let stream =
            UnixStream::from_std(socket).map_err(Error::io("registering the network socket"))?;
        let cancel = CancellationToken::new();
        let task = tokio::spawn(run(stream, addressing, cancel.clone()));
        Ok(Self { cancel, task })
    }

    /// Whether the task has ended (the VMM closed its end, or the instance went).
    #[cfg(test)]
    pub(crate) fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

async fn run(stream: UnixStream, addressing: Addressing, cancel: CancellationToken) {
    let started = std::time::Instant::now();
    let now = || smoltcp::time::Instant::from_micros(started.elapsed().as_micros() as i64);
    let mut gateway = Gateway::new(addressing, now());
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; READ_BUFFER];
    // buf[start..end] was read and not yet decoded.
    let (mut start, mut end) = (0, 0);
    let outcome = loop {
        let mut input = &buf[start..end];
        while gateway.has_room() {
            match decoder.decode(&mut input) {
                Some(Ok(frame)) => {
                    let _ = gateway.receive(frame);
                }
                Some(Err(err)) => {
                    tracing::debug!(target: "krunbox::net", "refused a frame from the guest: {err}");
                }
                None => break,
            }
        }
        start = end - input.len();
        gateway.poll(now());
        let mut interest = None;
        if start == end && gateway.has_room() {
            interest = Some(Interest::READABLE);
        }
        if !gateway.output().is_empty() {
            interest = Some(interest.map_or(Interest::WRITABLE, |i| i | Interest::WRITABLE));
        }
        let delay = gateway
            .poll_delay(now())
            .map_or(IDLE, |d| std::time::Duration::from_micros(d.total_micros()));
        let ready = async {
            match interest {
                Some(interest) => stream.ready(interest).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => break "the instance went",
            ready = ready => {
                let ready = match ready {
                    Ok(ready) => ready,
                    Err(_) => break "the socket failed",
                };
                if ready.is_readable() && start == end {
                    match stream.try_read(&mut buf) {
                        Ok(0) => {
                            if let Err(err) = decoder.finish() {
                                tracing::debug!(target: "krunbox::net", "at the link's end: {err}");
                            }
                            break "the VMM closed the link";
                        }
                        Ok(n) => (start, end) = (0, n),
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                        Err(_) => break "reading the socket failed",
                    }
                }
                if ready.is_writable() && !gateway.output().is_empty() {
                    match stream.try_write(gateway.output()) {
                        Ok(n) => {
                            gateway.output().drain(..n);
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                        Err(_) => break "writing the socket failed",
                    }
                }
            }
            _ = tokio::time::sleep(delay) => {}
        }
    };
    let counters = &gateway.counters;
    tracing::debug!(
        target: "krunbox::net",
        admitted = counters.admitted,
        dropped = counters.dropped,
        dns_refused = counters.dns_refused,
        "network service stopped: {outcome}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::frame;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn the_service_answers_over_the_stream_and_stops_when_the_vmm_end_closes() {
        let (ours, mut vmm) = UnixStream::pair().unwrap();
        let ours = OwnedFd::from(ours.into_std().unwrap());
        let service = NetService::start(Addressing::default(), ours).unwrap();
        // An ARP request for the gateway, framed as libkrun frames it; then garbage lengths.
        let addressing = Addressing::default();
        let mut arp = Vec::new();
        arp.extend_from_slice(&[0xff; 6]);
        arp.extend_from_slice(&addressing.guest_mac);
        arp.extend_from_slice(&[0x08, 0x06, 0, 1, 8, 0, 6, 4, 0, 1]);
        arp.extend_from_slice(&addressing.guest_mac);
        arp.extend_from_slice(&addressing.guest.octets());
        arp.extend_from_slice(&[0; 6]);
        arp.extend_from_slice(&addressing.gateway.octets());
        let mut stream = Vec::new();
        stream.extend_from_slice(&3u32.to_be_bytes());
        stream.extend_from_slice(&[1, 2, 3]);
        frame::encode(&arp, &mut stream).unwrap();
        vmm.write_all(&stream).await.unwrap();
        let mut len = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(5), vmm.read_exact(&mut len))
            .await
            .unwrap()
            .unwrap();
        let mut reply = vec![0u8; u32::from_be_bytes(len) as usize];
        vmm.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply[..6], &addressing.guest_mac, "addressed to the guest");
        assert_eq!(&reply[20..22], &[0, 2], "an ARP reply");
        drop(vmm);
        tokio::time::timeout(Duration::from_secs(5), async {
            while !service.is_finished() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the task ends when the VMM's end closes");
    }

    #[tokio::test]
    async fn dropping_the_service_stops_its_task_and_closes_the_link() {
        let (ours, mut vmm) = UnixStream::pair().unwrap();
        let service = NetService::start(
            Addressing::default(),
            OwnedFd::from(ours.into_std().unwrap()),
        )
        .unwrap();
        drop(service);
        // The task ended and dropped its end: the VMM's end reads EOF.
        let mut byte = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), vmm.read(&mut byte))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n, 0);
    }
}
