//! Files in the guest: read, write, stat, list, remove (see `krunbox::protocol::fs`).
//!
//! Every operation is a request/response pair on the control channel, answered by guest-init
//! (as root, on its own thread). Data moves in chunks of at most
//! [`MAX_FILE_CHUNK`](crate::protocol::fs::MAX_FILE_CHUNK) bytes; streams keep up to
//! [`IN_FLIGHT`](request::IN_FLIGHT) chunk requests outstanding, which bounds memory and is
//! the flow control.
//!
//! One concern per file: `request` (a request and its deadline), `read`, `write`, `dir`; this
//! module has metadata, removal and directory creation.
//!
//! Paths are guest paths. A relative path is taken relative to the guest's `/` (there is no
//! working directory for file operations).

mod dir;
mod read;
mod request;
mod search;
mod write;

use std::ffi::OsString;
use std::io;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::instance::Instance;
use crate::protocol::fs::{FileMeta, FileType, FsErrorKind, FsOk, FsOp};

pub use read::GuestFileReader;
pub use search::{Search, SearchCut, SearchHit, SearchResults};
pub use write::{GuestFileWriter, WriteOptions};

use request::Target;

/// Mode of directories created by [`Instance::create_dir_all`].
const DIR_MODE: u32 = 0o755;

/// What `stat` says about a file in the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Metadata {
    /// File, directory, symlink or other.
    pub file_type: FileType,
    /// Size in bytes (for a symlink, the length of its target).
    pub len: u64,
    /// Permission bits, `st_mode & 0o7777` (e.g. `0o644`).
    pub mode: u32,
    /// Owner's user id in the guest.
    pub uid: u32,
    /// Owner's group id in the guest.
    pub gid: u32,
    /// Last modification (the guest's clock).
    pub modified: SystemTime,
}

impl Metadata {
    /// Whether this is a regular file.
    pub fn is_file(&self) -> bool {
        self.file_type == FileType::File
    }

    /// Whether this is a directory.
    pub fn is_dir(&self) -> bool {
        self.file_type == FileType::Dir
    }

    /// Whether this is a symbolic link (only [`Instance::symlink_metadata`] reports these).
    pub fn is_symlink(&self) -> bool {
        self.file_type == FileType::Symlink
    }

    fn from_wire(meta: FileMeta) -> Metadata {
        let nanos = Duration::from_nanos(u64::from(meta.mtime_nanos.min(999_999_999)));
        let modified = if meta.mtime_secs >= 0 {
            UNIX_EPOCH.checked_add(Duration::from_secs(meta.mtime_secs as u64) + nanos)
        } else {
            UNIX_EPOCH
                .checked_sub(Duration::from_secs(meta.mtime_secs.unsigned_abs()))
                .and_then(|t| t.checked_add(nanos))
        };
        Metadata {
            file_type: meta.file_type,
            len: meta.len,
            mode: meta.mode & 0o7777,
            uid: meta.uid,
            gid: meta.gid,
            modified: modified.unwrap_or(UNIX_EPOCH),
        }
    }
}

/// One entry of a guest directory, from [`Instance::read_dir`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DirEntry {
    /// The file name (no directory part; Linux names are bytes, not necessarily UTF-8).
    pub name: OsString,
    /// The entry's own type: a symlink is reported as [`FileType::Symlink`], not followed.
    pub file_type: FileType,
}

