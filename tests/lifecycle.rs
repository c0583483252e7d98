//! A sandbox's life past boot and shutdown, against real microVMs: pausing one (no CPU used,
//! measured from the host) and resuming it, and a warm pool handing out instances that never
//! ran anything.

mod common;
#[path = "common/https_origin.rs"]
mod https_origin;

use std::time::Duration;

use krunbox::{BuiltinImage, Error, Instance, Pool, Rootfs, Sandbox};
use tokio::io::AsyncWriteExt;

/// The CPU time (user + system, in clock ticks) process `pid` has used, all its threads.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which is in parentheses): state is the 1st, utime the
    // 12th, stime the 13th.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// What `sh -c script` prints in `vm`, trimmed; fails the test if it fails.
async fn sh(vm: &Instance, script: &str) -> String {
    let out = vm
        .command("sh")
        .args(["-c", script])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{script}: {out:?}");
    out.stdout_text().trim().to_string()
}

/// Waits (at most 120 s) until `pool` has an instance ready; the failure says it never `what`.
async fn one_ready(pool: &Pool, what: &str) {
    let ready = async {
        while pool.ready() < 1 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(120), ready)
        .await
        .unwrap_or_else(|_| panic!("the pool never {what}: {:?}", pool.last_failure()));
}

#[test]
fn a_paused_instance_uses_no_cpu_outlives_the_liveness_check_and_answers_after_resume() {
    common::run(async {
        // A liveness timeout well inside the pause: were the check not suspended, the paused
        // guest would be declared hung and killed.
        let sandbox = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .memory_mib(256)
            .liveness_timeout(Duration::from_secs(3))
            .build()
            .unwrap();
        let vm = sandbox.boot().await.unwrap();
        let pid = vm.vmm_pid().unwrap();
        // A guest that would use a whole vCPU if it ran: a pause that did not stop it shows.
        let mut spinner = vm
            .command("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .await
            .unwrap();
        let before = cpu_ticks(pid);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(cpu_ticks(pid) > before, "the spinning guest uses CPU");

        vm.pause().await.unwrap();
        assert!(vm.is_paused());
        vm.pause().await.unwrap(); // pausing twice is harmless
        let paused_at = cpu_ticks(pid);
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert_eq!(cpu_ticks(pid), paused_at, "a paused VM used CPU");
        assert!(matches!(
            vm.command("true").status().await,
            Err(Error::Paused)
        ));
        assert!(matches!(
            vm.read_file("/etc/hostname").await,
            Err(Error::Paused)
        ));
        assert!(vm.is_running(), "paused, not declared hung");

        vm.resume().await.unwrap();
        assert!(!vm.is_paused());
        assert_eq!(sh(&vm, "echo back").await, "back");
        // The process running when it paused runs on; it ends as any other does.
        spinner.kill().await.unwrap();
        let status = spinner.wait().await.unwrap();
        assert!(!status.success());
        // Shutting down a paused instance resumes it to power off cleanly.
        vm.pause().await.unwrap();
        vm.shutdown().await.unwrap();
        assert!(!vm.is_running());
    });
}

#[test]
fn a_pool_hands_out_running_instances_that_never_saw_another_users_command() {
    common::run(async {
        let sandbox = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .memory_mib(256)
            .build()
            .unwrap();
        assert!(matches!(
            Pool::new(&sandbox, 0),
            Err(Error::InvalidConfig(_))
        ));
        let pool = Pool::new(&sandbox, 1).unwrap();
        // Filled in the background.
        one_ready(&pool, "filled").await;

        let first = pool.take().await.unwrap();
        let first_boot = sh(&first, "cat /proc/sys/kernel/random/boot_id").await;
        sh(
            &first,
            "echo secret > /tmp/left-behind; echo secret > /root/history",
        )
        .await;
        // The pool refills in the background: its next instance is another VM that ran nothing.
        one_ready(&pool, "refilled").await;
        let second = pool.take().await.unwrap();
        assert_ne!(first.id(), second.id());
        let second_boot = sh(&second, "cat /proc/sys/kernel/random/boot_id").await;
        assert_ne!(first_boot, second_boot, "another kernel");
        assert_eq!(
            sh(
                &second,
                "test -e /tmp/left-behind || test -e /root/history || echo clean"
            )
            .await,
            "clean",
            "no file of the first user's"
        );
        assert_eq!(
            // ps alone, not in a pipeline: a pipeline's side is a forked `sh` until it execs,
            // which ps could see.
            sh(&second, "ps -o comm= > /tmp/ps; grep -c -x sh /tmp/ps").await,
            "1",
            "no shell but this one"
        );
        first.shutdown().await.unwrap();
        second.shutdown().await.unwrap();
        pool.close().await;
        assert!(matches!(pool.take().await, Err(Error::InvalidConfig(_))));
    });
}

/// Flips one bit of the first data byte of `file` (a hole's byte would not be hashed).
fn flip_first_data_byte(file: &std::path::Path) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
    // SAFETY: lseek on a descriptor this test owns.
    let data_at = unsafe { libc::lseek(fd, 0, libc::SEEK_DATA) };
    assert!(data_at >= 0, "no data in the file");
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, data_at as u64).unwrap();
    file.write_all_at(&[byte[0] ^ 1], data_at as u64).unwrap();
}

