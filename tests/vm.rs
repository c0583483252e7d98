//! Integration tests that boot real libkrun microVMs.
//!
//! Nothing here is mocked: each test boots (or shares) a real VM running the real guest-init.
//! On a host whose KVM cannot boot guests these tests fail — the test command runs them inside
//! the nested L1 harness there (scripts/test.sh), never skips them.
//!
//! Independent checks share one booted busybox VM (a boot under nested emulation costs
//! seconds); tests about the VM itself boot their own.

mod common;
#[path = "common/kernel.rs"]
mod kernel;

use std::time::{Duration, Instant};

use krunbox::protocol::{ExecErrorKind, ProtocolError};
use krunbox::{BuiltinImage, Error, Instance, Kernel, KernelFormat, Rootfs, Sandbox};
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;
use tokio::sync::OnceCell;

fn busybox_builder() -> krunbox::SandboxBuilder {
    Sandbox::builder()
        .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
        .memory_mib(256)
}

fn busybox() -> Sandbox {
    busybox_builder().build().expect("sandbox definition (are guest-init, krunbox-vmm and libkrunfw built? run scripts/setup.sh)")
}

async fn shared_vm() -> &'static Instance {
    static VM: OnceCell<Instance> = OnceCell::const_new();
    VM.get_or_init(|| async {
        busybox()
            .boot()
            .await
            .expect("booting the shared busybox VM")
    })
    .await
}

async fn sh(vm: &Instance, script: &str) -> krunbox::Output {
    vm.command("sh")
        .args(["-c", script])
        .output()
        .await
        .expect("running sh in the guest")
}

#[test]
fn exit_codes_are_reported() {
    common::run(async {
        let vm = shared_vm().await;
        for code in [0, 1, 7, 255] {
            let out = sh(vm, &format!("exit {code}")).await;
            assert_eq!(out.status.code(), Some(code), "{:?}", out);
            assert_eq!(out.status.success(), code == 0);
            assert!(!out.status.timed_out());
        }
    });
}

#[test]
fn a_process_killed_by_sigkill_reports_the_signal() {
    common::run(async {
        let out = sh(shared_vm().await, "kill -9 $$").await;
        assert_eq!(out.status.signal(), Some(libc::SIGKILL), "{:?}", out.status);
        assert_eq!(out.status.code(), None);
    });
}

#[test]
fn stdout_and_stderr_stay_separate() {
    common::run(async {
        let out = sh(
            shared_vm().await,
            "echo to-out; echo to-err >&2; echo more-out",
        )
        .await;
        assert_eq!(out.stdout_text(), "to-out\nmore-out\n");
        assert_eq!(out.stderr_text(), "to-err\n");
    });
}

#[test]
fn the_host_environment_does_not_leak_into_the_guest() {
    std::env::set_var("KRUNBOX_TEST_HOST_SECRET", "host-only-value");
    common::run(async {
        // A VM of its own, booted after the variable is set: every path it could take (the
        // VMM helper's environment, the kernel command line, guest-init's) exists already.
        let vm = busybox().boot().await.unwrap();
        let out = vm
            .command("sh")
            .args([
                "-c",
                "env; echo ---; tr '\\0' '\\n' < /proc/1/environ; cat /proc/cmdline",
            ])
            .env("GIVEN", "explicitly")
            .output()
            .await
            .unwrap();
        let env = out.stdout_text();
        assert!(out.status.success(), "{env}{}", out.stderr_text());
        // What was looked at really is there: guest-init's environment and the command line.
        assert!(env.contains("init=/init.krun"), "{env}");
        assert!(
            !env.contains("KRUNBOX_TEST_HOST_SECRET"),
            "host variable leaked: {env}"
        );
        assert!(!env.contains("host-only-value"), "host value leaked: {env}");
        assert!(env.contains("GIVEN=explicitly"), "{env}");
        assert!(
            env.contains("PATH="),
            "the guest default PATH is set: {env}"
        );
        vm.shutdown().await.unwrap();
    });
}

