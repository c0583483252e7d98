//! A persistent writable root's layer: a qcow2 file that keeps the guest's changes between
//! boots (`Rootfs::persistent`).
//!
//! Made on first use: an ext4 of [`PERSISTENT_LAYER_BYTES`] (with a journal: the layer outlives
//! crashes) is formatted into a sparse scratch file by `mke2fs`, its first 1 KiB (which ext4
//! never uses) gets the layer's record (the base image's digest), and its written extents are
//! copied into a new qcow2 with imago, the crate libkrun itself reads qcow2 with; the qcow2 is
//! then renamed into place, so a layer file is whole or absent. Every boot opens it, takes an
//! exclusive `flock` that the instance holds until it is gone (a second boot gets
//! [`Error::RootInUse`]), and reads the record back through imago: a layer made over another
//! base fails closed ([`Error::RootBaseMismatch`]).
//!
//! The record lives in the disk the guest can write (it is root there): a guest that
//! overwrites it makes the next boot refuse the layer, and one that forges another base's
//! digest only attaches its own changes to an image they were not made on. It is a check
//! against mistakes, not a boundary.

use std::fs::File;
use std::path::Path;

use imago::file::File as ImagoFile;
use imago::qcow2::Qcow2;
use imago::{DenyImplicitOpenGate, FormatAccess, FormatCreateBuilder, FormatDriverBuilder};
use imago::{Storage, StorageCreateOptions, StorageOpenOptions};

use super::layer::{allocated_bytes, data_extents, format_ext4, Journal, RootUsage};
use crate::error::{Error, Result};

/// The size of a persistent layer's disk: what the guest's changes can grow to. The qcow2 file
/// takes host disk only for what is written.
pub(crate) const PERSISTENT_LAYER_BYTES: u64 = 32 << 30;

/// The most host disk a layer's qcow2 file can take: the disk, plus qcow2's tables and
/// refcounts (well under 1% at 64 KiB clusters), with room to spare. The helper's
/// `RLIMIT_FSIZE` while it serves the layer.
pub(crate) const PERSISTENT_LAYER_FILE_BYTES: u64 =
    PERSISTENT_LAYER_BYTES + PERSISTENT_LAYER_BYTES / 32 + (64 << 20);

/// The record's first line; the second names the base.
const RECORD_MAGIC: &str = "krunbox-layer v1";

/// Where the record is: ext4 leaves its first 1024 bytes to a boot loader.
const RECORD_BYTES: usize = 1024;

/// A persistent layer, open and exclusively locked for one instance.
#[derive(Debug)]
pub(crate) struct PersistentLayer {
    file: File,
}

impl PersistentLayer {
    /// Opens the layer at `path` for the base image `base_sha256`, making it if it does not
    /// exist, and locks it for this instance.
    pub(crate) async fn open(path: &Path, base_sha256: &str) -> Result<PersistentLayer> {
        if !path.exists() {
            create(path, base_sha256).await?;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(Error::io(format!(
                "opening the root layer {}",
                path.display()
            )))?;
        lock(&file, path)?;
        let recorded = read_record(path).await?;
        if recorded != base_sha256 {
            return Err(Error::RootBaseMismatch {
                path: path.to_path_buf(),
                expected: base_sha256.to_string(),
                recorded,
            });
        }
        Ok(PersistentLayer { file })
    }

    /// The layer's descriptor, handed to the VMM helper (the lock stays with the open file
    /// description, which the helper shares).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Host disk the layer's file takes now, against the most it can.
    pub(crate) fn usage(&self) -> RootUsage {
        RootUsage {
            held_bytes: allocated_bytes(&self.file),
            max_bytes: PERSISTENT_LAYER_FILE_BYTES,
        }
    }
}

/// An exclusive, non-blocking `flock`: another instance (in this process or another) holding
/// the layer makes this one fail at once.
fn lock(file: &File, path: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    // Not nix's `Flock`, whose guard unlocks when dropped: the lock must last as long as the
    // open file description, which `file` and the helper's inherited copy share, and go with
    // the last of them (the instance, or a helper that outlived it).
    // SAFETY: flock on a descriptor we own; no pointers.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Err(Error::RootInUse {
            path: path.to_path_buf(),
        });
    }
    Err(Error::io(format!(
        "locking the root layer {}",
        path.display()
    ))(err))
}