/// A busybox definition whose instances can be snapshotted, its key in `keys`.
fn snapshottable(keys: &std::path::Path) -> Sandbox {
    Sandbox::builder()
        .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
        .memory_mib(256)
        .snapshots(true)
        .snapshot_key_dir(keys)
        .build()
        .unwrap()
}

/// A shell in a pty on `vm` that has run `X=41` and `echo FILE_TEXT > /tmp/f`: the shell, its
/// input and its screen.
async fn shell_holding_state(
    vm: &Instance,
    file_text: &str,
) -> (krunbox::Child, krunbox::ChildStdin, krunbox::ChildStdout) {
    let mut shell = vm.command("sh").pty(24, 80).spawn().await.unwrap();
    let mut input = shell.stdin.take().unwrap();
    let mut screen = shell.stdout.take().unwrap();
    input
        .write_all(format!("X=41; echo {file_text} > /tmp/f; echo set-$X\n").as_bytes())
        .await
        .unwrap();
    common::read_until(&mut screen, "set-41").await;
    (shell, input, screen)
}

/// The guest's uptime in seconds (`/proc/uptime`: its boot-time clock, from kvmclock).
async fn uptime(vm: &Instance) -> f64 {
    let line = sh(vm, "cat /proc/uptime").await;
    line.split_whitespace().next().unwrap().parse().unwrap()
}

/// Snapshots' first steps: the control channel is quiesced (nothing in flight either way), the
/// helper pauses the vCPUs, saves the KVM state of the VM and each vCPU (through its
/// serialized form), holds it, sets it back and resumes, and the channel resumes. The guest's
/// clocks prove the state was set: kvmclock and the TSC come back as saved, so the guest's
/// uptime does not count the hold, where vCPUs merely paused and resumed would count all of
/// it. A shell in a pty, started before, answers after: the channel carried on.
#[test]
fn the_vms_saved_kvm_state_set_back_after_a_hold_resumes_the_guest_without_the_hold() {
    common::run(async {
        let sandbox = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .memory_mib(256)
            .build()
            .unwrap();
        let vm = sandbox.boot().await.unwrap();
        let mut shell = vm.command("sh").pty(24, 80).spawn().await.unwrap();
        let mut input = shell.stdin.take().unwrap();
        let mut screen = shell.stdout.take().unwrap();
        input.write_all(b"X=41; echo set-$X\n").await.unwrap();
        common::read_until(&mut screen, "set-41").await;

        let hold = Duration::from_secs(6);
        let before = uptime(&vm).await;
        let bytes = vm.round_trip_machine_state(hold).await.unwrap();
        let after = uptime(&vm).await;
        assert!(
            bytes > 4096,
            "a vCPU's state alone has 4 KiB of xsave: {bytes}"
        );
        assert!(
            after > before && after - before < hold.as_secs_f64() / 2.0,
            "the guest's uptime went from {before} to {after} across a hold of {hold:?}"
        );
        input.write_all(b"echo got-$((X + 1))\n").await.unwrap();
        common::read_until(&mut screen, "got-42").await;
        // The wall clock was set from the host's as the channel resumed.
        let guest_now: u64 = sh(&vm, "date +%s").await.parse().unwrap();
        let host_now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(
            guest_now.abs_diff(host_now) < 3,
            "the guest's clock says {guest_now}, the host's {host_now}"
        );
        input.write_all(b"exit 3\n").await.unwrap();
        assert_eq!(shell.wait().await.unwrap().code(), Some(3));

        // A sandbox built without snapshots says how to get them.
        let refused = vm.snapshot(std::env::temp_dir().join("never")).await;
        assert!(
            matches!(&refused, Err(Error::InvalidConfig(why)) if why.contains("snapshots(true)")),
            "{refused:?}"
        );
        // A paused VM's helper answers nothing: refused, not waited for.
        vm.pause().await.unwrap();
        assert!(matches!(
            vm.round_trip_machine_state(Duration::ZERO).await,
            Err(Error::Paused)
        ));
        vm.resume().await.unwrap();
        vm.shutdown().await.unwrap();
    });
}

