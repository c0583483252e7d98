//! Boot latency: krunbox `boot()` → first command output, against bare libkrun.
//!
//! The baseline boots the same kernel (libkrunfw) and the same verified busybox image through
//! the same VMM helper, but its init (guest-init's `true-init` example) only mounts the image,
//! runs its `/bin/true` and powers off: a bare libkrun VM running `true` from that rootfs.
//! krunbox's figure adds guest-init's scratch mounts, root switch, the vsock handshake and
//! one `true` round-trip over the control channel. Both are measured here, in the
//! same run, alternating, and the ratio is printed: under nested emulation absolute times mean
//! little, ratios do.
//!
//! The bare VM's moment of running `true` is not visible from outside, only the VM's end, so
//! the ratio compares whole cycles (boot, `true`, stopped); krunbox's boot → first output is
//! printed beside it.
//!
//! Fast starts, in the same run and as ratios to that cold boot → first output: a warm pool's
//! hand-out → first output (goal ≤ 0.05×), beside its floor, the same command on an instance
//! already running; a snapshot's restore → first output and a fork (snapshot, restore) →
//! first output (goals ≤ 0.3×), from an instance that has run the command once (a prepared
//! state, which is what snapshots are taken of). And the host's own work per boot
//! ([`Instance::host_boot_work`]) for the busybox and the agent image: with images sealed after
//! their first hash it must not grow with the image (goal: the same within noise, ≤ 5 ms
//! natively); the time one hash of each image takes is printed beside it, for scale.
//!
//! `KRUNBOX_BENCH_ITERS` sets the iterations per side (default 5).

mod common;

use common::median;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use krunbox::{BuiltinImage, Error, Instance, Pool, Rootfs, Sandbox};

fn true_init(guest_init: &std::path::Path) -> PathBuf {
    let path = guest_init.parent().unwrap().join("examples/true-init");
    assert!(
        path.is_file(),
        "{} missing: cargo build -p guest-init --release --target x86_64-unknown-linux-musl --examples",
        path.display()
    );
    path
}

/// One krunbox VM: (boot → first command output, the whole boot → `true` → stopped cycle, the
/// time the helper spent on its jail and canaries).
async fn krunbox_once(sandbox: &Sandbox) -> (Duration, Duration, Duration) {
    let start = Instant::now();
    let vm = sandbox.boot().await.expect("boot");
    let jail = vm.isolation().setup_time();
    let out = vm.command("true").output().await.expect("true");
    assert!(out.status.success());
    let first_output = start.elapsed();
    vm.shutdown().await.expect("shutdown");
    (first_output, start.elapsed(), jail)
}

/// One hand-out from `pool` → first command output; waits (unmeasured) until the pool is full
/// again first, and shuts the instance down after.
async fn pool_once(pool: &Pool) -> Duration {
    while pool.ready() < 1 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let start = Instant::now();
    let vm = pool.take().await.expect("take");
    let out = vm.command("true").output().await.expect("true");
    assert!(out.status.success());
    let first_output = start.elapsed();
    vm.shutdown().await.expect("shutdown");
    first_output
}

/// The host's work in booting `image` (median of `iters` boots after one unmeasured boot that
/// seals it), and how long one SHA-256 of the image takes.
async fn host_work(image: BuiltinImage, iters: usize) -> (Duration, Duration) {
    let sandbox = Sandbox::builder()
        .rootfs(Rootfs::builtin(image))
        .memory_mib(512)
        .build()
        .unwrap();
    let boot = || async {
        let vm: Instance = sandbox.boot().await.expect("boot");
        let work = vm.host_boot_work();
        vm.shutdown().await.expect("shutdown");
        work
    };
    boot().await;
    let mut work = Vec::new();
    for _ in 0..iters {
        work.push(boot().await);
    }
    let path = krunbox_rootfs::image_path(&krunbox::cache_dir(), image);
    let start = Instant::now();
    let mut hasher = <sha2::Sha256 as sha2::Digest>::new();
    std::io::copy(&mut std::fs::File::open(&path).unwrap(), &mut hasher).unwrap();
    let _ = sha2::Digest::finalize(hasher);
    (median(work), start.elapsed())
}

