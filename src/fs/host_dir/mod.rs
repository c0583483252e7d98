//! `HostDir`: a host directory, served to the guest so that nothing it does reaches outside.
//! The how and why are on [`HostDir`] itself, where the public documentation shows them.

mod mask;
mod overlay;
mod sys;

#[cfg(test)]
mod escape_tests;
#[cfg(test)]
mod mask_tests;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::ffi::{CStr, CString, OsStr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use mask::Mask;
use mask::{Intent, MaskDir, Masks, Place};
use overlay::{host_perm, Overlay, PRIVATE_PREFIX, XATTR};

use super::types::*;
use super::{VirtualFs, WriteData};
use crate::budget::Descriptor;

/// The most inodes the guest can hold at once (each is an open `O_PATH` descriptor of the
/// host process): past that, a lookup fails with `ENFILE` until the guest forgets some.
const MAX_INODES: usize = 65_536;

/// The most files and directories the guest can have open at once (`EMFILE` past that).
const MAX_HANDLES: usize = 16_384;

/// The most bytes one read or write moves.
const MAX_IO: usize = 4 << 20;

/// Reads up to this size are made on the calling task's thread; larger ones on tokio's
/// blocking pool (see `HostDir::run`).
const INLINE_IO: usize = 64 << 10;

/// Entries returned by one `readdir` call (the guest asks again from the last one).
const READDIR_CHUNK: usize = 512;

/// The most in-memory ownership records kept for inodes the guest has forgotten.
const MAX_VOLATILE: usize = 65_536;

/// The most host records remembered, with the ctime they were read at, for inodes the guest
/// has forgotten (see `Table::known`).
const MAX_KNOWN: usize = 65_536;

/// Inode numbers from here on are HostDir's own (inodes on another device than the root's);
/// below, they are host inode numbers.
const FOREIGN_BASE: u64 = 1 << 62;

/// A masked directory's source entries not to list: its masked names, and the inodes they
/// name (found by the filesystem's own lookup, which may fold case).
struct Hidden<'a> {
    mask: &'a MaskDir,
    inodes: Vec<(u64, u64)>,
}

impl Hidden<'_> {
    fn has_inode(&self, ino: u64) -> bool {
        self.inodes.iter().any(|&(_, hidden)| hidden == ino)
    }
}

/// Listing offsets from here on are a masked directory's entries from its mask's storage,
/// listed after the source's (`readdir`): above every host cookie, which is an `off_t`.
const STORED_BASE: u64 = 1 << 63;

/// Longest symlink target.
const PATH_MAX: usize = libc::PATH_MAX as usize;

/// A host directory as a [`VirtualFs`], read-write or read-only, that nothing the guest does
/// can escape.
///
/// Cloning is cheap and shares the directory's state (its inode table and open files).
///
/// # How it stays inside
///
/// - The root is held as an `O_PATH` descriptor, and so is every inode the guest has looked up
///   (the inode table: [`InodeId`] → descriptor). Nothing is ever named by a path: each name
///   the guest gives is one component, resolved by the kernel relative to its parent's
///   descriptor with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
///   RESOLVE_NO_XDEV)` and `O_NOFOLLOW`: `..` cannot climb, a symlink (absolute, relative, or
///   a magic link like `/proc/self/root`) is never followed on the host (a lookup returns the
///   symlink itself, whose target the guest kernel resolves in the guest's own view, where
///   `..` at the mount's root stays there), and no mount point inside is crossed (`EXDEV`).
/// - An inode the guest holds stays that inode whatever happens to names: its directory
///   renamed away and a symlink to the outside put in its place, a create through the old
///   inode still lands in the renamed directory, inside.
/// - Operations on an inode use its descriptor (`fstat`, `fchmodat2`/`utimensat`/`linkat` with
///   an empty path, `readlinkat`); opening a regular file for I/O goes through the descriptor's
///   own `/proc/self/fd` entry, a magic link to the pinned file rather than a name (see
///   `ProcFd` in `host_dir/sys.rs` for why that cannot be swapped). Device nodes are never
///   opened (`EACCES`) nor created (`EPERM`); one the host placed inside is shown with its
///   kind and number. Fifos and sockets are created as plain directory entries.
/// - `link` takes only inodes of the table, all reached beneath the root: the guest cannot give
///   an outside file a name inside. A hard link the host itself placed inside, to a file that
///   also has a name outside, is that file (its contents are reachable): that is the host's
///   choice, as with any file it puts there.
/// - The host never gets a setuid or setgid bit from the guest (a guest must not plant a
///   setuid binary for the host's users), and opening a host file with those bits for writing
///   first clears them on the host, as the kernel does for an unprivileged writer. The host is
///   never chowned.
///
/// # Ownership and modes
///
/// The guest sees the host's owner, group and mode, except where it changed them: a `chown`,
/// a `chmod` to a mode the host does not get verbatim (setuid/setgid bits, or a mode without
/// the owner's read/write, which the host keeps so that its process can go on serving the
/// file), or a file created by a guest user other than the host process's. Those are recorded
/// in the extended attribute `user.krunbox.stat` (`host_dir/overlay.rs`), hidden from the guest,
/// together with the host's owner and mode they were made against: if the host changes either
/// behind the guest's back, the host's value shows again. Linux allows `user.` attributes only
/// on regular files and directories, so for symlinks, fifos and sockets (and on a host
/// filesystem without user attributes) the record lives in memory for this `HostDir`'s life
/// (at most 65,536 inodes once the guest forgets them). A record read from the host is
/// remembered with the inode's ctime when the guest forgets the inode (at most 65,536), and
/// taken again while the ctime is unchanged (any change of an attribute changes it), so a
/// lookup of the same file again costs no read of the attribute; on a filesystem that said
/// it keeps no user attributes none is read again.
///
/// # Inode numbers
///
/// An inode on the root's filesystem is numbered with its host inode number (stable while the
/// host file lives, so `ls -i` and git's index agree across lookups); the root is
/// [`InodeId::ROOT`]; inodes on another device (btrfs subvolumes, overlayfs layers) are
/// numbered from 2^62 while the guest holds them.
///
/// # Threads
///
/// Calls that only look or make a name (lookup, getattr, readlink, statfs, extended
/// attributes, opening without truncating, mkdir, symlink, link, mknod, a chmod, chown or
/// utimes) and reads of up to 64 KiB are made on the calling task's thread: on a local
/// filesystem they take microseconds, less than the hop to tokio's blocking pool and back,
/// which was a third of a cold `stat`'s cost. Writes are made where the runtime's other tasks
/// cannot wait on them (the host's dirty-page throttling can hold a writer): on a
/// multi-threaded runtime in [`tokio::task::block_in_place`], a write of up to 64 KiB in the
/// calling task, a larger one in a task of its own; elsewhere on the blocking pool. What
/// frees data, or may wait on it, goes to the blocking pool: truncation, unlink, rmdir,
/// rename, `fsync`, `fallocate`, directory listings, larger reads; a file is closed there too,
/// without waiting (its last close may free it). A
/// directory on a filesystem whose every call can stall (a network filesystem) holds up the
/// runtime thread that serves its mount meanwhile; serve such a directory through a
/// [`VirtualFs`] of your own that makes its calls on the blocking pool.
///
/// # Limits
///
/// At most 65,536 inodes held by the guest at once (each an `O_PATH` descriptor of the host
/// process, so the process's `RLIMIT_NOFILE` must allow them; past either limit a lookup fails
/// with `ENFILE`/`EMFILE` until the guest forgets some), 16,384 open files and directories
/// (`EMFILE`; an open directory holds a descriptor and no listing: it is read a batch at a
/// time), 4 MiB per read or write.
///
/// # Example
///
/// ```
/// use krunbox::fs::{HostDir, InodeId, OpenFlags, VirtualFs};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let dir = tempfile::tempdir()?;
/// std::fs::write(dir.path().join("notes.txt"), b"hello")?;
///
/// let fs = HostDir::new(dir.path())?;
/// let entry = fs.lookup(InodeId::ROOT, "notes.txt".as_ref()).await?;
/// let handle = fs.open(entry.attr.ino, OpenFlags(libc::O_RDONLY)).await?;
/// assert_eq!(fs.read(entry.attr.ino, handle, 0, 100).await?, b"hello");
/// fs.release(entry.attr.ino, handle).await?;
///
/// // `..` is not a name.
/// assert!(fs.lookup(InodeId::ROOT, "..".as_ref()).await.is_err());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct HostDir {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    read_only: bool,
    proc: sys::ProcFd,
    root: Arc<Node>,
    /// `(st_dev, st_ino)` of the root.
    root_key: (u64, u64),
    table: Mutex<Table>,
    handles: Mutex<Handles>,
    limits: Limits,
    /// Paths hidden from the guest, or served from storage (`mask.rs`).
    masks: Option<Masks>,
}

