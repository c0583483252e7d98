//! The boundary, tested from both sides with real microVMs: nothing of the host is reachable
//! from the guest, and the VMM helper is confined.
//!
//! A test here plants canaries on the host (files with a random token in them) where a leak
//! would show them, then goes looking for them from inside the guest as root, by every path the
//! guest can name: every virtio-fs device it can mount and every block device it can read.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use krunbox::{BuiltinImage, Instance, Layer, Rootfs, Sandbox};

fn busybox() -> Sandbox {
    Sandbox::builder()
        .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
        .memory_mib(256)
        .build()
        .expect("sandbox definition (run scripts/setup.sh)")
}

async fn sh(vm: &Instance, script: &str) -> krunbox::Output {
    vm.command("sh")
        .args(["-c", script])
        .output()
        .await
        .expect("running sh in the guest")
}

/// A token no image or kernel contains: 128 random bits, hex.
fn token() -> String {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .expect("reading /dev/urandom");
    format!("krunbox-canary-{}", hex(&bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The running instance's directory on the host (control socket, logs, the VMM's
/// configuration): the directory of the configuration file the helper was started with.
fn instance_dir(vm: &Instance) -> PathBuf {
    let pid = vm.vmm_pid().expect("a running VM has a VMM process");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("the helper's cmdline");
    let config = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| PathBuf::from(String::from_utf8_lossy(a).into_owned()))
        .find(|a| a.extension().is_some_and(|e| e == "json"))
        .expect("the helper is started with its configuration file");
    config
        .parent()
        .expect("config in a directory")
        .to_path_buf()
}

/// Plants a canary file in `dir` and every directory below it; returns the files planted.
fn plant(dir: &Path, token: &str, planted: &mut Vec<PathBuf>) {
    let file = dir.join(token);
    std::fs::write(&file, token).expect("planting a canary");
    planted.push(file);
    for entry in std::fs::read_dir(dir).expect("listing the instance directory") {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_dir() {
            plant(&entry.path(), token, planted);
        }
    }
}

/// Removes the canaries even when the test fails.
struct Canaries(Vec<PathBuf>);

impl Drop for Canaries {
    fn drop(&mut self) {
        for file in &self.0 {
            let _ = std::fs::remove_file(file);
        }
    }
}

#[test]
fn the_guest_finds_no_host_file_on_any_device_it_can_reach() {
    common::run(async {
        let vm = busybox().boot().await.unwrap();
        let token = token();
        // Where a shared host directory would be: the instance's own directory (the library
        // builds everything it gives the helper there) and the runtime directory around it.
        let dir = instance_dir(&vm);
        let mut planted = Vec::new();
        plant(&dir, &token, &mut planted);
        let outer = dir.parent().unwrap().join(&token);
        std::fs::write(&outer, &token).unwrap();
        planted.push(outer);
        let _cleanup = Canaries(planted);

        // As root in the guest: mount every virtio-fs tag the kernel knows again, list and
        // search it; read every block device whole.
        let script = format!(
            r#"
            t={token}
            mkdir -p /tmp/v
            for f in /sys/fs/virtiofs/*/tag; do
                tag=$(cat "$f")
                echo "TAG $tag"
                mount -t virtiofs "$tag" /tmp/v || {{ echo "MOUNTFAIL $tag"; continue; }}
                find /tmp/v | sed 's|^/tmp/v|ENTRY |'
                grep -rl "$t" /tmp/v | sed 's|^|HIT |'
                [ -e "/tmp/v/$t" ] && echo "HIT by name on $tag"
                [ -f /tmp/v/init.krun ] && echo "INIT on $tag"
                umount /tmp/v
            done
            for b in /sys/block/*; do
                d=/dev/${{b##*/}}
                [ -b "$d" ] || continue
                echo "BLOCK $d $(grep -c "$t" "$d")"
            done
            "#
        );
        let out = sh(&vm, &script).await;
        let text = out.stdout_text();
        assert!(out.status.success(), "{text}\n{}", out.stderr_text());
        assert!(
            !text.contains("HIT ") && !text.contains("MOUNTFAIL"),
            "the guest reached a host file or could not look:\n{text}"
        );
        // The root device is there and serves guest-init; whatever a listing shows of it is
        // guest-init and its mount points, nothing else.
        assert!(text.contains("INIT on /dev/root"), "{text}");
        let entries: BTreeSet<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("ENTRY "))
            .collect();
        let allowed: BTreeSet<&str> = ["", "/dev", "/proc", "/sys", "/newroot", "/init.krun"]
            .into_iter()
            .collect();
        assert!(entries.is_subset(&allowed), "{text}");
        // At least the root image was read, and no device holds the token.
        let blocks: Vec<&str> = text.lines().filter(|l| l.starts_with("BLOCK ")).collect();
        assert!(!blocks.is_empty(), "no block device was read:\n{text}");
        for line in blocks {
            assert!(
                line.ends_with(" 0"),
                "a block device holds the token: {line}"
            );
        }
        vm.shutdown().await.unwrap();
    });
}

