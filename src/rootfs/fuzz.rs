//! The rootfs fuzz targets.
//!
//! `layer_file`: a persistent layer's file as a compromised VMM helper could leave it (the
//! helper writes that file; the library opens it again at the next boot). The property:
//! reading the layer's record from any bytes never panics and never opens another file (a
//! qcow2 naming a backing or data file is refused); it gives a base digest of 64 lowercase hex
//! digits or a typed [`Error::RootLayer`].
//!
//! `layer_block`: a copy-on-write root's block I/O as the guest drives it (any offsets and
//! lengths, syncs), over a store that fails when the script says so. See
//! [`fuzz_layer_block`].

use std::sync::OnceLock;

#[cfg(test)]
use imago::{
    file::File as ImagoFile, qcow2::Qcow2, DenyImplicitOpenGate, FormatAccess, FormatCreateBuilder,
    FormatDriverBuilder, Storage, StorageCreateOptions, StorageOpenOptions,
};

use super::persistent::read_record;
#[cfg(test)]
use super::persistent::record;
use crate::error::Error;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    })
}

/// Checks the property on `bytes` as a layer file.
pub(crate) fn fuzz_layer_file(bytes: &[u8]) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("layer.qcow2");
    std::fs::write(&path, bytes).expect("writing the layer file");
    match runtime().block_on(read_record(&path)) {
        Ok(digest) => assert!(
            digest.len() == 64
                && digest
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{digest:?}"
        ),
        Err(Error::RootLayer { .. }) => {}
        Err(other) => panic!("not a typed layer error: {other:?}"),
    }
}

/// The dirty bound of the `layer_block` harness: small, so the store is written often, and
/// above the largest write of a script plus two blocks (so a write that fails changed nothing).
const BLOCK_HARNESS_DIRTY: u64 = 128 << 10;

/// A store whose every call fails while `failing` is set, and which can break in the middle
/// of a write: blocks in a [`MemoryStore`].
struct FlakyStore {
    blocks: super::MemoryStore,
    failing: std::sync::atomic::AtomicBool,
    /// Blocks it still writes before it breaks (sets `failing`) partway through a call;
    /// `u64::MAX`: no such limit.
    breaks_after: std::sync::atomic::AtomicU64,
}

impl FlakyStore {
    fn check(&self) -> Result<(), super::StoreError> {
        if self.failing.load(std::sync::atomic::Ordering::SeqCst) {
            Err(super::StoreError::Failed("failing on purpose".into()))
        } else {
            Ok(())
        }
    }
}

#[async_trait::async_trait]
impl super::BlockStore for FlakyStore {
    fn block_size(&self) -> u32 {
        self.blocks.block_size()
    }
    async fn written_blocks(&self) -> Result<Vec<u64>, super::StoreError> {
        self.check()?;
        self.blocks.written_blocks().await
    }
    async fn read_blocks(&self, first: u64, buf: &mut [u8]) -> Result<(), super::StoreError> {
        self.check()?;
        self.blocks.read_blocks(first, buf).await
    }
    async fn write_blocks(&self, first: u64, data: &[u8]) -> Result<(), super::StoreError> {
        use std::sync::atomic::Ordering;
        self.check()?;
        let size = self.block_size() as usize;
        let budget = self.breaks_after.load(Ordering::SeqCst);
        let blocks = (data.len() / size) as u64;
        if budget == u64::MAX {
            return self.blocks.write_blocks(first, data).await;
        }
        if budget >= blocks {
            self.breaks_after.store(budget - blocks, Ordering::SeqCst);
            return self.blocks.write_blocks(first, data).await;
        }
        // Some blocks are stored, the rest are not, and the call fails: a store that broke.
        let stored = budget as usize * size;
        if stored > 0 {
            self.blocks.write_blocks(first, &data[..stored]).await?;
        }
        self.breaks_after.store(u64::MAX, Ordering::SeqCst);
        self.failing.store(true, Ordering::SeqCst);
        Err(super::StoreError::Failed("broke partway on purpose".into()))
    }
    async fn flush(&self) -> Result<(), super::StoreError> {
        self.check()
    }
}

