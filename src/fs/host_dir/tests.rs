//! Functional tests: each operation, as a guest's kernel would call it.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::*;

/// A host directory `base` holding the served `root` and an `outside` that no operation may
/// touch.
pub(super) struct Fixture {
    pub base: tempfile::TempDir,
    pub root: PathBuf,
    pub outside: PathBuf,
    pub fs: HostDir,
}

pub(super) fn fixture() -> Fixture {
    fixture_with(false, Limits::default())
}

pub(super) fn fixture_with(read_only: bool, limits: Limits) -> Fixture {
    let base = tempfile::tempdir().unwrap();
    let root = base.path().join("root");
    let outside = base.path().join("outside");
    std::fs::create_dir(&root).unwrap();
    std::fs::create_dir(&outside).unwrap();
    std::fs::create_dir(outside.join("dir")).unwrap();
    std::fs::write(outside.join("secret.txt"), b"secret").unwrap();
    std::fs::set_permissions(
        outside.join("secret.txt"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let fs = HostDir::open(&root, read_only, limits).unwrap();
    Fixture {
        base,
        root,
        outside,
        fs,
    }
}

/// Everything about a tree that an escape could change: each path's type, mode, owner, size,
/// times, link count and contents (symlinks not followed), and the names next to `root`.
pub(super) fn snapshot(path: &Path) -> BTreeMap<PathBuf, String> {
    let mut all = BTreeMap::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta = std::fs::symlink_metadata(&path).unwrap();
        let contents = if meta.is_file() {
            format!("{:?}", std::fs::read(&path).unwrap())
        } else if meta.file_type().is_symlink() {
            format!("-> {:?}", std::fs::read_link(&path).unwrap())
        } else {
            String::new()
        };
        all.insert(
            path.clone(),
            format!(
                "mode={:o} uid={} gid={} size={} mtime={}.{} ctime={}.{} nlink={} {}",
                meta.mode(),
                meta.uid(),
                meta.gid(),
                meta.size(),
                meta.mtime(),
                meta.mtime_nsec(),
                meta.ctime(),
                meta.ctime_nsec(),
                meta.nlink(),
                contents
            ),
        );
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path).unwrap() {
                stack.push(entry.unwrap().path());
            }
        }
    }
    all
}

impl Fixture {
    /// The state outside the served root: `outside` entirely, and the names beside `root`.
    pub(super) fn outside_state(&self) -> (BTreeMap<PathBuf, String>, Vec<PathBuf>) {
        let mut beside: Vec<PathBuf> = std::fs::read_dir(self.base.path())
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .collect();
        beside.sort();
        (snapshot(&self.outside), beside)
    }
}

pub(super) fn name(name: &str) -> &OsStr {
    OsStr::new(name)
}

/// The host process's own credentials, as a guest caller.
pub(super) fn me() -> Caller {
    // SAFETY: plain calls.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    Caller { uid, gid, pid: 1 }
}

/// A guest user other than the host process.
pub(super) fn someone() -> Caller {
    let me = me();
    Caller {
        uid: me.uid + 1000,
        gid: me.gid + 1000,
        pid: 2,
    }
}

pub(super) fn is_root() -> bool {
    me().uid == 0
}

pub(super) fn errno_of<T: std::fmt::Debug>(result: FsResult<T>) -> i32 {
    result.expect_err("expected an error").errno()
}

pub(super) async fn write_file(fs: &HostDir, parent: InodeId, file: &str, data: &[u8]) -> Entry {
    let (entry, handle) = fs
        .create(parent, name(file), 0o644, OpenFlags(libc::O_WRONLY), me())
        .await
        .unwrap();
    assert_eq!(
        fs.write(entry.attr.ino, handle, 0, data).await.unwrap() as usize,
        data.len()
    );
    fs.release(entry.attr.ino, handle).await.unwrap();
    entry
}

pub(super) async fn read_all(fs: &HostDir, ino: InodeId) -> Vec<u8> {
    let handle = fs.open(ino, OpenFlags(libc::O_RDONLY)).await.unwrap();
    let data = fs.read(ino, handle, 0, 1 << 20).await.unwrap();
    fs.release(ino, handle).await.unwrap();
    data
}

pub(super) async fn list(fs: &HostDir, dir: InodeId) -> Vec<DirEntry> {
    let handle = fs.opendir(dir).await.unwrap();
    let mut all = Vec::new();
    let mut offset = 0;
    loop {
        let entries = fs.readdir(dir, handle, offset).await.unwrap();
        let Some(last) = entries.last() else { break };
        offset = last.offset;
        all.extend(entries);
    }
    fs.releasedir(dir, handle).await.unwrap();
    all
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().mode()
}

#[tokio::test]
async fn new_needs_an_existing_directory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("file"), b"").unwrap();
    assert_eq!(
        HostDir::new(dir.path().join("file")).unwrap_err(),
        FsError::NOT_DIRECTORY
    );
    assert_eq!(
        HostDir::new(dir.path().join("missing")).unwrap_err(),
        FsError::NOT_FOUND
    );
    let fs = HostDir::new(dir.path()).unwrap();
    assert!(format!("{fs:?}").contains("HostDir"));
    let attr = fs.getattr(InodeId::ROOT).await.unwrap();
    assert_eq!(attr.kind, FileKind::Directory);
    assert_eq!(attr.ino, InodeId::ROOT);
}

#[tokio::test]
async fn lookup_reports_host_metadata_with_host_inode_numbers() {
    let f = fixture();
    std::fs::write(f.root.join("a.txt"), b"hello").unwrap();
    std::fs::set_permissions(f.root.join("a.txt"), std::fs::Permissions::from_mode(0o640)).unwrap();
    let meta = std::fs::metadata(f.root.join("a.txt")).unwrap();
    let entry = f.fs.lookup(InodeId::ROOT, name("a.txt")).await.unwrap();
    assert_eq!(entry.attr.kind, FileKind::File);
    assert_eq!(entry.attr.size, 5);
    assert_eq!(entry.attr.perm, 0o640);
    assert_eq!(entry.attr.uid, meta.uid());
    assert_eq!(entry.attr.nlink, 1);
    assert_eq!(entry.attr.ino, InodeId(meta.ino()));
    assert_eq!(
        entry.attr.mtime,
        UNIX_EPOCH + Duration::new(meta.mtime() as u64, meta.mtime_nsec() as u32)
    );
    // The same file, the same number; getattr agrees.
    let again = f.fs.lookup(InodeId::ROOT, name("a.txt")).await.unwrap();
    assert_eq!(again.attr.ino, entry.attr.ino);
    assert_eq!(f.fs.getattr(entry.attr.ino).await.unwrap(), entry.attr);
}

