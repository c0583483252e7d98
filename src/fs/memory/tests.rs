//! `MemoryFs` through the trait the guest drives and the host's path API. Every test ends by
//! checking the tree's invariants (link counts, parents, bytes used, handles).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::time::{Duration, Instant, SystemTime};

use super::tree::{ENTRY_COST, MAX_LINKS, READDIR_BATCH};
use super::*;

const ROOT: InodeId = InodeId::ROOT;
const RW: OpenFlags = OpenFlags(libc::O_RDWR);
const RO: OpenFlags = OpenFlags(libc::O_RDONLY);
const NONE: RenameFlags = RenameFlags {
    no_replace: false,
    exchange: false,
};
const NOREPLACE: RenameFlags = RenameFlags {
    no_replace: true,
    exchange: false,
};
const EXCHANGE: RenameFlags = RenameFlags {
    no_replace: false,
    exchange: true,
};

fn user() -> Caller {
    Caller {
        uid: 1000,
        gid: 1000,
        pid: 42,
    }
}

fn root_user() -> Caller {
    Caller::default()
}

fn n(name: &str) -> &OsStr {
    OsStr::new(name)
}

fn errno(errno: i32) -> FsError {
    FsError::from_errno(errno)
}

fn check(fs: &MemoryFs) {
    fs.lock().check();
}

fn used(fs: &MemoryFs) -> u64 {
    fs.lock().used_bytes()
}

/// Creates `name` with `bytes` and closes it (one lookup reference stays).
async fn file(fs: &MemoryFs, parent: InodeId, name: &str, bytes: &[u8]) -> InodeId {
    let (entry, fh) = fs.create(parent, n(name), 0o644, RW, user()).await.unwrap();
    let ino = entry.attr.ino;
    if !bytes.is_empty() {
        assert_eq!(
            fs.write(ino, fh, 0, bytes).await.unwrap(),
            bytes.len() as u32
        );
    }
    fs.release(ino, fh).await.unwrap();
    ino
}

async fn dir(fs: &MemoryFs, parent: InodeId, name: &str) -> InodeId {
    fs.mkdir(parent, n(name), 0o755, user())
        .await
        .unwrap()
        .attr
        .ino
}

async fn read_all(fs: &MemoryFs, ino: InodeId) -> Vec<u8> {
    let fh = fs.open(ino, RO).await.unwrap();
    let bytes = fs.read(ino, fh, 0, u32::MAX).await.unwrap();
    fs.release(ino, fh).await.unwrap();
    bytes
}

async fn nlink(fs: &MemoryFs, ino: InodeId) -> u32 {
    fs.getattr(ino).await.unwrap().nlink
}

/// A whole listing, as (name, inode, kind), through one handle.
async fn listing(fs: &MemoryFs, ino: InodeId) -> Vec<(String, InodeId, FileKind)> {
    let fh = fs.opendir(ino).await.unwrap();
    let mut all = Vec::new();
    let mut offset = 0;
    loop {
        let batch = fs.readdir(ino, fh, offset).await.unwrap();
        let Some(last) = batch.last() else { break };
        offset = last.offset;
        all.extend(
            batch
                .into_iter()
                .map(|e| (e.name.to_string_lossy().into_owned(), e.ino, e.kind)),
        );
    }
    fs.releasedir(ino, fh).await.unwrap();
    all
}

async fn names(fs: &MemoryFs, ino: InodeId) -> Vec<String> {
    let mut names: Vec<String> = listing(fs, ino).await.into_iter().map(|e| e.0).collect();
    names.sort();
    names
}

fn later(a: SystemTime, b: SystemTime) -> bool {
    b > a
}

fn tick() {
    std::thread::sleep(Duration::from_millis(2));
}

#[tokio::test]
async fn the_root_is_a_0755_directory_owned_by_root() {
    let fs = MemoryFs::new();
    let root = fs.getattr(ROOT).await.unwrap();
    assert_eq!(root.ino, ROOT);
    assert_eq!(root.kind, FileKind::Directory);
    assert_eq!(
        (root.perm, root.uid, root.gid, root.nlink),
        (0o755, 0, 0, 2)
    );
    assert_eq!(fs.getattr(InodeId(2)).await, Err(FsError::NOT_FOUND));
    assert_eq!(fs.lookup(ROOT, n("x")).await, Err(FsError::NOT_FOUND));
    assert_eq!(
        names(&fs, ROOT).await,
        [".", ".."],
        "an empty root lists itself and its parent"
    );
    // Forgetting the root never frees it.
    fs.forget(ROOT, 100).await;
    assert!(fs.getattr(ROOT).await.is_ok());
    check(&fs);
}

#[tokio::test]
async fn lookup_finds_names_and_refuses_bad_ones() {
    let fs = MemoryFs::new();
    let a = file(&fs, ROOT, "a", b"x").await;
    let entry = fs.lookup(ROOT, n("a")).await.unwrap();
    assert_eq!((entry.attr.ino, entry.generation), (a, 0));
    assert_eq!(entry.attr.size, 1);
    assert_eq!(fs.lookup(a, n("b")).await, Err(FsError::NOT_DIRECTORY));
    assert_eq!(
        fs.lookup(InodeId(999), n("b")).await,
        Err(FsError::NOT_FOUND)
    );
    for bad in ["", ".", "..", "a/b", "a\0b"] {
        assert_eq!(
            fs.lookup(ROOT, n(bad)).await,
            Err(FsError::INVALID),
            "{bad:?}"
        );
        assert_eq!(
            fs.mkdir(ROOT, n(bad), 0o755, user()).await,
            Err(FsError::INVALID)
        );
        assert_eq!(
            fs.create(ROOT, n(bad), 0o644, RW, user()).await.map(drop),
            Err(FsError::INVALID)
        );
        assert_eq!(
            fs.rename(ROOT, n("a"), ROOT, n(bad), NONE).await,
            Err(FsError::INVALID)
        );
        assert_eq!(fs.link(a, ROOT, n(bad)).await, Err(FsError::INVALID));
    }
    let long = "x".repeat(256);
    assert_eq!(fs.lookup(ROOT, n(&long)).await, Err(FsError::NAME_TOO_LONG));
    let longest = "y".repeat(255);
    file(&fs, ROOT, &longest, b"").await;
    assert!(fs.lookup(ROOT, n(&longest)).await.is_ok());
    check(&fs);
}

#[tokio::test]
async fn writes_read_back_and_sparse_writes_read_zeros_between() {
    let fs = MemoryFs::new();
    let (entry, fh) = fs.create(ROOT, n("f"), 0o640, RW, user()).await.unwrap();
    let ino = entry.attr.ino;
    assert_eq!(entry.attr.kind, FileKind::File);
    assert_eq!(
        (entry.attr.perm, entry.attr.uid, entry.attr.gid),
        (0o640, 1000, 1000)
    );
    let epoch = SetAttr {
        mtime: Some(TimeOrNow::At(SystemTime::UNIX_EPOCH)),
        ..SetAttr::default()
    };
    fs.setattr(ino, epoch, user()).await.unwrap();
    assert_eq!(fs.write(ino, fh, 0, b"hello").await, Ok(5));
    assert_eq!(fs.write(ino, fh, 10, b"world").await, Ok(5));
    let attr = fs.getattr(ino).await.unwrap();
    assert_eq!(attr.size, 15);
    assert!(attr.blocks >= 1);
    assert!(
        later(SystemTime::UNIX_EPOCH, attr.mtime),
        "a write sets mtime"
    );
    assert_eq!(
        fs.read(ino, fh, 0, 100).await.unwrap(),
        b"hello\0\0\0\0\0world"
    );
    assert_eq!(fs.read(ino, fh, 3, 4).await.unwrap(), b"lo\0\0");
    assert_eq!(fs.read(ino, fh, 15, 10).await.unwrap(), b"");
    assert_eq!(fs.read(ino, fh, u64::MAX, 10).await.unwrap(), b"");
    assert_eq!(fs.write(ino, fh, 3, b"").await, Ok(0));

    // Far offsets: a hole costs nothing; past the largest file, EFBIG.
    let before = used(&fs);
    let max = MemoryFs::MAX_FILE_SIZE;
    // (A chunk's buffer starts at the chunk's start: write at one.)
    let far = max - 64 * 1024;
    assert_eq!(fs.write(ino, fh, far, b"z").await, Ok(1));
    assert!(
        used(&fs) - before < 100,
        "a sparse write allocates its bytes only"
    );
    assert_eq!(fs.getattr(ino).await.unwrap().size, far + 1);
    assert_eq!(fs.read(ino, fh, far - 1, 10).await.unwrap(), b"\0z");
    assert_eq!(fs.write(ino, fh, max - 1, b"z").await, Ok(1));
    assert_eq!(fs.getattr(ino).await.unwrap().size, max);
    assert_eq!(
        fs.write(ino, fh, max - 1, b"zz").await,
        Err(FsError::TOO_BIG)
    );
    assert_eq!(
        fs.write(ino, fh, u64::MAX, b"z").await,
        Err(FsError::TOO_BIG)
    );

    // Handles: unknown, another file's, or read-only for a write.
    let other = file(&fs, ROOT, "g", b"").await;
    assert_eq!(
        fs.read(ino, FileHandle(999), 0, 1).await,
        Err(FsError::BAD_HANDLE)
    );
    assert_eq!(fs.read(other, fh, 0, 1).await, Err(FsError::BAD_HANDLE));
    let ro = fs.open(ino, RO).await.unwrap();
    assert_eq!(fs.write(ino, ro, 0, b"x").await, Err(FsError::BAD_HANDLE));
    assert_eq!(fs.read(ino, ro, 0, 5).await.unwrap(), b"hello");
    // No flush or fsync: ENOSYS, which the guest kernel takes as "nothing to do".
    assert_eq!(fs.flush(ino, ro).await, Err(FsError::UNSUPPORTED));
    assert_eq!(fs.fsync(ino, ro, true).await, Err(FsError::UNSUPPORTED));
    fs.release(ino, ro).await.unwrap();
    assert_eq!(fs.release(ino, ro).await, Err(FsError::BAD_HANDLE));
    fs.release(ino, fh).await.unwrap();
    check(&fs);
}

