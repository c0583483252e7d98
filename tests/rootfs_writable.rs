//! Writable roots: an image made writable for one boot (`Rootfs::ephemeral`), its changes on a
//! layer in host memory, or across boots (`Rootfs::persistent`), its changes in a qcow2 file. Every VM test boots its own VM; each writes as little as proves its
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

fn persistent(base: BuiltinImage, path: &std::path::Path) -> Sandbox {
    Sandbox::builder()
        .rootfs(Rootfs::persistent(Rootfs::builtin(base), path))
        .memory_mib(if base == BuiltinImage::Agent {
            512
        } else {
            256
        })
        .build()
        .expect("sandbox definition (run scripts/setup.sh)")
}

/// A persistent root keeps what the guest wrote for the next boot; while one sandbox runs on
/// the layer a second boot is refused; after a clean shutdown the file is a clean qcow2 by
/// qemu's own checker.
#[test]
fn a_persistent_root_keeps_its_changes_and_serves_one_sandbox_at_a_time() {
    common::run(async {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("root.qcow2");
        let sandbox = persistent(BuiltinImage::Busybox, &path);
        let vm = sandbox.boot().await.expect("first boot");
        let (out, _) = sh(
            &vm,
            "echo kept > /etc/krunbox-kept && mkdir -p /opt/tool && echo v1 > /opt/tool/version
             rm -f /etc/resolv.conf; echo written",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "written\n", "{out}");
        match sandbox.boot().await {
            Err(Error::RootInUse { path: refused }) => assert_eq!(refused, path),
            Ok(_) => panic!("a second sandbox booted on a layer in use"),
            Err(other) => panic!("a second boot failed otherwise: {other}"),
        }
        // The same file by another name (a symlink to it): the lock is the file's, not the
        // name's (issue 35).
        let alias = dir.path().join("alias.qcow2");
        std::os::unix::fs::symlink(&path, &alias).unwrap();
        match persistent(BuiltinImage::Busybox, &alias).boot().await {
            Err(Error::RootInUse { .. }) => {}
            Ok(_) => panic!("a second sandbox booted on a layer in use through a symlink"),
            Err(other) => panic!("a boot through a symlink failed otherwise: {other}"),
        }
        vm.shutdown().await.expect("shutdown");

        let vm = sandbox.boot().await.expect("second boot");
        let (out, _) = sh(
            &vm,
            "cat /etc/krunbox-kept /opt/tool/version; [ -e /etc/resolv.conf ] || echo deleted",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "kept\nv1\ndeleted\n", "{out}");
        vm.shutdown().await.expect("shutdown");
        assert_qcow2_is_clean(&path);
    });
}

/// Masked host directories (issue 35; the reference suite's sandbox-api #22, #23 and #40): a
/// read-only project whose `.git` and `node_modules` the guest does not see; a writable one
/// whose masked paths are served from a storage directory inside its own masked `.kc`, which
/// also holds the boot's persistent root, never visible to the guest. The guest's entries at
/// masked paths land in the storage and the source's stay as they were.
#[test]
fn masked_host_directories_hide_their_paths_and_keep_the_guests_entries_in_storage() {
    use krunbox::fs::{HostDir, Mask};
    common::run(async {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("project");
        for sub in [
            "node_modules",
            ".git",
            "packages/a/node_modules",
            ".kc/mounts/ws",
        ] {
            std::fs::create_dir_all(source.join(sub)).unwrap();
        }
        std::fs::write(source.join("node_modules/lower.txt"), "lower\n").unwrap();
        std::fs::write(source.join(".git/config"), "lower-git\n").unwrap();
        std::fs::write(source.join("packages/a/node_modules/lower.txt"), "lower\n").unwrap();
        std::fs::write(source.join("visible.txt"), "visible\n").unwrap();
        let storage = source.join(".kc/mounts/ws");
        std::fs::write(storage.join("preexisting"), "upper\n").unwrap();
        std::fs::write(source.join("preexisting"), "lower\n").unwrap();

        let read_only = HostDir::read_only(&source)
            .unwrap()
            .with_mask(Mask::hide(["/node_modules", "/.git", "/.kc"]))
            .unwrap();
        let masked = [
            "/.kc",
            "/node_modules",
            "/packages/a/node_modules",
            "/preexisting",
        ];
        let writable = HostDir::new(&source)
            .unwrap()
            .with_mask(Mask::hide(masked).stored_in(&storage))
            .unwrap();
        let layer = source.join(".kc/root.qcow2");
        let vm = Sandbox::builder()
            .rootfs(Rootfs::persistent(
                Rootfs::builtin(BuiltinImage::Busybox),
                &layer,
            ))
            .memory_mib(256)
            .mount("/tmp/ro", read_only)
            .mount("/tmp/ws", writable)
            .build()
            .expect("sandbox definition (run scripts/setup.sh)")
            .boot()
            .await
            .expect("boot");
        let (out, _) = sh(
            &vm,
            "set -e
             cat /tmp/ro/visible.txt
             test ! -e /tmp/ro/node_modules && test ! -e /tmp/ro/.git
             ls -a /tmp/ro | tr '\\n' ' '; echo
             ls -a /tmp/ws | tr '\\n' ' '; echo
             cat /tmp/ws/preexisting
             test ! -e /tmp/ws/.kc && test ! -e /tmp/ws/packages/a/node_modules
             if (echo x > /tmp/ws/node_modules/child.txt) 2>/dev/null; then echo made-without-parent; fi
             mkdir /tmp/ws/node_modules /tmp/ws/packages/a/node_modules
             echo child > /tmp/ws/node_modules/child.txt
             echo pkg > /tmp/ws/packages/a/node_modules/pkg.txt
             ln /tmp/ws/node_modules/child.txt /tmp/ws/node_modules/link.txt
             if mv /tmp/ws/packages /tmp/ws/moved 2>/dev/null; then echo moved; fi
             cat /tmp/ws/node_modules/link.txt /tmp/ws/packages/a/node_modules/pkg.txt
             test ! -e /tmp/ws/.kc && echo done",
            TIMEOUT,
        )
        .await;
        vm.shutdown().await.expect("shutdown");
        assert_eq!(
            out,
            "visible\n. .. packages preexisting visible.txt \n. .. .git packages preexisting visible.txt \n\
             upper\nchild\npkg\ndone\n",
            "{out}"
        );
        let read = |path: &std::path::Path| std::fs::read_to_string(path).unwrap();
        // The guest's entries are in the storage; the source's masked ones are untouched.
        assert_eq!(read(&storage.join("node_modules/link.txt")), "child\n");
        assert_eq!(
            read(&storage.join("packages/a/node_modules/pkg.txt")),
            "pkg\n"
        );
        assert_eq!(read(&source.join("node_modules/lower.txt")), "lower\n");
        assert_eq!(
            read(&source.join("packages/a/node_modules/lower.txt")),
            "lower\n"
        );
        assert_eq!(read(&source.join("preexisting")), "lower\n");
        assert!(!source.join("node_modules/child.txt").exists());
        assert!(
            source.join("packages/a").is_dir(),
            "a directory on the way to a mask stays"
        );
        assert_qcow2_is_clean(&layer);
    });
}

/// A layer made over one image is refused over another, before anything boots.
#[test]
fn a_persistent_root_made_over_one_image_refuses_another() {
    common::run(async {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("root.qcow2");
        let vm = persistent(BuiltinImage::Busybox, &path)
            .boot()
            .await
            .expect("boot over busybox");
        vm.shutdown().await.expect("shutdown");
        match persistent(BuiltinImage::Agent, &path).boot().await {
            Err(Error::RootBaseMismatch {
                expected, recorded, ..
            }) => assert_ne!(expected, recorded),
            Ok(_) => panic!("a layer made over busybox booted over the agent image"),
            Err(other) => panic!("refused otherwise: {other}"),
        }
    });
}

/// The durability claim: a VMM killed while the guest writes leaves a layer file that checks
/// clean and boots again, its journal replayed, with what the guest synced before the kill.
#[test]
fn a_persistent_root_keeps_what_was_synced_when_its_vmm_is_killed_mid_write() {
    common::run(async {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("root.qcow2");
        let sandbox = persistent(BuiltinImage::Busybox, &path);
        let vm = sandbox.boot().await.expect("boot");
        let (out, _) = sh(
            &vm,
            "echo durable > /etc/durable && sync /etc/durable && echo synced",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "synced\n", "{out}");
        // Writes in flight: a writer that keeps going, then the VMM killed under it.
        let writer = vm
            .command("sh")
            .args([
                "-c",
                "i=0; while :; do dd if=/dev/zero of=/churn-$i bs=65536 count=64 2>/dev/null; i=$((i+1)); done",
            ])
            .spawn()
            .await
            .expect("start the writer");
        let (out, _) = sh(&vm, "sleep 2; ls / | grep -c churn", TIMEOUT).await;
        assert!(
            out.trim().parse::<u32>().unwrap_or(0) >= 1,
            "no writes yet: {out}"
        );
        let pid = vm.vmm_pid().expect("the VMM runs") as i32;
        // SAFETY: a signal to the VMM process this test's instance started.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        drop(writer);
        vm.shutdown()
            .await
            .expect("the instance notices its VMM is gone");
        assert!(vm.vmm_pid().is_none());

        assert_qcow2_is_clean(&path);

        let vm = sandbox.boot().await.expect("boot after the kill");
        let (out, _) = sh(
            &vm,
            "cat /etc/durable; echo x > /etc/after && echo writable",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "durable\nwritable\n", "{out}");
        vm.shutdown().await.expect("shutdown");
    });
}

/// `qemu-img check` (qemu's own checker) finds the qcow2 at `path` clean: no corruption, no
/// leaked clusters (exit status 0).
fn assert_qcow2_is_clean(path: &std::path::Path) {
    let check = std::process::Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(path)
        .output()
        .expect("qemu-img (Debian's qemu-utils; scripts/setup.sh installs it)");
    assert!(
        check.status.success(),
        "exit {:?}: {}{}",
        check.status.code(),
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
}

/// `flatten` merges a persistent root (a file added, a file of the image deleted) into one
/// standalone qcow2 that `qemu-img check` finds clean and that boots on its own, read-only,
/// with the changes and without the deleted file; and boots with libkrun alone as well.
#[test]
fn a_flattened_persistent_root_boots_alone_with_its_changes() {
    common::run(async {
        let dir = tempfile::tempdir().unwrap();
        let layer = dir.path().join("root.qcow2");
        let root = Rootfs::persistent(Rootfs::builtin(BuiltinImage::Busybox), &layer);
        let vm = persistent(BuiltinImage::Busybox, &layer)
            .boot()
            .await
            .expect("boot");
        let (out, _) = sh(
            &vm,
            "echo flat > /etc/flat && rm /bin/true && echo changed",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "changed\n", "{out}");
        vm.shutdown().await.expect("shutdown");

        let flat = krunbox::image::flatten(&root, dir.path().join("flat.qcow2"))
            .await
            .expect("flatten");
        assert_eq!(flat.sha256.len(), 64);
        assert_qcow2_is_clean(&flat.path);
        let vm = Sandbox::builder()
            .rootfs(flat.rootfs())
            .memory_mib(256)
            .build()
            .unwrap()
            .boot()
            .await
            .expect("boot the flattened image");
        let (out, _) = sh(
            &vm,
            "cat /etc/flat; [ -e /bin/true ] && echo present || echo gone; \
             touch /etc/new 2>&1 | grep -c 'Read-only'",
            TIMEOUT,
        )
        .await;
        assert_eq!(out, "flat\ngone\n1\n", "{out}");
        vm.shutdown().await.expect("shutdown");

        // And with libkrun alone: its own init mounts the image as the root.
        let out = boot_with_plain_libkrun(
            &flat.path,
            "cat /etc/flat; [ -e /bin/true ] && echo present || echo gone; echo plain-$((6 * 7))",
        )
        .await;
        let lines: Vec<&str> = out.lines().map(str::trim_end).collect();
        for expected in ["flat", "gone", "plain-42"] {
            assert!(lines.contains(&expected), "no line {expected:?} in:\n{out}");
        }
        assert!(!lines.contains(&"present"), "{out}");
    });
}

/// Boots `image` (a qcow2 of ext4) with `tests/plain-libkrun`, a program linking only the
/// crates.io libkrun with its own init, and returns the console's output of `sh -c SCRIPT`.
async fn boot_with_plain_libkrun(image: &std::path::Path, script: &str) -> String {
    // Built by scripts/setup.sh into the workspace's target directory, beside the test binary's.
    let program = std::env::current_exe()
        .unwrap()
        .parent()
        .and_then(|deps| deps.parent())
        .unwrap()
        .join("libkrun-plain-boot");
    let libkrunfw = krunbox::Artifacts::locate()
        .expect("artifacts (run scripts/setup.sh)")
        .libkrunfw_dir;
    let mut child = tokio::process::Command::new(&program)
        .arg(image)
        .args(["/bin/sh", "-c", script])
        .env("LD_LIBRARY_PATH", libkrunfw)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (scripts/setup.sh builds it from tests/plain-libkrun)",
                program.display()
            )
        });
    let (mut stdout, mut stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let run = async {
        use tokio::io::AsyncReadExt;
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let (a, b) = tokio::join!(stdout.read_to_end(&mut out), stderr.read_to_end(&mut err));
        a.and(b)?;
        Ok::<_, std::io::Error>((out, err, child.wait().await?))
    };
    // On a timeout the child is dropped, and killed (kill_on_drop).
    let (out, err, status) = tokio::time::timeout(TIMEOUT, run)
        .await
        .expect("the plain libkrun guest did not finish in time")
        .expect("reading its output");
    let (out, err) = (String::from_utf8_lossy(&out), String::from_utf8_lossy(&err));
    assert!(
        !err.contains("libkrun-plain-boot:"),
        "libkrun refused the configuration ({status}): {err}"
    );
    // Its log too, for the assertions' messages (it is never the lines they look for).
    format!("{out}\n(stderr, {status}:)\n{err}")
}
