//! A copy-on-write root's layer disk, served block by block from a [`BlockStore`].
//!
//! libkrun's disks are files it opens itself, so the layer disk is a virtio-blk device of our
//! own in the helper (`device/`), which forwards the guest's requests to the library (or serves
//! a store's one local file in place, see below); guest-init
//! mounts the ext4 on it as the overlay's upper layer. Every block the guest's kernel writes
//! arrives here as a write; a guest `fsync` (its filesystem's flush of the disk's volatile
//! cache) arrives as a flush. docs/architecture.md has the alternatives.
//!
//! Here: pages the guest writes are kept in memory (dirty), with copies of blocks as the store
//! holds them (clean: at most half, dropped first), at most `max_dirty_bytes` of both
//! (`block_cache.rs` says why pages). Dirty pages go to the store, merged into whole blocks:
//! * when the next write would pass the bound (written, not flushed: like a disk's cache);
//! * on a guest sync: every dirty page written, then [`BlockStore::flush`], and only then
//!   does the guest's `fsync` return;
//! * when the VM stops, however it stops (written and flushed), before
//!   [`Instance::shutdown`](crate::Instance::shutdown) returns.
//!
//! A store that fails keeps its pages dirty (offered again at the next sync), fails the
//! guest's I/O with `EIO`, and is reported by `shutdown` as [`Error::BlockStore`]: never a
//! silent loss.
//!
//! A store that keeps its blocks in one local file ([`BlockStore::blocks_file`]) is used
//! through the trait only to attach, format and check the layer, and to flush and detach it
//! when the VM stops: in between the helper's device reads and writes the file in place
//! ([`CowLayer::source`]), and nothing of the guest's I/O comes here.

use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::block_cache::{BlockCache, Fetched};
use super::layer::{data_extents, formatted_memfd, Journal, RootUsage};
use super::persistent::{parse_record, record};
use super::served::{DiskSource, ServedDisk};
use super::store::{check_block_size, BlockStore, Claim, Guarded, StoreContext, StoreError};
use crate::error::{Error, Result};
use crate::fs::{async_trait, FsError, FsResult};

/// The size of a copy-on-write root's layer disk (32 GiB): what its changes can grow to.
pub(crate) const COW_LAYER_BYTES: u64 = 32 << 30;

/// The most a store call reads or writes at once.
const MAX_STORE_CALL: u64 = 1 << 20;

/// The blocks of one boot: which the store holds, the dirty pages and the clean copies.
#[derive(Debug)]
struct Blocks {
    cache: BlockCache,
    /// The VM has stopped and everything went to the store (or failed to): no more I/O.
    finished: bool,
}

/// One boot's attachment to a store: the layer disk the guest sees, served from it.
pub(crate) struct CowLayer {
    store: Arc<dyn BlockStore>,
    /// The store handle's "attached" flag: cleared when this boot is done with it.
    attached: Arc<AtomicBool>,
    blocks: tokio::sync::Mutex<Blocks>,
    /// Bytes held now, dirty and clean (read without the lock, for [`CowLayer::usage`]).
    held_bytes: std::sync::atomic::AtomicU64,
    /// Of them, dirty.
    dirty_bytes: std::sync::atomic::AtomicU64,
    block_size: u64,
    blocks_on_disk: u64,
    max_dirty_bytes: u64,
    /// The first store failure, as `(operation, message)`, for `shutdown` to report.
    failure: Mutex<Option<(&'static str, String)>>,
    /// The disk served in place from the store's blocks file ([`BlockStore::blocks_file`]):
    /// then nothing of the guest's I/O comes here (only the count of what failed).
    in_place: Option<DiskSource>,
}

impl std::fmt::Debug for CowLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CowLayer")
            .field("block_size", &self.block_size)
            .field("max_dirty_bytes", &self.max_dirty_bytes)
            .finish_non_exhaustive()
    }
}

