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
/// spins and nothing moves. KVM's counters in debugfs show it: tens of thousands of injected
/// page faults and emulated instructions a second. Empty when the counters are unreadable or
/// calm.
pub fn nested_emulation_evidence() -> String {
    let read = |name: &str| -> Option<u64> {
        std::fs::read_to_string(format!("/sys/kernel/debug/kvm/{name}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let sample = || Some((read("pf_guest")?, read("insn_emulation")?));
    let Some((pf0, emul0)) = sample() else {
        return String::new();
    };
    std::thread::sleep(Duration::from_secs(2));
    let Some((pf1, emul1)) = sample() else {
        return String::new();
    };
    let (pf, emul) = (pf1.wrapping_sub(pf0), emul1.wrapping_sub(emul0));
    if pf < 2_000 || emul < 2_000 {
        return String::new();
    }
    format!(
        "\n{NESTED_FAULT_MARKER}: meanwhile KVM injected {pf} page faults and emulated {emul} \
         instructions in 2 s: the nested hypervisor is looping on one guest instruction \
         (docs/architecture.md, \"Testing under nested emulation\")"
    )
}