#[test]
fn working_directory_uid_and_gid_apply() {
    common::run(async {
        let vm = shared_vm().await;
        let out = vm
            .command("pwd")
            .current_dir("/tmp")
            .output()
            .await
            .unwrap();
        assert_eq!(out.stdout_text(), "/tmp\n");
        let out = vm
            .command("sh")
            .args(["-c", "id -u; id -g"])
            .uid(65534)
            .gid(65533)
            .output()
            .await
            .unwrap();
        assert_eq!(out.stdout_text(), "65534\n65533\n");
        // A missing working directory is a typed error, not a silent fallback.
        match vm.command("pwd").current_dir("/no/such/dir").output().await {
            Err(Error::Exec { kind, message, .. }) => {
                assert_eq!(kind, ExecErrorKind::NotFound);
                assert!(message.contains("/no/such/dir"), "{message}");
            }
            other => panic!("expected an Exec error, got {other:?}"),
        }
    });
}

#[test]
fn a_missing_program_is_a_typed_not_found_error() {
    common::run(async {
        match shared_vm().await.command("/no/such/program").output().await {
            Err(Error::Exec { kind, .. }) => assert_eq!(kind, ExecErrorKind::NotFound),
            other => panic!("expected Exec NotFound, got {other:?}"),
        }
    });
}

#[test]
fn stdout_of_several_windows_arrives_intact() {
    common::run(async {
        // Four output windows and a few bytes: every credit round trip and a partial last
        // frame are crossed; more volume proves nothing more (benches/exec.rs measures it).
        let out = sh(
            shared_vm().await,
            "head -c 4194307 /dev/urandom > /tmp/blob && sha256sum /tmp/blob >&2 && cat /tmp/blob && rm /tmp/blob",
        )
        .await;
        assert!(out.status.success(), "{}", out.stderr_text());
        assert_eq!(out.stdout.len(), 4 * 1024 * 1024 + 3);
        let host_digest = hex::encode(Sha256::digest(&out.stdout));
        let guest_digest = out.stderr_text();
        assert_eq!(
            guest_digest.split_whitespace().next(),
            Some(host_digest.as_str()),
            "guest and host disagree on the stream's SHA-256"
        );
    });
}

/// Asserts that the guest process whose pid `pidfile` holds has ended; the file must exist
/// (a process that never wrote it proves nothing).
async fn assert_gone(vm: &Instance, pidfile: &str, what: &str) {
    let script = format!(
        "test -s {pidfile} || echo no-pidfile; \
         kill -0 $(cat {pidfile}) 2>/dev/null && echo alive || echo gone"
    );
    assert_eq!(sh(vm, &script).await.stdout_text(), "gone\n", "{what}");
}

#[test]
fn a_timeout_kills_the_process_group_and_reports_124() {
    common::run(async {
        let vm = shared_vm().await;
        let started = Instant::now();
        // The grandchild `sleep` writes its pid first so we can check it is gone afterwards.
        let out = vm
            .command("sh")
            .args(["-c", "sleep 300 & echo $! > /tmp/grandchild; wait"])
            .timeout(Duration::from_secs(2))
            .output()
            .await
            .unwrap();
        assert!(out.status.timed_out(), "{:?}", out.status);
        assert_eq!(out.status.code(), Some(124));
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the timeout took {:?}",
            started.elapsed()
        );
        assert_gone(
            vm,
            "/tmp/grandchild",
            "the backgrounded grandchild survived",
        )
        .await;
    });
}

