#!/usr/bin/env bash
# example.sh: the main example. Sets up what it needs, then runs one isolated command in a
# microVM booted from the built-in agent image: `uname -r`, which prints the *guest's* kernel
# release (libkrunfw's), not this host's. Extra arguments replace the command.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$here/.."
# shellcheck source=lib.sh
source "$here/lib.sh"
where=$("$here/setup.sh" | tail -n1)
(($#)) || set -- uname -r
cmd=("$(cargo_target_dir)/debug/krunbox" run --image agent -- "$@")
if [[ $where == native ]]; then
    exec "${cmd[@]}"
else
    exec "$here/nested.sh" run -- "${cmd[@]}"
fi