#[derive(Debug, Clone, Copy)]
struct Limits {
    inodes: usize,
    handles: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            inodes: MAX_INODES,
            handles: MAX_HANDLES,
        }
    }
}

/// One inode the guest holds.
struct Node {
    id: InodeId,
    /// `O_PATH` (and for a symlink `O_NOFOLLOW`): pins the inode, opens nothing.
    fd: OwnedFd,
    key: (u64, u64),
    kind: FileKind,
    overlay: Mutex<OverlayState>,
    /// For a directory on the way to masked paths, found by their names: its branch of them.
    mask: OnceLock<Arc<MaskDir>>,
    /// `fd`'s charge to the budget of the sandbox that looked it up (none for the root, or
    /// outside a sandbox).
    _charge: Option<Descriptor>,
}

/// A node's ownership record and whether the host's attribute holds it.
#[derive(Debug, Clone, Copy, Default)]
struct OverlayState {
    record: Option<Overlay>,
    persisted: bool,
    /// The record is the host's as of this ctime of the inode (seconds, nanoseconds): it was
    /// read then. Changing an extended attribute changes the ctime, so while the ctime is the
    /// same the record is too.
    read_at: Option<Ctime>,
}

#[derive(Default)]
struct Table {
    /// Live inodes (the root is not here) and the guest's reference counts.
    nodes: HashMap<InodeId, (Arc<Node>, u64)>,
    /// Numbers of live inodes on another device than the root's.
    foreign: HashMap<(u64, u64), InodeId>,
    next_foreign: u64,
    /// Records that live only in memory, of inodes the guest forgot.
    volatile: HashMap<(u64, u64), Overlay>,
    /// Host records (or their absence) of inodes the guest forgot, with the ctime they were
    /// read at: a lookup of the same inode with the same ctime takes it instead of reading
    /// the attribute again (two system calls and an open of the file, a third of a cold
    /// lookup's cost). At most [`MAX_KNOWN`].
    known: HashMap<(u64, u64), (Ctime, Option<Overlay>)>,
    /// Devices whose filesystem keeps no user extended attributes (a read said
    /// `EOPNOTSUPP`): no record is read there.
    without_xattrs: std::collections::HashSet<u64>,
}

enum Handle {
    File(Arc<OpenFile>),
    Dir(Arc<OpenDir>),
}

struct OpenFile {
    node: Arc<Node>,
    fd: OwnedFd,
    write: bool,
    /// `fd`'s charge to the sandbox's budget.
    _charge: Option<Descriptor>,
}

/// A directory the guest has open: read by the host's own cursor, a batch per `readdir`, so
/// what it costs the host is one descriptor whatever the directory holds (issue 33: a listing
/// was kept whole per handle, 16,384 handles of a million entries each).
struct OpenDir {
    node: Arc<Node>,
    /// `O_RDONLY` on the directory; a `readdir` at a time (it sets the position, then reads).
    fd: Mutex<OwnedFd>,
    /// `fd`'s charge to the sandbox's budget.
    _charge: Option<Descriptor>,
}

#[derive(Default)]
struct Handles {
    map: HashMap<u64, Handle>,
    next: u64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere never leaves these maps half-changed: keep serving.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn errno(errno: i32) -> FsError {
    FsError::from_errno(errno)
}

/// Charges a descriptor the host is about to hold for the guest to the calling sandbox's
/// budget (see `crate::budget`): `ENFILE` past its share of the process's descriptors.
fn charge() -> FsResult<Option<Descriptor>> {
    crate::budget::charge_current().map_err(|()| errno(libc::ENFILE))
}

/// The inode the guest named does not exist (any more) here.
const STALE: i32 = libc::ESTALE;

impl HostDir {
    /// Serves the directory `path` read-write. The path itself is the host's choice and is
    /// opened as given (symlinks in it followed); nothing below it is ever named by a path.
    ///
    /// Fails if `path` is not a directory, or if `/proc/self/fd` is not procfs (needed to
    /// open files for I/O: see "How it stays inside" above). Raises the process's soft
    /// descriptor limit (`RLIMIT_NOFILE`) towards its hard one when it is below what a full
    /// inode table needs (see "Limits").
    ///
    /// ```
    /// use krunbox::fs::HostDir;
    ///
    /// let dir = tempfile::tempdir().unwrap();
    /// let fs = HostDir::new(dir.path()).unwrap();
    /// assert!(!fs.is_read_only());
    /// assert!(HostDir::new(dir.path().join("missing")).is_err());
    /// ```
    pub fn new(path: impl AsRef<Path>) -> FsResult<Self> {
        Self::open(path.as_ref(), false, Limits::default())
    }

    /// Serves the directory `path` read-only: every change fails with `EROFS`, whatever the
    /// mount's options say, and files are opened for reading only.
    ///
    /// ```
    /// use krunbox::fs::{FsError, HostDir, InodeId, VirtualFs};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let dir = tempfile::tempdir()?;
    /// let fs = HostDir::read_only(dir.path())?;
    /// assert!(fs.is_read_only());
    /// let caller = Default::default();
    /// let made = fs.mkdir(InodeId::ROOT, "new".as_ref(), 0o755, caller).await;
    /// assert_eq!(made.unwrap_err(), FsError::READ_ONLY);
    /// # Ok(()) }
    /// ```
    pub fn read_only(path: impl AsRef<Path>) -> FsResult<Self> {
        Self::open(path.as_ref(), true, Limits::default())
    }

    /// The same directory served with `mask`: its paths hidden from the guest, or served from
    /// the mask's storage (see [`Mask`]). Returns a new `HostDir` (the directory opened again,
    /// sharing nothing with `self`); give it to a sandbox before the guest uses it.
    ///
    /// Fails with [`Error::InvalidConfig`](crate::Error::InvalidConfig) for a path that is not
    /// a plain relative one, or a storage directory the guest could reach through the served
    /// one too (inside it but under no masked path, or holding it).
    ///
    /// ```
    /// use krunbox::fs::{FsError, HostDir, InodeId, Mask, VirtualFs};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let project = tempfile::tempdir()?;
    /// std::fs::create_dir(project.path().join(".git"))?;
    /// std::fs::write(project.path().join("main.rs"), "fn main() {}")?;
    ///
    /// let fs = HostDir::read_only(project.path())?.with_mask(Mask::hide([".git"]))?;
    /// assert!(fs.lookup(InodeId::ROOT, "main.rs".as_ref()).await.is_ok());
    /// let git = fs.lookup(InodeId::ROOT, ".git".as_ref()).await;
    /// assert_eq!(git.unwrap_err(), FsError::NOT_FOUND);
    /// # Ok(()) }
    /// ```
    pub fn with_mask(&self, mask: Mask) -> crate::Result<Self> {
        let inner = &self.inner;
        let masks = Masks::open(&mask, &inner.path).map_err(crate::Error::InvalidConfig)?;
        Self::open_with(&inner.path, inner.read_only, inner.limits, Some(masks)).map_err(|err| {
            crate::Error::Io {
                context: format!("opening {} again", inner.path.display()),
                source: std::io::Error::from_raw_os_error(err.errno()),
            }
        })
    }

    /// Whether this is served read-only ([`read_only`](Self::read_only)).
    ///
    /// ```
    /// use krunbox::fs::HostDir;
    ///
    /// let dir = tempfile::tempdir().unwrap();
    /// assert!(HostDir::read_only(dir.path()).unwrap().is_read_only());
    /// ```
    pub fn is_read_only(&self) -> bool {
        self.inner.read_only
    }

    fn open(path: &Path, read_only: bool, limits: Limits) -> FsResult<Self> {
        Self::open_with(path, read_only, limits, None)
    }

    fn open_with(
        path: &Path,
        read_only: bool,
        limits: Limits,
        masks: Option<Masks>,
    ) -> FsResult<Self> {
        crate::budget::raise_descriptor_limit();
        let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| FsError::INVALID)?;
        // SAFETY: NUL-terminated path; we own the descriptor on success.
        let fd = unsafe {
            libc::open(
                c_path.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: a new descriptor, ours.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let proc = sys::ProcFd::open().map_err(|err| {
            tracing::warn!(target: "krunbox::fs", %err, "HostDir needs procfs at /proc");
            FsError::from(err)
        })?;
        let st = sys::fstat(fd.as_fd())?;
        let root_key = (st.st_dev, st.st_ino);
        let (overlay, _) = load_overlay(&proc, fd.as_fd(), FileKind::Directory, ctime(&st));
        let root = Arc::new(Node {
            id: InodeId::ROOT,
            fd,
            key: root_key,
            kind: FileKind::Directory,
            overlay: Mutex::new(overlay),
            mask: match &masks {
                Some(masks) => OnceLock::from(masks.root.clone()),
                None => OnceLock::new(),
            },
            _charge: None,
        });
        Ok(HostDir {
            inner: Arc::new(Inner {
                path: path.to_path_buf(),
                read_only,
                proc,
                root,
                root_key,
                table: Mutex::new(Table {
                    next_foreign: FOREIGN_BASE,
                    ..Table::default()
                }),
                handles: Mutex::new(Handles {
                    next: 1,
                    ..Handles::default()
                }),
                limits,
                masks,
            }),
        })
    }

    /// Runs `op` here, on the calling task's thread. A metadata call or a read of up to
    /// [`INLINE_IO`] on a local filesystem takes microseconds, less than the hop to tokio's
    /// blocking pool and back (two thread wake-ups), which was a third of a cold `stat`'s cost
    /// and a fifth of a small read's (docs/architecture.md, "Workspaces"); nginx serves files
    /// from its event loop the same way. What can take long goes to [`run_blocking`] (see
    /// "Threads" on [`HostDir`]).
    ///
    /// [`run_blocking`]: Self::run_blocking
    async fn run<T: Send + 'static>(
        &self,
        op: impl FnOnce(&Inner) -> FsResult<T> + Send + 'static,
    ) -> FsResult<T> {
        op(&self.inner)
    }

