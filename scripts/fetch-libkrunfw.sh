#!/usr/bin/env bash
# fetch-libkrunfw.sh: put libkrunfw (the guest kernel that libkrun dlopen()s)
# into $KRUNBOX_CACHE_DIR/libkrunfw/ and print that directory, which is meant
# for LD_LIBRARY_PATH:
#     LD_LIBRARY_PATH=$(scripts/fetch-libkrunfw.sh) cargo test
#
# Only Debian sid packages it (libkrunfw5, no dependencies). We read sid
# through a private sources list and private package lists under the cache,
# so the machine's apt configuration stays untouched, then unpack the .deb
# with `dpkg-deb -x` instead of installing it. A second run does nothing;
# delete that directory to pick up a newer sid version.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

dest=$KRUNBOX_CACHE_DIR/libkrunfw
done_marker() { [[ -e $dest/libkrunfw.so.5 && -s $dest/VERSION ]]; }

if ! done_marker; then
    mkdir -p "$KRUNBOX_CACHE_DIR"
    # Parallel callers wait for the first one instead of racing it.
    exec {lock}>"$KRUNBOX_CACHE_DIR/.libkrunfw.lock"
    flock "$lock"
fi
if ! done_marker; then
    apt_dir=$KRUNBOX_CACHE_DIR/apt-sid
    mkdir -p "$apt_dir"
    printf 'deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] %s sid main\n' \
        "$(debian_mirror)" >"$apt_dir/sources.list"
    log "reading Debian sid's package list (private to $apt_dir)"
    PARTS=/dev/null apt_private "$apt_dir" update -qq >&2

    work=$(mktemp -d "$KRUNBOX_CACHE_DIR/libkrunfw.tmp.XXXXXX")
    chmod 755 "$work"
    trap 'rm -rf "$work"' EXIT
    log "downloading libkrunfw5 from sid"
    (cd "$work" && PARTS=/dev/null apt_private "$apt_dir" download -qq libkrunfw5 >&2)
    deb=$(echo "$work"/libkrunfw5_*.deb)
    dpkg-deb -x "$deb" "$work/root"
    lib=$(cd "$work/root" && find . -name 'libkrunfw.so.5*' -type f -print -quit)
    [[ -n $lib ]] || die "libkrunfw.so.5 not found in $deb"
    ln -s "root/${lib#./}" "$work/libkrunfw.so.5"
    dpkg-deb -f "$deb" Version >"$work/VERSION"
    rm -f "$deb"

    # Swap the finished directory in whole, so a half-done one is never seen.
    rm -rf "$dest"
    mv -T "$work" "$dest"
    rm -rf "$apt_dir" # the sid lists are large and no longer needed
    log "libkrunfw $(cat "$dest/VERSION") in $dest"
fi
printf '%s\n' "$dest"