/// A store's [`BlockStore::blocks_file`] must be a regular file open for reading and writing,
/// without `O_APPEND` (Linux's `pwritev` then appends, whatever the offset: every guest write
/// would land in the wrong place) or `O_DIRECT` (a request's data follows its header in guest
/// memory, unaligned: every write would fail).
fn check_blocks_file(file: &std::fs::File) -> std::result::Result<(), StoreError> {
    use nix::fcntl::OFlag;
    use std::os::fd::AsFd;
    let mode = nix::fcntl::fcntl(file.as_fd(), nix::fcntl::FcntlArg::F_GETFL)
        .map_err(std::io::Error::from)?;
    let flags = OFlag::from_bits_truncate(mode);
    let fit = file.metadata()?.is_file()
        && flags & OFlag::O_ACCMODE == OFlag::O_RDWR
        && !flags.intersects(OFlag::O_APPEND | OFlag::O_DIRECT);
    if fit {
        Ok(())
    } else {
        Err(StoreError::Failed(
            "its blocks_file is not a regular file open for reading and writing (without \
             O_APPEND or O_DIRECT)"
                .into(),
        ))
    }
}

fn store_error(operation: &'static str) -> impl Fn(StoreError) -> Error {
    move |source| Error::BlockStore { operation, source }
}

impl CowLayer {
    /// Attaches `store` for one boot over the base with digest `base_sha256`: claims the
    /// handle (`attached`; another running sandbox holds it: [`StoreError::InUse`]), asks the
    /// store, checks the layer's record of its base, and formats a fresh layer into an empty
    /// store.
    pub(crate) async fn attach(
        store: Arc<dyn BlockStore>,
        attached: Arc<AtomicBool>,
        base_sha256: &str,
        max_dirty_bytes: u64,
    ) -> Result<CowLayer> {
        let store: Arc<dyn BlockStore> = Arc::new(Guarded(store));
        let block_size = store.block_size();
        check_block_size(block_size).map_err(Error::InvalidConfig)?;
        // Until the layer is ready, a boot that fails or is dropped gives the store back.
        let mut claim = Claim::take(attached.clone()).map_err(store_error("attach"))?;
        let mut layer = CowLayer::new(store, attached, max_dirty_bytes);
        let context = StoreContext {
            base_sha256: base_sha256.to_string(),
            disk_bytes: COW_LAYER_BYTES,
        };
        claim
            .attach(&layer.store, &context)
            .await
            .map_err(store_error("attach"))?;
        layer.load(base_sha256).await?;
        // Asked once everything before the guest went through the trait (the format, block 0
        // read for its record): the cache holds nothing dirty, and no clean copy goes stale.
        if let Some(file) = layer.store.blocks_file() {
            check_blocks_file(&file).map_err(store_error("attach"))?;
            let size = layer.blocks_on_disk * layer.block_size;
            layer.in_place = Some(
                DiskSource::in_place(file, size)
                    .map_err(Error::io("counting the layer disk's failures"))?,
            );
        }
        claim.disarm();
        Ok(layer)
    }

    /// How the helper's device reaches this layer's blocks: the store's file in place, or
    /// through this layer.
    pub(crate) fn source(self: &Arc<Self>) -> DiskSource {
        match &self.in_place {
            Some(in_place) => in_place.clone(),
            None => DiskSource::Library(self.clone()),
        }
    }