    /// Runs `op` on tokio's blocking pool: for calls that can take long however local the
    /// filesystem is (writes, what frees blocks, `fsync`, `fallocate`, a directory listed
    /// whole, a read of more than [`INLINE_IO`]).
    async fn run_blocking<T: Send + 'static>(
        &self,
        op: impl FnOnce(&Inner) -> FsResult<T> + Send + 'static,
    ) -> FsResult<T> {
        let inner = self.inner.clone();
        // A thread of the pool counts against the calling sandbox's share until it returns,
        // and what the call opens is charged to that sandbox too.
        let budget = crate::budget::current();
        let permit = match &budget {
            Some(budget) => Some(budget.blocking().await),
            None => None,
        };
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            crate::budget::sync_scope(budget, || op(&inner))
        })
        .await
        .unwrap_or_else(|_| Err(FsError::IO))
    }

    /// [`run_blocking`](Self::run_blocking) when `blocking`, else [`run`](Self::run).
    async fn run_where<T: Send + 'static>(
        &self,
        blocking: bool,
        op: impl FnOnce(&Inner) -> FsResult<T> + Send + 'static,
    ) -> FsResult<T> {
        if blocking {
            self.run_blocking(op).await
        } else {
            self.run(op).await
        }
    }
}

impl std::fmt::Debug for HostDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostDir")
            .field("path", &self.inner.path)
            .field("read_only", &self.inner.read_only)
            .finish_non_exhaustive()
    }
}

/// A name the guest gave: one component, checked again here whatever the caller checked.
fn component(name: &OsStr) -> FsResult<CString> {
    let bytes = name.as_bytes();
    if bytes.len() > 255 {
        return Err(FsError::NAME_TOO_LONG);
    }
    if bytes.is_empty() || bytes == b"." || bytes == b".." || bytes.contains(&b'/') {
        return Err(FsError::INVALID);
    }
    CString::new(bytes).map_err(|_| FsError::INVALID)
}

fn kind_of(mode: u32) -> FsResult<FileKind> {
    FileKind::from_mode(mode).ok_or(FsError::IO)
}

fn system_time(secs: i64, nanos: i64) -> SystemTime {
    let nanos = nanos.clamp(0, 999_999_999) as u32;
    if secs >= 0 {
        UNIX_EPOCH + Duration::new(secs as u64, nanos)
    } else {
        UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs()) + Duration::from_nanos(nanos.into())
    }
}

fn timespec(time: Option<TimeOrNow>) -> libc::timespec {
    let (tv_sec, tv_nsec) = match time {
        None => (0, libc::UTIME_OMIT),
        Some(TimeOrNow::Now) => (0, libc::UTIME_NOW),
        Some(TimeOrNow::At(at)) => match at.duration_since(UNIX_EPOCH) {
            Ok(after) => (after.as_secs() as i64, after.subsec_nanos() as i64),
            Err(before) => {
                let before = before.duration();
                let secs = before.as_secs() as i64;
                match before.subsec_nanos() {
                    0 => (-secs, 0),
                    nanos => (-secs - 1, 1_000_000_000 - nanos as i64),
                }
            }
        },
    };
    libc::timespec { tv_sec, tv_nsec }
}

/// Reads an inode's ownership record from the host (regular files and directories only).
/// Closes waiting on tokio's blocking pool; past [`MAX_CLOSING`] a close is made in place,
/// so descriptors cannot pile up behind a busy pool.
static CLOSING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The most closes left waiting on the blocking pool at once.
const MAX_CLOSING: usize = 1024;

/// Drops `held` (and so closes what it holds, when it is the last holder) on tokio's blocking
/// pool without waiting for it: the last close of an unlinked file frees its blocks, and a
/// network filesystem flushes on close. In place outside a runtime or past [`MAX_CLOSING`].
fn close_later<T: Send + 'static>(held: T) {
    use std::sync::atomic::Ordering;
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    if CLOSING.fetch_add(1, Ordering::Relaxed) >= MAX_CLOSING {
        CLOSING.fetch_sub(1, Ordering::Relaxed);
        return;
    }
    runtime.spawn_blocking(move || {
        drop(held);
        CLOSING.fetch_sub(1, Ordering::Relaxed);
    });
}

/// Inserts into a map that holds at most `max` entries, letting an arbitrary one go when full.
fn insert_bounded<V>(map: &mut HashMap<(u64, u64), V>, max: usize, key: (u64, u64), value: V) {
    if map.len() >= max {
        if let Some(&old) = map.keys().next() {
            map.remove(&old);
        }
    }
    map.insert(key, value);
}

/// An inode's ctime: (seconds, nanoseconds).
type Ctime = (i64, i64);

/// The ctime of `st`.
fn ctime(st: &libc::stat) -> Ctime {
    (st.st_ctime, st.st_ctime_nsec)
}

/// Reads the host's record of the inode `fd`, whose ctime was `ctime` before the read; and
/// whether its filesystem keeps no user extended attributes at all (`EOPNOTSUPP`: tmpfs
/// before Linux 6.6, some network filesystems).
fn load_overlay(
    proc: &sys::ProcFd,
    fd: BorrowedFd<'_>,
    kind: FileKind,
    ctime: Ctime,
) -> (OverlayState, bool) {
    let io = match kind {
        FileKind::File => proc.reopen(fd, libc::O_RDONLY | libc::O_NONBLOCK),
        FileKind::Directory => sys::open_dir(fd),
        _ => return (OverlayState::default(), false),
    };
    let value = io.ok().map(|io| sys::fgetxattr(io.as_fd(), XATTR));
    // Remembered across forgets only when the host said for certain: a record, or none.
    let (record, certain, unsupported) = match value {
        Some(Ok(value)) => (Overlay::decode(&value), true, false),
        Some(Err(err)) => match err.raw_os_error() {
            Some(libc::ENODATA) => (None, true, false),
            Some(libc::EOPNOTSUPP) => (None, true, true),
            _ => (None, false, false),
        },
        None => (None, false, false),
    };
    let state = OverlayState {
        record,
        persisted: true,
        read_at: (certain && settled(ctime)).then_some(ctime),
    };
    (state, unsupported)
}

/// Whether a ctime lies far enough back that a change made now would show as another ctime.
/// A filesystem's timestamps may be as coarse as the kernel's clock tick (before Linux 6.13's
/// fine-grained ones), so a change in the same tick as the read would keep the ctime the
/// read saw: as git does with its index, what changed in the last two seconds is not taken
/// for settled.
fn settled(ctime: Ctime) -> bool {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    let read = unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut now) };
    read == 0 && ctime.0 < now.tv_sec - 2
}

/// Extended attribute names the guest may use: `user.*`, other than HostDir's own.
fn xattr_name(name: &OsStr, write: bool) -> FsResult<CString> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() > 255 {
        return Err(FsError::RANGE);
    }
    if !bytes.starts_with(b"user.") {
        // security.*, trusted.*, system.posix_acl_* would change host permissions or
        // capabilities: not offered.
        return Err(FsError::NOT_SUPPORTED);
    }
    if bytes.starts_with(PRIVATE_PREFIX) {
        return Err(if write {
            FsError::NOT_PERMITTED
        } else {
            FsError::NO_DATA
        });
    }
    CString::new(bytes).map_err(|_| FsError::INVALID)
}

impl Inner {
    /// Fails early, before anything is made on the host, when a new inode could not be held.
    fn room_for_inode(&self) -> FsResult<()> {
        if lock(&self.table).nodes.len() >= self.limits.inodes {
            return Err(errno(libc::ENFILE));
        }
        Ok(())
    }

    fn writable(&self) -> FsResult<()> {
        if self.read_only {
            Err(FsError::READ_ONLY)
        } else {
            Ok(())
        }
    }

