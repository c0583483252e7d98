//! Copy-on-write roots (`Rootfs::cow`): an image made writable with its changes kept, block by
//! block, in a `BlockStore` — the two that ship (`MemoryStore`, `DirectoryStore`) and stores
//! this file writes itself through the public trait (one that fails, one that keeps a copy of
//! what was durable at each flush). Every VM test boots its own VMs and writes as little as
//! proves its point (the nested emulation these run under faults more the more a guest writes).

mod common;
#[allow(dead_code)] // only `sh` is used here
#[path = "common/guest.rs"]
mod guest;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use krunbox::fs::MemoryFs;
use krunbox::rootfs::{
    async_trait, BlockStore, DirectoryStore, MemoryStore, StoreContext, StoreError,
};
use krunbox::{BootOptions, BuiltinImage, Error, Rootfs, Sandbox};

use guest::sh;

const TIMEOUT: Duration = Duration::from_secs(180);

fn cow(base: BuiltinImage, store: impl Into<krunbox::rootfs::StoreHandle>) -> Sandbox {
    Sandbox::builder()
        .rootfs(Rootfs::cow(Rootfs::builtin(base), store, 32 << 20))
        .memory_mib(512)
        .build()
        .expect("sandbox definition (run scripts/setup.sh)")
}

/// Builds a .deb in the guest (dpkg-deb, in /tmp), installs it with `dpkg -i`, writes a file
/// into /etc, and syncs.
const INSTALL: &str = "set -e
mkdir -p /tmp/pkg/DEBIAN /tmp/pkg/usr/bin
printf 'Package: krunbox-probe\\nVersion: 1.0\\nArchitecture: all\\nMaintainer: krunbox tests <tests@krunbox.invalid>\\nDescription: a package a test built\\n' > /tmp/pkg/DEBIAN/control
printf '#!/bin/sh\\necho probe says hi\\n' > /tmp/pkg/usr/bin/krunbox-probe
chmod 755 /tmp/pkg/usr/bin/krunbox-probe
dpkg-deb --build /tmp/pkg /tmp/probe.deb >/dev/null
dpkg -i /tmp/probe.deb >/dev/null
echo kept > /etc/krunbox-kept
sync
echo installed";

/// What the next boot must see after [`INSTALL`].
const CHECK: &str =
    "cat /etc/krunbox-kept; krunbox-probe; dpkg-query -W -f '${Status}\\n' krunbox-probe";

