//! File operations requested by the host (see `krunbox_protocol::fs`).
//!
//! Each request runs on its own short-lived thread, so a slow disk never stalls the control
//! loop, and answers with exactly one [`FsReply`]. Reads and writes open without blocking and
//! refuse anything but a regular file (a FIFO would block the thread, `/dev/zero` never ends). Requests run
//! as guest-init runs: root. Nothing here changes the process-wide umask (commands are spawned
//! concurrently and would inherit it); exact modes are set with `fchmod`/`chmod` after creation.

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use krunbox_protocol::fs::{
    DirEntry, FileMeta, FileType, FsError, FsErrorKind, FsOk, FsOp, FsReply, FsRequest,
    MAX_DIR_ENTRIES, MAX_FILE_CHUNK,
};
use krunbox_protocol::limits::MAX_TEXT;
use krunbox_protocol::GuestMessage;
use serde_bytes::ByteBuf;

use crate::outbox::Outbox;

/// Handles one request off the control loop's thread and sends its reply.
pub fn handle(request: FsRequest, outbox: &Outbox) {
    let id = request.id;
    let thread_outbox = outbox.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("fs-{id}"))
        .spawn(move || {
            let result = run(request.op);
            thread_outbox.send(&GuestMessage::FsReply(FsReply { id, result }));
        });
    if let Err(err) = spawned {
        // Out of threads or memory: answer at once rather than run it on the control loop.
        outbox.send(&GuestMessage::FsReply(FsReply {
            id,
            result: Err(FsError {
                kind: FsErrorKind::Other,
                errno: err.raw_os_error().unwrap_or(0),
                message: format!("cannot start a thread for the file operation: {err}"),
            }),
        }));
    }
}

/// Runs one operation to completion on the calling thread.
pub fn run(op: FsOp) -> Result<FsOk, FsError> {
    match op {
        FsOp::Read { path, offset, len } => read(path_of(&path), offset, len),
        FsOp::Write {
            path,
            offset,
            data,
            mode,
            create,
            truncate,
        } => write(path_of(&path), offset, &data, mode, create, truncate),
        FsOp::Sync { path } => sync(path_of(&path)),
        FsOp::Metadata { path, follow } => metadata(path_of(&path), follow),
        FsOp::ReadDir { path, after } => read_dir(path_of(&path), after.as_ref().map(|a| &a[..])),
        FsOp::Remove { path, recursive } => remove(path_of(&path), recursive),
        FsOp::CreateDir {
            path,
            mode,
            parents,
        } => create_dir(path_of(&path), mode, parents),
        FsOp::Rename { from, to } => rename(path_of(&from), path_of(&to)),
        FsOp::Search(spec) => crate::search::search(spec),
    }
}

fn path_of(bytes: &[u8]) -> &Path {
    Path::new(OsStr::from_bytes(bytes))
}

/// The protocol's class for an errno.
pub fn error_kind(errno: i32) -> FsErrorKind {
    match errno {
        libc::ENOENT => FsErrorKind::NotFound,
        libc::EACCES | libc::EPERM | libc::EROFS => FsErrorKind::PermissionDenied,
        libc::EISDIR => FsErrorKind::IsADirectory,
        libc::ENOTDIR => FsErrorKind::NotADirectory,
        libc::EEXIST => FsErrorKind::AlreadyExists,
        libc::ENOTEMPTY => FsErrorKind::DirectoryNotEmpty,
        libc::EINVAL => FsErrorKind::InvalidInput,
        _ => FsErrorKind::Other,
    }
}

/// `"{what} {path}: {err}"`, e.g. `open /x: No such file or directory (os error 2)`, cut to
/// [`MAX_TEXT`] bytes on a character boundary.
pub fn error(what: &str, path: &Path, err: &io::Error) -> FsError {
    let errno = err.raw_os_error().unwrap_or(0);
    let kind = match err.raw_os_error() {
        Some(errno) => error_kind(errno),
        None if err.kind() == io::ErrorKind::InvalidInput => FsErrorKind::InvalidInput,
        None => FsErrorKind::Other,
    };
    FsError {
        kind,
        errno,
        message: truncate_text(format!("{what} {}: {err}", path.display()), MAX_TEXT),
    }
}

