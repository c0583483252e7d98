//! The transport's library side: each mount's socket to its device in the helper, served.
//!
//! Each mount is a virtio-fs device in the `krunbox-vmm` helper ([`super::virtio`]), which
//! writes the guest kernel's FUSE requests to the mount's socket unparsed and completes them
//! with the replies that come back. Here each request is read whole (its header's length,
//! bounded by [`MAX_REQUEST`]), answered concurrently (at most [`MAX_IN_FLIGHT`] per mount: past
//! that, reading stops, the device's forwarding blocks and the guest waits), and the replies are
//! written back in the order they finish. Everything belongs to the instance: dropping the
//! service ends every task.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tracing::Instrument;

use super::fuse::{Session, IN_HEADER_LEN, MAX_IN_FLIGHT, MAX_REQUEST};
use super::Mount;
use crate::guest_memory::GuestMemoryFile;

/// Serves an instance's mounts while it lives.
pub(crate) struct FsService {
    /// Read only to connect (no state of theirs is held here across a call that can panic).
    mounts: std::panic::AssertUnwindSafe<Vec<Mount>>,
    connections: Vec<JoinHandle<()>>,
    /// The instance's share of the process's descriptors and blocking threads.
    budget: Arc<crate::budget::Budget>,
}

impl Drop for FsService {
    fn drop(&mut self) {
        for connection in &self.connections {
            connection.abort();
        }
    }
}

impl FsService {
    /// A service for `mounts`, connected to no helper yet, whose filesystems' calls are
    /// charged to `budget`.
    pub(crate) fn new(mounts: Vec<Mount>, budget: Arc<crate::budget::Budget>) -> Self {
        FsService {
            mounts: std::panic::AssertUnwindSafe(mounts),
            connections: Vec::new(),
            budget,
        }
    }

    /// Connects every mount afresh, for one boot attempt: a socket pair each, whose one end is
    /// served from now on (with a new FUSE session, replacing an earlier attempt's) and whose
    /// other ends, in mount order, go to the helper. With `memory` (the VM's memory is that
    /// file) each device hands its queues over and they are served here
    /// ([`super::served`]); without, the device forwards each request on the socket. Must run
    /// inside the tokio runtime.
    pub(crate) fn connect(
        &mut self,
        memory: Option<Arc<GuestMemoryFile>>,
    ) -> std::io::Result<Vec<OwnedFd>> {
        for connection in self.connections.drain(..) {
            connection.abort();
        }
        let mut helper_ends = Vec::with_capacity(self.mounts.len());
        for mount in self.mounts.iter() {
            let (ours, helper_end) = std::os::unix::net::UnixStream::pair()?;
            ours.set_nonblocking(true)?;
            let stream = UnixStream::from_std(ours)?;
            let session = Arc::new(
                Session::new(mount.fs.clone(), mount.options).with_budget(self.budget.clone()),
            );
            let path = mount.guest_path.clone();
            let memory = memory.clone();
            self.connections.push(tokio::spawn(async move {
                let served = match memory {
                    Some(memory) => super::served::serve(stream, session, memory).await,
                    None => serve(stream, session).await,
                };
                if let Err(err) = served {
                    tracing::warn!(target: "krunbox::fs", mount = %path, %err, "a mount's connection ended");
                }
            }
.in_current_span()));
            helper_ends.push(OwnedFd::from(helper_end));
        }
        Ok(helper_ends)
    }
}

/// Serves one mount's connection until it closes or breaks the framing.
async fn serve(stream: UnixStream, session: Arc<Session>) -> std::io::Result<()> {
    let (reader, mut writer) = stream.into_split();
    // Small requests arrive several to a read; a large write's data bypasses the buffer.
    let mut reader = tokio::io::BufReader::with_capacity(64 * 1024, reader);
    let (replies, mut outgoing) = mpsc::channel::<Vec<u8>>(MAX_IN_FLIGHT);
    let mut requests = JoinSet::new();
    let writing = async move {
        while let Some(reply) = outgoing.recv().await {
            writer.write_all(&reply).await?;
        }
        Ok::<_, std::io::Error>(())
    };
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let reading = async {
        loop {
            let mut length = [0u8; 4];
            match reader.read_exact(&mut length).await {
                Ok(_) => {}
                Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(err) => return Err(err),
            }
            let length = u32::from_le_bytes(length) as usize;
            if !(IN_HEADER_LEN..=MAX_REQUEST).contains(&length) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("a FUSE request of {length} bytes (at most {MAX_REQUEST})"),
                ));
            }
            let permit = slots.clone().acquire_owned().await.expect("never closed");
            let mut message = vec![0u8; length];
            message[..4].copy_from_slice(&(length as u32).to_le_bytes());
            reader.read_exact(&mut message[4..]).await?;
            while requests.try_join_next().is_some() {}
            let session = session.clone();
            let replies = replies.clone();
            requests.spawn(async move {
                let _permit = permit;
                match session.handle(&message).await {
                    Ok(Some(reply)) => {
                        let _ = replies.send(reply).await;
                    }
                    Ok(None) => {}
                    Err(err) => {
                        tracing::warn!(target: "krunbox::fs", %err, "the guest broke FUSE framing");
                    }
                }
            }
.in_current_span());
        }
    };
    tokio::select! {
        result = reading => result,
        result = writing => result,
    }
}