#[test]
fn a_timeout_also_bounds_output_held_open_after_the_command_exits() {
    common::run(async {
        let vm = shared_vm().await;
        // The command exits at once, but a background `sleep` keeps its stdout open: the
        // output is not complete until it ends, and the timeout covers that wait too.
        let started = Instant::now();
        let out = vm
            .command("sh")
            .args([
                "-c",
                "echo before; sleep 300 & echo $! > /tmp/holder; exit 0",
            ])
            .timeout(Duration::from_secs(2))
            .output()
            .await
            .unwrap();
        assert!(out.status.timed_out(), "{:?}", out.status);
        assert_eq!(out.status.code(), Some(124));
        assert_eq!(
            out.stdout_text(),
            "before\n",
            "output before the kill is kept"
        );
        // guest-init enforces it: the host's own backstop could not end it before 12 s
        // (2 s + its 10 s grace).
        assert!(
            started.elapsed() < Duration::from_secs(11),
            "{:?}",
            started.elapsed()
        );
        assert_gone(vm, "/tmp/holder", "the holder survived the timeout").await;

        // A process that left the group (its own session) cannot be killed with it; its
        // stream is given up shortly after the kill instead of waited for.
        let started = Instant::now();
        let out = vm
            .command("sh")
            .args(["-c", "setsid sleep 300 & echo $! > /tmp/escaped; exit 0"])
            .timeout(Duration::from_secs(2))
            .output()
            .await
            .unwrap();
        assert_eq!(out.status.code(), Some(124), "{:?}", out.status);
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{:?}",
            started.elapsed()
        );
        // It is still running (nothing could reach it); end it by its pid.
        let check = sh(
            vm,
            "kill -0 $(cat /tmp/escaped) && echo alive; kill -9 $(cat /tmp/escaped)",
        )
        .await;
        assert_eq!(check.stdout_text(), "alive\n", "{:?}", check.stderr_text());
    });
}

#[test]
fn the_guest_runs_its_own_kernel() {
    common::run(async {
        let vm = shared_vm().await;
        let out = vm.command("uname").arg("-r").output().await.unwrap();
        let guest = out.stdout_text().trim().to_string();
        let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        assert_eq!(guest, vm.kernel_release());
        assert_ne!(guest, host.trim(), "uname -r printed the host's kernel");
        assert_eq!(guest, kernel::libkrunfw_release(), "not libkrunfw's kernel");
        let out = vm.command("hostname").output().await.unwrap();
        assert_eq!(
            out.stdout_text(),
            "krunbox\n",
            "guest-init sets the configured hostname"
        );
        // The root image is read-only; scratch space is not.
        let out = sh(
            vm,
            "touch /etc/x 2>&1; echo rc=$?; touch /tmp/x && echo tmp-ok",
        )
        .await;
        assert!(
            out.stdout_text().contains("Read-only file system"),
            "{}",
            out.stdout_text()
        );
        assert!(out.stdout_text().contains("tmp-ok"));
    });
}

