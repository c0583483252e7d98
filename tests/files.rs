//! File operations against a real microVM: `Instance::read_file`, `write_file`, streams,
//! metadata, listing, removal, and the typed errors.
//!
//! Nothing is mocked: one busybox VM, booted once for this test binary, is shared by every
//! test (each works under its own directory in the guest's `/tmp`). Where the host's KVM cannot
//! boot guests, run this binary inside the nested L1 harness (scripts/nested.sh).

mod common;

use std::time::{Duration, Instant, SystemTime};

use krunbox::{BuiltinImage, Error, FileType, FsErrorKind, Instance, Rootfs, Sandbox};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::OnceCell;

async fn shared_vm() -> &'static Instance {
    static VM: OnceCell<Instance> = OnceCell::const_new();
    VM.get_or_init(|| async {
        Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            // /tmp is a tmpfs of half the memory: room for every file these tests write.
            .memory_mib(512)
            .build()
            .expect("sandbox definition (are guest-init, krunbox-vmm and libkrunfw built? run scripts/setup.sh)")
            .boot()
            .await
            .expect("booting the shared busybox VM")
    })
    .await
}

async fn sh(vm: &Instance, script: &str) -> krunbox::Output {
    let out = vm
        .command("sh")
        .args(["-c", script])
        .output()
        .await
        .expect("running sh in the guest");
    assert!(out.status.success(), "`{script}` failed: {out:?}");
    out
}

/// A fresh, empty directory in the guest for one test.
async fn scratch(vm: &Instance, name: &str) -> String {
    let dir = format!("/tmp/files-test/{name}");
    sh(vm, &format!("rm -rf {dir} && mkdir -p {dir}")).await;
    dir
}

fn fs_kind<T: std::fmt::Debug>(result: krunbox::Result<T>) -> (FsErrorKind, String) {
    match result {
        Err(err @ Error::Fs { .. }) => (err.fs_kind().unwrap(), err.to_string()),
        other => panic!("expected a file-operation error, got {other:?}"),
    }
}

/// Deterministic pseudo-random bytes (xorshift64*), fast enough for megabytes in a debug build.
struct Noise(u64);

impl Noise {
    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let word = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }
}

#[test]
fn write_then_read_round_trips_exact_bytes() {
    common::run(async {
        let vm = shared_vm().await;
        let dir = scratch(vm, "round-trip").await;
        let mut data: Vec<u8> = (0..=255u8).collect();
        data.extend_from_slice(b"\0\0\xff\xfe line\r\n\0");
        let path = format!("{dir}/bytes.bin");
        vm.write_file(&path, &data).await.unwrap();
        assert_eq!(vm.read_file(&path).await.unwrap(), data);

        // The guest's own tools see the same bytes...
        let out = vm.command("cat").arg(&path).output().await.unwrap();
        assert_eq!(out.stdout, data);
        // ...and files written by commands are visible to read_file.
        sh(
            vm,
            &format!("printf 'from\\000the\\377guest' > {dir}/cmd.bin"),
        )
        .await;
        assert_eq!(
            vm.read_file(format!("{dir}/cmd.bin")).await.unwrap(),
            b"from\0the\xffguest"
        );

        // Rewriting truncates; an empty file reads back empty.
        vm.write_file(&path, b"short").await.unwrap();
        assert_eq!(vm.read_file(&path).await.unwrap(), b"short");
        vm.write_file(&path, b"").await.unwrap();
        assert_eq!(vm.read_file(&path).await.unwrap(), b"");
        assert_eq!(vm.metadata(&path).await.unwrap().len, 0);

        // Exactly one chunk, and one byte more: the chunk boundaries of the protocol.
        for len in [512 * 1024, 512 * 1024 + 1, 3 * 512 * 1024 - 7] {
            let mut data = vec![0u8; len];
            Noise(len as u64).fill(&mut data);
            vm.write_file(&path, &data).await.unwrap();
            let back = vm.read_file(&path).await.unwrap();
            assert_eq!(back.len(), len);
            assert!(back == data, "{len} bytes differ after the round trip");
        }

        // A relative path is relative to the guest's `/`.
        let relative = format!("{}/relative.txt", dir.trim_start_matches('/'));
        vm.write_file(&relative, b"rel").await.unwrap();
        assert_eq!(
            vm.read_file(format!("{dir}/relative.txt")).await.unwrap(),
            b"rel"
        );
    });
}

