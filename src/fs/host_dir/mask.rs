//! Masks: paths of a [`HostDir`](super::HostDir) the guest does not see, or sees from a
//! separate storage directory instead of the source.
//!
//! A mask is matched by names, as the guest walks to it: the served root carries the tree of
//! masked paths ([`MaskDir`]), a directory looked up along it carries its branch, and a name
//! that is a masked path's last component is resolved in the storage directory (at the same
//! relative path, made as the guest first creates something there) or, without storage, not at
//! all. So the source's entry at a masked path is never named by the host on the guest's
//! behalf, whatever the guest does: a directory on the way to a mask cannot be renamed
//! (`EBUSY`, as a mount point), and nothing else moves a name. On a filesystem that folds case,
//! the source's masked entries are also hidden by inode (`.GIT` opens `.git` there). A path a
//! symlink in the source leads to is not masked by the symlink's path: masks name real
//! directories. What a mask does not hide: that a hidden entry exists (a directory holding
//! only hidden entries is not empty to `rmdir`, and hidden subdirectories count in its link
//! count).

use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use super::sys;
use crate::fs::types::{FsError, FsResult};

/// The most paths one mask may name.
const MAX_PATHS: usize = 1024;

/// Paths of a [`HostDir`](super::HostDir) hidden from the guest, and where the guest's own
/// entries at those paths go: given to [`HostDir::with_mask`](super::HostDir::with_mask).
///
/// A masked path reads as absent until the guest makes something there. Without storage it
/// stays absent (making it fails with `EACCES`, or `EROFS` on a read-only directory). With
/// storage ([`Mask::stored_in`]), whatever the guest makes at a masked path, and below it,
/// is made in the storage directory at the same relative path, and what the storage already
/// holds there is what the guest sees: a project's `node_modules` installed by the guest for
/// its own platform lives beside the host's, which the guest never sees or changes.
///
/// ```
/// use krunbox::fs::{HostDir, Mask};
///
/// let project = tempfile::tempdir().unwrap();
/// let storage = tempfile::tempdir().unwrap();
/// let mask = Mask::hide(["node_modules", ".git", "packages/a/node_modules"])
///     .stored_in(storage.path());
/// let fs = HostDir::new(project.path()).unwrap().with_mask(mask).unwrap();
/// # let _ = fs;
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mask {
    paths: Vec<PathBuf>,
    storage: Option<PathBuf>,
}

impl Mask {
    /// Hides `paths`, each relative to the served directory (a leading `/` is allowed and
    /// means the same: `"/node_modules"` is `"node_modules"`). A path below another masked
    /// path adds nothing. The paths are checked by
    /// [`HostDir::with_mask`](super::HostDir::with_mask): each a plain relative path without
    /// `.` or `..`.
    ///
    /// ```
    /// let mask = krunbox::fs::Mask::hide([".git", "/target"]);
    /// # let _ = mask;
    /// ```
    pub fn hide<I, P>(paths: I) -> Mask
    where
        I: IntoIterator<Item = P>,
        P: Into<PathBuf>,
    {
        Mask {
            paths: paths.into_iter().map(Into::into).collect(),
            storage: None,
        }
    }

    /// Serves the masked paths from `dir` (a host directory; it may lie inside the served one,
    /// but then under a masked path, so the guest cannot reach it twice).
    ///
    /// ```
    /// let storage = tempfile::tempdir().unwrap();
    /// let mask = krunbox::fs::Mask::hide(["node_modules"]).stored_in(storage.path());
    /// # let _ = mask;
    /// ```
    pub fn stored_in(mut self, dir: impl Into<PathBuf>) -> Mask {
        self.storage = Some(dir.into());
        self
    }
}

/// A directory on the way to masked paths (the served root, or one of its subdirectories):
/// which of its names are masked, and which lead on to more.
#[derive(Debug, Default)]
pub(super) struct MaskDir {
    /// Its path from the served root, a component each.
    path: Vec<CString>,
    /// Names masked here (bytes of one component).
    masked: HashSet<Vec<u8>>,
    /// Names that lead on to masked paths below.
    children: HashMap<Vec<u8>, Arc<MaskDir>>,
}

/// Where the guest's name in a directory lives on the host.
pub(super) enum Place {
    /// In the directory itself (the parent node's descriptor); `mask` is the branch a
    /// directory found there carries, when the name leads on to masked paths.
    Source { mask: Option<Arc<MaskDir>> },
    /// In this directory of the storage (an `O_PATH` descriptor).
    Storage(OwnedFd),
}

