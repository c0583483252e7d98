#!/usr/bin/env bash
# fault-rate.sh NAME RUNS WORKLOAD: measure how often the nested emulation faults (docs/testing.md).
#
# Boots a pool L1 (nested.sh serve) with the QEMU configuration in the environment
# (KRUNBOX_NESTED_ACCEL, _SMP, _CPU; see nested.sh) and runs WORKLOAD RUNS times, one fresh
# microVM each, one after another. WORKLOAD is
#   stream:MIB   a busybox guest writes MIB MiB of zeros to stdout, over the control channel
#   block        an agent guest reads every file of its root image (virtio-blk, erofs)
# Prints one line per run and, last, a table row:
#   NAME | runs | ok | guest triple fault | wedged | L1 died | too slow | other | median s of ok
# Needs scripts/setup.sh to have run (it uses the debug build of the krunbox CLI).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"
name=$1 runs=$2 workload=$3
krunbox=$(cargo_target_dir)/debug/krunbox
[[ -x $krunbox ]] || die "no $krunbox: run scripts/setup.sh first"
case $workload in
stream:*)
    mib=${workload#stream:}
    want=$((mib << 20))
    cmd=(sh -c "$(printf '%q ' "$krunbox") run --image busybox -- head -c $want /dev/zero | wc -c")
    ;;
block)
    want=
    cmd=("$krunbox" run --image agent --memory 1024 -- sh -c
        'find / -xdev -type f -print0 | xargs -0 cat | wc -c')
    ;;
*) die "unknown workload $workload" ;;
esac

pool=$(mktemp -d "${TMPDIR:-/tmp}/krunbox-fault-rate.XXXXXX")
"$here/nested.sh" serve "$pool" &
serve_pid=$!
# shellcheck disable=SC2064 # expand now: our own pid and directory
trap "kill $serve_pid 2>/dev/null; wait $serve_pid 2>/dev/null; rm -rf '$pool'" EXIT
export KRUNBOX_NESTED_POOL=$pool

ok=0 triple=0 wedged=0 died=0 slow=0 other=0 times=()
for ((i = 1; i <= runs; i++)); do
    t0=$SECONDS
    # A run that takes KRUNBOX_FAULT_RATE_TIMEOUT seconds (default 300) counts as wedged: set
    # it to a few times a healthy run (about 25 s for stream:128 under TCG here).
    out=$(timeout -s TERM "${KRUNBOX_FAULT_RATE_TIMEOUT:-300}" "$here/nested.sh" exec -- "${cmd[@]}" 2>&1)
    rc=$?
    took=$((SECONDS - t0))
    last=$(tail -n 1 <<<"$out")
    if ((rc == 0)) && [[ -z $want || $last == "$want" ]]; then
        verdict=ok ok=$((ok + 1)) times+=("$took")
    elif grep -q 'krunbox-nested-l1-died' <<<"$out"; then
        verdict=l1-died died=$((died + 1))
    elif grep -q 'KVM_EXIT_SHUTDOWN' <<<"$out"; then
        verdict=triple-fault triple=$((triple + 1))
    elif grep -qiE 'GuestHung|liveness ping|krunbox-nested-emulation-fault' <<<"$out"; then
        # Declared hung by the library's liveness check, or KVM in L1 seen looping meanwhile.
        verdict=wedged wedged=$((wedged + 1))
    elif ((rc == 124 || rc == 143)); then
        # Out of time with no sign of a wedge: too slow, not faulted.
        verdict=too-slow slow=$((slow + 1))
    else
        verdict=other other=$((other + 1))
    fi
    echo "run $i: $verdict in ${took} s (exit $rc): ${last:0:160}"
    [[ $verdict == other ]] && tail -n 5 <<<"$out"
done
median=-
if ((${#times[@]})); then
    median=$(printf '%s\n' "${times[@]}" | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
fi
echo "| $name | $runs | $ok | $triple | $wedged | $died | $slow | $other | $median |"