    /// A layer over `store` as if attached to an empty store, without the format (for the
    /// fuzz harness: every block reads as zeros until written).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn unformatted(store: Arc<dyn BlockStore>, max_dirty_bytes: u64) -> CowLayer {
        CowLayer::new(store, Arc::new(AtomicBool::new(true)), max_dirty_bytes)
    }

    /// A layer over `store` holding nothing yet (no block known written, none dirty).
    fn new(store: Arc<dyn BlockStore>, attached: Arc<AtomicBool>, max_dirty_bytes: u64) -> Self {
        let block_size = u64::from(store.block_size());
        CowLayer {
            store,
            attached,
            blocks: tokio::sync::Mutex::new(Blocks {
                cache: BlockCache::new(block_size, COW_LAYER_BYTES / block_size, max_dirty_bytes),
                finished: false,
            }),
            held_bytes: 0.into(),
            dirty_bytes: 0.into(),
            block_size,
            blocks_on_disk: COW_LAYER_BYTES / block_size,
            max_dirty_bytes,
            failure: Mutex::new(None),
            in_place: None,
        }
    }

    /// Learns which blocks the store holds; checks the record of an existing layer, or
    /// formats a new one into an empty store.
    async fn load(&self, base_sha256: &str) -> Result<()> {
        let written = self
            .store
            .written_blocks()
            .await
            .map_err(store_error("list its blocks"))?;
        let mut blocks = self.blocks.lock().await;
        for index in &written {
            if *index >= self.blocks_on_disk {
                return Err(store_error("list its blocks")(StoreError::Failed(format!(
                    "it lists block {index}, past the layer disk's {} blocks",
                    self.blocks_on_disk
                ))));
            }
            blocks.cache.set_written(*index);
        }
        if written.is_empty() {
            drop(blocks);
            return self.format(base_sha256).await;
        }
        let mut first = vec![0u8; self.block_size as usize];
        if blocks.cache.is_written(0) {
            self.store
                .read_blocks(0, &mut first)
                .await
                .map_err(store_error("read"))?;
        }
        match parse_record(&first[..1024]) {
            Ok(recorded) if recorded == base_sha256 => Ok(()),
            Ok(recorded) => Err(store_error("attach")(StoreError::BaseMismatch {
                expected: base_sha256.to_string(),
                recorded,
            })),
            Err(reason) => Err(store_error("attach")(StoreError::Failed(format!(
                "its blocks hold no krunbox layer ({reason}; a first format that failed halfway \
                 leaves this: empty the store and boot again)"
            )))),
        }
    }

    /// A fresh layer: `mke2fs` into a sparse memfd of the disk's size (with a journal: the
    /// store keeps it across crashes), the record in its first KiB, and every block it wrote
    /// stored and flushed.
    async fn format(&self, base_sha256: &str) -> Result<()> {
        let disk = tokio::task::spawn_blocking(move || -> Result<_> {
            let file = formatted_memfd(COW_LAYER_BYTES, Journal::With)?;
            Ok(file)
        })
        .await
        .map_err(|e| Error::WritableLayer(e.to_string()))??;
        disk.write_all_at(&record(base_sha256), 0)
            .map_err(Error::io("writing the layer's record"))?;
        let extents = data_extents(&disk).map_err(Error::io("finding the fresh layer's data"))?;
        // The blocks covering each extent; all-zero ones are skipped (an unwritten block reads
        // as zeros). A fresh layer is a few hundred KiB: block by block is quick enough.
        let size = self.block_size;
        let mut chunk = vec![0u8; size as usize];
        let mut indexes: Vec<u64> = extents
            .iter()
            .flat_map(|&(start, end)| (start / size)..end.div_ceil(size))
            .collect();
        indexes.dedup();
        // Block 0 (the record and the superblock) last, after everything else is flushed: a
        // store whose format failed halfway holds no record and is refused at the next attach
        // (formatting over its blocks again would trust stale ones as zeros), never taken for
        // a whole layer.
        indexes.retain(|&i| i != 0);
        indexes.push(0);
        let mut blocks = self.blocks.lock().await;
        for index in indexes {
            disk.read_exact_at(&mut chunk, index * size)
                .map_err(Error::io("reading the fresh layer"))?;
            if index != 0 && chunk.iter().all(|b| *b == 0) {
                continue;
            }
            if index == 0 {
                self.store.flush().await.map_err(store_error("flush"))?;
            }
            self.store
                .write_blocks(index, &chunk)
                .await
                .map_err(store_error("write"))?;
            blocks.cache.set_written(index);
        }
        self.store.flush().await.map_err(store_error("flush"))
    }

    /// What the layer holds in host memory now (dirty pages and clean copies), against the
    /// bound.
    pub(crate) fn usage(&self) -> RootUsage {
        RootUsage {
            held_bytes: self.held_bytes.load(Ordering::Relaxed),
            max_bytes: self.max_dirty_bytes,
        }
    }

    /// Bytes the guest wrote that the store does not hold yet.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn dirty_bytes(&self) -> u64 {
        self.dirty_bytes.load(Ordering::Relaxed)
    }

    fn account(&self, blocks: &Blocks) {
        let cache = &blocks.cache;
        self.held_bytes.store(cache.held_bytes(), Ordering::Relaxed);
        self.dirty_bytes
            .store(cache.dirty_bytes(), Ordering::Relaxed);
    }

    /// Reads `indexes` (ascending) from the store, consecutive ones in one call each.
    async fn fetch(&self, indexes: &[u64]) -> FsResult<Fetched> {
        let bs = self.block_size;
        let per_call = (MAX_STORE_CALL / bs).max(1);
        let mut fetched = Fetched::new();
        let mut rest = indexes;
        while let Some(&first) = rest.first() {
            let mut count = 1;
            while count < rest.len()
                && (count as u64) < per_call
                && rest[count] == first + count as u64
            {
                count += 1;
            }
            let mut buf = vec![0u8; count * bs as usize];
            if let Err(err) = self.store.read_blocks(first, &mut buf).await {
                self.fail("read", &err);
                return Err(FsError::IO);
            }
            for (i, block) in buf.chunks(bs as usize).enumerate() {
                fetched.insert(first + i as u64, block.into());
            }
            rest = &rest[count..];
        }
        Ok(fetched)
    }

    fn fail(&self, operation: &'static str, err: &StoreError) {
        tracing::warn!(target: "krunbox::rootfs", %err, "the root's block store failed to {operation}");
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        failure.get_or_insert_with(|| (operation, err.to_string()));
    }

    /// The first store failure of this boot, if any.
    pub(crate) fn failure(&self) -> Option<Error> {
        let failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        failure
            .as_ref()
            .map(|(operation, message)| Error::BlockStore {
                operation,
                source: StoreError::Failed(message.clone()),
            })
    }

    /// Reads `size` bytes at `offset` of the disk (fewer at its end).
    pub(crate) async fn read(&self, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        let disk = self.blocks_on_disk * self.block_size;
        let end = offset.saturating_add(u64::from(size)).min(disk);
        if offset >= end {
            return Ok(Vec::new());
        }
        let mut blocks = self.blocks.lock().await;
        if blocks.finished {
            return Err(FsError::IO);
        }
        let fetched = self
            .fetch(&blocks.cache.blocks_to_read(offset, end))
            .await?;
        let data = blocks.cache.read(offset, end, &fetched);
        for (index, block) in fetched {
            blocks.cache.keep_clean(index, block);
        }
        self.account(&blocks);
        Ok(data)
    }

    /// Writes `data` at `offset` of the disk into dirty pages, first storing the dirty ones
    /// if it would pass the bound.
    pub(crate) async fn write(&self, offset: u64, data: &[u8]) -> FsResult<u32> {
        let disk = self.blocks_on_disk * self.block_size;
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|end| *end <= disk)
            .ok_or(FsError::NO_SPACE)?;
        if data.is_empty() {
            return Ok(0);
        }
        let mut blocks = self.blocks.lock().await;
        if blocks.finished {
            return Err(FsError::IO);
        }
        let result = self.write_locked(&mut blocks, offset, end, data).await;
        self.account(&blocks);
        result
    }

    async fn write_locked(
        &self,
        blocks: &mut Blocks,
        offset: u64,
        end: u64,
        data: &[u8],
    ) -> FsResult<u32> {
        let cache = &blocks.cache;
        if cache.dirty_bytes() + cache.new_dirty_bytes(offset, end) > self.max_dirty_bytes {
            self.store_dirty(blocks).await?;
        }
        // What the pages this write covers only in part hold now: read before any change, so
        // that a failing store leaves the write undone rather than half done.
        let fetched = self
            .fetch(&blocks.cache.blocks_to_write(offset, end))
            .await?;
        blocks.cache.write(offset, data, &fetched);
        for (index, block) in fetched {
            blocks.cache.keep_clean(index, block);
        }
        // One write larger than the bound (never from the guest's kernel, whose writes are at
        // most 1 MiB against a bound of at least 16 MiB) goes straight through.
        if blocks.cache.dirty_bytes() > self.max_dirty_bytes {
            self.store_dirty(blocks).await?;
        }
        Ok(data.len() as u32)
    }

    /// Writes every dirty page to the store, merged into runs of whole consecutive blocks (at
    /// most 1 MiB each; the store's version of a block the pages do not cover is read first).
    /// A failure keeps the pages not yet stored dirty.
    async fn store_dirty(&self, blocks: &mut Blocks) -> FsResult<()> {
        while let Some(run) = blocks.cache.next_run(MAX_STORE_CALL) {
            let fetched = self.fetch(&blocks.cache.blocks_to_store(run)).await?;
            let data = blocks.cache.assemble(run, &fetched);
            drop(fetched);
            if let Err(err) = self.store.write_blocks(run.first, &data).await {
                self.fail("write", &err);
                return Err(FsError::IO);
            }
            blocks.cache.stored(run, &data);
            self.account(blocks);
        }
        Ok(())
    }

    /// The guest synced: everything dirty to the store, then the store's flush.
    pub(crate) async fn sync(&self) -> FsResult<()> {
        let mut blocks = self.blocks.lock().await;
        if blocks.finished {
            return Err(FsError::IO);
        }
        self.store_dirty(&mut blocks).await?;
        if let Err(err) = self.store.flush().await {
            self.fail("flush", &err);
            return Err(FsError::IO);
        }
        Ok(())
    }

    /// The VM has stopped: stores and flushes what is dirty, detaches the store and frees the
    /// handle for the next boot. Failures are kept for [`CowLayer::failure`].
    pub(crate) async fn finish(&self) {
        let mut blocks = self.blocks.lock().await;
        if blocks.finished {
            return;
        }
        blocks.finished = true;
        if let Some(DiskSource::InPlace { failures, .. }) = &self.in_place {
            let count = failures.take();
            if count > 0 {
                self.fail(
                    "write",
                    &StoreError::Failed(format!(
                        "{count} of the guest's reads, writes or flushes of the store's file \
                         failed in the VMM (its log says why; the guest got EIO for each)"
                    )),
                );
            }
        }
        if self.store_dirty(&mut blocks).await.is_ok() {
            if let Err(err) = self.store.flush().await {
                self.fail("flush", &err);
            }
        }
        let left = blocks.cache.dirty_bytes();
        if left > 0 {
            self.fail(
                "write",
                &StoreError::Failed(format!(
                    "{} KiB the guest wrote could not be stored when the VM stopped",
                    left / 1024
                )),
            );
        }
        blocks.cache.clear();
        self.account(&blocks);
        if let Err(err) = self.store.detach().await {
            self.fail("detach", &err);
        }
        self.attached.store(false, Ordering::SeqCst);
    }
}