/// A snapshot of a running instance: written whole (memory as data among holes, the machine
/// state, an authenticated manifest), checked whole when opened (a flipped byte is refused),
/// and the instance goes on afterwards with its processes and files.
#[test]
fn a_snapshot_is_written_whole_refused_once_tampered_and_the_instance_goes_on() {
    common::run(async {
        let keys = tempfile::tempdir().unwrap();
        let sandbox = snapshottable(keys.path());
        let vm = sandbox.boot().await.unwrap();
        let (mut shell, mut input, mut screen) = shell_holding_state(&vm, "kept").await;

        let place = tempfile::tempdir().unwrap();
        let dir = place.path().join("snap");
        let snapshot = vm.snapshot(&dir).await.unwrap();
        assert_eq!(snapshot.dir(), dir);
        let memory = std::fs::metadata(dir.join("memory.img")).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert!(
            memory.len() >= 256 << 20 && memory.blocks() * 512 < memory.len(),
            "guest memory is written sparse: {} bytes, {} allocated",
            memory.len(),
            memory.blocks() * 512
        );
        // Another process of this user opens it: the key is on disk.
        let opened = krunbox::Snapshot::open(&dir, keys.path()).unwrap();
        assert_eq!(opened.digest(), snapshot.digest());

        // The instance goes on: the shell's variable, the file, new commands.
        input.write_all(b"echo got-$((X + 1))\n").await.unwrap();
        common::read_until(&mut screen, "got-42").await;
        assert_eq!(sh(&vm, "cat /tmp/f").await, "kept");

        // One byte of guest memory changed on disk: refused, saying which part.
        flip_first_data_byte(&dir.join("memory.img"));
        assert!(matches!(
            krunbox::Snapshot::open(&dir, keys.path()).unwrap().verify(),
            Err(Error::SnapshotTampered { part, .. }) if part == "memory.img"
        ));

        input.write_all(b"exit 0\n").await.unwrap();
        assert_eq!(shell.wait().await.unwrap().code(), Some(0));
        vm.shutdown().await.unwrap();
    });
}

/// A snapshot restored as a new instance (in this process; a fresh process is the next test's
/// business): the shell in its pty is taken over with its variable, the guest's files are
/// there, and from then on the restored instance and its source go their own ways. A snapshot
/// whose memory changed on disk is refused before a VM starts.
#[test]
fn a_restored_snapshot_takes_over_its_shell_keeps_its_files_and_diverges_from_its_source() {
    common::run(async {
        let keys = tempfile::tempdir().unwrap();
        let sandbox = snapshottable(keys.path());
        let vm = sandbox.boot().await.unwrap();
        let (mut shell, mut input, mut screen) = shell_holding_state(&vm, "kept").await;
        let pid = shell.id();
        let place = tempfile::tempdir().unwrap();
        let dir = place.path().join("snap");
        vm.snapshot(&dir).await.unwrap();

        let snapshot = krunbox::Snapshot::open(&dir, keys.path()).unwrap();
        let twin = sandbox.restore(&snapshot).await.unwrap();
        assert_eq!(twin.processes(), vec![pid]);
        let mut twin_shell = twin.attach(pid).unwrap();
        assert!(twin.attach(pid).is_err(), "a process is taken over once");
        let mut twin_input = twin_shell.stdin.take().unwrap();
        let mut twin_screen = twin_shell.stdout.take().unwrap();
        twin_input
            .write_all(b"echo got-$((X + 1)) $(cat /tmp/f); echo twin > /tmp/f\n")
            .await
            .unwrap();
        common::read_until(&mut twin_screen, "got-42 kept").await;
        assert_eq!(sh(&twin, "cat /tmp/f").await, "twin");
        // The twin maps the snapshot's memory copy-on-write: a snapshot of it holds what it
        // wrote over that.
        let again = place.path().join("again");
        twin.snapshot(&again).await.unwrap();
        let third = sandbox
            .restore(&krunbox::Snapshot::open(&again, keys.path()).unwrap())
            .await
            .unwrap();
        assert_eq!(sh(&third, "cat /tmp/f").await, "twin");
        third.shutdown().await.unwrap();
        // The source never saw the twin's write, and goes on as it was.
        input
            .write_all(b"echo src-$X $(cat /tmp/f)\n")
            .await
            .unwrap();
        common::read_until(&mut screen, "src-41 kept").await;

        twin_input.write_all(b"exit 5\n").await.unwrap();
        assert_eq!(twin_shell.wait().await.unwrap().code(), Some(5));
        twin.shutdown().await.unwrap();
        input.write_all(b"exit 0\n").await.unwrap();
        assert_eq!(shell.wait().await.unwrap().code(), Some(0));
        vm.shutdown().await.unwrap();

        // A byte of the snapshot's memory changed on disk: refused before any VM runs.
        flip_first_data_byte(&dir.join("memory.img"));
        let refused = sandbox.restore(&snapshot).await;
        assert!(
            matches!(&refused, Err(Error::SnapshotTampered { part, .. }) if part == "memory.img"),
            "{refused:?}"
        );
    });
}

