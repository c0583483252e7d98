#!/usr/bin/env bash
# test.sh: the whole test suite from a fresh checkout. Sets up what it needs (setup.sh), runs the
# host-only tests here, and the tests that boot microVMs natively or, where this host's KVM
# cannot boot guests, inside one nested L1 VM (nested.sh) for the whole VM suite.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"
cd "$here/.."
started=$SECONDS

where=$("$here/setup.sh" | tail -n1)

log "krunbox doctor on this host"
# On nested PVM hosts (the project's machines) the doctor must say so plainly, and fail
# --exit-code: that verdict is what sends the VM suite to the nested harness.
doctor_rc=0
report=$("$(cargo_target_dir)/debug/krunbox" doctor --exit-code) || doctor_rc=$?
if [[ -e /sys/module/kvm_pvm ]]; then
    ((doctor_rc != 0)) || die "krunbox doctor --exit-code passed on a nested PVM host: $report"
    grep -q 'nested PVM' <<<"$report" && grep -q 'scripts/nested.sh' <<<"$report" ||
        die "krunbox doctor did not name nested PVM and the nested harness: $report"
fi
if [[ $where == native ]]; then
    ((doctor_rc == 0)) || die "setup chose native VMs, but krunbox doctor says: $report"
else
    ((doctor_rc != 0)) || die "setup chose the nested harness, but krunbox doctor passes"
fi

log "formatting and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings

log "host tests (no VM): protocol, krun-sys, rootfs, library units, doc tests"
cargo test --workspace --exclude krunbox
cargo test -p krunbox --lib --bins
cargo test -p krunbox --doc

log "building the VM test binaries"
target=$(cargo_target_dir)
# The executables of krunbox's integration tests and benches, built here, run where VMs boot.
mapfile -t binaries < <(cargo test -p krunbox --tests --benches --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    kind = m.get("target", {}).get("kind", [""])[0]
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"] and kind in ("test", "bench"):
        print(kind, m["target"]["name"], m["executable"])
')
((${#binaries[@]})) || die "no VM test binaries were built"
printf '%s\n' "${binaries[@]}" >"$target/vm-suite.list"

log "VM tests: running ${#binaries[@]} binaries $([[ $where == native ]] && echo natively || echo 'inside the nested L1 VM')"
if [[ $where == native ]]; then
    "$here/vm-suite.sh" "$target/vm-suite.list"
else
    # One L1 for the whole suite. Its time limit leaves room in CI's 90 minutes; a binary that
    # fails on a fault of the nested hypervisor itself is run again, at most twice (vm-suite.sh).
    KRUNBOX_NESTED_TIMEOUT=${KRUNBOX_NESTED_TIMEOUT:-3000} "$here/nested.sh" run --keep "$target" \
        --env KRUNBOX_NESTED_FAULT_RETRY=1 --env KRUNBOX_TEST_STREAM_MIB=256 \
        -- "$here/vm-suite.sh" "$target/vm-suite.list"
fi
log "all tests passed in $((SECONDS - started)) s"