/// As an `io::Error` (for the `AsyncRead`/`AsyncWrite` impls), keeping the typed error inside:
/// `err.get_ref()` and `downcast_ref::<krunbox::Error>()` give it back.
fn to_io(err: Error) -> io::Error {
    let kind = match &err {
        Error::Fs { kind, .. } => match kind {
            FsErrorKind::NotFound => io::ErrorKind::NotFound,
            FsErrorKind::PermissionDenied => io::ErrorKind::PermissionDenied,
            FsErrorKind::IsADirectory => io::ErrorKind::IsADirectory,
            FsErrorKind::NotADirectory => io::ErrorKind::NotADirectory,
            FsErrorKind::AlreadyExists => io::ErrorKind::AlreadyExists,
            FsErrorKind::DirectoryNotEmpty => io::ErrorKind::DirectoryNotEmpty,
            FsErrorKind::InvalidInput => io::ErrorKind::InvalidInput,
            FsErrorKind::Other => io::ErrorKind::Other,
            FsErrorKind::NotAFile => io::ErrorKind::InvalidInput,
            FsErrorKind::TooLarge => io::ErrorKind::FileTooLarge,
        },
        Error::InstanceGone { .. } | Error::GuestHung { .. } => io::ErrorKind::BrokenPipe,
        Error::RequestTimeout { .. } => io::ErrorKind::TimedOut,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, err)
}

impl Instance {
    async fn stat(&self, op: &'static str, path: &Path, follow: bool) -> Result<Metadata> {
        let target = Target::new(self, op, path)?;
        match target
            .call(FsOp::Metadata {
                path: target.wire_path(),
                follow,
            })
            .await?
        {
            FsOk::Metadata(meta) => Ok(Metadata::from_wire(meta)),
            other => Err(target.unexpected("Metadata", &other)),
        }
    }

    /// Metadata of a guest path, following symlinks (`stat`).
    ///
    /// A relative path is relative to the guest's `/`.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let meta = vm.metadata("/etc/passwd").await?;
    /// println!("{} bytes, mode {:o}", meta.len, meta.mode);
    /// # Ok(()) }
    /// ```
    pub async fn metadata(&self, path: impl AsRef<Path>) -> Result<Metadata> {
        self.stat("metadata", path.as_ref(), true).await
    }

    /// Metadata of a guest path without following a final symlink (`lstat`): a symlink is
    /// reported as [`FileType::Symlink`].
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let meta = vm.symlink_metadata("/bin/sh").await?;
    /// println!("/bin/sh is a symlink: {}", meta.is_symlink());
    /// # Ok(()) }
    /// ```
    pub async fn symlink_metadata(&self, path: impl AsRef<Path>) -> Result<Metadata> {
        self.stat("symlink_metadata", path.as_ref(), false).await
    }

    /// Removes a file, a symlink (not its target) or an empty directory.
    ///
    /// A relative path is relative to the guest's `/`. A non-empty directory fails with
    /// [`FsErrorKind::DirectoryNotEmpty`]; use [`Instance::remove_all`].
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.remove("/tmp/input.txt").await?;
    /// # Ok(()) }
    /// ```
    pub async fn remove(&self, path: impl AsRef<Path>) -> Result<()> {
        let target = Target::new(self, "remove", path.as_ref())?;
        target
            .call_done(FsOp::Remove {
                path: target.wire_path(),
                recursive: false,
            })
            .await
    }

    /// Removes a path and, if it is a directory, everything under it. Symlinks inside are
    /// removed themselves, never followed.
    ///
    /// A relative path is relative to the guest's `/`. A missing path is
    /// [`FsErrorKind::NotFound`]. `/`, a mount point of the sandbox's
    /// ([`SandboxBuilder::mount`](crate::SandboxBuilder::mount)) and a directory holding one
    /// are refused ([`FsErrorKind::InvalidInput`]) before anything is removed, so that no
    /// removal walks into a mounted filesystem of the caller's and empties it; name what is
    /// inside the mount instead.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.remove_all("/tmp/build").await?;
    /// # Ok(()) }
    /// ```
    pub async fn remove_all(&self, path: impl AsRef<Path>) -> Result<()> {
        let target = Target::new(self, "remove_all", path.as_ref())?;
        target
            .call_done(FsOp::Remove {
                path: target.wire_path(),
                recursive: true,
            })
            .await
    }