#[tokio::test]
async fn lookup_failures_are_errnos() {
    let f = fixture();
    std::fs::write(f.root.join("file"), b"").unwrap();
    assert_eq!(
        errno_of(f.fs.lookup(InodeId::ROOT, name("missing")).await),
        libc::ENOENT
    );
    let file = f.fs.lookup(InodeId::ROOT, name("file")).await.unwrap();
    assert_eq!(
        errno_of(f.fs.lookup(file.attr.ino, name("x")).await),
        libc::ENOTDIR
    );
    assert_eq!(
        errno_of(
            f.fs.lookup(InodeId::ROOT, OsStr::from_bytes(&[b'n'; 256]))
                .await
        ),
        libc::ENAMETOOLONG
    );
}

#[tokio::test]
async fn hard_links_share_one_inode_number() {
    let f = fixture();
    std::fs::write(f.root.join("a"), b"x").unwrap();
    std::fs::hard_link(f.root.join("a"), f.root.join("b")).unwrap();
    let a = f.fs.lookup(InodeId::ROOT, name("a")).await.unwrap();
    let b = f.fs.lookup(InodeId::ROOT, name("b")).await.unwrap();
    assert_eq!(a.attr.ino, b.attr.ino);
    assert_eq!(b.attr.nlink, 2);
}

#[tokio::test]
async fn forget_releases_an_inode_after_its_last_reference() {
    let f = fixture();
    std::fs::write(f.root.join("a"), b"x").unwrap();
    let a = f.fs.lookup(InodeId::ROOT, name("a")).await.unwrap();
    f.fs.lookup(InodeId::ROOT, name("a")).await.unwrap();
    f.fs.forget(a.attr.ino, 1).await;
    f.fs.getattr(a.attr.ino).await.unwrap();
    f.fs.forget(a.attr.ino, 1).await;
    assert_eq!(errno_of(f.fs.getattr(a.attr.ino).await), libc::ESTALE);
    // Forgetting the root or an unknown inode changes nothing.
    f.fs.forget(InodeId::ROOT, 100).await;
    f.fs.forget(InodeId(123_456_789), 1).await;
    f.fs.getattr(InodeId::ROOT).await.unwrap();
    // Looked up again: the same number (the host's).
    let again = f.fs.lookup(InodeId::ROOT, name("a")).await.unwrap();
    assert_eq!(again.attr.ino, a.attr.ino);
}

#[tokio::test]
async fn the_inode_table_is_bounded() {
    let f = fixture_with(
        false,
        Limits {
            inodes: 3,
            ..Limits::default()
        },
    );
    for i in 0..4 {
        std::fs::write(f.root.join(i.to_string()), b"").unwrap();
    }
    let mut held = Vec::new();
    for i in 0..3 {
        held.push(
            f.fs.lookup(InodeId::ROOT, name(&i.to_string()))
                .await
                .unwrap(),
        );
    }
    assert_eq!(
        errno_of(f.fs.lookup(InodeId::ROOT, name("3")).await),
        libc::ENFILE
    );
    // A held inode can still be looked up again; after a forget there is room.
    f.fs.lookup(InodeId::ROOT, name("0")).await.unwrap();
    f.fs.forget(held[1].attr.ino, 1).await;
    f.fs.lookup(InodeId::ROOT, name("3")).await.unwrap();
}

#[tokio::test]
async fn open_handles_are_bounded() {
    let f = fixture_with(
        false,
        Limits {
            handles: 2,
            ..Limits::default()
        },
    );
    let file = write_file(&f.fs, InodeId::ROOT, "a", b"x").await;
    let ino = file.attr.ino;
    let h1 = f.fs.open(ino, OpenFlags(libc::O_RDONLY)).await.unwrap();
    let _h2 = f.fs.opendir(InodeId::ROOT).await.unwrap();
    assert_eq!(
        errno_of(f.fs.open(ino, OpenFlags(libc::O_RDONLY)).await),
        libc::EMFILE
    );
    assert_eq!(
        errno_of(
            f.fs.create(
                InodeId::ROOT,
                name("b"),
                0o644,
                OpenFlags(libc::O_RDWR),
                me()
            )
            .await
        ),
        libc::EMFILE
    );
    assert!(!f.root.join("b").exists());
    f.fs.release(ino, h1).await.unwrap();
    f.fs.open(ino, OpenFlags(libc::O_RDONLY)).await.unwrap();
}

#[tokio::test]
async fn create_write_read_release() {
    let f = fixture();
    let (entry, handle) =
        f.fs.create(
            InodeId::ROOT,
            name("new.txt"),
            0o640,
            OpenFlags(libc::O_RDWR),
            me(),
        )
        .await
        .unwrap();
    let ino = entry.attr.ino;
    assert_eq!(entry.attr.kind, FileKind::File);
    assert_eq!(entry.attr.perm, 0o640);
    assert_eq!(
        f.fs.write(ino, handle, 0, b"hello world").await.unwrap(),
        11
    );
    assert_eq!(f.fs.write(ino, handle, 6, b"there").await.unwrap(), 5);
    assert_eq!(
        f.fs.read(ino, handle, 0, 100).await.unwrap(),
        b"hello there"
    );
    assert_eq!(f.fs.read(ino, handle, 6, 3).await.unwrap(), b"the");
    assert_eq!(f.fs.read(ino, handle, 100, 3).await.unwrap(), b"");
    // No flush (ENOSYS: the guest kernel stops sending them); fsync reaches the host file.
    assert_eq!(errno_of(f.fs.flush(ino, handle).await), libc::ENOSYS);
    f.fs.fsync(ino, handle, false).await.unwrap();
    f.fs.fsync(ino, handle, true).await.unwrap();
    f.fs.release(ino, handle).await.unwrap();
    assert_eq!(errno_of(f.fs.read(ino, handle, 0, 1).await), libc::EBADF);
    assert_eq!(
        std::fs::read(f.root.join("new.txt")).unwrap(),
        b"hello there"
    );
    // The exact mode asked, whatever the process's umask.
    assert_eq!(mode(&f.root.join("new.txt")) & 0o7777, 0o640);
    assert_eq!(f.fs.getattr(ino).await.unwrap().size, 11);
}

#[tokio::test]
async fn create_of_an_existing_name() {
    let f = fixture();
    std::fs::write(f.root.join("a"), b"old").unwrap();
    let flags = OpenFlags(libc::O_RDWR | libc::O_CREAT | libc::O_EXCL);
    assert_eq!(
        errno_of(
            f.fs.create(InodeId::ROOT, name("a"), 0o644, flags, me())
                .await
        ),
        libc::EEXIST
    );
    // Without O_EXCL: the existing file, opened (and truncated if asked).
    let flags = OpenFlags(libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC);
    let (entry, handle) =
        f.fs.create(InodeId::ROOT, name("a"), 0o600, flags, me())
            .await
            .unwrap();
    f.fs.release(entry.attr.ino, handle).await.unwrap();
    assert_eq!(std::fs::read(f.root.join("a")).unwrap(), b"");
}

