//! POSIX conformance of the workspaces: pjdfstest (the Rust rewrite of the FreeBSD/ZFS
//! filesystem suite, crates.io `pjdfstest`), run as root in a real guest against a `MemoryFs`
//! and a `HostDir` mount, each in its own test and microVM.
//!
//! scripts/setup.sh builds pjdfstest as a static musl binary into
//! `$KRUNBOX_CACHE_DIR/tools/pjdfstest/bin/pjdfstest` (`KRUNBOX_PJDFSTEST` names another). The
//! test copies it into the guest, runs it on the mount, and compares with the baseline committed
//! beside this file (`tests/fs_conformance/<mount>.passing`, one pjdfstest test name a line): a
//! test of the baseline that no longer passes fails this test; a test that newly passes is only
//! reported, so the baseline can be raised. docs/fs-conformance.md records the counts per mount
//! and why each failing test fails.
//!
//! A run takes minutes under nested emulation, longer than the other VM tests' deadline:
//! these tests have their own ([`DEADLINE`]) and their own nextest override
//! (.config/nextest.toml).

#[allow(dead_code)] // common::run and its deadline: these tests have their own
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use krunbox::fs::{HostDir, MemoryFs, VirtualFs};
use krunbox::{BuiltinImage, Instance, Rootfs, Sandbox};

/// The longest one conformance test may take, boot to shutdown, under nested emulation (runs
/// took 2 to 8 minutes there, depending on how busy the host's cores were: see
/// docs/fs-conformance.md). Below nextest's limit for these tests (.config/nextest.toml: 17
/// minutes), so a hang fails here, with the hypervisor's evidence, rather than being killed
/// there.
const DEADLINE: Duration = Duration::from_secs(960);

/// The longest the whole pjdfstest run may take in the guest; its output so far is still read.
const SUITE_TIMEOUT: Duration = Duration::from_secs(780);

/// The longest the run of the EROFS tests alone may take.
const EROFS_TIMEOUT: Duration = Duration::from_secs(120);

/// Where the filesystem under test is mounted (its mount point is made in the guest's /tmp).
const MOUNT: &str = "/tmp/conformance";

/// pjdfstest's configuration. Features: the optional behaviours Linux filesystems have
/// (posix_fallocate, rename updating ctime, UTIME_NOW, utimensat); not FreeBSD's chflags,
/// birth times or NFSv4 ACLs. `naptime`, the pause between two changes whose timestamps must
/// differ, is far above the nanosecond timestamps of both implementations. The two
/// unprivileged users are the image's `nobody` and `tests`, which the test adds (see
/// [`GUEST_SETUP`]). `allow_remount` is false here: see [`CONFIG_EROFS`].
const CONFIG: &str = r#"
[features]
posix_fallocate = {}
rename_ctime = {}
utime_now = {}
utimensat = {}

[settings]
naptime = 0.01
allow_remount = false

[dummy_auth]
entries = [["nobody", "nogroup"], ["tests", "tests"]]
"#;

/// The EROFS tests remount the filesystem read-only and back (`mount -o remount,ro`). Late in
/// a whole run that fails with EBUSY on any filesystem (tmpfs on the host too): by then
/// pjdfstest's own earlier tests have left descriptors open for writing on it. So they run on
/// their own, in a second pjdfstest process, with remounts allowed.
const CONFIG_EROFS: &str = r#"
[settings]
naptime = 0.01
allow_remount = true

[dummy_auth]
entries = [["nobody", "nogroup"], ["tests", "tests"]]
"#;

/// The agent image (Debian), not busybox: pjdfstest's ETXTBSY tests copy `sleep` and run the
/// copy, and busybox's multi-call binary under another name exits at once ("applet not
/// found"), which made those tests races. The image has one unprivileged user (`nobody`);
/// pjdfstest needs two. Its root is read-only, so copies of /etc/passwd and /etc/group with a
/// `tests` user are bind-mounted over them. /tmp/secondary is the "other filesystem" of the
/// EXDEV tests (the guest's /tmp, a tmpfs).
const GUEST_SETUP: &str = "set -e
cp /etc/passwd /tmp/passwd && echo 'tests:x:1000:1000:pjdfstest:/:/bin/false' >> /tmp/passwd
cp /etc/group /tmp/group && echo 'tests:x:1000:' >> /tmp/group
mount --bind /tmp/passwd /etc/passwd
mount --bind /tmp/group /etc/group
mkdir -p /tmp/secondary
echo ready";

/// The pjdfstest binary: `$KRUNBOX_PJDFSTEST`, else where scripts/setup.sh installs it.
fn pjdfstest_binary() -> PathBuf {
    std::env::var_os("KRUNBOX_PJDFSTEST")
        .map(PathBuf::from)
        .unwrap_or_else(|| krunbox::cache_dir().join("tools/pjdfstest/bin/pjdfstest"))
}

