//! A snapshot's parts on disk: files whose data extents are listed and hashed. Guest memory is
//! mostly holes (a guest touches a fraction of its RAM), so only data is copied, at the same
//! offsets, and only data is hashed. A copy reads exactly the listed extents (what is not
//! listed is zeros), so a byte added or changed anywhere that matters changes the digest; a
//! part mapped whole (a restore's memory) must also hold nothing but zeros outside them
//! ([`check_whole`]).
//!
//! A part's digest is sealed to the state of its file (`rootfs::seal`, as images' are) when
//! this process writes it, and after a restore hashed it: a restore of a part whose file is
//! unchanged since does not read it again (a copy's extents are copied in the kernel).

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::rootfs::seal::{self, DigestKind, Provenance};
use sha2::{Digest, Sha256};

/// Bytes copied and hashed at once.
const CHUNK: usize = 1 << 20;

/// One part of a snapshot, as its manifest lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Part {
    /// The file's name in the snapshot's directory.
    pub name: String,
    /// Its length (what is not in an extent reads as zeros).
    pub length: u64,
    /// Where its data is: `[start, end)` byte ranges, in order, not overlapping.
    pub extents: Vec<(u64, u64)>,
    /// SHA-256 of every extent's start, end (little-endian u64s) and its data's SHA-256, in
    /// order (`PartDigest`).
    pub sha256: String,
}

/// Why a part could not be read back as its manifest says.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PartError {
    /// Its bytes are not the ones the manifest's digest was made from, or its extents are
    /// out of order or out of bounds.
    #[error("{name} is not the part the snapshot was written with: {why}")]
    Tampered { name: String, why: String },
    /// It could not be read.
    #[error("reading {name}: {source}")]
    Io {
        name: String,
        source: std::io::Error,
    },
}

/// Copies `from`'s data into `dir/name` at the same offsets, hashing it; returns the part and
/// the new file (to [`seal`] once the source runs again). Holes stay holes, and so do pages
/// of zeros: a guest's memory holds many it once touched (a fifth of a busybox guest's), which
/// a restore then need not copy.
pub(crate) fn write(from: &File, dir: &Path, name: &str) -> std::io::Result<(Part, File)> {
    let length = from.metadata()?.len();
    let mut to = std::os::unix::fs::OpenOptionsExt::mode(
        File::options().write(true).create_new(true),
        0o600,
    )
    .open(dir.join(name))?;
    to.set_len(length)?;
    let mut digest = PartDigest::default();
    let mut buf = vec![0u8; CHUNK];
    for (start, end) in crate::rootfs::layer::data_extents(from)? {
        let mut at = start;
        while at < end {
            let len = ((end - at) as usize).min(CHUNK);
            from.read_exact_at(&mut buf[..len], at)?;
            for (offset, span, zeros) in spans(&buf[..len]) {
                let span_at = at + offset as u64;
                if zeros {
                    digest.end_extent(span_at);
                } else {
                    digest.data(span_at, span);
                    to.write_all_at(span, span_at)?;
                }
            }
            at += len as u64;
        }
        digest.end_extent(end);
    }
    to.flush()?;
    to.sync_all()?;
    let (extents, sha256) = digest.finish();
    let part = Part {
        name: name.to_owned(),
        length,
        extents,
        sha256,
    };
    Ok((part, to))
}

/// Seals `part`'s digest to `file`, as [`write`] made it, in `seals` (see
/// `rootfs::seal::seal_own_write`; it may wait a clock tick, so not while a VM is stopped).
pub(crate) fn seal(file: &File, part: &Part, seals: &Path) {
    seal::seal_own_write(file, DigestKind::SnapshotPart, Some(seals), &part.sha256);
}

/// The size of the pages a part's zeros are found in.
const PAGE: usize = 4096;