/// Where the parent of [`a_python_repl_in_a_pty_survives_a_snapshot_restored_by_a_fresh_process`]
/// tells its child process (the same test, run again) what to restore.
const RESTORE_CHILD: &str = "KRUNBOX_TEST_RESTORE_CHILD";

/// Issue 39's acceptance: a Python REPL in a pty, holding a variable and a file in guest
/// tmpfs, is snapshotted; a fresh process (this test binary again, running this test in its
/// child role) restores the snapshot, takes the REPL over and finds both.
#[test]
fn a_python_repl_in_a_pty_survives_a_snapshot_restored_by_a_fresh_process() {
    common::run(async {
        let child_role = std::env::var_os(RESTORE_CHILD);
        let keys = tempfile::tempdir().unwrap();
        let key_dir = child_role
            .as_ref()
            .map(|dir| std::path::Path::new(dir).join("keys"))
            .unwrap_or_else(|| keys.path().to_path_buf());
        let sandbox = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Agent))
            .memory_mib(512)
            .snapshots(true)
            .snapshot_key_dir(&key_dir)
            .build()
            .unwrap();
        if let Some(dir) = child_role {
            // The child: restore, take the REPL over, ask it.
            let dir = std::path::Path::new(&dir);
            let pid: u32 = std::fs::read_to_string(dir.join("pid"))
                .unwrap()
                .parse()
                .unwrap();
            let snapshot = krunbox::Snapshot::open(dir.join("snap"), &key_dir).unwrap();
            let vm = sandbox.restore(&snapshot).await.unwrap();
            let mut repl = vm.attach(pid).unwrap();
            let mut input = repl.stdin.take().unwrap();
            let mut screen = repl.stdout.take().unwrap();
            input
                .write_all(b"print('answer', x + 1, open('/tmp/f').read())\n")
                .await
                .unwrap();
            common::read_until(&mut screen, "answer 42 kept").await;
            input.write_all(b"exit(7)\n").await.unwrap();
            assert_eq!(repl.wait().await.unwrap().code(), Some(7));
            vm.shutdown().await.unwrap();
            return;
        }
        let vm = sandbox.boot().await.unwrap();
        let mut repl = vm
            .command("python3")
            .args(["-q", "-i"])
            .pty(24, 80)
            .spawn()
            .await
            .unwrap();
        let mut input = repl.stdin.take().unwrap();
        let mut screen = repl.stdout.take().unwrap();
        input
            .write_all(b"x = 41; n = open('/tmp/f', 'w').write('kept'); print('ready', x)\n")
            .await
            .unwrap();
        common::read_until(&mut screen, "ready 41").await;
        let work = tempfile::tempdir().unwrap();
        std::fs::write(work.path().join("pid"), repl.id().to_string()).unwrap();
        vm.snapshot(work.path().join("snap")).await.unwrap();
        vm.shutdown().await.unwrap();
        // The keys go with the snapshot to the child: it is this user's other process.
        std::fs::create_dir(work.path().join("keys")).unwrap();
        std::fs::copy(
            keys.path().join("snapshot.key"),
            work.path().join("keys/snapshot.key"),
        )
        .unwrap();

        let child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_python_repl_in_a_pty_survives_a_snapshot_restored_by_a_fresh_process",
                "--nocapture",
            ])
            .env(RESTORE_CHILD, work.path())
            .kill_on_drop(true)
            .output()
            .await
            .unwrap();
        assert!(
            child.status.success(),
            "the restoring process failed: {}\n{}",
            String::from_utf8_lossy(&child.stdout),
            String::from_utf8_lossy(&child.stderr)
        );
        let out = String::from_utf8_lossy(&child.stdout);
        assert!(out.contains("1 passed"), "the child ran no test: {out}");
    });
}

