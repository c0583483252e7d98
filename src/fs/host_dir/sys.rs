//! The system calls [`HostDir`](super::HostDir) makes, each relative to a descriptor it holds,
//! each returning `io::Result`. Nothing here takes a path built from the guest's input: names
//! are single components (checked by the caller), and every resolution goes through
//! [`openat2`] with [`RESOLVE`].
//!
//! Two families of calls act on an inode given only its `O_PATH` descriptor:
//!
//! - the kernel's own "empty path" forms (`fchmodat2`, `utimensat`, `linkat` with
//!   `AT_EMPTY_PATH`), used first: they name the inode by the descriptor, nothing else;
//! - where a kernel lacks those (`fchmodat2` is Linux 6.6; `linkat(AT_EMPTY_PATH)` needs
//!   `CAP_DAC_READ_SEARCH`), and to open a regular file for I/O (no kernel reopens an `O_PATH`
//!   descriptor otherwise), the descriptor's own entry in `/proc/self/fd` (see [`ProcFd`]).

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// How every name is resolved: beneath the descriptor it is relative to, no symlinks (a
/// trailing one is opened itself with `O_PATH | O_NOFOLLOW`), no magic links, no mount
/// crossings.
pub(super) const RESOLVE: u64 = libc::RESOLVE_BENEATH
    | libc::RESOLVE_NO_MAGICLINKS
    | libc::RESOLVE_NO_SYMLINKS
    | libc::RESOLVE_NO_XDEV;

const EMPTY: &CStr = c"";
const DOT: &CStr = c".";

fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Runs `call` again while it fails with `EINTR`.
fn retry<T>(mut call: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    loop {
        match call() {
            Err(err) if err.raw_os_error() == Some(libc::EINTR) => continue,
            result => return result,
        }
    }
}

fn errno_is(err: &io::Error, errnos: &[i32]) -> bool {
    err.raw_os_error().is_some_and(|e| errnos.contains(&e))
}

/// `openat2(dir, name, flags | O_CLOEXEC, mode)` resolved with [`RESOLVE`]. `EAGAIN` (a
/// concurrent rename seen during resolution) is retried a few times.
pub(super) fn openat2(
    dir: BorrowedFd<'_>,
    name: &CStr,
    flags: i32,
    mode: u32,
) -> io::Result<OwnedFd> {
    // open_how is non_exhaustive: built from zeroes, as the kernel wants unused bytes.
    // SAFETY: open_how is plain integers; all-zero is a valid value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u32 as u64;
    how.mode = if flags & (libc::O_CREAT | libc::O_TMPFILE) != 0 {
        u64::from(mode)
    } else {
        0
    };
    how.resolve = RESOLVE;
    let mut again = 0;
    loop {
        // SAFETY: the name is NUL-terminated, `how` lives across the call, its size is given.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir.as_raw_fd(),
                name.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if ret >= 0 {
            // SAFETY: the kernel returned a new descriptor we now own.
            return Ok(unsafe { OwnedFd::from_raw_fd(ret as RawFd) });
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) if again < 8 => again += 1,
            _ => return Err(err),
        }
    }
}

/// Opens the directory `dir` itself (an `O_PATH` descriptor of a directory) for reading:
/// `openat2(dir, ".")`, which resolves to `dir` and nothing else.
pub(super) fn open_dir(dir: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    openat2(dir, DOT, libc::O_RDONLY | libc::O_DIRECTORY, 0)
}

