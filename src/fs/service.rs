//! The transport: each mount's vsock connection, served.
//!
//! guest-init connects to [`FS_PORT`](krunbox_protocol::FS_PORT) once per mount (libkrun
//! bridges the port to this instance's `fs.sock`), sends the mount's index, then relays the
//! guest kernel's FUSE requests unparsed. Here each request is read whole (its header's length,
//! bounded by [`MAX_REQUEST`]), answered concurrently (at most [`MAX_IN_FLIGHT`] per mount: past
//! that, reading stops and the guest waits), and the replies are written back in the order they
//! finish. Everything belongs to the instance: dropping the service ends every task.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::{JoinHandle, JoinSet};

use super::fuse::{Session, IN_HEADER_LEN, MAX_REQUEST};
use super::Mount;

/// Requests of one mount answered at once.
pub(crate) const MAX_IN_FLIGHT: usize = 64;

/// Serves an instance's mounts while it lives.
pub(crate) struct FsService {
    acceptor: JoinHandle<()>,
}

impl Drop for FsService {
    fn drop(&mut self) {
        // The acceptor owns the connections' tasks (a JoinSet): aborting it ends them all.
        self.acceptor.abort();
    }
}

impl FsService {
    /// Starts accepting the guest's mount connections on `listener`.
    pub(crate) fn start(mounts: Vec<Mount>, listener: UnixListener) -> Self {
        FsService {
            acceptor: tokio::spawn(accept(mounts, listener)),
        }
    }
}

async fn accept(mounts: Vec<Mount>, listener: UnixListener) {
    let mut connections = JoinSet::new();
    // Each mount's current connection: a boot that is retried connects again, and the new
    // connection replaces the old one.
    let mut current: Vec<Option<tokio::task::AbortHandle>> = vec![None; mounts.len()];
    loop {
        let (mut stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(target: "krunbox::fs", %err, "accepting a mount connection failed");
                return;
            }
        };
        while connections.try_join_next().is_some() {}
        let mut index = [0u8; 4];
        // The index arrives with the connection; a guest that withholds it holds up only
        // this acceptor, briefly.
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            stream.read_exact(&mut index),
        )
        .await;
        let index = u32::from_le_bytes(index) as usize;
        let Some(mount) = mounts.get(index).filter(|_| matches!(read, Ok(Ok(_)))) else {
            tracing::warn!(target: "krunbox::fs", index, "refused a mount connection that named no mount");
            continue;
        };
        if let Some(old) = current[index].take() {
            old.abort();
        }
        let session = Arc::new(Session::new(mount.fs.clone(), mount.options));
        let path = mount.guest_path.clone();
        current[index] = Some(connections.spawn(async move {
            if let Err(err) = serve(stream, session).await {
                tracing::warn!(target: "krunbox::fs", mount = %path, %err, "a mount's connection ended");
            }
        }));
    }
}

/// Serves one mount's connection until it closes or breaks the framing.
async fn serve(stream: UnixStream, session: Arc<Session>) -> std::io::Result<()> {
    let (mut reader, mut writer) = stream.into_split();
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
            });
        }
    };
    tokio::select! {
        result = reading => result,
        result = writing => result,
    }
}