impl CowLayer {
    /// Storing the last blocks took longer than `deadline`: recorded as this boot's failure
    /// (if none came first). The handle stays taken until [`CowLayer::finish`], still
    /// running, detaches the store: a store still busy is not free for another boot.
    pub(crate) fn give_up(&self, deadline: std::time::Duration) {
        self.fail(
            "write",
            &StoreError::Failed(format!(
                "storing the blocks the guest wrote did not finish within {deadline:?} of the VM stopping"
            )),
        );
    }
}

#[async_trait]
impl ServedDisk for CowLayer {
    fn size(&self) -> u64 {
        self.blocks_on_disk * self.block_size
    }
    async fn read(&self, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        CowLayer::read(self, offset, size).await
    }
    async fn write(&self, offset: u64, data: &[u8]) -> FsResult<u32> {
        CowLayer::write(self, offset, data).await
    }
    async fn sync(&self) -> FsResult<()> {
        CowLayer::sync(self).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rootfs::MemoryStore;

    const BASE: &str = "abababababababababababababababababababababababababababababababab";

    async fn attach(store: &MemoryStore, max_dirty_bytes: u64) -> Result<CowLayer> {
        CowLayer::attach(
            Arc::new(store.clone()),
            Arc::new(AtomicBool::new(false)),
            BASE,
            max_dirty_bytes,
        )
        .await
    }

    /// A first attach formats the layer into the store: ext4 with the record in its first
    /// KiB, a few hundred KiB of blocks, all flushed.
    #[tokio::test]
    async fn a_first_attach_formats_a_recorded_ext4_into_the_store() {
        let store = MemoryStore::with_block_size(4096).unwrap();
        let layer = attach(&store, 1 << 20).await.unwrap();
        let stored = store.stored_bytes();
        assert!(stored > 0 && stored < 16 << 20, "{stored} bytes stored");
        let head = layer.read(0, 4096).await.unwrap();
        assert_eq!(parse_record(&head[..1024]).unwrap(), BASE);
        assert_eq!(u16::from_le_bytes([head[1080], head[1081]]), 0xEF53);
        layer.finish().await;
        assert!(layer.failure().is_none());
        // Attached again: the record is read back, nothing is formatted anew.
        let again = attach(&store, 1 << 20).await.unwrap();
        assert_eq!(store.stored_bytes(), stored);
        again.finish().await;
        let other = CowLayer::attach(
            Arc::new(store.clone()),
            Arc::new(AtomicBool::new(false)),
            &"cd".repeat(32),
            1 << 20,
        )
        .await;
        assert!(matches!(
            other,
            Err(Error::BlockStore {
                source: StoreError::BaseMismatch { .. },
                ..
            })
        ));
    }

    /// A store that keeps its blocks in one file (a `DirectoryStore`) has the disk served from
    /// that file in place, the formatted layer already in it; a memory store is served through
    /// the layer; a store whose file the device could not write is refused at attach.
    #[tokio::test]
    async fn a_store_with_a_blocks_file_is_served_in_place_and_a_read_only_one_refused() {
        use crate::rootfs::DirectoryStore;
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let store = DirectoryStore::open(dir.path()).unwrap();
        let layer = Arc::new(
            CowLayer::attach(
                Arc::new(store.clone()),
                Arc::new(AtomicBool::new(false)),
                BASE,
                1 << 20,
            )
            .await
            .unwrap(),
        );
        let DiskSource::InPlace { file, size, .. } = layer.source() else {
            panic!("a directory store is served in place");
        };
        assert_eq!(size, COW_LAYER_BYTES);
        let mut head = [0u8; 1024];
        file.read_exact_at(&mut head, 0).unwrap();
        assert_eq!(parse_record(&head).unwrap(), BASE);
        // What the device writes into the file is what the store holds at the next attach.
        file.write_all_at(b"written in place", 1 << 30).unwrap();
        layer.finish().await;
        assert!(layer.failure().is_none());
        // What failed in the device is counted, and reported when the VM has stopped.
        let failing = Arc::new(
            CowLayer::attach(
                Arc::new(DirectoryStore::open(dir.path()).unwrap()),
                Arc::new(AtomicBool::new(false)),
                BASE,
                1 << 20,
            )
            .await
            .unwrap(),
        );
        let DiskSource::InPlace { failures, .. } = failing.source() else {
            panic!("in place");
        };
        let helper = std::fs::File::from(failures.for_helper().unwrap());
        std::io::Write::write_all(&mut &helper, &2u64.to_ne_bytes()).unwrap();
        failing.finish().await;
        assert!(
            matches!(
                failing.failure(),
                Some(Error::BlockStore {
                    operation: "write",
                    ..
                })
            ),
            "{:?}",
            failing.failure()
        );
        let again = CowLayer::attach(
            Arc::new(DirectoryStore::open(dir.path()).unwrap()),
            Arc::new(AtomicBool::new(false)),
            BASE,
            1 << 20,
        )
        .await
        .unwrap();
        assert!(again.blocks.lock().await.cache.is_written((1 << 30) / 4096));
        again.finish().await;

        let memory = Arc::new(attach(&MemoryStore::new(), 1 << 20).await.unwrap());
        assert!(matches!(memory.source(), DiskSource::Library(_)));
        memory.finish().await;

        /// A directory store that hands over a file the device could not use.
        struct UnfitFile(DirectoryStore, Arc<std::fs::File>);
        #[async_trait]
        impl BlockStore for UnfitFile {
            fn block_size(&self) -> u32 {
                self.0.block_size()
            }
            async fn attach(&self, context: &StoreContext) -> std::result::Result<(), StoreError> {
                self.0.attach(context).await
            }
            async fn written_blocks(&self) -> std::result::Result<Vec<u64>, StoreError> {
                self.0.written_blocks().await
            }
            async fn read_blocks(
                &self,
                first: u64,
                buf: &mut [u8],
            ) -> std::result::Result<(), StoreError> {
                self.0.read_blocks(first, buf).await
            }
            async fn write_blocks(
                &self,
                first: u64,
                data: &[u8],
            ) -> std::result::Result<(), StoreError> {
                self.0.write_blocks(first, data).await
            }
            async fn flush(&self) -> std::result::Result<(), StoreError> {
                self.0.flush().await
            }
            async fn detach(&self) -> std::result::Result<(), StoreError> {
                self.0.detach().await
            }
            fn blocks_file(&self) -> Option<Arc<std::fs::File>> {
                Some(self.1.clone())
            }
        }
        let blocks = dir.path().join("blocks.img");
        let read_only = std::fs::File::open(&blocks).unwrap();
        // Linux's pwritev ignores the offset on an O_APPEND file.
        let appending = std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .open(&blocks)
            .unwrap();
        for unfit in [read_only, appending] {
            let attached = Arc::new(AtomicBool::new(false));
            let refused = CowLayer::attach(
                Arc::new(UnfitFile(
                    DirectoryStore::open(dir.path()).unwrap(),
                    Arc::new(unfit),
                )),
                attached.clone(),
                BASE,
                1 << 20,
            )
            .await;
            assert!(
                matches!(
                    &refused,
                    Err(Error::BlockStore {
                        operation: "attach",
                        ..
                    })
                ),
                "{refused:?}"
            );
            // And the refused boot gave the store back: its lock too.
            for _ in 0..100 {
                if !attached.load(Ordering::SeqCst) {
                    break;
                }
                tokio::task::yield_now().await;
            }
            assert!(!attached.load(Ordering::SeqCst));
            let after = CowLayer::attach(
                Arc::new(DirectoryStore::open(dir.path()).unwrap()),
                Arc::new(AtomicBool::new(false)),
                BASE,
                1 << 20,
            )
            .await
            .expect("the store's lock was released");
            after.finish().await;
        }
    }

    /// Reads see every write, whole or partial, dirty or stored; the dirty bytes never pass
    /// the bound (the store takes them first); a sync leaves nothing dirty.
    #[tokio::test]
    async fn reads_see_writes_and_dirty_blocks_stay_within_the_bound() {
        let store = MemoryStore::with_block_size(16384).unwrap();
        let bound = 64 << 10;
        let layer = attach(&store, bound).await.unwrap();
        let base = 1 << 30; // past the fresh filesystem's blocks
        let mut model = vec![0u8; 1 << 20];
        let mut seed = 7u64;
        for round in 0..200u64 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let offset = (seed >> 20) % (model.len() as u64 - 70000);
            let len = 1 + (seed >> 45) as usize % 70000;
            let data: Vec<u8> = (0..len)
                .map(|i| (round as u8).wrapping_add(i as u8))
                .collect();
            assert_eq!(layer.write(base + offset, &data).await.unwrap(), len as u32);
            model[offset as usize..offset as usize + len].copy_from_slice(&data);
            assert!(layer.usage().held_bytes <= bound, "{:?}", layer.usage());
            let check = (seed >> 12) % (model.len() as u64 - 9000);
            let back = layer.read(base + check, 9000).await.unwrap();
            assert_eq!(back, &model[check as usize..check as usize + 9000]);
        }
        layer.sync().await.unwrap();
        assert_eq!(layer.dirty_bytes(), 0);
        assert_eq!(layer.read(base, 1 << 20).await.unwrap(), model);
        // The end of the disk: reads stop there, writes past it fail.
        assert!(layer.read(COW_LAYER_BYTES, 10).await.unwrap().is_empty());
        assert_eq!(layer.read(COW_LAYER_BYTES - 4, 10).await.unwrap().len(), 4);
        assert_eq!(
            layer.write(COW_LAYER_BYTES - 4, &[1; 10]).await,
            Err(FsError::NO_SPACE)
        );
        layer.finish().await;
        assert_eq!(layer.read(0, 10).await, Err(FsError::IO));
    }