// The kernel is rewrapped as an x86-64 ELF file, the format libkrun loads there.
#[cfg(target_arch = "x86_64")]
#[test]
fn a_custom_kernel_boots_instead_of_libkrunfws() {
    common::run(async {
        // libkrunfw's kernel, rebuilt into an ELF file and given a release string of its own:
        // `uname -r` can only print it if the VM booted this file.
        let (load, entry, mut image) = kernel::libkrunfw_kernel();
        let offsets = kernel::utsname_release_offsets(&image);
        assert!(
            !offsets.is_empty(),
            "no utsname in libkrunfw's kernel to mark"
        );
        let release = format!("{}-krunbox-custom", kernel::release_at(&image, offsets[0]));
        for &at in &offsets {
            let field = &mut image[at..at + release.len() + 1];
            field[..release.len()].copy_from_slice(release.as_bytes());
            field[release.len()] = 0;
        }
        let dir = tempfile::tempdir().unwrap();
        let vmlinux = dir.path().join("vmlinux");
        std::fs::write(&vmlinux, kernel::elf_kernel(load, entry, &image)).unwrap();

        let vm = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .memory_mib(256)
            .kernel(Kernel::new(&vmlinux, KernelFormat::Elf).arg("krunbox.test=custom-kernel"))
            .build()
            .unwrap()
            .boot()
            .await
            .unwrap();
        let copies = offsets.len();
        assert_eq!(
            vm.kernel_release(),
            release,
            "{copies} utsname copies marked"
        );
        let out = sh(&vm, "uname -r; cat /proc/cmdline").await;
        let text = out.stdout_text();
        assert!(text.starts_with(&format!("{release}\n")), "{text}");
        assert!(text.contains(" krunbox.test=custom-kernel"), "{text}");
        assert!(text.contains("init=/init.krun"), "{text}");
        vm.shutdown().await.unwrap();

        // A file that is not a kernel of that format fails the boot at once, with libkrun's
        // reason, not after the boot timeout.
        let bogus = dir.path().join("not-a-kernel");
        std::fs::write(&bogus, b"#!/bin/sh\n").unwrap();
        let started = Instant::now();
        let err = Sandbox::builder()
            .kernel(Kernel::new(&bogus, KernelFormat::Elf))
            .build()
            .unwrap()
            .boot()
            .await
            .unwrap_err();
        let Error::VmExited { console_tail, .. } = &err else {
            panic!("expected the VM to stop, got {err:?}");
        };
        assert!(console_tail.contains("Elf"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(60), "{err}");
    });
}

#[test]
fn dropping_an_instance_ends_its_vmm_process() {
    common::run(async {
        let vm = busybox().boot().await.unwrap();
        let pid = vm.vmm_pid().expect("a running VM has a VMM process");
        let proc_dir = std::path::PathBuf::from(format!("/proc/{pid}"));
        let exe = std::fs::read_link(proc_dir.join("exe")).unwrap();
        assert!(
            exe.ends_with("krunbox-vmm"),
            "pid {pid} is not the VMM helper: {}",
            exe.display()
        );
        drop(vm);
        // The helper is killed and reaped: its /proc entry goes (a zombie would keep it).
        let mut waited = Duration::ZERO;
        while proc_dir.exists() {
            assert!(
                waited < Duration::from_secs(30),
                "the VMM helper {pid} outlived its dropped instance"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
            waited += Duration::from_millis(100);
        }
    });
}

#[test]
fn three_instances_of_one_definition_run_at_once() {
    common::run(async {
        let sandbox = busybox();
        let (a, b, c) = tokio::try_join!(sandbox.boot(), sandbox.boot(), sandbox.boot()).unwrap();
        let mut boot_ids = Vec::new();
        for vm in [&a, &b, &c] {
            let out = vm
                .command("cat")
                .arg("/proc/sys/kernel/random/boot_id")
                .output()
                .await
                .unwrap();
            assert!(out.status.success());
            boot_ids.push(out.stdout_text());
        }
        boot_ids.sort();
        boot_ids.dedup();
        assert_eq!(boot_ids.len(), 3, "three distinct kernels: {boot_ids:?}");
        for vm in [a, b, c] {
            vm.shutdown().await.unwrap();
            assert!(!vm.is_running());
        }
    });
}

#[test]
fn an_image_with_one_flipped_byte_is_refused_before_boot_also_after_it_was_sealed() {
    common::run(async {
        let cache = krunbox::cache_dir();
        let manifest = krunbox_rootfs::load(&cache, BuiltinImage::Busybox)
            .unwrap()
            .expect("busybox image built by the set-up step");
        let original = krunbox_rootfs::image_path(&cache, BuiltinImage::Busybox);
        let dir = tempfile::tempdir().unwrap();
        let copy = dir.path().join("busybox.erofs");
        let mut bytes = std::fs::read(&original).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x01;
        std::fs::write(&copy, &bytes).unwrap();

        let sandbox = Sandbox::builder()
            .rootfs(Rootfs::image(&copy, "erofs", &manifest.sha256))
            .build()
            .unwrap();
        let refused = |result: krunbox::Result<krunbox::Instance>| match result {
            Err(Error::ImageDigestMismatch {
                expected, actual, ..
            }) => {
                assert_eq!(expected, manifest.sha256);
                assert_ne!(actual, manifest.sha256);
            }
            other => panic!("expected ImageDigestMismatch, got {other:?}"),
        };
        let started = Instant::now();
        refused(sandbox.boot().await);
        // Refused before any VM started: far quicker than a boot.
        assert!(started.elapsed() < Duration::from_secs(5));

        // The unmodified bytes under the same expected digest do boot; once the file's change
        // time has settled, the boot seals the digest to the file's state.
        bytes[middle] ^= 0x01;
        std::fs::write(&copy, &bytes).unwrap();
        tokio::time::sleep(Duration::from_millis(3100)).await;
        let vm = sandbox.boot().await.expect("the restored image boots");
        assert!(vm.command("true").status().await.unwrap().success());
        vm.shutdown().await.unwrap();

        // Tampered in place after the seal, its modification time put back: still refused, by
        // this process (which remembers the seal) and before the guest runs.
        let modified = std::fs::metadata(&copy).unwrap().modified().unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&copy).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, &[bytes[middle] ^ 0x01], middle as u64)
            .unwrap();
        file.set_modified(modified).unwrap();
        drop(file);
        let started = Instant::now();
        refused(sandbox.boot().await);
        assert!(started.elapsed() < Duration::from_secs(5));
    });
}