/// Cuts `text` to at most `max` bytes without splitting a character.
pub fn truncate_text(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

pub(crate) fn invalid(what: &str, path: &Path, detail: &str) -> FsError {
    FsError {
        kind: FsErrorKind::InvalidInput,
        errno: libc::EINVAL,
        message: truncate_text(format!("{what} {}: {detail}", path.display()), MAX_TEXT),
    }
}

/// What a file that is not a regular file is, for messages.
fn describe(t: fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Opens `path` with `options` and refuses anything but a regular file.
///
/// The open never blocks: `O_NONBLOCK` makes a FIFO open at once (reading) or fail with
/// `ENXIO` (writing, no reader), where a plain open would wait for the other end forever.
/// `O_NOCTTY` keeps a terminal from becoming guest-init's controlling terminal; std adds
/// `O_CLOEXEC`. Then `fstat` on the descriptor (not the path, which could be swapped) decides:
/// FIFOs, devices (`/dev/zero` never ends) and sockets are [`FsErrorKind::NotAFile`], a
/// directory [`FsErrorKind::IsADirectory`].
pub(crate) fn open_regular(path: &Path, options: &mut OpenOptions) -> Result<File, FsError> {
    let file = options
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| error("open", path, &e))?;
    let meta = file.metadata().map_err(|e| error("fstat", path, &e))?;
    let t = meta.file_type();
    if t.is_file() {
        return Ok(file);
    }
    let (kind, errno) = if t.is_dir() {
        (FsErrorKind::IsADirectory, libc::EISDIR)
    } else {
        (FsErrorKind::NotAFile, libc::EINVAL)
    };
    Err(FsError {
        kind,
        errno,
        message: truncate_text(
            format!(
                "open {}: {}, not a regular file (file operations read and write regular files \
                 only; use a command such as `head -c N` for devices and pipes)",
                path.display(),
                describe(t)
            ),
            MAX_TEXT,
        ),
    })
}

/// Reads up to `len` bytes at `offset`, looping over short reads so that a short chunk means
/// end of file (the host pipelines reads at consecutive offsets).
fn read(path: &Path, offset: u64, len: u32) -> Result<FsOk, FsError> {
    let len = len as usize;
    if len > MAX_FILE_CHUNK {
        return Err(invalid("read", path, "length exceeds the chunk limit"));
    }
    let file = open_regular(path, OpenOptions::new().read(true))?;
    let mut data = vec![0u8; len];
    let mut filled = 0;
    while filled < len {
        match file.read_at(&mut data[filled..], offset + filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(error("read", path, &e)),
        }
    }
    data.truncate(filled);
    Ok(FsOk::Data(ByteBuf::from(data)))
}

/// Opens for writing, refusing anything but a regular file (see [`open_regular`]). A file this
/// call creates gets exactly `mode` (not `mode & !umask`).
fn open_for_write(path: &Path, mode: u32, create: bool, truncate: bool) -> Result<File, FsError> {
    let mode = mode & 0o7777;
    let mut options = OpenOptions::new();
    options
        .write(true)
        .truncate(truncate)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
    if !create {
        return open_regular(path, &mut options);
    }
    let created = |file: File| {
        file.set_permissions(fs::Permissions::from_mode(mode))
            .map_err(|e| error("chmod", path, &e))?;
        Ok(file)
    };
    // Exclusive first, so we know whether the file is ours to chmod (O_EXCL always makes a
    // new regular file).
    match options.clone().create_new(true).mode(mode).open(path) {
        Ok(file) => return created(file),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(error("open", path, &e)),
    }
    match open_regular(path, &mut options.clone()) {
        // A dangling symlink "exists" for O_EXCL; like open(O_CREAT), create its target.
        Err(e) if e.kind == FsErrorKind::NotFound => {
            created(open_regular(path, options.create(true).mode(mode))?)
        }
        other => other,
    }
}

fn write(
    path: &Path,
    offset: u64,
    data: &[u8],
    mode: u32,
    create: bool,
    truncate: bool,
) -> Result<FsOk, FsError> {
    let file = open_for_write(path, mode, create, truncate)?;
    file.write_all_at(data, offset)
        .map_err(|e| error("write", path, &e))?;
    Ok(FsOk::Done)
}

fn sync(path: &Path) -> Result<FsOk, FsError> {
    let file = open_regular(path, OpenOptions::new().read(true))?;
    file.sync_all().map_err(|e| error("fsync", path, &e))?;
    Ok(FsOk::Done)
}

pub(crate) fn file_type(t: fs::FileType) -> FileType {
    if t.is_symlink() {
        FileType::Symlink
    } else if t.is_dir() {
        FileType::Dir
    } else if t.is_file() {
        FileType::File
    } else {
        FileType::Other
    }
}

fn metadata(path: &Path, follow: bool) -> Result<FsOk, FsError> {
    let (what, meta) = if follow {
        ("stat", fs::metadata(path))
    } else {
        ("lstat", fs::symlink_metadata(path))
    };
    let meta = meta.map_err(|e| error(what, path, &e))?;
    Ok(FsOk::Metadata(FileMeta {
        file_type: file_type(meta.file_type()),
        len: meta.size(),
        mode: meta.mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        mtime_secs: meta.mtime(),
        mtime_nanos: meta.mtime_nsec().clamp(0, 999_999_999) as u32,
    }))
}

/// One page of `path`'s entries after `after`, sorted by name bytes.
///
/// Every page lists the whole directory (the protocol is stateless), so listing a directory of
/// n entries costs O(n²/[`MAX_DIR_ENTRIES`]) — fine for the tens of thousands a sandbox holds.
fn read_dir(path: &Path, after: Option<&[u8]>) -> Result<FsOk, FsError> {
    let entries = fs::read_dir(path).map_err(|e| error("opendir", path, &e))?;
    let mut page = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| error("readdir", path, &e))?;
        let name = entry.file_name();
        if after.is_some_and(|after| name.as_bytes() <= after) {
            continue;
        }
        // d_type, or lstat when the filesystem does not fill it in (never follows links).
        let kind = match entry.file_type() {
            Ok(t) => file_type(t),
            // Removed between readdir and lstat: it is no longer there to list.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(_) => FileType::Other,
        };
        page.push(DirEntry {
            name: ByteBuf::from(name.into_vec()),
            file_type: kind,
        });
    }
    let complete = page.len() <= MAX_DIR_ENTRIES;
    if !complete {
        page.select_nth_unstable_by(MAX_DIR_ENTRIES, |a, b| a.name.cmp(&b.name));
        page.truncate(MAX_DIR_ENTRIES);
    }
    page.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    Ok(FsOk::Entries {
        entries: page,
        complete,
    })
}