#[tokio::test]
async fn create_refuses_an_existing_name_under_o_excl_and_opens_it_otherwise() {
    let fs = MemoryFs::new();
    let ino = file(&fs, ROOT, "f", b"contents").await;
    let excl = OpenFlags(libc::O_RDWR | libc::O_CREAT | libc::O_EXCL);
    assert_eq!(
        fs.create(ROOT, n("f"), 0o644, excl, user()).await.map(drop),
        Err(FsError::EXISTS)
    );
    // The guest believed the name free (a cached negative entry older than the host's file):
    // without O_EXCL the existing file opens, truncated under O_TRUNC.
    let (entry, fh) = fs
        .create(
            ROOT,
            n("f"),
            0o600,
            OpenFlags(libc::O_RDWR | libc::O_CREAT),
            user(),
        )
        .await
        .unwrap();
    assert_eq!(entry.attr.ino, ino);
    assert_eq!(entry.attr.perm, 0o644, "the existing file keeps its mode");
    assert_eq!(fs.read(ino, fh, 0, 100).await.unwrap(), b"contents");
    fs.release(ino, fh).await.unwrap();
    let trunc = OpenFlags(libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC);
    let (entry, fh) = fs.create(ROOT, n("f"), 0o644, trunc, user()).await.unwrap();
    assert_eq!(entry.attr.size, 0);
    fs.release(ino, fh).await.unwrap();

    dir(&fs, ROOT, "d").await;
    VirtualFs::symlink(&fs, ROOT, n("l"), n("f"), user())
        .await
        .unwrap();
    let plain = OpenFlags(libc::O_RDWR | libc::O_CREAT);
    assert_eq!(
        fs.create(ROOT, n("d"), 0o644, plain, user())
            .await
            .map(drop),
        Err(FsError::IS_DIRECTORY)
    );
    assert_eq!(
        fs.create(ROOT, n("l"), 0o644, plain, user())
            .await
            .map(drop),
        Err(FsError::EXISTS)
    );
    assert_eq!(
        fs.create(ino, n("x"), 0o644, plain, user()).await.map(drop),
        Err(FsError::NOT_DIRECTORY)
    );
    check(&fs);
}

#[tokio::test]
async fn open_truncates_under_o_trunc_and_appends_under_o_append() {
    let fs = MemoryFs::new();
    let ino = file(&fs, ROOT, "f", &[7; 100_000]).await;
    let full = used(&fs);
    let fh = fs
        .open(ino, OpenFlags(libc::O_WRONLY | libc::O_TRUNC))
        .await
        .unwrap();
    assert_eq!(fs.getattr(ino).await.unwrap().size, 0);
    assert!(
        full - used(&fs) >= 100_000,
        "truncation gives the bytes back"
    );
    fs.release(ino, fh).await.unwrap();

    file(&fs, ROOT, "log", b"one\n").await;
    let log = fs.lookup(ROOT, n("log")).await.unwrap().attr.ino;
    let fh = fs
        .open(log, OpenFlags(libc::O_WRONLY | libc::O_APPEND))
        .await
        .unwrap();
    // The guest's idea of the end may be stale: O_APPEND writes at the real end.
    assert_eq!(fs.write(log, fh, 0, b"two\n").await, Ok(4));
    assert_eq!(fs.write(log, fh, 1, b"three\n").await, Ok(6));
    fs.release(log, fh).await.unwrap();
    assert_eq!(read_all(&fs, log).await, b"one\ntwo\nthree\n");

    let d = dir(&fs, ROOT, "d").await;
    assert_eq!(fs.open(d, RO).await, Err(FsError::IS_DIRECTORY));
    let l = VirtualFs::symlink(&fs, ROOT, n("l"), n("f"), user())
        .await
        .unwrap();
    assert_eq!(fs.open(l.attr.ino, RO).await, Err(FsError::LOOP));
    assert_eq!(fs.open(InodeId(12345), RO).await, Err(FsError::NOT_FOUND));
    check(&fs);
}

#[tokio::test]
async fn setattr_changes_modes_owners_sizes_and_times() {
    let fs = MemoryFs::new();
    let ino = file(&fs, ROOT, "f", b"abcdef").await;
    let before = fs.getattr(ino).await.unwrap();
    tick();
    let chmod = SetAttr {
        perm: Some(0o4755),
        ..SetAttr::default()
    };
    let attr = fs.setattr(ino, chmod, user()).await.unwrap();
    assert_eq!((attr.kind, attr.perm), (FileKind::File, 0o4755));
    assert!(later(before.ctime, attr.ctime), "chmod changes ctime");
    assert_eq!(attr.mtime, before.mtime, "chmod leaves mtime");
    // Bits outside 0o7777 are not the caller's to set.
    let attr = fs
        .setattr(
            ino,
            SetAttr {
                perm: Some(libc::S_IFDIR | 0o644),
                ..SetAttr::default()
            },
            user(),
        )
        .await
        .unwrap();
    assert_eq!((attr.kind, attr.perm), (FileKind::File, 0o644));

    let chown = SetAttr {
        uid: Some(5),
        gid: Some(6),
        ..SetAttr::default()
    };
    let attr = fs.setattr(ino, chown, root_user()).await.unwrap();
    assert_eq!((attr.uid, attr.gid), (5, 6));

    // Truncation down then up: the cut bytes come back as zeros.
    let shrink = SetAttr {
        size: Some(3),
        ..SetAttr::default()
    };
    let c0 = fs.getattr(ino).await.unwrap();
    tick();
    let attr = fs.setattr(ino, shrink, user()).await.unwrap();
    assert_eq!(attr.size, 3);
    assert!(later(c0.mtime, attr.mtime) && later(c0.ctime, attr.ctime));
    let grow = SetAttr {
        size: Some(6),
        ..SetAttr::default()
    };
    fs.setattr(ino, grow, user()).await.unwrap();
    assert_eq!(read_all(&fs, ino).await, b"abc\0\0\0");

    // Times: given instants, or now.
    let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    let utimes = SetAttr {
        atime: Some(TimeOrNow::At(at)),
        mtime: Some(TimeOrNow::At(at + Duration::from_nanos(5))),
        ..SetAttr::default()
    };
    let attr = fs.setattr(ino, utimes, user()).await.unwrap();
    assert_eq!(attr.atime, at);
    assert_eq!(attr.mtime, at + Duration::from_nanos(5));
    assert!(later(at, attr.ctime));
    let now = SetAttr {
        atime: Some(TimeOrNow::Now),
        mtime: Some(TimeOrNow::Now),
        ..SetAttr::default()
    };
    let start = SystemTime::now();
    let attr = fs.setattr(ino, now, user()).await.unwrap();
    assert!(attr.atime >= start && attr.mtime >= start);
    assert_eq!(attr.atime, attr.mtime);

    // Errors change nothing (all fields or none).
    let too_big = SetAttr {
        perm: Some(0o600),
        size: Some(MemoryFs::MAX_FILE_SIZE + 1),
        ..SetAttr::default()
    };
    assert_eq!(
        fs.setattr(ino, too_big, user()).await,
        Err(FsError::TOO_BIG)
    );
    assert_eq!(fs.getattr(ino).await.unwrap().perm, 0o644);
    let d = dir(&fs, ROOT, "d").await;
    let truncate = SetAttr {
        size: Some(0),
        ..SetAttr::default()
    };
    assert_eq!(
        fs.setattr(d, truncate.clone(), user()).await,
        Err(FsError::IS_DIRECTORY)
    );
    let l = VirtualFs::symlink(&fs, ROOT, n("l"), n("f"), user())
        .await
        .unwrap();
    assert_eq!(
        fs.setattr(l.attr.ino, truncate.clone(), user()).await,
        Err(FsError::INVALID)
    );
    assert_eq!(
        fs.setattr(InodeId(999), truncate, user()).await,
        Err(FsError::NOT_FOUND)
    );
    let chmod_dir = SetAttr {
        perm: Some(0o1777),
        ..SetAttr::default()
    };
    let attr = fs.setattr(d, chmod_dir, user()).await.unwrap();
    assert_eq!((attr.kind, attr.perm), (FileKind::Directory, 0o1777));
    check(&fs);
}