/// What the guest means to do with a name: find it, make it, or remove or rename it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Intent {
    Find,
    Make,
    Remove,
}

/// A [`Mask`] ready to serve: its tree and its storage, opened.
pub(super) struct Masks {
    pub(super) root: Arc<MaskDir>,
    storage: Option<OwnedFd>,
}

impl Masks {
    /// Checks `mask` for the directory served at `source` and opens its storage.
    pub(super) fn open(mask: &Mask, source: &Path) -> Result<Masks, String> {
        if mask.paths.len() > MAX_PATHS {
            return Err(format!(
                "a mask names {} paths; at most {MAX_PATHS}",
                mask.paths.len()
            ));
        }
        let mut paths = Vec::with_capacity(mask.paths.len());
        for path in &mask.paths {
            paths.push(components(path)?);
        }
        let storage = match &mask.storage {
            None => None,
            Some(dir) => Some(open_storage(dir, source, &paths)?),
        };
        Ok(Masks {
            root: Arc::new(tree(Vec::new(), &paths)),
            storage,
        })
    }

    /// Where `name` in the directory carrying `dir` lives, for `intent`. A masked name without
    /// storage is `ENOENT` (`EACCES` to make); with storage, its storage directory is opened
    /// (and made, to make something) or the name is `ENOENT`.
    pub(super) fn place(&self, dir: &MaskDir, name: &CStr, intent: Intent) -> FsResult<Place> {
        if !dir.masked.contains(name.to_bytes()) {
            return Ok(Place::Source {
                mask: dir.children.get(name.to_bytes()).cloned(),
            });
        }
        let Some(storage) = &self.storage else {
            return Err(match intent {
                Intent::Make => FsError::ACCESS_DENIED,
                Intent::Find | Intent::Remove => FsError::NOT_FOUND,
            });
        };
        match storage_dir(storage.as_fd(), &dir.path, intent == Intent::Make)? {
            Some(fd) => Ok(Place::Storage(fd)),
            None => Err(FsError::NOT_FOUND),
        }
    }

    /// The masked names of `dir` that its storage holds, with their host metadata, each with
    /// its index among all of `dir`'s masked names in byte order: what a listing of `dir`
    /// shows after the source's own entries, the index its cookie.
    pub(super) fn stored_entries(&self, dir: &MaskDir) -> Vec<(usize, CString, libc::stat)> {
        let Some(storage) = &self.storage else {
            return Vec::new();
        };
        let Ok(Some(fd)) = storage_dir(storage.as_fd(), &dir.path, false) else {
            return Vec::new();
        };
        let mut names: Vec<&Vec<u8>> = dir.masked.iter().collect();
        names.sort();
        names
            .into_iter()
            .enumerate()
            .filter_map(|(index, name)| {
                let name = CString::new(name.as_slice()).ok()?;
                let st = sys::fstatat_nofollow(fd.as_fd(), &name).ok()?;
                Some((index, name, st))
            })
            .collect()
    }

    /// The inodes (device, number) that `dir`'s masked names name in the source directory
    /// `source`, as its filesystem looks them up (one that folds case finds `.git` for
    /// `.GIT`, so an entry is hidden by what it is, not only by its name).
    pub(super) fn hidden_inodes(&self, source: BorrowedFd<'_>, dir: &MaskDir) -> Vec<(u64, u64)> {
        dir.masked
            .iter()
            .filter_map(|name| {
                let name = CString::new(name.as_slice()).ok()?;
                let st = sys::fstatat_nofollow(source, &name).ok()?;
                Some((st.st_dev, st.st_ino))
            })
            .collect()
    }
}

impl MaskDir {
    /// Whether `name` here is masked (the source's entry is never listed).
    pub(super) fn is_masked(&self, name: &[u8]) -> bool {
        self.masked.contains(name)
    }
}

/// A mask's path as components: relative (a leading `/` dropped), no `.`, `..` or empty ones.
fn components(path: &Path) -> Result<Vec<CString>, String> {
    let mut parts = Vec::new();
    for component in path.components() {
        match component {
            Component::RootDir if parts.is_empty() => {}
            Component::Normal(name) => {
                let bytes = name.as_bytes();
                if bytes.len() > 255 {
                    return Err(format!("a masked path's name is over 255 bytes: {path:?}"));
                }
                parts.push(
                    CString::new(bytes)
                        .map_err(|_| format!("a masked path holds a NUL byte: {path:?}"))?,
                );
            }
            _ => {
                return Err(format!(
                    "a masked path must be a plain path inside the directory (no `.` or `..`): \
                     {path:?}"
                ))
            }
        }
    }
    if parts.is_empty() {
        return Err(format!(
            "a masked path must name something inside the directory, not the directory itself: \
             {path:?}"
        ));
    }
    Ok(parts)
}

