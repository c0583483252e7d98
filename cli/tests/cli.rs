//! The `krunbox` command line, run as a user would: each case boots a real microVM.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

#[path = "../../tests/common/kernel.rs"]
mod kernel;
#[allow(dead_code)] // the OCI layout is for tests/rootfs_oci.rs
#[path = "../../tests/common/oci.rs"]
mod oci;
#[path = "../../tests/common/registry.rs"]
mod registry;

fn krunbox(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_krunbox"))
        .args(args)
        .output()
        .expect("running krunbox")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn run_exits_with_the_commands_exit_code() {
    let out = krunbox(&["run", "--image", "busybox", "--", "sh", "-c", "exit 7"]);
    assert_eq!(out.status.code(), Some(7), "stderr: {}", text(&out.stderr));
}

#[test]
fn run_with_a_timeout_exits_124_in_seconds() {
    let started = Instant::now();
    let out = krunbox(&[
        "run",
        "--image",
        "busybox",
        "--timeout",
        "2",
        "--",
        "sleep",
        "300",
    ]);
    assert_eq!(
        out.status.code(),
        Some(124),
        "stderr: {}",
        text(&out.stderr)
    );
    // Boot plus two seconds, far below the 300 s the command asked for (the bound leaves
    // room for a slow boot under nested emulation).
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "took {:?}",
        started.elapsed()
    );
}

/// Also `--stats=json`: what the VM cost, one JSON object on stderr after the command's own
/// output, stdout untouched.
#[test]
fn run_keeps_stdout_and_stderr_apart_and_passes_env_workdir_and_hostname() {
    let out = krunbox(&[
        "run",
        "--image",
        "busybox",
        "--env",
        "WHO=guest",
        "--workdir",
        "/tmp",
        "--hostname",
        "lane-9",
        "--stats=json",
        "--",
        "sh",
        "-c",
        "echo \"out $WHO $(pwd) $(hostname) $(cat /etc/hostname)\"; echo err-line >&2",
    ]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "out guest /tmp lane-9 lane-9\n");
    let stderr = text(&out.stderr);
    assert!(stderr.contains("err-line\n"), "{stderr}");
    assert!(!text(&out.stdout).contains("err-line"));
    let stats = stderr
        .lines()
        .find(|line| line.starts_with('{'))
        .unwrap_or_else(|| panic!("no stats line: {stderr}"));
    let stats: serde_json::Value = serde_json::from_str(stats).unwrap();
    assert!(stats["cpu_time"].as_f64().unwrap() > 0.0, "{stats}");
    assert!(stats["memory_peak_bytes"].as_u64().unwrap() > 0, "{stats}");
    assert!(stats["source"].is_string(), "{stats}");
    assert!(stats["host_boot_work"].as_f64().unwrap() > 0.0, "{stats}");
}