    /// A store that fails: the guest's I/O gets EIO, the blocks stay dirty (within the bound)
    /// and are offered again, and the failure is kept for shutdown.
    #[tokio::test]
    async fn a_failing_store_is_eio_and_a_kept_failure_never_a_silent_loss() {
        a_store_that_fails_writes(Failure::Error).await;
    }

    /// The same when the store panics (it is the caller's code): the panic fails that call only.
    #[tokio::test]
    async fn a_panicking_store_fails_only_its_call() {
        a_store_that_fails_writes(Failure::Panic).await;
    }

    #[derive(Clone, Copy, PartialEq)]
    enum Failure {
        Error,
        Panic,
    }

    /// A `MemoryStore` whose writes fail, the way `failure` says, while `failing` is set.
    struct Failing(MemoryStore, AtomicBool, Failure);

    #[async_trait]
    impl BlockStore for Failing {
        fn block_size(&self) -> u32 {
            self.0.block_size()
        }
        async fn written_blocks(&self) -> std::result::Result<Vec<u64>, StoreError> {
            self.0.written_blocks().await
        }
        async fn read_blocks(
            &self,
            first: u64,
            buf: &mut [u8],
        ) -> std::result::Result<(), StoreError> {
            self.0.read_blocks(first, buf).await
        }
        async fn write_blocks(
            &self,
            first: u64,
            data: &[u8],
        ) -> std::result::Result<(), StoreError> {
            if self.1.load(Ordering::SeqCst) {
                match self.2 {
                    Failure::Error => return Err(StoreError::Failed("down".into())),
                    Failure::Panic => panic!("the store's own bug"),
                }
            }
            self.0.write_blocks(first, data).await
        }
        async fn flush(&self) -> std::result::Result<(), StoreError> {
            Ok(())
        }
    }

