#!/usr/bin/env bash
# vm-suite.sh LIST: run the prebuilt test and bench binaries named in LIST (lines of
# "KIND NAME PATH", from test.sh) on a host where microVMs boot, and total their results.
# Every test here boots real microVMs; none is skipped. Benches run once, as smoke tests.
set -uo pipefail
list=$1
passed=0 failed=0 ignored=0 broken=()
while read -r kind name path; do
    echo "==> $kind $name" >&2
    out=$(mktemp)
    if [[ $kind == bench ]]; then
        "$path" 2>&1 | tee "$out"
        rc=${PIPESTATUS[0]}
        if ((rc == 0)); then passed=$((passed + 1)); else failed=$((failed + 1)) broken+=("$name"); fi
    else
        "$path" --test-threads 2 2>&1 | tee "$out"
        rc=${PIPESTATUS[0]}
        counts=$(sed -n 's/^test result: .*\. \([0-9]*\) passed; \([0-9]*\) failed; \([0-9]*\) ignored.*/\1 \2 \3/p' "$out" | tail -n1)
        read -r p f i <<<"$counts"
        passed=$((passed + ${p:-0})) failed=$((failed + ${f:-0})) ignored=$((ignored + ${i:-0}))
        if ((rc != 0)) || [[ -z ${p:-} ]]; then broken+=("$name"); fi
    fi
    rm -f "$out"
done <"$list"
echo
echo "VM-booting tests (each boots real microVMs; benches count once):"
echo "vm-suite: $passed passed, $failed failed, $ignored skipped"
if ((${#broken[@]} || failed || ignored)); then
    echo "failed or incomplete: ${broken[*]:-} (skipped tests count as failures here)" >&2
    exit 1
fi
