#!/usr/bin/env bash
# nested.sh: run a command where libkrun can really boot guests.
#
# The host's /dev/kvm is nested PVM, which only runs PVM-built guest kernels,
# so libkrun's guests cannot boot on it (shared/notes/kvm-on-these-machines.md).
# Instead we boot a throwaway "L1" VM under QEMU's software emulation (TCG)
# with an emulated AMD SVM CPU: Debian bookworm's kernel loads kvm-amd and
# gets a /dev/kvm that libkrun can use. L1 sees the host's whole filesystem
# read-only over virtio-9p and runs the command there, at the caller's cwd.
#
#   scripts/nested.sh prepare
#       Install QEMU & co., fetch the L1 kernel, build the initramfs (cached).
#   scripts/nested.sh run [--mem MIB] [--cwd DIR] [--env NAME[=VALUE]]...
#                         [--keep DIR]... -- CMD [ARG]...
#       Boot L1, run CMD in it, power L1 off; exits with CMD's exit status.
#       CMD's stdout/stderr stream live to ours (as ttys only if ours are);
#       its stdin is /dev/null. Nothing else L1 prints reaches the terminal.
#   scripts/nested.sh serve POOL [--mem MIB] [--keep DIR]...
#       Keep an L1 running that takes jobs from `exec`, several at a time,
#       until SIGTERM. When L1 dies (its kernel panics, QEMU exits) or stops
#       answering, a fresh L1 boots at once: POOL/gen-N is the Nth L1's
#       directory, POOL/current the live one, POOL/deaths one line per death.
#   KRUNBOX_NESTED_POOL=POOL[:POOL]... scripts/nested.sh exec [--] CMD [ARG]...
#       Run CMD in the pool's live L1 (at our cwd, with our environment as for
#       `run`) and exit with its status; its stdout and stderr are printed
#       when it ends. Given several pools, runs CMD in the first one that
#       runs no other `exec`'s job, waiting while all do. This is cargo-nextest's target runner for the VM tests:
#       one test, one process, one job. If L1 dies while CMD runs, prints the
#       fault marker `krunbox-nested-l1-died` and exits 125; if KVM in L1 was
#       looping on one guest instruction while CMD ran and CMD failed, prints
#       `krunbox-nested-emulation-fault`. SIGTERM kills CMD's process group.
#
# Inside L1: / is the host's / read-only; /tmp, /var/tmp, /run, /dev/shm are
# fresh tmpfs (so Unix sockets and libkrun's own files live on tmpfs, never on
# 9p) and HOME=/tmp/home. Host directories that those tmpfs would hide are
# bound back at the same path: the cwd, $KRUNBOX_CACHE_DIR, CMD's directory,
# LD_LIBRARY_PATH entries and every --keep DIR. Build on the host: L1's CPU
# is emulated and roughly 10-50x slower.
#
# QEMU's CPU and threading are knobs for measuring the emulation's faults
# (docs/testing.md): KRUNBOX_NESTED_ACCEL (default tcg,thread=multi),
# KRUNBOX_NESTED_SMP (1: with 2 vCPUs, L1 faulted far more often),
# KRUNBOX_NESTED_CPU (max,+svm), and L1's kernel:
# KRUNBOX_NESTED_L1_KERNEL=bookworm (default) or backports.
#
# Exit status of `run`: CMD's, or 124 on timeout (KRUNBOX_NESTED_TIMEOUT
# seconds, default 4800), 125 if L1 failed before reporting one, 130/143 when
# interrupted. KRUNBOX_NESTED_VERBOSE=1 prints timings and keeps L1's logs.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# L1's kernel: bookworm's (the default), or with KRUNBOX_NESTED_L1_KERNEL=backports the newer
# one of bookworm-backports (compared in docs/testing.md). Each has a cache directory of its own.
L1_KERNEL=${KRUNBOX_NESTED_L1_KERNEL:-bookworm}
case $L1_KERNEL in
bookworm) NESTED_DIR=$KRUNBOX_CACHE_DIR/nested ;;
backports) NESTED_DIR=$KRUNBOX_CACHE_DIR/nested-backports ;;
*) die "KRUNBOX_NESTED_L1_KERNEL=$L1_KERNEL: say bookworm or backports" ;;
esac

# Modules L1 loads, by name; their dependencies come from the kernel
# package's modules.dep. Ones built into the kernel are skipped.
# KRUNBOX_NESTED_MODULES adds more (space-separated).
read -ra ROOT_MODULES <<<"virtio_pci 9pnet_virtio 9p kvm_amd ${KRUNBOX_NESTED_MODULES:-}"
declare -A MODULE_PARAMS=(
    # Guests of libkrun write MSRs KVM does not emulate; its (harmless)
    # "Unhandled WRMSR(0xc0010007)" reports would be noise.
    [kvm]="report_ignored_msrs=0"
    [kvm_amd]="nested=1"
)

