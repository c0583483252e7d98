//! Shared by the test binaries that boot microVMs: one tokio runtime per test process and a
//! deadline for every test. scripts/test.sh runs these tests with cargo-nextest, so every test is
//! a process of its own and boots its own microVM (a `static` VM is per test there); under plain
//! `cargo test` the tests of one binary share it.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use tokio::runtime::Runtime;

/// Longest any single VM test may take, even under nested emulation (the slowest take about
/// half a minute there). A test that hangs fails with this, saying what KVM was doing, before
/// nextest's own limit (.config/nextest.toml: 300 s) kills it.
pub const TEST_DEADLINE: Duration = Duration::from_secs(240);

/// What `scripts/junit-results.py` looks for to tell a fault of the nested hypervisor from a
/// failure of ours.
pub const NESTED_FAULT_MARKER: &str = "krunbox-nested-emulation-fault";

/// One runtime for the whole binary.
pub fn rt() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| Runtime::new().expect("tokio runtime"))
}

/// Runs one test's body on the shared runtime; fails the test if it takes longer than
/// [`TEST_DEADLINE`], saying what the hypervisor underneath was doing if that can be read.
pub fn run<F: Future>(body: F) -> F::Output {
    rt().block_on(async {
        match tokio::time::timeout(TEST_DEADLINE, body).await {
            Ok(output) => output,
            Err(_) => panic!(
                "the test did not finish in {TEST_DEADLINE:?}{}",
                nested_emulation_evidence()
            ),
        }
    })
}

/// Under nested emulation (scripts/nested.sh: KVM inside a QEMU-TCG L1 whose emulated SVM has
/// no NRIP-save or decode assists), L1's KVM sometimes loops forever emulating one guest
/// instruction and injecting a page fault the guest's handler finds spurious; the guest's vCPU
/// spins and nothing moves. KVM's per-VM counters in debugfs (`kvm/PID-FD/`) show it: tens of
/// thousands of injected page faults and emulated instructions a second. Only this process's
/// own VMM processes (its children, or their children) are looked at: another test beside this
/// one may loop without this one's hang being a fault. Empty when the counters are unreadable or
/// calm.
pub fn nested_emulation_evidence() -> String {
    let ours = std::process::id().to_string();
    let sample = || -> Vec<(String, u64, u64)> {
        let Ok(dirs) = std::fs::read_dir("/sys/kernel/debug/kvm") else {
            return Vec::new();
        };
        dirs.filter_map(|d| {
            let dir = d.ok()?.path();
            let name = dir.file_name()?.to_str()?.to_owned();
            let pid = name.split_once('-')?.0;
            // /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces, not ')'.
            let ppid = |pid: &str| -> Option<String> {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
                Some(
                    stat.rsplit_once(')')?
                        .1
                        .split_whitespace()
                        .nth(1)?
                        .to_string(),
                )
            };
            // The VMM is the helper this process started, or (in the helper's own pid
            // namespace) that helper's child.
            let parent = ppid(pid)?;
            if parent != ours && ppid(&parent).as_deref() != Some(ours.as_str()) {
                return None;
            }
            let read = |file: &str| -> Option<u64> {
                std::fs::read_to_string(dir.join(file))
                    .ok()?
                    .trim()
                    .parse()
                    .ok()
            };
            Some((name, read("pf_guest")?, read("insn_emulation")?))
        })
        .collect()
    };
    let before = sample();
    if before.is_empty() {
        return String::new();
    }
    std::thread::sleep(Duration::from_secs(2));
    let after = sample();
    for (vm, pf1, emul1) in &after {
        let Some((_, pf0, emul0)) = before.iter().find(|(name, ..)| name == vm) else {
            continue;
        };
        let (pf, emul) = (pf1.wrapping_sub(*pf0), emul1.wrapping_sub(*emul0));
        if pf >= 2_000 && emul >= 2_000 {
            return format!(
                "\n{NESTED_FAULT_MARKER}: meanwhile KVM injected {pf} page faults and emulated \
                 {emul} instructions in 2 s into this test's microVM {vm}: the nested hypervisor \
                 is looping on one guest instruction (docs/testing.md)"
            );
        }
    }
    String::new()
}

/// Reads from `reader` until the accumulated text contains `needle`; returns the text.
#[allow(dead_code)] // not every test binary reads a terminal
pub async fn read_until<R: tokio::io::AsyncRead + Unpin>(reader: &mut R, needle: &str) -> String {
    let mut text = String::new();
    let mut buf = [0u8; 4096];
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !text.contains(needle) {
        assert!(
            std::time::Instant::now() < deadline,
            "never saw {needle:?}; got {text:?}"
        );
        let n = match tokio::time::timeout(
            Duration::from_secs(60),
            tokio::io::AsyncReadExt::read(reader, &mut buf),
        )
        .await
        {
            Ok(result) => result.expect("read"),
            Err(_) => panic!("no output for 60 s while waiting for {needle:?}; got {text:?}"),
        };
        assert!(n > 0, "stream ended before {needle:?}; got {text:?}");
        text.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    text
}
