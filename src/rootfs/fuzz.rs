//! The `layer_file` fuzz target: a persistent layer's file as a compromised VMM helper could
//! leave it (the helper writes that file; the library opens it again at the next boot).
//!
//! The property: reading the layer's record from any bytes never panics and never opens
//! another file (a qcow2 naming a backing or data file is refused); it gives a base digest of
//! 64 lowercase hex digits or a typed [`Error::RootLayer`].

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