#[tokio::test]
async fn mkdir_counts_links_and_setgid_directories_pass_on_their_group() {
    let fs = MemoryFs::new();
    let a = dir(&fs, ROOT, "a").await;
    dir(&fs, ROOT, "b").await;
    assert_eq!(nlink(&fs, ROOT).await, 4);
    assert_eq!(nlink(&fs, a).await, 2);
    let before = fs.getattr(a).await.unwrap();
    tick();
    let c = dir(&fs, a, "c").await;
    assert_eq!(nlink(&fs, a).await, 3);
    let after = fs.getattr(a).await.unwrap();
    assert!(later(before.mtime, after.mtime) && later(before.ctime, after.ctime));
    let attr = fs.getattr(c).await.unwrap();
    assert_eq!((attr.uid, attr.gid, attr.perm), (1000, 1000, 0o755));
    assert_eq!(
        fs.mkdir(ROOT, n("a"), 0o755, user()).await,
        Err(FsError::EXISTS)
    );
    let f = file(&fs, ROOT, "f", b"").await;
    assert_eq!(
        fs.mkdir(f, n("x"), 0o755, user()).await,
        Err(FsError::NOT_DIRECTORY)
    );

    // A setgid directory: new files get its group, new directories its group and setgid.
    let shared = SetAttr {
        perm: Some(0o2775),
        gid: Some(50),
        ..SetAttr::default()
    };
    fs.setattr(a, shared, root_user()).await.unwrap();
    let sub = fs.mkdir(a, n("sub"), 0o755, user()).await.unwrap().attr;
    assert_eq!((sub.gid, sub.perm), (50, 0o2755));
    let (entry, fh) = fs.create(a, n("new"), 0o644, RW, user()).await.unwrap();
    assert_eq!((entry.attr.uid, entry.attr.gid), (1000, 50));
    fs.release(entry.attr.ino, fh).await.unwrap();
    // A setgid file in a group its maker is not in loses the bit, unless root makes it.
    let sgid = fs
        .mknod(a, n("sgid"), libc::S_IFREG | 0o2755, 0, user())
        .await
        .unwrap()
        .attr;
    assert_eq!((sgid.gid, sgid.perm), (50, 0o755));
    let sgid = fs
        .mknod(a, n("root-sgid"), libc::S_IFREG | 0o2755, 0, root_user())
        .await
        .unwrap()
        .attr;
    assert_eq!((sgid.gid, sgid.perm), (50, 0o2755));
    let link = VirtualFs::symlink(&fs, a, n("l"), n("x"), user())
        .await
        .unwrap()
        .attr;
    assert_eq!((link.gid, link.perm), (50, 0o777));
    check(&fs);
}

#[tokio::test]
async fn unlink_and_rmdir_remove_names_with_their_errors() {
    let fs = MemoryFs::new();
    let d = dir(&fs, ROOT, "d").await;
    let inner = dir(&fs, d, "inner").await;
    let f = file(&fs, d, "f", b"x").await;
    assert_eq!(fs.unlink(d, n("missing")).await, Err(FsError::NOT_FOUND));
    assert_eq!(fs.unlink(d, n("inner")).await, Err(FsError::IS_DIRECTORY));
    assert_eq!(fs.rmdir(d, n("f")).await, Err(FsError::NOT_DIRECTORY));
    assert_eq!(fs.rmdir(ROOT, n("d")).await, Err(FsError::NOT_EMPTY));
    assert_eq!(fs.unlink(f, n("x")).await, Err(FsError::NOT_DIRECTORY));

    let before = fs.getattr(d).await.unwrap();
    tick();
    fs.unlink(d, n("f")).await.unwrap();
    assert_eq!(fs.lookup(d, n("f")).await, Err(FsError::NOT_FOUND));
    let after = fs.getattr(d).await.unwrap();
    assert!(later(before.mtime, after.mtime) && later(before.ctime, after.ctime));
    // Still looked up by the guest: there, with no links, until forgotten.
    assert_eq!(nlink(&fs, f).await, 0);
    fs.forget(f, 1).await;
    assert_eq!(fs.getattr(f).await, Err(FsError::NOT_FOUND));

    assert_eq!(nlink(&fs, d).await, 3);
    fs.rmdir(d, n("inner")).await.unwrap();
    assert_eq!(nlink(&fs, d).await, 2);
    assert_eq!(nlink(&fs, inner).await, 0);
    // Nothing can be made in a removed directory.
    assert_eq!(
        fs.mkdir(inner, n("x"), 0o755, user()).await,
        Err(FsError::NOT_FOUND)
    );
    assert_eq!(
        fs.create(inner, n("x"), 0o644, RW, user()).await.map(drop),
        Err(FsError::NOT_FOUND)
    );
    fs.rmdir(ROOT, n("d")).await.unwrap();
    assert_eq!(nlink(&fs, ROOT).await, 2);
    check(&fs);
    fs.forget(inner, 1).await;
    fs.forget(d, 1).await;
    assert_eq!(fs.getattr(d).await, Err(FsError::NOT_FOUND));
    assert_eq!(used(&fs), 0, "everything removed gave its bytes back");
    check(&fs);
}

#[tokio::test]
async fn symlinks_keep_their_targets() {
    let fs = MemoryFs::new();
    let entry = VirtualFs::symlink(&fs, ROOT, n("l"), n("../some/where"), user())
        .await
        .unwrap();
    let attr = entry.attr;
    assert_eq!(
        (attr.kind, attr.perm, attr.size),
        (FileKind::Symlink, 0o777, 13)
    );
    assert_eq!(fs.readlink(attr.ino).await.unwrap(), b"../some/where");
    assert_eq!(
        VirtualFs::symlink(&fs, ROOT, n("l"), n("x"), user()).await,
        Err(FsError::EXISTS)
    );
    assert_eq!(
        VirtualFs::symlink(&fs, ROOT, n("e"), n(""), user()).await,
        Err(FsError::NOT_FOUND)
    );
    assert_eq!(
        VirtualFs::symlink(&fs, ROOT, n("e"), n("a\0b"), user()).await,
        Err(FsError::INVALID)
    );
    let long = "t".repeat(4096);
    assert_eq!(
        VirtualFs::symlink(&fs, ROOT, n("e"), n(&long), user()).await,
        Err(FsError::NAME_TOO_LONG)
    );
    let f = file(&fs, ROOT, "f", b"").await;
    assert_eq!(fs.readlink(f).await, Err(FsError::INVALID));
    assert_eq!(fs.readlink(ROOT).await, Err(FsError::INVALID));
    check(&fs);
}

#[tokio::test]
async fn mknod_makes_files_fifos_sockets_and_devices() {
    let fs = MemoryFs::new();
    let cases = [
        ("reg", libc::S_IFREG, FileKind::File, 0),
        ("fifo", libc::S_IFIFO, FileKind::Fifo, 0),
        ("sock", libc::S_IFSOCK, FileKind::Socket, 0),
        ("chr", libc::S_IFCHR, FileKind::CharDevice, 0x0103),
        ("blk", libc::S_IFBLK, FileKind::BlockDevice, 0x0801),
    ];
    for (name, format, kind, rdev) in cases {
        let attr = fs
            .mknod(ROOT, n(name), format | 0o640, rdev, user())
            .await
            .unwrap()
            .attr;
        assert_eq!(
            (attr.kind, attr.perm, attr.rdev),
            (kind, 0o640, rdev),
            "{name}"
        );
        assert_eq!(fs.lookup(ROOT, n(name)).await.unwrap().attr, attr);
    }
    assert_eq!(
        fs.mknod(ROOT, n("reg"), libc::S_IFREG | 0o644, 0, user())
            .await,
        Err(FsError::EXISTS)
    );
    for bad in [
        libc::S_IFDIR | 0o755,
        libc::S_IFLNK | 0o777,
        0o644,
        0o170000,
    ] {
        assert_eq!(
            fs.mknod(ROOT, n("bad"), bad, 0, user()).await,
            Err(FsError::INVALID),
            "{bad:o}"
        );
    }
    assert_eq!(fs.lookup(ROOT, n("bad")).await, Err(FsError::NOT_FOUND));
    let kinds: Vec<FileKind> = listing(&fs, ROOT).await.into_iter().map(|e| e.2).collect();
    assert!(kinds.contains(&FileKind::Fifo) && kinds.contains(&FileKind::BlockDevice));
    check(&fs);
}