fn hostile_init() -> std::path::PathBuf {
    let path = krunbox::Artifacts::locate()
        .expect("artifacts")
        .guest_init
        .parent()
        .unwrap()
        .join("examples/hostile-init");
    assert!(
        path.is_file(),
        "{} missing: build it with `cargo build -p guest-init --release --target x86_64-unknown-linux-musl --examples`",
        path.display()
    );
    path
}

#[test]
fn garbage_on_the_control_channel_is_a_typed_error() {
    common::run(async {
        let sandbox = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .memory_mib(256)
            .guest_init(hostile_init())
            .build()
            .unwrap();
        let started = Instant::now();
        match sandbox.boot().await {
            Err(Error::Protocol(err)) => {
                // The hostile init sends bytes that either announce a huge frame or do not
                // decode; both are typed protocol errors.
                assert!(
                    matches!(
                        err,
                        ProtocolError::FrameTooLarge { .. }
                            | ProtocolError::UnknownKind { .. }
                            | ProtocolError::Malformed { .. }
                    ),
                    "{err:?}"
                );
            }
            other => panic!("expected a protocol error, got {other:?}"),
        }
        // The hostile guest sleeps 30 s after sending: the host must not wait for it.
        assert!(started.elapsed() < Duration::from_secs(120));
    });
}

/// Runs a command that never finishes normally because the VM dies under it (`die` is called
/// once the command is running), then checks the typed error and that the host carries on.
async fn assert_vm_death_is_reported<F>(die: F)
where
    F: FnOnce(&Instance),
{
    let vm = busybox().boot().await.unwrap();
    let mut child = vm
        .command("sh")
        .args(["-c", "echo started; sleep 600"])
        .spawn()
        .await
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut line = [0u8; 8];
    stdout.read_exact(&mut line).await.unwrap();
    assert_eq!(&line, b"started\n");
    die(&vm);
    // The rest of the stream never comes: a reader must hear that, not a clean end of file.
    let mut rest = Vec::new();
    let err = stdout
        .read_to_end(&mut rest)
        .await
        .expect_err("a stream cut off by the VM's death must not end cleanly");
    match err.get_ref().and_then(|e| e.downcast_ref::<Error>()) {
        Some(Error::InstanceGone { .. }) => {}
        other => panic!("expected InstanceGone inside the read error, got {other:?} ({err})"),
    }
    match child.wait().await {
        Err(Error::InstanceGone { reason }) => {
            assert!(reason.contains("VM"), "the reason names the VM: {reason}")
        }
        other => panic!("expected InstanceGone, got {other:?}"),
    }
    assert!(!vm.is_running());
    match vm.command("true").output().await {
        Err(Error::InstanceGone { .. }) => {}
        other => panic!("a dead instance must refuse commands, got {other:?}"),
    }
    // The library is fine: a new VM from the same definition boots and works.
    let again = busybox().boot().await.unwrap();
    assert!(again.command("true").status().await.unwrap().success());
    again.shutdown().await.unwrap();
}

