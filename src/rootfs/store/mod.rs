//! Block stores: where a [`Rootfs::cow`](crate::Rootfs::cow) root keeps its layer's blocks.
//!
//! A writable root's changes live on a layer disk (docs/architecture.md, "Writable roots"). For
//! a copy-on-write root that disk is served by the host, block by block, from a [`BlockStore`]
//! the program supplies: a database, an object store, a directory, memory. The guest's writes
//! collect in host memory (at most the root's `max_dirty_bytes`) and reach the store
//! as [`BlockStore::write_blocks`] calls when that bound fills, when the guest syncs (then
//! followed by [`BlockStore::flush`]) and when the VM stops. A store whose blocks are one local
//! file ([`BlockStore::blocks_file`]) is served from that file in place instead: each write
//! the guest's disk completes is in the file at once, and a guest sync makes it durable. Two
//! stores ship: [`MemoryStore`] and [`DirectoryStore`] (served in place).
//!
//! ```
//! use krunbox::rootfs::{BlockStore, MemoryStore};
//!
//! let store = MemoryStore::new();
//! assert_eq!(store.block_size(), MemoryStore::DEFAULT_BLOCK_SIZE);
//! assert_eq!(store.stored_bytes(), 0);
//! ```

mod claim;
mod directory;
pub(crate) mod error;
mod memory;

pub(crate) use claim::Claim;
pub use directory::DirectoryStore;
pub use error::StoreError;
pub use memory::MemoryStore;

/// Re-exported so that implementations can write `#[async_trait]` without depending on the
/// crate themselves.
pub use async_trait::async_trait;

/// The smallest block a store may use (the guest's filesystem block).
pub const MIN_BLOCK_SIZE: u32 = 4096;

/// The largest block a store may use.
pub const MAX_BLOCK_SIZE: u32 = 1 << 20;

/// What a store is attached to for one boot.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreContext {
    /// The SHA-256 (lowercase hex) of the base image the layer lies over. A layer is
    /// meaningful only over the exact base it was made on: a store that has been attached to
    /// another base should refuse with [`StoreError::BaseMismatch`]. (krunbox also checks the
    /// layer's own record of its base, so a store that ignores this is still safe.)
    pub base_sha256: String,
    /// The layer disk's size in bytes: block indexes are below `disk_bytes / block_size`.
    pub disk_bytes: u64,
}

/// Storage for a copy-on-write root's layer disk, in blocks of [`BlockStore::block_size`]
/// bytes. Implement it to keep a sandbox's root in your own storage; every method is async,
/// and the trait is object safe, so a binding's runtime can implement it too. A store that
/// keeps its blocks in one local file can hand it over ([`BlockStore::blocks_file`]) and have
/// the disk served from it in place, at a raw disk's speed.
///
/// krunbox calls, for one boot: [`attach`](BlockStore::attach) first; then
/// [`written_blocks`](BlockStore::written_blocks) once; then reads, writes and flushes as
/// the guest needs them (one call at a time); [`detach`](BlockStore::detach) last, after a
/// final write and flush of everything the guest wrote. A store is attached to at most one
/// running sandbox of this process at a time (krunbox enforces it); a store shared between
/// processes should refuse a second attach itself ([`StoreError::InUse`]), as
/// [`DirectoryStore`] does.
///
/// Blocks never written read as zeros: krunbox asks only for blocks `written_blocks` listed
/// or that it wrote since. After a crash, each 512-byte sector of a block written since the
/// last `flush` should hold its old or its new contents: what a disk promises, and all the
/// guest's journalling filesystem relies on (the parts of a block the guest did not change are
/// written with what the store held).
///
/// ```
/// use std::collections::HashMap;
/// use std::sync::Mutex;
/// use krunbox::rootfs::{async_trait, BlockStore, StoreError};
///
/// /// Blocks in a map (what `MemoryStore` does, in short).
/// struct MapStore(Mutex<HashMap<u64, Vec<u8>>>);
///
/// #[async_trait]
/// impl BlockStore for MapStore {
///     fn block_size(&self) -> u32 { 4096 }
///     async fn written_blocks(&self) -> Result<Vec<u64>, StoreError> {
///         Ok(self.0.lock().unwrap().keys().copied().collect())
///     }
///     async fn read_blocks(&self, first: u64, buf: &mut [u8]) -> Result<(), StoreError> {
///         let map = self.0.lock().unwrap();
///         for (i, block) in buf.chunks_mut(4096).enumerate() {
///             match map.get(&(first + i as u64)) {
///                 Some(data) => block.copy_from_slice(data),
///                 None => block.fill(0),
///             }
///         }
///         Ok(())
///     }
///     async fn write_blocks(&self, first: u64, data: &[u8]) -> Result<(), StoreError> {
///         let mut map = self.0.lock().unwrap();
///         for (i, block) in data.chunks(4096).enumerate() {
///             map.insert(first + i as u64, block.to_vec());
///         }
///         Ok(())
///     }
///     async fn flush(&self) -> Result<(), StoreError> { Ok(()) }
/// }
/// ```
#[async_trait]
pub trait BlockStore: Send + Sync + 'static {
    /// Bytes per block: a power of two from [`MIN_BLOCK_SIZE`] to [`MAX_BLOCK_SIZE`], the same
    /// for the store's whole life.
    fn block_size(&self) -> u32;

    /// The store is about to serve a boot over `context`'s base. Refuse a base other than the
    /// one the store was made for ([`StoreError::BaseMismatch`]), or a store already in use
    /// elsewhere ([`StoreError::InUse`]). The default accepts.
    async fn attach(&self, context: &StoreContext) -> Result<(), StoreError> {
        let _ = context;
        Ok(())
    }

    /// The index of every block written so far (any order). An empty store gets a freshly
    /// formatted layer.
    async fn written_blocks(&self) -> Result<Vec<u64>, StoreError>;

    /// Fills `buf` (a whole number of blocks) with the blocks from index `first` on.
    async fn read_blocks(&self, first: u64, buf: &mut [u8]) -> Result<(), StoreError>;

    /// Stores `data` (a whole number of blocks) as the blocks from index `first` on. Durable
    /// only after the next [`flush`](BlockStore::flush) returns.
    async fn write_blocks(&self, first: u64, data: &[u8]) -> Result<(), StoreError>;

    /// Makes every write that returned durable: the guest's `fsync` waits for this.
    async fn flush(&self) -> Result<(), StoreError>;

    /// The boot is over: nothing more is read or written until the next `attach`. The
    /// default does nothing.
    async fn detach(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// The one local file the store keeps its blocks in, if it keeps them so: a regular file
    /// open for reading and writing (not `O_APPEND` or `O_DIRECT`: the attach refuses them),
    /// block `i` at byte `i * block_size`, a block never written a hole or past the file's end
    /// (reading as zeros). The default is `None`.
    ///
    /// A store that returns it (as [`DirectoryStore`] does) has its layer disk served in
    /// place: while the VM runs, krunbox's VMM helper reads and writes the file itself,
    /// straight between guest memory and the file, as it would a raw disk, and makes it
    /// durable with `fdatasync` when the guest flushes. The blocks then never pass through
    /// this process: no dirty pages are held (`max_dirty_bytes` bounds nothing), and
    /// `read_blocks` and `write_blocks` are not called between the layer's first use and
    /// the VM's end; `written_blocks` at the next attach must count what the file holds.
    /// Asked once per boot, after `written_blocks`; `flush` and `detach` are still called
    /// when the VM stops. A read, write or flush of the file that fails is `EIO` to the guest
    /// and makes `shutdown` return [`Error::BlockStore`](crate::Error::BlockStore).
    fn blocks_file(&self) -> Option<std::sync::Arc<std::fs::File>> {
        None
    }
}