#[test]
fn run_on_the_agent_image_prints_the_guest_kernel_and_has_python_node_and_gh() {
    let out = krunbox(&[
        "run", "--", "sh", "-c",
        "uname -r; python3 -c 'import ssl, sqlite3; print(\"py-ok\")'; git --version; curl --version | head -n1; \
         node --version; command -v npm; grep -m1 '\"version\"' /usr/share/nodejs/npm/package.json; \
         gh --version | head -n1",
    ]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let mut lines = stdout.lines();
    let guest_release = lines.next().unwrap_or_default();
    let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_ne!(
        guest_release,
        host_release.trim(),
        "printed the host's kernel"
    );
    assert!(!guest_release.is_empty());
    assert!(stdout.contains("py-ok"), "{stdout}");
    assert!(stdout.contains("git version"), "{stdout}");
    assert!(stdout.contains("curl "), "{stdout}");
    // The agent runtimes and CLIs the reference suite expects (its sandbox-api #16). npm is
    // checked on PATH and by its package, not run: under the nested emulation anything that
    // starts V8 takes 15 s and `npm --version` 40 s (`node --version` starts no V8).
    assert!(
        stdout.lines().any(|line| line.starts_with("v18.")),
        "{stdout}"
    );
    assert!(stdout.contains("\"version\": \"9."), "{stdout}");
    assert!(stdout.contains("/usr/bin/npm"), "{stdout}");
    assert!(stdout.contains("gh version "), "{stdout}");
}

#[test]
fn run_reports_krunbox_failures_with_125_and_a_reason() {
    let out = krunbox(&["run", "--image", "busybox", "--", "/no/such/program"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(
        text(&out.stderr).contains("/no/such/program"),
        "{}",
        text(&out.stderr)
    );
    let out = krunbox(&["run", "--image", "no-such-image", "--", "true"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(
        text(&out.stderr).contains("not a built-in image"),
        "{}",
        text(&out.stderr)
    );
}

/// `krunbox run -it -- sh` on a real host terminal: the guest shell sees this terminal's size,
/// follows a resize (SIGWINCH), answers typed input, and its exit code comes back.
#[test]
fn run_it_gives_an_interactive_shell_with_the_terminal_size() {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    use std::sync::mpsc;

    let size = |rows, cols| nix::pty::Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = nix::pty::openpty(Some(&size(30, 100)), None).expect("openpty");
    let slave = std::fs::File::from(pty.slave);
    let mut child = Command::new(env!("CARGO_BIN_EXE_krunbox"));
    child
        .args(["run", "-it", "--image", "busybox", "--", "sh"])
        .stdin(slave.try_clone().unwrap())
        .stdout(slave.try_clone().unwrap())
        .stderr(slave.try_clone().unwrap());
    // SAFETY: setsid and ioctl are async-signal-safe; the terminal on fd 0 becomes krunbox's
    // controlling terminal, so a resize signals it as it would an interactive program.
    unsafe {
        child.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = child.spawn().expect("spawning krunbox");
    drop(slave);

    let master = std::fs::File::from(pty.master);
    let master_fd = master.as_raw_fd();
    let mut writer = master.try_clone().unwrap();
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let mut reader = master;
        let mut buf = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut screen = String::new();
    let mut expect = |needle: &str| {
        let deadline = Instant::now() + Duration::from_secs(180);
        while !screen.contains(needle) {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(bytes) => screen.push_str(&String::from_utf8_lossy(&bytes)),
                Err(_) => panic!("never saw {needle:?}; screen: {screen:?}"),
            }
        }
        screen.clear();
    };

    writer.write_all(b"stty size\r").unwrap();
    expect("30 100");
    // SAFETY: TIOCSWINSZ reads a valid winsize; the kernel sends SIGWINCH to krunbox.
    let ws = size(40, 120);
    assert_eq!(unsafe { libc::ioctl(master_fd, libc::TIOCSWINSZ, &ws) }, 0);
    std::thread::sleep(Duration::from_secs(2));
    writer.write_all(b"stty size\r").unwrap();
    expect("40 120");
    writer.write_all(b"echo typed-$((6*7))\r").unwrap();
    expect("typed-42");
    writer.write_all(b"exit 5\r").unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(5));
}

#[test]
fn doctor_boots_a_probe_vm_where_vms_boot() {
    // These tests run where microVMs boot (natively, or inside the nested harness's L1), so
    // the doctor's real probe must boot one, running libkrunfw's kernel.
    let out = krunbox(&["doctor", "--exit-code"]);
    let report = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{report}{}", text(&out.stderr));
    let expected = format!(
        "ok: a probe microVM booted (guest kernel {})",
        kernel::libkrunfw_release()
    );
    assert!(report.contains(&expected), "{report}");
    for part in [
        "VMM helper:",
        "guest-init:",
        "libkrunfw:",
        "image busybox:",
        "Isolation:",
    ] {
        let line = report.lines().find(|l| l.starts_with(part));
        assert!(
            line.is_some_and(|l| l.contains("ok")),
            "{part} is not ok: {report}"
        );
    }
    // The isolation layers this host gives the VMM helper, each on or off with its reason,
    // and the five canaries, all blocked.
    for layer in krunbox::Layer::ALL {
        let name = layer.to_string();
        let line = report
            .lines()
            .find(|l| l.contains(&format!("] {name}")))
            .unwrap_or_else(|| panic!("no line for {name}: {report}"));
        assert!(line.contains("[on ]") || line.contains("[OFF]"), "{line}");
    }
    let canaries: Vec<&str> = report
        .lines()
        .filter(|l| l.trim_start().starts_with("canary "))
        .collect();
    assert_eq!(canaries.len(), 5, "{report}");
    assert!(canaries.iter().all(|l| l.contains("blocked")), "{report}");
}

#[test]
fn run_mounts_host_directories_and_memory_filesystems() {
    let project = tempfile::tempdir().unwrap();
    let docs = tempfile::tempdir().unwrap();
    std::fs::write(project.path().join("in.txt"), "from the host\n").unwrap();
    std::fs::write(docs.path().join("guide.md"), "# guide\n").unwrap();
    let project_flag = format!("{}:/workspace", project.path().display());
    let docs_flag = format!("{}:/docs:ro", docs.path().display());
    let out = krunbox(&[
        "run",
        "--image",
        "busybox",
        "--mount",
        &project_flag,
        "--mount",
        &docs_flag,
        "--memfs",
        "/scratch",
        "--",
        "sh",
        "-c",
        "cat /workspace/in.txt /docs/guide.md; echo made > /workspace/out.txt; \
         echo x > /scratch/s && cat /scratch/s; echo y > /docs/new 2>&1; true",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.starts_with("from the host\n# guide\nx\n"),
        "{stdout}"
    );
    // The shell reports the refused redirection on its stderr.
    assert!(
        text(&out.stderr).contains("Read-only file system"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(project.path().join("out.txt")).unwrap(),
        "made\n"
    );
    assert!(!docs.path().join("new").exists());
}

/// `--persist PATH` makes the root writable and keeps it for the next run; `--ephemeral` makes
/// it writable for one run only.
#[test]
fn run_persists_a_writable_root_between_runs_and_ephemeral_forgets() {
    let dir = tempfile::tempdir().unwrap();
    let layer = dir.path().join("root.qcow2");
    let layer_flag = layer.display().to_string();
    let first = krunbox(&[
        "run",
        "--image",
        "busybox",
        "--persist",
        &layer_flag,
        "--",
        "sh",
        "-c",
        "echo kept > /etc/krunbox-cli && echo ok",
    ]);
    assert!(
        first.status.success(),
        "{}{}",
        text(&first.stdout),
        text(&first.stderr)
    );
    assert!(layer.is_file(), "no layer file was made");
    let second = krunbox(&[
        "run",
        "--image",
        "busybox",
        "--persist",
        &layer_flag,
        "--",
        "cat",
        "/etc/krunbox-cli",
    ]);
    assert_eq!(text(&second.stdout), "kept\n", "{}", text(&second.stderr));
    let ephemeral = krunbox(&[
        "run",
        "--image",
        "busybox",
        "--ephemeral",
        "32M",
        "--",
        "sh",
        "-c",
        "cat /etc/krunbox-cli 2>/dev/null; echo fresh > /etc/krunbox-cli && cat /etc/krunbox-cli",
    ]);
    assert_eq!(
        text(&ephemeral.stdout),
        "fresh\n",
        "{}",
        text(&ephemeral.stderr)
    );
    // A block store in a directory keeps changes too.
    let store = dir.path().join("blocks");
    let store_flag = store.display().to_string();
    let run = |script: &str| {
        krunbox(&[
            "run",
            "--image",
            "busybox",
            "--store",
            &store_flag,
            "--",
            "sh",
            "-c",
            script,
        ])
    };
    let first = run("echo stored > /etc/krunbox-cli && echo ok");
    assert_eq!(text(&first.stdout), "ok\n", "{}", text(&first.stderr));
    let second = run("cat /etc/krunbox-cli");
    assert_eq!(text(&second.stdout), "stored\n", "{}", text(&second.stderr));
}

/// `krunbox image import` keeps a `docker save` archive under a name, `image ls` lists it,
/// `run --image NAME` without a command runs its entrypoint (as its user, in its directory,
/// with its variables), `image rm` removes it.
#[test]
fn image_import_ls_run_and_rm() {
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("app.tar");
    std::fs::write(&archive, oci::docker_save()).unwrap();
    let images = dir.path().join("images");
    let krunbox = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_krunbox"))
            .args(args)
            .env("KRUNBOX_IMAGE_DIR", &images)
            .output()
            .expect("running krunbox")
    };
    let name = "app:1";
    let archive_flag = archive.display().to_string();
    let imported = krunbox(&["image", "import", &archive_flag, "--name", name]);
    assert!(imported.status.success(), "{}", text(&imported.stderr));
    assert!(images.join("app:1.qcow2").is_file());
    let listed = krunbox(&["image", "ls"]);
    assert!(
        text(&listed.stdout).contains(name),
        "{}",
        text(&listed.stdout)
    );
    let run = krunbox(&["run", "--image", name]);
    assert_eq!(
        text(&run.stdout),
        oci::ENTRYPOINT_OUTPUT,
        "{}",
        text(&run.stderr)
    );
    let removed = krunbox(&["image", "rm", name]);
    assert!(removed.status.success(), "{}", text(&removed.stderr));
    let listed = krunbox(&["image", "ls"]);
    assert!(
        !text(&listed.stdout).contains(name),
        "{}",
        text(&listed.stdout)
    );
    assert!(!krunbox(&["image", "rm", name]).status.success());
}

/// `krunbox image pull` with a password on stdin keeps a private image from a registry (on
/// loopback, token authentication) under its default name, `run --image NAME` runs its
/// entrypoint, `image rm` removes it and the blobs it was pulled from.
#[test]
fn image_pull_run_and_rm() {
    let (_runtime, registry) = registry::with_app("private/app", "1");
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    let krunbox = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_krunbox"))
            .args(args)
            .env("KRUNBOX_IMAGE_DIR", &images)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("running krunbox")
    };
    let reference = format!("{}/private/app:1", registry.host);
    let mut pull = krunbox(&[
        "image",
        "pull",
        "--plain-http",
        "--username",
        "reader",
        "--password-stdin",
        &reference,
    ]);
    use std::io::Write;
    writeln!(pull.stdin.take().unwrap(), "{}", registry::READER_PASSWORD).unwrap();
    let pulled = pull.wait_with_output().unwrap();
    assert!(pulled.status.success(), "{}", text(&pulled.stderr));
    assert!(images.join("app:1.qcow2").is_file());
    let blobs = || {
        std::fs::read_dir(images.join("blobs/sha256"))
            .map(|d| d.count())
            .unwrap_or(0)
    };
    assert_eq!(blobs(), 3, "two layers and the config");
    let listed = krunbox(&["image", "ls"]).wait_with_output().unwrap();
    assert!(
        text(&listed.stdout).contains("app:1")
            && text(&listed.stdout).contains(&format!("from {reference}")),
        "{}",
        text(&listed.stdout)
    );

    let run = krunbox(&["run", "--image", "app:1"])
        .wait_with_output()
        .unwrap();
    assert_eq!(
        text(&run.stdout),
        oci::ENTRYPOINT_OUTPUT,
        "{}",
        text(&run.stderr)
    );
    let removed = krunbox(&["image", "rm", "app:1"])
        .wait_with_output()
        .unwrap();
    assert!(removed.status.success(), "{}", text(&removed.stderr));
    assert_eq!(blobs(), 0);
}

/// `krunbox image build` runs its steps on the --from image and keeps the result by name;
/// `run --image NAME` boots it with the changes.
#[test]
fn image_build_then_run() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    let krunbox = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_krunbox"))
            .args(args)
            .env("KRUNBOX_IMAGE_DIR", &images)
            .output()
            .expect("running krunbox")
    };
    let built = krunbox(&[
        "image",
        "build",
        "tools",
        "--from",
        "busybox",
        "--memory",
        "256",
        "--run",
        "echo one > /etc/steps",
        "--run",
        "echo two >> /etc/steps",
    ]);
    assert!(built.status.success(), "{}", text(&built.stderr));
    let run = krunbox(&["run", "--image", "tools", "--", "cat", "/etc/steps"]);
    assert_eq!(text(&run.stdout), "one\ntwo\n", "{}", text(&run.stderr));
}

/// `krunbox run --image HOST/REPO:TAG` pulls a registry reference it does not have (here
/// anonymously, from a registry on loopback), runs its entrypoint, and runs the local copy the
/// next time without pulling again.
#[test]
fn run_pulls_a_registry_reference_once() {
    let (_runtime, registry) = registry::with_app("public/app", "7");
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    let reference = format!("{}/public/app:7", registry.host);
    let run = || {
        Command::new(env!("CARGO_BIN_EXE_krunbox"))
            .args(["run", "--plain-http", "--image", &reference])
            .env("KRUNBOX_IMAGE_DIR", &images)
            .output()
            .expect("running krunbox")
    };
    let first = run();
    assert_eq!(
        text(&first.stdout),
        oci::ENTRYPOINT_OUTPUT,
        "{}",
        text(&first.stderr)
    );
    assert!(
        text(&first.stderr).contains("pulled"),
        "{}",
        text(&first.stderr)
    );
    assert!(images.join("app:7.qcow2").is_file());
    let second = run();
    assert_eq!(
        text(&second.stdout),
        oci::ENTRYPOINT_OUTPUT,
        "{}",
        text(&second.stderr)
    );
    assert!(
        !text(&second.stderr).contains("pulled"),
        "{}",
        text(&second.stderr)
    );
}

/// As a user outside this repository (`scripts/as-a-user.sh` made what this runs, and the test
/// command runs it first): `krunbox` and `krunbox-vmm` from `cargo install --path`, and a fresh
/// project that depends on krunbox by path. The installed `krunbox setup` installs the helper
/// beside it and what the set-up built (guest-init, libkrunfw) into a data directory, in the
/// documented layout; the installed `krunbox run -- uname -r` and the project's program, each
/// alone in its directory, then boot VMs with the installed files, and without them say to run
/// `krunbox setup`.
#[test]
fn as_a_user_cargo_installs_and_an_embedders_project_boot_with_the_installed_artifacts() {
    use std::os::unix::fs::PermissionsExt;
    let target = std::path::Path::new(env!("CARGO_BIN_EXE_krunbox"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf();
    let user = target.join("as-a-user");
    let (cli, helper) = (user.join("bin/krunbox"), user.join("bin/krunbox-vmm"));
    let embedder = user.join("embedder/hello-krunbox");
    for built in [&cli, &helper, &embedder] {
        assert!(
            built.is_file(),
            "{} is missing: scripts/as-a-user.sh makes it (scripts/test.sh runs it)",
            built.display()
        );
    }
    // Each alone, as they run from a user's machine, with only what the user's environment
    // gives: the data directory, nothing that points into the build.
    let alone = |program: &std::path::Path, data: &std::path::Path| {
        let mut command = Command::new(program);
        command
            .env("KRUNBOX_DATA_DIR", data)
            .env_remove("KRUNBOX_VMM")
            .env_remove("KRUNBOX_GUEST_INIT")
            .env_remove("KRUNBOX_LIBKRUNFW_DIR");
        command
    };

    let data = tempfile::tempdir().unwrap();
    let set_up = alone(&cli, data.path()).arg("setup").output().unwrap();
    assert!(set_up.status.success(), "stderr: {}", text(&set_up.stderr));
    for file in ["bin/krunbox-vmm", "guest-init", "libkrunfw/libkrunfw.so.5"] {
        assert!(data.path().join(file).is_file(), "{file} not installed");
    }
    let installed_helper = data.path().join("bin/krunbox-vmm");
    assert_eq!(
        std::fs::read(&installed_helper).unwrap(),
        std::fs::read(&helper).unwrap(),
        "the helper installed is the one cargo installed beside krunbox"
    );
    let mode = std::fs::metadata(&installed_helper)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o111, 0o111, "the helper is executable");

    // The helper found now is the data directory's: move the installed programs where nothing
    // lies beside them.
    let elsewhere = tempfile::tempdir().unwrap();
    let (cli_alone, embedder_alone) = (
        elsewhere.path().join("krunbox"),
        elsewhere.path().join("hello-krunbox"),
    );
    std::fs::copy(&cli, &cli_alone).unwrap();
    std::fs::copy(&embedder, &embedder_alone).unwrap();

    let run = alone(&cli_alone, data.path())
        .args(["run", "--image", "busybox", "--", "uname", "-r"])
        .output()
        .unwrap();
    assert!(run.status.success(), "stderr: {}", text(&run.stderr));
    let release = text(&run.stdout).trim().to_string();
    assert!(!release.is_empty(), "no kernel release");

    let embedded = alone(&embedder_alone, data.path())
        .args(["uname", "-r"])
        .output()
        .unwrap();
    assert!(
        embedded.status.success(),
        "stderr: {}",
        text(&embedded.stderr)
    );
    assert_eq!(
        text(&embedded.stdout).trim(),
        release,
        "the embedder's guest runs the same installed kernel"
    );

    // Without the installed files, both say what to do (no VM boots).
    let empty = tempfile::tempdir().unwrap();
    let missing = alone(&cli_alone, empty.path())
        .args(["run", "--image", "busybox", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(
        missing.status.code(),
        Some(125),
        "{}",
        text(&missing.stderr)
    );
    let missing_embedded = alone(&embedder_alone, empty.path()).output().unwrap();
    assert!(!missing_embedded.status.success());
    for out in [&missing, &missing_embedded] {
        assert!(
            text(&out.stderr).contains("krunbox setup"),
            "{}",
            text(&out.stderr)
        );
    }
}

#[test]
fn run_snapshots_a_vm_and_a_later_run_starts_from_it() {
    let work = tempfile::tempdir().unwrap();
    let keys = work.path().join("keys");
    let snap = work.path().join("snap");
    let (keys, snap) = (keys.to_str().unwrap(), snap.to_str().unwrap());
    let first = krunbox(&[
        "run",
        "--image",
        "busybox",
        "--memory",
        "256",
        "--snapshot-key-dir",
        keys,
        "--snapshot-to",
        snap,
        "--",
        "sh",
        "-c",
        "echo kept > /tmp/f",
    ]);
    assert!(first.status.success(), "stderr: {}", text(&first.stderr));
    assert!(text(&first.stderr).contains("start from it with --from"));
    let second = krunbox(&[
        "run",
        "--image",
        "busybox",
        "--memory",
        "256",
        "--snapshot-key-dir",
        keys,
        "--from",
        snap,
        "--",
        "cat",
        "/tmp/f",
    ]);
    assert!(second.status.success(), "stderr: {}", text(&second.stderr));
    assert_eq!(text(&second.stdout), "kept\n");
    // Another definition (memory size) is refused, saying why.
    let other = krunbox(&[
        "run",
        "--image",
        "busybox",
        "--memory",
        "512",
        "--snapshot-key-dir",
        keys,
        "--from",
        snap,
        "--",
        "true",
    ]);
    assert!(!other.status.success());
    assert!(
        text(&other.stderr).contains("256 MiB"),
        "{}",
        text(&other.stderr)
    );
}
