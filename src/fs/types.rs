//! The values a [`VirtualFs`](super::VirtualFs) takes and returns: inode numbers, attributes,
//! directory entries, errors as errno values.

use std::ffi::OsString;
use std::time::{Duration, SystemTime};

/// An inode number: stable for the life of the file (the guest caches it, `ls -i` shows it,
/// hard links share it). [`InodeId::ROOT`] is the mount's root directory; `0` is never valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InodeId(pub u64);

impl InodeId {
    /// The root directory of every mount.
    pub const ROOT: InodeId = InodeId(1);
}

/// A handle an implementation returned from `open`, `create` or `opendir`, given back on every
/// read, write and release of that open file. Its meaning is the implementation's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileHandle(pub u64);

/// What kind of file an inode is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Directory,
    /// A symbolic link.
    Symlink,
    /// A named pipe.
    Fifo,
    /// A unix socket's name.
    Socket,
    /// A character device (its number in [`Attr::rdev`]).
    CharDevice,
    /// A block device (its number in [`Attr::rdev`]).
    BlockDevice,
}

impl FileKind {
    /// The `S_IFMT` bits of this kind.
    pub fn mode_bits(self) -> u32 {
        match self {
            FileKind::File => libc::S_IFREG,
            FileKind::Directory => libc::S_IFDIR,
            FileKind::Symlink => libc::S_IFLNK,
            FileKind::Fifo => libc::S_IFIFO,
            FileKind::Socket => libc::S_IFSOCK,
            FileKind::CharDevice => libc::S_IFCHR,
            FileKind::BlockDevice => libc::S_IFBLK,
        }
    }

    /// The kind whose `S_IFMT` bits `mode` carries, if any.
    pub fn from_mode(mode: u32) -> Option<Self> {
        Some(match mode & libc::S_IFMT {
            libc::S_IFREG => FileKind::File,
            libc::S_IFDIR => FileKind::Directory,
            libc::S_IFLNK => FileKind::Symlink,
            libc::S_IFIFO => FileKind::Fifo,
            libc::S_IFSOCK => FileKind::Socket,
            libc::S_IFCHR => FileKind::CharDevice,
            libc::S_IFBLK => FileKind::BlockDevice,
            _ => return None,
        })
    }

    /// The `DT_*` value a directory listing gives this kind.
    pub fn dirent_type(self) -> u32 {
        (self.mode_bits() >> 12) & 0o17
    }
}

/// An inode's metadata, as `stat(2)` shows it in the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attr {
    /// The inode number.
    pub ino: InodeId,
    /// What kind of file.
    pub kind: FileKind,
    /// Permission bits (`0o7777`: including setuid, setgid, sticky).
    pub perm: u32,
    /// Number of hard links.
    pub nlink: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Size in bytes (a symlink: its target's length).
    pub size: u64,
    /// 512-byte blocks allocated.
    pub blocks: u64,
    /// Last access.
    pub atime: SystemTime,
    /// Last change of contents.
    pub mtime: SystemTime,
    /// Last change of metadata.
    pub ctime: SystemTime,
    /// Device number of a device node.
    pub rdev: u32,
}

/// A change to an inode's metadata (`chmod`, `chown`, `truncate`, `utimes`): every `None`
/// leaves that field alone. An implementation applies all fields or none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetAttr {
    /// New permission bits (`0o7777`).
    pub perm: Option<u32>,
    /// New owner.
    pub uid: Option<u32>,
    /// New group.
    pub gid: Option<u32>,
    /// New size: truncate or extend with zeros.
    pub size: Option<u64>,
    /// New access time.
    pub atime: Option<TimeOrNow>,
    /// New modification time.
    pub mtime: Option<TimeOrNow>,
    /// The open file the change came through (`ftruncate`), if any.
    pub handle: Option<FileHandle>,
}

/// A time to set: a given instant or the implementation's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeOrNow {
    /// This instant.
    At(SystemTime),
    /// Now.
    Now,
}

impl TimeOrNow {
    /// The instant this stands for.
    pub fn resolve(self) -> SystemTime {
        match self {
            TimeOrNow::At(at) => at,
            TimeOrNow::Now => SystemTime::now(),
        }
    }
}

/// A name found in a directory: the inode and its attributes, and how long the guest may cache
/// each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The inode's attributes (its number included).
    pub attr: Attr,
    /// A generation number: an inode number reused for another file must come with a higher
    /// generation. 0 is fine for implementations that never reuse numbers.
    pub generation: u64,
}

/// One directory listing entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// The entry's inode.
    pub ino: InodeId,
    /// The cookie that resumes the listing just after this entry: given back as
    /// `readdir`'s `offset`. Never 0 (0 means "from the start").
    pub offset: u64,
    /// What kind of file.
    pub kind: FileKind,
    /// The name (no `/`, no NUL; `.` and `..` included if the implementation lists them).
    pub name: OsString,
}

/// Filesystem-wide numbers for `statfs(2)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatFs {
    /// Total blocks of `block_size` bytes.
    pub blocks: u64,
    /// Free blocks.
    pub blocks_free: u64,
    /// Free blocks for unprivileged users.
    pub blocks_available: u64,
    /// Total inodes.
    pub files: u64,
    /// Free inodes.
    pub files_free: u64,
    /// Block size.
    pub block_size: u32,
    /// Longest name.
    pub name_max: u32,
}

/// Who asked: the guest process's credentials. Implementations use them to own new files
/// (permission checks are the guest kernel's: mounts use `default_permissions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Caller {
    /// Effective user id in the guest.
    pub uid: u32,
    /// Effective group id in the guest.
    pub gid: u32,
    /// Process id in the guest.
    pub pid: u32,
}

