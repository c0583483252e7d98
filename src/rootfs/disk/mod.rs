//! The layer disk's library side: the device's socket, served from a [`ServedDisk`].
//!
//! Requests are read in the order the device forwarded them and run one at a time, writes and
//! flushes each to its end ([`run_whole`]): a flush then covers every write before it, as
//! virtio-blk asks, and the layer's calls into its store never overlap or stop halfway. The device keeps forwarding meanwhile (the
//! socket holds what waits), so the guest's block layer keeps many requests in flight and no
//! request waits for a wake-up of its own. Everything belongs to the instance: dropping the
//! service ends the connection's task.

pub(crate) use krunbox_virtio::disk_wire as wire;

use std::os::fd::OwnedFd;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::rootfs::served::{run_whole, DiskSource, InPlaceFailures, ServedDisk};
use wire::{Operation, ReplyHeader, RequestHeader, Status, REQUEST_HEADER_LEN};

/// One served disk's link to its device in the helper, for the instance's life: a service of
/// the library's, or a file the device reads and writes in place.
pub(crate) enum DiskLink {
    Library(BlockService),
    InPlace(Arc<std::fs::File>, Arc<InPlaceFailures>),
}

impl DiskLink {
    pub(crate) fn new(source: &DiskSource) -> Self {
        match source {
            DiskSource::Library(disk) => DiskLink::Library(BlockService::new(disk.clone())),
            DiskSource::InPlace { file, failures, .. } => {
                DiskLink::InPlace(file.clone(), failures.clone())
            }
        }
    }

    /// The descriptors the helper gets for one boot attempt: a fresh socket served from now
    /// on; or the file (a descriptor of its own, sharing the open file) and the count of its
    /// failures.
    pub(crate) fn connect(&mut self) -> std::io::Result<(OwnedFd, Option<OwnedFd>)> {
        match self {
            DiskLink::Library(service) => Ok((service.connect()?, None)),
            DiskLink::InPlace(file, failures) => Ok((
                OwnedFd::from(file.try_clone()?),
                Some(failures.for_helper()?),
            )),
        }
    }
}

/// Serves one disk's device while the instance lives.
pub(crate) struct BlockService {
    /// Read only to connect (no state of its is held here across a call that can panic).
    disk: std::panic::AssertUnwindSafe<Arc<dyn ServedDisk>>,
    connection: Option<JoinHandle<()>>,
}

impl Drop for BlockService {
    fn drop(&mut self) {
        if let Some(connection) = &self.connection {
            connection.abort();
        }
    }
}

impl BlockService {
    /// A service for `disk`, connected to no helper yet.
    pub(crate) fn new(disk: Arc<dyn ServedDisk>) -> Self {
        BlockService {
            disk: std::panic::AssertUnwindSafe(disk),
            connection: None,
        }
    }

    /// Connects afresh, for one boot attempt: a socket pair whose one end is served from now
    /// on (replacing an earlier attempt's) and whose other end goes to the helper. Must run
    /// inside the tokio runtime.
    pub(crate) fn connect(&mut self) -> std::io::Result<OwnedFd> {
        if let Some(connection) = self.connection.take() {
            connection.abort();
        }
        let (ours, helper_end) = std::os::unix::net::UnixStream::pair()?;
        ours.set_nonblocking(true)?;
        let stream = UnixStream::from_std(ours)?;
        let disk = Arc::clone(&self.disk);
        self.connection = Some(tokio::spawn(async move {
            if let Err(err) = serve(stream, disk).await {
                tracing::warn!(target: "krunbox::rootfs", %err, "the layer disk's connection ended");
            }
        }
.in_current_span()));
        Ok(OwnedFd::from(helper_end))
    }
}

/// Serves one connection until it closes or breaks the framing.
pub(crate) async fn serve<D: ServedDisk + ?Sized>(
    stream: UnixStream,
    disk: Arc<D>,
) -> std::io::Result<()> {
    let (reader, writer) = stream.into_split();
    // Small requests arrive several to a read, and replies go out several to a write: the
    // buffer is flushed whenever no further request is already at hand.
    let mut reader = tokio::io::BufReader::with_capacity(64 * 1024, reader);
    let mut writer = tokio::io::BufWriter::with_capacity(64 * 1024, writer);
    loop {
        let mut bytes = [0u8; REQUEST_HEADER_LEN];
        if reader.buffer().len() < REQUEST_HEADER_LEN {
            writer.flush().await?;
        }
        match reader.read_exact(&mut bytes).await {
            Ok(_) => {}
            Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(err) => return Err(err),
        }
        let request = RequestHeader::decode(&bytes)
            .map_err(|err| std::io::Error::new(std::io::ErrorKind::InvalidData, err))?;
        let mut data = Vec::new();
        if request.operation == Operation::Write {
            // Into the vector's spare room, never zeroed first (a pass over 1 MiB saved).
            data.reserve_exact(request.length as usize);
            (&mut reader)
                .take(u64::from(request.length))
                .read_to_end(&mut data)
                .await?;
            if data.len() != request.length as usize {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
        if request.operation == Operation::Flush {
            // The replies at hand go out first: a flush may wait for the store a long time.
            writer.flush().await?;
        }
        let (status, reply_data) = if request.fits(disk.size()) {
            run(&disk, request, data).await
        } else {
            (Status::IoError, Vec::new())
        };
        let reply = ReplyHeader {
            id: request.id,
            status,
            length: reply_data.len() as u32,
        };
        writer.write_all(&reply.encode()).await?;
        writer.write_all(&reply_data).await?;
    }
}

/// Runs one checked request on the disk, to its end: its status and a read's data.
async fn run<D: ServedDisk + ?Sized>(
    disk: &Arc<D>,
    request: RequestHeader,
    data: Vec<u8>,
) -> (Status, Vec<u8>) {
    let disk = disk.clone();
    let done = match request.operation {
        // A read changes nothing, so it may stop halfway when the connection goes: it runs
        // here, without the hop to a task of its own.
        Operation::Read => disk.read(request.offset, request.length).await,
        Operation::Write => {
            run_whole(async move {
                let written = disk.write(request.offset, &data).await?;
                if written as usize == data.len() {
                    Ok(Vec::new())
                } else {
                    Err(crate::fs::FsError::IO)
                }
            })
            .await
        }
        Operation::Flush => run_whole(async move { disk.sync().await.map(|()| Vec::new()) }).await,
    };
    match done {
        Ok(bytes)
            if request.operation != Operation::Read || bytes.len() == request.length as usize =>
        {
            (Status::Ok, bytes)
        }
        Ok(_) => (Status::IoError, Vec::new()),
        Err(err) => {
            tracing::debug!(target: "krunbox::rootfs", ?request, %err, "a layer disk request failed");
            (Status::IoError, Vec::new())
        }
    }
}