    /// Renames `from` to `to`, as `rename(2)` does: a file at `to` is replaced atomically (the
    /// way to publish a file whole: write it beside, then rename), a symlink is renamed itself,
    /// never followed. Both must be on one filesystem of the guest's.
    ///
    /// Relative paths are relative to the guest's `/`. A missing `from`, or a missing parent
    /// of `to`, is [`FsErrorKind::NotFound`]; a directory onto a file, or the reverse,
    /// [`FsErrorKind::NotADirectory`] / [`FsErrorKind::IsADirectory`]; across filesystems
    /// (say, from `/tmp` into a mount) [`FsErrorKind::Other`] with the guest's `EXDEV`.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.write_file("/tmp/report.json.part", b"{}").await?;
    /// vm.rename("/tmp/report.json.part", "/tmp/report.json").await?;
    /// # Ok(()) }
    /// ```
    pub async fn rename(&self, from: impl AsRef<Path>, to: impl AsRef<Path>) -> Result<()> {
        let source = Target::new(self, "rename", from.as_ref())?;
        let destination = Target::new(self, "rename", to.as_ref())?;
        source
            .call_done(FsOp::Rename {
                from: source.wire_path(),
                to: destination.wire_path(),
            })
            .await
    }

    /// Creates a directory with exactly `mode` (the umask does not apply). Its parent must
    /// exist, and the directory must not ([`FsErrorKind::AlreadyExists`]).
    ///
    /// A relative path is relative to the guest's `/`.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.create_dir("/tmp/private", 0o700).await?;
    /// # Ok(()) }
    /// ```
    pub async fn create_dir(&self, path: impl AsRef<Path>, mode: u32) -> Result<()> {
        let target = Target::new(self, "create_dir", path.as_ref())?;
        target
            .call_done(FsOp::CreateDir {
                path: target.wire_path(),
                mode,
                parents: false,
            })
            .await
    }

    /// Creates a directory and its missing parents, each with mode `0o755`; an existing
    /// directory is not an error.
    ///
    /// A relative path is relative to the guest's `/`.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.create_dir_all("/tmp/work/src/bin").await?;
    /// # Ok(()) }
    /// ```
    pub async fn create_dir_all(&self, path: impl AsRef<Path>) -> Result<()> {
        let target = Target::new(self, "create_dir_all", path.as_ref())?;
        target
            .call_done(FsOp::CreateDir {
                path: target.wire_path(),
                mode: DIR_MODE,
                parents: true,
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send + 'static>() {}

    #[test]
    fn streams_can_move_between_tasks() {
        assert_send::<GuestFileReader>();
        assert_send::<GuestFileWriter>();
    }

    #[test]
    fn wire_metadata_becomes_system_time() {
        let wire = |secs, nanos| FileMeta {
            file_type: FileType::File,
            len: 3,
            mode: 0o100644,
            uid: 0,
            gid: 0,
            mtime_secs: secs,
            mtime_nanos: nanos,
        };
        let meta = Metadata::from_wire(wire(1_700_000_000, 5));
        assert_eq!(meta.modified, UNIX_EPOCH + Duration::new(1_700_000_000, 5));
        assert_eq!(meta.mode, 0o644);
        assert!(meta.is_file());
        let before = Metadata::from_wire(wire(-10, 500_000_000));
        assert_eq!(
            before.modified,
            UNIX_EPOCH - Duration::from_secs(10) + Duration::from_millis(500)
        );
    }

    #[test]
    fn io_errors_keep_the_typed_error() {
        let err = to_io(Error::Fs {
            op: "read_file",
            path: "/x".into(),
            kind: FsErrorKind::IsADirectory,
            message: "read /x: Is a directory (os error 21)".into(),
        });
        assert_eq!(err.kind(), io::ErrorKind::IsADirectory);
        let inner = err.get_ref().unwrap().downcast_ref::<Error>().unwrap();
        assert_eq!(inner.fs_kind(), Some(FsErrorKind::IsADirectory));
        assert_eq!(
            inner.to_string(),
            "read_file \"/x\" in the guest failed: read /x: Is a directory (os error 21)"
        );
    }
}
