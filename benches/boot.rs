//! Boot latency: krunbox `boot()` → first command output, against bare libkrun.
//!
//! The baseline boots the same kernel (libkrunfw) and the same verified busybox image through
//! the same VMM helper, but its init (`poweroff-init`) powers off at once: the cost of a bare
//! libkrun VM running a program that does nothing. krunbox's figure adds guest-init's mounts,
//! root switch, the vsock handshake and one `true` round-trip. Both are measured here, in the
//! same run, alternating, and the ratio is printed: under nested emulation absolute times mean
//! little, ratios do.
//!
//! `KRUNBOX_BENCH_ITERS` sets the iterations per side (default 5).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use krunbox::{BuiltinImage, Error, Rootfs, Sandbox};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn poweroff_init(guest_init: &std::path::Path) -> PathBuf {
    let path = guest_init.parent().unwrap().join("examples/poweroff-init");
    assert!(
        path.is_file(),
        "{} missing: cargo build -p guest-init --release --target x86_64-unknown-linux-musl --examples",
        path.display()
    );
    path
}

async fn krunbox_once(sandbox: &Sandbox) -> Duration {
    let start = Instant::now();
    let vm = sandbox.boot().await.expect("boot");
    let out = vm.command("true").output().await.expect("true");
    assert!(out.status.success());
    let elapsed = start.elapsed();
    vm.shutdown().await.expect("shutdown");
    elapsed
}

async fn bare_once(sandbox: &Sandbox) -> Duration {
    let start = Instant::now();
    match sandbox.boot().await {
        // The bare init never says hello: the VM powering off ends the boot attempt.
        Err(Error::VmExited { .. }) => start.elapsed(),
        other => panic!("the bare VM should power off at once, got {other:?}"),
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
            .guest_init(poweroff_init(&ours.artifacts().guest_init))
            .build()
            .unwrap();
        // Warm the page cache and the image build once, unmeasured.
        krunbox_once(&ours).await;

        let (mut k, mut b) = (Vec::new(), Vec::new());
        for _ in 0..iters {
            b.push(bare_once(&bare).await);
            k.push(krunbox_once(&ours).await);
        }
        let (k, b) = (median(k), median(b));
        println!("boot/bare-libkrun-true      median {b:>10.3?}  ({iters} runs)");
        println!("boot/krunbox-first-output   median {k:>10.3?}  ({iters} runs)");
        println!(
            "boot/ratio krunbox / bare   {:.2}x",
            k.as_secs_f64() / b.as_secs_f64()
        );
    });
}
