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
# The helper's workspace (vmm/) and tests/plain-libkrun are workspaces of their own, which the
# two above do not reach.
cargo fmt --manifest-path vmm/Cargo.toml --all -- --check
cargo clippy --locked --manifest-path vmm/Cargo.toml --workspace --all-targets -- -D warnings
cargo fmt --manifest-path tests/plain-libkrun/Cargo.toml -- --check
cargo clippy --locked --manifest-path tests/plain-libkrun/Cargo.toml --target-dir "$(cargo_target_dir)" -- -D warnings

log "host tests (no VM): protocol, virtio, rootfs, library, CLI and helper units, doc tests"
# The two packages whose integration tests boot microVMs: those run below, with nextest. Their
# unit tests (the library's, the CLI's argument parsing) run here, on the host.
vm_packages=(-p krunbox -p krunbox-cli)
cargo test --workspace --exclude krunbox --exclude krunbox-cli
cargo test -p krunbox --lib --bins
cargo test -p krunbox-cli --bins
cargo test -p krunbox --doc
# The helper's units: its jail's filters, its devices driven over real guest memory against the
# library's real services, krun-sys's doc tests.
cargo test --locked --manifest-path vmm/Cargo.toml --workspace

# As a user outside the repository: `cargo install --path` of the CLI and the helper, and a
# fresh project that depends on krunbox (no libkrun in its tree, checked); the VM test
# `as_a_user_...` (cli/tests/cli.rs) boots with what they installed.
"$here/as-a-user.sh"

target=$(cargo_target_dir)
log "building the VM tests and benches"
cargo build "${vm_packages[@]}" --tests --benches >&2
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