/// `fstat`, which works on `O_PATH` descriptors (and on a symlink's: its own metadata).
pub(super) fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `st` is written by the kernel on success.
    check(unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) })?;
    // SAFETY: fstat succeeded.
    Ok(unsafe { st.assume_init() })
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`: a name's own metadata (used for directory
/// entries whose type the listing does not give).
pub(super) fn fstatat_nofollow(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: as fstat; the name is NUL-terminated.
    check(unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            st.as_mut_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })?;
    // SAFETY: fstatat succeeded.
    Ok(unsafe { st.assume_init() })
}

/// `fstatvfs` (works on `O_PATH` descriptors since Linux 3.12).
pub(super) fn fstatvfs(fd: BorrowedFd<'_>) -> io::Result<libc::statvfs> {
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: written by the call on success.
    check(unsafe { libc::fstatvfs(fd.as_raw_fd(), st.as_mut_ptr()) })?;
    // SAFETY: fstatvfs succeeded.
    Ok(unsafe { st.assume_init() })
}

/// The target of a symlink given by its `O_PATH | O_NOFOLLOW` descriptor.
pub(super) fn readlink(fd: BorrowedFd<'_>) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
    // SAFETY: the buffer is as long as we say.
    let len = unsafe {
        libc::readlinkat(
            fd.as_raw_fd(),
            EMPTY.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if len < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(len as usize);
    Ok(buf)
}

pub(super) fn mkdirat(dir: BorrowedFd<'_>, name: &CStr, mode: u32) -> io::Result<()> {
    // SAFETY: NUL-terminated name.
    check(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode) }).map(drop)
}

pub(super) fn mknodat(dir: BorrowedFd<'_>, name: &CStr, mode: u32) -> io::Result<()> {
    // Never a device: the caller passes only regular, fifo and socket kinds; rdev is 0.
    // SAFETY: NUL-terminated name.
    check(unsafe { libc::mknodat(dir.as_raw_fd(), name.as_ptr(), mode, 0) }).map(drop)
}

pub(super) fn symlinkat(target: &CStr, dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    // SAFETY: NUL-terminated strings.
    check(unsafe { libc::symlinkat(target.as_ptr(), dir.as_raw_fd(), name.as_ptr()) }).map(drop)
}

pub(super) fn unlinkat(dir: BorrowedFd<'_>, name: &CStr, flags: i32) -> io::Result<()> {
    // SAFETY: NUL-terminated name.
    check(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), flags) }).map(drop)
}

pub(super) fn renameat2(
    dir: BorrowedFd<'_>,
    name: &CStr,
    new_dir: BorrowedFd<'_>,
    new_name: &CStr,
    flags: u32,
) -> io::Result<()> {
    // The raw system call: libc's wrapper is glibc 2.28+ only.
    // SAFETY: NUL-terminated names.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            dir.as_raw_fd(),
            name.as_ptr(),
            new_dir.as_raw_fd(),
            new_name.as_ptr(),
            flags,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

pub(super) fn ftruncate(fd: BorrowedFd<'_>, size: u64) -> io::Result<()> {
    let size = i64::try_from(size).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    retry(|| {
        // SAFETY: plain call.
        check(unsafe { libc::ftruncate(fd.as_raw_fd(), size) }).map(drop)
    })
}

pub(super) fn fchmod(fd: BorrowedFd<'_>, mode: u32) -> io::Result<()> {
    // SAFETY: plain call.
    check(unsafe { libc::fchmod(fd.as_raw_fd(), mode) }).map(drop)
}

/// `fallocate(2)` of `fd` (`mode` 0 or `FALLOC_FL_KEEP_SIZE`, checked by the caller).
pub(super) fn fallocate(fd: BorrowedFd<'_>, mode: i32, offset: u64, length: u64) -> io::Result<()> {
    let offset = i64::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    let length = i64::try_from(length).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: a plain syscall on a descriptor we own; no pointers.
    let result = unsafe { libc::fallocate(fd.as_raw_fd(), mode, offset, length) };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

pub(super) fn fsync(fd: BorrowedFd<'_>, data_only: bool) -> io::Result<()> {
    retry(|| {
        // SAFETY: plain calls.
        check(unsafe {
            if data_only {
                libc::fdatasync(fd.as_raw_fd())
            } else {
                libc::fsync(fd.as_raw_fd())
            }
        })
        .map(drop)
    })
}

/// Reads up to `size` bytes at `offset`: fewer only at the end of the file.
pub(super) fn pread_full(fd: BorrowedFd<'_>, offset: u64, size: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; size];
    let mut done = 0;
    while done < size {
        let at = offset
            .checked_add(done as u64)
            .and_then(|at| i64::try_from(at).ok())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: the slice from `done` is in bounds.
        let n = unsafe {
            libc::pread(
                fd.as_raw_fd(),
                buf[done..].as_mut_ptr().cast(),
                size - done,
                at,
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            break;
        }
        done += n as usize;
    }
    buf.truncate(done);
    Ok(buf)
}

/// One directory entry as the host lists it.
pub(super) struct RawEntry {
    pub name: CString,
    pub ino: u64,
    /// The `S_IFMT` bits, when the listing gives them.
    pub kind: Option<u32>,
    /// Where the listing goes on after this entry: the filesystem's own cookie (`d_off`), which
    /// `lseek` on the directory takes back.
    pub next: u64,
}

/// The bytes of `getdents64` records read at once: about a hundred entries of long names, many
/// more of short ones.
const DIRENT_BUFFER: usize = 32 * 1024;

/// At most `max` entries of the directory open as `dir` (an `O_RDONLY` descriptor kept for the
/// guest's open directory), from the filesystem's cookie `from` on (0: the start); `.` and `..`
/// included. One `getdents64` call, so the host holds one buffer whatever the directory's size;
/// the caller asks again from the last entry's `next`. The descriptor's position is set here
/// every time (`lseek` to the same position is a no-op, and keeps a tmpfs cursor in place
/// while entries before it are removed).
pub(super) fn read_dir_at(
    dir: BorrowedFd<'_>,
    from: u64,
    max: usize,
    room: usize,
) -> io::Result<Vec<RawEntry>> {
    // linux_dirent64: d_ino u64, d_off i64, d_reclen u16, d_type u8, d_name NUL-terminated.
    const NAME: usize = 19;
    let from =
        libc::off_t::try_from(from).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: a plain lseek on a descriptor we borrow.
    if unsafe { libc::lseek(dir.as_raw_fd(), from, libc::SEEK_SET) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // A record here is never larger than its FUSE entry, so `room` bytes read at least as
    // many entries as fit the reply.
    let mut buf = vec![0u8; DIRENT_BUFFER.min(room.max(NAME + 256))];
    let len = retry(|| {
        // SAFETY: the buffer is as long as we say.
        let len = unsafe {
            libc::syscall(
                libc::SYS_getdents64,
                dir.as_raw_fd(),
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        if len < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(len as usize)
        }
    })?;
    let mut entries: Vec<RawEntry> = Vec::new();
    let mut at = 0;
    let mut used = 0;
    while at < len && entries.len() < max {
        let record = &buf[at..len];
        if record.len() <= NAME {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        let reclen = u16::from_ne_bytes([record[16], record[17]]) as usize;
        if reclen <= NAME || reclen > record.len() {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        let ino = u64::from_ne_bytes(record[..8].try_into().expect("8 bytes"));
        let next = i64::from_ne_bytes(record[8..16].try_into().expect("8 bytes"));
        let name = CStr::from_bytes_until_nul(&record[NAME..reclen])
            .map_err(|_| io::Error::from_raw_os_error(libc::EIO))?;
        let size = crate::fs::fuse::reply::dirent_size(name.to_bytes().len());
        if used + size > room && !entries.is_empty() {
            break;
        }
        used += size;
        let kind = match record[18] {
            libc::DT_FIFO => Some(libc::S_IFIFO),
            libc::DT_CHR => Some(libc::S_IFCHR),
            libc::DT_DIR => Some(libc::S_IFDIR),
            libc::DT_BLK => Some(libc::S_IFBLK),
            libc::DT_REG => Some(libc::S_IFREG),
            libc::DT_LNK => Some(libc::S_IFLNK),
            libc::DT_SOCK => Some(libc::S_IFSOCK),
            _ => None,
        };
        entries.push(RawEntry {
            name: name.to_owned(),
            ino,
            kind,
            // A cookie is never negative (lseek could not take it back).
            next: u64::try_from(next).map_err(|_| io::Error::from_raw_os_error(libc::EIO))?,
        });
        at += reclen;
    }
    if at < len {
        // Read further than is returned: the position goes back to where the guest will ask
        // next, so that ask moves nothing (on tmpfs before Linux 6.6 a move walks the
        // directory from its start).
        if let Some(last) = entries.last() {
            // SAFETY: a plain lseek on a descriptor we borrow; the cookie came from the
            // filesystem (it fits an off_t: checked when it was read).
            if unsafe { libc::lseek(dir.as_raw_fd(), last.next as libc::off_t, libc::SEEK_SET) } < 0
            {
                return Err(io::Error::last_os_error());
            }
        }
    }
    // Entries whose type the filesystem did not give: asked one by one, never following.
    for entry in entries.iter_mut().filter(|entry| entry.kind.is_none()) {
        if let Ok(st) = fstatat_nofollow(dir, &entry.name) {
            entry.kind = Some(st.st_mode & libc::S_IFMT);
        }
    }
    Ok(entries)
}

// Extended attributes: these need a descriptor opened for I/O (Linux refuses `O_PATH` ones).

pub(super) fn fgetxattr(fd: BorrowedFd<'_>, name: &CStr) -> io::Result<Vec<u8>> {
    let mut buf: Vec<u8> = Vec::new();
    loop {
        // SAFETY: the buffer is as long as we say (a null pointer with size 0 asks the size).
        let len = unsafe {
            libc::fgetxattr(
                fd.as_raw_fd(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if len >= 0 {
            let len = len as usize;
            if buf.is_empty() && len > 0 {
                buf.resize(len, 0);
                continue;
            }
            buf.truncate(len);
            return Ok(buf);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ERANGE) && buf.len() < XATTR_SIZE_MAX {
            // Grew between the two calls.
            buf.resize((buf.len() * 2).clamp(256, XATTR_SIZE_MAX), 0);
            continue;
        }
        return Err(err);
    }
}

/// The longest value Linux stores (`XATTR_SIZE_MAX`).
pub(super) const XATTR_SIZE_MAX: usize = 65536;
/// The longest name list Linux returns (`XATTR_LIST_MAX`).
pub(super) const XATTR_LIST_MAX: usize = 65536;

pub(super) fn fsetxattr(
    fd: BorrowedFd<'_>,
    name: &CStr,
    value: &[u8],
    flags: i32,
) -> io::Result<()> {
    // SAFETY: the value is as long as we say.
    check(unsafe {
        libc::fsetxattr(
            fd.as_raw_fd(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            flags,
        )
    })
    .map(drop)
}

pub(super) fn fremovexattr(fd: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    // SAFETY: NUL-terminated name.
    check(unsafe { libc::fremovexattr(fd.as_raw_fd(), name.as_ptr()) }).map(drop)
}

/// The names of the inode's extended attributes, each without its NUL.
pub(super) fn flistxattr(fd: BorrowedFd<'_>) -> io::Result<Vec<Vec<u8>>> {
    let mut buf: Vec<u8> = Vec::new();
    let len = loop {
        // SAFETY: the buffer is as long as we say.
        let len = unsafe { libc::flistxattr(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if len >= 0 {
            let len = len as usize;
            if buf.is_empty() && len > 0 {
                buf.resize(len, 0);
                continue;
            }
            break len;
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ERANGE) && buf.len() < XATTR_LIST_MAX {
            buf.resize((buf.len() * 2).clamp(256, XATTR_LIST_MAX), 0);
            continue;
        }
        return Err(err);
    };
    buf.truncate(len);
    Ok(buf
        .split(|&b| b == 0)
        .filter(|name| !name.is_empty())
        .map(<[u8]>::to_vec)
        .collect())
}

/// Access to the descriptors' own entries in `/proc/self/fd`, for what a kernel offers no
/// other way to do on an `O_PATH` descriptor.
///
/// Why this is safe where a path is not: `/proc/self/fd/N` is a *magic link* to the open file
/// `N` itself (the same mount and dentry), not to a name; following it resolves nothing, so no
/// rename, symlink or mount in the shared directory can change where it leads, and the
/// descriptor keeps the inode alive. `N` is a number we print from a descriptor we hold for the
/// whole call, so it cannot be closed and reused meanwhile. The `fd` directory is opened once,
/// from the host's `/proc`, and checked to be procfs (not something mounted over it).
/// The guest's own magic links are never followed: every name it gives is resolved with
/// `RESOLVE_NO_MAGICLINKS`. Following our own link lands on the inode and stops there, even for
/// a symlink (the kernel does not follow a symlink a magic link jumped to: see the tests).
/// Callers check the inode's type (from `fstat` of the pinned descriptor: an inode's type
/// never changes) before opening it, so a device node is never opened.
pub(super) struct ProcFd(OwnedFd);

impl ProcFd {
    pub(super) fn open() -> io::Result<ProcFd> {
        // SAFETY: NUL-terminated path; a new descriptor on success.
        let fd = check(unsafe {
            libc::open(
                c"/proc/self/fd".as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        })?;
        // SAFETY: we own the new descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut fs = std::mem::MaybeUninit::<libc::statfs>::uninit();
        // SAFETY: written on success.
        check(unsafe { libc::fstatfs(fd.as_raw_fd(), fs.as_mut_ptr()) })?;
        // SAFETY: fstatfs succeeded.
        let fs = unsafe { fs.assume_init() };
        // f_type's width differs between targets.
        #[allow(clippy::unnecessary_cast)]
        if fs.f_type as i64 != libc::PROC_SUPER_MAGIC as i64 {
            return Err(io::Error::other("/proc/self/fd is not procfs"));
        }
        Ok(ProcFd(fd))
    }

    fn name(fd: BorrowedFd<'_>) -> CString {
        CString::new(fd.as_raw_fd().to_string()).expect("digits have no NUL")
    }

    /// Opens the inode `fd` refers to, for I/O (`flags` without `O_CREAT`; never
    /// `O_NOFOLLOW`, which would refuse the magic link itself).
    pub(super) fn reopen(&self, fd: BorrowedFd<'_>, flags: i32) -> io::Result<OwnedFd> {
        let name = Self::name(fd);
        retry(|| {
            // SAFETY: NUL-terminated name; a new descriptor on success.
            let ret = check(unsafe {
                libc::openat(
                    self.0.as_raw_fd(),
                    name.as_ptr(),
                    flags | libc::O_CLOEXEC | libc::O_NOCTTY,
                )
            })?;
            // SAFETY: we own the new descriptor.
            Ok(unsafe { OwnedFd::from_raw_fd(ret) })
        })
    }

    fn chmod(&self, fd: BorrowedFd<'_>, mode: u32) -> io::Result<()> {
        let name = Self::name(fd);
        // SAFETY: NUL-terminated name.
        check(unsafe { libc::fchmodat(self.0.as_raw_fd(), name.as_ptr(), mode, 0) }).map(drop)
    }

    fn utimens(&self, fd: BorrowedFd<'_>, times: &[libc::timespec; 2]) -> io::Result<()> {
        let name = Self::name(fd);
        // SAFETY: NUL-terminated name, two timespecs.
        check(unsafe { libc::utimensat(self.0.as_raw_fd(), name.as_ptr(), times.as_ptr(), 0) })
            .map(drop)
    }

    fn link(&self, fd: BorrowedFd<'_>, new_dir: BorrowedFd<'_>, new_name: &CStr) -> io::Result<()> {
        let name = Self::name(fd);
        // SAFETY: NUL-terminated names.
        check(unsafe {
            libc::linkat(
                self.0.as_raw_fd(),
                name.as_ptr(),
                new_dir.as_raw_fd(),
                new_name.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        })
        .map(drop)
    }
}

/// Sets the permission bits of the inode `fd` (an `O_PATH` descriptor) refers to:
/// `fchmodat2(fd, "", AT_EMPTY_PATH)`, or through `/proc/self/fd` before Linux 6.6.
pub(super) fn chmod(proc: &ProcFd, fd: BorrowedFd<'_>, mode: u32) -> io::Result<()> {
    // SAFETY: NUL-terminated empty name.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_fchmodat2,
            fd.as_raw_fd(),
            EMPTY.as_ptr(),
            mode,
            libc::AT_EMPTY_PATH,
        )
    };
    if ret == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if errno_is(&err, &[libc::ENOSYS, libc::EINVAL]) {
        return proc.chmod(fd, mode);
    }
    Err(err)
}

/// Sets the times of the inode `fd` refers to (never what a symlink points to):
/// `utimensat(fd, "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`, or through `/proc/self/fd` on
/// kernels without the empty-path form.
pub(super) fn utimens(
    proc: &ProcFd,
    fd: BorrowedFd<'_>,
    times: &[libc::timespec; 2],
) -> io::Result<()> {
    // SAFETY: NUL-terminated empty name, two timespecs.
    let ret = unsafe {
        libc::utimensat(
            fd.as_raw_fd(),
            EMPTY.as_ptr(),
            times.as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if ret == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if errno_is(&err, &[libc::EINVAL, libc::ENOENT]) {
        return proc.utimens(fd, times);
    }
    Err(err)
}

/// Gives the inode `fd` refers to another name, `new_dir/new_name`:
/// `linkat(fd, "", AT_EMPTY_PATH)` where the process may (`CAP_DAC_READ_SEARCH`), else
/// through `/proc/self/fd` (which links the inode itself, a symlink included, as the tests
/// show).
pub(super) fn link(
    proc: &ProcFd,
    fd: BorrowedFd<'_>,
    new_dir: BorrowedFd<'_>,
    new_name: &CStr,
) -> io::Result<()> {
    // SAFETY: NUL-terminated names.
    let ret = unsafe {
        libc::linkat(
            fd.as_raw_fd(),
            EMPTY.as_ptr(),
            new_dir.as_raw_fd(),
            new_name.as_ptr(),
            libc::AT_EMPTY_PATH,
        )
    };
    if ret == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if errno_is(&err, &[libc::ENOENT, libc::EPERM]) {
        return proc.link(fd, new_dir, new_name);
    }
    Err(err)
}

#[cfg(test)]
mod tests {
    //! The `/proc/self/fd` fallbacks, called directly (a kernel this new never needs them).
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn opath(path: &std::path::Path) -> OwnedFd {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: NUL-terminated path.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        assert!(fd >= 0, "{}", io::Error::last_os_error());
        // SAFETY: new descriptor.
        unsafe { OwnedFd::from_raw_fd(fd) }
    }

    #[test]
    fn proc_fallbacks_act_on_a_symlink_itself_never_its_target() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::write(&outside, b"secret").unwrap();
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o644)).unwrap();
        let before = std::fs::metadata(&outside).unwrap();
        let inside = dir.path().join("inside");
        std::fs::create_dir(&inside).unwrap();
        std::os::unix::fs::symlink(&outside, inside.join("link")).unwrap();
        let proc = ProcFd::open().unwrap();
        let link_fd = opath(&inside.join("link"));
        let dir_fd = opath(&inside);

        // Reopening a symlink's descriptor for I/O fails: it is not followed.
        assert!(proc.reopen(link_fd.as_fd(), libc::O_RDWR).is_err());
        // chmod of a symlink: refused, the target untouched.
        assert!(proc.chmod(link_fd.as_fd(), 0o777).is_err());
        // Times: set on the link itself.
        let times = [
            libc::timespec {
                tv_sec: 7,
                tv_nsec: 0,
            },
            libc::timespec {
                tv_sec: 7,
                tv_nsec: 0,
            },
        ];
        proc.utimens(link_fd.as_fd(), &times).unwrap();
        assert_eq!(
            std::fs::symlink_metadata(inside.join("link"))
                .unwrap()
                .mtime(),
            7
        );
        // A hard link of the symlink, not of its target.
        proc.link(link_fd.as_fd(), dir_fd.as_fd(), c"link2")
            .unwrap();
        let linked = std::fs::symlink_metadata(inside.join("link2")).unwrap();
        assert!(linked.file_type().is_symlink());

        let after = std::fs::metadata(&outside).unwrap();
        assert_eq!(after.mode(), before.mode());
        assert_eq!(after.mtime(), before.mtime());
        assert_eq!(after.nlink(), 1);
        assert_eq!(std::fs::read(&outside).unwrap(), b"secret");
    }

    #[test]
    fn proc_fallbacks_act_on_the_pinned_file_after_a_rename() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a"), b"data").unwrap();
        let fd = opath(&dir.path().join("a"));
        let dir_fd = opath(dir.path());
        std::fs::rename(dir.path().join("a"), dir.path().join("b")).unwrap();
        std::fs::write(dir.path().join("a"), b"other").unwrap();
        let proc = ProcFd::open().unwrap();
        proc.chmod(fd.as_fd(), 0o600).unwrap();
        assert_eq!(
            std::fs::metadata(dir.path().join("b")).unwrap().mode() & 0o777,
            0o600
        );
        let file = proc.reopen(fd.as_fd(), libc::O_RDONLY).unwrap();
        assert_eq!(pread_full(file.as_fd(), 0, 100).unwrap(), b"data");
        proc.link(fd.as_fd(), dir_fd.as_fd(), c"c").unwrap();
        assert_eq!(std::fs::read(dir.path().join("c")).unwrap(), b"data");
    }

    #[test]
    fn openat2_refuses_dotdot_and_symlinks_on_the_way() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("root")).unwrap();
        std::os::unix::fs::symlink("/", dir.path().join("root/up")).unwrap();
        let root = opath(&dir.path().join("root"));
        assert!(openat2(root.as_fd(), c"..", libc::O_PATH, 0).is_err());
        assert!(openat2(root.as_fd(), c"up/etc", libc::O_PATH, 0).is_err());
        assert!(openat2(root.as_fd(), c"up", libc::O_RDONLY, 0).is_err());
        // The trailing symlink itself, as O_PATH | O_NOFOLLOW.
        let link = openat2(root.as_fd(), c"up", libc::O_PATH | libc::O_NOFOLLOW, 0).unwrap();
        assert_eq!(
            fstat(link.as_fd()).unwrap().st_mode & libc::S_IFMT,
            libc::S_IFLNK
        );
    }
}