/// The `layer_block` property. `data` is a script: a first byte choosing the store's block
/// size (4 KiB shifted left by it modulo 4: 4 to 32 KiB), then operations, each a byte
/// (modulo 4) and its arguments (missing bytes read as zero):
///
/// * write: a 5-byte offset (bit 0 of the first byte: counted back from the disk's end
///   instead), a 2-byte length, a fill byte;
/// * read: an offset as above and a 2-byte length;
/// * sync;
/// * a byte: below 128, the store starts or stops failing; from 128, it breaks partway
///   through a later write, after storing (byte - 128) more blocks.
///
/// Checked after each: nothing panics; the bytes held (dirty pages and clean copies) never
/// pass the bound; a write that fails changed nothing and a write past the disk is `ENOSPC`; a read that succeeds
/// returns exactly what a model disk holds (stopping at the disk's end); with the store
/// failing, the guest gets `EIO` or success, never wrong data. At the end the store works
/// again: a sync succeeds, leaves nothing dirty, and every byte written reads back.
pub(crate) fn fuzz_layer_block(data: &[u8]) {
    use super::cow::{CowLayer, COW_LAYER_BYTES};
    use crate::fs::FsError;
    use std::collections::BTreeMap;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    const PAGE: u64 = 4096;
    let Some((&size, data)) = data.split_first() else {
        return;
    };
    let store = Arc::new(FlakyStore {
        blocks: super::MemoryStore::with_block_size(4096 << (size % 4)).expect("a valid size"),
        failing: false.into(),
        breaks_after: u64::MAX.into(),
    });
    let layer = CowLayer::unformatted(store.clone(), BLOCK_HARNESS_DIRTY);
    // The model disk: written pages (all others are zeros).
    let mut model: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let model_read = |model: &BTreeMap<u64, Vec<u8>>, offset: u64, len: u64| -> Vec<u8> {
        (offset..offset + len)
            .map(|at| {
                model
                    .get(&(at / PAGE))
                    .map_or(0, |p| p[(at % PAGE) as usize])
            })
            .collect()
    };
    let mut bytes = data.iter().copied();
    let mut next = move || bytes.next().unwrap_or(0);
    let offset = |next: &mut dyn FnMut() -> u8| {
        let raw = (0..5).fold(0u64, |n, _| (n << 8) | u64::from(next()));
        if raw & (1 << 32) != 0 {
            COW_LAYER_BYTES.saturating_sub(raw & 0x1_ffff)
        } else {
            raw
        }
    };
    runtime().block_on(async {
        for _ in 0..64 {
            if data.is_empty() {
                break;
            }
            let op = next() % 4;
            match op {
                0 => {
                    let at = offset(&mut next);
                    let len = u64::from(u16::from_le_bytes([next(), next()]));
                    let fill = next();
                    let result = layer.write(at, &vec![fill; len as usize]).await;
                    if at.saturating_add(len) > COW_LAYER_BYTES {
                        assert_eq!(result, Err(FsError::NO_SPACE), "a write past the disk");
                    } else if result.is_ok() {
                        assert_eq!(result, Ok(len as u32));
                        for byte in at..at + len {
                            model
                                .entry(byte / PAGE)
                                .or_insert_with(|| vec![0; PAGE as usize])
                                [(byte % PAGE) as usize] = fill;
                        }
                    } else {
                        assert_eq!(result, Err(FsError::IO));
                        assert!(
                            store.failing.load(Ordering::SeqCst),
                            "EIO from a working store"
                        );
                    }
                }
                1 => {
                    let at = offset(&mut next);
                    let len = u64::from(u16::from_le_bytes([next(), next()]));
                    match layer.read(at, len as u32).await {
                        Ok(back) => {
                            let end = at.saturating_add(len).min(COW_LAYER_BYTES).max(at);
                            assert_eq!(back, model_read(&model, at, end - at), "read at {at}");
                        }
                        Err(err) => {
                            assert_eq!(err, FsError::IO);
                            assert!(
                                store.failing.load(Ordering::SeqCst),
                                "EIO from a working store"
                            );
                        }
                    }
                }
                2 => {
                    if layer.sync().await.is_err() {
                        assert!(
                            store.failing.load(Ordering::SeqCst),
                            "a working store's sync failed"
                        );
                    } else {
                        assert_eq!(layer.dirty_bytes(), 0, "a sync left pages dirty");
                    }
                }
                _ => {
                    let how = next();
                    if how < 128 {
                        store.failing.fetch_xor(true, Ordering::SeqCst);
                    } else {
                        store
                            .breaks_after
                            .store(u64::from(how - 128), Ordering::SeqCst);
                    }
                }
            }
            assert!(
                layer.usage().held_bytes <= BLOCK_HARNESS_DIRTY,
                "{:?}",
                layer.usage()
            );
        }
        store.failing.store(false, Ordering::SeqCst);
        store.breaks_after.store(u64::MAX, Ordering::SeqCst);
        layer.sync().await.expect("a working store syncs");
        assert_eq!(layer.dirty_bytes(), 0);
        for (&page, contents) in &model {
            assert_eq!(
                &layer.read(page * PAGE, PAGE as u32).await.unwrap(),
                contents
            );
        }
    });
}