# The Python package: its wheel built from this clone into a fresh virtualenv (python.sh), and
# its pytest tests, each run below like a VM test, in its own process and microVMs.
"$here/python.sh" build
mapfile -t python_tests < <("$here/python.sh" tests)
((${#python_tests[@]})) || die "no Python tests were collected"

# The Node package: its addon, types and TypeScript built from this clone (node.sh), and its
# node --test files, each run below like a VM test, in its own process and microVMs.
"$here/node.sh" build
mapfile -t node_tests < <("$here/node.sh" tests)
((${#node_tests[@]})) || die "no Node tests were found"

# Where VMs boot: natively, or in the nested L1 that `nested.sh serve` keeps alive (a fresh one
# replaces one that dies) with `nested.sh exec` as the target runner of every test process.
# Two L1s of one vCPU each, one test at a time in each: measured, L1s with two vCPUs faulted in
# 19 of 100 runs of a 128 MiB stream, L1s with one in 1 of 60 (docs/testing.md); two of them
# keep both host cores busy.
runner=() pools=() serve_pids=()
if [[ $where == nested ]]; then
    pool=$target/nested-pool
    rm -rf "$pool"
    for i in $(seq "${KRUNBOX_NESTED_L1S:-2}"); do
        "$here/nested.sh" serve "$pool/l1-$i" --mem 4096 --keep "$target" &
        serve_pids+=($!)
        pools+=("$pool/l1-$i")
    done
    # cargo splits a runner's command line at spaces: a path without any calls ours.
    shim=$(mktemp -d /tmp/krunbox-runner.XXXXXX)
    printf '#!/bin/bash\nexec %q exec -- "$@"\n' "$here/nested.sh" >"$shim/runner"
    chmod +x "$shim/runner"
    # shellcheck disable=SC2064 # expand now: the pids are ours, and only ours are ended
    trap "kill ${serve_pids[*]} 2>/dev/null; wait ${serve_pids[*]} 2>/dev/null; rm -rf '$shim'" EXIT
    KRUNBOX_NESTED_POOL=$(IFS=:; echo "${pools[*]}")
    export KRUNBOX_NESTED_POOL
    export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER=$shim/runner
    runner=("$shim/runner")
fi

# The integration tests (kind(test)) of both packages: their unit tests ran above, on the host.
# Ignored tests run too: none may be skipped. Listed on the host (a listing needs no VM) to check
# that the JUnit report has every one of them.
vm_tests="kind(test)"
expected=$(env -u CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER cargo nextest list \
    "${vm_packages[@]}" --tests --run-ignored all -E "$vm_tests" --message-format oneline \
    2>/dev/null | grep -c .) || die "cargo nextest list failed"

# A failure is run again only when it carries the diagnosed signature of a fault of the nested
# hypervisor (docs/testing.md), at most twice; a failure of ours never is.
fault_signature='krunbox-nested-l1-died|krunbox-nested-emulation-fault|KVM_EXIT_SHUTDOWN'
retry_faults=$([[ $where == nested ]] && echo 1 || echo 0)
declare -A result=() why=()
retried=()
filter=
junit=$target/nextest/vm/junit.xml
for attempt in 1 2 3; do
    log "VM tests$( ((attempt > 1)) && echo " (attempt $attempt, faulted tests only)") $([[ $where == native ]] && echo natively || echo 'in the nested L1')"
    rm -f "$junit"
    cargo nextest run "${vm_packages[@]}" --tests --profile vm --no-fail-fast --run-ignored all \
        ${pools[0]:+--test-threads ${#pools[@]}} -E "$vm_tests${filter:+ & ($filter)}" || true
    [[ -s $junit ]] || die "nextest wrote no JUnit report: the VM tests did not run"
    cases=$("$here/junit-results.py" "$junit" "$fault_signature") || die "cannot read $junit"
    if ((attempt == 1)); then
        got=$(grep -c . <<<"$cases")
        ((got == expected)) || die "the JUnit report has $got tests, nextest lists $expected"
    fi
    filter=
    while IFS=$'\t' read -r status binary name fault reason; do
        result["$binary $name"]=$status
        why["$binary $name"]=$reason
        if [[ $status == fail ]] && ((fault && retry_faults && attempt < 3)); then
            retried+=("$binary $name")
            filter+="${filter:+ | }(binary_id(=$binary) & test(=$name))"
        fi
    done <<<"$cases"
    [[ -n $filter ]] || break
done

# One job in its own process (where VMs boot: through the runner), retried like a VM test
# after a diagnosed fault: run_job NAME DIR CMD [ARG]... puts its output into DIR/NAME.out, its
# status (pass or fail, and whether it was retried) into DIR/NAME.status. NAME is a file name.
run_job() {
    local name=$1 dir=$2 out status retried=0
    shift 2
    for attempt in 1 2 3; do
        # A deadline: a job's own hang must not eat CI's time (about a minute here).
        out=$(timeout -s TERM 600 "${runner[@]}" "$@" 2>&1) && status=pass || status=fail
        printf '%s\n' "$out" >>"$dir/$name.out"
        if [[ $status == fail ]] && ((retry_faults && attempt < 3)) && grep -qE "$fault_signature" <<<"$out"; then
            retried=1
            printf '(attempt %s after a fault of the nested hypervisor)\n' $((attempt + 1)) >>"$dir/$name.out"
            continue
        fi
        break
    done
    echo "$status $retried" >"$dir/$name.status"
}

# The MCP server's tests (Python's and Node's official clients) and the tools bench run this
# build's CLI.
export KRUNBOX_CLI=$target/debug/krunbox

# The bench smokes and the Python and Node tests, in one queue with as many jobs at once as there are
# L1s (or one natively): the runner gives each its own. A job is "KEY|DIR|PROGRAM ARG...", its
# words without spaces; KEY names its result, DIR is where it runs.
queue=()
for bench in "${benches[@]}"; do
    read -r name path <<<"$bench"
    queue+=("bench $name|.|$path")
done
queue+=("bench python|bindings/python|$target/python/venv/bin/python benches/bench_exec.py")
for id in "${python_tests[@]}"; do
    queue+=("python $id|bindings/python|$target/python/venv/bin/python -m pytest -q -p no:cacheprovider $id")
done
queue+=("bench node|bindings/node|node build/bindings/node/benches/bench_exec.js")
for file in "${node_tests[@]}"; do
    queue+=("node $file|bindings/node|node --test $file")
done
job_dir=$(mktemp -d /tmp/krunbox-jobs.XXXXXX)
parallel=$(( ${#pools[@]} > 1 ? ${#pools[@]} : 1 ))
running=()
for i in "${!queue[@]}"; do
    IFS="|" read -r key dir line <<<"${queue[$i]}"
    read -ra argv <<<"$line"
    log "$key"
    (cd "$dir" && run_job "job-$i" "$job_dir" "${argv[@]}") &
    running+=($!)
    if ((${#running[@]} >= parallel)); then
        # The next job starts as soon as any running one ends (not the oldest: an L1 would
        # sit idle behind a long job).
        finished=
        wait -n -p finished "${running[@]}" || true
        [[ -n $finished ]] || { wait "${running[0]}" || true; finished=${running[0]}; }
        still=()
        for pid in "${running[@]}"; do [[ $pid == "$finished" ]] || still+=("$pid"); done
        running=("${still[@]}")
    fi
done
for pid in "${running[@]}"; do wait "$pid" || true; done
for i in "${!queue[@]}"; do
    IFS='|' read -r key _ <<<"${queue[$i]}"
    read -r status was_retried <"$job_dir/job-$i.status" || status=fail was_retried=0
    # A bench's output is its report; a test's is shown when it failed.
    if [[ $key == bench* || $status != pass ]]; then cat "$job_dir/job-$i.out" 2>/dev/null || true; fi
    ((was_retried)) && retried+=("$key")
    result["$key"]=$status
done
rm -rf "$job_dir"

passed=0 failed=0 skipped=0 broken=()
for key in "${!result[@]}"; do
    case ${result[$key]} in
    pass) passed=$((passed + 1)) ;;
    skip) skipped=$((skipped + 1)) broken+=("$key") ;;
    *) failed=$((failed + 1)) broken+=("$key") ;;
    esac
done
ok=$( ((failed || skipped || passed == 0)) && echo 0 || echo 1)
((ok)) || log "failed or skipped (skipped tests count as failures here): ${broken[*]}"
((ok == 0)) || log "all tests passed in $((SECONDS - started)) s"
echo
echo "VM-booting tests (each in its own process, with its own microVM; benches count once):"
for key in "${retried[@]}"; do echo "run again after a fault of the nested hypervisor: $key"; done
# Why each failed VM test failed, in the last lines, which are what a reader of CI's log sees
# first (nextest's own report of a failure is far above, behind the passing runs' output).
for key in "${broken[@]}"; do
    if [[ -n ${why[$key]:-} ]]; then echo "why $key failed: ${why[$key]}"; fi
done
for p in "${pools[@]}"; do
    if [[ -s $p/deaths ]]; then
        echo "nested L1 deaths in ${p##*/} (each replaced by a fresh L1):"
        cat "$p/deaths"
    fi
done
echo "vm-suite: $passed passed, $failed failed, $skipped skipped"
((ok))