/// The record: the magic line and the base's digest, zero-padded to [`RECORD_BYTES`].
pub(super) fn record(base_sha256: &str) -> Vec<u8> {
    let mut bytes = format!("{RECORD_MAGIC}\nbase sha256:{base_sha256}\n").into_bytes();
    bytes.resize(RECORD_BYTES, 0);
    bytes
}

/// The base digest a record names, or why it is not a record.
pub(super) fn parse_record(bytes: &[u8]) -> std::result::Result<String, String> {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    let text = std::str::from_utf8(&bytes[..end]).map_err(|_| "not text".to_string())?;
    let mut lines = text.lines();
    if lines.next() != Some(RECORD_MAGIC) {
        return Err("no krunbox layer record".into());
    }
    let digest = lines
        .next()
        .and_then(|line| line.strip_prefix("base sha256:"))
        .filter(|d| d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| "the record names no base digest".to_string())?;
    Ok(digest.to_ascii_lowercase())
}

/// qcow2's header extension that names features (`0x6803f857`): entries of 48 bytes.
const FEATURE_NAME_TABLE: u32 = 0x6803_f857;

/// Checks the qcow2 header's extensions for what imago 0.2.6 does not survive: it indexes
/// each 48-byte entry of the feature name table without checking that the last one is whole,
/// and panics on a table whose length is not a multiple of 48 (found by the `layer_file` fuzz
/// target). The helper, which may be compromised, writes this file, and the library opens it
/// again at the next boot, so the header is walked here first (written by hand: it guards one
/// crate's bug, which no other crate does). Also refuses extensions that run past the header's
/// cluster.
pub(super) fn check_header_extensions(file: &File) -> std::result::Result<(), String> {
    use std::os::unix::fs::FileExt;
    let mut fixed = [0u8; 104];
    file.read_exact_at(&mut fixed, 0)
        .map_err(|e| format!("reading the qcow2 header: {e}"))?;
    let be32 = |at: usize| u32::from_be_bytes(fixed[at..at + 4].try_into().expect("4 bytes"));
    if &fixed[..4] != b"QFI\xfb" {
        return Err("not a qcow2 file".into());
    }
    let version = be32(4);
    let cluster_bits = be32(20);
    if !(9..=21).contains(&cluster_bits) {
        return Err(format!("cluster bits {cluster_bits} out of range"));
    }
    let start = match version {
        2 => 72,
        3 => be32(100) as u64,
        other => return Err(format!("qcow2 version {other}")),
    };
    let end = 1u64 << cluster_bits;
    if start > end {
        return Err("the header is longer than its cluster".into());
    }
    let mut area = vec![0u8; (end - start) as usize];
    let read = file
        .read_at(&mut area, start)
        .map_err(|e| format!("reading the header extensions: {e}"))?;
    area.truncate(read);
    let mut at = 0usize;
    while at + 8 <= area.len() {
        let kind = u32::from_be_bytes(area[at..at + 4].try_into().expect("4 bytes"));
        let length = u32::from_be_bytes(area[at + 4..at + 8].try_into().expect("4 bytes")) as usize;
        if kind == 0 {
            return Ok(());
        }
        if kind == FEATURE_NAME_TABLE && !length.is_multiple_of(48) {
            return Err(format!("a feature name table of {length} bytes"));
        }
        at = at
            .checked_add(8 + length.div_ceil(8) * 8)
            .filter(|&next| next <= area.len())
            .ok_or("a header extension runs past the header's cluster")?;
    }
    Ok(())
}

/// Checks that a qcow2 stands alone: it names no backing file (header offset 8) and keeps its
/// data in itself (incompatible feature bit 2, an external data file, clear), and its header
/// extensions are whole (see [`check_header_extensions`]).
pub(super) fn check_standalone_qcow2(file: &File) -> std::result::Result<(), String> {
    use std::os::unix::fs::FileExt;
    check_header_extensions(file)?;
    let mut fixed = [0u8; 80];
    file.read_exact_at(&mut fixed, 0)
        .map_err(|e| format!("reading the qcow2 header: {e}"))?;
    let be64 = |at: usize| u64::from_be_bytes(fixed[at..at + 8].try_into().expect("8 bytes"));
    if be64(8) != 0 {
        return Err("it names a backing file".into());
    }
    let version = u32::from_be_bytes(fixed[4..8].try_into().expect("4 bytes"));
    if version >= 3 && be64(72) & (1 << 2) != 0 {
        return Err("it keeps its data in an external file".into());
    }
    Ok(())
}