/// Seeds for `layer_block` (8 KiB blocks but the last): writes across block edges, a read
/// back, a sync; writes while the store fails, past the bound, then a sync after it recovers;
/// writes and reads at the disk's end; with 32 KiB blocks, a store that breaks partway
/// through storing a sync's blocks, then recovers.
#[cfg(test)]
pub(crate) fn layer_block_seeds() -> Vec<Vec<u8>> {
    let write = |at: [u8; 5], len: u16, fill: u8| {
        let mut op = vec![0];
        op.extend(at);
        op.extend(len.to_le_bytes());
        op.push(fill);
        op
    };
    let read = |at: [u8; 5], len: u16| {
        let mut op = vec![1];
        op.extend(at);
        op.extend(len.to_le_bytes());
        op
    };
    let near_end = |back: u16| {
        let [hi, lo] = back.to_be_bytes();
        [1, 0, 0, hi, lo]
    };
    vec![
        [
            vec![1],
            write([0, 0, 0, 0x1f, 0xf0], 9000, 7),
            read([0, 0, 0, 0x1f, 0], 12000),
            vec![2],
        ]
        .concat(),
        [
            vec![1, 3, 0],
            write([0, 0, 1, 0, 0], 60000, 1),
            write([0, 0, 2, 0, 0], 60000, 2),
            write([0, 0, 3, 0, 0], 60000, 3),
            vec![2, 3, 0],
            read([0, 0, 1, 0, 0], 60000),
            vec![2],
        ]
        .concat(),
        [
            vec![1],
            write(near_end(100), 50, 9),
            write(near_end(10), 50, 9),
            read(near_end(60), 200),
        ]
        .concat(),
        [
            vec![3],
            write([0, 0, 1, 0, 0], 60000, 4),
            vec![3, 129],
            vec![2],
            read([0, 0, 1, 0, 0], 60000),
            vec![3, 0, 2],
            read([0, 0, 1, 0, 0], 60000),
        ]
        .concat(),
    ]
}

#[cfg(test)]
/// A small qcow2 (512-byte clusters, 1 MiB disk) holding `first_kib` at offset 0, made the way
/// a layer is made; `backing` names a backing file in its header.
async fn small_qcow2(first_kib: &[u8], backing: Option<&str>) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("seed.qcow2");
    ImagoFile::create(StorageCreateOptions::new().filename(&path))
        .await
        .unwrap();
    let storage = ImagoFile::open(StorageOpenOptions::new().filename(&path).write(true))
        .await
        .unwrap();
    let mut builder = Qcow2::<ImagoFile>::create_builder(storage)
        .size(1 << 20)
        .cluster_size(512);
    if let Some(backing) = backing {
        builder = builder.backing(backing.to_string(), "raw".to_string());
    }
    builder.create().await.unwrap();
    if backing.is_none() {
        let storage = ImagoFile::open(StorageOpenOptions::new().filename(&path).write(true))
            .await
            .unwrap();
        let qcow2 = Qcow2::<ImagoFile>::builder(storage)
            .write(true)
            .open(DenyImplicitOpenGate::default())
            .await
            .unwrap();
        let qcow2 = FormatAccess::new(qcow2);
        qcow2.write(first_kib, 0).await.unwrap();
        qcow2.flush().await.unwrap();
    }
    std::fs::read(&path).unwrap()
}

