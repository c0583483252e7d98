//! Workspaces: host-implemented filesystems mounted in a real microVM (FUSE in the guest,
//! relayed over vsock to the library). Every test boots its own VM.

mod common;
#[allow(dead_code)] // the network tests' sandboxes are not used here
#[path = "common/guest.rs"]
mod guest;

use std::ffi::OsStr;
use std::time::{Duration, SystemTime};

use krunbox::fs::*;
use krunbox::{BuiltinImage, Error, Instance, Rootfs, Sandbox};

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
