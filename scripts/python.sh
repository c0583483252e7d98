#!/usr/bin/env bash
# python.sh: the Python package (bindings/python) as the test command builds it, from the clone.
#
#   scripts/python.sh build
#       A fresh virtualenv in TARGET/python/venv with the pinned tools of
#       bindings/python/requirements-dev.txt (pip's own cache keeps their downloads), the
#       wheel built by maturin from this clone (the dev profile and target directory the rest
#       of the suite builds in, so the library is not built twice), carrying this build's
#       krunbox-vmm helper and guest-init (`krunbox setup` into the package's _artifacts
#       directory first; the guest kernel is found as the library finds it), installed into
#       it; and the package's types checked by mypy --strict.
#   scripts/python.sh tests
#       The pytest node ids of the package's tests, one a line (collected here, on the host).
#
# TARGET is the cargo target directory. Run from the repository's root.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"
cd "$here/.."
target=$(cargo_target_dir)
venv=$target/python/venv
package=bindings/python

case ${1:-} in
build)
    log "the Python package: a fresh virtualenv, the wheel built from this clone, mypy"
    rm -rf "$venv" "$target/python/wheels"
    artifacts=$package/python/krunbox/_artifacts
    rm -rf "$artifacts"
    "$target/debug/krunbox" setup --data-dir "$artifacts" >&2
    rm -rf "$artifacts/libkrunfw"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$package/requirements-dev.txt"
    CARGO_TARGET_DIR=$target "$venv/bin/maturin" build --quiet --profile dev \
        --manifest-path "$package/Cargo.toml" --out "$target/python/wheels" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
        "$target/python/wheels"/krunbox-*.whl
    (cd "$package" && "$venv/bin/mypy" --strict python/krunbox tests benches ../../examples/python >&2)
    ;;
tests)
    cd "$package"
    "$venv/bin/python" -m pytest --collect-only -q -p no:cacheprovider | grep '::'
    ;;
*) die "usage: scripts/python.sh build|tests" ;;
esac
