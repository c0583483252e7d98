//! A disk the host serves to the guest as a virtio-blk device of ours (`device/`): a
//! copy-on-write root's layer disk (`cow.rs`), or an image build's output disk (`flatten.rs`).

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

/// A disk a sandbox's VM gets besides its root, found by the serial [`OUTPUT_DISK_SERIAL`]: an
/// image build's output (crate-internal; `SandboxBuilder::output_disk`).
#[derive(Clone)]
pub(crate) struct OutputDisk(pub Arc<dyn ServedDisk>);

impl std::fmt::Debug for OutputDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutputDisk")
            .field("size", &self.0.size())
            .finish()
    }
}

/// The serial an [`OutputDisk`] shows the guest.
pub(crate) const OUTPUT_DISK_SERIAL: &str = "krunbox-output";