/// Checks a store's block size: a power of two within the bounds.
pub(crate) fn check_block_size(block_size: u32) -> Result<(), String> {
    if block_size.is_power_of_two() && (MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&block_size) {
        Ok(())
    } else {
        Err(format!(
            "a block store's block size must be a power of two from {MIN_BLOCK_SIZE} to \
             {MAX_BLOCK_SIZE} bytes, got {block_size}"
        ))
    }
}

/// A store whose every call is guarded: the store is the caller's code, and a panic in it fails
/// that call ([`StoreError::Failed`], so the guest's I/O gets `EIO` and `shutdown` reports it)
/// instead of the task serving the disk. The layer holds its store through this.
pub(crate) struct Guarded(pub(crate) std::sync::Arc<dyn BlockStore>);

impl Guarded {
    fn failed(operation: &str, panicked: crate::callback::Panicked) -> StoreError {
        tracing::error!(target: "krunbox::rootfs", "the block store panicked in {operation} ({panicked})");
        StoreError::Failed(format!("the store panicked in {operation}: {panicked}"))
    }
}

#[async_trait]
impl BlockStore for Guarded {
    fn block_size(&self) -> u32 {
        // 0 is no block size: the layer refuses it, with the store's error.
        crate::callback::guarded_sync(|| self.0.block_size()).unwrap_or_else(|panicked| {
            Self::failed("block_size", panicked);
            0
        })
    }

    async fn attach(&self, context: &StoreContext) -> Result<(), StoreError> {
        crate::callback::guarded(|| self.0.attach(context))
            .await
            .unwrap_or_else(|p| Err(Self::failed("attach", p)))
    }

    async fn written_blocks(&self) -> Result<Vec<u64>, StoreError> {
        crate::callback::guarded(|| self.0.written_blocks())
            .await
            .unwrap_or_else(|p| Err(Self::failed("written_blocks", p)))
    }

    async fn read_blocks(&self, first: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        crate::callback::guarded(|| self.0.read_blocks(first, buf))
            .await
            .unwrap_or_else(|p| Err(Self::failed("read_blocks", p)))
    }

    async fn write_blocks(&self, first: u64, data: &[u8]) -> Result<(), StoreError> {
        crate::callback::guarded(|| self.0.write_blocks(first, data))
            .await
            .unwrap_or_else(|p| Err(Self::failed("write_blocks", p)))
    }

    async fn flush(&self) -> Result<(), StoreError> {
        crate::callback::guarded(|| self.0.flush())
            .await
            .unwrap_or_else(|p| Err(Self::failed("flush", p)))
    }

    async fn detach(&self) -> Result<(), StoreError> {
        crate::callback::guarded(|| self.0.detach())
            .await
            .unwrap_or_else(|p| Err(Self::failed("detach", p)))
    }

    fn blocks_file(&self) -> Option<std::sync::Arc<std::fs::File>> {
        crate::callback::guarded_sync(|| self.0.blocks_file()).unwrap_or_else(|panicked| {
            // Without the file the layer serves the disk through the trait, whose calls are
            // guarded the same way.
            Self::failed("blocks_file", panicked);
            None
        })
    }
}