    fn node(&self, id: InodeId) -> FsResult<Arc<Node>> {
        if id == InodeId::ROOT {
            return Ok(self.root.clone());
        }
        lock(&self.table)
            .nodes
            .get(&id)
            .map(|(node, _)| node.clone())
            .ok_or(errno(STALE))
    }

    fn dir(&self, id: InodeId) -> FsResult<Arc<Node>> {
        let node = self.node(id)?;
        if node.kind != FileKind::Directory {
            return Err(FsError::NOT_DIRECTORY);
        }
        Ok(node)
    }

    /// The number an inode gets without allocating one (the root, or a host inode number).
    fn direct_id(&self, key: (u64, u64)) -> Option<InodeId> {
        if key == self.root_key {
            return Some(InodeId::ROOT);
        }
        (key.0 == self.root_key.0 && key.1 > 1 && key.1 < FOREIGN_BASE).then_some(InodeId(key.1))
    }

    /// The number a directory listing shows for a host inode number.
    fn listed_id(&self, ino: u64) -> InodeId {
        if ino == self.root_key.1 {
            InodeId::ROOT
        } else if ino == 0 {
            InodeId(FOREIGN_BASE - 1)
        } else {
            InodeId(ino)
        }
    }

    /// The live node of `key` with one more guest reference, if there is one.
    fn bump(&self, table: &mut Table, key: (u64, u64)) -> Option<Arc<Node>> {
        let id = self
            .direct_id(key)
            .or_else(|| table.foreign.get(&key).copied())?;
        if id == InodeId::ROOT {
            return Some(self.root.clone());
        }
        let (node, refs) = table.nodes.get_mut(&id)?;
        *refs += 1;
        Some(node.clone())
    }

    /// Counts one guest reference to the inode `fd` (a new `O_PATH` descriptor, `st` its
    /// metadata) refers to and returns its node: the live one if the guest holds the inode
    /// already (`fd` is then closed), else a new one. `fresh` is a record just written (for an
    /// inode just created); otherwise a new node's record is read from the host.
    /// `place` is where it was found: a directory on the way to masked paths is given its
    /// branch before anything else can reach it (the guest knows inode numbers from listings,
    /// and may name the inode in a request while this lookup is still running).
    fn remember(
        &self,
        fd: OwnedFd,
        st: &libc::stat,
        fresh: Option<OverlayState>,
        place: &Place,
    ) -> FsResult<Arc<Node>> {
        let key = (st.st_dev, st.st_ino);
        let kind = kind_of(st.st_mode)?;
        let mask = match (place.leads_on(), kind) {
            (Some(mask), FileKind::Directory) => Some(mask.clone()),
            _ => None,
        };
        {
            let mut table = lock(&self.table);
            if let Some(node) = self.bump(&mut table, key) {
                if let Some(mask) = &mask {
                    let _ = node.mask.set(mask.clone());
                }
                if let Some(fresh) = fresh {
                    *lock(&node.overlay) = fresh;
                }
                return Ok(node);
            }
            if table.nodes.len() >= self.limits.inodes {
                return Err(errno(libc::ENFILE));
            }
        }
        let made = fresh.is_some();
        let mut overlay = match fresh {
            Some(fresh) => fresh,
            None => {
                let (known, without_records) = {
                    let mut table = lock(&self.table);
                    let known = table.known.remove(&key);
                    (known, table.without_xattrs.contains(&st.st_dev))
                };
                match known {
                    Some((read_at, record)) if read_at == ctime(st) => OverlayState {
                        record,
                        persisted: true,
                        read_at: Some(read_at),
                    },
                    // Nothing to read on a filesystem that keeps no records.
                    _ if without_records => OverlayState {
                        record: None,
                        persisted: true,
                        read_at: None,
                    },
                    _ => {
                        let (state, unsupported) =
                            load_overlay(&self.proc, fd.as_fd(), kind, ctime(st));
                        if unsupported {
                            lock(&self.table).without_xattrs.insert(st.st_dev);
                        }
                        state
                    }
                }
            }
        };
        let mut table = lock(&self.table);
        if let Some(node) = self.bump(&mut table, key) {
            // Another lookup of the same inode won the race.
            if let Some(mask) = &mask {
                let _ = node.mask.set(mask.clone());
            }
            return Ok(node);
        }
        if table.nodes.len() >= self.limits.inodes {
            return Err(errno(libc::ENFILE));
        }
        // A record kept in memory for a forgotten inode; one just made replaces it (the
        // inode number of a deleted file reused).
        if let Some(record) = table.volatile.remove(&key) {
            if overlay.record.is_none() && !made {
                overlay = OverlayState {
                    record: Some(record),
                    persisted: false,
                    read_at: None,
                };
            }
        }
        let id = match self.direct_id(key) {
            Some(id) => id,
            None => {
                let id = InodeId(table.next_foreign);
                table.next_foreign += 1;
                table.foreign.insert(key, id);
                id
            }
        };
        let node = Arc::new(Node {
            id,
            fd,
            key,
            kind,
            overlay: Mutex::new(overlay),
            // Set once, here or above, under the table's lock: a directory has one name, and
            // one on the way to masks cannot be renamed (see `rename`).
            mask: mask.map_or_else(OnceLock::new, OnceLock::from),
            _charge: charge()?,
        });
        table.nodes.insert(id, (node.clone(), 1));
        Ok(node)
    }

    fn forget(&self, id: InodeId, count: u64) {
        if id == InodeId::ROOT {
            return;
        }
        let gone = {
            let mut table = lock(&self.table);
            let Some((_, refs)) = table.nodes.get_mut(&id) else {
                return;
            };
            *refs = refs.saturating_sub(count);
            if *refs > 0 {
                return;
            }
            let (node, _) = table.nodes.remove(&id).expect("present");
            table.foreign.remove(&node.key);
            let state = *lock(&node.overlay);
            if let (true, Some(read_at)) = (state.persisted, state.read_at) {
                insert_bounded(
                    &mut table.known,
                    MAX_KNOWN,
                    node.key,
                    (read_at, state.record),
                );
            }
            if let (Some(record), false) = (state.record, state.persisted) {
                insert_bounded(&mut table.volatile, MAX_VOLATILE, node.key, record);
            }
            node
        };
        // The descriptor closes here (or when the last operation using it ends). A file's
        // last descriptor may be what holds an unlinked file's blocks: closed off this thread.
        if gone.kind == FileKind::File {
            close_later(gone);
        }
    }

    fn attr(&self, node: &Node, st: &libc::stat) -> Attr {
        let record = lock(&node.overlay).record;
        let (uid, gid, perm) = Overlay::apply(record.as_ref(), st);
        Attr {
            ino: node.id,
            kind: node.kind,
            perm,
            nlink: st.st_nlink.try_into().unwrap_or(u32::MAX),
            uid,
            gid,
            size: st.st_size.max(0) as u64,
            blocks: st.st_blocks.max(0) as u64,
            atime: system_time(st.st_atime, st.st_atime_nsec),
            mtime: system_time(st.st_mtime, st.st_mtime_nsec),
            ctime: system_time(st.st_ctime, st.st_ctime_nsec),
            rdev: st.st_rdev as u32,
        }
    }

    fn getattr(&self, node: &Node) -> FsResult<Attr> {
        let st = sys::fstat(node.fd.as_fd())?;
        Ok(self.attr(node, &st))
    }

    fn entry(&self, node: &Node, st: &libc::stat) -> Entry {
        Entry {
            attr: self.attr(node, st),
            generation: 0,
        }
    }

    /// Where the guest's `name` in `parent` lives on the host, for `intent` (see `mask.rs`:
    /// in `parent` itself unless masks say otherwise).
    fn place(&self, parent: &Node, name: &CStr, intent: Intent) -> FsResult<Place> {
        match (&self.masks, parent.mask.get()) {
            (Some(masks), Some(dir)) => masks.place(dir, name, intent),
            _ => Ok(Place::Source { mask: None }),
        }
    }

    fn lookup(&self, parent: &Node, name: &CStr) -> FsResult<Entry> {
        let place = self.place(parent, name, Intent::Find)?;
        self.lookup_at(parent, &place, name)
    }

