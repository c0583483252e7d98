//! Flattened images kept in a [`BlockStore`]: the image's bytes as the store's blocks (block
//! `i` holds bytes `i * block_size ..`, the last block padded with zeros), written by
//! [`flatten_into_store`] and read back, checked against the image's SHA-256, by
//! [`stored_bytes`]. A program that keeps its roots' layers in its own storage (a database,
//! an object store) keeps their flattened images there the same way.

use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::Stream;
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;

use super::flatten::{flatten, scratch_dir, FlatImage, WrittenImage};
use crate::error::{Error, Result};
use crate::rootfs::store::{check_block_size, Claim};
use crate::rootfs::{BlockStore, Rootfs, StoreContext, StoreError, StoreHandle};

/// The most bytes one store call moves.
const CHUNK: usize = 1 << 20;

/// Like [`flatten_into`](super::flatten_into), with the image written into `store`, an empty
/// [`BlockStore`] used as the image's byte storage: block `i` holds bytes `i * block_size`
/// on, the last block padded with zeros. The store is attached with a [`StoreContext`] whose
/// `base_sha256` is the image's own SHA-256 (its bytes are that image, over no base) and whose
/// `disk_bytes` is the image's size in whole blocks; written, flushed and detached. Returns
/// the image's size and SHA-256, which [`stored_bytes`] needs to read it back.
///
/// A store that holds blocks already is refused ([`Error::InvalidConfig`]): an image is
/// written whole into a store of its own.
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::rootfs::{DirectoryStore, MemoryStore};
/// use krunbox::{BuiltinImage, Rootfs};
///
/// let root = Rootfs::cow(Rootfs::builtin(BuiltinImage::Busybox), MemoryStore::new(), 32 << 20);
/// let images = DirectoryStore::open("/var/lib/lanes/42/image")?;
/// let image = krunbox::image::flatten_into_store(&root, images).await?;
/// println!("{} bytes, sha256 {}", image.len, image.sha256);
/// # Ok(()) }
/// ```
pub async fn flatten_into_store(
    root: &Rootfs,
    store: impl Into<StoreHandle>,
) -> Result<WrittenImage> {
    let store = store.into();
    let scratch = scratch_dir()?;
    let flat = flatten(root, scratch.path().join("image.qcow2")).await?;
    write_image(&flat, &store).await
}

fn store_error(operation: &'static str) -> impl Fn(StoreError) -> Error {
    move |source| Error::BlockStore { operation, source }
}

/// `n` rounded up to whole blocks of `block` bytes (a checked block size, never 0).
fn whole_blocks(n: u64, block: u64) -> u64 {
    n.div_ceil(block).saturating_mul(block)
}

/// The disk an image of `len` bytes takes in blocks of `block`: refused when it would not fit
/// in a `u64` (a length no image has; only a caller's mistake gives one).
fn image_disk_bytes(len: u64, block: u64) -> Result<u64> {
    len.div_ceil(block).checked_mul(block).ok_or_else(|| {
        Error::InvalidConfig(format!(
            "an image of {len} bytes is larger than any store holds"
        ))
    })
}

/// Writes the image file `flat` into the empty store `handle` (see [`flatten_into_store`]).
pub(super) async fn write_image(flat: &FlatImage, handle: &StoreHandle) -> Result<WrittenImage> {
    let (store, mut claim) = handle.take().map_err(store_error("attach"))?;
    let block = store.block_size();
    check_block_size(block).map_err(Error::InvalidConfig)?;
    let io = |what: &'static str| {
        let path = flat.path.clone();
        move |source| Error::Io {
            context: format!("{what} the image {}", path.display()),
            source,
        }
    };
    let mut file = tokio::fs::File::open(&flat.path)
        .await
        .map_err(io("opening"))?;
    let len = file.metadata().await.map_err(io("reading"))?.len();
    let context = StoreContext {
        base_sha256: flat.sha256.clone(),
        disk_bytes: image_disk_bytes(len, block.into())?,
    };
    claim
        .attach(&store, &context)
        .await
        .map_err(store_error("attach"))?;
    let held = store
        .written_blocks()
        .await
        .map_err(store_error("written_blocks"))?;
    if !held.is_empty() {
        claim.release().await.map_err(store_error("detach"))?;
        return Err(Error::InvalidConfig(format!(
            "an image is written into an empty block store, and this one holds {} blocks: give \
             each image a store of its own",
            held.len()
        )));
    }
    let mut buf = vec![0u8; CHUNK];
    let mut first = 0u64;
    loop {
        let filled = read_full(&mut file, &mut buf)
            .await
            .map_err(io("reading"))?;
        if filled == 0 {
            break;
        }
        let padded = whole_blocks(filled as u64, block.into()) as usize;
        buf[filled..padded].fill(0);
        store
            .write_blocks(first, &buf[..padded])
            .await
            .map_err(store_error("write"))?;
        first += (padded / block as usize) as u64;
        if filled < CHUNK {
            break;
        }
    }
    store.flush().await.map_err(store_error("flush"))?;
    claim.release().await.map_err(store_error("detach"))?;
    Ok(WrittenImage {
        len,
        sha256: flat.sha256.clone(),
    })
}