#[test]
fn modes_are_applied_exactly() {
    common::run(async {
        let vm = shared_vm().await;
        let dir = scratch(vm, "modes").await;
        let stat = |path: String| async move {
            let out = vm
                .command("stat")
                .args(["-c", "%a"])
                .arg(&path)
                .output()
                .await
                .unwrap();
            assert!(out.status.success(), "{out:?}");
            out.stdout_text().trim().to_string()
        };

        vm.write_file(format!("{dir}/default"), b"x").await.unwrap();
        assert_eq!(stat(format!("{dir}/default")).await, "644");
        assert_eq!(
            vm.metadata(format!("{dir}/default")).await.unwrap().mode,
            0o644
        );

        // No umask: 0o777 stays 0o777, and special bits survive.
        for mode in [0o600, 0o777, 0o4755, 0o1777, 0o000] {
            let path = format!("{dir}/m{mode:o}");
            vm.write_file_with_mode(&path, b"#!/bin/sh\n", mode)
                .await
                .unwrap();
            assert_eq!(
                stat(path.clone()).await,
                format!("{mode:o}"),
                "mode {mode:o}"
            );
            assert_eq!(vm.metadata(&path).await.unwrap().mode, mode);
        }

        // Rewriting an existing file keeps its mode.
        let path = format!("{dir}/m600");
        vm.write_file_with_mode(&path, b"again", 0o777)
            .await
            .unwrap();
        assert_eq!(vm.metadata(&path).await.unwrap().mode, 0o600);

        // A streamed file gets its mode at creation.
        let mut w = vm
            .create_file(format!("{dir}/streamed"), 0o751)
            .await
            .unwrap();
        w.write_all(b"data").await.unwrap();
        w.shutdown().await.unwrap();
        assert_eq!(stat(format!("{dir}/streamed")).await, "751");

        // Directories too.
        vm.create_dir(format!("{dir}/d700"), 0o700).await.unwrap();
        assert_eq!(stat(format!("{dir}/d700")).await, "700");
        vm.create_dir(format!("{dir}/d777"), 0o777).await.unwrap();
        assert_eq!(stat(format!("{dir}/d777")).await, "777");
        vm.create_dir_all(format!("{dir}/p/q/r")).await.unwrap();
        for sub in ["p", "p/q", "p/q/r"] {
            assert_eq!(stat(format!("{dir}/{sub}")).await, "755", "{sub}");
        }
    });
}

#[test]
fn a_stream_of_many_chunks_round_trips() {
    // Eight whole chunks and a partial one: enough for every chunk boundary, the writer's
    // buffering across them and the final short chunk to be crossed in both directions, and
    // little enough that the nested emulation (docs/testing.md) is not stressed for nothing.
    // Throughput belongs to benches/, not here.
    const SIZE: usize = 8 * krunbox::protocol::fs::MAX_FILE_CHUNK + 12_345;
    common::run(async {
        let vm = shared_vm().await;
        let dir = scratch(vm, "stream").await;
        let path = format!("{dir}/big.bin");

        // Odd write sizes exercise the writer's buffering across chunk boundaries.
        let mut noise = Noise(0x9e37_79b9_7f4a_7c15);
        let mut block = vec![0u8; 100_003]; // odd, so writes straddle chunk boundaries
        let mut sent = Sha256::new();
        let mut writer = vm.create_file(&path, 0o644).await.unwrap();
        let started = Instant::now();
        let mut left = SIZE;
        while left > 0 {
            let n = left.min(block.len());
            noise.fill(&mut block[..n]);
            sent.update(&block[..n]);
            writer.write_all(&block[..n]).await.unwrap();
            left -= n;
        }
        writer.finish().await.unwrap();
        let write_time = started.elapsed();
        let sent = hex::encode(sent.finalize());

        let out = vm.command("sha256sum").arg(&path).output().await.unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            out.stdout_text().split_whitespace().next(),
            Some(sent.as_str())
        );
        assert_eq!(vm.metadata(&path).await.unwrap().len, SIZE as u64);

        let started = Instant::now();
        let mut reader = vm.open_file(&path).await.unwrap();
        let mut received = Sha256::new();
        let mut total = 0usize;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = reader.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            received.update(&buf[..n]);
            total += n;
        }
        let read_time = started.elapsed();
        assert_eq!(total, SIZE);
        assert_eq!(hex::encode(received.finalize()), sent);
        // Further reads at EOF stay at EOF.
        assert_eq!(reader.read(&mut buf).await.unwrap(), 0);

        let mib = SIZE as f64 / (1024.0 * 1024.0);
        eprintln!(
            "{mib:.1} MiB stream: write {:.1} s ({:.1} MiB/s), read {:.1} s ({:.1} MiB/s)",
            write_time.as_secs_f64(),
            mib / write_time.as_secs_f64(),
            read_time.as_secs_f64(),
            mib / read_time.as_secs_f64()
        );
        vm.remove(&path).await.unwrap();
    });
}

