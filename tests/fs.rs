//! Workspaces: host-implemented filesystems mounted in a real microVM (FUSE over a virtio-fs
//! device of the helper's, forwarded to the library). Every test boots its own VM.

mod common;
#[allow(dead_code)] // the network tests' sandboxes are not used here
#[path = "common/guest.rs"]
mod guest;

use std::ffi::OsStr;
use std::time::{Duration, SystemTime};

use krunbox::fs::*;
use krunbox::{BuiltinImage, Error, FsErrorKind, Instance, Rootfs, Sandbox};

use guest::sh;

/// A filesystem of one read-only file that implements nothing else: what the guest sees of
/// the operations an implementation lacks.
struct OneFile;

const FILE: InodeId = InodeId(2);
const TEXT: &[u8] = b"served by the host\n";

fn one_file_attr(ino: InodeId) -> Attr {
    let (kind, perm, size) = if ino == InodeId::ROOT {
        (FileKind::Directory, 0o755, 0)
    } else {
        (FileKind::File, 0o644, TEXT.len() as u64)
    };
    let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    Attr {
        ino,
        kind,
        perm,
        nlink: 1,
        uid: 0,
        gid: 0,
        size,
        blocks: 1,
        atime: t,
        mtime: t,
        ctime: t,
        rdev: 0,
    }
}

#[async_trait]
impl VirtualFs for OneFile {
    async fn lookup(&self, parent: InodeId, name: &OsStr) -> FsResult<Entry> {
        if parent == InodeId::ROOT && name == "hello.txt" {
            Ok(Entry {
                attr: one_file_attr(FILE),
                generation: 0,
            })
        } else {
            Err(FsError::NOT_FOUND)
        }
    }
    async fn getattr(&self, ino: InodeId) -> FsResult<Attr> {
        match ino {
            InodeId::ROOT | FILE => Ok(one_file_attr(ino)),
            _ => Err(FsError::NOT_FOUND),
        }
    }
    async fn readdir(&self, _: InodeId, _: FileHandle, offset: u64) -> FsResult<Vec<DirEntry>> {
        let all = [DirEntry {
            ino: FILE,
            offset: 1,
            kind: FileKind::File,
            name: "hello.txt".into(),
        }];
        Ok(all.into_iter().skip(offset as usize).collect())
    }
    async fn open(&self, _: InodeId, _: OpenFlags) -> FsResult<FileHandle> {
        Ok(FileHandle(7))
    }
    async fn read(&self, _: InodeId, _: FileHandle, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        let start = (offset as usize).min(TEXT.len());
        let end = (start + size as usize).min(TEXT.len());
        Ok(TEXT[start..end].to_vec())
    }
}

/// [`OneFile`], but the caller's code panics looking up `boom`.
struct Foreign;

#[async_trait]
impl VirtualFs for Foreign {
    async fn lookup(&self, parent: InodeId, name: &OsStr) -> FsResult<Entry> {
        if name == "boom" {
            panic!("the implementation's own bug");
        }
        OneFile.lookup(parent, name).await
    }
    async fn getattr(&self, ino: InodeId) -> FsResult<Attr> {
        OneFile.getattr(ino).await
    }
    async fn readdir(&self, ino: InodeId, fh: FileHandle, offset: u64) -> FsResult<Vec<DirEntry>> {
        OneFile.readdir(ino, fh, offset).await
    }
    async fn open(&self, ino: InodeId, flags: OpenFlags) -> FsResult<FileHandle> {
        OneFile.open(ino, flags).await
    }
    async fn read(
        &self,
        ino: InodeId,
        fh: FileHandle,
        offset: u64,
        size: u32,
    ) -> FsResult<Vec<u8>> {
        OneFile.read(ino, fh, offset, size).await
    }
}

/// Issue 33: a panic in the caller's `VirtualFs` left the guest's call unanswered for ever (its
/// process unkillable). Now it fails that call with EIO and the mount goes on serving.
#[test]
fn a_panicking_filesystem_call_fails_only_that_call() {
    common::run(async {
        let vm = boot(busybox().mount("/tmp/served", Foreign)).await;
        let (out, took) = sh(
            &vm,
            "ls /tmp/served/boom 2>&1; echo rc-boom=$?; cat /tmp/served/hello.txt",
            Duration::from_secs(60),
        )
        .await;
        assert!(took < Duration::from_secs(50), "took {took:?}: {out}");
        assert!(out.contains("Input/output error"), "{out}");
        assert!(out.contains("rc-boom=1"), "{out}");
        assert!(out.contains("served by the host"), "{out}");
        vm.shutdown().await.unwrap();
    })
}

