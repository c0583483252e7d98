//! A disk the host serves to the guest as a virtio-blk device of ours (`device/`): a
//! copy-on-write root's layer disk (`cow.rs`), or an image build's output disk (`crate::image`'s `flatten.rs`).
//! Either the library serves its requests ([`ServedDisk`]) or the device reads and writes a
//! regular file in place ([`DiskSource::InPlace`]).

use std::fs::File;
use std::sync::Arc;

use crate::fs::{async_trait, FsError, FsResult};

/// A disk the host serves: a fixed size, reads, writes and syncs at byte offsets.
#[async_trait]
pub(crate) trait ServedDisk: Send + Sync + 'static {
    /// The disk's size in bytes.
    fn size(&self) -> u64;
    /// Up to `size` bytes at `offset` (fewer at the disk's end).
    async fn read(&self, offset: u64, size: u32) -> FsResult<Vec<u8>>;
    /// Writes `data` at `offset` (`ENOSPC` past the end).
    async fn write(&self, offset: u64, data: &[u8]) -> FsResult<u32>;
    /// Makes every write durable (the guest's flush).
    async fn sync(&self) -> FsResult<()>;
}

/// Runs one disk operation in a task of its own, so that it runs to its end even when the
/// request that asked for it is dropped (its connection closed, the instance going): a disk's
/// calls into a store then never overlap or stop halfway.
pub(super) async fn run_whole<T: Send + 'static>(
    operation: impl std::future::Future<Output = FsResult<T>> + Send + 'static,
) -> FsResult<T> {
    tokio::spawn(operation).await.unwrap_or(Err(FsError::IO))
}

/// Where a served disk's blocks are, as the helper's device reaches them.
#[derive(Clone)]
pub(crate) enum DiskSource {
    /// The library serves each request (over a socket, `disk`).
    Library(Arc<dyn ServedDisk>),
    /// The device reads and writes this regular file (open read-write) in place, block `i` of
    /// the disk at byte `i * 512`; holes and what lies past its end read as zeros.
    InPlace {
        /// The file.
        file: Arc<File>,
        /// The disk's size in bytes.
        size: u64,
        /// What failed in the helper.
        failures: Arc<InPlaceFailures>,
    },
}

impl DiskSource {
    /// `file` served in place as a disk of `size` bytes.
    pub(crate) fn in_place(file: Arc<File>, size: u64) -> std::io::Result<DiskSource> {
        Ok(DiskSource::InPlace {
            file,
            size,
            failures: Arc::new(InPlaceFailures::new()?),
        })
    }
}

/// The reads, writes and flushes of a disk served in place that failed in the helper's device
/// (a full host disk, an I/O error): the guest got `EIO` for each, and the library, which
/// sees none of the I/O, learns of them here once the VM has stopped. An eventfd: the helper
/// adds one per failure to its copy (`Inherited::ServedDiskFailures`), and reading it
/// takes the count.
#[derive(Debug)]
pub(crate) struct InPlaceFailures(nix::sys::eventfd::EventFd);

impl InPlaceFailures {
    fn new() -> std::io::Result<Self> {
        use nix::sys::eventfd::{EfdFlags, EventFd};
        let flags = EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK;
        Ok(InPlaceFailures(
            EventFd::from_flags(flags).map_err(std::io::Error::from)?,
        ))
    }

    /// A descriptor of the count for the helper.
    pub(crate) fn for_helper(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        use std::os::fd::AsFd;
        self.0.as_fd().try_clone_to_owned()
    }

    /// The failures counted since the last call (0 for none).
    pub(crate) fn take(&self) -> u64 {
        // EAGAIN (nothing counted) and anything else alike: no failure was reported.
        self.0.read().unwrap_or(0)
    }
}

impl DiskSource {
    /// The disk's size in bytes.
    pub(crate) fn size(&self) -> u64 {
        match self {
            DiskSource::Library(disk) => disk.size(),
            DiskSource::InPlace { size, .. } => *size,
        }
    }
}

impl std::fmt::Debug for DiskSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            DiskSource::Library(_) => "Library",
            DiskSource::InPlace { .. } => "InPlace",
        };
        f.debug_struct(kind)
            .field("size", &self.size())
            .finish_non_exhaustive()
    }
}

/// A disk a sandbox's VM gets besides its root, found by the serial [`OUTPUT_DISK_SERIAL`]: an
/// image build's output (crate-internal; `SandboxBuilder::output_disk`).
#[derive(Clone, Debug)]
pub(crate) struct OutputDisk(pub DiskSource);

/// The serial an [`OutputDisk`] shows the guest.
pub(crate) const OUTPUT_DISK_SERIAL: &str = "krunbox-output";