#[tokio::test]
async fn open_flags_truncate_and_append() {
    let f = fixture();
    let file = write_file(&f.fs, InodeId::ROOT, "a", b"0123456789").await;
    let ino = file.attr.ino;
    let handle =
        f.fs.open(ino, OpenFlags(libc::O_WRONLY | libc::O_APPEND))
            .await
            .unwrap();
    f.fs.write(ino, handle, 0, b"ab").await.unwrap();
    f.fs.release(ino, handle).await.unwrap();
    assert_eq!(std::fs::read(f.root.join("a")).unwrap(), b"0123456789ab");
    let handle =
        f.fs.open(ino, OpenFlags(libc::O_RDWR | libc::O_TRUNC))
            .await
            .unwrap();
    f.fs.release(ino, handle).await.unwrap();
    assert_eq!(std::fs::read(f.root.join("a")).unwrap(), b"");
    assert_eq!(
        errno_of(f.fs.open(ino, OpenFlags(libc::O_ACCMODE)).await),
        libc::EINVAL
    );
    assert_eq!(
        errno_of(f.fs.open(InodeId::ROOT, OpenFlags(libc::O_RDONLY)).await),
        libc::EISDIR
    );
}

#[tokio::test]
async fn handles_are_checked() {
    let f = fixture();
    let a = write_file(&f.fs, InodeId::ROOT, "a", b"a").await.attr.ino;
    let b = write_file(&f.fs, InodeId::ROOT, "b", b"b").await.attr.ino;
    let read_only = f.fs.open(a, OpenFlags(libc::O_RDONLY)).await.unwrap();
    assert_eq!(
        errno_of(f.fs.write(a, read_only, 0, b"x").await),
        libc::EBADF
    );
    // A handle given with another inode.
    assert_eq!(errno_of(f.fs.read(b, read_only, 0, 1).await), libc::EBADF);
    assert_eq!(errno_of(f.fs.release(b, read_only).await), libc::EBADF);
    // A directory handle is not a file handle, nor the reverse.
    let dir = f.fs.opendir(InodeId::ROOT).await.unwrap();
    assert_eq!(
        errno_of(f.fs.read(InodeId::ROOT, dir, 0, 1).await),
        libc::EBADF
    );
    assert_eq!(errno_of(f.fs.readdir(a, read_only, 0).await), libc::EBADF);
    assert_eq!(errno_of(f.fs.releasedir(a, read_only).await), libc::EBADF);
    f.fs.releasedir(InodeId::ROOT, dir).await.unwrap();
    f.fs.release(a, read_only).await.unwrap();
}

#[tokio::test]
async fn setattr_truncates_chmods_and_sets_times() {
    let f = fixture();
    let file = write_file(&f.fs, InodeId::ROOT, "a", b"0123456789").await;
    let ino = file.attr.ino;
    let path = f.root.join("a");

    let attr =
        f.fs.setattr(
            ino,
            SetAttr {
                size: Some(4),
                ..Default::default()
            },
            me(),
        )
        .await
        .unwrap();
    assert_eq!(attr.size, 4);
    assert_eq!(std::fs::read(&path).unwrap(), b"0123");
    // Through a handle (ftruncate), extending with zeros.
    let handle = f.fs.open(ino, OpenFlags(libc::O_RDWR)).await.unwrap();
    let change = SetAttr {
        size: Some(6),
        handle: Some(handle),
        ..Default::default()
    };
    f.fs.setattr(ino, change, me()).await.unwrap();
    f.fs.release(ino, handle).await.unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"0123\0\0");

    let attr =
        f.fs.setattr(
            ino,
            SetAttr {
                perm: Some(0o751),
                ..Default::default()
            },
            me(),
        )
        .await
        .unwrap();
    assert_eq!(attr.perm, 0o751);
    assert_eq!(mode(&path) & 0o7777, 0o751);

    let at = UNIX_EPOCH + Duration::new(1_000_000_000, 123_456_789);
    let before_epoch = UNIX_EPOCH - Duration::from_millis(1500);
    let change = SetAttr {
        atime: Some(TimeOrNow::At(before_epoch)),
        mtime: Some(TimeOrNow::At(at)),
        ..Default::default()
    };
    let attr = f.fs.setattr(ino, change, me()).await.unwrap();
    assert_eq!(attr.mtime, at);
    assert_eq!(attr.atime, before_epoch);
    let change = SetAttr {
        mtime: Some(TimeOrNow::Now),
        ..Default::default()
    };
    let attr = f.fs.setattr(ino, change, me()).await.unwrap();
    assert!(attr.mtime > SystemTime::now() - Duration::from_secs(60));
    assert_eq!(attr.atime, before_epoch);

    assert_eq!(
        errno_of(
            f.fs.setattr(
                InodeId::ROOT,
                SetAttr {
                    size: Some(0),
                    ..Default::default()
                },
                me()
            )
            .await
        ),
        libc::EISDIR
    );
}

#[tokio::test]
async fn a_mode_without_owner_access_is_the_guests_only() {
    let f = fixture();
    let file = write_file(&f.fs, InodeId::ROOT, "a", b"data").await;
    let ino = file.attr.ino;
    let attr =
        f.fs.setattr(
            ino,
            SetAttr {
                perm: Some(0o000),
                ..Default::default()
            },
            me(),
        )
        .await
        .unwrap();
    assert_eq!(attr.perm, 0o000);
    // The host keeps the owner's read and write, so it can go on serving the file.
    assert_eq!(mode(&f.root.join("a")) & 0o7777, 0o600);
    assert_eq!(read_all(&f.fs, ino).await, b"data");
    // Persisted: a forgotten and looked-up-again inode shows the same.
    f.fs.forget(ino, 1).await;
    let again = f.fs.lookup(InodeId::ROOT, name("a")).await.unwrap();
    assert_eq!(again.attr.perm, 0o000);
    // Back to a mode the host can carry: the record goes.
    f.fs.setattr(
        ino,
        SetAttr {
            perm: Some(0o644),
            ..Default::default()
        },
        me(),
    )
    .await
    .unwrap();
    let on_host = xattr::get(&f.root.join("a"));
    assert_eq!(on_host, None);
}

/// Reading HostDir's record from the host side.
mod xattr {
    use std::ffi::CString;
    use std::path::Path;