fn busybox() -> krunbox::SandboxBuilder {
    Sandbox::builder()
        .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
        .memory_mib(256)
}

async fn boot(builder: krunbox::SandboxBuilder) -> Instance {
    builder
        .build()
        .expect("sandbox definition (run scripts/setup.sh)")
        .boot()
        .await
        .expect("booting")
}

/// The guest reads what the host serves; what the implementation lacks fails at once with
/// ENOSYS ("Function not implemented"), and the guest carries on.
#[test]
fn a_host_filesystem_is_read_and_its_missing_operations_fail_at_once() {
    common::run(async {
        let vm = boot(busybox().mount("/tmp/served", OneFile)).await;
        let (out, took) = sh(
            &vm,
            "cat /tmp/served/hello.txt; ls /tmp/served; stat -c '%s %a %Y' /tmp/served/hello.txt; \
             touch /tmp/served/new 2>&1; mkdir /tmp/served/d 2>&1; echo done",
            Duration::from_secs(60),
        )
        .await;
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "served by the host", "{out}");
        assert_eq!(lines[1], "hello.txt", "{out}");
        assert_eq!(lines[2], "19 644 1700000000", "{out}");
        assert!(
            out.matches("Function not implemented").count() == 2,
            "touch and mkdir should fail with ENOSYS: {out}"
        );
        assert!(out.ends_with("done\n"), "{out}");
        assert!(took < Duration::from_secs(50), "took {took:?}");
        vm.shutdown().await.unwrap();
    })
}

/// A mount point that cannot be made fails the boot, and the host's error carries the guest's.
#[test]
fn a_mount_point_that_cannot_be_made_fails_the_boot_with_the_guests_error() {
    common::run(async {
        // /bin/sh is a file: nothing can be made beneath it.
        let err = busybox()
            .mount("/bin/sh/workspace", OneFile)
            .build()
            .unwrap()
            .boot()
            .await
            .expect_err("a mount under a file");
        let Error::GuestSetup { message } = &err else {
            panic!("expected GuestSetup, got {err:?}");
        };
        assert!(message.contains("/bin/sh/workspace"), "{message}");
        assert!(
            message.contains("Not a directory") || message.contains("File exists"),
            "{message}"
        );
    })
}

/// A mount point the read-only image lacks is made for it (an overlay holding just that empty
/// directory), and the root stays read-only.
#[test]
fn a_mount_point_missing_from_the_read_only_image_is_made_and_the_root_stays_read_only() {
    common::run(async {
        let vm = boot(busybox().mount("/workspace/project", OneFile)).await;
        let (out, _) = sh(
            &vm,
            "cat /workspace/project/hello.txt; touch /created-by-guest 2>&1; \
             mkdir /workspace/other 2>&1; ls /bin/busybox",
            Duration::from_secs(60),
        )
        .await;
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "served by the host", "{out}");
        assert!(lines[1].contains("Read-only file system"), "{out}");
        assert!(lines[2].contains("Read-only file system"), "{out}");
        assert_eq!(
            lines[3], "/bin/busybox",
            "the image is still the root: {out}"
        );
        vm.shutdown().await.unwrap();
    })
}

/// The host reads what the guest writes while the guest runs, and the guest sees what the host
/// changes once its cache time (1 s by default) has passed.
#[test]
fn host_and_guest_see_each_others_changes_while_the_vm_runs() {
    common::run(async {
        let workspace = MemoryFs::new();
        workspace
            .write_file("/seeded.txt", b"from the host\n")
            .unwrap();
        let vm = boot(busybox().mount("/workspace", workspace.clone())).await;
        let (out, _) = sh(
            &vm,
            "cat /workspace/seeded.txt && mkdir -p /workspace/made && \
             echo 'from the guest' > /workspace/made/by-guest.txt",
            Duration::from_secs(60),
        )
        .await;
        assert_eq!(out, "from the host\n", "{out}");
        // Read while the VM runs: the guest's write returned, so the host has it.
        assert_eq!(
            workspace.read_file("/made/by-guest.txt").unwrap(),
            b"from the guest\n"
        );
        // The host changes a file the guest has read, and adds one.
        workspace
            .write_file("/seeded.txt", b"changed by the host, longer\n")
            .unwrap();
        workspace
            .write_file("/new-from-host.txt", b"new\n")
            .unwrap();
        tokio::time::sleep(MountOptions::DEFAULT_CACHE + Duration::from_millis(500)).await;
        let (out, _) = sh(
            &vm,
            "cat /workspace/seeded.txt /workspace/new-from-host.txt",
            Duration::from_secs(60),
        )
        .await;
        assert_eq!(out, "changed by the host, longer\nnew\n");
        vm.shutdown().await.unwrap();
    })
}