    fn lookup_at(&self, parent: &Node, place: &Place, name: &CStr) -> FsResult<Entry> {
        let dir = place.dir(parent.fd.as_fd());
        let fd = sys::openat2(dir, name, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
        let st = sys::fstat(fd.as_fd())?;
        self.refuse_masked(parent, place, &st)?;
        let node = self.remember(fd, &st, None, place)?;
        Ok(self.entry(&node, &st))
    }

    /// Fails with `ENOENT` when `st`, found in the source directory `parent`, is the inode of
    /// one of its masked names: a filesystem that folds case (ext4's casefold directories,
    /// vfat, cifs) opens `.GIT` as `.git`.
    fn refuse_masked(&self, parent: &Node, place: &Place, st: &libc::stat) -> FsResult<()> {
        if let (Some(masks), Some(mask), Place::Source { .. }) =
            (&self.masks, parent.mask.get(), place)
        {
            if masks
                .hidden_inodes(parent.fd.as_fd(), mask)
                .contains(&(st.st_dev, st.st_ino))
            {
                return Err(FsError::NOT_FOUND);
            }
        }
        Ok(())
    }

    /// Opens a regular file's inode for I/O. Writing (or truncating) a host file that has
    /// setuid or setgid bits clears them on the host first.
    fn open_io(&self, node: &Node, flags: i32) -> FsResult<OwnedFd> {
        if node.kind != FileKind::File {
            return Err(FsError::ACCESS_DENIED);
        }
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0;
        if writes {
            let st = sys::fstat(node.fd.as_fd())?;
            if st.st_mode & (libc::S_ISUID | libc::S_ISGID) != 0 {
                sys::chmod(&self.proc, node.fd.as_fd(), st.st_mode & 0o1777)
                    .map_err(|_| FsError::NOT_PERMITTED)?;
            }
        }
        let fd = self.proc.reopen(node.fd.as_fd(), flags)?;
        let st = sys::fstat(fd.as_fd())?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || (st.st_dev, st.st_ino) != node.key {
            // Cannot happen (the descriptor pins the inode): refuse rather than trust.
            return Err(FsError::IO);
        }
        Ok(fd)
    }

    /// A descriptor for the inode's extended attributes (Linux refuses `O_PATH` ones).
    fn xattr_fd(&self, node: &Node) -> FsResult<Option<OwnedFd>> {
        Ok(match node.kind {
            FileKind::File => Some(self.open_io(node, libc::O_RDONLY | libc::O_NONBLOCK)?),
            FileKind::Directory => Some(sys::open_dir(node.fd.as_fd())?),
            _ => None,
        })
    }

    /// Records the guest's view `record` for `node` (on the host where it can be kept).
    fn set_overlay(&self, node: &Node, record: Option<Overlay>, io: Option<BorrowedFd<'_>>) {
        let state = self.persist_overlay(node.kind, node.fd.as_fd(), record, io);
        if state.persisted && state.record.is_some() {
            // Its filesystem keeps records after all (one that said it did not, for another
            // inode, may differ per inode: an overlay's upper layer, a FUSE server).
            lock(&self.table).without_xattrs.remove(&node.key.0);
        }
        *lock(&node.overlay) = state;
    }

    fn persist_overlay(
        &self,
        kind: FileKind,
        fd: BorrowedFd<'_>,
        record: Option<Overlay>,
        io: Option<BorrowedFd<'_>>,
    ) -> OverlayState {
        let opened;
        let io = match (io, kind) {
            (Some(io), _) => Some(io),
            (None, FileKind::File) => {
                opened = self.proc.reopen(fd, libc::O_RDONLY | libc::O_NONBLOCK).ok();
                opened.as_ref().map(|fd| fd.as_fd())
            }
            (None, FileKind::Directory) => {
                opened = sys::open_dir(fd).ok();
                opened.as_ref().map(|fd| fd.as_fd())
            }
            (None, _) => None,
        };
        let persisted = match (io, kind) {
            (Some(io), FileKind::File | FileKind::Directory) => {
                let result = match &record {
                    Some(record) => sys::fsetxattr(io, XATTR, &record.encode(), 0),
                    None => match sys::fremovexattr(io, XATTR) {
                        Err(err) if err.raw_os_error() == Some(libc::ENODATA) => Ok(()),
                        other => other,
                    },
                };
                if let Err(err) = &result {
                    tracing::debug!(target: "krunbox::fs", %err, "an ownership record stays in memory only");
                }
                result.is_ok()
            }
            _ => record.is_none(),
        };
        OverlayState {
            record,
            persisted,
            read_at: None,
        }
    }

    /// Owner, group and permission bits of a new inode of kind `kind` (`S_IFMT` bits) made by
    /// `caller` in `parent`: the caller's, but the group of a setgid directory (whose new
    /// subdirectories are setgid too), as Linux does.
    fn new_owner(
        &self,
        parent: &Node,
        caller: Caller,
        kind: u32,
        perm: u32,
    ) -> FsResult<(u32, u32, u32)> {
        let st = sys::fstat(parent.fd.as_fd())?;
        let (_, parent_gid, parent_perm) =
            Overlay::apply(lock(&parent.overlay).record.as_ref(), &st);
        let mut perm = perm & 0o7777;
        let gid = if parent_perm & libc::S_ISGID != 0 {
            if kind == libc::S_IFDIR {
                perm |= libc::S_ISGID;
            }
            parent_gid
        } else {
            caller.gid
        };
        Ok((caller.uid, gid, perm))
    }

    /// After `parent/name` was made (of kind `kind`, `io` its open descriptor if it was
    /// opened): the exact host mode, the ownership record, the node.
    #[allow(clippy::too_many_arguments)]
    fn finish_create(
        &self,
        (parent, place): (&Node, &Place),
        name: &CStr,
        kind: u32,
        uid: u32,
        gid: u32,
        perm: u32,
        io: Option<BorrowedFd<'_>>,
    ) -> FsResult<(Arc<Node>, libc::stat)> {
        let fd = match io {
            // The very file just created, whatever has happened to its name since.
            Some(io) => self.proc.reopen(io, libc::O_PATH)?,
            None => sys::openat2(
                place.dir(parent.fd.as_fd()),
                name,
                libc::O_PATH | libc::O_NOFOLLOW,
                0,
            )?,
        };
        let mut st = sys::fstat(fd.as_fd())?;
        if st.st_mode & libc::S_IFMT != kind {
            // The guest swapped the name meanwhile: the new inode is not there any more.
            return Err(errno(libc::EAGAIN));
        }
        let node_kind = kind_of(st.st_mode)?;
        let perm = if kind == libc::S_IFLNK { 0o777 } else { perm };
        if kind != libc::S_IFLNK {
            // The process's umask applied to the mode asked; a directory keeps the setgid
            // bit the host's own setgid parent gave it (the host's group sharing).
            let mut want = host_perm(kind, perm);
            if kind == libc::S_IFDIR {
                want |= st.st_mode & libc::S_ISGID;
            }
            if st.st_mode & 0o7777 != want {
                match io {
                    Some(io) => sys::fchmod(io, want)?,
                    None => sys::chmod(&self.proc, fd.as_fd(), want)?,
                }
                st = sys::fstat(fd.as_fd())?;
            }
        }
        let record = Overlay::between(uid, gid, perm, &st);
        let state = self.persist_overlay(node_kind, fd.as_fd(), record, io);
        let node = self.remember(fd, &st, Some(state), place)?;
        Ok((node, st))
    }

    fn setattr(&self, node: &Node, change: &SetAttr) -> FsResult<Attr> {
        self.writable()?;
        if let Some(size) = change.size {
            match node.kind {
                FileKind::File => {}
                FileKind::Directory => return Err(FsError::IS_DIRECTORY),
                _ => return Err(FsError::INVALID),
            }
            let open =
                change
                    .handle
                    .and_then(|handle| match lock(&self.handles).map.get(&handle.0) {
                        Some(Handle::File(file)) if file.write && file.node.id == node.id => {
                            Some(file.clone())
                        }
                        _ => None,
                    });
            match open {
                Some(file) => sys::ftruncate(file.fd.as_fd(), size)?,
                None => {
                    let fd = self.open_io(node, libc::O_WRONLY | libc::O_NONBLOCK)?;
                    sys::ftruncate(fd.as_fd(), size)?;
                }
            }
        }
        let kind_bits = node.kind.mode_bits();
        let st = sys::fstat(node.fd.as_fd())?;
        let current = lock(&node.overlay).record;
        let (uid, gid, perm) = Overlay::apply(current.as_ref(), &st);
        let perm = change.perm.map_or(perm, |perm| perm & 0o7777);
        if change.perm.is_some() {
            if node.kind == FileKind::Symlink {
                return Err(FsError::NOT_SUPPORTED);
            }
            // Even to the mode it has: a chmod changes the inode's ctime.
            sys::chmod(&self.proc, node.fd.as_fd(), host_perm(kind_bits, perm))?;
        }
        if change.perm.is_some() || change.uid.is_some() || change.gid.is_some() {
            let st = sys::fstat(node.fd.as_fd())?;
            let record = Overlay::between(
                change.uid.unwrap_or(uid),
                change.gid.unwrap_or(gid),
                perm,
                &st,
            );
            let state = *lock(&node.overlay);
            if record != state.record || !state.persisted {
                self.set_overlay(node, record, None);
            }
            let times_given = change.atime.is_some() || change.mtime.is_some();
            if (change.uid.is_some() || change.gid.is_some()) && !times_given {
                // A chown changes the inode's ctime, and the host's owner never changes: the
                // access time set to itself changes it (best effort: the host may refuse).
                let atime = libc::timespec {
                    tv_sec: st.st_atime,
                    tv_nsec: st.st_atime_nsec,
                };
                let omit = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: libc::UTIME_OMIT,
                };
                let _ = sys::utimens(&self.proc, node.fd.as_fd(), &[atime, omit]);
            }
        }
        if change.atime.is_some() || change.mtime.is_some() {
            let times = [timespec(change.atime), timespec(change.mtime)];
            sys::utimens(&self.proc, node.fd.as_fd(), &times)?;
        }
        self.getattr(node)
    }

