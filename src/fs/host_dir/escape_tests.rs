//! The escape suite: a hostile guest calling the operations directly, each case its own test.
//! Every test ends by checking that the tree outside the served root is exactly as it was and
//! that nothing appeared beside the root.

use std::ffi::OsStr;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{MetadataExt, PermissionsExt};

use super::tests::{
    errno_of, fixture, fixture_with, is_root, list, me, name, read_all, write_file,
};
use super::*;

/// Every operation that takes a name, given `bad`: all must fail (with `errno` if given).
async fn every_name_refused(fs: &HostDir, bad: &OsStr, errno: i32) {
    let file = write_file(fs, InodeId::ROOT, "victim", b"v").await.attr.ino;
    let caller = me();
    let none = RenameFlags::default();
    let results = [
        errno_of(fs.lookup(InodeId::ROOT, bad).await),
        errno_of(
            fs.create(InodeId::ROOT, bad, 0o644, OpenFlags(libc::O_RDWR), caller)
                .await,
        ),
        errno_of(fs.mkdir(InodeId::ROOT, bad, 0o755, caller).await),
        errno_of(
            fs.mknod(InodeId::ROOT, bad, libc::S_IFIFO | 0o644, 0, caller)
                .await,
        ),
        errno_of(fs.symlink(InodeId::ROOT, bad, name("t"), caller).await),
        errno_of(fs.unlink(InodeId::ROOT, bad).await),
        errno_of(fs.rmdir(InodeId::ROOT, bad).await),
        errno_of(
            fs.rename(InodeId::ROOT, name("victim"), InodeId::ROOT, bad, none)
                .await,
        ),
        errno_of(
            fs.rename(InodeId::ROOT, bad, InodeId::ROOT, name("x"), none)
                .await,
        ),
        errno_of(fs.link(file, InodeId::ROOT, bad).await),
    ];
    for (index, result) in results.into_iter().enumerate() {
        assert_eq!(result, errno, "operation {index} with {bad:?}");
    }
    fs.unlink(InodeId::ROOT, name("victim")).await.unwrap();
}

#[tokio::test]
async fn dotdot_dot_slash_and_empty_are_not_names() {
    let f = fixture();
    let before = f.outside_state();
    for bad in [
        "..",
        ".",
        "",
        "../outside",
        "a/b",
        "/",
        "/etc/passwd",
        "../outside/secret.txt",
    ] {
        every_name_refused(&f.fs, name(bad), libc::EINVAL).await;
    }
    // Also from a subdirectory: `..` of the root's child is not the root either.
    let sub =
        f.fs.mkdir(InodeId::ROOT, name("sub"), 0o755, me())
            .await
            .unwrap();
    assert_eq!(
        errno_of(f.fs.lookup(sub.attr.ino, name("..")).await),
        libc::EINVAL
    );
    assert_eq!(f.outside_state(), before);
    assert_eq!(
        std::fs::read_dir(&f.root).unwrap().count(),
        1,
        "only sub was made"
    );
}

#[tokio::test]
async fn nul_bytes_are_refused_in_names_and_targets() {
    let f = fixture();
    let before = f.outside_state();
    for bad in [&b"a\0b"[..], b"\0", b"secret\0/../..", b"..\0"] {
        every_name_refused(&f.fs, OsStr::from_bytes(bad), libc::EINVAL).await;
    }
    assert_eq!(
        errno_of(
            f.fs.symlink(
                InodeId::ROOT,
                name("l"),
                OsStr::from_bytes(b"/tmp\0/x"),
                me()
            )
            .await
        ),
        libc::EINVAL
    );
    let file = write_file(&f.fs, InodeId::ROOT, "f", b"").await.attr.ino;
    assert_eq!(
        errno_of(
            f.fs.setxattr(file, OsStr::from_bytes(b"user.a\0b"), b"", 0)
                .await
        ),
        libc::EINVAL
    );
    assert_eq!(f.outside_state(), before);
    let names: Vec<_> = std::fs::read_dir(&f.root).unwrap().collect();
    assert_eq!(names.len(), 1, "only f was made");
}

#[tokio::test]
async fn names_longer_than_255_bytes_are_refused() {
    let f = fixture();
    let before = f.outside_state();
    let long = "x".repeat(256);
    every_name_refused(&f.fs, name(&long), libc::ENAMETOOLONG).await;
    assert_eq!(f.outside_state(), before);
}

