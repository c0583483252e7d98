//! An image's digest, computed once per state of its file and then relied on: the work a boot
//! does to prove its image is O(1), whatever the image's size.
//!
//! Hashing the 228 MB agent image takes 0.15 s with SHA extensions and over a second without
//! (several whole boots on real hardware), so a digest is computed once and sealed to the
//! state of the inode it was computed for: its device and number, size, and modification and
//! change times. The kernel moves an inode's ctime on every `write`, truncation or attribute
//! change, and no caller without the power to set the system clock can set it back.
//!
//! Not every change shows in the ctime, though: a write through a shared mapping made before
//! the stamp may not move it (tmpfs never notices such writes; ext4 only at writeback), nor may
//! a device node's contents, nor may a filesystem whose times come from a server (NFS, SMB) or
//! a FUSE daemon. So only files for which a changed ctime is the kernel's word are sealed: a
//! regular file on a local filesystem whose times the kernel keeps (ext4, xfs, btrfs, f2fs,
//! bcachefs, zfs, tmpfs, overlayfs), owned by this user and writable by nobody else. Whoever
//! could then change it unseen (a mapping of this user's, the clock set by root) could as well
//! rewrite the seals or the expected digests in this user's cache: a seal is as trustworthy as
//! the cache directory holding it, which also holds the built-in images' recorded digests and
//! the helper's artifacts (docs/security.md). Any other file is hashed on every boot.
//!
//! Seals live in this process (the fast path) and in `seals/` of the library's cache, one
//! small file per inode, so a fresh process boots without hashing either. Anything unexpected
//! in a seal file (a stamp that differs, bytes that do not parse, a file over its bound, not a
//! regular file, a file or a `seals/` directory not this user's or writable by others) means
//! "not sealed": the image is hashed again, never trusted. Snapshot parts' digests are sealed
//! the same way, in `seals/` beside the snapshot key (`snapshot::part`), under names of their
//! own. Seal files are small and never removed (one per sealed inode).
//!
//! fs-verity would let the kernel check every page as the guest reads it, but few filesystems
//! in use have it on; the stamp works on all of the above.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The most images whose digests this process remembers.
const MAX_REMEMBERED_DIGESTS: usize = 64;

/// A seal file's size bound: a line of a few numbers and a digest.
const MAX_SEAL_BYTES: u64 = 512;

/// The first word of a seal file: its format.
const SEAL_FORMAT: &str = "krunbox-seal-1";

/// One state of an inode: device and number, size, and modification and change times
/// (seconds, nanoseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InodeStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl InodeStamp {
    pub(crate) fn of(file: &File) -> std::io::Result<InodeStamp> {
        use std::os::unix::fs::MetadataExt;
        let meta = file.metadata()?;
        Ok(InodeStamp {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        })
    }

    /// The seal file's line for this stamp and `digest`.
    fn line(&self, digest: &str) -> String {
        format!(
            "{SEAL_FORMAT} {} {} {} {}.{} {}.{} {digest}\n",
            self.dev, self.ino, self.size, self.mtime.0, self.mtime.1, self.ctime.0, self.ctime.1
        )
    }

    /// The digest a seal file's `text` records for exactly this stamp, if it does.
    fn sealed_digest(&self, text: &str) -> Option<String> {
        let fields: Vec<&str> = text.strip_suffix('\n')?.split(' ').collect();
        let [format, dev, ino, size, mtime, ctime, digest] = fields[..] else {
            return None;
        };
        let time = |word: &str| -> Option<(i64, i64)> {
            let (seconds, nanos) = word.split_once('.')?;
            Some((seconds.parse().ok()?, nanos.parse().ok()?))
        };
        let recorded = InodeStamp {
            dev: dev.parse().ok()?,
            ino: ino.parse().ok()?,
            size: size.parse().ok()?,
            mtime: time(mtime)?,
            ctime: time(ctime)?,
        };
        let well_formed = format == SEAL_FORMAT
            && digest.len() == 64
            && digest
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        (well_formed && recorded == *self).then(|| digest.to_string())
    }

    /// Whether this state's ctime lies far enough back to be sealed: a filesystem's timestamps
    /// may be as coarse as the kernel's tick, so a write in the same tick as the hash could
    /// leave the ctime it had (git does the same with its index).
    fn settled_before(&self, seconds_since_epoch: i64) -> bool {
        self.ctime.0 < seconds_since_epoch - 2
    }
}