    fn add_handle(&self, handle: Handle) -> FsResult<FileHandle> {
        let mut handles = lock(&self.handles);
        if handles.map.len() >= self.limits.handles {
            return Err(errno(libc::EMFILE));
        }
        let id = handles.next;
        handles.next += 1;
        handles.map.insert(id, handle);
        Ok(FileHandle(id))
    }

    fn file(&self, ino: InodeId, handle: FileHandle) -> FsResult<Arc<OpenFile>> {
        match lock(&self.handles).map.get(&handle.0) {
            Some(Handle::File(file)) if file.node.id == ino => Ok(file.clone()),
            _ => Err(FsError::BAD_HANDLE),
        }
    }

    fn open_dir(&self, ino: InodeId, handle: FileHandle) -> FsResult<Arc<OpenDir>> {
        match lock(&self.handles).map.get(&handle.0) {
            Some(Handle::Dir(dir)) if dir.node.id == ino => Ok(dir.clone()),
            _ => Err(FsError::BAD_HANDLE),
        }
    }

    fn open(&self, node: &Arc<Node>, flags: OpenFlags) -> FsResult<FileHandle> {
        let writes = flags.write() || flags.truncate();
        if writes {
            self.writable()?;
        }
        match node.kind {
            FileKind::File => {}
            FileKind::Directory => return Err(FsError::IS_DIRECTORY),
            FileKind::Symlink => return Err(FsError::LOOP),
            FileKind::CharDevice | FileKind::BlockDevice => return Err(FsError::ACCESS_DENIED),
            FileKind::Fifo | FileKind::Socket => return Err(errno(libc::ENXIO)),
        }
        let access = flags.0 & libc::O_ACCMODE;
        if access == libc::O_ACCMODE {
            return Err(FsError::INVALID);
        }
        let io_flags =
            access | (flags.0 & (libc::O_APPEND | libc::O_TRUNC | libc::O_SYNC | libc::O_DSYNC));
        let charge = charge()?;
        let fd = self.open_io(node, io_flags)?;
        self.add_handle(Handle::File(Arc::new(OpenFile {
            node: node.clone(),
            fd,
            write: access != libc::O_RDONLY,
            _charge: charge,
        })))
    }

    fn create(
        &self,
        parent: &Node,
        name: &CStr,
        mode: u32,
        flags: OpenFlags,
        caller: Caller,
    ) -> FsResult<(Entry, FileHandle)> {
        self.writable()?;
        self.room_for_inode()?;
        if lock(&self.handles).map.len() >= self.limits.handles {
            return Err(errno(libc::EMFILE));
        }
        let access = flags.0 & libc::O_ACCMODE;
        if access == libc::O_ACCMODE {
            return Err(FsError::INVALID);
        }
        let (uid, gid, perm) = self.new_owner(parent, caller, libc::S_IFREG, mode)?;
        let place = self.place(parent, name, Intent::Make)?;
        let created = sys::openat2(
            place.dir(parent.fd.as_fd()),
            name,
            libc::O_CREAT
                | libc::O_EXCL
                | libc::O_NOFOLLOW
                | access
                | (flags.0 & (libc::O_APPEND | libc::O_SYNC | libc::O_DSYNC)),
            host_perm(libc::S_IFREG, perm),
        );
        let io = match created {
            Ok(io) => io,
            Err(err) if err.raw_os_error() == Some(libc::EEXIST) && !flags.exclusive() => {
                // It exists (made meanwhile): opened like any existing file.
                let entry = self.lookup_at(parent, &place, name)?;
                let node = self.node(entry.attr.ino)?;
                return match self.open(&node, flags) {
                    Ok(handle) => Ok((entry, handle)),
                    Err(err) => {
                        self.forget(node.id, 1);
                        Err(err)
                    }
                };
            }
            Err(err) => return Err(err.into()),
        };
        let (node, st) = self.finish_create(
            (parent, &place),
            name,
            libc::S_IFREG,
            uid,
            gid,
            perm,
            Some(io.as_fd()),
        )?;
        let entry = self.entry(&node, &st);
        let opened = charge().and_then(|charge| {
            self.add_handle(Handle::File(Arc::new(OpenFile {
                node: node.clone(),
                fd: io,
                write: access != libc::O_RDONLY,
                _charge: charge,
            })))
        });
        match opened {
            Ok(handle) => Ok((entry, handle)),
            Err(err) => {
                self.forget(node.id, 1);
                Err(err)
            }
        }
    }

    fn mknod(&self, parent: &Node, name: &CStr, mode: u32, caller: Caller) -> FsResult<Entry> {
        self.writable()?;
        self.room_for_inode()?;
        let kind = match mode & libc::S_IFMT {
            0 | libc::S_IFREG => libc::S_IFREG,
            libc::S_IFIFO => libc::S_IFIFO,
            libc::S_IFSOCK => libc::S_IFSOCK,
            // A device node would open the host's device for whoever opens it there.
            libc::S_IFCHR | libc::S_IFBLK => return Err(FsError::NOT_PERMITTED),
            _ => return Err(FsError::INVALID),
        };
        let (uid, gid, perm) = self.new_owner(parent, caller, kind, mode)?;
        let place = self.place(parent, name, Intent::Make)?;
        let dir = place.dir(parent.fd.as_fd());
        sys::mknodat(dir, name, kind | host_perm(kind, perm))?;
        let (node, st) = self.finish_create((parent, &place), name, kind, uid, gid, perm, None)?;
        Ok(self.entry(&node, &st))
    }

    fn mkdir(&self, parent: &Node, name: &CStr, mode: u32, caller: Caller) -> FsResult<Entry> {
        self.writable()?;
        self.room_for_inode()?;
        let (uid, gid, perm) = self.new_owner(parent, caller, libc::S_IFDIR, mode)?;
        let place = self.place(parent, name, Intent::Make)?;
        let dir = place.dir(parent.fd.as_fd());
        sys::mkdirat(dir, name, host_perm(libc::S_IFDIR, perm))?;
        let (node, st) =
            self.finish_create((parent, &place), name, libc::S_IFDIR, uid, gid, perm, None)?;
        Ok(self.entry(&node, &st))
    }

    fn symlink(
        &self,
        parent: &Node,
        name: &CStr,
        target: &OsStr,
        caller: Caller,
    ) -> FsResult<Entry> {
        self.writable()?;
        self.room_for_inode()?;
        let target = target.as_bytes();
        if target.is_empty() {
            return Err(FsError::NOT_FOUND);
        }
        if target.len() >= PATH_MAX {
            return Err(FsError::NAME_TOO_LONG);
        }
        let target = CString::new(target).map_err(|_| FsError::INVALID)?;
        let (uid, gid, _) = self.new_owner(parent, caller, libc::S_IFLNK, 0o777)?;
        let place = self.place(parent, name, Intent::Make)?;
        sys::symlinkat(&target, place.dir(parent.fd.as_fd()), name)?;
        let (node, st) =
            self.finish_create((parent, &place), name, libc::S_IFLNK, uid, gid, 0o777, None)?;
        Ok(self.entry(&node, &st))
    }

    fn link(&self, node: &Node, new_parent: &Node, new_name: &CStr) -> FsResult<Entry> {
        self.writable()?;
        self.room_for_inode()?;
        if node.kind == FileKind::Directory {
            return Err(FsError::NOT_PERMITTED);
        }
        let place = self.place(new_parent, new_name, Intent::Make)?;
        sys::link(
            &self.proc,
            node.fd.as_fd(),
            place.dir(new_parent.fd.as_fd()),
            new_name,
        )?;
        self.lookup_at(new_parent, &place, new_name)
    }

    /// Removes `name` from `parent` (`flags` as `unlinkat`'s).
    fn remove(&self, parent: &Node, name: &CStr, flags: i32) -> FsResult<()> {
        let place = self.place(parent, name, Intent::Remove)?;
        Ok(sys::unlinkat(place.dir(parent.fd.as_fd()), name, flags)?)
    }