#[test]
fn a_guest_that_resets_mid_command_is_reported_and_the_host_survives() {
    common::run(async {
        // An abrupt guest reset: what a guest kernel panic (panic=-1) or a hostile root
        // process looks like from the host.
        assert_vm_death_is_reported(|vm| {
            let vm = vm.clone();
            tokio::spawn(async move {
                let _ = vm.command("reboot").arg("-f").output().await;
            });
        })
        .await;
    });
}

#[test]
fn a_guest_kernel_panic_is_reported_and_the_host_survives() {
    common::run(async {
        // An init that exits: the guest kernel panics while booting.
        let panic_init = krunbox::Artifacts::locate()
            .unwrap()
            .guest_init
            .parent()
            .unwrap()
            .join("examples/panic-init");
        let err = busybox_builder()
            .guest_init(&panic_init)
            .build()
            .unwrap()
            .boot()
            .await
            .unwrap_err();
        match &err {
            // The panic message itself does not reach the console: with `panic=-1` the VM
            // resets before the virtio console is flushed. The init's last line does.
            Error::VmExited { console_tail, .. } => {
                assert!(
                    console_tail.contains("panic-init: exiting as PID 1"),
                    "{err}"
                );
            }
            other => panic!("expected the VM to stop with the panic, got {other:?}"),
        }
        // The library carries on: the next VM boots and runs.
        let vm = busybox().boot().await.unwrap();
        assert!(vm.command("true").status().await.unwrap().success());
        vm.shutdown().await.unwrap();
    });
}

#[test]
fn a_vmm_crash_is_reported_and_the_host_survives() {
    common::run(async {
        assert_vm_death_is_reported(|vm| {
            let pid = vm.vmm_pid().expect("running VM has a helper pid");
            // The test started this helper (through boot) and ends it by its pid.
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            )
            .unwrap();
        })
        .await;
    });
}