/// `renameat2(2)` flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RenameFlags {
    /// `RENAME_NOREPLACE`: fail with `EEXIST` if the new name exists.
    pub no_replace: bool,
    /// `RENAME_EXCHANGE`: swap the two names atomically (both must exist).
    pub exchange: bool,
}

/// How a file is opened: the access mode and the flags an implementation may care about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFlags(pub i32);

impl OpenFlags {
    /// Opened for reading.
    pub fn read(self) -> bool {
        matches!(self.0 & libc::O_ACCMODE, libc::O_RDONLY | libc::O_RDWR)
    }

    /// Opened for writing.
    pub fn write(self) -> bool {
        matches!(self.0 & libc::O_ACCMODE, libc::O_WRONLY | libc::O_RDWR)
    }

    /// `O_TRUNC`.
    pub fn truncate(self) -> bool {
        self.0 & libc::O_TRUNC != 0
    }

    /// `O_APPEND`.
    pub fn append(self) -> bool {
        self.0 & libc::O_APPEND != 0
    }

    /// `O_EXCL` (with create).
    pub fn exclusive(self) -> bool {
        self.0 & libc::O_EXCL != 0
    }
}

/// How long the guest may cache what a reply said before asking again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachePolicy {
    /// How long a name → inode answer (or a "no such name") stays valid.
    pub entry_timeout: Duration,
    /// How long an inode's attributes stay valid.
    pub attr_timeout: Duration,
}

/// A filesystem operation failed: an errno value, which the guest's call returns as is.
///
/// ```
/// use krunbox::fs::FsError;
///
/// let err = FsError::from(std::io::Error::from(std::io::ErrorKind::NotFound));
/// assert_eq!(err, FsError::NOT_FOUND);
/// assert_eq!(err.errno(), libc::ENOENT);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FsError(i32);

impl FsError {
    /// `ENOENT`.
    pub const NOT_FOUND: FsError = FsError(libc::ENOENT);
    /// `EEXIST`.
    pub const EXISTS: FsError = FsError(libc::EEXIST);
    /// `ENOTDIR`.
    pub const NOT_DIRECTORY: FsError = FsError(libc::ENOTDIR);
    /// `EISDIR`.
    pub const IS_DIRECTORY: FsError = FsError(libc::EISDIR);
    /// `ENOTEMPTY`.
    pub const NOT_EMPTY: FsError = FsError(libc::ENOTEMPTY);
    /// `EINVAL`.
    pub const INVALID: FsError = FsError(libc::EINVAL);
    /// `EPERM`.
    pub const NOT_PERMITTED: FsError = FsError(libc::EPERM);
    /// `EACCES`.
    pub const ACCESS_DENIED: FsError = FsError(libc::EACCES);
    /// `EROFS`.
    pub const READ_ONLY: FsError = FsError(libc::EROFS);
    /// `ENOSPC`.
    pub const NO_SPACE: FsError = FsError(libc::ENOSPC);
    /// `ENOSYS`: the implementation does not do this operation.
    pub const UNSUPPORTED: FsError = FsError(libc::ENOSYS);
    /// `EOPNOTSUPP`.
    pub const NOT_SUPPORTED: FsError = FsError(libc::EOPNOTSUPP);
    /// `ENODATA`: no such extended attribute.
    pub const NO_DATA: FsError = FsError(libc::ENODATA);
    /// `ERANGE`: a reply larger than the caller's buffer.
    pub const RANGE: FsError = FsError(libc::ERANGE);
    /// `ENAMETOOLONG`.
    pub const NAME_TOO_LONG: FsError = FsError(libc::ENAMETOOLONG);
    /// `EBADF`.
    pub const BAD_HANDLE: FsError = FsError(libc::EBADF);
    /// `EIO`.
    pub const IO: FsError = FsError(libc::EIO);
    /// `EXDEV`.
    pub const CROSS_DEVICE: FsError = FsError(libc::EXDEV);
    /// `ELOOP`.
    pub const LOOP: FsError = FsError(libc::ELOOP);
    /// `EMLINK`.
    pub const TOO_MANY_LINKS: FsError = FsError(libc::EMLINK);
    /// `EFBIG`.
    pub const TOO_BIG: FsError = FsError(libc::EFBIG);

    /// An error with this errno value; anything not a valid errno (`<= 0` or past 4095)
    /// becomes `EIO`.
    pub fn from_errno(errno: i32) -> Self {
        if (1..4096).contains(&errno) {
            FsError(errno)
        } else {
            FsError::IO
        }
    }

    /// The errno value.
    pub fn errno(self) -> i32 {
        self.0
    }
}

impl std::fmt::Debug for FsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FsError({})", std::io::Error::from_raw_os_error(self.0))
    }
}

impl std::fmt::Display for FsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::io::Error::from_raw_os_error(self.0).fmt(f)
    }
}

impl std::error::Error for FsError {}

impl From<std::io::Error> for FsError {
    fn from(err: std::io::Error) -> Self {
        match err.raw_os_error() {
            Some(errno) => FsError::from_errno(errno),
            None => match err.kind() {
                std::io::ErrorKind::NotFound => FsError::NOT_FOUND,
                std::io::ErrorKind::PermissionDenied => FsError::ACCESS_DENIED,
                std::io::ErrorKind::AlreadyExists => FsError::EXISTS,
                std::io::ErrorKind::InvalidInput => FsError::INVALID,
                std::io::ErrorKind::Unsupported => FsError::NOT_SUPPORTED,
                _ => FsError::IO,
            },
        }
    }
}

/// The result of a filesystem operation.
pub type FsResult<T> = std::result::Result<T, FsError>;