/// A symlink placed in the root pointing out: looked up, it is the symlink itself; nothing
/// goes through it; what acts on it acts on the link, not its target.
async fn symlink_leads_nowhere(f: &super::tests::Fixture, link: &str) {
    let before = f.outside_state();
    let entry = f.fs.lookup(InodeId::ROOT, name(link)).await.unwrap();
    let ino = entry.attr.ino;
    assert_eq!(entry.attr.kind, FileKind::Symlink);
    let caller = me();
    assert_eq!(
        errno_of(f.fs.lookup(ino, name("secret.txt")).await),
        libc::ENOTDIR
    );
    assert_eq!(
        errno_of(
            f.fs.create(ino, name("planted"), 0o644, OpenFlags(libc::O_RDWR), caller)
                .await
        ),
        libc::ENOTDIR
    );
    assert_eq!(
        errno_of(f.fs.mkdir(ino, name("planted"), 0o755, caller).await),
        libc::ENOTDIR
    );
    assert_eq!(
        errno_of(f.fs.symlink(ino, name("planted"), name("x"), caller).await),
        libc::ENOTDIR
    );
    assert_eq!(
        errno_of(f.fs.unlink(ino, name("secret.txt")).await),
        libc::ENOTDIR
    );
    assert_eq!(errno_of(f.fs.opendir(ino).await), libc::ENOTDIR);
    for flags in [libc::O_RDONLY, libc::O_RDWR, libc::O_WRONLY | libc::O_TRUNC] {
        assert_eq!(
            errno_of(f.fs.open(ino, OpenFlags(flags)).await),
            libc::ELOOP
        );
    }
    let truncate = SetAttr {
        size: Some(0),
        ..Default::default()
    };
    assert_eq!(
        errno_of(f.fs.setattr(ino, truncate, caller).await),
        libc::EINVAL
    );
    let chmod = SetAttr {
        perm: Some(0o777),
        ..Default::default()
    };
    assert_eq!(
        errno_of(f.fs.setattr(ino, chmod, caller).await),
        libc::EOPNOTSUPP
    );
    // Times and owner change on the link itself.
    let change = SetAttr {
        uid: Some(0),
        mtime: Some(TimeOrNow::At(UNIX_EPOCH)),
        atime: Some(TimeOrNow::At(UNIX_EPOCH)),
        ..Default::default()
    };
    f.fs.setattr(ino, change, caller).await.unwrap();
    assert_eq!(
        std::fs::symlink_metadata(f.root.join(link))
            .unwrap()
            .mtime(),
        0
    );
    assert_eq!(
        errno_of(f.fs.setxattr(ino, name("user.x"), b"1", 0).await),
        libc::EPERM
    );
    // A hard link of it is another symlink, inside.
    let linked = f.fs.link(ino, InodeId::ROOT, name("copy")).await.unwrap();
    assert_eq!(linked.attr.kind, FileKind::Symlink);
    // readlink: the bytes, nothing resolved.
    let target = f.fs.readlink(ino).await.unwrap();
    assert_eq!(
        target,
        std::fs::read_link(f.root.join(link))
            .unwrap()
            .as_os_str()
            .as_bytes()
    );
    // Renamed and removed: the link goes, its target stays.
    f.fs.rename(
        InodeId::ROOT,
        name(link),
        InodeId::ROOT,
        name("renamed"),
        RenameFlags::default(),
    )
    .await
    .unwrap();
    f.fs.unlink(InodeId::ROOT, name("renamed")).await.unwrap();
    f.fs.unlink(InodeId::ROOT, name("copy")).await.unwrap();
    assert_eq!(f.outside_state(), before);
}

#[tokio::test]
async fn an_absolute_symlink_out_is_never_followed() {
    let f = fixture();
    std::os::unix::fs::symlink(&f.outside, f.root.join("abs")).unwrap();
    symlink_leads_nowhere(&f, "abs").await;
    std::os::unix::fs::symlink(f.outside.join("secret.txt"), f.root.join("abs_file")).unwrap();
    symlink_leads_nowhere(&f, "abs_file").await;
}

#[tokio::test]
async fn a_relative_symlink_out_is_never_followed() {
    let f = fixture();
    std::os::unix::fs::symlink("../outside", f.root.join("rel")).unwrap();
    symlink_leads_nowhere(&f, "rel").await;
    std::fs::create_dir(f.root.join("deep")).unwrap();
    std::os::unix::fs::symlink("../../outside/secret.txt", f.root.join("deep/rel")).unwrap();
    let deep = f.fs.lookup(InodeId::ROOT, name("deep")).await.unwrap();
    let link = f.fs.lookup(deep.attr.ino, name("rel")).await.unwrap();
    assert_eq!(
        errno_of(f.fs.open(link.attr.ino, OpenFlags(libc::O_RDWR)).await),
        libc::ELOOP
    );
}