fn remove(path: &Path, recursive: bool) -> Result<FsOk, FsError> {
    let meta = fs::symlink_metadata(path).map_err(|e| error("lstat", path, &e))?;
    let result = if meta.is_dir() {
        if recursive {
            refuse_a_tree_with_host_mounts(path)?;
            // std's remove_dir_all works with openat/unlinkat and never follows symlinks.
            fs::remove_dir_all(path).map_err(|e| error("remove tree", path, &e))
        } else {
            fs::remove_dir(path).map_err(|e| error("rmdir", path, &e))
        }
    } else {
        fs::remove_file(path).map_err(|e| error("unlink", path, &e))
    };
    result.map(|()| FsOk::Done)
}

/// Refuses, before anything is removed, a recursive removal of `/` or of a tree that is or
/// holds the mount point of one of the caller's filesystems (a virtio-fs mount: a host
/// directory or a filesystem of the caller's program), which `remove_dir_all` would walk into
/// and empty. What is inside such a mount can still be removed by naming it.
fn refuse_a_tree_with_host_mounts(path: &Path) -> Result<(), FsError> {
    let refuse = |message: String| FsError {
        kind: FsErrorKind::InvalidInput,
        errno: libc::EINVAL,
        message: truncate_text(message, MAX_TEXT),
    };
    let tree = fs::canonicalize(path).map_err(|e| error("resolve", path, &e))?;
    if tree == Path::new("/") {
        return Err(refuse(format!(
            "refusing to remove {} recursively: it is the whole root",
            path.display()
        )));
    }
    let mountinfo = read_bounded(Path::new("/proc/self/mountinfo"), MOUNTINFO_MAX)
        .map_err(|e| error("read", Path::new("/proc/self/mountinfo"), &e))?;
    for mount_point in host_mount_points(&mountinfo) {
        if mount_point.starts_with(&tree) {
            return Err(refuse(format!(
                "refusing to remove {} recursively: {} is a mount of the sandbox's (remove what is inside it instead)",
                path.display(),
                mount_point.display()
            )));
        }
    }
    Ok(())
}

