#!/usr/bin/env bash
# as-a-user.sh: what someone outside this repository does with it, made into
# <target>/as-a-user for cli/tests/cli.rs's `as_a_user_...` test to boot VMs with:
#   bin/krunbox, bin/krunbox-vmm   `cargo install --path cli` and `cargo install --path vmm`
#   embedder/hello-krunbox         a fresh Cargo project in a temporary directory, outside every
#                                  workspace of this repository, that depends on krunbox by
#                                  path and has no [patch] (its main.rs is examples/hello.rs)
# All in the dev profile and into the shared target directory (--debug, --target-dir), so that
# what the workspaces built is reused; the installs --locked to the workspaces' lock files, the
# project with a copy of the library's (cargo drops what it does not use: no download).
# Needs what setup.sh makes (the libkrun hook, for the helper's workspace).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"
cd "$here/.."
repo=$PWD
target=$(cargo_target_dir)
out=$target/as-a-user
# The workspaces' dev profile (line tables only, Cargo.toml), for the project too: with cargo's
# default (full debug info) nothing the workspaces built would be reused.
export CARGO_PROFILE_DEV_DEBUG=line-tables-only
rm -rf "$out"
mkdir -p "$out/embedder"

log "cargo install --path cli, --path vmm (into $out)"
cargo install --quiet --locked --debug --path cli --root "$out" --target-dir "$target" >&2
cargo install --quiet --locked --debug --path vmm --root "$out" --target-dir "$target" >&2

project=$(mktemp -d /tmp/krunbox-embedder.XXXXXX)
trap 'rm -rf "$project"' EXIT
log "a fresh project that depends on krunbox, in $project"
mkdir -p "$project/src"
cat >"$project/Cargo.toml" <<TOML
[package]
name = "hello-krunbox"
version = "0.1.0"
edition = "2021"

[dependencies]
krunbox = { path = "$repo" }
tokio = { version = "1", features = ["rt-multi-thread", "macros"] }
TOML
cp examples/hello.rs "$project/src/main.rs"
cp Cargo.lock "$project/Cargo.lock"
# Nothing of libkrun may reach an embedder's build: the point of the helper's own workspace.
if cargo tree --manifest-path "$project/Cargo.toml" --prefix none -e normal,build |
    grep -qE '^(libkrun|krun-vmm|krun-sys) '; then
    die "a project that depends on krunbox builds libkrun: $(cargo tree --manifest-path "$project/Cargo.toml" -i krun-vmm 2>&1 | head -5)"
fi
cargo build --quiet --manifest-path "$project/Cargo.toml" --target-dir "$target" >&2
cp "$target/debug/hello-krunbox" "$out/embedder/hello-krunbox"