/// One bare VM: boot → `/bin/true` → stopped (the helper process has exited).
async fn bare_once(sandbox: &Sandbox) -> Duration {
    let start = Instant::now();
    match sandbox.boot().await {
        // The bare init never says hello: the VM powering off ends the boot attempt.
        Err(Error::VmExited { console_tail, .. }) => {
            let elapsed = start.elapsed();
            assert!(
                console_tail.contains("true-init: /bin/true from the root image: exit status: 0"),
                "the bare VM did not run /bin/true: {console_tail}"
            );
            elapsed
        }
        other => panic!("the bare VM should run /bin/true and power off, got {other:?}"),
    }
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs us once as a smoke test.
    let smoke = !std::env::args().any(|a| a == "--bench");
    let iters: usize = if smoke {
        1
    } else {
        std::env::var("KRUNBOX_BENCH_ITERS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(5)
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let rootfs = Rootfs::builtin(BuiltinImage::Busybox);
        let ours = Sandbox::builder()
            .rootfs(rootfs.clone())
            .memory_mib(256)
            .build()
            .unwrap();
        let bare = Sandbox::builder()
            .rootfs(rootfs)
            .memory_mib(256)
            .guest_init(true_init(&ours.artifacts().guest_init))
            .build()
            .unwrap();
        // Warm the page cache and the image build once, unmeasured.
        krunbox_once(&ours).await;

        let (mut first, mut cycle, mut bare_cycle) = (Vec::new(), Vec::new(), Vec::new());
        let mut jail = Vec::new();
        for _ in 0..iters {
            bare_cycle.push(bare_once(&bare).await);
            let (f, c, j) = krunbox_once(&ours).await;
            first.push(f);
            cycle.push(c);
            jail.push(j);
        }
        let (first, cycle, bare) = (median(first), median(cycle), median(bare_cycle));
        let jail = median(jail);
        // The bare VM's moment of running `true` cannot be seen from outside, only its end;
        // so the ratio compares whole cycles (boot, `true`, stopped), like for like.
        println!("boot/krunbox-first-output        median {first:>10.3?}  ({iters} runs)");
        println!("boot/krunbox-boot-true-stopped   median {cycle:>10.3?}  ({iters} runs)");
        println!("boot/bare-libkrun-true-stopped   median {bare:>10.3?}  ({iters} runs)");
        println!(
            "boot/ratio krunbox / bare        {:.2}x",
            cycle.as_secs_f64() / bare.as_secs_f64()
        );
        // Both sides run in the jailed helper, so the ratio above does not show what the jail
        // costs; the helper times it (namespaces, empty root, limits, Landlock, seccomp,
        // canaries). Goal: at most 5% of the cycle.
        println!("boot/jail-and-canaries           median {jail:>10.3?}  ({iters} runs)");
        println!(
            "boot/ratio jail / krunbox cycle  {:.3}x",
            jail.as_secs_f64() / cycle.as_secs_f64()
        );

        // The floor of any fast start: the same command on an instance already running.
        let running = ours.boot().await.expect("boot");
        let mut warm = Vec::new();
        for _ in 0..iters {
            let start = Instant::now();
            assert!(running.command("true").status().await.expect("true").success());
            warm.push(start.elapsed());
        }
        running.shutdown().await.expect("shutdown");
        let warm = median(warm);
        println!("boot/running-instance-output     median {warm:>10.3?}  ({iters} runs)");

        // A warm pool: its hand-out → first output against the cold boot → first output above.
        let pool = Pool::new(&ours, 1).expect("pool");
        let mut handed_out = Vec::new();
        for _ in 0..iters {
            handed_out.push(pool_once(&pool).await);
        }
        pool.shutdown().await;
        let handed_out = median(handed_out);
        println!("boot/pool-first-output           median {handed_out:>10.3?}  ({iters} runs)");
        println!(
            "boot/ratio pool / cold boot      {:.3}x  (goal <= 0.05x)",
            handed_out.as_secs_f64() / first.as_secs_f64()
        );

        // Restore and fork: from a snapshot of a booted instance of the same image, against the
        // cold boot → first output above.
        let keys = tempfile::tempdir().expect("tempdir");
        let snapshottable = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .memory_mib(256)
            .snapshots(true)
            .snapshot_key_dir(keys.path())
            .build()
            .unwrap();
        let source = snapshottable.boot().await.expect("boot");
        // What a snapshot is for: a prepared state. Here the instance has run the command the
        // restores and forks then run (its binary is in the guest's page cache, as a prepared
        // tool's would be); the cold boot reads it from the image.
        assert!(source.command("true").status().await.expect("true").success());
        let place = tempfile::tempdir().expect("tempdir");
        let start = Instant::now();
        let snapshot = source
            .snapshot(place.path().join("snap"))
            .await
            .expect("snapshot");
        println!("boot/snapshot-taken              once   {:>10.3?}", start.elapsed());
        let (mut restored, mut forked) = (Vec::new(), Vec::new());
        for _ in 0..iters {
            let start = Instant::now();
            let vm = snapshottable.restore(&snapshot).await.expect("restore");
            assert!(vm.command("true").status().await.expect("true").success());
            restored.push(start.elapsed());
            vm.shutdown().await.expect("shutdown");
            let start = Instant::now();
            let fork = source.fork(1).await.expect("fork").remove(0);
            assert!(fork.command("true").status().await.expect("true").success());
            forked.push(start.elapsed());
            fork.shutdown().await.expect("shutdown");
        }
        source.shutdown().await.expect("shutdown");
        let (restored, forked) = (median(restored), median(forked));
        println!("boot/restore-first-output        median {restored:>10.3?}  ({iters} runs)");
        println!(
            "boot/ratio restore / cold boot   {:.3}x  (goal <= 0.3x)",
            restored.as_secs_f64() / first.as_secs_f64()
        );
        println!("boot/fork-first-output           median {forked:>10.3?}  ({iters} runs)");
        println!(
            "boot/ratio fork / cold boot      {:.3}x  (goal <= 0.3x)",
            forked.as_secs_f64() / first.as_secs_f64()
        );

        // The host's own work per boot, for a small and a large image.
        for image in [BuiltinImage::Busybox, BuiltinImage::Agent] {
            let (work, hash) = host_work(image, iters).await;
            let name = format!("boot/host-work-{}", image.name());
            println!("{name:<32} median {work:>10.3?}  ({iters} runs; one hash of the image: {hash:.3?})");
        }
    });
}