    pub fn get(path: &Path) -> Option<String> {
        let path = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        let mut buf = vec![0u8; 256];
        // SAFETY: the buffer is as long as we say.
        let len = unsafe {
            libc::lgetxattr(
                path.as_ptr(),
                c"user.krunbox.stat".as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        (len >= 0).then(|| String::from_utf8(buf[..len as usize].to_vec()).unwrap())
    }

    pub fn set(path: &Path, value: &str) {
        let path = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: NUL-terminated strings, a value as long as we say.
        let ret = unsafe {
            libc::lsetxattr(
                path.as_ptr(),
                c"user.krunbox.stat".as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        assert_eq!(ret, 0, "{}", std::io::Error::last_os_error());
    }

    pub fn remove(path: &Path) {
        let path = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: NUL-terminated strings.
        let ret = unsafe { libc::lremovexattr(path.as_ptr(), c"user.krunbox.stat".as_ptr()) };
        assert_eq!(ret, 0, "{}", std::io::Error::last_os_error());
    }
}

#[tokio::test]
async fn chown_is_recorded_never_applied_on_the_host() {
    let f = fixture();
    let file = write_file(&f.fs, InodeId::ROOT, "a", b"").await;
    let ino = file.attr.ino;
    let host = std::fs::metadata(f.root.join("a")).unwrap();
    let change = SetAttr {
        uid: Some(4242),
        gid: Some(4343),
        ..Default::default()
    };
    let attr = f.fs.setattr(ino, change, me()).await.unwrap();
    assert_eq!((attr.uid, attr.gid), (4242, 4343));
    let after = std::fs::metadata(f.root.join("a")).unwrap();
    assert_eq!((after.uid(), after.gid()), (host.uid(), host.gid()));
    let record = xattr::get(&f.root.join("a")).unwrap();
    assert!(record.starts_with("1 4242 4343 644 "), "{record}");
    // Survives the guest forgetting the inode.
    f.fs.forget(ino, 1).await;
    let again = f.fs.lookup(InodeId::ROOT, name("a")).await.unwrap();
    assert_eq!((again.attr.uid, again.attr.gid), (4242, 4343));
    // Hidden from the guest's attribute listing.
    assert!(f.fs.listxattr(ino).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_record_changed_on_the_host_while_the_inode_was_forgotten_is_read_again() {
    let f = fixture();
    let file = write_file(&f.fs, InodeId::ROOT, "a", b"").await;
    let ino = file.attr.ino;
    let change = SetAttr {
        uid: Some(4242),
        ..Default::default()
    };
    f.fs.setattr(ino, change, me()).await.unwrap();
    let path = f.root.join("a");
    // A record is remembered only once its ctime is two seconds old (a change within the
    // same clock tick could keep the ctime).
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    // Read from the host once, then forgotten: remembered with the inode's ctime.
    f.fs.forget(ino, 1).await;
    let again = f.fs.lookup(InodeId::ROOT, name("a")).await.unwrap();
    assert_eq!(again.attr.uid, 4242);
    f.fs.forget(ino, 1).await;
    let unchanged = f.fs.lookup(InodeId::ROOT, name("a")).await.unwrap();
    assert_eq!(unchanged.attr.uid, 4242);
    f.fs.forget(ino, 1).await;
    // Someone on the host rewrites the record (which changes the ctime).
    let record = xattr::get(&path).unwrap();
    let rewritten = record.replacen("4242", "5151", 1);
    xattr::set(&path, &rewritten);
    let seen = f.fs.lookup(InodeId::ROOT, name("a")).await.unwrap();
    assert_eq!(
        seen.attr.uid, 5151,
        "the record remembered before the change was used"
    );
    f.fs.forget(ino, 1).await;
    // And removes it: the host's owner shows.
    xattr::remove(&path);
    let host = std::fs::metadata(&path).unwrap();
    let seen = f.fs.lookup(InodeId::ROOT, name("a")).await.unwrap();
    assert_eq!(seen.attr.uid, host.uid());
}

#[tokio::test]
async fn host_changes_behind_a_record_win() {
    let f = fixture();
    let file = write_file(&f.fs, InodeId::ROOT, "a", b"").await;
    let ino = file.attr.ino;
    let change = SetAttr {
        uid: Some(4242),
        perm: Some(0o4755),
        ..Default::default()
    };
    let attr = f.fs.setattr(ino, change, me()).await.unwrap();
    assert_eq!((attr.uid, attr.perm), (4242, 0o4755));
    std::fs::set_permissions(f.root.join("a"), std::fs::Permissions::from_mode(0o700)).unwrap();
    let attr = f.fs.getattr(ino).await.unwrap();
    assert_eq!((attr.uid, attr.perm), (4242, 0o700));
}

#[tokio::test]
async fn new_files_belong_to_their_guest_creator() {
    let f = fixture();
    let guest = someone();
    let (entry, handle) =
        f.fs.create(
            InodeId::ROOT,
            name("f"),
            0o644,
            OpenFlags(libc::O_RDWR),
            guest,
        )
        .await
        .unwrap();
    f.fs.release(entry.attr.ino, handle).await.unwrap();
    let dir =
        f.fs.mkdir(InodeId::ROOT, name("d"), 0o755, guest)
            .await
            .unwrap();
    let fifo =
        f.fs.mknod(InodeId::ROOT, name("p"), libc::S_IFIFO | 0o644, 0, guest)
            .await
            .unwrap();
    let link =
        f.fs.symlink(InodeId::ROOT, name("l"), name("f"), guest)
            .await
            .unwrap();
    for entry in [&entry, &dir, &fifo, &link] {
        assert_eq!((entry.attr.uid, entry.attr.gid), (guest.uid, guest.gid));
        // Never chowned on the host.
        assert_eq!(f.fs.getattr(entry.attr.ino).await.unwrap().uid, guest.uid);
    }
    for path in ["f", "d", "p", "l"] {
        assert_eq!(
            std::fs::symlink_metadata(f.root.join(path)).unwrap().uid(),
            me().uid
        );
    }
    // Symlinks and fifos keep their record in memory, also once forgotten.
    f.fs.forget(link.attr.ino, 1).await;
    let again = f.fs.lookup(InodeId::ROOT, name("l")).await.unwrap();
    assert_eq!(again.attr.uid, guest.uid);
    // lchown of a symlink.
    let change = SetAttr {
        uid: Some(7),
        ..Default::default()
    };
    assert_eq!(
        f.fs.setattr(link.attr.ino, change, me()).await.unwrap().uid,
        7
    );
    // A symlink has no mode of its own.
    let change = SetAttr {
        perm: Some(0o700),
        ..Default::default()
    };
    assert_eq!(
        errno_of(f.fs.setattr(link.attr.ino, change, me()).await),
        libc::EOPNOTSUPP
    );
}

#[tokio::test]
async fn a_setgid_directory_gives_its_group() {
    let f = fixture();
    let guest = someone();
    let dir =
        f.fs.mkdir(InodeId::ROOT, name("shared"), 0o775, me())
            .await
            .unwrap();
    let change = SetAttr {
        gid: Some(50),
        perm: Some(0o2775),
        ..Default::default()
    };
    let attr = f.fs.setattr(dir.attr.ino, change, me()).await.unwrap();
    assert_eq!((attr.gid, attr.perm), (50, 0o2775));
    // Not setgid on the host.
    assert_eq!(mode(&f.root.join("shared")) & 0o7777, 0o775);
    let (file, handle) =
        f.fs.create(
            dir.attr.ino,
            name("f"),
            0o644,
            OpenFlags(libc::O_RDWR),
            guest,
        )
        .await
        .unwrap();
    f.fs.release(file.attr.ino, handle).await.unwrap();
    assert_eq!((file.attr.uid, file.attr.gid), (guest.uid, 50));
    let sub =
        f.fs.mkdir(dir.attr.ino, name("sub"), 0o755, guest)
            .await
            .unwrap();
    assert_eq!(sub.attr.gid, 50);
    assert_eq!(sub.attr.perm, 0o2755);
    assert_eq!(mode(&f.root.join("shared/sub")) & 0o7777, 0o755);
}

#[tokio::test]
async fn mkdir_rmdir_unlink() {
    let f = fixture();
    let dir =
        f.fs.mkdir(InodeId::ROOT, name("d"), 0o750, me())
            .await
            .unwrap();
    assert_eq!(dir.attr.kind, FileKind::Directory);
    assert_eq!(dir.attr.perm, 0o750);
    assert_eq!(mode(&f.root.join("d")) & 0o7777, 0o750);
    write_file(&f.fs, dir.attr.ino, "f", b"x").await;
    assert_eq!(
        errno_of(f.fs.mkdir(InodeId::ROOT, name("d"), 0o755, me()).await),
        libc::EEXIST
    );
    assert_eq!(
        errno_of(f.fs.rmdir(InodeId::ROOT, name("d")).await),
        libc::ENOTEMPTY
    );
    assert_eq!(
        errno_of(f.fs.unlink(InodeId::ROOT, name("d")).await),
        libc::EISDIR
    );
    f.fs.unlink(dir.attr.ino, name("f")).await.unwrap();
    assert_eq!(
        errno_of(f.fs.rmdir(dir.attr.ino, name("f")).await),
        libc::ENOENT
    );
    f.fs.rmdir(InodeId::ROOT, name("d")).await.unwrap();
    assert!(!f.root.join("d").exists());
}

#[tokio::test]
async fn symlinks_hold_any_bytes_and_are_read_back() {
    let f = fixture();
    let target = OsStr::from_bytes(b"../../\xff/etc/passwd");
    let link =
        f.fs.symlink(InodeId::ROOT, name("l"), target, me())
            .await
            .unwrap();
    assert_eq!(link.attr.kind, FileKind::Symlink);
    assert_eq!(link.attr.size, target.len() as u64);
    assert_eq!(
        f.fs.readlink(link.attr.ino).await.unwrap(),
        target.as_bytes()
    );
    assert_eq!(
        std::fs::read_link(f.root.join("l")).unwrap().as_os_str(),
        target
    );
    assert_eq!(
        errno_of(f.fs.symlink(InodeId::ROOT, name("e"), name(""), me()).await),
        libc::ENOENT
    );
    let long = "x".repeat(PATH_MAX);
    assert_eq!(
        errno_of(
            f.fs.symlink(InodeId::ROOT, name("e"), name(&long), me())
                .await
        ),
        libc::ENAMETOOLONG
    );
    assert_eq!(errno_of(f.fs.readlink(InodeId::ROOT).await), libc::EINVAL);
}

#[tokio::test]
async fn mknod_makes_fifos_sockets_and_files() {
    let f = fixture();
    let fifo =
        f.fs.mknod(InodeId::ROOT, name("p"), libc::S_IFIFO | 0o640, 0, me())
            .await
            .unwrap();
    assert_eq!(fifo.attr.kind, FileKind::Fifo);
    assert_eq!(fifo.attr.perm, 0o640);
    assert!(std::fs::symlink_metadata(f.root.join("p"))
        .unwrap()
        .file_type()
        .is_fifo());
    // Never opened on the host (the guest kernel serves fifos itself).
    assert_eq!(
        errno_of(f.fs.open(fifo.attr.ino, OpenFlags(libc::O_RDONLY)).await),
        libc::ENXIO
    );
    let socket =
        f.fs.mknod(InodeId::ROOT, name("s"), libc::S_IFSOCK | 0o600, 0, me())
            .await
            .unwrap();
    assert_eq!(socket.attr.kind, FileKind::Socket);
    assert!(std::fs::symlink_metadata(f.root.join("s"))
        .unwrap()
        .file_type()
        .is_socket());
    let file =
        f.fs.mknod(InodeId::ROOT, name("r"), libc::S_IFREG | 0o600, 0, me())
            .await
            .unwrap();
    assert_eq!(file.attr.kind, FileKind::File);
    assert_eq!(
        errno_of(
            f.fs.mknod(InodeId::ROOT, name("x"), libc::S_IFDIR | 0o700, 0, me())
                .await
        ),
        libc::EINVAL
    );
}

#[tokio::test]
async fn rename_with_and_without_flags() {
    let f = fixture();
    write_file(&f.fs, InodeId::ROOT, "a", b"a").await;
    write_file(&f.fs, InodeId::ROOT, "b", b"b").await;
    let dir =
        f.fs.mkdir(InodeId::ROOT, name("d"), 0o755, me())
            .await
            .unwrap();
    let none = RenameFlags::default();
    let no_replace = RenameFlags {
        no_replace: true,
        ..Default::default()
    };
    let exchange = RenameFlags {
        exchange: true,
        ..Default::default()
    };
    assert_eq!(
        errno_of(
            f.fs.rename(
                InodeId::ROOT,
                name("a"),
                InodeId::ROOT,
                name("b"),
                no_replace
            )
            .await
        ),
        libc::EEXIST
    );
    f.fs.rename(InodeId::ROOT, name("a"), InodeId::ROOT, name("b"), exchange)
        .await
        .unwrap();
    assert_eq!(std::fs::read(f.root.join("a")).unwrap(), b"b");
    assert_eq!(std::fs::read(f.root.join("b")).unwrap(), b"a");
    f.fs.rename(InodeId::ROOT, name("a"), dir.attr.ino, name("moved"), none)
        .await
        .unwrap();
    assert_eq!(std::fs::read(f.root.join("d/moved")).unwrap(), b"b");
    f.fs.rename(InodeId::ROOT, name("b"), dir.attr.ino, name("moved"), none)
        .await
        .unwrap();
    assert_eq!(std::fs::read(f.root.join("d/moved")).unwrap(), b"a");
    let both = RenameFlags {
        no_replace: true,
        exchange: true,
    };
    assert_eq!(
        errno_of(
            f.fs.rename(dir.attr.ino, name("moved"), InodeId::ROOT, name("x"), both)
                .await
        ),
        libc::EINVAL
    );
    // A directory into itself.
    assert_eq!(
        errno_of(
            f.fs.rename(InodeId::ROOT, name("d"), dir.attr.ino, name("d"), none)
                .await
        ),
        libc::EINVAL
    );
}

#[tokio::test]
async fn link_gives_another_name_to_the_same_inode() {
    let f = fixture();
    let file = write_file(&f.fs, InodeId::ROOT, "a", b"data").await;
    let dir =
        f.fs.mkdir(InodeId::ROOT, name("d"), 0o755, me())
            .await
            .unwrap();
    let linked =
        f.fs.link(file.attr.ino, dir.attr.ino, name("b"))
            .await
            .unwrap();
    assert_eq!(linked.attr.ino, file.attr.ino);
    assert_eq!(linked.attr.nlink, 2);
    assert_eq!(std::fs::read(f.root.join("d/b")).unwrap(), b"data");
    assert_eq!(
        std::fs::metadata(f.root.join("a")).unwrap().ino(),
        std::fs::metadata(f.root.join("d/b")).unwrap().ino()
    );
    assert_eq!(
        errno_of(f.fs.link(dir.attr.ino, InodeId::ROOT, name("e")).await),
        libc::EPERM
    );
    assert_eq!(
        errno_of(f.fs.link(file.attr.ino, InodeId::ROOT, name("a")).await),
        libc::EEXIST
    );
    // A symlink can be hard-linked too: the link, not its target.
    let sym =
        f.fs.symlink(InodeId::ROOT, name("s"), name("a"), me())
            .await
            .unwrap();
    let sym2 =
        f.fs.link(sym.attr.ino, InodeId::ROOT, name("s2"))
            .await
            .unwrap();
    assert_eq!(sym2.attr.kind, FileKind::Symlink);
    assert_eq!(sym2.attr.nlink, 2);
}

#[tokio::test]
async fn readdir_lists_every_entry_with_dots() {
    let f = fixture();
    let dir =
        f.fs.mkdir(InodeId::ROOT, name("d"), 0o755, me())
            .await
            .unwrap();
    for i in 0..1500 {
        std::fs::write(f.root.join(format!("d/{i}")), b"").unwrap();
    }
    std::fs::create_dir(f.root.join("d/sub")).unwrap();
    std::os::unix::fs::symlink("x", f.root.join("d/link")).unwrap();
    let entries = list(&f.fs, dir.attr.ino).await;
    assert_eq!(entries.len(), 1504);
    let names: std::collections::HashSet<_> = entries.iter().map(|e| e.name.clone()).collect();
    assert_eq!(names.len(), 1504);
    let entry = |n: &str| entries.iter().find(|e| e.name == n).unwrap();
    assert_eq!(entry(".").ino, dir.attr.ino);
    assert_eq!(entry("..").ino, InodeId::ROOT);
    // Offsets are the host filesystem's own cookies: each names one place in the listing.
    let offsets: std::collections::HashSet<u64> = entries.iter().map(|e| e.offset).collect();
    assert_eq!(offsets.len(), 1504);
    assert!(!offsets.contains(&0), "0 is the listing's start");
    assert_eq!(entry("sub").kind, FileKind::Directory);
    assert_eq!(entry("link").kind, FileKind::Symlink);
    assert_eq!(entry("7").kind, FileKind::File);
    // Listed numbers are the numbers lookups give.
    let seven = f.fs.lookup(dir.attr.ino, name("7")).await.unwrap();
    assert_eq!(entry("7").ino, seven.attr.ino);
    // The root's parent is the root.
    let root = list(&f.fs, InodeId::ROOT).await;
    let dotdot = root.iter().find(|e| e.name == "..").unwrap();
    assert_eq!(dotdot.ino, InodeId::ROOT);
    // A listing resumes from any cookie, with the entries after it; the last one's is the end.
    let handle = f.fs.opendir(dir.attr.ino).await.unwrap();
    let from =
        f.fs.readdir(dir.attr.ino, handle, entries[1000].offset)
            .await
            .unwrap();
    assert_eq!(from[0].name, entries[1001].name);
    assert!(f
        .fs
        .readdir(dir.attr.ino, handle, entries[1503].offset)
        .await
        .unwrap()
        .is_empty());
    f.fs.releasedir(dir.attr.ino, handle).await.unwrap();
    assert_eq!(errno_of(f.fs.opendir(seven.attr.ino).await), libc::ENOTDIR);
}

/// Issue 33: every open directory kept its whole listing (16,384 handles of up to a million
/// entries). Now it holds a descriptor, and the host reads a batch per call: the directory as
/// it is at each call, from the start again on a rewind.
#[tokio::test]
async fn a_listing_reads_the_directory_as_it_is_a_batch_at_a_time() {
    let f = fixture();
    for i in 0..(READDIR_CHUNK + 100) {
        std::fs::write(f.root.join(format!("f{i}")), b"").unwrap();
    }
    let handle = f.fs.opendir(InodeId::ROOT).await.unwrap();
    // Made after the open: a listing taken at the open (as on 88bb6c9) would not hold it.
    std::fs::write(f.root.join("late"), b"").unwrap();
    let first = f.fs.readdir(InodeId::ROOT, handle, 0).await.unwrap();
    assert_eq!(first.len(), READDIR_CHUNK, "one batch a call");
    let mut all = first;
    loop {
        let from = all.last().unwrap().offset;
        let batch = f.fs.readdir(InodeId::ROOT, handle, from).await.unwrap();
        if batch.is_empty() {
            break;
        }
        all.extend(batch);
    }
    assert!(all.iter().any(|e| e.name == "late"), "made after the open");
    std::fs::remove_file(f.root.join("late")).unwrap();
    // rewinddir: read anew.
    let mut again = Vec::new();
    let mut offset = 0;
    loop {
        let batch = f.fs.readdir(InodeId::ROOT, handle, offset).await.unwrap();
        let Some(last) = batch.last() else { break };
        offset = last.offset;
        again.extend(batch);
    }
    assert_eq!(again.len(), READDIR_CHUNK + 100 + 2);
    assert!(!again.iter().any(|e| e.name == "late"));
    f.fs.releasedir(InodeId::ROOT, handle).await.unwrap();
    assert_eq!(
        errno_of(f.fs.readdir(InodeId::ROOT, handle, 0).await),
        libc::EBADF
    );
}

#[tokio::test]
async fn statfs_reports_the_host_filesystem() {
    let f = fixture();
    let st = f.fs.statfs().await.unwrap();
    assert!(st.blocks > 0);
    assert!(st.block_size > 0);
    assert!(st.blocks_free <= st.blocks);
    assert_eq!(st.name_max, 255);
}

#[tokio::test]
async fn user_xattrs_are_served() {
    let f = fixture();
    let file = write_file(&f.fs, InodeId::ROOT, "a", b"").await.attr.ino;
    f.fs.setxattr(file, name("user.one"), b"1", 0)
        .await
        .unwrap();
    f.fs.setxattr(InodeId::ROOT, name("user.dir"), b"d", 0)
        .await
        .unwrap();
    assert_eq!(f.fs.getxattr(file, name("user.one")).await.unwrap(), b"1");
    assert_eq!(
        f.fs.getxattr(InodeId::ROOT, name("user.dir"))
            .await
            .unwrap(),
        b"d"
    );
    assert_eq!(
        errno_of(
            f.fs.setxattr(file, name("user.one"), b"2", libc::XATTR_CREATE)
                .await
        ),
        libc::EEXIST
    );
    assert_eq!(
        errno_of(
            f.fs.setxattr(file, name("user.two"), b"2", libc::XATTR_REPLACE)
                .await
        ),
        libc::ENODATA
    );
    f.fs.setxattr(file, name("user.empty"), b"", 0)
        .await
        .unwrap();
    assert_eq!(f.fs.getxattr(file, name("user.empty")).await.unwrap(), b"");
    let mut names = f.fs.listxattr(file).await.unwrap();
    names.sort();
    assert_eq!(names, vec![b"user.empty".to_vec(), b"user.one".to_vec()]);
    f.fs.removexattr(file, name("user.one")).await.unwrap();
    assert_eq!(
        errno_of(f.fs.getxattr(file, name("user.one")).await),
        libc::ENODATA
    );
    assert_eq!(
        errno_of(f.fs.removexattr(file, name("user.one")).await),
        libc::ENODATA
    );
    let big = vec![0u8; sys::XATTR_SIZE_MAX + 1];
    assert_eq!(
        errno_of(f.fs.setxattr(file, name("user.big"), &big, 0).await),
        libc::E2BIG
    );
    // Symlinks and special files have no user attributes (as in Linux).
    let link =
        f.fs.symlink(InodeId::ROOT, name("l"), name("a"), me())
            .await
            .unwrap();
    assert_eq!(
        errno_of(f.fs.setxattr(link.attr.ino, name("user.x"), b"1", 0).await),
        libc::EPERM
    );
    assert_eq!(
        errno_of(f.fs.getxattr(link.attr.ino, name("user.x")).await),
        libc::ENODATA
    );
    assert!(f.fs.listxattr(link.attr.ino).await.unwrap().is_empty());
}

#[tokio::test]
async fn fsync_through_handles_and_without() {
    let f = fixture();
    let file = write_file(&f.fs, InodeId::ROOT, "a", b"x").await.attr.ino;
    f.fs.fsync(file, FileHandle(0), false).await.unwrap();
    let dir = f.fs.opendir(InodeId::ROOT).await.unwrap();
    f.fs.fsync(InodeId::ROOT, dir, false).await.unwrap();
    f.fs.fsync(InodeId::ROOT, FileHandle(99), true)
        .await
        .unwrap();
    f.fs.releasedir(InodeId::ROOT, dir).await.unwrap();
    assert_eq!(
        errno_of(f.fs.fsync(InodeId(999_999_999), FileHandle(0), false).await),
        libc::ESTALE
    );
}

#[tokio::test]
async fn clones_share_one_state() {
    let f = fixture();
    let other = f.fs.clone();
    let file = write_file(&f.fs, InodeId::ROOT, "a", b"shared").await;
    assert_eq!(read_all(&other, file.attr.ino).await, b"shared");
    assert!(!other.is_read_only());
}

#[tokio::test]
async fn host_side_changes_show_at_once() {
    let f = fixture();
    let file = write_file(&f.fs, InodeId::ROOT, "a", b"guest").await;
    std::fs::write(f.root.join("a"), b"host wrote this").unwrap();
    assert_eq!(read_all(&f.fs, file.attr.ino).await, b"host wrote this");
    assert_eq!(f.fs.getattr(file.attr.ino).await.unwrap().size, 15);
    // A host rename: the inode the guest holds is still that file.
    std::fs::rename(f.root.join("a"), f.root.join("b")).unwrap();
    assert_eq!(read_all(&f.fs, file.attr.ino).await, b"host wrote this");
    let b = f.fs.lookup(InodeId::ROOT, name("b")).await.unwrap();
    assert_eq!(b.attr.ino, file.attr.ino);
}

#[tokio::test]
async fn big_reads_and_writes_are_bounded() {
    let f = fixture();
    let (entry, handle) =
        f.fs.create(
            InodeId::ROOT,
            name("big"),
            0o644,
            OpenFlags(libc::O_RDWR),
            me(),
        )
        .await
        .unwrap();
    let ino = entry.attr.ino;
    let data = vec![7u8; MAX_IO];
    assert_eq!(
        f.fs.write(ino, handle, 0, &data).await.unwrap() as usize,
        MAX_IO
    );
    assert_eq!(
        f.fs.write(ino, handle, MAX_IO as u64, &data).await.unwrap() as usize,
        MAX_IO
    );
    let too_big = vec![0u8; MAX_IO + 1];
    assert_eq!(
        errno_of(f.fs.write(ino, handle, 0, &too_big).await),
        libc::EINVAL
    );
    // A read is cut at MAX_IO, whatever size is asked.
    assert_eq!(
        f.fs.read(ino, handle, 0, u32::MAX).await.unwrap().len(),
        MAX_IO
    );
    f.fs.release(ino, handle).await.unwrap();
}

#[tokio::test]
async fn chown_and_chmod_change_ctime_even_to_the_same_values() {
    let f = fixture();
    let file = write_file(&f.fs, InodeId::ROOT, "f", b"").await.attr.ino;
    let link =
        f.fs.symlink(InodeId::ROOT, name("l"), name("f"), me())
            .await
            .unwrap()
            .attr
            .ino;
    for (ino, change) in [
        (
            file,
            SetAttr {
                uid: Some(me().uid),
                ..Default::default()
            },
        ),
        (
            file,
            SetAttr {
                uid: Some(4242),
                ..Default::default()
            },
        ),
        (
            file,
            SetAttr {
                uid: Some(4242),
                ..Default::default()
            },
        ),
        (
            file,
            SetAttr {
                perm: Some(0o644),
                ..Default::default()
            },
        ),
        (
            link,
            SetAttr {
                gid: Some(4242),
                ..Default::default()
            },
        ),
    ] {
        let before = f.fs.getattr(ino).await.unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let after = f.fs.setattr(ino, change.clone(), me()).await.unwrap();
        assert!(after.ctime > before.ctime, "{change:?}");
        assert_eq!(after.atime, before.atime, "{change:?}");
        assert_eq!(after.mtime, before.mtime, "{change:?}");
    }
}

/// `fallocate` reaches the host file for the two allocating modes only; a read-only mount and
/// a read-only handle refuse it.
#[tokio::test]
async fn fallocate_allocates_on_the_host_in_the_allocating_modes_only() {
    let f = fixture();
    let entry = write_file(&f.fs, InodeId::ROOT, "f", b"hello").await;
    let ino = entry.attr.ino;
    let handle = f.fs.open(ino, OpenFlags(libc::O_RDWR)).await.unwrap();
    f.fs.fallocate(ino, handle, 0, 100_000, 0).await.unwrap();
    let host = f.root.join("f");
    assert_eq!(std::fs::metadata(&host).unwrap().len(), 100_000);
    assert_eq!(&std::fs::read(&host).unwrap()[..5], b"hello");
    f.fs.fallocate(ino, handle, 0, 300_000, libc::FALLOC_FL_KEEP_SIZE)
        .await
        .unwrap();
    assert_eq!(std::fs::metadata(&host).unwrap().len(), 100_000);
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    assert_eq!(
        errno_of(f.fs.fallocate(ino, handle, 0, 5, punch).await),
        libc::EOPNOTSUPP
    );
    assert_eq!(&std::fs::read(&host).unwrap()[..5], b"hello");
    f.fs.release(ino, handle).await.unwrap();
    let read_only = f.fs.open(ino, OpenFlags(libc::O_RDONLY)).await.unwrap();
    assert_eq!(
        errno_of(f.fs.fallocate(ino, read_only, 0, 200_000, 0).await),
        libc::EBADF
    );
    f.fs.release(ino, read_only).await.unwrap();
    assert_eq!(std::fs::metadata(&host).unwrap().len(), 100_000);

    let ro = fixture_with(true, Limits::default());
    std::fs::write(ro.root.join("g"), b"x").unwrap();
    let g = ro
        .fs
        .lookup(InodeId::ROOT, name("g"))
        .await
        .unwrap()
        .attr
        .ino;
    let handle = ro.fs.open(g, OpenFlags(libc::O_RDONLY)).await.unwrap();
    assert_eq!(
        errno_of(ro.fs.fallocate(g, handle, 0, 10, 0).await),
        libc::EROFS
    );
}

/// On a multi-threaded runtime a write is made with `block_in_place` from the guest's bytes:
/// small and large writes reach the host file whole, and a file released and unlinked is
/// closed on the blocking pool while the next file is created and read at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_on_a_multi_threaded_runtime_reach_the_host() {
    let f = fixture();
    let large: Vec<u8> = (0..(1u32 << 20) + 4097).map(|i| (i % 251) as u8).collect();
    let entry = write_file(&f.fs, InodeId::ROOT, "large", &large).await;
    assert_eq!(std::fs::read(f.root.join("large")).unwrap(), large);
    assert_eq!(read_all(&f.fs, entry.attr.ino).await.len(), 1 << 20);
    f.fs.unlink(InodeId::ROOT, name("large")).await.unwrap();
    f.fs.forget(entry.attr.ino, 1).await;
    for i in 0..50 {
        let file = format!("small{i}");
        let entry = write_file(&f.fs, InodeId::ROOT, &file, file.as_bytes()).await;
        assert_eq!(read_all(&f.fs, entry.attr.ino).await, file.as_bytes());
        assert_eq!(std::fs::read(f.root.join(&file)).unwrap(), file.as_bytes());
    }
}

/// Issue 33: a guest's descriptors were bounded per `HostDir` only, and one guest could hold
/// the whole process's. Each inode and handle it holds is now charged to its sandbox's budget
/// (the mount's calls run in its scope): past it a lookup or open fails with `ENFILE`, and
/// what the guest forgets or closes is given back.
#[tokio::test]
async fn the_guests_inodes_and_handles_are_charged_to_its_sandbox() {
    let f = fixture();
    for i in 0..4 {
        std::fs::write(f.root.join(format!("f{i}")), b"x").unwrap();
    }
    let budget = crate::budget::Budget::new(&crate::Limits::new().host_descriptors(3));
    let fs = f.fs.clone();
    let held = budget.clone();
    crate::budget::scope(Some(budget.clone()), async move {
        let a = fs.lookup(InodeId::ROOT, name("f0")).await.unwrap().attr.ino;
        let b = fs.lookup(InodeId::ROOT, name("f1")).await.unwrap().attr.ino;
        assert_eq!(held.descriptors_held(), 2);
        let handle = fs.open(a, OpenFlags(libc::O_RDONLY)).await.unwrap();
        assert_eq!(held.descriptors_held(), 3);
        assert_eq!(
            errno_of(fs.lookup(InodeId::ROOT, name("f2")).await),
            libc::ENFILE
        );
        assert_eq!(errno_of(fs.opendir(InodeId::ROOT).await), libc::ENFILE);
        // A second lookup of a held inode takes nothing new.
        fs.lookup(InodeId::ROOT, name("f1")).await.unwrap();
        fs.release(a, handle).await.unwrap();
        fs.forget(b, 2).await;
        // A file is closed on the blocking pool, without the guest waiting: its charge goes
        // back when it is closed.
        for _ in 0..500 {
            if held.descriptors_held() == 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        assert_eq!(held.descriptors_held(), 1);
        fs.lookup(InodeId::ROOT, name("f3")).await.unwrap();
        // The blocking pool's calls are charged too (opendir runs there).
        let dir = fs.opendir(InodeId::ROOT).await.unwrap();
        assert_eq!(held.descriptors_held(), 3);
        fs.releasedir(InodeId::ROOT, dir).await.unwrap();
    })
    .await;
    assert_eq!(budget.descriptors_held(), 2, "what the guest still holds");
}