/// Fills `buf` from `file` as far as the file goes.
async fn read_full(file: &mut tokio::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..]).await? {
            0 => break,
            n => filled += n,
        }
    }
    Ok(filled)
}

/// The bytes of an image [`flatten_into_store`] wrote into `store`, as a stream (to upload it,
/// or to write it where a sandbox boots it from): read from the store a MiB at a time, and
/// checked against `image`'s SHA-256 as they pass, so a store that gives back other bytes
/// ends the stream with an error (`InvalidData`) in place of its last chunk. The store is
/// attached while the stream is read (as [`flatten_into_store`] attaches it) and detached at
/// its end, or when it is dropped.
///
/// ```no_run
/// # async fn demo(image: krunbox::image::WrittenImage) -> krunbox::Result<()> {
/// use krunbox::rootfs::DirectoryStore;
///
/// let images = DirectoryStore::open("/var/lib/lanes/42/image")?;
/// let mut bytes = krunbox::image::stored_bytes(images, &image);
/// let mut file = tokio::fs::File::create("/tmp/lane-42.qcow2").await.unwrap();
/// tokio::io::copy(&mut bytes, &mut file).await.unwrap();
/// # Ok(()) }
/// ```
pub fn stored_bytes(
    store: impl Into<StoreHandle>,
    image: &WrittenImage,
) -> impl tokio::io::AsyncRead + Send + Unpin + 'static {
    let reading = Reading {
        handle: store.into(),
        image: image.clone(),
        open: None,
        started: false,
        block: 0,
        next_block: 0,
        left: image.len,
        hasher: Sha256::new(),
    };
    let chunks = futures_util::stream::unfold(Some(reading), |state| async move {
        let mut reading = state?;
        match reading.next_chunk().await {
            Ok(Some(chunk)) => Some((Ok(chunk), Some(reading))),
            Ok(None) => None,
            Err(err) => Some((Err(err), None)),
        }
    });
    let chunks: Pin<Box<dyn Stream<Item = std::io::Result<Bytes>> + Send>> = Box::pin(chunks);
    tokio_util::io::StreamReader::new(chunks)
}

/// A stored image being read.
struct Reading {
    handle: StoreHandle,
    image: WrittenImage,
    /// The store and its claim, once attached.
    open: Option<(Arc<dyn BlockStore>, Claim)>,
    /// Whether the store was taken (it is given back when the stream ends).
    started: bool,
    /// The store's block size, checked when it was taken.
    block: u64,
    next_block: u64,
    /// Image bytes not read yet.
    left: u64,
    hasher: Sha256,
}

impl Reading {
    /// The next chunk of the image; `None` after the last, once its digest matched and the
    /// store is detached.
    async fn next_chunk(&mut self) -> std::io::Result<Option<Bytes>> {
        let failed = |err: Error| std::io::Error::other(err);
        if !self.started {
            self.started = true;
            let (store, mut claim) = self
                .handle
                .take()
                .map_err(store_error("attach"))
                .map_err(failed)?;
            let block = store.block_size();
            check_block_size(block)
                .map_err(Error::InvalidConfig)
                .map_err(failed)?;
            let context = StoreContext {
                base_sha256: self.image.sha256.clone(),
                disk_bytes: image_disk_bytes(self.image.len, block.into()).map_err(failed)?,
            };
            claim
                .attach(&store, &context)
                .await
                .map_err(store_error("attach"))
                .map_err(failed)?;
            self.block = u64::from(block);
            self.open = Some((store, claim));
        }
        let Some((store, _)) = &self.open else {
            // Finished: the last chunk was checked and the store given back.
            return Ok(None);
        };
        if self.left == 0 {
            // An empty image: nothing to read, its digest still checked.
            self.finish().await?;
            return Ok(None);
        }
        // The size checked at the start: a store is not asked again (one that panicked
        // would say 0).
        let block = self.block;
        let want = self.left.min(CHUNK as u64);
        let mut buf = vec![0u8; whole_blocks(want, block) as usize];
        store
            .read_blocks(self.next_block, &mut buf)
            .await
            .map_err(store_error("read"))
            .map_err(failed)?;
        buf.truncate(want as usize);
        self.next_block += whole_blocks(want, block) / block;
        self.left -= want;
        self.hasher.update(&buf);
        if self.left == 0 {
            // The last chunk passes only with the whole image's digest right.
            self.finish().await?;
        }
        Ok(Some(Bytes::from(buf)))
    }