/// A file and a package installed with `dpkg -i` survive into the next boot over the same
/// memory store; a second boot while one runs is refused; the store holds what was written.
/// The first boot's mounts (one inside the other, at a path the image lacks) do not leave
/// their mount point in the layer (issue 35).
#[test]
fn a_cow_root_over_a_memory_store_keeps_a_file_and_a_dpkg_installed_package_across_boots() {
    common::run(async {
        let store = MemoryStore::new();
        let sandbox = cow(BuiltinImage::Agent, store.clone());
        let (outer, inner) = (MemoryFs::new(), MemoryFs::new());
        outer.write_file("/hello", b"outer\n").unwrap();
        inner.write_file("/hello", b"inner\n").unwrap();
        let mounts = BootOptions::new()
            .mount("/srv/lane/data", outer.clone())
            .mount("/srv/lane/data/cache", inner);
        let vm = sandbox.boot_with(mounts).await.expect("boot");
        let (out, _) = sh(
            &vm,
            "cat /srv/lane/data/hello /srv/lane/data/cache/hello",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "outer\ninner\n", "{out}");
        assert!(
            outer.metadata("/cache").unwrap().kind == krunbox::fs::FileKind::Directory,
            "the inner mount's point is made in the outer mount"
        );
        match sandbox.boot().await {
            Err(Error::BlockStore {
                source: StoreError::InUse,
                ..
            }) => {}
            other => panic!("a second boot over a store in use must be refused, got {other:?}"),
        }
        let (out, _) = sh(&vm, INSTALL, TIMEOUT).await;
        assert_eq!(out, "installed\n", "{out}");
        // The layer is the host-served virtio-blk disk, found by its serial, with 4 KiB
        // blocks and a write cache the guest flushes (so an fsync reaches the store).
        let (out, _) = sh(
            &vm,
            "for d in /sys/block/*; do [ \"$(cat $d/serial 2>/dev/null)\" = krunbox-layer ] && \
             echo ${d##*/} $(cat $d/queue/logical_block_size) $(cat $d/queue/write_cache); done",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "vdb 4096 write back\n", "{out}");
        let usage = vm.root_usage().expect("a writable root reports its usage");
        assert!(usage.held_bytes <= usage.max_bytes, "{usage:?}");
        vm.shutdown().await.expect("shutdown");
        assert!(store.stored_bytes() > 0);

        let vm = sandbox.boot().await.expect("second boot");
        let (out, _) = sh(&vm, CHECK, TIMEOUT).await;
        assert_eq!(out, "kept\nprobe says hi\ninstall ok installed\n", "{out}");
        let (out, _) = sh(&vm, "ls -A /srv 2>/dev/null; echo end", TIMEOUT).await;
        assert_eq!(
            out, "end\n",
            "the last boot's mount points stayed in the layer: {out}"
        );
        // What an agent is told of this guest (issue 35), read through the file API.
        let facts = vm.facts().await.expect("facts");
        assert_eq!(facts.root, krunbox::RootKind::CopyOnWrite);
        assert!(facts.root_read_write && !facts.network, "{facts:?}");
        let distro = facts
            .distro
            .clone()
            .expect("the agent image has an os-release");
        assert_eq!(distro.id, "debian", "{facts:?}");
        assert!(distro.version_id.is_some(), "{facts:?}");
        assert_eq!(facts.package_manager, Some(krunbox::PackageManager::Apt));
        assert_eq!(facts.shell.as_deref(), Some("/bin/sh"));
        for command in ["git", "curl", "python3"] {
            assert!(facts.commands.iter().any(|c| c == command), "{facts:?}");
        }
        // An os-release that is a script is refused, and never run.
        sh(
            &vm,
            "printf '%s\\n' 'ID=$(touch /tmp/os-release-executed)' 'VERSION_ID=3.23' > /etc/os-release",
            TIMEOUT,
        )
        .await;
        let refused = vm.facts().await.expect_err("a script for an os-release");
        assert_eq!(
            refused.fs_kind(),
            Some(krunbox::FsErrorKind::InvalidInput),
            "{refused}"
        );
        assert!(
            refused.to_string().contains("unsupported guest distro"),
            "{refused}"
        );
        let (out, _) = sh(
            &vm,
            "test -e /tmp/os-release-executed || echo never-run",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "never-run\n");
        vm.shutdown().await.expect("shutdown");
    });
}

/// The same over a directory store, the second boot through a store opened anew on the same
/// directory (as another process would), which holds the blocks in one file. That file is
/// the disk, served in place: a write the guest's disk completes is in it at once, before
/// any flush, and stays there when the VMM is killed.
#[test]
fn a_cow_root_over_a_directory_store_keeps_a_file_and_a_dpkg_installed_package_across_boots() {
    common::run(async {
        let dir = tempfile::tempdir().unwrap();
        let vm = cow(
            BuiltinImage::Agent,
            DirectoryStore::open(dir.path()).unwrap(),
        )
        .boot()
        .await
        .expect("boot");
        let (out, _) = sh(&vm, INSTALL, TIMEOUT).await;
        assert_eq!(out, "installed\n", "{out}");
        vm.shutdown().await.expect("shutdown");
        // The blocks are in the store's one sparse file, taking host disk for what was written.
        use std::os::unix::fs::MetadataExt;
        let blocks = std::fs::metadata(dir.path().join("blocks.img")).unwrap();
        assert!(blocks.blocks() > 0, "nothing written to the store's file");

        let again = DirectoryStore::open(dir.path()).unwrap();
        let vm = cow(BuiltinImage::Agent, again)
            .boot()
            .await
            .expect("second boot");
        let (out, _) = sh(&vm, CHECK, TIMEOUT).await;
        assert_eq!(out, "kept\nprobe says hi\ninstall ok installed\n", "{out}");

        // 64 KiB of a pattern written straight to the disk's last 64 KiB (O_DIRECT, no sync:
        // no flush reaches the host), where the layer's fresh ext4 keeps nothing.
        const PATTERN: &[u8] = b"krunbox-in-place";
        let last = (32u64 << 30) / 65536 - 1;
        let (out, _) = sh(
            &vm,
            &format!(
                "yes krunbox-in-place | tr '\\n' - | head -c 65536 > /tmp/pattern && \
                 dd if=/tmp/pattern of=/dev/vdb bs=65536 seek={last} count=1 oflag=direct \
                 2>/dev/null && echo written"
            ),
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "written\n", "{out}");
        let in_file = || {
            use std::os::unix::fs::FileExt;
            let file = std::fs::File::open(dir.path().join("blocks.img")).unwrap();
            let mut tail = vec![0u8; 65536];
            // Short (the file ends before): not there.
            file.read_exact_at(&mut tail, last * 65536).is_ok()
                && tail
                    .chunks_exact(PATTERN.len() + 1)
                    .all(|chunk| chunk.starts_with(PATTERN))
        };
        assert!(in_file(), "the completed write is not in the store's file");
        let pid = vm.vmm_pid().expect("the VMM runs") as i32;
        // SAFETY: a signal to the VMM process this test's instance started.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        vm.shutdown()
            .await
            .expect("a killed VMM leaves a store with nothing to lose");
        // (The page cache holds it, not the VMM: this checks that nothing after the kill,
        // the store's flush and detach, undid it.)
        assert!(in_file(), "the write is gone after the shutdown");
    });
}