#[tokio::test]
async fn hard_links_share_the_inode_and_count_their_names() {
    let fs = MemoryFs::new();
    let d = dir(&fs, ROOT, "d").await;
    let f = file(&fs, ROOT, "f", b"shared").await;
    let before = fs.getattr(f).await.unwrap();
    tick();
    let entry = fs.link(f, d, n("g")).await.unwrap();
    assert_eq!((entry.attr.ino, entry.attr.nlink), (f, 2));
    assert!(
        later(before.ctime, entry.attr.ctime),
        "a new name changes ctime"
    );
    assert_eq!(fs.lookup(d, n("g")).await.unwrap().attr.ino, f);
    assert_eq!(fs.link(d, ROOT, n("d2")).await, Err(FsError::NOT_PERMITTED));
    assert_eq!(fs.link(f, ROOT, n("d")).await, Err(FsError::EXISTS));
    assert_eq!(fs.link(f, f, n("x")).await, Err(FsError::NOT_DIRECTORY));
    assert_eq!(
        fs.link(InodeId(999), ROOT, n("x")).await,
        Err(FsError::NOT_FOUND)
    );

    fs.unlink(ROOT, n("f")).await.unwrap();
    assert_eq!(nlink(&fs, f).await, 1);
    assert_eq!(read_all(&fs, f).await, b"shared");
    // Renaming one link over another of the same inode does nothing.
    fs.link(f, d, n("h")).await.unwrap();
    fs.rename(d, n("g"), d, n("h"), NONE).await.unwrap();
    assert_eq!(names(&fs, d).await, [".", "..", "g", "h"]);
    assert_eq!(nlink(&fs, f).await, 2);
    fs.unlink(d, n("g")).await.unwrap();
    fs.unlink(d, n("h")).await.unwrap();
    assert_eq!(nlink(&fs, f).await, 0);
    // An unlinked inode (open somewhere, say) gets no new names.
    assert_eq!(fs.link(f, d, n("back")).await, Err(FsError::NOT_FOUND));
    check(&fs);
}

#[tokio::test]
async fn a_file_has_at_most_max_links_names() {
    let fs = MemoryFs::new();
    let f = file(&fs, ROOT, "f", b"").await;
    let d = dir(&fs, ROOT, "d").await;
    for i in 1..MAX_LINKS {
        fs.link(f, d, n(&i.to_string())).await.unwrap();
    }
    assert_eq!(nlink(&fs, f).await, MAX_LINKS);
    assert_eq!(
        fs.link(f, d, n("one-more")).await,
        Err(FsError::TOO_MANY_LINKS)
    );
    check(&fs);
}

#[tokio::test]
async fn an_open_unlinked_file_keeps_working_until_closed_and_forgotten() {
    let fs = MemoryFs::new();
    let baseline = used(&fs);
    let (entry, fh) = fs.create(ROOT, n("tmp"), 0o600, RW, user()).await.unwrap();
    let ino = entry.attr.ino;
    fs.write(ino, fh, 0, &[1; 200_000]).await.unwrap();
    fs.unlink(ROOT, n("tmp")).await.unwrap();
    assert_eq!(fs.lookup(ROOT, n("tmp")).await, Err(FsError::NOT_FOUND));
    assert_eq!(names(&fs, ROOT).await, [".", ".."]);
    assert_eq!(nlink(&fs, ino).await, 0);
    fs.write(ino, fh, 200_000, b"tail").await.unwrap();
    assert_eq!(
        fs.read(ino, fh, 199_998, 10).await.unwrap(),
        b"\x01\x01tail"
    );
    let truncate = SetAttr {
        size: Some(10),
        handle: Some(fh),
        ..SetAttr::default()
    };
    assert_eq!(fs.setattr(ino, truncate, user()).await.unwrap().size, 10);
    assert!(used(&fs) > baseline, "its bytes are still counted");
    // A new file of the same name is another inode.
    let again = file(&fs, ROOT, "tmp", b"new").await;
    assert_ne!(again, ino);
    assert_eq!(fs.read(ino, fh, 0, 100).await.unwrap(), [1; 10]);
    check(&fs);

    // Closed but still known to the guest's kernel: kept.
    fs.release(ino, fh).await.unwrap();
    assert!(fs.getattr(ino).await.is_ok());
    // Forgotten too: gone, bytes given back.
    fs.forget(ino, 1).await;
    assert_eq!(fs.getattr(ino).await, Err(FsError::NOT_FOUND));
    fs.unlink(ROOT, n("tmp")).await.unwrap();
    fs.forget(again, 1).await;
    assert_eq!(used(&fs), baseline);

    // The other order: forgotten first, then closed.
    let (entry, fh) = fs.create(ROOT, n("t2"), 0o600, RW, user()).await.unwrap();
    let ino = entry.attr.ino;
    fs.write(ino, fh, 0, b"data").await.unwrap();
    fs.unlink(ROOT, n("t2")).await.unwrap();
    fs.forget(ino, 1).await;
    assert_eq!(fs.read(ino, fh, 0, 10).await.unwrap(), b"data");
    fs.release(ino, fh).await.unwrap();
    assert_eq!(fs.getattr(ino).await, Err(FsError::NOT_FOUND));
    assert_eq!(used(&fs), baseline);
    check(&fs);
}

#[tokio::test]
async fn an_inode_goes_only_when_every_lookup_is_forgotten() {
    let fs = MemoryFs::new();
    let ino = file(&fs, ROOT, "f", b"x").await; // one reference (create)
    for _ in 0..3 {
        fs.lookup(ROOT, n("f")).await.unwrap();
    }
    fs.unlink(ROOT, n("f")).await.unwrap();
    fs.forget(ino, 2).await;
    assert!(fs.getattr(ino).await.is_ok());
    fs.forget(ino, 1).await;
    assert!(fs.getattr(ino).await.is_ok());
    fs.forget(ino, 1).await;
    assert_eq!(fs.getattr(ino).await, Err(FsError::NOT_FOUND));
    // Forgetting what is gone, or too much, is harmless.
    fs.forget(ino, 5).await;
    let kept = file(&fs, ROOT, "kept", b"y").await;
    fs.forget(kept, u64::MAX).await;
    assert_eq!(
        read_all(&fs, kept).await,
        b"y",
        "a file with a name stays however often it is forgotten"
    );
    // Inode numbers are never reused.
    let next = file(&fs, ROOT, "next", b"").await;
    assert!(next.0 > kept.0 && next.0 > ino.0);
    check(&fs);
}

#[tokio::test]
async fn rename_moves_names_between_directories() {
    let fs = MemoryFs::new();
    let a = dir(&fs, ROOT, "a").await;
    let b = dir(&fs, ROOT, "b").await;
    let f = file(&fs, a, "f", b"x").await;
    let before = fs.getattr(f).await.unwrap();
    let (a0, b0) = (fs.getattr(a).await.unwrap(), fs.getattr(b).await.unwrap());
    tick();
    fs.rename(a, n("f"), b, n("g"), NONE).await.unwrap();
    assert_eq!(fs.lookup(a, n("f")).await, Err(FsError::NOT_FOUND));
    assert_eq!(fs.lookup(b, n("g")).await.unwrap().attr.ino, f);
    let after = fs.getattr(f).await.unwrap();
    assert!(
        later(before.ctime, after.ctime),
        "a moved inode's ctime changes"
    );
    assert_eq!(after.mtime, before.mtime);
    assert!(later(a0.mtime, fs.getattr(a).await.unwrap().mtime));
    assert!(later(b0.mtime, fs.getattr(b).await.unwrap().mtime));

    // A directory moves with its `..` and the link counts of both parents.
    let sub = dir(&fs, a, "sub").await;
    file(&fs, sub, "inside", b"").await;
    assert_eq!((nlink(&fs, a).await, nlink(&fs, b).await), (3, 2));
    fs.rename(a, n("sub"), b, n("sub"), NONE).await.unwrap();
    assert_eq!((nlink(&fs, a).await, nlink(&fs, b).await), (2, 3));
    let dotdot = listing(&fs, sub).await;
    assert_eq!(dotdot[1], ("..".to_string(), b, FileKind::Directory));
    assert_eq!(dotdot[2].0, "inside");
    // Within one directory: same counts.
    fs.rename(b, n("sub"), b, n("sub2"), NONE).await.unwrap();
    assert_eq!(nlink(&fs, b).await, 3);
    // A name onto itself: nothing happens.
    fs.rename(b, n("sub2"), b, n("sub2"), NONE).await.unwrap();
    assert_eq!(fs.lookup(b, n("sub2")).await.unwrap().attr.ino, sub);

    assert_eq!(
        fs.rename(a, n("missing"), b, n("x"), NONE).await,
        Err(FsError::NOT_FOUND)
    );
    assert_eq!(
        fs.rename(b, n("g"), f, n("x"), NONE).await,
        Err(FsError::NOT_DIRECTORY)
    );
    assert_eq!(
        fs.rename(f, n("g"), b, n("x"), NONE).await,
        Err(FsError::NOT_DIRECTORY)
    );
    // Into a removed directory: no.
    let gone = dir(&fs, ROOT, "gone").await;
    fs.rmdir(ROOT, n("gone")).await.unwrap();
    assert_eq!(
        fs.rename(b, n("g"), gone, n("x"), NONE).await,
        Err(FsError::NOT_FOUND)
    );
    check(&fs);
}