# L1's kernel command line. Its console (ttyS0) goes to a log file, never to
# the terminal. oops=panic with panic=-1: an oops in L1 (the emulation's
# faults cause some: docs/testing.md) ends L1 at once instead of leaving a
# half-dead kernel that panics minutes later. TCG makes all vCPUs read one
# host clock, so the TSC can be trusted: that skips a slow sync check and
# gives a vDSO clock (HPET reads would trap); lpj= skips the second vCPU's
# slow delay-loop calibration.
KERNEL_CMDLINE="console=ttyS0 quiet loglevel=3 panic=-1 oops=panic mitigations=off tsc=reliable lpj=10000000"

# The environment CMD gets, besides HOME and --env: these names or prefixes.
PASS_ENV='^(PATH|USER|LOGNAME|LANG|LC_[A-Z_]+|TZ|TERM|COLORTERM|NO_COLOR|CI|LD_LIBRARY_PATH|KRUNBOX_[A-Za-z0-9_]*|NEXTEST_[A-Za-z0-9_]*|CARGO_[A-Za-z0-9_]*|RUST_[A-Za-z0-9_]*|RUSTUP_[A-Za-z0-9_]*|RUSTC|RUSTC_[A-Za-z0-9_]*|RUSTFLAGS|RUSTDOCFLAGS)$'

# PID 1 of L1 (busybox sh, in the initramfs). Changing it changes the
# initramfs' cache key, so `prepare` rebuilds.
init_script() {
    cat <<'EOF'
#!/bin/sh
# PID 1 of krunbox's nested-KVM L1 VM, written by scripts/nested.sh.
# Its own messages go to the console (ttyS0), which the host logs to a file.
# shellcheck disable=SC2015 # "a && b || die": die when either fails
export PATH=/bin
die() { echo "nested-init: $*"; poweroff -f; }
mount -t proc proc /proc && mount -t sysfs sysfs /sys && mount -t devtmpfs dev /dev ||
    die "early mounts failed"
while read -r mod params; do
    # shellcheck disable=SC2086 # params are words by design
    insmod "/modules/$mod" $params || die "insmod $mod failed"
done </modules.load
ip link set lo up
hostname krunbox-l1

# The host's / read-only. cache=loose: nothing writes through this mount, so
# L1 may cache pages and metadata freely, which makes it far faster.
r=/newroot
opts=trans=virtio,version=9p2000.L,msize=512000
mkdir -p $r /host
mount -t 9p -o "$opts,cache=loose,ro" hostroot $r || die "cannot mount the host's /"
mount --bind $r /host # the host's view, before tmpfs hide parts of it
mount -t proc proc $r/proc && mount -t sysfs sysfs $r/sys &&
    mount -t devtmpfs dev $r/dev && mkdir -p $r/dev/pts $r/dev/shm &&
    mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts $r/dev/pts &&
    mount -t tmpfs -o mode=1777 tmpfs $r/dev/shm &&
    mount -t tmpfs -o mode=1777 tmpfs $r/tmp &&
    mount -t tmpfs -o mode=1777 tmpfs $r/var/tmp &&
    mount -t tmpfs -o mode=755 tmpfs $r/run || die "mounting the new root failed"
mount -t cgroup2 cgroup2 $r/sys/fs/cgroup 2>/dev/null
# KVM's counters (/sys/kernel/debug/kvm) tell a looping nested hypervisor from a hung test.
mount -t debugfs debugfs $r/sys/kernel/debug || echo "nested-init: no debugfs"
# devtmpfs has no /dev/fd & co.; bash process substitution and many tools need them.
ln -s /proc/self/fd $r/dev/fd && ln -s /proc/self/fd/0 $r/dev/stdin &&
    ln -s /proc/self/fd/1 $r/dev/stdout && ln -s /proc/self/fd/2 $r/dev/stderr
mkdir -p $r/tmp/home $r/run/krunbox
# The writable export: the command script in, results out.
s=$r/run/krunbox
mount -t 9p -o "$opts" krunbox $s || die "cannot mount the scratch export"
while read -r dir; do
    mkdir -p "$r$dir" && mount --bind "/host$dir" "$r$dir" || die "cannot keep $dir"
done <$s/keep

# How a command gets the host's tree as its root, run in a mount namespace of
# its own (unshare -m): the tree is moved over / there and the command
# chroots to it, so its root is the namespace's topmost mount and not a
# chroot inside it. Inside a plain chroot the kernel refuses what sandboxes
# do (unshare(CLONE_NEWUSER) is EPERM, pivot_root EINVAL), and the VMM
# helper's jail could not be tested here. Its arguments are /bin/sh's in the
# new root.
enter_root="cd $r && mount --move . / && exec chroot . /bin/sh \"\$@\""

# Pool mode (nested.sh serve): run every job the host queues, several at once,
# until the host stops L1. A job is a directory queue/ID holding cmd.sh; it
# moves to jobs/ID and gets pgid, started, out, err, ended and status there.
# A file cancel/ID kills the job's process group.
if [ -e $s/serve ]; then
    # run_job ID: one job, in a session (and so a process group) of its own.
    run_job() {
        d=$s/jobs/$1
        cut -d' ' -f1 /proc/uptime >$d/started
        setsid env -i /bin/unshare -m /bin/sh -c "$enter_root" sh \
            -c 'echo $$ >"$1/pgid"; exec /bin/sh "$1/cmd.sh"' sh "/run/krunbox/jobs/$1" </dev/null >$d/out 2>$d/err
        rc=$?
        cut -d' ' -f1 /proc/uptime >$d/ended
        echo $rc >$d/status.new && mv $d/status.new $d/status
    }
    # KVM looping on one guest instruction shows as tens of thousands of
    # injected page faults and emulated instructions a second. Per VM (KVM's
    # debugfs has a directory PID-FD for each), log each 2 s interval where
    # both pass 2000, with L1's uptime and the session of the VMM process:
    # each job is a session of its own, so `exec` blames only the job whose
    # microVM looped, not another test running beside it.
    watch_kvm() {
        k=$r/sys/kernel/debug/kvm
        [ -d $k ] || return
        mkdir -p /kvm-prev
        while sleep 2; do
            for d in $k/*-*; do
                [ -r "$d/pf_guest" ] || continue
                vm=${d##*/}
                read -r pf <"$d/pf_guest" && read -r em <"$d/insn_emulation" || continue
                if read -r pf0 em0 <"/kvm-prev/$vm" 2>/dev/null &&
                    [ $((pf - pf0)) -gt 2000 ] && [ $((em - em0)) -gt 2000 ]; then
                    sid=$(cut -d' ' -f6 "/proc/${vm%-*}/stat" 2>/dev/null)
                    echo "$(cut -d' ' -f1 /proc/uptime) ${sid:-?} $((pf - pf0)) $((em - em0))" >>$s/kvm-loops
                fi
                echo "$pf $em" >"/kvm-prev/$vm"
            done
        done
    }
    watch_kvm &
    mkdir -p $s/queue $s/jobs $s/cancel
    cut -d' ' -f1 /proc/uptime >$s/ready
    n=0
    while :; do
        for j in $s/queue/*; do
            [ -d "$j" ] || continue
            id=${j##*/}
            mv "$j" $s/jobs/ && run_job "$id" &
        done
        for c in $s/cancel/*; do
            [ -e "$c" ] || continue
            d=$s/jobs/${c##*/}
            if [ -e $d/status ]; then
                rm -f "$c"
            else
                { read -r pg <$d/pgid && kill -KILL -- "-$pg"; } 2>/dev/null
            fi
        done
        # The host restarts an L1 whose heartbeat stops.
        n=$((n + 1))
        [ $((n % 5)) -ne 0 ] || cut -d' ' -f1 /proc/uptime >$s/heartbeat
        sleep 0.2
    done
