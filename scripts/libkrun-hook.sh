#!/usr/bin/env bash
# libkrun-hook.sh: makes vmm/.patched/krun-vmm and vmm/.patched/krun-devices, libkrun's crates
# of release 1.19.7 from crates.io with krunbox's changes (vmm/krun-sys/hook/<crate>.patch):
# in krun-vmm, a list of virtio devices the embedding program supplies, guest memory in its
# file, and the VM's KVM state for snapshots; in krun-devices, the state of the devices'
# transports and queues for snapshots. The helper's workspace (vmm/Cargo.toml) and fuzz/ patch
# crates.io's crates with them, so this runs before any cargo command there (`cargo install
# --path vmm` included); setup.sh calls it. The library's workspace needs none of it.
# Idempotent (redone only when a patch or this script's version changes) and safe to run twice
# at once (a lock; the new trees are renamed into place, the stamp written last).
# krun-sys's build script refuses stale trees. Why a patch at all, and what it costs:
# docs/architecture.md, "How the device gets into libkrun".
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
version=0.1.0-1.19.7
crates=(krun-vmm krun-devices)
hook=$repo/vmm/krun-sys/hook
patched=$repo/vmm/.patched
# What krun-sys/build.rs compares: each patch's SHA-256, in the order of `crates`, and the
# version.
stamp_file=$patched/.krunbox-hook
stamp="$(for crate in "${crates[@]}"; do sha256sum "$hook/$crate.patch" | cut -d' ' -f1; done | tr '\n' ' ')$version"
current() { [[ -f $stamp_file && $(cat "$stamp_file") == "$stamp" ]]; }

current && exit 0
mkdir -p "$patched"
exec 9>"$patched/.lock"
flock 9
current && exit 0

echo "libkrun-hook: ${crates[*]} $version from crates.io, with krunbox's patches" >&2
work=$(mktemp -d "$patched/.work.XXXXXX")
trap 'rm -rf "$work"' EXIT
# A throwaway package outside the workspace, so that cargo downloads and checks the crates the
# usual way (their registry, their checksums) even before .patched exists; with the workspace's
# lock file, so that it resolves what the helper's workspace already uses.
mkdir -p "$work/fetch/src"
{
    printf '[package]\nname = "krunbox-fetch-libkrun"\nversion = "0.0.0"\nedition = "2021"\n'
    printf '[dependencies]\n'
    for crate in "${crates[@]}"; do printf '%s = "=%s"\n' "$crate" "$version"; done
    printf '[workspace]\n'
} > "$work/fetch/Cargo.toml"
: > "$work/fetch/src/lib.rs"
cp "$repo/vmm/Cargo.lock" "$work/fetch/Cargo.lock"
cargo fetch --quiet --manifest-path "$work/fetch/Cargo.toml" >&2
metadata=$(cargo metadata --format-version 1 --manifest-path "$work/fetch/Cargo.toml")
rm -f "$stamp_file"
for crate in "${crates[@]}"; do
    source_dir=$(python3 -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == sys.argv[1] and p["source"] and p["source"].startswith("registry+"):
        print(p["manifest_path"].rsplit("/", 1)[0])' "$crate" <<<"$metadata")
    [[ -d $source_dir ]] || { echo "libkrun-hook: $crate $version not found after cargo fetch" >&2; exit 1; }
    cp -r "$source_dir" "$work/$crate"
    (cd "$work/$crate" && patch --quiet --forward -p1 < "$hook/$crate.patch")
done
# Each tree renamed into place within one filesystem; the stamp, written last, says both are.
for crate in "${crates[@]}"; do
    dest=$patched/$crate
    rm -rf "$dest.old"
    [[ -e $dest ]] && mv "$dest" "$dest.old"
    mv "$work/$crate" "$dest"
    rm -rf "$dest.old" "$dest/.krunbox-hook"
done
echo "$stamp" > "$stamp_file"