#[tokio::test]
async fn a_guest_made_symlink_out_is_only_bytes() {
    let f = fixture();
    let before = f.outside_state();
    let target = f.outside.join("secret.txt");
    let link =
        f.fs.symlink(InodeId::ROOT, name("esc"), target.as_os_str(), me())
            .await
            .unwrap();
    assert_eq!(
        f.fs.readlink(link.attr.ino).await.unwrap(),
        target.as_os_str().as_bytes()
    );
    assert_eq!(
        errno_of(
            f.fs.open(link.attr.ino, OpenFlags(libc::O_WRONLY | libc::O_TRUNC))
                .await
        ),
        libc::ELOOP
    );
    // Creating "through" it by name replaces nothing: the name exists (as the link).
    assert_eq!(
        errno_of(
            f.fs.create(
                InodeId::ROOT,
                name("esc"),
                0o644,
                OpenFlags(libc::O_RDWR | libc::O_CREAT),
                me()
            )
            .await
        ),
        libc::ELOOP
    );
    std::os::unix::fs::symlink("../outside/dir", f.root.join("dirlink")).unwrap();
    assert_eq!(
        errno_of(
            f.fs.mkdir(InodeId::ROOT, name("dirlink"), 0o755, me())
                .await
        ),
        libc::EEXIST
    );
    assert_eq!(f.outside_state(), before);
}

#[tokio::test]
async fn a_directory_swapped_for_a_symlink_after_lookup_keeps_its_inode() {
    let f = fixture();
    let before = f.outside_state();
    std::fs::create_dir(f.root.join("work")).unwrap();
    std::fs::write(f.root.join("work/file"), b"inside").unwrap();
    let work = f.fs.lookup(InodeId::ROOT, name("work")).await.unwrap();
    let ino = work.attr.ino;
    // Between lookup and use: the directory is moved away and a symlink out put in its place.
    std::fs::rename(f.root.join("work"), f.root.join("moved")).unwrap();
    std::os::unix::fs::symlink(&f.outside, f.root.join("work")).unwrap();
    let caller = me();
    let (file, handle) =
        f.fs.create(ino, name("planted"), 0o644, OpenFlags(libc::O_RDWR), caller)
            .await
            .unwrap();
    f.fs.write(file.attr.ino, handle, 0, b"here").await.unwrap();
    f.fs.release(file.attr.ino, handle).await.unwrap();
    f.fs.mkdir(ino, name("planted_dir"), 0o755, caller)
        .await
        .unwrap();
    f.fs.symlink(ino, name("planted_link"), name("x"), caller)
        .await
        .unwrap();
    f.fs.mknod(ino, name("planted_fifo"), libc::S_IFIFO | 0o644, 0, caller)
        .await
        .unwrap();
    f.fs.setxattr(ino, name("user.planted"), b"1", 0)
        .await
        .unwrap();
    f.fs.setattr(
        ino,
        SetAttr {
            perm: Some(0o700),
            ..Default::default()
        },
        caller,
    )
    .await
    .unwrap();
    // The old inode sees the moved directory's contents, not the outside's.
    assert_eq!(
        errno_of(f.fs.lookup(ino, name("secret.txt")).await),
        libc::ENOENT
    );
    let names: Vec<_> = list(&f.fs, ino).await.into_iter().map(|e| e.name).collect();
    assert!(names.iter().any(|n| n == "file"));
    assert!(!names.iter().any(|n| n == "secret.txt"));
    assert_eq!(
        std::fs::read(f.root.join("moved/planted")).unwrap(),
        b"here"
    );
    assert!(f.root.join("moved/planted_dir").is_dir());
    f.fs.unlink(ino, name("file")).await.unwrap();
    // The new name is the symlink, which leads nowhere.
    let now = f.fs.lookup(InodeId::ROOT, name("work")).await.unwrap();
    assert_eq!(now.attr.kind, FileKind::Symlink);
    assert_ne!(now.attr.ino, ino);
    assert_eq!(f.outside_state(), before);
}