fi

# CMD writes to ttyS1 (stdout) and ttyS2 (stderr) with no \n -> \r\n
# translation; when the caller's side is not a terminal, through pipes, so
# that CMD does not see a tty either.
out=/dev/ttyS1 err=/dev/ttyS2
stty -F $out raw -echo && stty -F $err raw -echo
pids=
if [ ! -e $s/stdout-tty ]; then
    mkfifo /out
    cat /out >$out &
    pids="$pids $!" out=/out
fi
if [ ! -e $s/stderr-tty ]; then
    mkfifo /err
    cat /err >$err &
    pids="$pids $!" err=/err
fi
cut -d' ' -f1 /proc/uptime >$s/boot-seconds
env -i /bin/unshare -m /bin/sh -c "$enter_root" sh /run/krunbox/cmd.sh </dev/null >$out 2>$err
echo $? >$s/exit-status
cut -d' ' -f1 /proc/uptime >$s/end-seconds
# Let the pipes drain, but do not wait for children CMD left running.
for _ in 1 2 3 4 5 6 7 8 9 10; do
    alive=
    for p in $pids; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ -n "$alive" ] || break
    sleep 0.2
done
sync
poweroff -f
EOF
}

# need_qemu: install qemu-system-x86. Machines of this project come with
# qemu-utils from bookworm-backports, which bookworm's own qemu-system-x86
# conflicts with (apt would remove qemu-utils), so when it is there we take
# qemu-system-x86 of the very same version from bookworm-backports through
# a private sources list (the machine's apt configuration is not changed).
need_qemu() {
    command -v qemu-system-x86_64 >/dev/null && return 0
    local ver
    ver=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null || true)
    if [[ $ver != *bpo* ]]; then
        need_apt qemu-system-x86
        return
    fi
    local dir=$KRUNBOX_CACHE_DIR/apt-backports
    mkdir -p "$dir"
    printf 'deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] %s bookworm-backports main\n' \
        "$(debian_mirror)" >"$dir/sources.list"
    log "apt-get install qemu-system-x86=$ver (bookworm-backports, like qemu-utils)"
    apt_private "$dir" update -qq >&2
    apt_private "$dir" install -y -qq --no-install-recommends --no-remove \
        -t bookworm-backports "qemu-system-x86=$ver" >/dev/null
    rm -rf "$dir"
}