#[tokio::test]
async fn rename_replaces_by_posix_rules() {
    let fs = MemoryFs::new();
    let d = dir(&fs, ROOT, "d").await;
    let full = dir(&fs, ROOT, "full").await;
    file(&fs, full, "x", b"").await;
    let empty = dir(&fs, ROOT, "empty").await;
    let f = file(&fs, ROOT, "f", b"new").await;
    let old = file(&fs, ROOT, "old", b"old contents").await;
    fs.forget(old, 1).await; // the guest no longer holds it

    assert_eq!(
        fs.rename(ROOT, n("f"), ROOT, n("d"), NONE).await,
        Err(FsError::IS_DIRECTORY)
    );
    assert_eq!(
        fs.rename(ROOT, n("d"), ROOT, n("f"), NONE).await,
        Err(FsError::NOT_DIRECTORY)
    );
    assert_eq!(
        fs.rename(ROOT, n("d"), ROOT, n("full"), NONE).await,
        Err(FsError::NOT_EMPTY)
    );
    assert_eq!(
        fs.rename(ROOT, n("f"), ROOT, n("old"), NOREPLACE).await,
        Err(FsError::EXISTS)
    );
    assert_eq!(
        fs.rename(ROOT, n("f"), ROOT, n("f"), NOREPLACE).await,
        Err(FsError::EXISTS)
    );
    // A directory into itself or its own subtree.
    let deep = dir(&fs, d, "deep").await;
    assert_eq!(
        fs.rename(ROOT, n("d"), deep, n("d"), NONE).await,
        Err(FsError::INVALID)
    );
    assert_eq!(
        fs.rename(ROOT, n("d"), d, n("d"), NONE).await,
        Err(FsError::INVALID)
    );
    // Nothing changed by the failures.
    assert_eq!(nlink(&fs, ROOT).await, 2 + 3);
    check(&fs);

    // A file over a file: the replaced inode goes (nobody holds it).
    let before = used(&fs);
    fs.rename(ROOT, n("f"), ROOT, n("old"), NONE).await.unwrap();
    assert_eq!(fs.lookup(ROOT, n("old")).await.unwrap().attr.ino, f);
    assert_eq!(fs.getattr(old).await, Err(FsError::NOT_FOUND));
    assert!(used(&fs) < before);
    // NOREPLACE onto a free name works.
    fs.rename(ROOT, n("old"), ROOT, n("fresh"), NOREPLACE)
        .await
        .unwrap();
    // A directory over an empty directory, across parents.
    let root_links = nlink(&fs, ROOT).await;
    fs.rename(d, n("deep"), ROOT, n("empty"), NONE)
        .await
        .unwrap();
    assert_eq!(fs.lookup(ROOT, n("empty")).await.unwrap().attr.ino, deep);
    assert_eq!(
        nlink(&fs, ROOT).await,
        root_links,
        "one subdirectory for another"
    );
    assert_eq!(nlink(&fs, d).await, 2);
    assert_eq!(
        nlink(&fs, empty).await,
        0,
        "the replaced directory is removed"
    );
    // A replaced file the guest still holds stays readable.
    let held = file(&fs, ROOT, "held", b"still here").await;
    let fh = fs.open(held, RO).await.unwrap();
    fs.rename(ROOT, n("fresh"), ROOT, n("held"), NONE)
        .await
        .unwrap();
    assert_eq!(nlink(&fs, held).await, 0);
    assert_eq!(fs.read(held, fh, 0, 100).await.unwrap(), b"still here");
    fs.release(held, fh).await.unwrap();
    check(&fs);
}

#[tokio::test]
async fn rename_exchange_swaps_two_names_atomically() {
    let fs = MemoryFs::new();
    let a = dir(&fs, ROOT, "a").await;
    let b = dir(&fs, ROOT, "b").await;
    let f = file(&fs, a, "f", b"file").await;
    let sub = dir(&fs, b, "sub").await;
    file(&fs, sub, "inside", b"").await;
    let g = file(&fs, a, "g", b"other").await;

    // Two files in one directory.
    fs.rename(a, n("f"), a, n("g"), EXCHANGE).await.unwrap();
    assert_eq!(fs.lookup(a, n("f")).await.unwrap().attr.ino, g);
    assert_eq!(fs.lookup(a, n("g")).await.unwrap().attr.ino, f);

    // A file and a non-empty directory across parents: both parents' counts follow.
    assert_eq!((nlink(&fs, a).await, nlink(&fs, b).await), (2, 3));
    fs.rename(a, n("g"), b, n("sub"), EXCHANGE).await.unwrap();
    assert_eq!(fs.lookup(a, n("g")).await.unwrap().attr.ino, sub);
    assert_eq!(fs.lookup(b, n("sub")).await.unwrap().attr.ino, f);
    assert_eq!((nlink(&fs, a).await, nlink(&fs, b).await), (3, 2));
    assert_eq!(
        listing(&fs, sub).await[1].1,
        a,
        "the directory's .. follows it"
    );
    check(&fs);

    // Two directories across parents.
    let other = dir(&fs, b, "other").await;
    fs.rename(a, n("g"), b, n("other"), EXCHANGE).await.unwrap();
    assert_eq!(listing(&fs, sub).await[1].1, b);
    assert_eq!(listing(&fs, other).await[1].1, a);
    assert_eq!((nlink(&fs, a).await, nlink(&fs, b).await), (3, 3));
    check(&fs);

    // Both names must exist; no directory into its own subtree; not with NOREPLACE.
    assert_eq!(
        fs.rename(a, n("f"), b, n("missing"), EXCHANGE).await,
        Err(FsError::NOT_FOUND)
    );
    let deeper = dir(&fs, other, "deeper").await;
    assert_eq!(
        fs.rename(a, n("g"), deeper, n("x"), EXCHANGE).await,
        Err(FsError::NOT_FOUND)
    );
    file(&fs, deeper, "x", b"").await;
    assert_eq!(
        fs.rename(a, n("g"), deeper, n("x"), EXCHANGE).await,
        Err(FsError::INVALID)
    );
    assert_eq!(
        fs.rename(deeper, n("x"), a, n("g"), EXCHANGE).await,
        Err(FsError::INVALID)
    );
    let both = RenameFlags {
        no_replace: true,
        exchange: true,
    };
    assert_eq!(
        fs.rename(a, n("f"), b, n("sub"), both).await,
        Err(FsError::INVALID)
    );
    // A name with itself: nothing happens.
    fs.rename(a, n("f"), a, n("f"), EXCHANGE).await.unwrap();
    assert_eq!(fs.lookup(a, n("f")).await.unwrap().attr.ino, g);
    check(&fs);
}

#[tokio::test]
async fn readdir_lists_dot_dotdot_and_entries_and_resumes_at_cookies() {
    let fs = MemoryFs::new();
    let d = dir(&fs, ROOT, "d").await;
    let f = file(&fs, d, "f", b"").await;
    let s = dir(&fs, d, "s").await;
    let l = VirtualFs::symlink(&fs, d, n("l"), n("f"), user())
        .await
        .unwrap()
        .attr
        .ino;
    let all = listing(&fs, d).await;
    assert_eq!(
        all,
        [
            (".".into(), d, FileKind::Directory),
            ("..".into(), ROOT, FileKind::Directory),
            ("f".into(), f, FileKind::File),
            ("s".into(), s, FileKind::Directory),
            ("l".into(), l, FileKind::Symlink),
        ]
    );
    let fh = fs.opendir(d).await.unwrap();
    let first = fs.readdir(d, fh, 0).await.unwrap();
    assert!(first.iter().all(|e| e.offset != 0));
    // Resuming after each entry gives what follows it.
    for (i, entry) in first.iter().enumerate() {
        let rest = fs.readdir(d, fh, entry.offset).await.unwrap();
        assert_eq!(rest, first[i + 1..], "after {:?}", entry.name);
    }
    // Changes while listing: a removed entry is not listed, an added one is.
    let after_f = first[2].offset;
    fs.unlink(d, n("s")).await.unwrap_err(); // a directory: not unlinked
    fs.rmdir(d, n("s")).await.unwrap();
    file(&fs, d, "new", b"").await;
    let rest: Vec<String> = fs
        .readdir(d, fh, after_f)
        .await
        .unwrap()
        .iter()
        .map(|e| e.name.to_string_lossy().into_owned())
        .collect();
    assert_eq!(rest, ["l", "new"]);
    // An entry removed right at the cookie: the listing resumes after it all the same.
    fs.unlink(d, n("f")).await.unwrap();
    assert_eq!(fs.readdir(d, fh, after_f).await.unwrap().len(), 2);

    // Handles: a directory's own only.
    assert_eq!(fs.readdir(ROOT, fh, 0).await, Err(FsError::BAD_HANDLE));
    assert_eq!(
        fs.readdir(d, FileHandle(999), 0).await,
        Err(FsError::BAD_HANDLE)
    );
    let file_handle = fs.open(l, RO).await.unwrap_err();
    assert_eq!(file_handle, FsError::LOOP);
    let g = file(&fs, d, "g", b"").await;
    let gh = fs.open(g, RO).await.unwrap();
    assert_eq!(fs.readdir(g, gh, 0).await, Err(FsError::BAD_HANDLE));
    assert_eq!(fs.releasedir(g, gh).await, Err(FsError::BAD_HANDLE));
    fs.release(g, gh).await.unwrap();
    assert_eq!(fs.opendir(g).await, Err(FsError::NOT_DIRECTORY));
    assert_eq!(fs.release(d, fh).await, Err(FsError::BAD_HANDLE));
    fs.releasedir(d, fh).await.unwrap();
    assert_eq!(fs.readdir(d, fh, 0).await, Err(FsError::BAD_HANDLE));
    check(&fs);
}