/// Reads the record from the qcow2 at `path`.
pub(super) async fn read_record(path: &Path) -> Result<String> {
    let broken = |e: std::io::Error| Error::RootLayer {
        path: path.to_path_buf(),
        reason: format!("not a readable qcow2 layer: {e}"),
    };
    let file = File::open(path).map_err(broken)?;
    check_header_extensions(&file).map_err(|reason| Error::RootLayer {
        path: path.to_path_buf(),
        reason: format!("not a qcow2 layer krunbox made: {reason}"),
    })?;
    drop(file);
    let owned = path.to_path_buf();
    // A deadline: the file may be hostile, and the boot waits on this before its own deadline
    // starts. (The thread is left to finish; reading 1 KiB of a good layer takes milliseconds.)
    let reading = on_imago_thread(move || async move { read_record_with_imago(&owned).await });
    match tokio::time::timeout(RECORD_DEADLINE, reading).await {
        Ok(Ok(result)) => result,
        Ok(Err(reason)) => Err(Error::RootLayer {
            path: path.to_path_buf(),
            reason,
        }),
        Err(_) => Err(Error::RootLayer {
            path: path.to_path_buf(),
            reason: format!("reading its record took more than {RECORD_DEADLINE:?}"),
        }),
    }
}

/// How long reading a layer's record may take.
const RECORD_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// Runs imago's work on a blocking thread with a runtime of its own: imago's futures are not
/// `Send` (so they cannot be part of `Sandbox::boot`'s future, which callers spawn), and a
/// panic inside imago on bytes [`check_header_extensions`] does not foresee becomes an error
/// here instead of unwinding through the caller's boot.
pub(super) async fn on_imago_thread<T, F, Fut>(work: F) -> std::result::Result<T, String>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("starting a runtime for imago: {e}"))?;
        Ok(runtime.block_on(work()))
    })
    .await
    .map_err(|e| format!("imago failed on it: {e}"))?
}

async fn read_record_with_imago(path: &Path) -> Result<String> {
    let broken = |e: std::io::Error| Error::RootLayer {
        path: path.to_path_buf(),
        reason: format!("not a readable qcow2 layer: {e}"),
    };
    // Opened explicitly, and nothing else implicitly: a file naming a backing file or an
    // external data file (no layer of ours does) fails here instead of opening it.
    let storage = ImagoFile::open(StorageOpenOptions::new().filename(path))
        .await
        .map_err(broken)?;
    let qcow2 = Qcow2::<ImagoFile>::builder(storage)
        .write(false)
        .open(DenyImplicitOpenGate::default())
        .await
        .map_err(broken)?;
    let qcow2 = FormatAccess::new(qcow2);
    let mut bytes = vec![0u8; RECORD_BYTES];
    qcow2.read(&mut bytes[..], 0).await.map_err(broken)?;
    parse_record(&bytes).map_err(|reason| Error::RootLayer {
        path: path.to_path_buf(),
        reason,
    })
}

/// Makes the layer at `path`: ext4 in a sparse scratch file beside it, the record, then a
/// qcow2 holding the scratch file's written extents, renamed into place.
async fn create(path: &Path, base_sha256: &str) -> Result<()> {
    let dir = super::dir_of(path);
    if path.file_name().is_none() {
        return Err(Error::InvalidConfig(format!(
            "{} names no file",
            path.display()
        )));
    }
    let scratch = tempfile::Builder::new()
        .prefix(".krunbox-layer-")
        .tempfile_in(dir)
        .map_err(Error::io(format!(
            "making a scratch file in {}",
            dir.display()
        )))?;
    let layer_error = |what: &str| {
        let what = what.to_string();
        move |e: std::io::Error| Error::RootLayer {
            path: path.to_path_buf(),
            reason: format!("{what}: {e}"),
        }
    };
    scratch
        .as_file()
        .set_len(PERSISTENT_LAYER_BYTES)
        .map_err(layer_error("sizing the scratch disk"))?;
    let scratch_path = scratch.path().to_path_buf();
    tokio::task::spawn_blocking(move || format_ext4(&scratch_path, Journal::With))
        .await
        .map_err(|e| Error::WritableLayer(e.to_string()))??;
    std::os::unix::fs::FileExt::write_all_at(scratch.as_file(), &record(base_sha256), 0)
        .map_err(layer_error("writing the layer's record"))?;

    let raw = scratch
        .as_file()
        .try_clone()
        .map_err(layer_error("duplicating the scratch disk's descriptor"))?;
    qcow2_into_place(raw, path)
        .await
        .map_err(layer_error("writing the qcow2 layer"))
}