    /// Renames `parent/name` to `new_parent/new_name` (`flags` as `renameat2`'s). A directory
    /// on the way to masked paths stays where it is (`EBUSY`, as for a mount point: moved, its
    /// masks would no longer be found by their names; not `EXDEV`, on which `mv` would copy
    /// the tree and then remove the masked entries' storage).
    fn rename(
        &self,
        (parent, name): (&Node, &CStr),
        (new_parent, new_name): (&Node, &CStr),
        flags: u32,
    ) -> FsResult<()> {
        let from = self.place(parent, name, Intent::Remove)?;
        let to = self.place(new_parent, new_name, Intent::Make)?;
        if from.leads_on().is_some() || to.leads_on().is_some() {
            return Err(errno(libc::EBUSY));
        }
        Ok(sys::renameat2(
            from.dir(parent.fd.as_fd()),
            name,
            to.dir(new_parent.fd.as_fd()),
            new_name,
            flags,
        )?)
    }

    /// The entries of `dir` from the guest's offset on, a batch at a time. Offsets are the
    /// host filesystem's own cookies (`d_off`), so a listing resumes where the guest says
    /// without the host holding anything but the descriptor; `.` and `..` come as the host
    /// lists them, `..` of the root being the root.
    ///
    /// A directory on the way to masked paths lists the source's entries but the masked ones,
    /// then the masked names its mask's storage holds (at offsets from [`STORED_BASE`]).
    fn readdir(&self, dir: &OpenDir, offset: u64, room: usize) -> FsResult<Vec<DirEntry>> {
        let masked = self.masks.as_ref().zip(dir.node.mask.get());
        if offset >= STORED_BASE {
            return Ok(masked.map_or_else(Vec::new, |(masks, mask)| {
                self.stored_listing(masks, mask, offset - STORED_BASE)
            }));
        }
        let hidden = masked.map(|(masks, mask)| Hidden {
            mask: mask.as_ref(),
            inodes: masks.hidden_inodes(dir.node.fd.as_fd(), mask),
        });
        let fd = lock(&dir.fd);
        let mut entries = Vec::new();
        let mut from = offset;
        // Until something is left to return, or the listing ends: a batch whose every entry
        // vanished since it was listed must not read as the end.
        while entries.is_empty() {
            let raw = sys::read_dir_at(fd.as_fd(), from, READDIR_CHUNK, room)?;
            let Some(last) = raw.last() else { break };
            from = last.next;
            self.add_listed(dir, raw, hidden.as_ref(), &mut entries);
        }
        if let (true, Some((masks, mask))) = (entries.is_empty(), masked) {
            return Ok(self.stored_listing(masks, mask, 0));
        }
        Ok(entries)
    }

    /// The entries of a masked directory's storage from its `from`th masked name on (the
    /// names in a fixed order, absent ones skipped: a cookie means the same name whatever
    /// the storage gains or loses meanwhile).
    fn stored_listing(&self, masks: &Masks, mask: &MaskDir, from: u64) -> Vec<DirEntry> {
        masks
            .stored_entries(mask)
            .into_iter()
            .filter(|(index, _, _)| (*index as u64) >= from)
            .filter_map(|(index, name, st)| {
                Some(DirEntry {
                    ino: self.listed_id(st.st_ino),
                    offset: STORED_BASE + index as u64 + 1,
                    kind: FileKind::from_mode(st.st_mode)?,
                    name: OsStr::from_bytes(name.as_bytes()).to_owned(),
                })
            })
            .collect()
    }

    /// `raw` entries of `dir` as the guest sees them: all but those `hidden` masks (by name,
    /// or by inode where the filesystem folds case).
    fn add_listed(
        &self,
        dir: &OpenDir,
        raw: Vec<sys::RawEntry>,
        hidden: Option<&Hidden<'_>>,
        entries: &mut Vec<DirEntry>,
    ) {
        for entry in raw {
            let name = entry.name.as_bytes();
            let masked = hidden.is_some_and(|hidden| {
                hidden.mask.is_masked(name)
                    || (name != b"." && name != b".." && hidden.has_inode(entry.ino))
            });
            if masked {
                continue;
            }
            let (ino, kind) = match name {
                b"." => (dir.node.id, FileKind::Directory),
                b".." if dir.node.id == InodeId::ROOT => (InodeId::ROOT, FileKind::Directory),
                b".." => (self.listed_id(entry.ino), FileKind::Directory),
                _ => match entry.kind.and_then(FileKind::from_mode) {
                    Some(kind) => (self.listed_id(entry.ino), kind),
                    // Gone since it was listed.
                    None => continue,
                },
            };
            entries.push(DirEntry {
                ino,
                offset: entry.next,
                kind,
                name: OsStr::from_bytes(name).to_owned(),
            });
        }
    }

    fn fsync(&self, ino: InodeId, handle: FileHandle, data_only: bool) -> FsResult<()> {
        let open = lock(&self.handles)
            .map
            .get(&handle.0)
            .and_then(|open| match open {
                Handle::File(file) if file.node.id == ino => Some(file.clone()),
                _ => None,
            });
        if let Some(file) = open {
            return Ok(sys::fsync(file.fd.as_fd(), data_only)?);
        }
        let node = self.node(ino)?;
        let fd = match node.kind {
            FileKind::File => self.open_io(&node, libc::O_RDONLY | libc::O_NONBLOCK)?,
            FileKind::Directory => sys::open_dir(node.fd.as_fd())?,
            _ => return Ok(()),
        };
        Ok(sys::fsync(fd.as_fd(), data_only)?)
    }

    fn statfs(&self) -> FsResult<StatFs> {
        let st = sys::fstatvfs(self.root.fd.as_fd())?;
        Ok(StatFs {
            blocks: st.f_blocks,
            blocks_free: st.f_bfree,
            blocks_available: st.f_bavail,
            files: st.f_files,
            files_free: st.f_ffree,
            block_size: st.f_frsize.try_into().unwrap_or(4096),
            name_max: st.f_namemax.min(255) as u32,
        })
    }
}

#[async_trait::async_trait]
impl VirtualFs for HostDir {
    async fn lookup(&self, parent: InodeId, name: &OsStr) -> FsResult<Entry> {
        let name = component(name)?;
        let parent = self.inner.dir(parent)?;
        self.run(move |inner| inner.lookup(&parent, &name)).await
    }

    async fn forget(&self, ino: InodeId, count: u64) {
        self.inner.forget(ino, count);
    }

    async fn getattr(&self, ino: InodeId) -> FsResult<Attr> {
        let node = self.inner.node(ino)?;
        self.run(move |inner| inner.getattr(&node)).await
    }

    async fn setattr(&self, ino: InodeId, change: SetAttr, _caller: Caller) -> FsResult<Attr> {
        self.inner.writable()?;
        let node = self.inner.node(ino)?;
        // A truncate frees the file's blocks inside the call.
        self.run_where(change.size.is_some(), move |inner| {
            inner.setattr(&node, &change)
        })
        .await
    }

    async fn readlink(&self, ino: InodeId) -> FsResult<Vec<u8>> {
        let node = self.inner.node(ino)?;
        if node.kind != FileKind::Symlink {
            return Err(FsError::INVALID);
        }
        self.run(move |_| Ok(sys::readlink(node.fd.as_fd())?)).await
    }

    async fn mknod(
        &self,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        _rdev: u32,
        caller: Caller,
    ) -> FsResult<Entry> {
        self.inner.writable()?;
        let name = component(name)?;
        let parent = self.inner.dir(parent)?;
        self.run(move |inner| inner.mknod(&parent, &name, mode, caller))
            .await
    }

    async fn mkdir(
        &self,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        caller: Caller,
    ) -> FsResult<Entry> {
        self.inner.writable()?;
        let name = component(name)?;
        let parent = self.inner.dir(parent)?;
        self.run(move |inner| inner.mkdir(&parent, &name, mode, caller))
            .await
    }

    async fn unlink(&self, parent: InodeId, name: &OsStr) -> FsResult<()> {
        self.inner.writable()?;
        let name = component(name)?;
        let parent = self.inner.dir(parent)?;
        // Removing a file's last name frees its blocks inside the call.
        self.run_blocking(move |inner| inner.remove(&parent, &name, 0))
            .await
    }

    async fn rmdir(&self, parent: InodeId, name: &OsStr) -> FsResult<()> {
        self.inner.writable()?;
        let name = component(name)?;
        let parent = self.inner.dir(parent)?;
        self.run_blocking(move |inner| inner.remove(&parent, &name, libc::AT_REMOVEDIR))
            .await
    }

    async fn symlink(
        &self,
        parent: InodeId,
        name: &OsStr,
        target: &OsStr,
        caller: Caller,
    ) -> FsResult<Entry> {
        self.inner.writable()?;
        let name = component(name)?;
        let parent = self.inner.dir(parent)?;
        let target = target.to_owned();
        self.run(move |inner| inner.symlink(&parent, &name, &target, caller))
            .await
    }

