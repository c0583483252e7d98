//! The boundary, tested from both sides with real microVMs: nothing of the host is reachable
//! from the guest, and the VMM helper is confined.
//!
//! A test here plants canaries on the host (files with a random token in them) where a leak
//! would show them, then goes looking for them from inside the guest as root, by every path the
//! guest can name: every virtio-fs device it can mount and every block device it can read.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use krunbox::{BuiltinImage, Instance, Rootfs, Sandbox};

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