/// A fork into two: both forks start with the source's shell, variable and file, then each
/// goes its own way, and the source its own.
#[test]
fn a_fork_into_two_starts_both_from_the_source_and_each_diverges() {
    common::run(async {
        let keys = tempfile::tempdir().unwrap();
        let vm = snapshottable(keys.path()).boot().await.unwrap();
        let (shell, mut input, mut screen) = shell_holding_state(&vm, "base").await;
        let pid = shell.id();

        let forks = vm.fork(2).await.unwrap();
        assert_eq!(forks.len(), 2);
        for (i, fork) in forks.iter().enumerate() {
            let mut twin = fork.attach(pid).unwrap();
            let mut twin_input = twin.stdin.take().unwrap();
            let mut twin_screen = twin.stdout.take().unwrap();
            twin_input
                .write_all(
                    format!("X=$((X + {i})); echo fork{i} >> /tmp/f; echo seen-$X-$(cat /tmp/f | tr '\\n' .)\n")
                        .as_bytes(),
                )
                .await
                .unwrap();
            common::read_until(&mut twin_screen, &format!("seen-{}-base.fork{i}.", 41 + i)).await;
        }
        // Neither fork's change reached the other or the source.
        assert_eq!(
            sh(&forks[0], "cat /tmp/f | tr '\\n' .").await,
            "base.fork0."
        );
        assert_eq!(
            sh(&forks[1], "cat /tmp/f | tr '\\n' .").await,
            "base.fork1."
        );
        input
            .write_all(b"echo src-$X-$(cat /tmp/f)\n")
            .await
            .unwrap();
        common::read_until(&mut screen, "src-41-base").await;
        for fork in forks {
            fork.shutdown().await.unwrap();
        }
        // The source's memory is copy-on-write over what it froze now: what it wrote since
        // (only in its helper's own pages) reaches a second fork.
        assert_eq!(sh(&vm, "echo after > /tmp/g; cat /tmp/g").await, "after");
        let again = vm.fork(1).await.unwrap();
        assert_eq!(
            sh(&again[0], "cat /tmp/f /tmp/g | tr '\\n' .").await,
            "base.after."
        );
        again[0].shutdown().await.unwrap();
        vm.shutdown().await.unwrap();
    });
}

/// Issue 39: "the root layer's state" goes with a snapshot. An ephemeral root's layer (a file
/// written under /etc, on the root's writable layer) is restored with the instance and copied
/// into each fork, which then diverge; a sandbox whose root differs refuses the snapshot.
#[test]
fn an_ephemeral_roots_writes_survive_a_restore_and_reach_each_fork_apart() {
    common::run(async {
        let keys = tempfile::tempdir().unwrap();
        let sandbox = Sandbox::builder()
            .rootfs(Rootfs::ephemeral(
                Rootfs::builtin(BuiltinImage::Busybox),
                64 << 20,
            ))
            .memory_mib(256)
            .snapshots(true)
            .snapshot_key_dir(keys.path())
            .build()
            .unwrap();
        let vm = sandbox.boot().await.unwrap();
        // Written through to the layer disk (sync): the disk's state and the guest's page
        // cache in memory are both in the snapshot.
        assert_eq!(
            sh(&vm, "echo layer > /etc/kept; sync; cat /etc/kept").await,
            "layer"
        );
        let place = tempfile::tempdir().unwrap();
        let dir = place.path().join("snap");
        vm.snapshot(&dir).await.unwrap();
        let snapshot = krunbox::Snapshot::open(&dir, keys.path()).unwrap();

        let restored = sandbox.restore(&snapshot).await.unwrap();
        assert_eq!(
            sh(
                &restored,
                "echo 3 > /proc/sys/vm/drop_caches; cat /etc/kept"
            )
            .await,
            "layer",
            "read back from the restored layer disk, not only the page cache"
        );
        restored.shutdown().await.unwrap();

        let forks = vm.fork(1).await.unwrap();
        assert_eq!(
            sh(
                &forks[0],
                "echo fork >> /etc/kept; cat /etc/kept | tr '\\n' ."
            )
            .await,
            "layer.fork."
        );
        assert_eq!(sh(&vm, "cat /etc/kept").await, "layer");
        forks[0].shutdown().await.unwrap();
        vm.shutdown().await.unwrap();

        // An image root's sandbox has no layer to give it.
        let refused = snapshottable(keys.path()).restore(&snapshot).await;
        assert!(
            matches!(&refused, Err(Error::Snapshot { reason, .. }) if reason.contains("ephemeral root")),
            "{refused:?}"
        );
    });
}