#[test]
fn metadata_describes_files_dirs_and_symlinks() {
    common::run(async {
        let vm = shared_vm().await;
        let dir = scratch(vm, "meta").await;
        vm.write_file(format!("{dir}/file"), b"12345")
            .await
            .unwrap();
        sh(
            vm,
            &format!("ln -s file {dir}/link && chown 1000:1001 {dir}/file"),
        )
        .await;

        let file = vm.metadata(format!("{dir}/file")).await.unwrap();
        assert_eq!(file.file_type, FileType::File);
        assert!(file.is_file() && !file.is_dir() && !file.is_symlink());
        assert_eq!((file.len, file.uid, file.gid), (5, 1000, 1001));
        let now = SystemTime::now();
        let age = now
            .duration_since(file.modified)
            .unwrap_or_else(|e| e.duration());
        assert!(
            age < Duration::from_secs(3600),
            "mtime {:?} vs now {now:?}",
            file.modified
        );

        let d = vm.metadata(&dir).await.unwrap();
        assert_eq!(d.file_type, FileType::Dir);
        assert!(d.is_dir());

        // metadata follows the link; symlink_metadata describes the link itself.
        let followed = vm.metadata(format!("{dir}/link")).await.unwrap();
        assert_eq!((followed.file_type, followed.len), (FileType::File, 5));
        let link = vm.symlink_metadata(format!("{dir}/link")).await.unwrap();
        assert_eq!(link.file_type, FileType::Symlink);
        assert_eq!(link.len, 4, "a symlink's size is its target's length");

        let (kind, message) = fs_kind(vm.metadata(format!("{dir}/missing")).await);
        assert_eq!(kind, FsErrorKind::NotFound);
        assert!(message.contains("missing"), "{message}");

        // Device nodes are "other".
        let null = vm.metadata("/dev/null").await.unwrap();
        assert_eq!(null.file_type, FileType::Other);
    });
}