    async fn rename(
        &self,
        parent: InodeId,
        name: &OsStr,
        new_parent: InodeId,
        new_name: &OsStr,
        flags: RenameFlags,
    ) -> FsResult<()> {
        self.inner.writable()?;
        if flags.no_replace && flags.exchange {
            return Err(FsError::INVALID);
        }
        let name = component(name)?;
        let new_name = component(new_name)?;
        let parent = self.inner.dir(parent)?;
        let new_parent = self.inner.dir(new_parent)?;
        let flags = if flags.no_replace {
            libc::RENAME_NOREPLACE
        } else if flags.exchange {
            libc::RENAME_EXCHANGE
        } else {
            0
        };
        // A rename over a file frees the file it replaces.
        self.run_blocking(move |inner| {
            inner.rename((&parent, &name), (&new_parent, &new_name), flags)
        })
        .await
    }

    async fn link(&self, ino: InodeId, new_parent: InodeId, new_name: &OsStr) -> FsResult<Entry> {
        self.inner.writable()?;
        let new_name = component(new_name)?;
        let node = self.inner.node(ino)?;
        let new_parent = self.inner.dir(new_parent)?;
        self.run(move |inner| inner.link(&node, &new_parent, &new_name))
            .await
    }

    async fn open(&self, ino: InodeId, flags: OpenFlags) -> FsResult<FileHandle> {
        let node = self.inner.node(ino)?;
        self.run_where(flags.0 & libc::O_TRUNC != 0, move |inner| {
            inner.open(&node, flags)
        })
        .await
    }

    async fn create(
        &self,
        parent: InodeId,
        name: &OsStr,
        mode: u32,
        flags: OpenFlags,
        caller: Caller,
    ) -> FsResult<(Entry, FileHandle)> {
        self.inner.writable()?;
        let name = component(name)?;
        let parent = self.inner.dir(parent)?;
        self.run_where(flags.0 & libc::O_TRUNC != 0, move |inner| {
            inner.create(&parent, &name, mode, flags, caller)
        })
        .await
    }

    async fn read(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
        size: u32,
    ) -> FsResult<Vec<u8>> {
        let file = self.inner.file(ino, handle)?;
        let size = (size as usize).min(MAX_IO);
        self.run_where(size > INLINE_IO, move |_| {
            Ok(sys::pread_full(file.fd.as_fd(), offset, size)?)
        })
        .await
    }

    async fn write(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
        data: &[u8],
    ) -> FsResult<u32> {
        self.write_data(ino, handle, offset, WriteData::from_bytes(data))
            .await
    }

    async fn write_data(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
        data: WriteData<'_>,
    ) -> FsResult<u32> {
        self.inner.writable()?;
        let file = self.inner.file(ino, handle)?;
        if !file.write {
            return Err(FsError::BAD_HANDLE);
        }
        if data.len() > MAX_IO {
            return Err(FsError::INVALID);
        }
        // Any write can be held up by the host's dirty-page throttling, which a guest writing
        // fast brings about on purpose: never on a runtime thread that other tasks wait for.
        // On a multi-threaded runtime this thread hands its other tasks to another worker and
        // writes the guest's bytes where they are (in guest memory when the library serves
        // the mount's queues: `pwritev` from there); elsewhere they are copied for the pool.
        let multi_threaded = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        // A large write is also kept out of the caller's first poll (the mount's task answers
        // requests that are ready at once in place: this one gets a task of its own), so its
        // throttling holds up only itself. A small one is written in place, as small reads
        // are: the kernel's throttling pause grows with the pages a write dirties, and a task
        // of its own cost small writes a tenth of their rate (docs/testing.md).
        if data.len() > INLINE_IO || !multi_threaded {
            tokio::task::yield_now().await;
        }
        if multi_threaded {
            return tokio::task::block_in_place(|| {
                Ok(data.write_at(file.fd.as_fd(), offset)? as u32)
            });
        }
        let data = data.to_vec()?;
        self.run_blocking(move |_| {
            Ok(WriteData::from_bytes(&data).write_at(file.fd.as_fd(), offset)? as u32)
        })
        .await
    }

    async fn fallocate(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
    ) -> FsResult<()> {
        self.inner.writable()?;
        let file = self.inner.file(ino, handle)?;
        if !file.write {
            return Err(FsError::BAD_HANDLE);
        }
        // Only the two modes that allocate: punching holes, collapsing or inserting ranges
        // are not passed to the host's filesystem.
        if mode != 0 && mode != libc::FALLOC_FL_KEEP_SIZE {
            return Err(FsError::NOT_SUPPORTED);
        }
        self.run_blocking(move |_| Ok(sys::fallocate(file.fd.as_fd(), mode, offset, length)?))
            .await
    }

    // No flush: every write reaches the host file before `write` returns, so a close has
    // nothing to report. The default's ENOSYS tells the guest kernel, which stops sending them.

    async fn release(&self, ino: InodeId, handle: FileHandle) -> FsResult<()> {
        let removed = {
            let mut handles = lock(&self.inner.handles);
            match handles.map.get(&handle.0) {
                Some(Handle::File(file)) if file.node.id == ino => handles.map.remove(&handle.0),
                _ => return Err(FsError::BAD_HANDLE),
            }
        };
        // Closed on the blocking pool, not waited for: the last close of an unlinked file
        // frees its blocks, a network filesystem flushes on close; nothing of it is the
        // guest's to hear (every write reached the host before it returned).
        if let Some(removed) = removed {
            close_later(removed);
        }
        Ok(())
    }

    async fn fsync(&self, ino: InodeId, handle: FileHandle, data_only: bool) -> FsResult<()> {
        self.run_blocking(move |inner| inner.fsync(ino, handle, data_only))
            .await
    }

    async fn opendir(&self, ino: InodeId) -> FsResult<FileHandle> {
        let node = self.inner.dir(ino)?;
        self.run_blocking(move |inner| {
            let charge = charge()?;
            let fd = sys::open_dir(node.fd.as_fd())?;
            inner.add_handle(Handle::Dir(Arc::new(OpenDir {
                node,
                fd: Mutex::new(fd),
                _charge: charge,
            })))
        })
        .await
    }

    async fn readdir(
        &self,
        ino: InodeId,
        handle: FileHandle,
        offset: u64,
    ) -> FsResult<Vec<DirEntry>> {
        let dir = self.inner.open_dir(ino, handle)?;
        // As many entries as the guest's reply holds, when called by a mount's session.
        let room = crate::fs::fuse::reply::readdir_room().unwrap_or(usize::MAX);
        self.run_blocking(move |inner| inner.readdir(&dir, offset, room))
            .await
    }

    async fn releasedir(&self, ino: InodeId, handle: FileHandle) -> FsResult<()> {
        self.inner.open_dir(ino, handle)?;
        lock(&self.inner.handles).map.remove(&handle.0);
        Ok(())
    }

    async fn statfs(&self) -> FsResult<StatFs> {
        self.run(|inner| inner.statfs()).await
    }

    async fn getxattr(&self, ino: InodeId, name: &OsStr) -> FsResult<Vec<u8>> {
        let name = xattr_name(name, false)?;
        let node = self.inner.node(ino)?;
        self.run(move |inner| match inner.xattr_fd(&node)? {
            Some(fd) => Ok(sys::fgetxattr(fd.as_fd(), &name)?),
            // Linux keeps no user attributes on symlinks and special files.
            None => Err(FsError::NO_DATA),
        })
        .await
    }

    async fn setxattr(&self, ino: InodeId, name: &OsStr, value: &[u8], flags: i32) -> FsResult<()> {
        self.inner.writable()?;
        let name = xattr_name(name, true)?;
        if flags & !(libc::XATTR_CREATE | libc::XATTR_REPLACE) != 0 {
            return Err(FsError::INVALID);
        }
        if value.len() > sys::XATTR_SIZE_MAX {
            return Err(errno(libc::E2BIG));
        }
        let node = self.inner.node(ino)?;
        let value = value.to_vec();
        self.run(move |inner| match inner.xattr_fd(&node)? {
            Some(fd) => Ok(sys::fsetxattr(fd.as_fd(), &name, &value, flags)?),
            None => Err(FsError::NOT_PERMITTED),
        })
        .await
    }

    async fn listxattr(&self, ino: InodeId) -> FsResult<Vec<Vec<u8>>> {
        let node = self.inner.node(ino)?;
        self.run(move |inner| match inner.xattr_fd(&node)? {
            Some(fd) => Ok(sys::flistxattr(fd.as_fd())?
                .into_iter()
                .filter(|name| name.starts_with(b"user.") && !name.starts_with(PRIVATE_PREFIX))
                .collect()),
            None => Ok(Vec::new()),
        })
        .await
    }

    async fn removexattr(&self, ino: InodeId, name: &OsStr) -> FsResult<()> {
        self.inner.writable()?;
        let name = xattr_name(name, true)?;
        let node = self.inner.node(ino)?;
        self.run(move |inner| match inner.xattr_fd(&node)? {
            Some(fd) => Ok(sys::fremovexattr(fd.as_fd(), &name)?),
            None => Err(FsError::NOT_PERMITTED),
        })
        .await
    }
}