#[tokio::test]
async fn a_file_swapped_for_a_symlink_after_lookup_keeps_its_inode() {
    let f = fixture();
    let before = f.outside_state();
    std::fs::write(f.root.join("f"), b"inside").unwrap();
    let file = f.fs.lookup(InodeId::ROOT, name("f")).await.unwrap();
    let ino = file.attr.ino;
    std::fs::rename(f.root.join("f"), f.root.join("moved")).unwrap();
    std::os::unix::fs::symlink(f.outside.join("secret.txt"), f.root.join("f")).unwrap();
    let handle =
        f.fs.open(ino, OpenFlags(libc::O_RDWR | libc::O_TRUNC))
            .await
            .unwrap();
    f.fs.write(ino, handle, 0, b"written").await.unwrap();
    f.fs.release(ino, handle).await.unwrap();
    let change = SetAttr {
        size: Some(3),
        perm: Some(0o777),
        uid: Some(0),
        mtime: Some(TimeOrNow::At(UNIX_EPOCH)),
        ..Default::default()
    };
    f.fs.setattr(ino, change, me()).await.unwrap();
    f.fs.setxattr(ino, name("user.x"), b"1", 0).await.unwrap();
    f.fs.link(ino, InodeId::ROOT, name("linked")).await.unwrap();
    assert_eq!(std::fs::read(f.root.join("moved")).unwrap(), b"wri");
    assert_eq!(std::fs::read(f.root.join("linked")).unwrap(), b"wri");
    assert_eq!(f.outside_state(), before);
}

#[tokio::test]
async fn a_hard_link_the_host_placed_to_an_outside_file_is_that_file() {
    // Documented behaviour: the host put a name of the outside file inside the root, so the
    // file is inside. The guest reaches its contents, and only through names inside: it can
    // remove the inside name (the outside one stays) and give it more names inside only.
    let f = fixture();
    // Link counts change a file's ctime: compared without it.
    let without_ctime = |(files, beside): (std::collections::BTreeMap<_, String>, _)| {
        let files: Vec<_> = files
            .into_iter()
            .map(|(path, state)| {
                let ctime = state.find(" ctime=").unwrap();
                let nlink = state.find(" nlink=").unwrap();
                (path, format!("{}{}", &state[..ctime], &state[nlink..]))
            })
            .collect();
        (files, beside)
    };
    let before = without_ctime(f.outside_state());
    std::fs::hard_link(f.outside.join("secret.txt"), f.root.join("hl")).unwrap();
    let entry = f.fs.lookup(InodeId::ROOT, name("hl")).await.unwrap();
    assert_eq!(entry.attr.nlink, 2);
    assert_eq!(read_all(&f.fs, entry.attr.ino).await, b"secret");
    let linked =
        f.fs.link(entry.attr.ino, InodeId::ROOT, name("hl2"))
            .await
            .unwrap();
    assert_eq!(linked.attr.nlink, 3);
    f.fs.unlink(InodeId::ROOT, name("hl2")).await.unwrap();
    f.fs.unlink(InodeId::ROOT, name("hl")).await.unwrap();
    // The outside name and contents are as they were (the link count is back too).
    assert_eq!(without_ctime(f.outside_state()), before);
    assert_eq!(
        std::fs::read(f.outside.join("secret.txt")).unwrap(),
        b"secret"
    );
}

#[tokio::test]
async fn forged_inode_numbers_reach_nothing() {
    let f = fixture();
    let before = f.outside_state();
    std::fs::write(f.root.join("inside"), b"").unwrap();
    // The host inode numbers of outside files (inode numbers here are host numbers: a guest
    // may guess them) and of an inside file never looked up.
    let outside_file = std::fs::metadata(f.outside.join("secret.txt"))
        .unwrap()
        .ino();
    let outside_dir = std::fs::metadata(&f.outside).unwrap().ino();
    let base = std::fs::metadata(f.base.path()).unwrap().ino();
    let unseen = std::fs::metadata(f.root.join("inside")).unwrap().ino();
    let caller = me();
    for forged in [
        outside_file,
        outside_dir,
        base,
        unseen,
        0,
        2,
        FOREIGN_BASE,
        u64::MAX,
    ] {
        let ino = InodeId(forged);
        assert_eq!(errno_of(f.fs.getattr(ino).await), libc::ESTALE);
        assert_eq!(
            errno_of(f.fs.lookup(ino, name("secret.txt")).await),
            libc::ESTALE
        );
        assert_eq!(
            errno_of(f.fs.open(ino, OpenFlags(libc::O_RDWR)).await),
            libc::ESTALE
        );
        assert_eq!(errno_of(f.fs.opendir(ino).await), libc::ESTALE);
        assert_eq!(
            errno_of(
                f.fs.setattr(
                    ino,
                    SetAttr {
                        size: Some(0),
                        ..Default::default()
                    },
                    caller
                )
                .await
            ),
            libc::ESTALE
        );
        assert_eq!(
            errno_of(f.fs.link(ino, InodeId::ROOT, name("stolen")).await),
            libc::ESTALE
        );
        assert_eq!(
            errno_of(
                f.fs.create(ino, name("x"), 0o644, OpenFlags(libc::O_RDWR), caller)
                    .await
            ),
            libc::ESTALE
        );
        assert_eq!(
            errno_of(
                f.fs.rename(
                    InodeId::ROOT,
                    name("inside"),
                    ino,
                    name("x"),
                    RenameFlags::default()
                )
                .await
            ),
            libc::ESTALE
        );
        assert_eq!(errno_of(f.fs.readlink(ino).await), libc::ESTALE);
        assert_eq!(
            errno_of(f.fs.getxattr(ino, name("user.x")).await),
            libc::ESTALE
        );
    }
    assert!(!f.root.join("stolen").exists());
    assert_eq!(f.outside_state(), before);
}