/// Writes `raw`'s extents into a qcow2 beside `path` and renames it to `path`: the file there
/// is whole or absent.
pub(crate) async fn qcow2_into_place(raw: File, path: &Path) -> std::io::Result<()> {
    let dir = super::dir_of(path);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let new_path = dir.join(format!(".{name}.krunbox-new"));
    let _ = std::fs::remove_file(&new_path);
    let target = new_path.clone();
    let written = on_imago_thread(move || async move { write_qcow2(&target, &raw).await })
        .await
        .map_err(std::io::Error::other)
        .and_then(|written| written);
    if let Err(e) = written {
        let _ = std::fs::remove_file(&new_path);
        return Err(e);
    }
    std::fs::rename(&new_path, path)
}

/// Makes a qcow2 of `raw`'s size at `new_path` holding `raw`'s written extents.
pub(super) async fn write_qcow2(new_path: &Path, raw: &File) -> std::io::Result<()> {
    let size = raw.metadata()?.len();
    ImagoFile::create(
        StorageCreateOptions::new()
            .filename(new_path)
            .overwrite(true),
    )
    .await?;
    let storage = ImagoFile::open(StorageOpenOptions::new().filename(new_path).write(true)).await?;
    Qcow2::<ImagoFile>::create_builder(storage)
        .size(size)
        .create()
        .await?;
    let storage = ImagoFile::open(StorageOpenOptions::new().filename(new_path).write(true)).await?;
    let qcow2 = Qcow2::<ImagoFile>::builder(storage)
        .write(true)
        .open(DenyImplicitOpenGate::default())
        .await?;
    let qcow2 = FormatAccess::new(qcow2);
    copy_written_extents(raw, &qcow2).await?;
    qcow2.flush().await?;
    qcow2.sync().await?;
    Ok(())
}

/// Copies every written extent of the sparse `raw` file (found with `SEEK_DATA`/`SEEK_HOLE`)
/// into `qcow2` at the same offsets: holes stay unallocated there too.
async fn copy_written_extents(raw: &File, qcow2: &FormatAccess<ImagoFile>) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut buffer = vec![0u8; 1 << 20];
    for (start, end) in data_extents(raw)? {
        let mut offset = start;
        while offset < end {
            let n = ((end - offset) as usize).min(buffer.len());
            raw.read_exact_at(&mut buffer[..n], offset)?;
            qcow2.write(&buffer[..n], offset).await?;
            offset += n as u64;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> String {
        "ab".repeat(32)
    }

    #[test]
    fn records_round_trip_and_garbage_is_not_one() {
        assert_eq!(parse_record(&record(&base())).unwrap(), base());
        assert!(parse_record(&[0u8; 1024]).is_err());
        assert!(parse_record(b"krunbox-layer v1\nbase sha256:xyz\n").is_err());
        assert!(parse_record(&[0xff; 1024]).is_err());
    }

    /// A layer is made once, opens again for the same base, refuses another, and a second
    /// open while the first holds it is `RootInUse`.
    #[tokio::test]
    async fn a_layer_is_made_once_locked_and_bound_to_its_base() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("root.qcow2");
        let layer = PersistentLayer::open(&path, &base()).await.unwrap();
        let on_disk = std::fs::metadata(&path).unwrap().len();
        assert!(on_disk < 64 << 20, "a fresh layer takes {on_disk} bytes");
        assert!(matches!(
            PersistentLayer::open(&path, &base()).await,
            Err(Error::RootInUse { .. })
        ));
        drop(layer);
        let again = PersistentLayer::open(&path, &base()).await.unwrap();
        drop(again);
        let other = "cd".repeat(32);
        match PersistentLayer::open(&path, &other).await {
            Err(Error::RootBaseMismatch {
                expected, recorded, ..
            }) => {
                assert_eq!((expected, recorded), (other, base()));
            }
            x => panic!("another base was not refused: {x:?}"),
        }
        // The file is a clean qcow2 by qemu's own checker.
        let check = std::process::Command::new("qemu-img")
            .args(["check", "-f", "qcow2"])
            .arg(&path)
            .output()
            .expect("qemu-img (Debian's qemu-utils; scripts/setup.sh installs it)");
        assert!(
            check.status.success(),
            "{}{}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
        // Nothing but the layer is left in the directory.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["root.qcow2"]);
    }
}