/// The most of `/proc/self/mountinfo` read (a guest has a few dozen mounts, 100-odd bytes each).
const MOUNTINFO_MAX: u64 = 1 << 20;

fn read_bounded(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    File::open(path)?.take(max).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// The mount points of virtio-fs mounts in a `mountinfo` text: its fifth field, with the
/// kernel's octal escapes (`\040` for a space, ...) undone, of each line whose filesystem type
/// (the first field after `-`) is `virtiofs`.
fn host_mount_points(mountinfo: &[u8]) -> Vec<PathBuf> {
    mountinfo
        .split(|&b| b == b'\n')
        .filter_map(|line| {
            let fields: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
            let separator = fields.iter().position(|f| *f == b"-")?;
            let fstype = fields.get(separator + 1)?;
            (*fstype == b"virtiofs")
                .then(|| {
                    fields
                        .get(4)
                        .map(|field| PathBuf::from(OsStr::from_bytes(&unescape_octal(field))))
                })
                .flatten()
        })
        .collect()
}

/// Undoes the kernel's `\ooo` escapes in a `mountinfo` field.
fn unescape_octal(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        let escaped = field
            .get(i + 1..i + 4)
            .filter(|digits| field[i] == b'\\' && digits.iter().all(|d| (b'0'..=b'7').contains(d)));
        match escaped {
            Some(digits) => {
                let value = digits.iter().fold(0u32, |v, d| v * 8 + u32::from(d - b'0'));
                out.push(value as u8);
                i += 4;
            }
            None => {
                out.push(field[i]);
                i += 1;
            }
        }
    }
    out
}

/// `mkdir` with exactly `mode`.
fn mkdir(path: &Path, mode: u32) -> io::Result<()> {
    fs::DirBuilder::new().mode(mode).create(path)?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
}

/// `rename(2)`: never follows a symlink at either end (the link itself is renamed or
/// replaced), and refuses the root, which cannot be renamed, and a mount point (EBUSY).
fn rename(from: &Path, to: &Path) -> Result<FsOk, FsError> {
    fs::rename(from, to).map_err(|e| error("rename", from, &e))?;
    Ok(FsOk::Done)
}