/// Filesystems (`statfs` magic numbers) whose inode times the local kernel keeps: ext2/3/4,
/// xfs, btrfs, f2fs, bcachefs, zfs, tmpfs, overlayfs.
const LOCAL_FILESYSTEMS: [i64; 8] = [
    0xEF53,
    0x5846_5342,
    0x9123_683E,
    0xF2F5_2010,
    0xCA45_1A4E,
    0x2FC1_2FC1,
    0x0102_1994,
    0x794C_7630,
];

/// Whether a changed ctime is the kernel's word for `file`'s changes: a regular file on a
/// local filesystem, owned by this user and writable by nobody else (see the module's
/// documentation).
fn sealable(file: &File) -> bool {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = file.metadata() else {
        return false;
    };
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if !meta.file_type().is_file() || meta.uid() != euid || meta.mode() & 0o022 != 0 {
        return false;
    }
    let mut fs = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: fstatfs fills the struct for an open descriptor of ours, or fails.
    if unsafe { libc::fstatfs(file.as_raw_fd(), fs.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: fstatfs succeeded, so the struct is filled.
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between architectures
    let kind = unsafe { fs.assume_init() }.f_type as i64;
    LOCAL_FILESYSTEMS.contains(&kind)
}

/// What a sealed digest is of: one kind's seal never answers for another (an image's digest
/// is of its whole file, a snapshot part's of its listed extents).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DigestKind {
    /// SHA-256 of the whole file (images).
    WholeFile,
    /// A snapshot part's digest of its extents (`snapshot::part`).
    SnapshotPart,
}

impl DigestKind {
    /// The seal file's name prefix.
    fn prefix(self) -> &'static str {
        match self {
            DigestKind::WholeFile => "",
            DigestKind::SnapshotPart => "part-",
        }
    }
}

/// Digests this process computed, by kind and the stamp of the inode they were computed for.
type Remembered = Vec<(DigestKind, InodeStamp, String)>;
static DIGESTS: std::sync::Mutex<Remembered> = std::sync::Mutex::new(Vec::new());

fn remembered() -> std::sync::MutexGuard<'static, Remembered> {
    DIGESTS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn remember(kind: DigestKind, stamp: InodeStamp, digest: &str) {
    let mut known = remembered();
    known.retain(|(other_kind, other, _)| {
        (*other_kind, other.dev, other.ino) != (kind, stamp.dev, stamp.ino)
    });
    if known.len() >= MAX_REMEMBERED_DIGESTS {
        known.remove(0);
    }
    known.push((kind, stamp, digest.to_string()));
}

/// Forgets what this process remembers of `file`'s inode, as a fresh process would start
/// (tests; only that inode, so that tests beside it keep what they remember).
#[cfg(test)]
pub(crate) fn forget_for_tests(file: &File) {
    let stamp = InodeStamp::of(file).unwrap();
    remembered().retain(|(_, other, _)| (other.dev, other.ino) != (stamp.dev, stamp.ino));
}

/// Where seals are kept: `seals/` in the library's cache directory.
pub(crate) fn seals_dir(cache_dir: &Path) -> PathBuf {
    cache_dir.join("seals")
}

fn seal_path(seals: &Path, kind: DigestKind, stamp: &InodeStamp) -> PathBuf {
    seals.join(format!("{}{}-{}", kind.prefix(), stamp.dev, stamp.ino))
}