/// Like `common::run`, with this file's longer [`DEADLINE`].
fn run<F: Future>(body: F) -> F::Output {
    common::rt().block_on(async {
        match tokio::time::timeout(DEADLINE, body).await {
            Ok(output) => output,
            Err(_) => panic!(
                "the test did not finish in {DEADLINE:?}{}",
                common::nested_emulation_evidence()
            ),
        }
    })
}

/// One pjdfstest run, read from its output.
#[derive(Debug, Default)]
struct Report {
    passed: BTreeSet<String>,
    /// Each failed test with what it said (its assertion's message).
    failed: BTreeMap<String, String>,
    skipped: BTreeSet<String>,
    /// pjdfstest's summary lines, one per finished run.
    summaries: Vec<String>,
}

/// Reads pjdfstest's output: a line `NAME  STATUS` per test (`ok`, `FAILED`, `skipped`), then
/// for a failure its panic message, indented, and a summary line at the end of a run. Given
/// several runs' output, a test's later result replaces its earlier one.
fn parse(output: &str) -> Report {
    let mut report = Report::default();
    let mut last_failed: Option<String> = None;
    for line in output.lines() {
        if line.starts_with("Summary:") {
            report.summaries.push(line.to_string());
            last_failed = None;
            continue;
        }
        let result = line
            .split_once(char::is_whitespace)
            .and_then(|(name, rest)| {
                let status = rest.trim();
                let known = ["ok", "FAILED", "skipped"].contains(&status);
                (known && name.contains("::")).then(|| (name.to_string(), status))
            });
        if let Some((name, _)) = &result {
            report.passed.remove(name);
            report.failed.remove(name);
            report.skipped.remove(name);
        }
        match result {
            Some((name, "ok")) => {
                report.passed.insert(name);
                last_failed = None;
            }
            Some((name, "skipped")) => {
                report.skipped.insert(name);
                last_failed = None;
            }
            Some((name, _)) => {
                report.failed.insert(name.clone(), String::new());
                last_failed = Some(name);
            }
            None => {
                if let Some(message) = last_failed.as_ref().and_then(|n| report.failed.get_mut(n)) {
                    if !message.is_empty() {
                        message.push_str(" / ");
                    }
                    message.push_str(line.trim());
                }
            }
        }
    }
    report
}

/// The committed baseline for `mount`: the tests that passed when it was last raised.
fn baseline(mount: &str) -> BTreeSet<String> {
    let text = match mount {
        "memoryfs" => include_str!("fs_conformance/memoryfs.passing"),
        "hostdir" => include_str!("fs_conformance/hostdir.passing"),
        _ => unreachable!(),
    };
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect()
}

/// Runs pjdfstest in the guest with `config` (written to `/tmp/<config_name>`) on [`MOUNT`],
/// only the tests whose names contain one of `patterns` (all when empty): its stdout, stderr,
/// exit status and how long it took.
async fn pjdfstest(
    vm: &Instance,
    config_name: &str,
    config: &str,
    patterns: &[&str],
    timeout: Duration,
) -> (String, String, String, Duration) {
    let config_path = format!("/tmp/{config_name}");
    vm.write_file(&config_path, config)
        .await
        .expect("writing pjdfstest's configuration");
    let started = Instant::now();
    let out = vm
        .command("/tmp/pjdfstest")
        .args(["-c", &config_path, "-p", MOUNT, "-s", "/tmp/secondary"])
        .args(patterns)
        .env("NO_COLOR", "1")
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .current_dir(MOUNT)
        .timeout(timeout)
        .output()
        .await
        .expect("running pjdfstest in the guest");
    (
        out.stdout_text(),
        out.stderr_text(),
        out.status.to_string(),
        started.elapsed(),
    )
}