#[tokio::test]
async fn forged_handles_reach_nothing() {
    let f = fixture();
    let before = f.outside_state();
    let file = write_file(&f.fs, InodeId::ROOT, "f", b"data")
        .await
        .attr
        .ino;
    // Raw descriptor numbers of this process, and anything else.
    for forged in [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 64, 1 << 20, u64::MAX] {
        let handle = FileHandle(forged);
        assert_eq!(errno_of(f.fs.read(file, handle, 0, 10).await), libc::EBADF);
        assert_eq!(
            errno_of(f.fs.write(file, handle, 0, b"x").await),
            libc::EBADF
        );
        assert_eq!(errno_of(f.fs.release(file, handle).await), libc::EBADF);
        assert_eq!(
            errno_of(f.fs.readdir(InodeId::ROOT, handle, 0).await),
            libc::EBADF
        );
        assert_eq!(
            errno_of(f.fs.releasedir(InodeId::ROOT, handle).await),
            libc::EBADF
        );
    }
    assert_eq!(read_all(&f.fs, file).await, b"data");
    assert_eq!(f.outside_state(), before);
}

#[tokio::test]
async fn device_nodes_are_never_made_nor_opened() {
    let f = fixture();
    let before = f.outside_state();
    let caller = me();
    for kind in [libc::S_IFCHR, libc::S_IFBLK] {
        // /dev/null, /dev/sda, /dev/mem's numbers.
        for rdev in [
            libc::makedev(1, 3),
            libc::makedev(8, 0),
            libc::makedev(1, 1),
        ] {
            assert_eq!(
                errno_of(
                    f.fs.mknod(
                        InodeId::ROOT,
                        name("dev"),
                        kind | 0o666,
                        rdev as u32,
                        caller
                    )
                    .await
                ),
                libc::EPERM
            );
        }
    }
    assert!(std::fs::read_dir(&f.root).unwrap().next().is_none());
    if is_root() {
        // One the host made (as root can): looked up, never opened.
        let path = std::ffi::CString::new(f.root.join("null").into_os_string().into_vec()).unwrap();
        // SAFETY: NUL-terminated path.
        let made =
            unsafe { libc::mknod(path.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
        assert_eq!(made, 0, "{}", std::io::Error::last_os_error());
        let entry = f.fs.lookup(InodeId::ROOT, name("null")).await.unwrap();
        assert_eq!(entry.attr.kind, FileKind::CharDevice);
        for flags in [libc::O_RDONLY, libc::O_WRONLY, libc::O_RDWR] {
            assert_eq!(
                errno_of(f.fs.open(entry.attr.ino, OpenFlags(flags)).await),
                libc::EACCES
            );
        }
        let truncate = SetAttr {
            size: Some(0),
            ..Default::default()
        };
        assert_eq!(
            errno_of(f.fs.setattr(entry.attr.ino, truncate, caller).await),
            libc::EINVAL
        );
        assert_eq!(
            errno_of(f.fs.getxattr(entry.attr.ino, name("user.x")).await),
            libc::ENODATA
        );
        // fsync opens nothing that is not a file or a directory.
        f.fs.fsync(entry.attr.ino, FileHandle(0), false)
            .await
            .unwrap();
    }
    assert_eq!(f.outside_state(), before);
}

#[tokio::test]
async fn magic_links_placed_in_the_root_are_plain_symlinks() {
    let f = fixture();
    let before = f.outside_state();
    let mut links = vec![
        "/proc/self/root".to_string(),
        "/proc/self/cwd".to_string(),
        "/proc/thread-self/root".to_string(),
        "/proc/1/root".to_string(),
    ];
    // Every descriptor number this process could hold for the root or the procfs directory.
    links.extend((0..32).map(|fd| format!("/proc/self/fd/{fd}")));
    for (index, target) in links.iter().enumerate() {
        let link = format!("magic{index}");
        std::os::unix::fs::symlink(target, f.root.join(&link)).unwrap();
        let entry = f.fs.lookup(InodeId::ROOT, name(&link)).await.unwrap();
        assert_eq!(entry.attr.kind, FileKind::Symlink, "{target}");
        for inner in ["etc", "tmp", "outside", "secret.txt"] {
            assert_eq!(
                errno_of(f.fs.lookup(entry.attr.ino, name(inner)).await),
                libc::ENOTDIR,
                "{target}/{inner}"
            );
        }
        assert_eq!(
            errno_of(f.fs.open(entry.attr.ino, OpenFlags(libc::O_RDWR)).await),
            libc::ELOOP
        );
        assert_eq!(errno_of(f.fs.opendir(entry.attr.ino).await), libc::ENOTDIR);
        assert_eq!(
            errno_of(
                f.fs.create(
                    entry.attr.ino,
                    name("x"),
                    0o644,
                    OpenFlags(libc::O_RDWR),
                    me()
                )
                .await
            ),
            libc::ENOTDIR
        );
        assert_eq!(
            f.fs.readlink(entry.attr.ino).await.unwrap(),
            target.as_bytes()
        );
    }
    // Names that look like descriptor numbers are names in the root, nothing more.
    for fd in 0..16 {
        write_file(&f.fs, InodeId::ROOT, &fd.to_string(), b"just a file").await;
    }
    assert_eq!(f.outside_state(), before);
}

#[tokio::test]
async fn setuid_and_setgid_bits_never_reach_the_host() {
    let f = fixture();
    let before = f.outside_state();
    let caller = me();
    let mode_of = |path: &str| std::fs::symlink_metadata(f.root.join(path)).unwrap().mode();
    let (file, handle) =
        f.fs.create(
            InodeId::ROOT,
            name("suid"),
            0o6755,
            OpenFlags(libc::O_RDWR),
            caller,
        )
        .await
        .unwrap();
    f.fs.release(file.attr.ino, handle).await.unwrap();
    // The guest sees what it asked; the host has none of it.
    assert_eq!(file.attr.perm, 0o6755);
    assert_eq!(mode_of("suid") & 0o7777, 0o755);
    let plain = write_file(&f.fs, InodeId::ROOT, "plain", b"#!/bin/sh\n").await;
    let chmod = SetAttr {
        perm: Some(0o4755),
        ..Default::default()
    };
    let attr = f.fs.setattr(plain.attr.ino, chmod, caller).await.unwrap();
    assert_eq!(attr.perm, 0o4755);
    assert_eq!(mode_of("plain") & 0o6000, 0);
    let dir =
        f.fs.mkdir(InodeId::ROOT, name("d"), 0o2755, caller)
            .await
            .unwrap();
    assert_eq!(dir.attr.perm, 0o2755);
    assert_eq!(mode_of("d") & 0o6000, 0);
    f.fs.mknod(InodeId::ROOT, name("n"), libc::S_IFREG | 0o4755, 0, caller)
        .await
        .unwrap();
    assert_eq!(mode_of("n") & 0o6000, 0);
    f.fs.mknod(InodeId::ROOT, name("p"), libc::S_IFIFO | 0o2644, 0, caller)
        .await
        .unwrap();
    assert_eq!(mode_of("p") & 0o6000, 0);
    // Every inode the guest made: no setuid/setgid on the host.
    for entry in std::fs::read_dir(&f.root).unwrap() {
        let meta = std::fs::symlink_metadata(entry.unwrap().path()).unwrap();
        assert_eq!(meta.mode() & 0o6000, 0);
    }
    assert_eq!(f.outside_state(), before);
}

#[tokio::test]
async fn writing_a_host_setuid_file_clears_its_bits_first() {
    let f = fixture();
    let before = f.outside_state();
    std::fs::write(f.root.join("tool"), b"binary").unwrap();
    std::fs::set_permissions(f.root.join("tool"), std::fs::Permissions::from_mode(0o6755)).unwrap();
    let entry = f.fs.lookup(InodeId::ROOT, name("tool")).await.unwrap();
    assert_eq!(entry.attr.perm, 0o6755);
    // Reading leaves it be.
    assert_eq!(read_all(&f.fs, entry.attr.ino).await, b"binary");
    assert_eq!(
        std::fs::metadata(f.root.join("tool")).unwrap().mode() & 0o7777,
        0o6755
    );
    let handle =
        f.fs.open(entry.attr.ino, OpenFlags(libc::O_WRONLY))
            .await
            .unwrap();
    assert_eq!(
        std::fs::metadata(f.root.join("tool")).unwrap().mode() & 0o7777,
        0o755
    );
    f.fs.write(entry.attr.ino, handle, 0, b"trojan")
        .await
        .unwrap();
    f.fs.release(entry.attr.ino, handle).await.unwrap();
    // Truncating without a handle: the same.
    std::fs::set_permissions(f.root.join("tool"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    let truncate = SetAttr {
        size: Some(0),
        ..Default::default()
    };
    f.fs.setattr(entry.attr.ino, truncate, me()).await.unwrap();
    assert_eq!(
        std::fs::metadata(f.root.join("tool")).unwrap().mode() & 0o7777,
        0o755
    );
    assert_eq!(f.outside_state(), before);
}

#[tokio::test]
async fn read_only_refuses_every_change() {
    let f = fixture_with(true, Limits::default());
    std::fs::write(f.root.join("f"), b"data").unwrap();
    std::fs::create_dir(f.root.join("d")).unwrap();
    std::os::unix::fs::symlink("f", f.root.join("l")).unwrap();
    let before_root = super::tests::snapshot(&f.root);
    let before = f.outside_state();
    let fs = &f.fs;
    let caller = me();
    let file = fs.lookup(InodeId::ROOT, name("f")).await.unwrap().attr.ino;
    let dir = fs.lookup(InodeId::ROOT, name("d")).await.unwrap().attr.ino;
    let rofs = libc::EROFS;
    let none = RenameFlags::default();
    assert_eq!(
        errno_of(
            fs.setattr(
                file,
                SetAttr {
                    size: Some(0),
                    ..Default::default()
                },
                caller
            )
            .await
        ),
        rofs
    );
    assert_eq!(
        errno_of(
            fs.setattr(
                file,
                SetAttr {
                    perm: Some(0o777),
                    ..Default::default()
                },
                caller
            )
            .await
        ),
        rofs
    );
    assert_eq!(
        errno_of(
            fs.setattr(
                file,
                SetAttr {
                    uid: Some(1),
                    ..Default::default()
                },
                caller
            )
            .await
        ),
        rofs
    );
    assert_eq!(
        errno_of(
            fs.setattr(
                file,
                SetAttr {
                    mtime: Some(TimeOrNow::Now),
                    ..Default::default()
                },
                caller
            )
            .await
        ),
        rofs
    );
    assert_eq!(
        errno_of(
            fs.mknod(InodeId::ROOT, name("p"), libc::S_IFIFO | 0o644, 0, caller)
                .await
        ),
        rofs
    );
    assert_eq!(
        errno_of(fs.mkdir(InodeId::ROOT, name("n"), 0o755, caller).await),
        rofs
    );
    assert_eq!(errno_of(fs.unlink(InodeId::ROOT, name("f")).await), rofs);
    assert_eq!(errno_of(fs.rmdir(InodeId::ROOT, name("d")).await), rofs);
    assert_eq!(
        errno_of(
            fs.symlink(InodeId::ROOT, name("s"), name("f"), caller)
                .await
        ),
        rofs
    );
    assert_eq!(
        errno_of(
            fs.rename(InodeId::ROOT, name("f"), dir, name("g"), none)
                .await
        ),
        rofs
    );
    assert_eq!(errno_of(fs.link(file, dir, name("g")).await), rofs);
    assert_eq!(
        errno_of(
            fs.create(
                InodeId::ROOT,
                name("c"),
                0o644,
                OpenFlags(libc::O_RDWR),
                caller
            )
            .await
        ),
        rofs
    );
    for flags in [libc::O_WRONLY, libc::O_RDWR, libc::O_RDONLY | libc::O_TRUNC] {
        assert_eq!(errno_of(fs.open(file, OpenFlags(flags)).await), rofs);
    }
    assert_eq!(
        errno_of(fs.setxattr(file, name("user.x"), b"1", 0).await),
        rofs
    );
    assert_eq!(errno_of(fs.removexattr(file, name("user.x")).await), rofs);
    // Reading works, and a read handle cannot write.
    let handle = fs.open(file, OpenFlags(libc::O_RDONLY)).await.unwrap();
    assert_eq!(fs.read(file, handle, 0, 10).await.unwrap(), b"data");
    assert_eq!(errno_of(fs.write(file, handle, 0, b"x").await), rofs);
    fs.fsync(file, handle, false).await.unwrap();
    fs.release(file, handle).await.unwrap();
    assert_eq!(list(fs, InodeId::ROOT).await.len(), 5);
    assert_eq!(super::tests::snapshot(&f.root), before_root);
    assert_eq!(f.outside_state(), before);
}

#[tokio::test]
async fn private_and_privileged_xattrs_are_out_of_reach() {
    let f = fixture();
    let before = f.outside_state();
    let file = write_file(&f.fs, InodeId::ROOT, "f", b"").await.attr.ino;
    let chown = SetAttr {
        uid: Some(4242),
        ..Default::default()
    };
    f.fs.setattr(file, chown, me()).await.unwrap();
    let private = name("user.krunbox.stat");
    // The guest can neither read, forge nor remove the ownership record.
    assert_eq!(errno_of(f.fs.getxattr(file, private).await), libc::ENODATA);
    assert_eq!(
        errno_of(f.fs.setxattr(file, private, b"1 0 0 4755 0 0 755", 0).await),
        libc::EPERM
    );
    assert_eq!(
        errno_of(
            f.fs.setxattr(file, name("user.krunbox.other"), b"", 0)
                .await
        ),
        libc::EPERM
    );
    assert_eq!(errno_of(f.fs.removexattr(file, private).await), libc::EPERM);
    assert!(f.fs.listxattr(file).await.unwrap().is_empty());
    assert_eq!(f.fs.getattr(file).await.unwrap().uid, 4242);
    // Attributes that would change host permissions or capabilities are not offered.
    for privileged in [
        "security.capability",
        "security.selinux",
        "trusted.overlay.opaque",
        "system.posix_acl_access",
        "system.posix_acl_default",
    ] {
        assert_eq!(
            errno_of(
                f.fs.setxattr(file, name(privileged), b"\x01\0\0\x02", 0)
                    .await
            ),
            libc::EOPNOTSUPP,
            "{privileged}"
        );
        assert_eq!(
            errno_of(f.fs.getxattr(file, name(privileged)).await),
            libc::EOPNOTSUPP
        );
    }
    assert_eq!(f.outside_state(), before);
}

#[tokio::test]
async fn renames_stay_inside() {
    let f = fixture();
    let before = f.outside_state();
    std::os::unix::fs::symlink(&f.outside, f.root.join("out")).unwrap();
    write_file(&f.fs, InodeId::ROOT, "f", b"data").await;
    let out = f.fs.lookup(InodeId::ROOT, name("out")).await.unwrap();
    let none = RenameFlags::default();
    // Into the symlink as if it were a directory: it is not one.
    assert_eq!(
        errno_of(
            f.fs.rename(InodeId::ROOT, name("f"), out.attr.ino, name("f"), none)
                .await
        ),
        libc::ENOTDIR
    );
    // Over the symlink: replaces the link, not what it points to.
    f.fs.rename(InodeId::ROOT, name("f"), InodeId::ROOT, name("out"), none)
        .await
        .unwrap();
    assert_eq!(std::fs::read(f.root.join("out")).unwrap(), b"data");
    assert!(std::fs::symlink_metadata(f.root.join("out"))
        .unwrap()
        .is_file());
    assert_eq!(f.outside_state(), before);
}

#[test]
fn mount_points_inside_are_not_crossed() {
    // Needs a mount namespace of its own (root): a tmpfs mounted inside the served directory
    // is refused with EXDEV rather than served.
    if !is_root() {
        return;
    }
    let f = fixture();
    let before = f.outside_state();
    std::fs::create_dir(f.root.join("mnt")).unwrap();
    let root = f.root.clone();
    let outcome = std::thread::spawn(move || {
        // SAFETY: this thread only gets a mount namespace of its own.
        if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
            return None;
        }
        let none = c"none";
        let slash = c"/";
        // SAFETY: NUL-terminated strings.
        let private = unsafe {
            libc::mount(
                none.as_ptr(),
                slash.as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            )
        };
        let target = std::ffi::CString::new(root.join("mnt").into_os_string().into_vec()).unwrap();
        // SAFETY: as above.
        let mounted = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        if private != 0 || mounted != 0 {
            return None;
        }
        // Called directly: this thread's namespace has the mount, the blocking pool's not.
        let fs = HostDir::new(&root).unwrap();
        let inner = &fs.inner;
        let result = inner.lookup(&inner.root, c"mnt").map(|_| ());
        drop(fs);
        // SAFETY: as above.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        Some(result)
    })
    .join()
    .unwrap();
    match outcome {
        Some(result) => assert_eq!(result.unwrap_err().errno(), libc::EXDEV),
        None => eprintln!("skipped: no mount namespace of our own here"),
    }
    assert_eq!(f.outside_state(), before);
}