/// The digest `seals` holds for `stamp`, if any (anything unexpected reads as none).
fn read_seal(seals: &Path, kind: DigestKind, stamp: &InodeStamp) -> Option<String> {
    use std::os::unix::fs::OpenOptionsExt;
    // Not a FIFO (it would block) nor a link: a regular file of ours, or nothing.
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(seal_path(seals, kind, stamp))
        .ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() || !written_only_by_us(&meta) {
        return None;
    }
    // Its directory too: a seal another user could have put there vouches for nothing.
    let dir = std::fs::metadata(seals).ok()?;
    if !dir.is_dir() || !written_only_by_us(&dir) {
        return None;
    }
    let mut text = String::new();
    file.take(MAX_SEAL_BYTES).read_to_string(&mut text).ok()?;
    stamp.sealed_digest(&text)
}

/// Whether `meta` is this user's and no one else may write it.
fn written_only_by_us(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    meta.uid() == euid && meta.mode() & 0o022 == 0
}

/// Records `digest` for `stamp` in `seals`, replacing the inode's earlier seal at once (a
/// reader sees the old file or the new, never half of one). Best effort: a boot that cannot
/// seal just hashes again next time.
fn write_seal(seals: &Path, kind: DigestKind, stamp: &InodeStamp, digest: &str) {
    let written = (|| -> std::io::Result<()> {
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
            .create(seals)?;
        let mut temp = tempfile::NamedTempFile::new_in(seals)?;
        std::io::Write::write_all(&mut temp, stamp.line(digest).as_bytes())?;
        temp.persist(seal_path(seals, kind, stamp))?;
        Ok(())
    })();
    if let Err(e) = written {
        tracing::debug!(seals = %seals.display(), "could not record a seal: {e}");
    }
}

/// How [`digest_of`] came by a digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Provenance {
    /// Hashed now.
    Hashed,
    /// Remembered by this process for this very state of the file.
    Remembered,
    /// Read from a seal in the cache for this very state of the file.
    Sealed,
}

/// The digest of `kind` this process or a seal in `seals` knows for `file` in its present
/// state, if `file` is [`sealable`] and one does.
pub(crate) fn known_digest(
    file: &File,
    kind: DigestKind,
    seals: Option<&Path>,
) -> Option<(String, Provenance)> {
    if !sealable(file) {
        return None;
    }
    let stamp = InodeStamp::of(file).ok()?;
    let remembered = remembered()
        .iter()
        .find(|(known_kind, known, _)| (*known_kind, *known) == (kind, stamp))
        .map(|(_, _, digest)| digest.clone());
    if let Some(digest) = remembered {
        return Some((digest, Provenance::Remembered));
    }
    let digest = read_seal(seals?, kind, &stamp)?;
    remember(kind, stamp, &digest);
    Some((digest, Provenance::Sealed))
}

/// A hash of `file` about to begin: seals its digest afterwards if the file was sealable, its
/// ctime had settled when the hash began, and nothing changed it meanwhile.
pub(crate) struct Hashing {
    stamp: Option<InodeStamp>,
    now: i64,
}

impl Hashing {
    /// Called before the hash reads anything: a hash can take seconds, and "settled" is
    /// about the state the hash began with.
    pub(crate) fn begin(file: &File) -> Hashing {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_secs() as i64);
        let stamp = sealable(file).then(|| InodeStamp::of(file).ok()).flatten();
        Hashing { stamp, now }
    }

    /// Seals `digest`, the hash's result, if the state allows (see the type).
    pub(crate) fn finish(self, file: &File, kind: DigestKind, seals: Option<&Path>, digest: &str) {
        let Some(stamp) = self.stamp else {
            return;
        };
        if stamp.settled_before(self.now) && InodeStamp::of(file).ok() == Some(stamp) {
            remember(kind, stamp, digest);
            if let Some(seals) = seals {
                write_seal(seals, kind, &stamp, digest);
            }
        }
    }
}

