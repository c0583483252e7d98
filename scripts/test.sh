#!/usr/bin/env bash
# test.sh: the whole test suite from a fresh checkout. Sets up what it needs (setup.sh), runs the
# host-only tests here, and the tests that boot microVMs with cargo-nextest, one process and one
# microVM per test: natively, or, where this host's KVM cannot boot guests, each test process
# inside a nested L1 VM (nested.sh serve/exec) that is replaced at once when it dies.
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

target=$(cargo_target_dir)
log "building the VM tests and benches"
cargo build -p krunbox --tests --benches >&2
# The bench executables (harness = false, so not nextest's): each runs once, as a smoke test.
mapfile -t benches < <(cargo test -p krunbox --benches --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["bench"]:
        print(m["target"]["name"], m["executable"])
')
((${#benches[@]})) || die "no bench binaries were built"

# Where VMs boot: natively, or in the nested L1 that `nested.sh serve` keeps alive (a fresh one
# replaces one that dies) with `nested.sh exec` as the target runner of every test process.
runner=()
if [[ $where == nested ]]; then
    pool=$target/nested-pool
    rm -rf "$pool"
    "$here/nested.sh" serve "$pool" --keep "$target" &
    serve_pid=$!
    # shellcheck disable=SC2064 # expand now: the pid is ours, and only ours is ended
    trap "kill $serve_pid 2>/dev/null; wait $serve_pid 2>/dev/null" EXIT
    export KRUNBOX_NESTED_POOL=$pool
    export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$here/nested.sh exec --"
    runner=("$here/nested.sh" exec --)
fi

# A failure is run again only when it carries the diagnosed signature of a fault of the nested
# hypervisor (junit-results.py), at most twice; a failure of ours never is.
retry_faults=$([[ $where == nested ]] && echo 1 || echo 0)
declare -A result=()
retried=()
filter=
junit=$target/nextest/vm/junit.xml
for attempt in 1 2 3; do
    log "VM tests$( ((attempt > 1)) && echo " (attempt $attempt, faulted tests only)") $([[ $where == native ]] && echo natively || echo 'in the nested L1')"
    rm -f "$junit"
    # The integration tests (kind(test)): the library's unit tests ran above, on the host.
    args=(cargo nextest run -p krunbox --tests --profile vm --no-fail-fast
        -E "kind(test)${filter:+ & ($filter)}")
    "${args[@]}" || true
    [[ -s $junit ]] || die "nextest wrote no JUnit report: the VM tests did not run"
    filter=
    while IFS=$'\t' read -r status binary name fault; do
        result["$binary $name"]=$status
        if [[ $status == fail ]] && ((fault && retry_faults && attempt < 3)); then
            retried+=("$binary $name")
            filter+="${filter:+ | }(binary_id(=$binary) & test(=$name))"
        fi
    done < <("$here/junit-results.py" "$junit")
    [[ -n $filter ]] || break
done

for bench in "${benches[@]}"; do
    read -r name path <<<"$bench"
    for attempt in 1 2 3; do
        log "bench $name, once as a smoke test$( ((attempt > 1)) && echo " (attempt $attempt)")"
        out=$("${runner[@]}" "$path" 2>&1) && status=pass || status=fail
        printf '%s\n' "$out"
        if [[ $status == fail ]] && ((retry_faults && attempt < 3)) &&
            grep -qE 'krunbox-nested-l1-died|krunbox-nested-emulation-fault|KVM_EXIT_SHUTDOWN' <<<"$out"; then
            retried+=("bench $name")
            continue
        fi
        break
    done
    result["bench $name"]=$status
done

passed=0 failed=0 skipped=0 broken=()
for key in "${!result[@]}"; do
    case ${result[$key]} in
    pass) passed=$((passed + 1)) ;;
    skip) skipped=$((skipped + 1)) broken+=("$key") ;;
    *) failed=$((failed + 1)) broken+=("$key") ;;
    esac
done
echo
echo "VM-booting tests (each in its own process, with its own microVM; benches count once):"
for key in "${retried[@]}"; do echo "run again after a fault of the nested hypervisor: $key"; done
if [[ -s ${pool:-/nonexistent}/deaths ]]; then
    echo "nested L1 deaths (each replaced by a fresh L1):"
    cat "$pool/deaths"
fi
echo "vm-suite: $passed passed, $failed failed, $skipped skipped"
if ((failed || skipped || passed == 0)); then
    printf 'failed or skipped (skipped tests count as failures here): %s\n' "${broken[*]}" >&2
    exit 1
fi
log "all tests passed in $((SECONDS - started)) s"
