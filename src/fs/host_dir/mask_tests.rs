//! Masks, driven as a guest's kernel drives a `HostDir`: what is hidden, what the storage
//! serves, and that the source's masked entries are never touched.

use std::path::Path;

use super::tests::{errno_of, list, me, name, read_all, snapshot, write_file};
use super::*;

/// A source tree like a project's: entries at the masked paths the guest must never see.
fn project(source: &Path) {
    for dir in ["node_modules", ".cache", "packages/a/node_modules", ".kc"] {
        std::fs::create_dir_all(source.join(dir)).unwrap();
    }
    std::fs::write(source.join("node_modules/lower.txt"), "lower-root\n").unwrap();
    std::fs::write(source.join(".cache/lower.txt"), "lower-cache\n").unwrap();
    std::fs::write(
        source.join("packages/a/node_modules/lower.txt"),
        "lower-package\n",
    )
    .unwrap();
    std::fs::write(source.join(".kc/machine-state"), "host-private\n").unwrap();
    std::fs::write(source.join("visible.txt"), "visible\n").unwrap();
    std::fs::write(source.join("preexisting"), "lower-preexisting\n").unwrap();
}

const MASKED: [&str; 4] = [
    "/node_modules",
    "/.cache",
    "/packages/a/node_modules",
    "/preexisting",
];

fn names(entries: &[DirEntry]) -> Vec<String> {
    let mut names: Vec<String> = entries
        .iter()
        .map(|e| e.name.to_string_lossy().into_owned())
        .filter(|n| n != "." && n != "..")
        .collect();
    names.sort();
    names
}