/// A network across a snapshot: the restored instance and a fork each get a network service
/// of their own (their sandbox's policy decides their flows; the source's open flows do not
/// come along), which intercepts HTTPS with the sandbox CA their guest already trusts and
/// swaps the secret placeholder their guest's environment already holds, also when the
/// restoring sandbox's network was made anew (its own placeholder) as in another process.
#[test]
fn a_restored_or_forked_instance_reaches_the_network_with_its_sources_ca_and_placeholders() {
    use krunbox::net::{Flow, Intercept, Protocol, Resolver, Secret, UpstreamTrust, Verdict};
    common::run(async {
        // What the origin got: each path and its key (the guest would only ever see its
        // placeholder: the host swaps the value back on the way in).
        let got: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
        let kept = got.clone();
        let handler = move |request: hyper::Request<bytes::Bytes>| {
            let key = request
                .headers()
                .get("x-api-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("none")
                .to_owned();
            let path = request.uri().path().to_owned();
            kept.lock().unwrap().push(format!("{path} {key}"));
            https_origin::respond(200, "text/plain", format!("{path} answered"))
        };
        let origin = https_origin::start(&["origin.test"], std::sync::Arc::new(handler)).await;
        let (port, origin_ca) = (origin.port, origin.ca_pem.clone());
        let keys = tempfile::tempdir().unwrap();
        // A sandbox's definition; each call makes its secret anew (a placeholder of its own).
        let sandbox = || {
            let network = krunbox::Network::with_policy(move |flow: Flow| async move {
                match (flow.protocol(), flow.hostname()) {
                    (Protocol::Dns, Some("origin.test")) => {
                        Verdict::resolve(Resolver::fixed([std::net::IpAddr::V4(
                            std::net::Ipv4Addr::LOCALHOST,
                        )]))
                    }
                    (Protocol::Tcp, Some("origin.test")) if flow.destination().port() == port => {
                        Verdict::intercept(Intercept::new())
                    }
                    _ => Verdict::deny(),
                }
            })
            .upstream_trust(UpstreamTrust::pem(origin_ca.as_bytes()).unwrap())
            .secret(
                Secret::new("API_KEY", "real-api-key")
                    .unwrap()
                    .bind_to("origin.test"),
            );
            Sandbox::builder()
                .rootfs(Rootfs::builtin(BuiltinImage::Agent))
                .memory_mib(512)
                .network(network)
                .snapshots(true)
                .snapshot_key_dir(keys.path())
                .build()
                .unwrap()
        };
        let fetch = |who: &str| {
            format!("curl -sS -H \"X-Api-Key: $API_KEY\" https://origin.test:{port}/{who}")
        };
        let vm = sandbox().boot().await.unwrap();
        assert_eq!(sh(&vm, &fetch("source")).await, "/source answered");
        let place = tempfile::tempdir().unwrap();
        let dir = place.path().join("snap");
        vm.snapshot(&dir).await.unwrap();
        let restored = sandbox()
            .restore(&krunbox::Snapshot::open(&dir, keys.path()).unwrap())
            .await
            .unwrap();
        // curl checks the certificate: the restored guest trusts its source's CA only.
        assert_eq!(
            sh(&restored, &fetch("restored")).await,
            "/restored answered"
        );
        restored.shutdown().await.unwrap();
        let forks = vm.fork(1).await.unwrap();
        assert_eq!(sh(&forks[0], &fetch("fork")).await, "/fork answered");
        forks[0].shutdown().await.unwrap();
        assert_eq!(sh(&vm, &fetch("again")).await, "/again answered");
        vm.shutdown().await.unwrap();
        assert_eq!(
            *got.lock().unwrap(),
            [
                "/source real-api-key",
                "/restored real-api-key",
                "/fork real-api-key",
                "/again real-api-key"
            ]
        );
    });
}