/// The median time of a `readdir` of the last full batch of a directory of `count` entries
/// (the call a listing that costs its position, or its directory's size, makes dearest).
async fn readdir_median(fs: &MemoryFs, d: InodeId, count: u64) -> Duration {
    let fh = fs.opendir(d).await.unwrap();
    // Cookies are 3.. in creation order.
    let offset = 2 + count - READDIR_BATCH as u64;
    let mut times = Vec::new();
    for _ in 0..31 {
        let start = Instant::now();
        let batch = fs.readdir(d, fh, offset).await.unwrap();
        times.push(start.elapsed());
        assert_eq!(batch.len(), READDIR_BATCH);
    }
    fs.releasedir(d, fh).await.unwrap();
    times.sort();
    times[times.len() / 2]
}

#[tokio::test]
async fn readdir_of_70000_entries_is_complete_and_each_call_costs_its_batch() {
    const COUNT: u64 = 70_000;
    let fs = MemoryFs::new();
    let big = dir(&fs, ROOT, "big").await;
    let small = dir(&fs, ROOT, "small").await;
    for i in 0..COUNT {
        let mode = libc::S_IFREG | 0o644;
        let name = format!("file-{i:05}");
        let ino = fs
            .mknod(big, n(&name), mode, 0, user())
            .await
            .unwrap()
            .attr
            .ino;
        fs.forget(ino, 1).await;
        if i < 2 * READDIR_BATCH as u64 {
            fs.mknod(small, n(&name), mode, 0, user()).await.unwrap();
        }
    }
    // Complete, each name once, in batches the guest's buffers take.
    let fh = fs.opendir(big).await.unwrap();
    let mut offset = 0;
    let mut seen = std::collections::HashSet::new();
    let mut calls = 0;
    loop {
        let batch = fs.readdir(big, fh, offset).await.unwrap();
        calls += 1;
        assert!(batch.len() <= READDIR_BATCH);
        let Some(last) = batch.last() else { break };
        offset = last.offset;
        for entry in batch {
            assert!(seen.insert(entry.name), "listed twice");
        }
    }
    fs.releasedir(big, fh).await.unwrap();
    assert_eq!(seen.len() as u64, COUNT + 2);
    assert!(seen.contains(OsStr::new("file-69999")) && seen.contains(OsStr::new("..")));
    assert!(calls <= (COUNT as usize + 2) / READDIR_BATCH + 2);

    // A call costs what it returns, not what the directory holds: a full batch from a
    // directory of 70,000 takes about as long as one from a directory of 512 (a copy of the
    // listing per call would take over a hundred times as long).
    let in_big = readdir_median(&fs, big, COUNT).await;
    let in_small = readdir_median(&fs, small, 2 * READDIR_BATCH as u64).await;
    assert!(
        in_big < in_small * 20 + Duration::from_micros(500),
        "a batch from 70,000 entries took {in_big:?}, from 512 {in_small:?}"
    );
    check(&fs);
}

#[tokio::test]
async fn open_handles_are_bounded_and_released() {
    let fs = MemoryFs::new();
    let f = file(&fs, ROOT, "f", b"").await;
    let mut handles = Vec::new();
    for _ in 0..MemoryFs::MAX_OPEN_HANDLES {
        handles.push(fs.open(f, RO).await.unwrap());
    }
    let nfile = errno(libc::ENFILE);
    assert_eq!(fs.open(f, RO).await, Err(nfile));
    assert_eq!(fs.opendir(ROOT).await, Err(nfile));
    assert_eq!(
        fs.create(ROOT, n("g"), 0o644, RW, user()).await.map(drop),
        Err(nfile)
    );
    assert_eq!(
        fs.lookup(ROOT, n("g")).await,
        Err(FsError::NOT_FOUND),
        "a create that failed made nothing"
    );
    fs.release(f, handles.pop().unwrap()).await.unwrap();
    let dh = fs.opendir(ROOT).await.unwrap();
    assert_eq!(fs.open(f, RO).await, Err(nfile));
    fs.releasedir(ROOT, dh).await.unwrap();
    for fh in handles {
        fs.release(f, fh).await.unwrap();
    }
    check(&fs);
}

#[tokio::test]
async fn statfs_reports_the_limits_and_the_usage() {
    let fs = MemoryFs::with_limits(1 << 20, 100);
    let empty = fs.statfs().await.unwrap();
    assert_eq!(empty.block_size, 4096);
    assert_eq!((empty.blocks, empty.blocks_free), (256, 256));
    assert_eq!((empty.files, empty.files_free), (100, 99));
    assert_eq!(empty.name_max, 255);
    file(&fs, ROOT, "f", &[1; 64 * 1024]).await;
    let after = fs.statfs().await.unwrap();
    assert_eq!(after.files_free, 98);
    assert!(after.blocks_free <= 256 - 16, "{after:?}");
    assert_eq!(after.blocks_available, after.blocks_free);
    check(&fs);
}

#[tokio::test]
async fn xattrs_follow_create_and_replace_rules_and_are_bounded() {
    let fs = MemoryFs::new();
    let f = file(&fs, ROOT, "f", b"").await;
    assert_eq!(fs.getxattr(f, n("user.a")).await, Err(FsError::NO_DATA));
    assert_eq!(fs.listxattr(f).await.unwrap(), Vec::<Vec<u8>>::new());
    let before = fs.getattr(f).await.unwrap();
    tick();
    fs.setxattr(f, n("user.a"), b"one", 0).await.unwrap();
    assert!(later(before.ctime, fs.getattr(f).await.unwrap().ctime));
    assert_eq!(fs.getxattr(f, n("user.a")).await.unwrap(), b"one");
    assert_eq!(
        fs.setxattr(f, n("user.a"), b"two", libc::XATTR_CREATE)
            .await,
        Err(FsError::EXISTS)
    );
    assert_eq!(
        fs.setxattr(f, n("user.b"), b"two", libc::XATTR_REPLACE)
            .await,
        Err(FsError::NO_DATA)
    );
    fs.setxattr(f, n("user.a"), b"two", libc::XATTR_REPLACE)
        .await
        .unwrap();
    fs.setxattr(f, n("user.b"), b"", libc::XATTR_CREATE)
        .await
        .unwrap();
    assert_eq!(fs.getxattr(f, n("user.a")).await.unwrap(), b"two");
    assert_eq!(fs.getxattr(f, n("user.b")).await.unwrap(), b"");
    assert_eq!(
        fs.listxattr(f).await.unwrap(),
        [b"user.a".to_vec(), b"user.b".to_vec()]
    );
    assert_eq!(
        fs.setxattr(f, n("user.a"), b"x", 4).await,
        Err(FsError::INVALID)
    );
    assert_eq!(fs.getxattr(f, n("")).await, Err(FsError::RANGE));
    assert_eq!(
        fs.getxattr(f, n(&"x".repeat(256))).await,
        Err(FsError::RANGE)
    );
    fs.removexattr(f, n("user.a")).await.unwrap();
    assert_eq!(fs.removexattr(f, n("user.a")).await, Err(FsError::NO_DATA));
    assert_eq!(fs.getxattr(f, n("user.a")).await, Err(FsError::NO_DATA));
    assert_eq!(
        fs.getxattr(InodeId(999), n("user.a")).await,
        Err(FsError::NOT_FOUND)
    );

    // Value size and count per inode.
    let max = vec![9; MemoryFs::MAX_XATTR_VALUE];
    fs.setxattr(f, n("user.big"), &max, 0).await.unwrap();
    let over = vec![9; MemoryFs::MAX_XATTR_VALUE + 1];
    assert_eq!(
        fs.setxattr(f, n("user.big"), &over, 0).await,
        Err(errno(libc::E2BIG))
    );
    assert_eq!(fs.getxattr(f, n("user.big")).await.unwrap(), max);
    let d = dir(&fs, ROOT, "d").await;
    for i in 0..MemoryFs::MAX_XATTRS {
        fs.setxattr(d, n(&format!("user.{i}")), b"v", 0)
            .await
            .unwrap();
    }
    assert_eq!(
        fs.setxattr(d, n("user.more"), b"v", 0).await,
        Err(FsError::NO_SPACE)
    );
    fs.setxattr(d, n("user.0"), b"replaced", 0).await.unwrap();
    assert_eq!(fs.listxattr(d).await.unwrap().len(), MemoryFs::MAX_XATTRS);
    check(&fs);

    // Their bytes are counted, and given back with the inode.
    let before = used(&fs);
    fs.unlink(ROOT, n("f")).await.unwrap();
    fs.forget(f, 1).await;
    assert!(before - used(&fs) >= MemoryFs::MAX_XATTR_VALUE as u64);
    check(&fs);
}

