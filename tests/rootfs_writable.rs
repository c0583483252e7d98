//! Writable roots: an image made writable for one boot (`Rootfs::ephemeral`), its changes on a
//! layer in host memory. Every VM test boots its own VM; each writes as little as proves its
//! point (the nested emulation these run under faults more the more a guest writes).

mod common;
#[allow(dead_code)] // only `sh` is used here
#[path = "common/guest.rs"]
mod guest;

use std::time::Duration;

use krunbox::{BuiltinImage, Error, Rootfs, Sandbox};

use guest::sh;

const TIMEOUT: Duration = Duration::from_secs(120);

fn ephemeral(max_dirty_bytes: u64) -> Sandbox {
    Sandbox::builder()
        .rootfs(Rootfs::ephemeral(
            Rootfs::builtin(BuiltinImage::Busybox),
            max_dirty_bytes,
        ))
        .memory_mib(256)
        .build()
        .expect("sandbox definition (run scripts/setup.sh)")
}

/// Writes land anywhere in the root (`/etc`, `/usr`, `/root`, which a read-only image gives a
/// tmpfs), are read back, take host memory on the layer, and are gone at the next boot of the
/// same definition, which starts from the image again.
#[test]
fn an_ephemeral_root_takes_writes_everywhere_and_forgets_them_at_the_next_boot() {
    common::run(async {
        let sandbox = ephemeral(64 << 20);
        let vm = sandbox.boot().await.expect("boot");
        let fresh = vm.root_usage().expect("a writable root reports its usage");
        assert_eq!(fresh.max_bytes, 64 << 20);
        let (out, _) = sh(
            &vm,
            "set -e
             echo etc > /etc/krunbox-written
             mkdir -p /usr/local/krunbox && echo usr > /usr/local/krunbox/f
             mkdir -p /root && echo home > /root/f
             dd if=/dev/zero of=/usr/local/krunbox/big bs=1048576 count=4 2>/dev/null
             sync
             cat /etc/krunbox-written /usr/local/krunbox/f /root/f
             grep -c ' /root tmpfs' /proc/mounts || true",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "etc\nusr\nhome\n0\n", "{out}");
        let used = vm.root_usage().unwrap();
        assert!(
            used.held_bytes >= fresh.held_bytes + (4 << 20),
            "4 MiB written, but the layer went from {} to {} bytes",
            fresh.held_bytes,
            used.held_bytes
        );
        vm.shutdown().await.expect("shutdown");

        let again = sandbox.boot().await.expect("second boot");
        let (out, _) = sh(
            &again,
            "for f in /etc/krunbox-written /usr/local/krunbox/f /root/f; do
               [ -e $f ] && echo \"$f survived\"
             done; echo checked",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "checked\n", "{out}");
        again.shutdown().await.expect("shutdown");
    });
}

/// A guest that writes past the quota gets ENOSPC from its own filesystem and keeps running;
/// the host memory the layer holds never passes the quota.
#[test]
fn an_ephemeral_root_that_fills_up_gets_enospc_and_host_memory_stays_within_the_quota() {
    common::run(async {
        let quota = 24 << 20;
        let vm = ephemeral(quota).boot().await.expect("boot");
        let (out, _) = sh(
            &vm,
            "dd if=/dev/zero of=/fill bs=1048576 count=48 2>&1; echo \"dd=$?\"; sync
             rm /fill && echo removed",
            TIMEOUT,
        )
        .await;
        assert!(out.contains("No space left on device"), "{out}");
        assert!(out.contains("dd=1"), "{out}");
        assert!(out.ends_with("removed\n"), "the guest went on: {out}");
        let usage = vm.root_usage().unwrap();
        assert_eq!(usage.max_bytes, quota);
        assert!(
            usage.held_bytes <= quota,
            "the layer holds {} bytes, past its quota of {quota}",
            usage.held_bytes
        );
        assert!(
            usage.held_bytes >= quota / 2,
            "the guest filled its root, yet the layer holds only {} bytes",
            usage.held_bytes
        );
        vm.shutdown().await.expect("shutdown");
    });
}

/// A writable root over another writable root, or with a quota out of bounds, is refused when
/// the sandbox is built, before anything boots.
#[test]
fn bad_writable_roots_are_refused_when_built() {
    let base = || Rootfs::builtin(BuiltinImage::Busybox);
    for rootfs in [
        Rootfs::ephemeral(base(), Rootfs::MIN_DIRTY_BYTES - 1),
        Rootfs::ephemeral(base(), Rootfs::MAX_DIRTY_BYTES + 1),
        Rootfs::ephemeral(Rootfs::ephemeral(base(), 64 << 20), 64 << 20),
    ] {
        match Sandbox::builder().rootfs(rootfs.clone()).build() {
            Err(Error::InvalidConfig(message)) => {
                assert!(message.contains("writable root"), "{message}")
            }
            other => panic!("{rootfs:?} was not refused: {other:?}"),
        }
    }
}
