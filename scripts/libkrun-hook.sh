#!/usr/bin/env bash
# libkrun-hook.sh: makes vmm/.patched/krun-vmm, libkrun's krun-vmm 1.19.7 from crates.io with
# krunbox's one change (vmm/krun-sys/hook/embedder-devices.patch: a list of virtio devices the
# embedding program supplies, attached when the VM is built). The helper's workspace
# (vmm/Cargo.toml) and fuzz/ patch crates.io's krun-vmm with it, so this runs before any cargo
# command there (`cargo install --path vmm` included); setup.sh calls it. The library's
# workspace needs none of it. Idempotent (redone only when the patch or this script changes) and safe to run
# twice at once (a lock; the new tree is renamed into place whole, its stamp written last).
# krun-sys's build script refuses a stale tree. Why a patch at all, and what it costs:
# docs/architecture.md, "How the device gets into libkrun".
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
version=0.1.0-1.19.7
patch_file=$repo/vmm/krun-sys/hook/embedder-devices.patch
patched=$repo/vmm/.patched
dest=$patched/krun-vmm
# What krun-sys/build.rs compares: the patch's SHA-256 and the version.
stamp="$(sha256sum "$patch_file" | cut -d' ' -f1) $version"
current() { [[ -f $dest/.krunbox-hook && $(cat "$dest/.krunbox-hook") == "$stamp" ]]; }

current && exit 0
mkdir -p "$patched"
exec 9>"$patched/.lock"
flock 9
current && exit 0

echo "libkrun-hook: krun-vmm $version from crates.io, with krunbox's patch" >&2
work=$(mktemp -d "$patched/.work.XXXXXX")
trap 'rm -rf "$work"' EXIT
# A throwaway package outside the workspace, so that cargo downloads and checks the crate the
# usual way (its registry, its checksum) even before .patched exists; with the workspace's lock
# file, so that it resolves what the helper's workspace already uses.
mkdir -p "$work/fetch/src"
cat > "$work/fetch/Cargo.toml" <<TOML
[package]
name = "krunbox-fetch-krun-vmm"
version = "0.0.0"
edition = "2021"
[dependencies]
krun-vmm = "=$version"
[workspace]
TOML
: > "$work/fetch/src/lib.rs"
cp "$repo/vmm/Cargo.lock" "$work/fetch/Cargo.lock"
cargo fetch --quiet --manifest-path "$work/fetch/Cargo.toml" >&2
source_dir=$(cargo metadata --format-version 1 --manifest-path "$work/fetch/Cargo.toml" |
    python3 -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "krun-vmm":
        print(p["manifest_path"].rsplit("/", 1)[0])')
[[ -d $source_dir ]] || { echo "libkrun-hook: krun-vmm $version not found after cargo fetch" >&2; exit 1; }

cp -r "$source_dir" "$work/krun-vmm"
(cd "$work/krun-vmm" && patch --quiet --forward -p1 < "$patch_file")
echo "$stamp" > "$work/krun-vmm/.krunbox-hook"
# Renamed into place within one filesystem: the tree is whole or absent.
rm -rf "$dest.old"
[[ -e $dest ]] && mv "$dest" "$dest.old"
mv "$work/krun-vmm" "$dest"
rm -rf "$dest.old"