/// Every mount is a device of the VM, and the VM has only so many: with a network and a
/// writable root (a device each) a sandbox has room for 3 mounts, all of which work, and a
/// fourth is refused when the sandbox is built, saying why.
#[test]
fn as_many_mounts_as_the_vm_has_devices_for_work_beside_a_network_and_a_writable_root() {
    common::run(async {
        let with = |count: usize| {
            let mut builder = busybox()
                .rootfs(Rootfs::ephemeral(
                    Rootfs::builtin(BuiltinImage::Busybox),
                    64 << 20,
                ))
                .network(krunbox::Network::deny_all());
            for i in 0..count {
                let fs = MemoryFs::new();
                fs.write_file("/which", format!("mount {i}\n").as_bytes())
                    .unwrap();
                builder = builder.mount(format!("/mnt/m{i}"), fs);
            }
            builder
        };
        match with(4).build() {
            Err(Error::InvalidConfig(why)) => assert!(
                why.contains("at most 3 filesystems") && why.contains("network"),
                "{why}"
            ),
            other => panic!("4 mounts beside a network and a writable root: {other:?}"),
        }
        let vm = boot(with(3)).await;
        let (out, _) = sh(
            &vm,
            "cat /mnt/m0/which /mnt/m1/which /mnt/m2/which && echo x > /written && cat /written",
            Duration::from_secs(60),
        )
        .await;
        assert_eq!(out, "mount 0\nmount 1\nmount 2\nx\n");
        vm.shutdown().await.unwrap();
    })
}

/// A read-only mount: the guest reads, every change fails with EROFS, and the filesystem is
/// untouched.
#[test]
fn a_read_only_mount_refuses_every_change() {
    common::run(async {
        let docs = MemoryFs::new();
        docs.write_file("/guide.md", b"# guide\n").unwrap();
        let vm = boot(busybox().mount_with("/docs", docs.clone(), MountOptions::new().read_only()))
            .await;
        let (out, _) = sh(
            &vm,
            "cat /docs/guide.md; echo x > /docs/guide.md; touch /docs/new; mkdir /docs/d; \
             rm /docs/guide.md; mv /docs/guide.md /docs/moved; chmod 777 /docs/guide.md; true",
            Duration::from_secs(60),
        )
        .await;
        assert!(out.starts_with("# guide\n"), "{out}");
        assert_eq!(out.matches("Read-only file system").count(), 6, "{out}");
        assert_eq!(docs.read_dir("/").unwrap(), ["guide.md"]);
        assert_eq!(docs.read_file("/guide.md").unwrap(), b"# guide\n");
        vm.shutdown().await.unwrap();
    })
}

/// `remove_all` of `/`, of a mount point or of a tree holding one is refused before anything
/// is removed (it would walk into the mount and empty the caller's filesystem); what is inside
/// a mount is removed when named.
#[test]
fn remove_all_refuses_the_root_and_trees_holding_a_mount_and_removes_inside_one() {
    common::run(async {
        let work = MemoryFs::new();
        work.write_file("/keep.txt", b"kept\n").unwrap();
        work.create_dir_all("/build/obj").unwrap();
        work.write_file("/build/obj/a.o", b"obj").unwrap();
        let vm = boot(busybox().mount("/srv/work", work.clone())).await;
        for target in ["/", "/srv", "/srv/work", "/srv/../srv/work/."] {
            match vm.remove_all(target).await {
                Err(Error::Fs { kind, message, .. }) => {
                    assert_eq!(kind, FsErrorKind::InvalidInput, "{target}: {message}");
                }
                other => panic!("remove_all({target}) was not refused: {other:?}"),
            }
        }
        assert_eq!(work.read_file("/keep.txt").unwrap(), b"kept\n");
        vm.remove_all("/srv/work/build").await.unwrap();
        assert_eq!(work.read_dir("/").unwrap(), ["keep.txt"]);
        vm.shutdown().await.unwrap();
    })
}