async fn walk(fs: &HostDir, path: &str) -> FsResult<Entry> {
    let mut at = InodeId::ROOT;
    let mut entry = None;
    for part in path.split('/').filter(|p| !p.is_empty()) {
        let found = fs.lookup(at, name(part)).await?;
        at = found.attr.ino;
        entry = Some(found);
    }
    entry.ok_or(FsError::INVALID)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_mask_hides_its_paths_from_lookups_and_listings() {
    let base = tempfile::tempdir().unwrap();
    let source = base.path().join("source");
    project(&source);
    let fs = HostDir::read_only(&source)
        .unwrap()
        .with_mask(Mask::hide(MASKED))
        .unwrap();

    let visible = walk(&fs, "visible.txt").await.unwrap();
    assert_eq!(read_all(&fs, visible.attr.ino).await, b"visible\n");
    for path in MASKED {
        assert_eq!(
            errno_of(walk(&fs, path).await),
            libc::ENOENT,
            "{path} is hidden"
        );
    }
    // The way to a nested mask is seen; the mask at its end is not.
    assert!(walk(&fs, "packages/a").await.is_ok());
    assert_eq!(
        names(&list(&fs, InodeId::ROOT).await),
        [".kc", "packages", "visible.txt"]
    );
    let a = walk(&fs, "packages/a").await.unwrap().attr.ino;
    assert!(names(&list(&fs, a).await).is_empty());
    // Making a masked path: the read-only directory says so first.
    assert_eq!(
        errno_of(
            fs.mkdir(InodeId::ROOT, name("node_modules"), 0o755, me())
                .await
        ),
        libc::EROFS
    );

    // The same masks on a writable directory without storage: absent and not to be made.
    let fs = HostDir::new(&source)
        .unwrap()
        .with_mask(Mask::hide(MASKED))
        .unwrap();
    let before = snapshot(&source);
    assert_eq!(
        errno_of(
            fs.mkdir(InodeId::ROOT, name("node_modules"), 0o755, me())
                .await
        ),
        libc::EACCES
    );
    assert_eq!(
        errno_of(
            fs.create(
                InodeId::ROOT,
                name("preexisting"),
                0o644,
                OpenFlags(libc::O_WRONLY),
                me()
            )
            .await
        ),
        libc::EACCES
    );
    assert_eq!(
        errno_of(fs.unlink(InodeId::ROOT, name("preexisting")).await),
        libc::ENOENT
    );
    assert_eq!(snapshot(&source), before, "the source is untouched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writable_mask_keeps_the_guests_entries_in_its_storage() {
    let base = tempfile::tempdir().unwrap();
    let (source, storage) = (base.path().join("source"), base.path().join("storage"));
    project(&source);
    std::fs::create_dir(&storage).unwrap();
    std::fs::write(storage.join("preexisting"), "upper-preexisting\n").unwrap();
    let fs = HostDir::new(&source)
        .unwrap()
        .with_mask(Mask::hide(MASKED).stored_in(&storage))
        .unwrap();
    let masked_in_source = || {
        [
            "node_modules",
            ".cache",
            "packages/a/node_modules",
            "preexisting",
        ]
        .map(|path| snapshot(&source.join(path)))
    };
    let source_before = masked_in_source();

    // What the storage holds shows at its masked path, listed once, after the source's.
    let root_listing = list(&fs, InodeId::ROOT).await;
    assert_eq!(
        names(&root_listing),
        [".kc", "packages", "preexisting", "visible.txt"]
    );
    let pre = walk(&fs, "preexisting").await.unwrap();
    assert_eq!(read_all(&fs, pre.attr.ino).await, b"upper-preexisting\n");
    for path in ["node_modules", ".cache", "packages/a/node_modules"] {
        assert_eq!(errno_of(walk(&fs, path).await), libc::ENOENT, "{path}");
    }

    // A file at a masked name, then gone again.
    let file = write_file(&fs, InodeId::ROOT, "node_modules", b"file-entry").await;
    assert_eq!(read_all(&fs, file.attr.ino).await, b"file-entry");
    assert_eq!(
        std::fs::read(storage.join("node_modules")).unwrap(),
        b"file-entry"
    );
    fs.unlink(InodeId::ROOT, name("node_modules"))
        .await
        .unwrap();
    assert!(!storage.join("node_modules").exists());

    // Below a masked name that is not there yet, nothing can be made.
    let cache = fs.lookup(InodeId::ROOT, name(".cache")).await;
    assert_eq!(errno_of(cache), libc::ENOENT);

    // Directories at masked paths, made with their storage parents, and files in them.
    let modules = fs
        .mkdir(InodeId::ROOT, name("node_modules"), 0o755, me())
        .await
        .unwrap();
    write_file(&fs, modules.attr.ino, "child.txt", b"child").await;
    let cache = fs
        .mkdir(InodeId::ROOT, name(".cache"), 0o755, me())
        .await
        .unwrap();
    write_file(&fs, cache.attr.ino, "value.txt", b"cached").await;
    let a = walk(&fs, "packages/a").await.unwrap().attr.ino;
    let nested = fs
        .mkdir(a, name("node_modules"), 0o755, me())
        .await
        .unwrap();
    let pkg = write_file(&fs, nested.attr.ino, "pkg.txt", b"package").await;
    // A hard link inside the storage.
    fs.link(pkg.attr.ino, nested.attr.ino, name("pkg-link.txt"))
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(storage.join("node_modules/child.txt")).unwrap(),
        b"child"
    );
    assert_eq!(
        std::fs::read(storage.join(".cache/value.txt")).unwrap(),
        b"cached"
    );
    assert_eq!(
        std::fs::read(storage.join("packages/a/node_modules/pkg-link.txt")).unwrap(),
        b"package"
    );
    assert_eq!(
        names(&list(&fs, InodeId::ROOT).await),
        [
            ".cache",
            ".kc",
            "node_modules",
            "packages",
            "preexisting",
            "visible.txt"
        ]
    );
    assert_eq!(
        names(&list(&fs, nested.attr.ino).await),
        ["pkg-link.txt", "pkg.txt"]
    );

    // A directory on the way to masks stays put; a file moves into a masked directory.
    assert_eq!(
        errno_of(
            fs.rename(
                InodeId::ROOT,
                name("packages"),
                InodeId::ROOT,
                name("moved"),
                RenameFlags::default()
            )
            .await
        ),
        libc::EBUSY
    );
    write_file(&fs, InodeId::ROOT, "new.txt", b"new").await;
    fs.rename(
        InodeId::ROOT,
        name("new.txt"),
        modules.attr.ino,
        name("new.txt"),
        RenameFlags::default(),
    )
    .await
    .unwrap();
    assert_eq!(
        std::fs::read(storage.join("node_modules/new.txt")).unwrap(),
        b"new"
    );

    // The source's masked entries were never changed.
    assert_eq!(masked_in_source(), source_before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mask_may_keep_its_storage_under_a_masked_path_of_the_source() {
    let base = tempfile::tempdir().unwrap();
    let source = base.path().join("source");
    project(&source);
    let storage = source.join(".kc/mounts/workspace");
    std::fs::create_dir_all(&storage).unwrap();

    let mask = || Mask::hide(["/.kc", "/node_modules"]).stored_in(&storage);
    let fs = HostDir::new(&source).unwrap().with_mask(mask()).unwrap();
    assert_eq!(errno_of(walk(&fs, ".kc").await), libc::ENOENT);
    let modules = fs
        .mkdir(InodeId::ROOT, name("node_modules"), 0o755, me())
        .await
        .unwrap();
    write_file(&fs, modules.attr.ino, "native.txt", b"guest-native").await;
    assert_eq!(errno_of(walk(&fs, ".kc").await), libc::ENOENT);
    assert_eq!(
        std::fs::read(source.join(".kc/machine-state")).unwrap(),
        b"host-private\n"
    );
    assert_eq!(
        std::fs::read(source.join("node_modules/lower.txt")).unwrap(),
        b"lower-root\n"
    );

    // Served again: the guest's entry is there, the host's still hidden.
    let again = HostDir::new(&source).unwrap().with_mask(mask()).unwrap();
    let native = walk(&again, "node_modules/native.txt").await.unwrap();
    assert_eq!(read_all(&again, native.attr.ino).await, b"guest-native");
    assert_eq!(
        errno_of(walk(&again, "node_modules/lower.txt").await),
        libc::ENOENT
    );
}

#[test]
fn masks_the_guest_could_see_around_are_refused() {
    let base = tempfile::tempdir().unwrap();
    let source = base.path().join("source");
    project(&source);
    let fs = HostDir::new(&source).unwrap();
    let refused = |mask: Mask| match fs.with_mask(mask) {
        Err(crate::Error::InvalidConfig(why)) => why,
        other => panic!("expected InvalidConfig, got {other:?}"),
    };
    assert!(refused(Mask::hide(["../outside"])).contains("plain path"));
    assert!(refused(Mask::hide(["a/../b"])).contains("plain path"));
    assert!(refused(Mask::hide(["/"])).contains("not the directory itself"));
    // Storage the guest would reach through the source as well.
    assert!(
        refused(Mask::hide(["node_modules"]).stored_in(source.join(".kc")))
            .contains("under no masked path")
    );
    assert!(refused(Mask::hide(["node_modules"]).stored_in(base.path())).contains("holds"));
    assert!(
        refused(Mask::hide(["node_modules"]).stored_in(base.path().join("missing")))
            .contains("missing")
    );
    // Paths under another masked one, and the storage under a masked path, are fine.
    fs.with_mask(Mask::hide([".kc", ".kc/x/y"]).stored_in(source.join(".kc")))
        .unwrap();
}