/// A store of this test's own, through the public trait: a `DirectoryStore` underneath, plus a
/// copy of what was durable (flushed) at each moment, to boot from as if this process had died
/// right then.
struct RecordingStore {
    inner: DirectoryStore,
    unflushed: Mutex<HashMap<u64, Vec<u8>>>,
    durable: Mutex<HashMap<u64, Vec<u8>>>,
}

impl RecordingStore {
    fn new(dir: &std::path::Path) -> Self {
        RecordingStore {
            inner: DirectoryStore::open(dir).unwrap(),
            unflushed: Mutex::default(),
            durable: Mutex::default(),
        }
    }

    /// What a crash of the host process now would leave: the flushed blocks only.
    fn durable_copy(&self) -> MapStore {
        MapStore {
            block_size: self.inner.block_size(),
            blocks: Mutex::new(self.durable.lock().unwrap().clone()),
        }
    }
}

#[async_trait]
impl BlockStore for RecordingStore {
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }
    async fn attach(&self, context: &StoreContext) -> Result<(), StoreError> {
        self.inner.attach(context).await
    }
    async fn written_blocks(&self) -> Result<Vec<u64>, StoreError> {
        self.inner.written_blocks().await
    }
    async fn read_blocks(&self, first: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        self.inner.read_blocks(first, buf).await
    }
    async fn write_blocks(&self, first: u64, data: &[u8]) -> Result<(), StoreError> {
        self.inner.write_blocks(first, data).await?;
        let size = self.block_size() as usize;
        let mut unflushed = self.unflushed.lock().unwrap();
        for (i, block) in data.chunks(size).enumerate() {
            unflushed.insert(first + i as u64, block.to_vec());
        }
        Ok(())
    }
    async fn flush(&self) -> Result<(), StoreError> {
        self.inner.flush().await?;
        let flushed: Vec<_> = self.unflushed.lock().unwrap().drain().collect();
        self.durable.lock().unwrap().extend(flushed);
        Ok(())
    }
    async fn detach(&self) -> Result<(), StoreError> {
        self.inner.detach().await
    }
}

/// Blocks in a map, accepting any base (so that only krunbox's own check of the layer's
/// record stands between a layer and another base).
struct MapStore {
    block_size: u32,
    blocks: Mutex<HashMap<u64, Vec<u8>>>,
}