/// Seals `digest` for `file`, which this process has just created (exclusively, 0600, in a
/// directory only this user may enter) and written with exactly the bytes `digest` was
/// computed from. No other writer can have been at work, so the seconds of settling a hash of
/// a file found on disk needs are not needed; what is needed is that a write *after* this
/// returns moves the ctime, which it does not within the same clock tick. So this waits (a
/// few milliseconds at most) for the clock the kernel stamps inodes with to pass the file's
/// ctime, and seals nothing if it does not soon or if the filesystem keeps whole seconds.
/// Only a process of this same user could change the file unseen in that window, and it
/// could as well rewrite the seal (see the module's documentation).
pub(crate) fn seal_own_write(file: &File, kind: DigestKind, seals: Option<&Path>, digest: &str) {
    if !sealable(file) {
        return;
    }
    let Ok(stamp) = InodeStamp::of(file) else {
        return;
    };
    if !clock_passes(stamp.ctime, std::time::Duration::from_millis(50)) {
        return;
    }
    if InodeStamp::of(file).ok() != Some(stamp) {
        return;
    }
    remember(kind, stamp, digest);
    if let Some(seals) = seals {
        write_seal(seals, kind, &stamp, digest);
    }
}

/// Waits up to `deadline` until the coarse real-time clock (what the kernel stamps an
/// inode's ctime from) is past `ctime`. False for a ctime of whole seconds: a filesystem that
/// keeps only seconds gives a write in the same second the same ctime.
fn clock_passes(ctime: (i64, i64), deadline: std::time::Duration) -> bool {
    if ctime.1 == 0 {
        return false;
    }
    let start = std::time::Instant::now();
    loop {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime fills the timespec or fails.
        if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut now) } != 0 {
            return false;
        }
        if (now.tv_sec, now.tv_nsec) > ctime {
            return true;
        }
        if start.elapsed() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// The SHA-256 of the open `file`: hashed, unless this process or a seal in `seals` knows the