# backports_kernel: download the kernel bookworm-backports' linux-image-amd64 points at, through
# a private sources list (the machine's apt configuration is not changed); set KDIR.
backports_kernel() {
    local dir=$NESTED_DIR/apt pkg ver
    mkdir -p "$dir"
    printf 'deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] %s bookworm-backports main\n' \
        "$(debian_mirror)" >"$dir/sources.list"
    PARTS=/dev/null apt_private "$dir" update -qq >&2
    local -a opts=(-o Dir::Etc::SourceList="$dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o Dir::State::Lists="$dir/lists" -o Dir::Cache="$dir/cache")
    pkg=$(apt-cache "${opts[@]}" depends linux-image-amd64 2>/dev/null |
        awk '$1 == "Depends:" && $2 ~ /^linux-image-6\.[0-9.]+.*-amd64$/ { print $2; exit }')
    [[ -n $pkg ]] || die "bookworm-backports has no linux-image-amd64 kernel"
    ver=$(apt-cache "${opts[@]}" policy "$pkg" | awk '$1 == "Candidate:" { print $2 }')
    KDIR=$NESTED_DIR/${pkg}_$ver
    [[ -s $KDIR/kernel.deb ]] && return
    log "downloading $pkg $ver (bookworm-backports)"
    rm -rf "$NESTED_DIR"/linux-image-*
    mkdir -p "$KDIR/dl"
    (cd "$KDIR/dl" && PARTS=/dev/null apt_private "$dir" download -qq "$pkg=$ver" >&2)
    mv "$KDIR"/dl/*.deb "$KDIR/kernel.deb"
    rmdir "$KDIR/dl"
}

# prepare [cached]: make sure everything `run` needs is there; set KERNEL
# and INITRD. With "cached", a kernel already in the cache is used without
# asking apt (slow) whether a newer one came out.
prepare() {
    need_qemu
    need_apt busybox-static cpio kmod xz-utils
    mkdir -p "$NESTED_DIR"
    exec {lock}>"$NESTED_DIR/.lock"
    flock "$lock" # parallel runs wait for one prepare instead of racing it

    # The L1 kernel: the package bookworm's linux-image-amd64 points at.
    local kdir=
    if [[ ${1:-} == cached ]]; then
        kdir=$(compgen -G "$NESTED_DIR/linux-image-*/kernel.deb" | head -n1 || true)
        kdir=${kdir%/kernel.deb}
    fi
    if [[ -z $kdir && $L1_KERNEL == backports ]]; then
        backports_kernel
        kdir=$KDIR
    fi
    if [[ -z $kdir ]]; then
        apt_lists_present || apt_update_once
        local pkg ver
        pkg=$(apt-cache depends linux-image-amd64 2>/dev/null |
            awk '$1 == "Depends:" && $2 ~ /^linux-image-6\.1\.0-.*-amd64$/ { print $2; exit }')
        [[ -n $pkg ]] || die "apt knows no linux-image-6.1.0-*-amd64 (is this bookworm?)"
        ver=$(apt-cache policy "$pkg" | awk '$1 == "Candidate:" { print $2 }')
        kdir=$NESTED_DIR/${pkg}_$ver
    fi
    if [[ ! -s $kdir/kernel.deb ]]; then
        log "downloading $pkg $ver"
        rm -rf "$NESTED_DIR"/linux-image-* # older kernels, if any
        mkdir -p "$kdir/dl"
        if ! (cd "$kdir/dl" && apt-get download -qq -o APT::Sandbox::User=root "$pkg=$ver" >&2); then
            # Stale package lists can name a kernel the mirror no longer has: refresh, ask
            # again which kernel is current, retry once.
            apt_update_once
            pkg=$(apt-cache depends linux-image-amd64 2>/dev/null |
                awk '$1 == "Depends:" && $2 ~ /^linux-image-6\.1\.0-.*-amd64$/ { print $2; exit }')
            ver=$(apt-cache policy "$pkg" | awk '$1 == "Candidate:" { print $2 }')
            (cd "$kdir/dl" && apt-get download -qq -o APT::Sandbox::User=root "$pkg=$ver" >&2)
        fi
        mv "$kdir"/dl/*.deb "$kdir/kernel.deb"
        rmdir "$kdir/dl"
    fi

    local key
    key=$( {
        init_script
        declare -p ROOT_MODULES MODULE_PARAMS
        dpkg-deb -f "$kdir/kernel.deb" Package Version
        dpkg-query -W -f='${Version}' busybox-static
    } | sha256sum | cut -c1-16)
    KERNEL=$kdir/vmlinux
    INITRD=$kdir/initrd-$key.gz
    [[ -s $INITRD && -s $KERNEL ]] || build_initramfs "$kdir"
    exec {lock}>&-
}

# build_initramfs KDIR: unpack KDIR/kernel.deb, take the kernel and the
# modules L1 needs, and write $INITRD (cpio newc, gzip).
build_initramfs() {
    local kdir=$1 tmp kver
    log "building the L1 initramfs"
    tmp=$(mktemp -d "$NESTED_DIR/build.XXXXXX")
    # shellcheck disable=SC2064 # expand $tmp now
    trap "rm -rf '$tmp'" EXIT
    dpkg-deb -x "$kdir/kernel.deb" "$tmp/x"
    kver=$(ls "$tmp/x/lib/modules")
    local mods=$tmp/x/lib/modules/$kver
    # The package ships no modules.dep (its postinst runs depmod): make it.
    depmod -b "$tmp/x" "$kver"

    # Depth-first over modules.dep, dependencies before dependents.
    local -A deps=() byname=() seen=()
    local -a order=()
    local line path name
    while IFS= read -r line; do
        path=${line%%:*}
        deps[$path]=${line#*:}
        name=${path##*/}
        name=${name%.ko*}
        byname[${name//-/_}]=$path
    done <"$mods/modules.dep"
    visit() {
        [[ -n ${seen[$1]:-} ]] && return
        seen[$1]=1
        local d
        for d in ${deps[$1]}; do visit "$d"; done
        order+=("$1")
    }
    for name in "${ROOT_MODULES[@]}"; do
        name=${name//-/_}
        if [[ -n ${byname[$name]:-} ]]; then
            visit "${byname[$name]}"
        elif ! sed 's/-/_/g' "$mods/modules.builtin" | grep -q "/$name\.ko$"; then
            die "kernel $kver has no module $name"
        fi
    done

    local stage=$tmp/stage
    mkdir -p "$stage"/{bin,modules,proc,sys,dev,newroot,host}
    cp /bin/busybox "$stage/bin/busybox"
    local applet
    for applet in $(/bin/busybox --list); do
        [[ $applet == busybox ]] || ln -s busybox "$stage/bin/$applet"
    done
    init_script >"$stage/init"
    chmod 755 "$stage/init"
    for path in "${order[@]}"; do
        name=${path##*/}
        cp "$mods/$path" "$stage/modules/$name"
        name=${name%.ko*}
        printf '%s %s\n' "${path##*/}" "${MODULE_PARAMS[${name//-/_}]:-}"
    done >"$stage/modules.load"

    # QEMU boots the uncompressed ELF kernel through its PVH entry point, so
    # neither the BIOS runs nor the kernel XZ-decompresses itself: under TCG
    # that saves about 5 s per boot. The compressed stream (XZ for bookworm's
    # kernel, zstd for backports') starts at its magic bytes.
    local bz=$tmp/x/boot/vmlinuz-$kver off
    off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$bz" | awk -F: 'NR == 1 { print $1 }')
    # (the decompressor stops after the stream, while tail may still be writing:
    # tail's SIGPIPE must not count as a failure, hence no plain pipe.)
    if [[ -n $off ]]; then
        xz -dc --single-stream < <(tail -c +$((off + 1)) "$bz") >"$kdir/vmlinux.new"
    else
        need_apt zstd
        off=$(LC_ALL=C grep -obUaP '\x28\xb5\x2f\xfd' "$bz" | awk -F: 'NR == 1 { print $1 }')
        [[ -n $off ]] || die "$bz is compressed neither with XZ nor zstd"
        zstd -dcq < <(tail -c +$((off + 1)) "$bz") >"$kdir/vmlinux.new" 2>/dev/null || true
    fi
    cmp -s -n 4 <(printf '\177ELF') "$kdir/vmlinux.new" || die "no ELF kernel inside $bz"
    (cd "$stage" && find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) |
        gzip -1 >"$kdir/initrd.new"
    rm -f "$kdir"/initrd-*.gz
    mv "$kdir/vmlinux.new" "$KERNEL"
    mv "$kdir/initrd.new" "$INITRD"
    rm -rf "$tmp"
    trap - EXIT
    log "L1 kernel $kver, modules: ${order[*]##*/}"
}

# q WORD: WORD quoted for any POSIX shell ('...' with ' as '\'').
q() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

# write_cmd FILE CWD [--env NAME[=VALUE]]... -- CMD [ARG]...: the command, as
# a script for the host's /bin/sh inside L1: the environment, the cwd, then
# exec of the arguments, each one quoted.
write_cmd() {
    local file=$1 cwd=$2 name var
    shift 2
    local -a envs=()
    while [[ $1 == --env ]]; do envs+=("$2"); shift 2; done
    [[ $1 == -- ]] && shift
    {
        for name in $(compgen -e); do
            if [[ $name =~ $PASS_ENV ]]; then echo "export $(q "$name=${!name}")"; fi
        done
        # The toolchain stays where it is although HOME moves to tmpfs.
        if [[ -z ${CARGO_HOME:-} && -d $HOME/.cargo ]]; then
            echo "export $(q "CARGO_HOME=$HOME/.cargo")"
        fi
        if [[ -z ${RUSTUP_HOME:-} && -d $HOME/.rustup ]]; then
            echo "export $(q "RUSTUP_HOME=$HOME/.rustup")"
        fi
        echo "export HOME=/tmp/home"
        for var in "${envs[@]}"; do
            name=${var%%=*}
            [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "bad --env $var"
            [[ $var == *=* ]] || var="$name=${!name:-}"
            echo "export $(q "$var")"
        done
        echo "cd $(q "$cwd") || exit 125"
        printf 'exec'
        for var in "$@"; do printf ' %s' "$(q "$var")"; done
        echo
    } >"$file"
}

# write_keep FILE DIR...: the host directories under L1's tmpfs mounts that
# commands need (those given, the cache, LD_LIBRARY_PATH's entries).
write_keep() {
    local file=$1 var
    shift
    local -a libdirs=()
    IFS=: read -ra libdirs <<<"${LD_LIBRARY_PATH:-}"
    for var in "$@" "$KRUNBOX_CACHE_DIR" "${libdirs[@]}"; do
        [[ -d $var ]] || continue
        var=$(cd "$var" && pwd -P)
        [[ $var != *$'\n'* ]] || die "a newline in $var"
        if [[ $var =~ ^/(tmp|var/tmp|run|dev/shm)/ ]]; then echo "$var"; fi
    done | LC_ALL=C sort -u >"$file"
}

# qemu_command SHARE MEM CONSOLE OUT ERR: QEMU's command line for an L1 that
# exports SHARE as its scratch directory, into the array QEMU.
qemu_command() {
    # shellcheck disable=SC2054 # commas inside QEMU's option values
    QEMU=(
        qemu-system-x86_64 -nodefaults -no-user-config -nographic -no-reboot
        -accel "${KRUNBOX_NESTED_ACCEL:-tcg,thread=multi}" -smp "${KRUNBOX_NESTED_SMP:-1}"
        -cpu "${KRUNBOX_NESTED_CPU:-max,+svm}" -m "$2"
        -kernel "$KERNEL" -initrd "$INITRD" -append "$KERNEL_CMDLINE"
        -serial "file:$3" -serial "file:$4" -serial "file:$5"
        -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap
        -virtfs "local,path=$1,mount_tag=krunbox,security_model=none,multidevs=remap"
    )
}

run() {
    local mem=8192 cwd=$PWD
    local -a keep=() envs=()
    while (($#)); do
        case $1 in
        --mem) mem=$2; shift 2 ;;
        --cwd) cwd=$2; shift 2 ;;
        --env) envs+=(--env "$2"); shift 2 ;;
        --keep) keep+=("$2"); shift 2 ;;
        --) shift; break ;;
        *) usage ;;
        esac
    done
    (($#)) || usage
    [[ -d $cwd ]] || die "no such directory: $cwd"
    cwd=$(cd "$cwd" && pwd -P)
    prepare cached

    # Globals, not locals: the EXIT trap may run after run() has unwound.
    d=$(mktemp -d "${TMPDIR:-/tmp}/krunbox-nested.XXXXXX")
    share=$d/share
    mkdir "$share"
    write_cmd "$share/cmd.sh" "$cwd" "${envs[@]}" -- "$@"
    local -a dirs=("$cwd" "${keep[@]}")
    if [[ $1 == */* ]]; then dirs+=("$(dirname "$1")"); fi
    write_keep "$share/keep" "${dirs[@]}"

    if [[ -t 1 ]]; then touch "$share/stdout-tty"; fi
    if [[ -t 2 ]]; then touch "$share/stderr-tty"; fi

    # QEMU writes CMD's output into FIFOs that cat copies to our stdout and
    # stderr: works whatever those are (terminal, pipe, file, socket) and
    # QEMU never touches the terminal's settings.
    mkfifo "$d/out" "$d/err"
    cat <"$d/out" &
    cat_out=$!
    cat <"$d/err" >&2 &
    cat_err=$!

    qemu_command "$share" "$mem" "$d/console.log" "$d/out" "$d/err"
    # setpriv --pdeathsig: QEMU and the timer die with us even if we are
    # SIGKILLed (e.g. by CI's own timeout) and cannot clean up.
    local t0=$EPOCHREALTIME
    setpriv --pdeathsig KILL -- "${QEMU[@]}" </dev/null >"$d/qemu.log" 2>&1 &
    qpid=$!
    setpriv --pdeathsig KILL -- sleep "${KRUNBOX_NESTED_TIMEOUT:-4800}" &
    spid=$!

    # Whatever happens from here on, our QEMU, sleep and cats go away.
    # drain: wait until the cats have copied all output. A QEMU that died
    # before opening the FIFOs leaves them blocked in open(): open the FIFOs
    # ourselves (read-write never blocks), closing gives them their EOF.
    drain() {
        : 1<>"$d/out" 1<>"$d/err"
        wait "$cat_out" "$cat_err" 2>/dev/null || true
    }
    # stop PID...: kill and reap these children of ours (empty: gone already).
    stop() {
        local pid
        for pid; do if [[ -n $pid ]]; then kill "$pid" 2>/dev/null || true; fi; done
        for pid; do if [[ -n $pid ]]; then wait "$pid" 2>/dev/null || true; fi; done
    }
    # shellcheck disable=SC2317 # called from the traps below
    cleanup() {
        [[ -d $d ]] || return 0
        stop "$qpid" "$spid"
        drain
        if [[ ${KRUNBOX_NESTED_VERBOSE:-} == 1 ]]; then log "L1 logs kept in $d"; else rm -rf "$d"; fi
    }
    trap 'cleanup; exit 130' INT
    trap 'cleanup; exit 143' TERM HUP
    trap cleanup EXIT

    local first
    wait -n -p first "$qpid" "$spid" || true
    if [[ $first == "$spid" ]]; then
        spid=
        log "timed out after ${KRUNBOX_NESTED_TIMEOUT:-4800} s, killing L1 (QEMU pid $qpid)"
        echo "error: nested.sh run: timed out: $*" >&2
        exit 124
    fi
    qpid= # reaped: from now on its pid is no longer ours to kill
    stop "$spid"
    spid=
    drain
    if [[ ! -s $share/exit-status ]]; then
        printf 'error: L1 ended without an exit status; its console and QEMU said:\n' >&2
        tail -n 30 "$d/console.log" "$d/qemu.log" >&2 2>/dev/null || true
        exit 125
    fi
    if [[ ${KRUNBOX_NESTED_VERBOSE:-} == 1 ]]; then
        local total boot end
        total=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
        read -r boot <"$share/boot-seconds"
        read -r end <"$share/end-seconds"
        log "wall ${total}s; L1 kernel uptime at CMD start ${boot}s, at CMD end ${end}s"
    fi
    exit "$(cat "$share/exit-status")"
}

# serve POOL [--mem MIB] [--keep DIR]...: keep a live L1 for `exec`, booting
# a fresh one whenever one dies, until SIGTERM.
serve() {
    local pool=$1 mem=8192
    shift || usage
    local -a keep=()
    while (($#)); do
        case $1 in
        --mem) mem=$2; shift 2 ;;
        --keep) keep+=("$2"); shift 2 ;;
        *) usage ;;
        esac
    done
    prepare cached
    mkdir -p "$pool"
    pool=$(cd "$pool" && pwd -P)
    echo $$ >"$pool/serve.pid"
    # Heartbeats come every second; a minute without one is an L1 that hangs
    # (TCG keeps even a loaded L1's init loop going far more often).
    local stale=${KRUNBOX_NESTED_HEARTBEAT_LIMIT:-60}
    local gen=0 early=0 share reason now beat
    qpid=
    # shellcheck disable=SC2317 # called from the trap
    serve_stop() {
        if [[ -n $qpid ]]; then kill "$qpid" 2>/dev/null || true; wait "$qpid" 2>/dev/null || true; fi
        exit 0
    }
    trap serve_stop TERM INT HUP
    while :; do
        gen=$((gen + 1))
        share=$pool/gen-$gen
        # A pool served before leaves its generations behind: an old one's ready and heartbeat
        # files would make this fresh L1 look dead at once.
        rm -rf -- "$share"
        mkdir -p "$share"
        touch "$share/serve"
        write_keep "$share/keep" "$PWD" "${keep[@]}"
        qemu_command "$share" "$mem" "$share/console.log" /dev/null /dev/null
        setpriv --pdeathsig KILL -- "${QEMU[@]}" </dev/null >"$share/qemu.log" 2>&1 &
        qpid=$!
        echo "$qpid" >"$share/qemu.pid"
        ln -sfn "gen-$gen" "$pool/current.new" && mv -T "$pool/current.new" "$pool/current"
        reason=
        local t0=$SECONDS
        while kill -0 "$qpid" 2>/dev/null; do
            sleep 1
            [[ -e $share/ready ]] || continue
            beat=$(stat -c %Y "$share/heartbeat" 2>/dev/null || stat -c %Y "$share/ready")
            printf -v now '%(%s)T' -1
            if ((now - beat > stale)); then
                reason="no heartbeat from L1 for $((now - beat)) s: killed it"
                kill -KILL "$qpid" 2>/dev/null || true
                break
            fi
        done
        # (set -e: a QEMU killed or crashed must not end this loop.)
        local rc=0
        wait "$qpid" || rc=$?
        qpid=
        if [[ -z $reason ]]; then
            reason="QEMU exited with status $rc"
            # The L1 kernel's own last words, if it panicked.
            local last
            last=$(grep -aE 'Kernel panic|BUG:|general protection|Oops' "$share/console.log" | head -n 2 | tr '\n' ' ' || true)
            [[ -z $last ]] || reason+=": $last"
        fi
        echo "$reason" >"$share/dead"
        echo "L1 #$gen after $((SECONDS - t0)) s: $reason" >>"$pool/deaths"
        log "nested: L1 #$gen died ($reason); booting a fresh L1"
        # An L1 that cannot even come up will not do better the next time.
        if [[ -e $share/ready ]]; then early=0; else early=$((early + 1)); fi
        if ((early >= 3)); then
            echo "3 L1s in a row died before they were ready" >"$pool/failed"
            log "nested: 3 L1s in a row died before they were ready; giving up"
            tail -n 30 "$share/console.log" "$share/qemu.log" >&2 2>/dev/null
            exit 1
        fi
    done
}

# exec [--] CMD [ARG]...: run CMD in the live L1 of $KRUNBOX_NESTED_POOL.
exec_job() {
    local -a pools=()
    IFS=: read -ra pools <<<"${KRUNBOX_NESTED_POOL:?KRUNBOX_NESTED_POOL names the pool of a running nested.sh serve}"
    local pool=${pools[0]}
    [[ ${1:-} == -- ]] && shift
    (($#)) || usage
    if ((${#pools[@]} > 1)); then
        # Several pools (one L1 each): one job at a time per L1. Take the first free one and
        # hold it (a lock that goes with this process), waiting while all are busy.
        local p free=0 busy
        while :; do
            for p in "${pools[@]}"; do
                mkdir -p "$p"
                exec {busy}>>"$p/.busy"
                if flock -n "$busy"; then pool=$p free=1; break; fi
                exec {busy}>&-
            done
            ((free == 0)) || break
            sleep 0.2
        done
    fi
    local id share gen job waited=0 supervisor=
    id=$(date +%s%N)-$$
    while :; do
        # A live L1: the current generation, ready and not dead.
        while :; do
            [[ ! -e $pool/failed ]] || { echo "error: nested.sh exec: $(cat "$pool/failed")" >&2; exit 125; }
            [[ -n $supervisor ]] || supervisor=$(cat "$pool/serve.pid" 2>/dev/null) || supervisor=
            if [[ -n $supervisor ]] && ! kill -0 "$supervisor" 2>/dev/null; then
                echo "error: nested.sh exec: the pool's supervisor (nested.sh serve) is gone" >&2
                exit 125
            fi
            gen=$(readlink "$pool/current" 2>/dev/null) || gen=
            share=$pool/$gen
            [[ -n $gen && -e $share/ready && ! -e $share/dead ]] && break
            ((waited < 600 * 5)) || { echo "error: nested.sh exec: no live L1 in $pool after 600 s" >&2; exit 125; }
            waited=$((waited + 1))
            sleep 0.2
        done
        job=$share/jobs/$id
        # On SIGTERM (nextest's timeout, Ctrl-C): kill the job, show its output.
        # shellcheck disable=SC2317 # called from the trap
        cancel() {
            rm -rf "$share/new-$id"
            if [[ -d $share/queue/$id ]] && rm -rf "$share/queue/$id" 2>/dev/null && [[ ! -e $job ]]; then exit 143; fi
            [[ -e $job ]] || exit 143
            touch "$share/cancel/$id"
            local i
            for i in $(seq 50); do [[ -e $job/status || -e $share/dead ]] && break; sleep 0.1; done
            cat "$job/out" 2>/dev/null
            cat "$job/err" >&2 2>/dev/null
            echo "nested.sh exec: stopped by a signal; killed the job's process group in L1" >&2
            report_loops "$(cat "$job/started" 2>/dev/null)" "$(cut -d' ' -f1 "$share/heartbeat" 2>/dev/null)"
            exit 143
        }
        trap cancel TERM INT HUP
        mkdir "$share/new-$id"
        write_cmd "$share/new-$id/cmd.sh" "$PWD" -- "$@"
        mv "$share/new-$id" "$share/queue/$id"
        while [[ ! -e $job/status ]]; do
            if [[ -n $supervisor ]] && ! kill -0 "$supervisor" 2>/dev/null; then
                echo "error: nested.sh exec: the pool's supervisor (nested.sh serve) is gone" >&2
                exit 125
            fi
            if [[ -e $share/dead ]]; then
                [[ -e $job/status ]] && break
                if [[ -d $share/queue/$id ]]; then
                    # L1 died before it took the job: nothing ran; give it to the next L1.
                    rm -rf "$share/queue/$id"
                    continue 2
                fi
                if [[ " $* " == *" --list "* ]]; then
                    # nextest listing a binary's tests: harmless to repeat, and a failure
                    # there would end the whole run.
                    continue 2
                fi
                cat "$job/out" 2>/dev/null
                cat "$job/err" >&2 2>/dev/null
                echo "krunbox-nested-l1-died: the nested L1 ($gen) died while this ran: $(cat "$share/dead")" >&2
                grep -aE 'Kernel panic|BUG:|RIP:|Call Trace' "$share/console.log" 2>/dev/null | head -n 8 >&2 || true
                exit 125
            fi
            sleep 0.2
        done
        break
    done
    trap - TERM INT HUP
    local rc
    rc=$(<"$job/status")
    cat "$job/out"
    cat "$job/err" >&2
    if ((rc != 0)); then report_loops "$(<"$job/started")" "$(<"$job/ended")"; fi
    exit "$rc"
}

# report_loops FROM TO: print the fault marker if KVM in L1 looped on the instructions of one
# of this job's microVMs between these L1 uptimes (seconds; the job's start and end). Uses
# $share and $job.
report_loops() {
    [[ -s $share/kvm-loops && -n $1 && -s $job/pgid ]] || return 0
    local loops
    loops=$(awk -v a="$1" -v b="${2:-1e12}" -v sid="$(<"$job/pgid")" \
        '$1 >= a && $1 <= b + 2 && $2 == sid' "$share/kvm-loops")
    [[ -n $loops ]] || return 0
    echo "krunbox-nested-emulation-fault: while this ran, KVM in L1 looped on the instructions of its microVM (L1 uptime, session, page faults and emulations per 2 s):" >&2
    head -n 5 <<<"$loops" >&2
}

usage() {
    sed -n '2,/^set -euo/{/^set/d; s/^# \{0,1\}//; p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

case ${1:-} in
prepare) prepare && log "L1 ready: $KERNEL $INITRD" ;;
run) shift; run "$@" ;;
serve) shift; serve "$@" ;;
exec) shift; exec_job "$@" ;;
*) usage ;;
esac