/// `chunk` as runs of whole pages that are all zeros or not: (offset, bytes, all zeros).
fn spans(chunk: &[u8]) -> impl Iterator<Item = (usize, &[u8], bool)> {
    static ZEROS: [u8; PAGE] = [0; PAGE];
    let mut offset = 0;
    std::iter::from_fn(move || {
        if offset >= chunk.len() {
            return None;
        }
        let is_zeros = |at: usize| {
            let page = &chunk[at..(at + PAGE).min(chunk.len())];
            // A slice comparison is a memcmp, fast in unoptimized builds too.
            page == &ZEROS[..page.len()]
        };
        let zeros = is_zeros(offset);
        let start = offset;
        while offset < chunk.len() && is_zeros(offset) == zeros {
            offset = (offset + PAGE).min(chunk.len());
        }
        Some((start, &chunk[start..offset], zeros))
    })
}

/// A part's digest: SHA-256 over each extent's start and end (little-endian `u64`s) and the
/// SHA-256 of its data, in order. Each extent's data is hashed on its own, so an extent's end
/// need not be known before its data is (`write` finds its extents as it reads).
#[derive(Default)]
struct PartDigest {
    whole: Sha256,
    extents: Vec<(u64, u64)>,
    /// The extent being hashed: where it starts and its data's hash so far.
    open: Option<(u64, Sha256)>,
}

impl PartDigest {
    /// `bytes` at `at`: the open extent goes on, or one opens there.
    fn data(&mut self, at: u64, bytes: &[u8]) {
        self.open
            .get_or_insert_with(|| (at, Sha256::new()))
            .1
            .update(bytes);
    }

    /// The open extent, if any, ends at `end`.
    fn end_extent(&mut self, end: u64) {
        if let Some((start, data)) = self.open.take() {
            self.whole.update(start.to_le_bytes());
            self.whole.update(end.to_le_bytes());
            self.whole.update(data.finalize());
            self.extents.push((start, end));
        }
    }

    fn finish(self) -> (Vec<(u64, u64)>, String) {
        debug_assert!(self.open.is_none(), "an extent left open");
        (self.extents, hex::encode(self.whole.finalize()))
    }
}

/// Reads `part` from `dir`, checking its digest; with `into`, copies each extent there at its
/// offset as it is read (so that what was checked is exactly what `into` holds). `into` must
/// be at least `part.length` long and hold zeros where the part has holes. With `seals`, a
/// file whose state a seal there vouches for is not read again (its extents are copied in the
/// kernel), and a file hashed here is sealed for the next time.
pub(crate) fn read(
    dir: &Path,
    part: &Part,
    into: Option<&File>,
    seals: Option<&Path>,
) -> Result<Provenance, PartError> {
    let from = open(dir, part)?;
    check(&from, part, into, seals)
}

/// Checks `from` (`part`, [`open`]ed) for a restore to map as it is (copy-on-write): as [`read`]
/// checks a part and also, since a mapping reads the whole file where a copy reads only the
/// part's extents, that nothing outside them holds anything but zeros.
pub(crate) fn check_whole(from: &File, part: &Part, seals: &Path) -> Result<Provenance, PartError> {
    // Before the hash, which seals what it hashed.
    if !unlisted_data_is_zeros(from, &part.extents).map_err(|e| io_error(part, e))? {
        return Err(PartError::Tampered {
            name: part.name.clone(),
            why: "it holds data outside its extents".into(),
        });
    }
    check(from, part, None, Some(seals))
}

fn io_error(part: &Part, source: std::io::Error) -> PartError {
    PartError::Io {
        name: part.name.clone(),
        source,
    }
}

/// Opens `part` in `dir`, checking that its extents are in order and within it, and its length.
pub(crate) fn open(dir: &Path, part: &Part) -> Result<File, PartError> {
    let tampered = |why: String| PartError::Tampered {
        name: part.name.clone(),
        why,
    };
    let mut last_end = 0u64;
    for &(start, end) in &part.extents {
        if start < last_end || end <= start || end > part.length {
            return Err(tampered(format!(
                "the extent {start}..{end} is out of place"
            )));
        }
        last_end = end;
    }
    let from = File::open(dir.join(&part.name)).map_err(|e| io_error(part, e))?;
    if from.metadata().map_err(|e| io_error(part, e))?.len() != part.length {
        return Err(tampered("its length changed".into()));
    }
    Ok(from)
}