fn create_dir(path: &Path, mode: u32, parents: bool) -> Result<FsOk, FsError> {
    let mode = mode & 0o7777;
    if !parents {
        mkdir(path, mode).map_err(|e| error("mkdir", path, &e))?;
        return Ok(FsOk::Done);
    }
    // Like `mkdir -p`, but every directory created gets `mode` (as std's recursive DirBuilder
    // does), exactly; existing directories are left alone.
    let mut missing: Vec<PathBuf> = Vec::new();
    let mut current = Some(path);
    while let Some(dir) = current {
        if dir.as_os_str().is_empty() {
            break;
        }
        match fs::metadata(dir) {
            Ok(meta) if meta.is_dir() => break,
            Ok(_) => {
                let err = io::Error::from_raw_os_error(if dir == path {
                    libc::EEXIST
                } else {
                    libc::ENOTDIR
                });
                return Err(error("mkdir", dir, &err));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => missing.push(dir.to_path_buf()),
            Err(e) => return Err(error("stat", dir, &e)),
        }
        current = dir.parent();
    }
    for dir in missing.iter().rev() {
        match mkdir(dir, mode) {
            Ok(()) => {}
            // Created concurrently by someone else: fine, as long as it is a directory.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => {}
            Err(e) => return Err(error("mkdir", dir, &e)),
        }
    }
    Ok(FsOk::Done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtio_fs_mount_points_are_read_from_mountinfo_with_escapes_undone() {
        let mountinfo = b"22 1 253:0 / / ro,relatime - erofs /dev/vda ro\n\
            30 22 0:31 / /workspace rw,relatime - virtiofs krunbox-fs-0 rw\n\
            31 22 0:32 / /my\\040data rw - virtiofs krunbox-fs-1 rw\n\
            32 22 0:33 / /tmp rw shared:1 - tmpfs tmpfs rw\n\
            garbage without a separator\n";
        assert_eq!(
            host_mount_points(mountinfo),
            vec![PathBuf::from("/workspace"), PathBuf::from("/my data")]
        );
        assert_eq!(unescape_octal(b"a\\134b\\01"), b"a\\b\\01");
    }

    fn bytes(p: &Path) -> ByteBuf {
        ByteBuf::from(p.as_os_str().as_bytes().to_vec())
    }

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("guest-init-files-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn errnos_map_to_kinds() {
        assert_eq!(error_kind(libc::ENOENT), FsErrorKind::NotFound);
        for e in [libc::EACCES, libc::EPERM, libc::EROFS] {
            assert_eq!(error_kind(e), FsErrorKind::PermissionDenied);
        }
        assert_eq!(error_kind(libc::EISDIR), FsErrorKind::IsADirectory);
        assert_eq!(error_kind(libc::ENOTDIR), FsErrorKind::NotADirectory);
        assert_eq!(error_kind(libc::EEXIST), FsErrorKind::AlreadyExists);
        assert_eq!(error_kind(libc::ENOTEMPTY), FsErrorKind::DirectoryNotEmpty);
        assert_eq!(error_kind(libc::EINVAL), FsErrorKind::InvalidInput);
        assert_eq!(error_kind(libc::EIO), FsErrorKind::Other);
    }

    #[test]
    fn messages_name_the_operation_and_path_and_stay_bounded() {
        let err = error(
            "open",
            Path::new("/x"),
            &io::Error::from_raw_os_error(libc::ENOENT),
        );
        assert_eq!(
            err.message,
            "open /x: No such file or directory (os error 2)"
        );
        assert_eq!(err.errno, libc::ENOENT);
        assert_eq!(err.kind, FsErrorKind::NotFound);
        // A long path of multi-byte characters is cut on a character boundary.
        let long = "/".to_string() + &"é".repeat(MAX_TEXT);
        let err = error(
            "open",
            Path::new(&long),
            &io::Error::from_raw_os_error(libc::ENOENT),
        );
        assert!(err.message.len() <= MAX_TEXT);
        assert!(err.message.len() >= MAX_TEXT - 1);
    }

    #[test]
    fn write_read_sync_round_trip_with_exact_mode() {
        let dir = scratch("rw");
        let file = dir.join("f");
        let write = |offset, data: &[u8], create, truncate| {
            run(FsOp::Write {
                path: bytes(&file),
                offset,
                data: ByteBuf::from(data.to_vec()),
                mode: 0o640,
                create,
                truncate,
            })
        };
        assert_eq!(write(0, b"hello\0\xff", true, true), Ok(FsOk::Done));
        assert_eq!(
            fs::metadata(&file).unwrap().permissions().mode() & 0o7777,
            0o640
        );
        assert_eq!(write(5, b"!", false, false), Ok(FsOk::Done));
        assert_eq!(fs::read(&file).unwrap(), b"hello!\xff");
        let read = |offset, len| {
            run(FsOp::Read {
                path: bytes(&file),
                offset,
                len,
            })
        };
        assert_eq!(read(1, 3), Ok(FsOk::Data(ByteBuf::from(b"ell".to_vec()))));
        assert_eq!(
            read(4, 100),
            Ok(FsOk::Data(ByteBuf::from(b"o!\xff".to_vec())))
        );
        assert_eq!(read(7, 100), Ok(FsOk::Data(ByteBuf::new())));
        assert_eq!(run(FsOp::Sync { path: bytes(&file) }), Ok(FsOk::Done));
        // Truncation of an existing file keeps its mode.
        assert_eq!(write(0, b"x", true, true), Ok(FsOk::Done));
        assert_eq!(fs::read(&file).unwrap(), b"x");
        // Writing through a dangling symlink creates its target, with the mode.
        std::os::unix::fs::symlink("target", dir.join("link")).unwrap();
        let through = run(FsOp::Write {
            path: bytes(&dir.join("link")),
            offset: 0,
            data: ByteBuf::from(b"t".to_vec()),
            mode: 0o604,
            create: true,
            truncate: true,
        });
        assert_eq!(through, Ok(FsOk::Done));
        assert_eq!(fs::read(dir.join("target")).unwrap(), b"t");
        assert_eq!(
            fs::metadata(dir.join("target"))
                .unwrap()
                .permissions()
                .mode()
                & 0o7777,
            0o604
        );
        // Without create, a missing file is NotFound; reading a directory is IsADirectory.
        let missing = run(FsOp::Write {
            path: bytes(&dir.join("missing")),
            offset: 0,
            data: ByteBuf::new(),
            mode: 0o644,
            create: false,
            truncate: false,
        });
        assert_eq!(missing.unwrap_err().kind, FsErrorKind::NotFound);
        let err = run(FsOp::Read {
            path: bytes(&dir),
            offset: 0,
            len: 10,
        })
        .unwrap_err();
        assert_eq!(err.kind, FsErrorKind::IsADirectory, "{err:?}");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Runs `op` on a thread and fails if it has not answered within 10 s (a blocked open).
    fn answers(op: FsOp) -> Result<FsOk, FsError> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(run(op)));
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("the operation blocked instead of answering")
    }

    /// FIFOs and devices are refused without blocking: a plain open of a FIFO waits for a
    /// writer forever, and /dev/zero never ends.
    #[test]
    fn reads_and_writes_refuse_fifos_and_devices_without_blocking() {
        let dir = scratch("not-a-file");
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let read = |path: &Path| {
            answers(FsOp::Read {
                path: bytes(path),
                offset: 0,
                len: 16,
            })
        };
        for path in [
            fifo.as_path(),
            Path::new("/dev/zero"),
            Path::new("/dev/null"),
        ] {
            let err = read(path).unwrap_err();
            assert_eq!(err.kind, FsErrorKind::NotAFile, "{path:?}: {err:?}");
            assert!(
                err.message.contains("not a regular file"),
                "{}",
                err.message
            );
        }
        assert!(read(&fifo).unwrap_err().message.contains("a FIFO"));
        assert!(read(Path::new("/dev/zero"))
            .unwrap_err()
            .message
            .contains("a character device"));
        let err = read(&dir).unwrap_err();
        assert_eq!(err.kind, FsErrorKind::IsADirectory, "{err:?}");
        let err = answers(FsOp::Sync { path: bytes(&fifo) }).unwrap_err();
        assert_eq!(err.kind, FsErrorKind::NotAFile, "{err:?}");

        // Writing: no reader (ENXIO), a reader (opened, then refused), create on a FIFO.
        let write = |create| {
            answers(FsOp::Write {
                path: bytes(&fifo),
                offset: 0,
                data: ByteBuf::from(b"x".to_vec()),
                mode: 0o644,
                create,
                truncate: true,
            })
        };
        assert!(write(false).is_err());
        let reader = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        for create in [false, true] {
            let err = write(create).unwrap_err();
            assert_eq!(err.kind, FsErrorKind::NotAFile, "{err:?}");
        }
        drop(reader);

        // A regular file is still read and written.
        let file = dir.join("file");
        assert!(answers(FsOp::Write {
            path: bytes(&file),
            offset: 0,
            data: ByteBuf::from(b"data".to_vec()),
            mode: 0o600,
            create: true,
            truncate: true,
        })
        .is_ok());
        assert_eq!(
            read(&file).unwrap(),
            FsOk::Data(ByteBuf::from(b"data".to_vec()))
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn read_dir_is_sorted_and_paged() {
        let dir = scratch("list");
        let n = MAX_DIR_ENTRIES + 500;
        for i in 0..n {
            fs::write(dir.join(format!("f{i:05}")), b"").unwrap();
        }
        fs::create_dir(dir.join("sub")).unwrap();
        std::os::unix::fs::symlink("f00000", dir.join("link")).unwrap();
        let mut names = Vec::new();
        let mut after = None;
        let mut pages = 0;
        loop {
            let Ok(FsOk::Entries { entries, complete }) = run(FsOp::ReadDir {
                path: bytes(&dir),
                after: after.clone(),
            }) else {
                panic!("read_dir failed")
            };
            pages += 1;
            assert!(entries.len() <= MAX_DIR_ENTRIES);
            after = entries.last().map(|e| e.name.clone());
            names.extend(entries);
            if complete {
                break;
            }
        }
        assert_eq!(pages, 2);
        assert_eq!(names.len(), n + 2);
        assert!(names.windows(2).all(|w| w[0].name < w[1].name));
        let kind = |name: &str| {
            names
                .iter()
                .find(|e| &e.name[..] == name.as_bytes())
                .unwrap()
        };
        assert_eq!(kind("sub").file_type, FileType::Dir);
        assert_eq!(kind("link").file_type, FileType::Symlink);
        assert_eq!(kind("f00001").file_type, FileType::File);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn remove_and_create_dir() {
        let dir = scratch("rm");
        let outside = scratch("rm-outside");
        fs::write(outside.join("keep"), b"k").unwrap();
        let deep = dir.join("a/b/c");
        assert_eq!(
            run(FsOp::CreateDir {
                path: bytes(&deep),
                mode: 0o700,
                parents: true
            }),
            Ok(FsOk::Done)
        );
        assert_eq!(
            fs::metadata(&deep).unwrap().permissions().mode() & 0o7777,
            0o700
        );
        // Existing is fine with parents, an error without.
        assert!(run(FsOp::CreateDir {
            path: bytes(&deep),
            mode: 0o700,
            parents: true
        })
        .is_ok());
        let err = run(FsOp::CreateDir {
            path: bytes(&deep),
            mode: 0o700,
            parents: false,
        })
        .unwrap_err();
        assert_eq!(err.kind, FsErrorKind::AlreadyExists);
        std::os::unix::fs::symlink(&outside, dir.join("a/escape")).unwrap();
        let err = run(FsOp::Remove {
            path: bytes(&dir.join("a")),
            recursive: false,
        })
        .unwrap_err();
        assert_eq!(err.kind, FsErrorKind::DirectoryNotEmpty);
        assert_eq!(
            run(FsOp::Remove {
                path: bytes(&dir.join("a")),
                recursive: true
            }),
            Ok(FsOk::Done)
        );
        assert!(!dir.join("a").exists());
        // The symlinked directory's contents survived.
        assert_eq!(fs::read(outside.join("keep")).unwrap(), b"k");
        fs::remove_dir_all(&dir).unwrap();
        fs::remove_dir_all(&outside).unwrap();
    }

    #[test]
    fn metadata_follows_only_when_asked() {
        let dir = scratch("meta");
        fs::write(dir.join("f"), b"12345").unwrap();
        std::os::unix::fs::symlink("f", dir.join("l")).unwrap();
        let meta = |name: &str, follow| match run(FsOp::Metadata {
            path: bytes(&dir.join(name)),
            follow,
        }) {
            Ok(FsOk::Metadata(m)) => m,
            other => panic!("{other:?}"),
        };
        assert_eq!(meta("l", false).file_type, FileType::Symlink);
        let followed = meta("l", true);
        assert_eq!(followed.file_type, FileType::File);
        assert_eq!(followed.len, 5);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn rename_replaces_the_destination_and_moves_a_symlink_itself() {
        let dir = scratch("rename");
        fs::write(dir.join("new"), b"new").unwrap();
        fs::write(dir.join("old"), b"old").unwrap();
        std::os::unix::fs::symlink("old", dir.join("link")).unwrap();
        let rename = |from: &str, to: &str| {
            run(FsOp::Rename {
                from: bytes(&dir.join(from)),
                to: bytes(&dir.join(to)),
            })
        };
        assert_eq!(rename("new", "old"), Ok(FsOk::Done));
        assert_eq!(fs::read(dir.join("old")).unwrap(), b"new");
        assert!(!dir.join("new").exists());
        assert_eq!(rename("link", "moved"), Ok(FsOk::Done));
        assert!(fs::symlink_metadata(dir.join("moved"))
            .unwrap()
            .is_symlink());
        assert_eq!(
            fs::read(dir.join("old")).unwrap(),
            b"new",
            "the target stays"
        );
        let err = rename("old", "missing/old").unwrap_err();
        assert_eq!(err.kind, FsErrorKind::NotFound);
        assert!(err.message.starts_with("rename "), "{}", err.message);
        fs::remove_dir_all(&dir).unwrap();
    }
}