#[tokio::test]
async fn past_the_byte_limit_writes_fail_with_enospc_and_memory_stays_put() {
    const LIMIT: u64 = 256 * 1024;
    let fs = MemoryFs::with_limits(LIMIT, 1000);
    let (entry, fh) = fs.create(ROOT, n("f"), 0o644, RW, user()).await.unwrap();
    let ino = entry.attr.ino;
    let chunk = vec![5u8; 64 * 1024];
    let mut offset = 0;
    let result = loop {
        match fs.write(ino, fh, offset, &chunk).await {
            Ok(written) => offset += u64::from(written),
            Err(err) => break err,
        }
        assert!(offset < 10 * LIMIT, "writes never stopped");
    };
    assert_eq!(result, FsError::NO_SPACE);
    assert_eq!(offset, 3 * 64 * 1024);
    // What is left, in single bytes a chunk apart (the dearest way to use it).
    let mut far = 1000 * 64 * 1024;
    while fs.write(ino, fh, far, b"1").await.is_ok() {
        far += 64 * 1024;
    }
    assert!(
        far > 1100 * 64 * 1024,
        "single bytes took some of what was left"
    );
    let full = used(&fs);
    assert!(full <= LIMIT && LIMIT - full < 100, "{full}");
    let size = fs.getattr(ino).await.unwrap().size;
    for i in 0..100 {
        assert_eq!(
            fs.write(ino, fh, offset + i * 4096, &chunk).await,
            Err(FsError::NO_SPACE)
        );
        assert_eq!(
            fs.write(ino, fh, LIMIT * 100 + i, &chunk).await,
            Err(FsError::NO_SPACE)
        );
    }
    assert_eq!(used(&fs), full, "failed writes allocate nothing");
    assert_eq!(fs.getattr(ino).await.unwrap().size, size);
    // Names, attributes and the host's files count too.
    let long = "n".repeat(255);
    assert_eq!(
        fs.mkdir(ROOT, n(&long), 0o755, user()).await,
        Err(FsError::NO_SPACE)
    );
    assert_eq!(
        fs.setxattr(ino, n("user.x"), &[0; 100], 0).await,
        Err(FsError::NO_SPACE)
    );
    assert_eq!(
        fs.write_file("/host", &[1; 64 * 1024]),
        Err(FsError::NO_SPACE)
    );
    assert_eq!(fs.lookup(ROOT, n("host")).await, Err(FsError::NOT_FOUND));
    assert_eq!(used(&fs), full);
    // Truncation makes room again.
    let shrink = SetAttr {
        size: Some(0),
        ..SetAttr::default()
    };
    fs.setattr(ino, shrink, user()).await.unwrap();
    assert_eq!(used(&fs), 1 + ENTRY_COST, "only the name is left");
    assert_eq!(fs.write(ino, fh, 0, &chunk).await, Ok(chunk.len() as u32));
    fs.release(ino, fh).await.unwrap();
    // A host rewrite that does not fit keeps the old contents.
    fs.write_file("/h", &[2; 64 * 1024]).unwrap();
    assert_eq!(
        fs.write_file("/h", &[3; 200 * 1024]),
        Err(FsError::NO_SPACE)
    );
    assert_eq!(fs.read_file("/h").unwrap(), [2; 64 * 1024]);
    check(&fs);
}

#[tokio::test]
async fn names_count_against_the_byte_limit() {
    let fs = MemoryFs::with_limits(64 * 1024, 1_000_000);
    let f = file(&fs, ROOT, "f", b"").await;
    let mut made = 0;
    let err = loop {
        match fs.link(f, ROOT, n(&format!("{made:0200}"))).await {
            Ok(_) => made += 1,
            Err(err) => break err,
        }
    };
    assert_eq!(err, FsError::NO_SPACE);
    assert!(made > 100 && made < 64 * 1024 / 200, "{made} names");
    check(&fs);
}

#[tokio::test]
async fn past_the_inode_limit_nothing_new_is_made() {
    let fs = MemoryFs::with_limits(1 << 20, 10);
    let mut files = Vec::new();
    for i in 0..9 {
        files.push(file(&fs, ROOT, &format!("f{i}"), b"").await);
    }
    assert_eq!(
        fs.create(ROOT, n("x"), 0o644, RW, user()).await.map(drop),
        Err(FsError::NO_SPACE)
    );
    assert_eq!(
        fs.mkdir(ROOT, n("x"), 0o755, user()).await,
        Err(FsError::NO_SPACE)
    );
    assert_eq!(
        fs.mknod(ROOT, n("x"), libc::S_IFIFO | 0o644, 0, user())
            .await,
        Err(FsError::NO_SPACE)
    );
    assert_eq!(
        VirtualFs::symlink(&fs, ROOT, n("x"), n("t"), user()).await,
        Err(FsError::NO_SPACE)
    );
    assert_eq!(fs.write_file("/x", b""), Err(FsError::NO_SPACE));
    assert_eq!(fs.statfs().await.unwrap().files_free, 0);
    // A hard link needs no inode.
    fs.link(files[0], ROOT, n("link")).await.unwrap();
    // A removed and forgotten file frees its inode.
    fs.unlink(ROOT, n("f1")).await.unwrap();
    fs.forget(files[1], 1).await;
    dir(&fs, ROOT, "x").await;
    check(&fs);
}

#[tokio::test]
async fn the_host_api_seeds_reads_and_removes_by_path() {
    let fs = MemoryFs::new();
    fs.write_file("/a/b/c.txt", b"seed").unwrap();
    fs.write_file("//a/./b/d.txt", b"").unwrap();
    fs.create_dir_all("/a/e/f").unwrap();
    fs.symlink("/links/l", "../a/b/c.txt").unwrap();
    assert_eq!(fs.read_file("/a/b/c.txt").unwrap(), b"seed");
    assert_eq!(fs.read_dir("/a").unwrap(), ["b", "e"]);
    assert_eq!(fs.read_dir("/a/b").unwrap(), ["c.txt", "d.txt"]);
    assert_eq!(fs.read_dir("/").unwrap(), ["a", "links"]);
    let meta = fs.metadata("/a/b/c.txt").unwrap();
    assert_eq!(
        (meta.kind, meta.size, meta.perm),
        (FileKind::File, 4, 0o644)
    );
    assert_eq!((meta.uid, meta.gid, meta.nlink), (0, 0, 1));
    let dir_meta = fs.metadata("/a").unwrap();
    assert_eq!((dir_meta.perm, dir_meta.nlink), (0o755, 4));
    assert_eq!(fs.metadata("/links/l").unwrap().kind, FileKind::Symlink);

    // Bad paths.
    for bad in ["a/b", "", "/a/../b", "/a/b\0"] {
        assert_eq!(fs.read_file(bad), Err(FsError::INVALID), "{bad:?}");
        assert_eq!(fs.write_file(bad, b""), Err(FsError::INVALID), "{bad:?}");
    }
    assert_eq!(
        fs.metadata(&format!("/{}", "x".repeat(256))),
        Err(FsError::NAME_TOO_LONG)
    );
    // Kinds: symlinks are never followed.
    assert_eq!(fs.read_file("/a"), Err(FsError::IS_DIRECTORY));
    assert_eq!(fs.write_file("/a", b""), Err(FsError::IS_DIRECTORY));
    assert_eq!(fs.write_file("/", b""), Err(FsError::IS_DIRECTORY));
    assert_eq!(fs.read_file("/links/l"), Err(FsError::LOOP));
    assert_eq!(fs.write_file("/links/l", b""), Err(FsError::LOOP));
    assert_eq!(fs.read_file("/links/l/x"), Err(FsError::NOT_DIRECTORY));
    assert_eq!(
        fs.write_file("/a/b/c.txt/x", b""),
        Err(FsError::NOT_DIRECTORY)
    );
    assert_eq!(fs.create_dir_all("/a/b/c.txt"), Err(FsError::EXISTS));
    assert_eq!(
        fs.create_dir_all("/a/b/c.txt/x"),
        Err(FsError::NOT_DIRECTORY)
    );
    assert_eq!(fs.read_dir("/a/b/c.txt"), Err(FsError::NOT_DIRECTORY));
    assert_eq!(fs.symlink("/links/l", "x"), Err(FsError::EXISTS));
    assert_eq!(fs.symlink("/links/m", ""), Err(FsError::NOT_FOUND));
    assert_eq!(fs.read_file("/missing"), Err(FsError::NOT_FOUND));
    fs.create_dir_all("/").unwrap();

    // Removal.
    assert_eq!(fs.remove("/a/b"), Err(FsError::NOT_EMPTY));
    assert_eq!(fs.remove("/"), Err(errno(libc::EBUSY)));
    assert_eq!(fs.remove("/nothing"), Err(FsError::NOT_FOUND));
    fs.remove("/a/b/c.txt").unwrap();
    fs.remove("/a/b/d.txt").unwrap();
    fs.remove("/a/b").unwrap();
    fs.remove("/links/l").unwrap();
    assert_eq!(fs.read_dir("/a").unwrap(), ["e"]);
    assert_eq!(fs.metadata("/a").unwrap().nlink, 3);
    check(&fs);
    assert!(format!("{fs:?}").contains("max_inodes: 1000000"));
}