/// A normal Linux guest without a network device: its hostname set and resolvable (as
/// Python's `socket` resolves it), loopback up, `/dev/fd` and `/dev/std*`, cgroup2 at
/// `/sys/fs/cgroup`, and a buffered command's stdin closed (a `cat` returns at once).
#[test]
fn the_guest_is_a_normal_linux_system_without_a_network() {
    common::run(async {
        let vm = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Agent))
            .memory_mib(512)
            .hostname("lane-7")
            .build()
            .unwrap()
            .boot()
            .await
            .unwrap();
        let out = vm
            .command("sh")
            .args([
                "-c",
                "hostname; cat /etc/hostname; \
                 python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))'; \
                 cat /sys/class/net/lo/flags; \
                 readlink /dev/fd /dev/stdin /dev/stdout /dev/stderr; echo to-stderr > /dev/stderr; \
                 test -e /sys/fs/cgroup/cgroup.controllers && echo cgroup2; \
                 grep -q ' /dev/mqueue .* - mqueue ' /proc/self/mountinfo && echo mqueue; \
                 echo shm > /dev/shm/probe && cat /dev/shm/probe; \
                 python3 -c 'import socket; s = socket.create_server((\"127.0.0.1\", 0)); \
                   c = socket.create_connection(s.getsockname()); a, _ = s.accept(); \
                   c.sendall(b\"lo-round-trip\"); print(a.recv(64).decode())'; \
                 sh -c 'sleep 0.2 & exit 0'; sleep 1; \
                 echo zombies=$(grep -l '^State:.*Z' /proc/[0-9]*/status 2>/dev/null | wc -l)",
            ])
            .timeout(Duration::from_secs(60))
            .output()
            .await
            .unwrap();
        let text = out.stdout_text();
        assert!(out.status.success(), "{text}{}", out.stderr_text());
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "lane-7", "{text}");
        assert_eq!(lines[1], "lane-7", "/etc/hostname: {text}");
        assert_eq!(lines[2], "127.0.1.1", "the hostname resolves: {text}");
        // IFF_UP (0x1) with IFF_LOOPBACK (0x8).
        let flags = u32::from_str_radix(lines[3].trim_start_matches("0x"), 16).unwrap();
        assert_eq!(flags & 0x1, 0x1, "lo is down: {text}");
        assert_eq!(
            &lines[4..8],
            [
                "/proc/self/fd",
                "/proc/self/fd/0",
                "/proc/self/fd/1",
                "/proc/self/fd/2"
            ],
            "{text}"
        );
        assert_eq!(lines[8], "cgroup2", "{text}");
        assert_eq!(
            &lines[9..13],
            ["mqueue", "shm", "lo-round-trip", "zombies=0"],
            "message queues, /dev/shm, a TCP round trip on lo, an orphan reaped: {text}"
        );
        assert_eq!(out.stderr_text(), "to-stderr\n");

        // A buffered command's stdin is closed: `cat` reads end of file at once (a stdin left
        // open would hold it until its timeout: exit code 124).
        let cat = vm
            .command("cat")
            .timeout(Duration::from_secs(60))
            .output()
            .await
            .unwrap();
        assert!(cat.status.success() && cat.stdout.is_empty(), "{cat:?}");
        vm.shutdown().await.unwrap();
    })
}

/// One definition, booted twice with different per-boot options: each boot has its own mount,
/// hostname and starting directory, besides the definition's mount; options the builder would
/// refuse are refused before anything boots.
#[test]
fn one_definition_boots_lanes_with_their_own_mounts_hostnames_and_directories() {
    use krunbox::fs::MemoryFs;
    use krunbox::BootOptions;
    common::run(async {
        let shared = MemoryFs::new();
        shared.write_file("/note.txt", b"shared\n").unwrap();
        let sandbox = busybox_builder().mount("/shared", shared).build().unwrap();
        for lane in ["lane-1", "lane-2"] {
            let workspace = MemoryFs::new();
            workspace
                .write_file("/task.txt", format!("task of {lane}\n").as_bytes())
                .unwrap();
            let vm = sandbox
                .boot_with(
                    BootOptions::new()
                        .mount(format!("/work/{lane}"), workspace.clone())
                        .hostname(lane)
                        .current_dir(format!("/work/{lane}")),
                )
                .await
                .unwrap();
            let out = vm
                .command("sh")
                .args([
                    "-c",
                    "pwd; hostname; cat task.txt /shared/note.txt; ls /work",
                ])
                .output()
                .await
                .unwrap();
            assert!(out.status.success(), "{}", out.stderr_text());
            assert_eq!(
                out.stdout_text(),
                format!("/work/{lane}\n{lane}\ntask of {lane}\nshared\n{lane}\n")
            );
            // A command's own directory still wins.
            let tmp = vm
                .command("pwd")
                .current_dir("/tmp")
                .output()
                .await
                .unwrap();
            assert_eq!(tmp.stdout_text(), "/tmp\n");
            vm.shutdown().await.unwrap();
        }
        for (options, what) in [
            (BootOptions::new().hostname("not a name"), "hostname"),
            (BootOptions::new().current_dir("relative"), "current_dir"),
            (
                BootOptions::new().mount("/shared", MemoryFs::new()),
                "/shared",
            ),
        ] {
            match sandbox.boot_with(options).await {
                Err(Error::InvalidConfig(message)) => {
                    assert!(message.contains(what), "{message}")
                }
                other => panic!("{what}: not refused: {other:?}"),
            }
        }
    })
}