/// The seeds (committed once as `fuzz/corpus/layer_file/seed-*`; not regenerated and compared,
/// because imago writes its feature name table in a hash map's order): a layer with a good record, one with garbage where the record goes, one naming
/// a backing file, and bytes that are no qcow2.
#[cfg(test)]
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    runtime().block_on(async {
        vec![
            small_qcow2(&record(&"0123456789abcdef".repeat(4)), None).await,
            small_qcow2(&[0x5a; 1024], None).await,
            small_qcow2(&[0; 1024], Some("/etc/passwd")).await,
            b"QFI\xfb not really".to_vec(),
        ]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seeds_hold_the_property_and_say_what_they_should() {
        let seeds = seeds();
        for seed in &seeds {
            fuzz_layer_file(seed);
        }
        let read = |bytes: &[u8]| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("l.qcow2");
            std::fs::write(&path, bytes).unwrap();
            runtime().block_on(read_record(&path))
        };
        assert_eq!(read(&seeds[0]).unwrap(), "0123456789abcdef".repeat(4));
        assert!(matches!(read(&seeds[1]), Err(Error::RootLayer { .. })));
        // A backing file is never opened: refused, whatever it names.
        match read(&seeds[2]) {
            Err(Error::RootLayer { reason, .. }) => assert!(reason.contains("qcow2"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_property_holds_on_mutated_seeds() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for seed in seeds() {
            for _ in 0..64 {
                let mut bytes = seed.clone();
                for _ in 0..1 + next() % 8 {
                    let at = (next() as usize) % bytes.len();
                    bytes[at] = next() as u8;
                }
                if next() % 4 == 0 {
                    bytes.truncate((next() as usize) % bytes.len());
                }
                fuzz_layer_file(&bytes);
            }
        }
    }

    #[test]
    fn the_layer_block_property_holds_on_its_seeds_and_their_mutations() {
        let seeds = layer_block_seeds();
        for seed in &seeds {
            fuzz_layer_block(seed);
        }
        crate::fuzzing::mutate_seeds(&seeds, 300, 0x1a7e_b10c, fuzz_layer_block);
        crate::fuzzing::replay_corpus("layer_block", fuzz_layer_block);
    }

    /// The seeds, committed as `fuzz/corpus/layer_block/seed-*`; write them with
    /// `KRUNBOX_WRITE_FUZZ_SEEDS=1 cargo test --lib committed_layer_block_seeds`.
    #[test]
    fn committed_layer_block_seeds_are_the_generated_ones() {
        crate::fuzzing::assert_committed_seeds("layer_block", &layer_block_seeds());
    }

    /// A qcow2 root image must stand alone: one naming a backing file is refused before it
    /// could boot, one made the way layers and flattened images are is accepted.
    #[test]
    fn only_standalone_qcow2_images_are_accepted_as_roots() {
        let seeds = seeds();
        let file = |bytes: &[u8]| {
            let mut file = tempfile::tempfile().unwrap();
            std::io::Write::write_all(&mut file, bytes).unwrap();
            file
        };
        super::super::persistent::check_standalone_qcow2(&file(&seeds[0])).unwrap();
        let refused = super::super::persistent::check_standalone_qcow2(&file(&seeds[2]));
        assert_eq!(refused, Err("it names a backing file".to_string()));
    }

    #[test]
    fn the_layer_file_corpus_holds_the_property() {
        crate::fuzzing::replay_corpus("layer_file", fuzz_layer_file);
    }

    /// The first input the fuzz target found: a feature name table of 49 bytes, which imago
    /// 0.2.6 panics on, refused by the header check before imago sees it.
    #[test]
    fn a_feature_name_table_of_a_partial_entry_is_refused_before_imago() {
        let mut bytes = seeds()[0].clone();
        // The seed's extensions start at its header length (offset 100); find the table.
        let start = u32::from_be_bytes(bytes[100..104].try_into().unwrap()) as usize;
        let mut at = start;
        loop {
            let kind = u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
            let length = u32::from_be_bytes(bytes[at + 4..at + 8].try_into().unwrap());
            assert_ne!(kind, 0, "the seed has a feature name table");
            if kind == 0x6803_f857 {
                bytes[at + 4..at + 8].copy_from_slice(&(length + 1).to_be_bytes());
                break;
            }
            at += 8 + (length as usize).div_ceil(8) * 8;
        }
        fuzz_layer_file(&bytes);
    }
}