/// A `Name:  value` line of /proc/PID/status.
fn status_field(pid: u32, name: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("{name}:"))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
}

/// What each open descriptor of process `pid` points at.
fn open_descriptors(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
        .map(|p| p.to_string_lossy().into_owned())
        .collect()
}

#[test]
fn the_vmm_helper_is_jailed_and_every_canary_is_blocked() {
    common::run(async {
        // A descriptor this process holds without CLOEXEC (as a caller's C library or a
        // parent's jobserver pipe might): it must not reach the helper, where an open
        // directory would escape any root.
        let leak_dir = tempfile::tempdir().unwrap();
        let path = std::ffi::CString::new(leak_dir.path().to_str().unwrap()).unwrap();
        // SAFETY: opening a directory by a valid C string; closed at the end of the test.
        let leaked = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY) };
        assert!(leaked >= 0);
        // And one more copy at a number the helper's own descriptors leave free: 15, between
        // its fixed descriptors (up to 8) and its filesystem devices' (from 16). Whatever this
        // process had there is kept aside and put back.
        // SAFETY: fcntl/dup2 on descriptor numbers; 15 is restored at the end of the test.
        let in_the_gap = 15;
        let kept = unsafe { libc::fcntl(in_the_gap, libc::F_DUPFD_CLOEXEC, 64) };
        assert_eq!(unsafe { libc::dup2(leaked, in_the_gap) }, in_the_gap);
        // With a mount, so that the helper has a filesystem device's descriptor (16) above 15.
        let vm = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .memory_mib(256)
            .mount("/mnt/empty", krunbox::fs::MemoryFs::new())
            .build()
            .unwrap()
            .boot()
            .await
            .unwrap();
        let isolation = vm.isolation().clone();
        println!("{isolation}");
        // What the helper reports.
        assert_eq!(isolation.canaries().len(), 5, "{isolation}");
        assert!(isolation.breaches().is_empty(), "{isolation}");
        // The layers every host this suite runs on provides (Linux >= 5.13 with Landlock,
        // user namespaces or root). LandlockNetwork/Scope depend on the kernel's ABI.
        // A cgroup of the instance's own needs root (or a delegated subtree): the suite runs as
        // root in its L1; elsewhere the report must at least say why there is none.
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let required: Vec<Layer> = Layer::ALL
            .into_iter()
            .filter(|l| !matches!(l, Layer::LandlockNetwork | Layer::LandlockScope))
            .filter(|l| root || *l != Layer::Cgroup)
            .collect();
        assert!(isolation.missing(&required).is_empty(), "{isolation}");
        if !root {
            let cgroup = isolation.missing(&[Layer::Cgroup]);
            assert!(cgroup.iter().all(|l| !l.detail.is_empty()), "{isolation}");
        }

        // What the kernel says about the running helper, not trusting its report.
        let pid = vm.vmm_pid().unwrap();
        if isolation.is_enforced(Layer::Cgroup) {
            // The VMM is in a cgroup of the instance's own, bounded at the guest's 256 MiB and
            // the default overhead, and at most 512 tasks.
            let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
            let path = own.lines().find_map(|l| l.strip_prefix("0::")).unwrap();
            assert!(path.contains("/krunbox-"), "{own}");
            let dir = format!("/sys/fs/cgroup{path}");
            let read = |file: &str| std::fs::read_to_string(format!("{dir}/{file}")).unwrap();
            let expected = (256u64 << 20) + krunbox::DEFAULT_HOST_MEMORY_OVERHEAD;
            assert_eq!(read("memory.max").trim(), expected.to_string());
            assert_eq!(read("pids.max").trim(), "512");
            let tasks: u64 = read("pids.current").trim().parse().unwrap();
            assert!(tasks > 1 && tasks < 512, "{tasks} tasks");
        }
        assert_eq!(status_field(pid, "NoNewPrivs"), "1");
        assert_eq!(status_field(pid, "Seccomp"), "2", "seccomp filter mode");
        assert_eq!(status_field(pid, "CapEff"), "0000000000000000");
        assert_eq!(status_field(pid, "CapBnd"), "0000000000000000");
        let ns = |p: &str, kind: &str| std::fs::read_link(format!("/proc/{p}/ns/{kind}")).unwrap();
        for kind in ["user", "mnt", "net", "ipc", "uts", "pid"] {
            assert_ne!(
                ns("self", kind),
                ns(&pid.to_string(), kind),
                "{kind} namespace shared"
            );
        }
        // No descriptor of the helper (the VMM, or its parent outside the pid namespace) is
        // the one this process leaked.
        let parent = status_field(pid, "PPid").parse::<u32>().unwrap();
        for p in [pid, parent] {
            let fds = open_descriptors(p);
            assert!(
                !fds.iter()
                    .any(|f| f.as_str() == leak_dir.path().to_str().unwrap()),
                "pid {p} holds the leaked directory: {fds:?}"
            );
        }
        // SAFETY: closing the descriptors opened above, once.
        unsafe {
            libc::close(leaked);
            libc::close(in_the_gap);
            if kept >= 0 {
                libc::dup2(kept, in_the_gap);
                libc::close(kept);
            }
        }
        // Its root holds exactly what libkrun opens.
        let root: BTreeSet<String> = std::fs::read_dir(format!("/proc/{pid}/root"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        let expected: BTreeSet<String> = ["dev", "root.img", "console", "control.sock"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(root, expected);
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
        let limit = |name: &str| {
            limits
                .lines()
                .find(|l| l.starts_with(name))
                .map(|l| {
                    l[name.len()..]
                        .split_whitespace()
                        .next()
                        .unwrap()
                        .to_string()
                })
                .unwrap()
        };
        assert_eq!(limit("Max core file size"), "0");
        assert_eq!(limit("Max open files"), "512");
        // Pid 1 of its own pid namespace: it cannot name any host process.
        assert_eq!(
            status_field(pid, "NSpid").split_whitespace().last(),
            Some("1")
        );

        // And the VM works inside all that.
        let out = sh(&vm, "echo jailed").await;
        assert_eq!(out.stdout_text(), "jailed\n");
        vm.shutdown().await.unwrap();
    });
}

#[test]
fn required_layers_boot_where_the_host_has_them_and_fail_the_boot_where_it_does_not() {
    common::run(async {
        let builder = || {
            Sandbox::builder()
                .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
                .memory_mib(256)
        };
        // What this host gives the helper.
        let vm = builder().build().unwrap().boot().await.unwrap();
        let isolation = vm.isolation().clone();
        vm.shutdown().await.unwrap();
        let (have, lack): (Vec<Layer>, Vec<Layer>) = Layer::ALL
            .iter()
            .partition(|layer| isolation.is_enforced(**layer));
        // Requiring everything the host has boots.
        let vm = builder()
            .require_isolation(have.clone())
            .build()
            .unwrap()
            .boot()
            .await
            .unwrap();
        assert_eq!(sh(&vm, "echo ok").await.stdout_text(), "ok\n");
        vm.shutdown().await.unwrap();
        // Requiring one more it lacks fails before the guest runs, naming it and why. (On a
        // host that has every layer there is nothing to lack; the CI's L1 kernel, Linux 6.1,
        // has Landlock ABI 2 and so no Landlock network rules or scopes.)
        println!("this host lacks: {lack:?}\n{isolation}");
        if let Some(missing_layer) = lack.first().copied() {
            let err = builder()
                .require_isolation(have.iter().copied().chain([missing_layer]))
                .build()
                .unwrap()
                .boot()
                .await
                .unwrap_err();
            match &err {
                krunbox::Error::IsolationUnavailable { missing, isolation } => {
                    assert_eq!(missing.len(), 1, "{err}");
                    assert_eq!(missing[0].layer, missing_layer);
                    assert!(!missing[0].detail.is_empty());
                    // The rest of the jail was still applied and reported.
                    assert!(isolation.missing(&have).is_empty(), "{isolation}");
                    assert!(isolation.breaches().is_empty(), "{isolation}");
                }
                other => panic!("expected IsolationUnavailable, got {other}"),
            }
            let text = err.to_string();
            assert!(
                text.contains(&missing_layer.to_string()) && text.contains("krunbox doctor"),
                "{text}"
            );
        }
    });
}

#[test]
fn the_console_and_the_helpers_log_never_take_more_than_two_generations_on_disk() {
    common::run(async {
        // The smallest bound, so that little console I/O (slow under nested emulation: the
        // console goes out in small chunks) proves it: 64 KiB, two generations of 32 KiB.
        const MAX: u64 = 64 << 10;
        let vm = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .memory_mib(256)
            .console_log_max(MAX)
            .build()
            .unwrap()
            .boot()
            .await
            .unwrap();
        let dir = instance_dir(&vm);
        // The helper's own output (libkrun's log, which a guest can provoke too) is a pipe the
        // library drains into a bounded log the same way, never a file the helper writes
        // itself: that one only its RLIMIT_FSIZE would bound, which a writable root raises to
        // its disk's size. (The drain's bound is unit-tested in src/logs.rs.)
        let pid = vm.vmm_pid().expect("a running VM has a VMM process");
        for fd in [1, 2] {
            let target = std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).unwrap();
            assert!(
                target.to_string_lossy().starts_with("pipe:"),
                "the VMM's fd {fd} is {}, not a pipe",
                target.display()
            );
        }
        // Root in the guest writes 160 KiB to the console, more than twice the bound, ending
        // with a marker line.
        let out = sh(
            &vm,
            "yes 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcde \
             | head -c 163840 >/dev/console; echo console-end-marker >/dev/console",
        )
        .await;
        assert!(out.status.success(), "{}", out.stderr_text());
        // The drain may trail the guest by a moment.
        let log = dir.join("console.log");
        let mut waited = 0;
        while !std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("console-end-marker")
        {
            assert!(waited < 100, "the marker never reached console.log");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            waited += 1;
        }
        let size = |name: &str| {
            std::fs::metadata(dir.join(name))
                .map(|m| m.len())
                .unwrap_or(0)
        };
        let (newer, older) = (size("console.log"), size("console.log.1"));
        assert!(
            older > 0,
            "the log never rotated ({newer} bytes in console.log)"
        );
        assert!(
            newer <= MAX / 2 && older <= MAX / 2,
            "console.log {newer} bytes, console.log.1 {older} bytes"
        );
        // The instance is fine.
        assert_eq!(sh(&vm, "echo ok").await.stdout_text(), "ok\n");
        vm.shutdown().await.unwrap();
    });
}
