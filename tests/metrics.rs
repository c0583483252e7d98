//! `Instance::metrics`: what a real microVM costs the host, read while it runs.

mod common;

use std::time::Duration;

use krunbox::{BuiltinImage, Rootfs, Sandbox};

/// A guest that spins for 2 s of its CPU shows it in the VM's CPU time, and one that fills 200 MiB of
/// its memory shows it in the memory peak; the figures stop once the VM has.
#[test]
fn cpu_time_and_the_memory_peak_show_what_the_guest_did() {
    common::run(async {
        let vm = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .memory_mib(512)
            .build()
            .expect("definition")
            .boot()
            .await
            .expect("boot");
        let before = vm.metrics().unwrap();
        // Busy until the loop itself has had 2 s of the guest's CPU (its own user and system
        // ticks, USER_HZ 100): under nested emulation a guest's wall-clock second is not a
        // second of its vCPU's time on the host, but a second of guest CPU time is at least
        // one of the VMM's.
        let spun = vm
            .command("sh")
            .args([
                "-c",
                "while read -r _ _ _ _ _ _ _ _ _ _ _ _ _ u s _ < /proc/$$/stat; \
                 [ $((u + s)) -lt 200 ]; do :; done",
            ])
            .timeout(Duration::from_secs(60))
            .status()
            .await
            .unwrap();
        assert!(spun.success());
        let after_spin = vm.metrics().unwrap();
        let spent = after_spin.cpu_time.saturating_sub(before.cpu_time);
        assert!(
            spent >= Duration::from_millis(1500),
            "a 2 s busy loop cost {spent:?} of CPU"
        );
        // 200 MiB into the guest's tmpfs: guest memory it had not touched.
        let filled = vm
            .command("sh")
            .args(["-c", "head -c 209715200 /dev/zero > /tmp/fill && sync"])
            .timeout(Duration::from_secs(120))
            .status()
            .await
            .unwrap();
        assert!(filled.success());
        let after_fill = vm.metrics().unwrap();
        assert!(
            after_fill.memory_peak_bytes >= 200 << 20,
            "memory peak {} MiB",
            after_fill.memory_peak_bytes >> 20
        );
        assert!(
            after_fill.memory_peak_bytes >= before.memory_bytes + (180 << 20),
            "the peak grew from {} MiB to {} MiB",
            before.memory_bytes >> 20,
            after_fill.memory_peak_bytes >> 20
        );
        assert!(after_fill.memory_peak_bytes >= after_fill.memory_bytes);
        assert!(after_fill.network.is_none(), "no network");
        let json = serde_json::to_value(&after_fill).unwrap();
        assert!(json["cpu_time"].as_f64().unwrap() >= 1.5, "{json}");
        vm.shutdown().await.unwrap();
        assert!(matches!(
            vm.metrics(),
            Err(krunbox::Error::InstanceGone { .. })
        ));
    });
}