#[async_trait]
impl BlockStore for MapStore {
    fn block_size(&self) -> u32 {
        self.block_size
    }
    async fn written_blocks(&self) -> Result<Vec<u64>, StoreError> {
        Ok(self.blocks.lock().unwrap().keys().copied().collect())
    }
    async fn read_blocks(&self, first: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let blocks = self.blocks.lock().unwrap();
        for (i, block) in buf.chunks_mut(self.block_size as usize).enumerate() {
            match blocks.get(&(first + i as u64)) {
                Some(data) => block.copy_from_slice(data),
                None => block.fill(0),
            }
        }
        Ok(())
    }
    async fn write_blocks(&self, first: u64, data: &[u8]) -> Result<(), StoreError> {
        let mut blocks = self.blocks.lock().unwrap();
        for (i, block) in data.chunks(self.block_size as usize).enumerate() {
            blocks.insert(first + i as u64, block.to_vec());
        }
        Ok(())
    }
    async fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// The durability claim. What the guest synced is in the store, flushed, when its `sync`
/// returns: a boot from only what was flushed at that moment (this process dying right then)
/// has it, its journal replayed, and nothing written after. A VMM killed while the guest
/// writes (each file synced as it is done) leaves a directory store that a store opened anew
/// boots from, with the first file and the files synced after it.
#[test]
fn a_cow_root_keeps_what_was_synced_and_what_reached_the_host_when_its_vmm_is_killed() {
    common::run(async {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(RecordingStore::new(dir.path()));
        let handle = krunbox::rootfs::StoreHandle::new(ArcStore(store.clone()));
        let vm = cow(BuiltinImage::Busybox, handle)
            .boot()
            .await
            .expect("boot");
        let (out, _) = sh(
            &vm,
            "echo durable > /etc/durable && sync /etc/durable && echo synced",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "synced\n", "{out}");
        let at_sync = store.durable_copy();
        // Writes in flight: a writer that keeps going, then the VMM killed under it.
        let writer = vm
            .command("sh")
            .args([
                "-c",
                "i=0; while :; do
                   dd if=/dev/zero of=/churn-$i bs=65536 count=16 conv=fsync 2>/dev/null
                   echo $i > /tmp/synced; i=$((i+1))
                 done",
            ])
            .spawn()
            .await
            .expect("start the writer");
        let (out, _) = sh(
            &vm,
            "while [ ! -e /tmp/synced ]; do sleep 0.2; done; sleep 1; echo writing",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "writing\n", "{out}");
        let pid = vm.vmm_pid().expect("the VMM runs") as i32;
        // SAFETY: a signal to the VMM process this test's instance started.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        drop(writer);
        vm.shutdown()
            .await
            .expect("everything the host received reaches the store");

        let from_sync = cow(BuiltinImage::Busybox, at_sync)
            .boot()
            .await
            .expect("boot from what was flushed at the sync");
        let (out, _) = sh(
            &from_sync,
            "cat /etc/durable; ls / | grep -c churn; echo x > /etc/after && echo writable",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "durable\n0\nwritable\n", "{out}");
        from_sync.shutdown().await.expect("shutdown");

        let reopened = DirectoryStore::open(dir.path()).unwrap();
        let vm = cow(BuiltinImage::Busybox, reopened)
            .boot()
            .await
            .expect("boot after the kill");
        let (out, _) = sh(
            &vm,
            "cat /etc/durable; ls / | grep -c churn; echo x > /etc/after && echo writable",
            TIMEOUT,
        )
        .await;
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.first(), Some(&"durable"), "{out}");
        assert!(
            lines
                .get(1)
                .and_then(|n| n.parse::<u32>().ok())
                .unwrap_or(0)
                >= 1,
            "the writes after the sync are gone: {out}"
        );
        assert_eq!(lines.get(2), Some(&"writable"), "{out}");
        vm.shutdown().await.expect("shutdown");
    });
}

/// A store shared with the test through an `Arc`.
struct ArcStore<S>(Arc<S>);

#[async_trait]
impl<S: BlockStore> BlockStore for ArcStore<S> {
    fn block_size(&self) -> u32 {
        self.0.block_size()
    }
    async fn attach(&self, context: &StoreContext) -> Result<(), StoreError> {
        self.0.attach(context).await
    }
    async fn written_blocks(&self) -> Result<Vec<u64>, StoreError> {
        self.0.written_blocks().await
    }
    async fn read_blocks(&self, first: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        self.0.read_blocks(first, buf).await
    }
    async fn write_blocks(&self, first: u64, data: &[u8]) -> Result<(), StoreError> {
        self.0.write_blocks(first, data).await
    }
    async fn flush(&self) -> Result<(), StoreError> {
        self.0.flush().await
    }
    async fn detach(&self) -> Result<(), StoreError> {
        self.0.detach().await
    }
}

/// A store whose writes and flushes fail from when the test says so.
struct FailingStore {
    inner: MemoryStore,
    failing: AtomicBool,
}

#[async_trait]
impl BlockStore for FailingStore {
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }
    async fn written_blocks(&self) -> Result<Vec<u64>, StoreError> {
        self.inner.written_blocks().await
    }
    async fn read_blocks(&self, first: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        self.inner.read_blocks(first, buf).await
    }
    async fn write_blocks(&self, first: u64, data: &[u8]) -> Result<(), StoreError> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(StoreError::Failed("the bucket is gone".into()));
        }
        self.inner.write_blocks(first, data).await
    }
    async fn flush(&self) -> Result<(), StoreError> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(StoreError::Failed("the bucket is gone".into()));
        }
        Ok(())
    }
}