/// Whether every byte of `file` outside `extents` (in order, not overlapping) reads as zero
/// (holes are not read). One pass over the file's data extents and the listed ones together.
fn unlisted_data_is_zeros(file: &File, extents: &[(u64, u64)]) -> std::io::Result<bool> {
    let mut buf = vec![0u8; CHUNK];
    let mut zeros = |from: u64, to: u64| -> std::io::Result<bool> {
        let mut at = from;
        while at < to {
            let len = ((to - at) as usize).min(CHUNK);
            file.read_exact_at(&mut buf[..len], at)?;
            if buf[..len].iter().any(|&b| b != 0) {
                return Ok(false);
            }
            at += len as u64;
        }
        Ok(true)
    };
    let mut listed = extents.iter().copied().peekable();
    for (start, end) in crate::rootfs::layer::data_extents(file)? {
        let mut at = start;
        while at < end {
            // Listed extents wholly before `at` are behind both walks.
            while listed
                .next_if(|&(_, listed_end)| listed_end <= at)
                .is_some()
            {}
            match listed.peek() {
                Some(&(listed_start, listed_end)) if listed_start < end => {
                    if listed_start > at && !zeros(at, listed_start)? {
                        return Ok(false);
                    }
                    at = at.max(listed_end);
                }
                _ => {
                    if !zeros(at, end)? {
                        return Ok(false);
                    }
                    at = end;
                }
            }
        }
    }
    Ok(true)
}