/// digest of the same inode in the same state. Only a file [`sealable`] is sealed, and only a
/// state nothing changed while it was hashed, whose ctime had settled before the hash began.
pub(crate) fn digest_of(
    file: &mut File,
    seals: Option<&Path>,
) -> std::io::Result<(String, Provenance)> {
    if let Some(known) = known_digest(file, DigestKind::WholeFile, seals) {
        return Ok(known);
    }
    let hashing = Hashing::begin(file);
    let digest = super::sha256_hex(&mut *file)?;
    hashing.finish(file, DigestKind::WholeFile, seals, &digest);
    Ok((digest, Provenance::Hashed))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forget_all() {
        remembered().clear();
    }

    /// A ctime cannot be set back, so a test waits for its file's to settle.
    fn settle() {
        std::thread::sleep(std::time::Duration::from_millis(3100));
    }

    #[test]
    fn a_digest_is_sealed_only_for_the_same_settled_inode_and_read_back_by_a_fresh_process() {
        let dir = tempfile::tempdir().unwrap();
        let seals = dir.path().join("seals");
        let path = dir.path().join("img");
        std::fs::write(&path, b"abc").unwrap();
        let digest = |path: &Path| digest_of(&mut File::open(path).unwrap(), Some(&seals)).unwrap();
        // Just written: hashed each time (a write in the same tick could keep the ctime).
        assert_eq!(digest(&path).1, Provenance::Hashed);
        assert_eq!(digest(&path).1, Provenance::Hashed);
        settle();
        let (first, how) = digest(&path);
        assert_eq!(how, Provenance::Hashed);
        assert_eq!(digest(&path), (first.clone(), Provenance::Remembered));
        // A fresh process has only the seal on disk.
        forget_all();
        assert_eq!(digest(&path), (first.clone(), Provenance::Sealed));
        // The same bytes written again change the ctime: hashed again, not sealed.
        std::fs::write(&path, b"abc").unwrap();
        forget_all();
        assert_eq!(digest(&path), (first.clone(), Provenance::Hashed));
        // Tampered, with its modification time put back: the ctime still gives it away.
        settle();
        assert_eq!(digest(&path).1, Provenance::Hashed, "sealed again");
        let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
        std::fs::write(&path, b"abd").unwrap();
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        forget_all();
        let (changed, how) = digest(&path);
        assert_eq!(how, Provenance::Hashed);
        assert_ne!(changed, first);
    }

    /// A temporary directory with an image file `img` whose ctime has settled, and the path
    /// its seals go in.
    fn settled_image() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let seals = dir.path().join("seals");
        let path = dir.path().join("img");
        std::fs::write(&path, b"abc").unwrap();
        settle();
        (dir, seals, path)
    }

    #[test]
    fn files_others_may_write_and_non_files_are_hashed_every_time() {
        use std::os::unix::fs::PermissionsExt;
        let (_dir, seals, path) = settled_image();
        let digest = |path: &Path| digest_of(&mut File::open(path).unwrap(), Some(&seals)).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o664)).unwrap();
        settle();
        assert_eq!(digest(&path).1, Provenance::Hashed);
        assert_eq!(
            digest(&path).1,
            Provenance::Hashed,
            "group-writable: never sealed"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        settle();
        assert_eq!(digest(&path).1, Provenance::Hashed);
        assert_eq!(
            digest(&path).1,
            Provenance::Remembered,
            "sealed once only we may write"
        );
        // A FIFO where a seal would be is not read (it would block), nor trusted.
        forget_all();
        let stamp = InodeStamp::of(&File::open(&path).unwrap()).unwrap();
        std::fs::remove_file(seal_path(&seals, DigestKind::WholeFile, &stamp)).unwrap();
        nix::unistd::mkfifo(
            &seal_path(&seals, DigestKind::WholeFile, &stamp),
            nix::sys::stat::Mode::S_IRWXU,
        )
        .unwrap();
        assert_eq!(digest(&path).1, Provenance::Hashed);
    }

    #[test]
    fn a_seal_in_a_directory_or_file_others_may_write_is_not_trusted() {
        use std::os::unix::fs::PermissionsExt;
        let (_dir, seals, path) = settled_image();
        let digest = |path: &Path| digest_of(&mut File::open(path).unwrap(), Some(&seals)).unwrap();
        let forget = || forget_for_tests(&File::open(&path).unwrap());
        assert_eq!(digest(&path).1, Provenance::Hashed);
        forget();
        assert_eq!(digest(&path).1, Provenance::Sealed, "made 0700, trusted");
        let mode = |at: &Path, mode| std::fs::set_permissions(at, PermissionsExt::from_mode(mode));
        mode(&seals, 0o777).unwrap();
        forget();
        assert_eq!(
            digest(&path).1,
            Provenance::Hashed,
            "a directory anyone may write"
        );
        mode(&seals, 0o700).unwrap();
        let stamp = InodeStamp::of(&File::open(&path).unwrap()).unwrap();
        mode(&seal_path(&seals, DigestKind::WholeFile, &stamp), 0o662).unwrap();
        forget();
        assert_eq!(
            digest(&path).1,
            Provenance::Hashed,
            "a seal others may write"
        );
    }

    #[test]
    fn a_seal_file_that_is_damaged_or_for_another_state_is_not_trusted() {
        let stamp = InodeStamp {
            dev: 2049,
            ino: 77,
            size: 3,
            mtime: (1_700_000_000, 5),
            ctime: (1_700_000_001, 999_999_999),
        };
        let digest = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        let line = stamp.line(digest);
        assert_eq!(stamp.sealed_digest(&line).as_deref(), Some(digest));
        let other = InodeStamp {
            ctime: (1_700_000_002, 0),
            ..stamp
        };
        assert_eq!(
            other.sealed_digest(&line),
            None,
            "another state of the inode"
        );
        for damaged in [
            String::new(),
            line.trim_end().to_string(),
            line.replace(SEAL_FORMAT, "krunbox-seal-0"),
            line.replace(digest, &digest.to_uppercase()),
            line.replace(digest, &digest[1..]),
            line.replace(" 77 ", " 77x "),
            line.replace(" 3 ", " -3 "),
            format!("{line}{line}"),
            line.replace(' ', "  "),
        ] {
            assert_eq!(stamp.sealed_digest(&damaged), None, "{damaged:?}");
        }
    }
}