#[test]
fn read_dir_lists_large_directories_sorted_across_pages() {
    const N: usize = 2500;
    common::run(async {
        let vm = shared_vm().await;
        let dir = scratch(vm, "many").await;
        sh(
            vm,
            &format!(
                "cd {dir} && i=0; while [ $i -lt {N} ]; do : > f$i; i=$((i+1)); done; \
                 mkdir sub && ln -s f0 link && ln -s /nowhere dangling"
            ),
        )
        .await;
        let entries = vm.read_dir(&dir).await.unwrap();
        assert_eq!(entries.len(), N + 3);
        let names: Vec<Vec<u8>> = entries
            .iter()
            .map(|e| e.name.as_encoded_bytes().to_vec())
            .collect();
        let mut expected: Vec<Vec<u8>> = (0..N).map(|i| format!("f{i}").into_bytes()).collect();
        expected.extend([b"sub".to_vec(), b"link".to_vec(), b"dangling".to_vec()]);
        expected.sort();
        assert_eq!(
            names, expected,
            "sorted by name bytes, nothing missing or repeated"
        );
        let kind = |name: &str| {
            entries
                .iter()
                .find(|e| e.name == name)
                .map(|e| e.file_type)
                .unwrap()
        };
        assert_eq!(kind("sub"), FileType::Dir);
        assert_eq!(kind("link"), FileType::Symlink);
        assert_eq!(kind("dangling"), FileType::Symlink);
        assert_eq!(kind("f1999"), FileType::File);

        // Small directories, and empty ones.
        vm.create_dir(format!("{dir}/sub/empty"), 0o755)
            .await
            .unwrap();
        let sub = vm.read_dir(format!("{dir}/sub")).await.unwrap();
        assert_eq!(sub.len(), 1);
        assert_eq!(sub[0].name, "empty");
        assert!(vm
            .read_dir(format!("{dir}/sub/empty"))
            .await
            .unwrap()
            .is_empty());

        let (kind, _) = fs_kind(vm.read_dir(format!("{dir}/f1")).await);
        assert_eq!(kind, FsErrorKind::NotADirectory);
    });
}

#[test]
fn remove_remove_all_and_create_dir_all() {
    common::run(async {
        let vm = shared_vm().await;
        let dir = scratch(vm, "remove").await;
        let tree = format!("{dir}/tree");
        vm.create_dir_all(format!("{tree}/a/b/c")).await.unwrap();
        // Existing directories are fine for create_dir_all, not for create_dir.
        vm.create_dir_all(format!("{tree}/a/b")).await.unwrap();
        let (kind, _) = fs_kind(vm.create_dir(format!("{tree}/a"), 0o755).await);
        assert_eq!(kind, FsErrorKind::AlreadyExists);
        let (kind, _) = fs_kind(vm.create_dir(format!("{dir}/no/parent"), 0o755).await);
        assert_eq!(kind, FsErrorKind::NotFound);

        vm.write_file(format!("{tree}/a/b/c/file"), b"1")
            .await
            .unwrap();
        vm.write_file(format!("{tree}/top"), b"2").await.unwrap();
        // A symlink into a directory outside the tree: remove_all must not follow it.
        let outside = format!("{dir}/outside");
        vm.create_dir(&outside, 0o755).await.unwrap();
        vm.write_file(format!("{outside}/keep"), b"keep")
            .await
            .unwrap();
        sh(vm, &format!("ln -s {outside} {tree}/a/escape")).await;

        let (kind, message) = fs_kind(vm.remove(&tree).await);
        assert_eq!(kind, FsErrorKind::DirectoryNotEmpty);
        assert!(message.contains(&tree), "{message}");

        vm.remove_all(&tree).await.unwrap();
        let (kind, _) = fs_kind(vm.metadata(&tree).await);
        assert_eq!(kind, FsErrorKind::NotFound);
        assert_eq!(
            vm.read_file(format!("{outside}/keep")).await.unwrap(),
            b"keep"
        );

        // remove: a file, a symlink (not its target), an empty directory.
        sh(vm, &format!("ln -s {outside}/keep {dir}/link")).await;
        vm.remove(format!("{dir}/link")).await.unwrap();
        assert_eq!(
            vm.read_file(format!("{outside}/keep")).await.unwrap(),
            b"keep"
        );
        vm.remove(format!("{outside}/keep")).await.unwrap();
        vm.remove(&outside).await.unwrap();
        assert!(vm.read_dir(&dir).await.unwrap().is_empty());

        // remove_all of a plain file works; of nothing, NotFound.
        vm.write_file(format!("{dir}/f"), b"").await.unwrap();
        vm.remove_all(format!("{dir}/f")).await.unwrap();
        let (kind, _) = fs_kind(vm.remove_all(format!("{dir}/f")).await);
        assert_eq!(kind, FsErrorKind::NotFound);
        let (kind, _) = fs_kind(vm.remove(format!("{dir}/f")).await);
        assert_eq!(kind, FsErrorKind::NotFound);
    });
}

