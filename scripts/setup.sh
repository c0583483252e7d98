#!/usr/bin/env bash
# setup.sh: everything krunbox needs on a fresh Debian/Ubuntu machine, idempotent and cached.
#
#   Debian packages   erofs-utils, mmdebstrap, busybox-static (image building), python3,
#                     passt (the baseline benches/net.rs measures our network against),
#                     e2fsprogs (mke2fs formats writable roots' layers), qemu-utils
#                     (the tests check persistent layers with qemu-img check),
#                     docker-registry and skopeo (the pull tests' registry on loopback, and
#                     the pushes of the images they build), patch (libkrun's hook),
#                     libc6-dev (libkrun's own init, for tests/plain-libkrun, links statically)
#   libkrun hook      vmm/.patched/krun-vmm: libkrun's krun-vmm from crates.io with our one
#                     patch (scripts/libkrun-hook.sh; the helper's workspace cannot build
#                     without it, the library's needs none of it)
#   Rust target       x86_64-unknown-linux-musl (guest-init is a static binary; a copy of it
#                     goes into the krunbox cache, where an installed `krunbox` finds it)
#   cargo-nextest     runs the VM tests, one process per test (from crates.io if missing)
#   libkrunfw         the guest kernel, Debian sid's libkrunfw5, into the krunbox cache
#   build             the library's workspace (krunbox, its CLI, krunbox-rootfs), the helper's
#                     (vmm/: krunbox-vmm), guest-init, and
#                     tests/plain-libkrun (an image booted by libkrun alone, for one test)
#   pjdfstest         the POSIX filesystem conformance suite tests/fs_conformance.rs runs in the
#                     guest, from crates.io, as a static musl binary, into the krunbox cache
#   images            the built-in busybox and agent images, into the krunbox cache
#   nested harness    when this host's KVM cannot boot guests: QEMU, the L1 kernel, initramfs
#
# Prints, as its last line on stdout, `native` or `nested`: where microVMs will run.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"
cd "$here/.."

need_apt erofs-utils mmdebstrap busybox-static python3 passt e2fsprogs qemu-utils \
    docker-registry skopeo patch libc6-dev
# The Python package's tests run in a virtualenv (python.sh); Debian's python3 makes one only
# with python3-venv.
python3 -c 'import ensurepip, venv' 2>/dev/null || need_apt python3-venv

# Before any cargo command in the helper's workspace: vmm/Cargo.toml names libkrun's patched
# krun-vmm, which this makes (with python3 and patch, installed just above).
"$here/libkrun-hook.sh"

musl=x86_64-unknown-linux-musl
if ! rustup target list --installed | grep -qx "$musl"; then
    log "rustup target add $musl"
    rustup target add "$musl" >&2
fi

if ! cargo nextest --version >/dev/null 2>&1; then
    log "cargo install cargo-nextest"
    cargo install --locked cargo-nextest >&2
fi

"$here/fetch-libkrunfw.sh" >/dev/null

log "cargo build (host binaries)"
cargo build --workspace --bins >&2
# The helper: a workspace of its own (vmm/Cargo.toml says why), into the same target directory
# (.cargo/config.toml), so that target/debug/krunbox-vmm lies beside the library's binaries.
log "cargo build the helper (vmm/)"
cargo build --locked --manifest-path vmm/Cargo.toml --bins >&2
log "cargo build guest-init ($musl)"
cargo build -p guest-init --release --target "$musl" --bins --examples >&2
# Into the cache too, where a `krunbox` installed with `cargo install` finds it (its own
# directory holds no musl build) and `krunbox setup` installs it from. Renamed into place whole.
guest_init=$(cargo_target_dir)/$musl/release/guest-init
mkdir -p "$KRUNBOX_CACHE_DIR"
install -m 0755 "$guest_init" "$KRUNBOX_CACHE_DIR/.guest-init.new"
mv -f "$KRUNBOX_CACHE_DIR/.guest-init.new" "$KRUNBOX_CACHE_DIR/guest-init"
# A program that boots an image with libkrun alone (crates.io's, with its own init, without our
# patch): tests/rootfs_writable.rs shows a flattened image boots with it. Its own workspace.
log "cargo build tests/plain-libkrun"
cargo build --locked --manifest-path tests/plain-libkrun/Cargo.toml --target-dir "$(cargo_target_dir)" >&2

# pjdfstest (its Rust rewrite, a crates.io release): static, so it runs in either image. Built
# once (about two minutes) into $KRUNBOX_CACHE_DIR/tools/pjdfstest/bin/pjdfstest, where
# tests/fs_conformance.rs finds it (KRUNBOX_PJDFSTEST overrides); a version bump rebuilds.
pjdfstest_version=0.2.2
pjdfstest_root=$KRUNBOX_CACHE_DIR/tools/pjdfstest
pjdfstest_have=$("$pjdfstest_root/bin/pjdfstest" --version 2>/dev/null || true)
if [[ $pjdfstest_have != "pjdfstest $pjdfstest_version" ]]; then
    log "cargo install pjdfstest $pjdfstest_version ($musl) into $pjdfstest_root"
    cargo install --locked --force pjdfstest --version "=$pjdfstest_version" --target "$musl" \
        --root "$pjdfstest_root" >&2
fi

bin=$(cargo_target_dir)/debug
for image in busybox agent; do
    "$bin/krunbox-rootfs" build "$image" >/dev/null
done

# A real probe decides, not the presence of /dev/kvm: nested PVM hosts have a /dev/kvm that
# cannot boot stock guest kernels.
if "$bin/krunbox" doctor --exit-code >&2; then
    echo native
else
    log "this host cannot boot microVMs itself: using the nested L1 harness"
    "$here/nested.sh" prepare
    echo nested
fi