    /// Gives the store back and checks the digest of everything read.
    async fn finish(&mut self) -> std::io::Result<()> {
        if let Some((_, claim)) = self.open.take() {
            claim
                .release()
                .await
                .map_err(store_error("detach"))
                .map_err(std::io::Error::other)?;
        }
        let digest = hex::encode(std::mem::take(&mut self.hasher).finalize());
        if digest != self.image.sha256 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the block store gave back other bytes than the image's: sha256 {digest}, \
                     not {}",
                    self.image.sha256
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rootfs::{DirectoryStore, MemoryStore};

    /// An image file of `len` bytes that are not all alike, and its digest.
    fn image_file(dir: &std::path::Path, len: usize) -> FlatImage {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        let path = dir.join("image.qcow2");
        std::fs::write(&path, &bytes).unwrap();
        FlatImage {
            path,
            sha256: hex::encode(Sha256::digest(&bytes)),
        }
    }

    async fn read_back(store: StoreHandle, image: &WrittenImage) -> std::io::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        stored_bytes(store, image).read_to_end(&mut bytes).await?;
        Ok(bytes)
    }

    #[tokio::test]
    async fn an_image_goes_into_a_store_and_comes_back_whole() {
        let dir = tempfile::tempdir().unwrap();
        // Past a chunk, and not a whole number of blocks.
        let flat = image_file(dir.path(), CHUNK * 2 + 4096 * 3 + 123);
        let memory = StoreHandle::new(MemoryStore::new());
        let directory = StoreHandle::new(
            DirectoryStore::with_block_size(dir.path().join("store"), 16 << 10).unwrap(),
        );
        for store in [memory, directory] {
            let written = write_image(&flat, &store).await.unwrap();
            assert_eq!(written.len, std::fs::metadata(&flat.path).unwrap().len());
            assert_eq!(written.sha256, flat.sha256);
            let back = read_back(store.clone(), &written).await.unwrap();
            assert_eq!(back, std::fs::read(&flat.path).unwrap());
            // Read twice: the first read gave the store back.
            assert_eq!(read_back(store.clone(), &written).await.unwrap(), back);

            // A second image into the same store: refused, the store still usable.
            match write_image(&flat, &store).await {
                Err(Error::InvalidConfig(why)) => assert!(why.contains("empty"), "{why}"),
                other => panic!("a full store took an image: {other:?}"),
            }
            // The store knows which image it holds: asked for another, it refuses.
            let wrong = WrittenImage {
                sha256: "0".repeat(64),
                ..written.clone()
            };
            let err = read_back(store.clone(), &wrong).await.unwrap_err();
            assert!(err.to_string().contains("base image"), "{err}");
            assert_eq!(read_back(store.clone(), &written).await.unwrap(), back);
        }
    }

    /// A store that hands back one byte other than it was given.
    struct Flipping(MemoryStore);

    #[async_trait::async_trait]
    impl BlockStore for Flipping {
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
            self.0.read_blocks(first, buf).await?;
            buf[0] ^= 1;
            Ok(())
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
    }

    #[tokio::test]
    async fn a_store_that_gives_back_other_bytes_ends_the_stream_in_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let flat = image_file(dir.path(), 100_000);
        let store = StoreHandle::new(Flipping(MemoryStore::new()));
        let written = write_image(&flat, &store).await.unwrap();
        let err = read_back(store.clone(), &written).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{err}");
        assert!(err.to_string().contains("other bytes"), "{err}");
        // The failed read gave the store back too.
        store.take().unwrap();
    }

    #[tokio::test]
    async fn a_store_in_use_is_refused_and_a_panicking_one_fails_the_call() {
        let dir = tempfile::tempdir().unwrap();
        let flat = image_file(dir.path(), 10_000);
        let store = StoreHandle::new(MemoryStore::new());
        let (_, claim) = store.take().unwrap();
        match write_image(&flat, &store).await {
            Err(Error::BlockStore {
                source: StoreError::InUse,
                ..
            }) => {}
            other => panic!("a store in use took an image: {other:?}"),
        }
        claim.release().await.unwrap();
        write_image(&flat, &store).await.unwrap();

        struct Panicking;
        #[async_trait::async_trait]
        impl BlockStore for Panicking {
            fn block_size(&self) -> u32 {
                4096
            }
            async fn written_blocks(&self) -> std::result::Result<Vec<u64>, StoreError> {
                Ok(Vec::new())
            }
            async fn read_blocks(
                &self,
                _: u64,
                _: &mut [u8],
            ) -> std::result::Result<(), StoreError> {
                panic!("read")
            }
            async fn write_blocks(&self, _: u64, _: &[u8]) -> std::result::Result<(), StoreError> {
                panic!("write")
            }
            async fn flush(&self) -> std::result::Result<(), StoreError> {
                Ok(())
            }
        }
        match write_image(&flat, &StoreHandle::new(Panicking)).await {
            Err(Error::BlockStore {
                operation: "write",
                source: StoreError::Failed(why),
            }) => assert!(why.contains("panicked"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}