/// A store that fails while the guest writes: the guest's fsync fails with EIO, and shutdown
/// returns the typed error (the blocks were never silently dropped).
#[test]
fn a_store_failing_on_write_is_eio_in_the_guest_and_a_typed_error_from_shutdown() {
    common::run(async {
        let store = Arc::new(FailingStore {
            inner: MemoryStore::new(),
            failing: AtomicBool::new(false),
        });
        let vm = cow(BuiltinImage::Busybox, ArcStore(store.clone()))
            .boot()
            .await
            .expect("boot");
        store.failing.store(true, Ordering::SeqCst);
        let (out, _) = sh(
            &vm,
            "dd if=/dev/zero of=/etc/lost bs=65536 count=4 conv=fsync 2>&1; echo status=$?",
            TIMEOUT,
        )
        .await;
        assert!(out.contains("Input/output error"), "{out}");
        assert!(!out.contains("status=0"), "{out}");
        match vm.shutdown().await {
            Err(Error::BlockStore { operation, source }) => {
                assert!(
                    source.to_string().contains("the bucket is gone"),
                    "{operation}: {source}"
                );
            }
            other => panic!("expected the store's failure from shutdown, got {other:?}"),
        }
    });
}

/// A layer made over one image is refused over another by krunbox's own check of the layer's
/// record, even with a store that accepts any base.
#[test]
fn a_cow_layer_made_over_one_image_refuses_another() {
    common::run(async {
        let store = Arc::new(MapStore {
            block_size: 4096,
            blocks: Mutex::default(),
        });
        let vm = cow(BuiltinImage::Busybox, ArcStore(store.clone()))
            .boot()
            .await
            .expect("boot");
        vm.shutdown().await.expect("shutdown");
        match cow(BuiltinImage::Agent, ArcStore(store)).boot().await {
            Err(Error::BlockStore {
                source: StoreError::BaseMismatch { expected, recorded },
                ..
            }) => assert_ne!(expected, recorded),
            other => panic!("expected the other base refused, got {other:?}"),
        }
    });
}

/// A copy-on-write root flattens into a standalone image with its changes: the flattening VM
/// has two disks the library serves at once, the root's layer and the output.
#[test]
fn a_cow_root_flattens_into_an_image_with_its_changes() {
    common::run(async {
        let dir = tempfile::tempdir().unwrap();
        let store = MemoryStore::new();
        let root = Rootfs::cow(Rootfs::builtin(BuiltinImage::Busybox), store, 32 << 20);
        let sandbox = Sandbox::builder()
            .rootfs(root.clone())
            .memory_mib(256)
            .build()
            .expect("sandbox definition");
        let vm = sandbox.boot().await.expect("boot");
        let (out, _) = sh(
            &vm,
            "echo flat > /etc/krunbox-flat && rm /etc/group && sync && echo changed",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "changed\n", "{out}");
        vm.shutdown().await.expect("shutdown");

        // Into a block store of the caller's (issue 35: the design's `flatten` into a store),
        // streamed back out of it into a file, booted from there; `image::bytes` of that root
        // gives the same bytes again.
        let images = krunbox::rootfs::DirectoryStore::open(dir.path().join("images")).unwrap();
        let written = krunbox::image::flatten_into_store(&root, images.clone())
            .await
            .expect("flatten");
        let path = dir.path().join("downloaded.qcow2");
        let mut download = tokio::fs::File::create(&path).await.unwrap();
        let copied = tokio::io::copy(
            &mut krunbox::image::stored_bytes(images, &written),
            &mut download,
        )
        .await
        .expect("the image streamed out of the store, its digest checked");
        drop(download);
        assert_eq!(copied, written.len);
        let image = Rootfs::image(&path, "ext4", &written.sha256);
        let mut streamed = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(
            &mut krunbox::image::bytes(&image).await.unwrap(),
            &mut streamed,
        )
        .await
        .unwrap();
        assert_eq!(streamed, std::fs::read(&path).unwrap());
        let vm = Sandbox::builder()
            .rootfs(image)
            .memory_mib(256)
            .build()
            .unwrap()
            .boot()
            .await
            .expect("boot the flattened image");
        let (out, _) = sh(
            &vm,
            "cat /etc/krunbox-flat; [ -e /etc/group ] || echo gone",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "flat\ngone\n", "{out}");
        vm.shutdown().await.expect("shutdown");
    });
}