/// [`read`] of the file `from`, opened: `into` gets exactly what was checked.
fn check(
    from: &File,
    part: &Part,
    into: Option<&File>,
    seals: Option<&Path>,
) -> Result<Provenance, PartError> {
    let tampered = |why: String| PartError::Tampered {
        name: part.name.clone(),
        why,
    };
    let io = |source: std::io::Error| io_error(part, source);
    if seals.is_some() {
        let before = seal::InodeStamp::of(from).map_err(io)?;
        let known = seal::known_digest(from, DigestKind::SnapshotPart, seals);
        if let Some((_, how)) = known.filter(|(digest, _)| *digest == part.sha256) {
            if let Some(into) = into {
                super::copy::copy_extents(from, into, &part.extents).map_err(io)?;
            }
            // A write while it was copied moved the ctime: what was copied is not what the
            // seal vouched for.
            if seal::InodeStamp::of(from).map_err(io)? != before {
                return Err(tampered("it changed while it was copied".into()));
            }
            return Ok(how);
        }
    }
    let hashing = seal::Hashing::begin(from);
    let mut digest = PartDigest::default();
    let mut buf = vec![0u8; CHUNK];
    for &(start, end) in &part.extents {
        let mut at = start;
        while at < end {
            let len = ((end - at) as usize).min(CHUNK);
            from.read_exact_at(&mut buf[..len], at).map_err(io)?;
            digest.data(at, &buf[..len]);
            if let Some(into) = into {
                into.write_all_at(&buf[..len], at).map_err(io)?;
            }
            at += len as u64;
        }
        digest.end_extent(end);
    }
    let (_, digest) = digest.finish();
    if digest != part.sha256 {
        return Err(tampered("its digest differs".into()));
    }
    hashing.finish(from, DigestKind::SnapshotPart, seals, &digest);
    Ok(Provenance::Hashed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A memfd-like sparse file: two runs of data among holes.
    fn sparse_source() -> File {
        let file = tempfile::tempfile().unwrap();
        file.set_len(64 << 20).unwrap();
        file.write_all_at(&[7u8; 8192], 1 << 20).unwrap();
        file.write_all_at(b"the end", (64 << 20) - 7).unwrap();
        file
    }

    #[test]
    fn a_sparse_file_round_trips_with_its_holes_and_only_its_data_is_copied() {
        let dir = tempfile::tempdir().unwrap();
        let source = sparse_source();
        let part = write(&source, dir.path(), "memory.img").unwrap().0;
        assert_eq!(part.length, 64 << 20);
        let data: u64 = part.extents.iter().map(|(s, e)| e - s).sum();
        assert!(
            data < 1 << 20,
            "holes were copied as data: {:?}",
            part.extents
        );
        let into = tempfile::tempfile().unwrap();
        into.set_len(part.length).unwrap();
        read(dir.path(), &part, Some(&into), None).unwrap();
        let mut back = vec![0u8; 8192];
        into.read_exact_at(&mut back, 1 << 20).unwrap();
        assert_eq!(back, vec![7u8; 8192]);
        let mut end = [0u8; 7];
        into.read_exact_at(&mut end, (64 << 20) - 7).unwrap();
        assert_eq!(&end, b"the end");
    }

    #[test]
    fn pages_of_zeros_in_the_data_stay_holes_and_read_back_as_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let source = tempfile::tempfile().unwrap();
        source.set_len(1 << 20).unwrap();
        // Data, a written page of zeros, data, then zeros to the end of a 64 KiB run.
        source.write_all_at(&[1u8; PAGE], 0).unwrap();
        source.write_all_at(&[0u8; PAGE], PAGE as u64).unwrap();
        source
            .write_all_at(&[2u8; 100], 2 * PAGE as u64 + 7)
            .unwrap();
        source
            .write_all_at(&[0u8; 16 * PAGE], 3 * PAGE as u64)
            .unwrap();
        let part = write(&source, dir.path(), "memory.img").unwrap().0;
        assert_eq!(
            part.extents,
            vec![(0, PAGE as u64), (2 * PAGE as u64, 3 * PAGE as u64)]
        );
        let into =
            crate::guest_memory::GuestMemoryFile::create(1, crate::guest_memory::LaterSeals::None)
                .unwrap()
                .shared_file();
        read(dir.path(), &part, Some(&*into), None).unwrap();
        let mut back = vec![9u8; 20 * PAGE];
        into.read_exact_at(&mut back, 0).unwrap();
        let mut expected = vec![0u8; 20 * PAGE];
        expected[..PAGE].fill(1);
        expected[2 * PAGE + 7..2 * PAGE + 107].fill(2);
        assert!(back == expected);
    }

    #[test]
    fn data_outside_listed_extents_is_found_wherever_the_two_lists_interleave() {
        let file = tempfile::tempfile().unwrap();
        file.set_len(1 << 20).unwrap();
        // Data in three runs; zeros written in a fourth.
        for at in [0u64, 64 << 10, 512 << 10] {
            file.write_all_at(&[5u8; 8192], at).unwrap();
        }
        file.write_all_at(&[0u8; 8192], 256 << 10).unwrap();
        let all = [
            (0, 8192),
            (64 << 10, (64 << 10) + 8192),
            (512 << 10, (512 << 10) + 8192),
        ];
        assert!(unlisted_data_is_zeros(&file, &all).unwrap());
        // Listed extents that also cover holes, one spanning two runs.
        assert!(
            unlisted_data_is_zeros(&file, &[(0, (64 << 10) + 8192), (500 << 10, 1 << 20)]).unwrap()
        );
        // Each run left out in turn, or cut short by a page.
        for missing in 0..3 {
            let mut some = all.to_vec();
            some.remove(missing);
            assert!(
                !unlisted_data_is_zeros(&file, &some).unwrap(),
                "run {missing} left out"
            );
            let mut short = all.to_vec();
            short[missing].1 -= 4096;
            assert!(
                !unlisted_data_is_zeros(&file, &short).unwrap(),
                "run {missing} cut short"
            );
        }
        assert!(!unlisted_data_is_zeros(&file, &[]).unwrap());
    }

    #[test]
    fn a_part_to_map_whole_is_refused_with_data_outside_its_extents() {
        let dir = tempfile::tempdir().unwrap();
        let seals = dir.path().join("seals");
        let part = write(&sparse_source(), dir.path(), "memory.img").unwrap().0;
        let path = dir.path().join("memory.img");
        let check = || check_whole(&open(dir.path(), &part).unwrap(), &part, &seals);
        check().unwrap();
        // A hole given data: a copy of the extents would never read it, a mapping would.
        let file = File::options().write(true).open(&path).unwrap();
        file.write_all_at(b"planted", 4 << 20).unwrap();
        let err = check().unwrap_err();
        assert!(
            matches!(&err, PartError::Tampered { why, .. } if why.contains("outside")),
            "{err}"
        );
        // Zeros written there are zeros still.
        file.write_all_at(&[0u8; 7], 4 << 20).unwrap();
        check().unwrap();
    }

    #[test]
    fn a_flipped_byte_a_truncation_or_a_moved_extent_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let part = write(&sparse_source(), dir.path(), "memory.img").unwrap().0;
        let path = dir.path().join("memory.img");
        let file = File::options().write(true).open(&path).unwrap();

        file.write_all_at(&[8u8], (1 << 20) + 100).unwrap();
        assert!(matches!(
            read(dir.path(), &part, None, None),
            Err(PartError::Tampered { .. })
        ));
        file.write_all_at(&[7u8], (1 << 20) + 100).unwrap();
        read(dir.path(), &part, None, None).unwrap();

        let mut moved = part.clone();
        moved.extents[0].0 += 4096;
        assert!(matches!(
            read(dir.path(), &moved, None, None),
            Err(PartError::Tampered { .. })
        ));
        let mut overlapping = part.clone();
        overlapping.extents.push((0, 4096));
        assert!(matches!(
            read(dir.path(), &overlapping, None, None),
            Err(PartError::Tampered { .. })
        ));

        file.set_len(part.length - 4096).unwrap();
        assert!(matches!(
            read(dir.path(), &part, None, None),
            Err(PartError::Tampered { .. })
        ));
    }

    #[test]
    fn a_sealed_part_is_copied_unread_until_its_file_changes() {
        let dir = tempfile::tempdir().unwrap();
        let seals = dir.path().join("seals");
        let (part, file) = write(&sparse_source(), dir.path(), "memory.img").unwrap();
        seal(&file, &part, &seals);
        let restore = |part: &Part| {
            let into = crate::guest_memory::GuestMemoryFile::create(
                64,
                crate::guest_memory::LaterSeals::None,
            )
            .unwrap()
            .shared_file();
            let how = read(dir.path(), part, Some(&*into), Some(&seals));
            let mut back = vec![0u8; 8192];
            into.read_exact_at(&mut back, 1 << 20).unwrap();
            (how, back == vec![7u8; 8192])
        };
        // Sealed as written: this process remembers it, a fresh one finds the seal file.
        assert!(matches!(restore(&part), (Ok(Provenance::Remembered), true)));
        crate::rootfs::seal::forget_for_tests(&File::open(dir.path().join("memory.img")).unwrap());
        assert!(matches!(restore(&part), (Ok(Provenance::Sealed), true)));
        // Without seals (`Snapshot::verify`), always hashed.
        assert!(matches!(
            read(dir.path(), &part, None, None),
            Ok(Provenance::Hashed)
        ));
        // A seal vouches for its digest only: a manifest saying another is checked in full.
        let mut other = part.clone();
        other.sha256 = "0".repeat(64);
        assert!(matches!(restore(&other).0, Err(PartError::Tampered { .. })));
        // Any write moves the ctime: the seal no longer applies, the change is found.
        let file = File::options()
            .write(true)
            .open(dir.path().join("memory.img"))
            .unwrap();
        file.write_all_at(&[8u8], (1 << 20) + 100).unwrap();
        assert!(matches!(restore(&part).0, Err(PartError::Tampered { .. })));
        // Changed at once after it was written: still found (the seal waited for the clock
        // that stamps ctimes to move on).
        let (again, again_file) = write(&sparse_source(), dir.path(), "again.img").unwrap();
        seal(&again_file, &again, &seals);
        File::options()
            .write(true)
            .open(dir.path().join("again.img"))
            .unwrap()
            .write_all_at(&[8u8], (1 << 20) + 100)
            .unwrap();
        assert!(matches!(
            read(dir.path(), &again, None, Some(&seals)),
            Err(PartError::Tampered { .. })
        ));
        // Put back, it is hashed (and not sealed: its ctime has not settled).
        file.write_all_at(&[7u8], (1 << 20) + 100).unwrap();
        assert!(matches!(restore(&part), (Ok(Provenance::Hashed), true)));
        assert!(matches!(restore(&part), (Ok(Provenance::Hashed), true)));
    }
}
