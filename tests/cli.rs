//! The `krunbox` command line, run as a user would: each case boots a real microVM.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

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
        "30",
    ]);
    assert_eq!(
        out.status.code(),
        Some(124),
        "stderr: {}",
        text(&out.stderr)
    );
    // Boot plus two seconds, far below the 30 s the command asked for.
    assert!(
        started.elapsed() < Duration::from_secs(28),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn run_keeps_stdout_and_stderr_apart_and_passes_env_and_workdir() {
    let out = krunbox(&[
        "run",
        "--image",
        "busybox",
        "--env",
        "WHO=guest",
        "--workdir",
        "/tmp",
        "--",
        "sh",
        "-c",
        "echo \"out $WHO $(pwd)\"; echo err-line >&2",
    ]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "out guest /tmp\n");
    assert!(
        text(&out.stderr).contains("err-line\n"),
        "{}",
        text(&out.stderr)
    );
    assert!(!text(&out.stdout).contains("err-line"));
}

#[test]
fn run_on_the_agent_image_prints_the_guest_kernel_and_has_python() {
    let out = krunbox(&[
        "run", "--", "sh", "-c",
        "uname -r; python3 -c 'import ssl, sqlite3; print(\"py-ok\")'; git --version; curl --version | head -n1",
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