/// The tree of `paths` below `at`: a path's last component masked, its others leading on; a
/// path under a masked one is covered by it.
fn tree(at: Vec<CString>, paths: &[Vec<CString>]) -> MaskDir {
    let depth = at.len();
    let below: Vec<&Vec<CString>> = paths
        .iter()
        .filter(|path| path.len() > depth && path[..depth] == at[..])
        .collect();
    let masked: HashSet<Vec<u8>> = below
        .iter()
        .filter(|path| path.len() == depth + 1)
        .map(|path| path[depth].as_bytes().to_vec())
        .collect();
    let mut children = HashMap::new();
    for path in &below {
        let name = path[depth].as_bytes();
        if masked.contains(name) || children.contains_key(name) {
            continue;
        }
        let mut next = at.clone();
        next.push(path[depth].clone());
        children.insert(name.to_vec(), Arc::new(tree(next, paths)));
    }
    MaskDir {
        path: at,
        masked,
        children,
    }
}

/// Opens the storage directory `dir` (`O_PATH`), refusing one that the guest could reach
/// through the source too: inside `source` but under no masked path, or holding `source`.
fn open_storage(dir: &Path, source: &Path, paths: &[Vec<CString>]) -> Result<OwnedFd, String> {
    let canonical = |path: &Path| {
        std::fs::canonicalize(path).map_err(|err| format!("{}: {err}", path.display()))
    };
    let (storage, source) = (canonical(dir)?, canonical(source)?);
    if source.starts_with(&storage) {
        return Err(format!(
            "a mask's storage {} holds the served directory {}: give it a directory of its own",
            storage.display(),
            source.display()
        ));
    }
    if let Ok(inside) = storage.strip_prefix(&source) {
        let inside: Vec<&[u8]> = inside
            .components()
            .map(|c| c.as_os_str().as_bytes())
            .collect();
        let under_mask = paths.iter().any(|path| {
            path.len() <= inside.len() && path.iter().zip(&inside).all(|(a, b)| a.as_bytes() == *b)
        });
        if !under_mask {
            return Err(format!(
                "a mask's storage {} lies inside the served directory {} but under no masked \
                 path: the guest would see it twice (mask the path it is under)",
                storage.display(),
                source.display()
            ));
        }
    }
    let c_path =
        CString::new(storage.as_os_str().as_bytes()).map_err(|_| "a NUL in a path".to_string())?;
    // SAFETY: a NUL-terminated path; the descriptor is ours on success.
    let fd = unsafe {
        libc::open(
            c_path.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(format!(
            "opening a mask's storage {}: {}",
            storage.display(),
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: a new descriptor, ours.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// The storage's directory at `path` (components below its root), each step resolved as
/// every name is (beneath, no symlinks, no mount crossings); missing ones made when `make`,
/// else `None`.
fn storage_dir(root: BorrowedFd<'_>, path: &[CString], make: bool) -> FsResult<Option<OwnedFd>> {
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW;
    let mut at = sys::openat2(root, c".", flags, 0)?;
    for name in path {
        let next = match sys::openat2(at.as_fd(), name, flags, 0) {
            Err(err) if err.raw_os_error() == Some(libc::ENOENT) && make => {
                match sys::mkdirat(at.as_fd(), name, 0o755) {
                    Err(err) if err.raw_os_error() != Some(libc::EEXIST) => return Err(err.into()),
                    _ => sys::openat2(at.as_fd(), name, flags, 0)?,
                }
            }
            Err(err) if err.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
            other => other?,
        };
        at = next;
    }
    Ok(Some(at))
}

impl Place {
    /// The host directory the name is in: `parent`'s own descriptor, or the storage's.
    pub(super) fn dir<'a>(&'a self, parent: BorrowedFd<'a>) -> BorrowedFd<'a> {
        match self {
            Place::Source { .. } => parent,
            Place::Storage(fd) => fd.as_fd(),
        }
    }

    /// The branch of masked paths below the name, if it leads on to some.
    pub(super) fn leads_on(&self) -> Option<&Arc<MaskDir>> {
        match self {
            Place::Source { mask } => mask.as_ref(),
            Place::Storage(_) => None,
        }
    }
}