#[tokio::test]
async fn host_and_guest_see_each_others_changes() {
    let fs = MemoryFs::new();
    let host = fs.clone();
    host.write_file("/src/main.py", b"print('hi')\n").unwrap();

    // The guest finds and reads what the host seeded.
    let src = fs.lookup(ROOT, n("src")).await.unwrap().attr.ino;
    let main = fs.lookup(src, n("main.py")).await.unwrap().attr.ino;
    assert_eq!(read_all(&fs, main).await, b"print('hi')\n");

    // The host reads what the guest writes, while the file is open.
    let (entry, fh) = fs
        .create(ROOT, n("out.txt"), 0o644, RW, user())
        .await
        .unwrap();
    let out = entry.attr.ino;
    fs.write(out, fh, 0, b"partial").await.unwrap();
    assert_eq!(host.read_file("/out.txt").unwrap(), b"partial");
    fs.write(out, fh, 7, b" and more").await.unwrap();
    assert_eq!(host.read_file("/out.txt").unwrap(), b"partial and more");
    assert_eq!(host.metadata("/out.txt").unwrap().uid, 1000);

    // The host rewrites an open file: the same inode, so the guest's handle reads the new bytes.
    host.write_file("/out.txt", b"from the host").unwrap();
    assert_eq!(host.metadata("/out.txt").unwrap().ino, out);
    assert_eq!(fs.read(out, fh, 0, 100).await.unwrap(), b"from the host");

    // The host removes it: the guest's handle keeps working, the name is gone.
    host.remove("/out.txt").unwrap();
    assert_eq!(fs.lookup(ROOT, n("out.txt")).await, Err(FsError::NOT_FOUND));
    fs.write(out, fh, 0, b"FROM").await.unwrap();
    assert_eq!(fs.read(out, fh, 0, 100).await.unwrap(), b"FROM the host");
    fs.release(out, fh).await.unwrap();
    fs.forget(out, 1).await;
    assert_eq!(fs.getattr(out).await, Err(FsError::NOT_FOUND));

    // The guest's directories and symlinks, seen by the host.
    let d = dir(&fs, ROOT, "made-by-guest").await;
    VirtualFs::symlink(&fs, d, n("link"), n("/etc/hosts"), user())
        .await
        .unwrap();
    assert_eq!(host.read_dir("/made-by-guest").unwrap(), ["link"]);
    assert_eq!(host.metadata("/made-by-guest/link").unwrap().size, 10);
    // The host makes a name the guest thinks free (a cached negative lookup): creating it
    // without O_EXCL opens the host's file.
    host.write_file("/made-by-guest/late", b"host").unwrap();
    let plain = OpenFlags(libc::O_RDWR | libc::O_CREAT);
    let (entry, fh) = fs.create(d, n("late"), 0o644, plain, user()).await.unwrap();
    assert_eq!(fs.read(entry.attr.ino, fh, 0, 10).await.unwrap(), b"host");
    fs.release(entry.attr.ino, fh).await.unwrap();
    check(&fs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_from_many_tasks_keep_the_tree_whole() {
    let fs = MemoryFs::new();
    let mut tasks = Vec::new();
    for t in 0..8u8 {
        let fs = fs.clone();
        tasks.push(tokio::spawn(async move {
            let d = dir(&fs, ROOT, &format!("d{t}")).await;
            let (entry, fh) = fs.create(d, n("data"), 0o644, RW, user()).await.unwrap();
            let ino = entry.attr.ino;
            for i in 0..64u64 {
                fs.write(ino, fh, i * 4096, &[t; 4096]).await.unwrap();
                if i % 8 == 0 {
                    let name = format!("tmp{i}");
                    file(&fs, d, &name, b"x").await;
                    fs.rename(d, n(&name), ROOT, n(&format!("moved-{t}-{i}")), NONE)
                        .await
                        .unwrap();
                }
            }
            fs.release(ino, fh).await.unwrap();
            ino
        }));
    }
    let lister = {
        let fs = fs.clone();
        tokio::spawn(async move {
            for _ in 0..50 {
                let all = listing(&fs, ROOT).await;
                assert!(all.len() >= 2);
                tokio::task::yield_now().await;
            }
        })
    };
    for (t, task) in tasks.into_iter().enumerate() {
        task.await.unwrap();
        let bytes = fs.read_file(&format!("/d{t}/data")).unwrap();
        assert_eq!(bytes.len(), 64 * 4096);
        assert!(bytes.iter().all(|&b| b == t as u8));
    }
    lister.await.unwrap();
    assert_eq!(fs.read_dir("/").unwrap().len(), 8 + 8 * 8);
    check(&fs);
}

#[test]
fn memory_fs_is_send_sync_and_a_virtual_fs() {
    fn assert_traits<T: VirtualFs + Clone + Send + Sync + std::fmt::Debug>() {}
    assert_traits::<MemoryFs>();
    let shared: std::sync::Arc<dyn VirtualFs> = std::sync::Arc::new(MemoryFs::default());
    drop(shared);
    // Names are bytes: a name that is not UTF-8 is kept as given.
    let fs = MemoryFs::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        let name = OsStr::from_bytes(b"caf\xe9");
        fs.mknod(ROOT, name, libc::S_IFREG | 0o644, 0, user())
            .await
            .unwrap();
        assert!(fs.lookup(ROOT, name).await.is_ok());
        let listed = listing(&fs, ROOT).await;
        assert_eq!(listed[2].0, "caf\u{fffd}");
    });
    assert_eq!(fs.read_dir("/").unwrap(), ["caf\u{fffd}"]);
}

/// `fallocate` gives a range buffers counted like written bytes: mode 0 grows the size,
/// `FALLOC_FL_KEEP_SIZE` does not; written bytes stay; past the limit it fails with ENOSPC
/// and nothing changes; other modes, read-only handles and empty ranges are refused.
#[tokio::test]
async fn fallocate_reserves_space_within_the_limit() {
    let fs = MemoryFs::with_limits(1 << 20, 100);
    let ino = file(&fs, ROOT, "f", b"hello").await;
    let fh = fs.open(ino, RW).await.unwrap();
    let before = used(&fs);
    fs.fallocate(ino, fh, 3, 200_000, 0).await.unwrap();
    let attr = fs.getattr(ino).await.unwrap();
    assert_eq!(attr.size, 200_003);
    assert!(used(&fs) >= before + 190_000, "counted: {}", used(&fs));
    let bytes = read_all(&fs, ino).await;
    assert_eq!(&bytes[..5], b"hello", "written bytes stay");
    assert!(bytes[5..].iter().all(|&b| b == 0));
    // KEEP_SIZE: the size stays, also for a range past it.
    fs.fallocate(ino, fh, 100_000, 500_000, libc::FALLOC_FL_KEEP_SIZE)
        .await
        .unwrap();
    assert_eq!(fs.getattr(ino).await.unwrap().size, 200_003);
    // Past the limit: ENOSPC, size and usage as they were.
    let used_before = used(&fs);
    assert_eq!(
        fs.fallocate(ino, fh, 0, 4 << 20, 0).await,
        Err(FsError::NO_SPACE)
    );
    assert_eq!(fs.getattr(ino).await.unwrap().size, 200_003);
    assert_eq!(used(&fs), used_before);
    // Refused: other modes, an empty range, a read-only handle, past the largest file.
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    assert_eq!(
        fs.fallocate(ino, fh, 0, 10, punch).await,
        Err(FsError::NOT_SUPPORTED)
    );
    assert_eq!(fs.fallocate(ino, fh, 0, 0, 0).await, Err(FsError::INVALID));
    assert_eq!(
        fs.fallocate(ino, fh, MemoryFs::MAX_FILE_SIZE, 1, 0).await,
        Err(FsError::TOO_BIG)
    );
    let ro = fs.open(ino, RO).await.unwrap();
    assert_eq!(
        fs.fallocate(ino, ro, 0, 10, 0).await,
        Err(FsError::BAD_HANDLE)
    );
    fs.release(ino, ro).await.unwrap();
    fs.release(ino, fh).await.unwrap();
    check(&fs);
}