    async fn a_store_that_fails_writes(failure: Failure) {
        let store = Arc::new(Failing(
            MemoryStore::with_block_size(4096).unwrap(),
            AtomicBool::new(false),
            failure,
        ));
        let attached = Arc::new(AtomicBool::new(false));
        let layer = CowLayer::attach(store.clone(), attached.clone(), BASE, 8192)
            .await
            .unwrap();
        assert!(attached.load(Ordering::SeqCst));
        store.1.store(true, Ordering::SeqCst);
        let at = 1 << 30;
        layer.write(at, &[1; 8192]).await.unwrap();
        assert_eq!(layer.write(at + 8192, &[2; 4096]).await, Err(FsError::IO));
        assert_eq!(layer.sync().await, Err(FsError::IO));
        assert_eq!(layer.read(at, 4).await.unwrap(), [1; 4]);
        assert!(layer.failure().is_some());
        // The store comes back: the next sync stores what was kept.
        store.1.store(false, Ordering::SeqCst);
        layer.sync().await.unwrap();
        let mut block = vec![0u8; 4096];
        store.0.read_blocks(at / 4096, &mut block).await.unwrap();
        assert_eq!(block, [1; 4096]);
        layer.finish().await;
        assert!(!attached.load(Ordering::SeqCst), "the handle is free again");
        let Some(Error::BlockStore {
            operation: "write",
            source,
        }) = layer.failure()
        else {
            panic!("{:?}", layer.failure())
        };
        if failure == Failure::Panic {
            assert!(source.to_string().contains("panicked"), "{source}");
        }
    }
}