#[test]
fn failures_are_typed_errors() {
    common::run(async {
        let vm = shared_vm().await;
        let dir = scratch(vm, "errors").await;

        let (kind, message) = fs_kind(vm.read_file("/no/such/file").await);
        assert_eq!(kind, FsErrorKind::NotFound);
        assert!(
            message.contains(r#"read_file "/no/such/file""#),
            "{message}"
        );
        assert!(message.contains("No such file or directory"), "{message}");

        let (kind, message) = fs_kind(vm.read_file(&dir).await);
        assert_eq!(kind, FsErrorKind::IsADirectory, "{message}");
        let (kind, _) = fs_kind(vm.open_file(&dir).await);
        assert_eq!(kind, FsErrorKind::IsADirectory);

        // The image's root is read-only, even for root.
        let (kind, message) = fs_kind(vm.write_file("/etc/krunbox-test", b"x").await);
        assert_eq!(kind, FsErrorKind::PermissionDenied, "{message}");
        assert!(message.contains("Read-only file system"), "{message}");
        let (kind, _) = fs_kind(vm.create_file("/etc/krunbox-test", 0o644).await);
        assert_eq!(kind, FsErrorKind::PermissionDenied);
        let (kind, _) = fs_kind(vm.remove("/etc/passwd").await);
        assert_eq!(kind, FsErrorKind::PermissionDenied);

        vm.write_file(format!("{dir}/sub/x"), b"")
            .await
            .expect_err("the parent does not exist");
        vm.create_dir(format!("{dir}/sub"), 0o755).await.unwrap();
        vm.write_file(format!("{dir}/sub/x"), b"").await.unwrap();
        let (kind, _) = fs_kind(vm.remove(format!("{dir}/sub")).await);
        assert_eq!(kind, FsErrorKind::DirectoryNotEmpty);

        let (kind, _) = fs_kind(vm.read_file("/etc/passwd/x").await);
        assert_eq!(kind, FsErrorKind::NotADirectory);

        // Paths the protocol cannot carry fail before anything is sent.
        let (kind, _) = fs_kind(vm.read_file("").await);
        assert_eq!(kind, FsErrorKind::InvalidInput);
        let (kind, _) = fs_kind(vm.read_file("/tmp/a\0b").await);
        assert_eq!(kind, FsErrorKind::InvalidInput);
        let (kind, _) = fs_kind(vm.read_file(format!("/tmp/{}", "x".repeat(5000))).await);
        assert_eq!(kind, FsErrorKind::InvalidInput);
        // ...and the instance is still fine.
        assert!(vm.is_running());

        // Through AsyncRead/AsyncWrite the typed error is inside the io::Error.
        let mut writer = vm.create_file(format!("{dir}/gone"), 0o644).await.unwrap();
        vm.remove_all(&dir).await.unwrap();
        writer.write_all(b"lost").await.unwrap(); // buffered
        let err = writer
            .flush()
            .await
            .expect_err("the file's directory was removed");
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
        let inner = err
            .get_ref()
            .and_then(|e| e.downcast_ref::<Error>())
            .unwrap();
        assert_eq!(inner.fs_kind(), Some(FsErrorKind::NotFound));
        // The failure sticks.
        assert!(writer.write_all(b"more").await.is_err());
        assert_eq!(fs_kind(writer.finish().await).0, FsErrorKind::NotFound);
    });
}

#[test]
fn many_concurrent_operations_get_their_own_answers() {
    common::run(async {
        let vm = shared_vm().await;
        let dir = scratch(vm, "concurrent").await;
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..64u32 {
            let vm = vm.clone();
            let path = format!("{dir}/f{i}");
            tasks.spawn(async move {
                let data = format!("file number {i}").repeat(i as usize * 1000 + 1);
                vm.write_file(&path, &data).await.unwrap();
                assert_eq!(vm.read_file(&path).await.unwrap(), data.as_bytes());
                assert_eq!(vm.metadata(&path).await.unwrap().len, data.len() as u64);
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.unwrap();
        }
        assert_eq!(vm.read_dir(&dir).await.unwrap().len(), 64);
        // Commands keep working alongside (file requests and processes have ids of their own).
        let out = sh(vm, &format!("ls {dir} | wc -l")).await;
        assert_eq!(out.stdout_text().trim(), "64");
    });
}

/// Fails the test if `fut` takes longer than a minute: a refused read must be answered at
/// once, never block (a FIFO) or stream without end (`/dev/zero`).
async fn promptly<T>(fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), fut)
        .await
        .expect("answered promptly, not blocked or streaming")
}

/// `read_file` of a device, a FIFO or a 10 GiB (sparse) file is a typed error, answered at
/// once, and the instance stays healthy. (Before, `/dev/zero` exhausted host memory and a FIFO
/// blocked guest-init's open until the instance died.)
#[test]
fn read_file_refuses_devices_fifos_and_huge_files() {
    common::run(async {
        let vm = shared_vm().await;
        let dir = scratch(vm, "not-files").await;
        sh(
            vm,
            &format!("mkfifo {dir}/fifo && truncate -s 10G {dir}/sparse"),
        )
        .await;

        let (kind, message) = fs_kind(promptly(vm.read_file("/dev/zero")).await);
        assert_eq!(kind, FsErrorKind::NotAFile, "{message}");
        assert!(message.contains("not a regular file"), "{message}");
        let (kind, message) = fs_kind(promptly(vm.read_file(format!("{dir}/fifo"))).await);
        assert_eq!(kind, FsErrorKind::NotAFile, "{message}");
        // The stream refuses them in guest-init, without blocking on the FIFO's open.
        let (kind, message) = fs_kind(promptly(vm.open_file(format!("{dir}/fifo"))).await);
        assert_eq!(kind, FsErrorKind::NotAFile, "{message}");
        assert!(message.contains("a FIFO"), "{message}");
        let (kind, message) = fs_kind(promptly(vm.open_file("/dev/zero")).await);
        assert_eq!(kind, FsErrorKind::NotAFile, "{message}");

        let (kind, message) = fs_kind(promptly(vm.read_file(format!("{dir}/sparse"))).await);
        assert_eq!(kind, FsErrorKind::TooLarge, "{message}");
        assert!(message.contains("10737418240 bytes"), "{message}");
        assert!(message.contains("open_file"), "{message}");

        // Still healthy: a command and a file read work.
        assert!(vm.is_running());
        assert_eq!(
            sh(vm, "echo still here").await.stdout_text(),
            "still here\n"
        );
        vm.write_file(format!("{dir}/ok"), b"ok").await.unwrap();
        assert_eq!(vm.read_file(format!("{dir}/ok")).await.unwrap(), b"ok");
    });
}

/// With a small `read_file` limit (1 MiB, so three chunks cross it): a file of exactly the
/// limit is read, one byte more is `TooLarge`, and `open_file` streams it whole. A directory
/// past `read_dir_max_entries` is `TooLarge` too.
#[test]
fn files_past_the_limits_are_refused_and_streamed_instead() {
    common::run(async {
        const LIMIT: u64 = 1 << 20;
        let vm = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .limits(
                krunbox::Limits::new()
                    .read_file_max(LIMIT)
                    .read_dir_max_entries(10),
            )
            .build()
            .expect("sandbox definition")
            .boot()
            .await
            .expect("booting");
        sh(
            &vm,
            &format!(
                "mkdir -p /tmp/big/dir && cd /tmp/big && head -c {LIMIT} /dev/urandom > exact && \
                 cat exact > over && echo x >> over && touch dir/f1 dir/f2 dir/f3 dir/f4 \
                 dir/f5 dir/f6 dir/f7 dir/f8 dir/f9 dir/f10"
            ),
        )
        .await;
        let exact = vm.read_file("/tmp/big/exact").await.unwrap();
        assert_eq!(exact.len() as u64, LIMIT);

        let (kind, message) = fs_kind(vm.read_file("/tmp/big/over").await);
        assert_eq!(kind, FsErrorKind::TooLarge, "{message}");
        assert!(
            message.contains(&format!("{} bytes", LIMIT + 2)),
            "{message}"
        );

        let mut streamed = Vec::new();
        vm.open_file("/tmp/big/over")
            .await
            .unwrap()
            .read_to_end(&mut streamed)
            .await
            .unwrap();
        assert_eq!(streamed.len() as u64, LIMIT + 2);
        assert_eq!(&streamed[..LIMIT as usize], &exact[..]);
        assert_eq!(&streamed[LIMIT as usize..], b"x\n");

        assert_eq!(vm.read_dir("/tmp/big/dir").await.unwrap().len(), 10);
        sh(&vm, "touch /tmp/big/dir/f11").await;
        let (kind, message) = fs_kind(vm.read_dir("/tmp/big/dir").await);
        assert_eq!(kind, FsErrorKind::TooLarge, "{message}");
        assert!(message.contains("more than 10 entries"), "{message}");
        assert!(vm.is_running());
    });
}

/// Issue 35's file operations: rename (replacing a file atomically, a missing parent of the
/// destination refused), a ranged read (inside, across the end, past the end, of a file larger
/// than `read_file` takes), and a write that makes its missing parents.
#[test]
fn rename_ranged_reads_and_writes_that_make_their_parents() {
    common::run(async {
        let vm = shared_vm().await;
        let dir = scratch(vm, "rename").await;
        vm.write_file(format!("{dir}/report.part"), b"new")
            .await
            .unwrap();
        vm.write_file(format!("{dir}/report"), b"old")
            .await
            .unwrap();
        vm.rename(format!("{dir}/report.part"), format!("{dir}/report"))
            .await
            .unwrap();
        assert_eq!(vm.read_file(format!("{dir}/report")).await.unwrap(), b"new");
        let (kind, _) = fs_kind(vm.metadata(format!("{dir}/report.part")).await);
        assert_eq!(kind, FsErrorKind::NotFound);
        let (kind, message) = fs_kind(
            vm.rename(format!("{dir}/report"), format!("{dir}/missing/report"))
                .await,
        );
        assert_eq!(kind, FsErrorKind::NotFound, "{message}");
        assert_eq!(vm.read_file(format!("{dir}/report")).await.unwrap(), b"new");

        vm.write_file(format!("{dir}/greeting"), b"hello world")
            .await
            .unwrap();
        let range = |offset, len| vm.read_file_range(format!("{dir}/greeting"), offset, len);
        assert_eq!(range(6, 5).await.unwrap(), b"world");
        assert_eq!(range(9, 100).await.unwrap(), b"ld", "cut at the end");
        assert_eq!(range(11, 4).await.unwrap(), b"", "nothing past the end");
        // 80 MiB (sparse: no guest time spent writing it), past read_file's 64 MiB: a range of it
        // reads all the same.
        sh(
            vm,
            &format!("truncate -s 83886080 {dir}/big && printf tail >> {dir}/big"),
        )
        .await;
        let (kind, _) = fs_kind(vm.read_file(format!("{dir}/big")).await);
        assert_eq!(kind, FsErrorKind::TooLarge);
        let end = vm
            .read_file_range(format!("{dir}/big"), 83886080 - 2, 16)
            .await
            .unwrap();
        assert_eq!(end, b"\0\0tail");

        let deep = format!("{dir}/made/on/the/way/token");
        let (kind, _) = fs_kind(vm.write_file(&deep, b"t").await);
        assert_eq!(kind, FsErrorKind::NotFound, "no parents without the option");
        vm.write_file_with(
            &deep,
            b"t",
            krunbox::WriteOptions::new()
                .create_parents(true)
                .mode(0o600),
        )
        .await
        .unwrap();
        assert_eq!(vm.read_file(&deep).await.unwrap(), b"t");
        assert_eq!(vm.metadata(&deep).await.unwrap().mode & 0o777, 0o600);
        let parent = vm.metadata(format!("{dir}/made/on")).await.unwrap();
        assert!(parent.is_dir());
        assert_eq!(parent.mode & 0o777, 0o755);
        vm.remove_all(format!("{dir}/big")).await.unwrap();
    });
}