/// Boots the agent image with `fs` at [`MOUNT`], runs pjdfstest there (the whole suite, then
/// the EROFS tests on their own) and checks the result against the baseline of `name`.
async fn conformance(name: &str, fs: impl VirtualFs + 'static) {
    let binary = pjdfstest_binary();
    let binary_bytes = std::fs::read(&binary).unwrap_or_else(|e| {
        panic!(
            "no pjdfstest at {} ({e}): run scripts/setup.sh",
            binary.display()
        )
    });
    let started = Instant::now();
    let vm: Instance = Sandbox::builder()
        .rootfs(Rootfs::builtin(BuiltinImage::Agent))
        .memory_mib(512)
        .mount(MOUNT, fs)
        .build()
        .expect("sandbox definition (run scripts/setup.sh)")
        .boot()
        .await
        .expect("booting");
    vm.write_file_with_mode("/tmp/pjdfstest", &binary_bytes, 0o755)
        .await
        .expect("copying pjdfstest into the guest");
    let setup = vm
        .command("sh")
        .args(["-c", GUEST_SETUP])
        .timeout(Duration::from_secs(60))
        .output()
        .await
        .expect("running sh in the guest");
    assert!(
        setup.status.success(),
        "guest setup failed: {}{}",
        setup.stdout_text(),
        setup.stderr_text()
    );
    let booted = started.elapsed();

    let (stdout, stderr, status, took) =
        pjdfstest(&vm, "pjdfstest.toml", CONFIG, &[], SUITE_TIMEOUT).await;
    let (erofs_stdout, erofs_stderr, erofs_status, erofs_took) =
        pjdfstest(&vm, "erofs.toml", CONFIG_EROFS, &["erofs"], EROFS_TIMEOUT).await;
    vm.shutdown().await.expect("shutting the guest down");
    let report = parse(&format!("{stdout}\n{erofs_stdout}"));
    let stderr = format!("{stderr}{erofs_stderr}");

    let expected = baseline(name);
    let regressed: Vec<&String> = expected
        .iter()
        .filter(|t| !report.passed.contains(*t))
        .collect();
    let newly: Vec<&String> = report
        .passed
        .iter()
        .filter(|t| !expected.contains(*t))
        .collect();

    println!(
        "pjdfstest on {name}: {} passed, {} failed, {} skipped ({} in the baseline); boot and \
         setup {booted:.1?}, the suite {took:.1?} ({status}), the EROFS tests {erofs_took:.1?} \
         ({erofs_status})",
        report.passed.len(),
        report.failed.len(),
        report.skipped.len(),
        expected.len(),
    );
    for (test, message) in &report.failed {
        println!("  FAILED {test}: {message}");
    }
    for test in &report.skipped {
        println!("  skipped {test}");
    }
    if !newly.is_empty() {
        println!(
            "newly passing on {name}, not yet in tests/fs_conformance/{name}.passing (add them \
             to raise the baseline):"
        );
        for test in &newly {
            println!("{test}");
        }
    }
    if std::env::var_os("KRUNBOX_CONFORMANCE_DUMP").is_some() {
        println!("--- pjdfstest's output ---\n{stdout}\n{erofs_stdout}\n--- stderr ---\n{stderr}");
    }

    let why = |test: &str| -> String {
        match report.failed.get(test) {
            Some(message) => format!("{test}: FAILED: {message}"),
            None if report.skipped.contains(test) => format!("{test}: skipped"),
            None => format!("{test}: did not run"),
        }
    };
    assert!(
        regressed.is_empty(),
        "{} test(s) of the baseline no longer pass on {name}:\n{}\n{}\nstderr: {stderr}",
        regressed.len(),
        regressed
            .iter()
            .map(|t| why(t))
            .collect::<Vec<_>>()
            .join("\n"),
        report.summaries.join("\n"),
    );
    let tail = |out: &str| -> String {
        let lines: Vec<&str> = out.lines().collect();
        lines[lines.len().saturating_sub(10)..].join("\n")
    };
    assert!(
        report.summaries.len() == 2,
        "pjdfstest did not finish: the suite ({status}, {took:?}) ended with\n{}\nthe EROFS \
         tests ({erofs_status}, {erofs_took:?}) with\n{}\nstderr: {stderr}",
        tail(&stdout),
        tail(&erofs_stdout),
    );
}

#[test]
fn pjdfstest_on_a_memory_fs_passes_its_baseline() {
    run(conformance("memoryfs", MemoryFs::new()))
}

#[test]
fn pjdfstest_on_a_host_dir_passes_its_baseline() {
    let dir = tempfile::tempdir().expect("a host directory");
    run(conformance(
        "hostdir",
        HostDir::new(dir.path()).expect("HostDir"),
    ))
}

/// The parser, on pjdfstest's own output (no VM).
#[test]
fn pjdfstest_output_is_parsed() {
    let out = "chmod::update_ctime::regular                                                  ok\n\
               link::link_count_max                                                      FAILED\n\
               \tassertion `left == right` failed\n  left: Ok(())\n right: Err(EMLINK)\n\
               open::erofs_named                                                        skipped\n\
               \tRemounts (allow_remount) are not allowed in the configuration file\n\
               \nSummary: 1 failed, 1 skipped, 1 passed, 0 expected failures, 3 total\n";
    let report = parse(out);
    assert_eq!(
        report.passed.iter().collect::<Vec<_>>(),
        ["chmod::update_ctime::regular"]
    );
    assert_eq!(
        report.failed["link::link_count_max"],
        "assertion `left == right` failed / left: Ok(()) / right: Err(EMLINK)"
    );
    assert!(report.skipped.contains("open::erofs_named"));
    assert_eq!(report.summaries.len(), 1);

    // A later run's result for a test replaces an earlier one's.
    let again = parse(&format!(
        "{out}open::erofs_named      ok\nSummary: 0 failed, 0 skipped, 1 passed\n"
    ));
    assert!(again.passed.contains("open::erofs_named"));
    assert!(!again.skipped.contains("open::erofs_named"));
    assert_eq!(again.summaries.len(), 2);
}
