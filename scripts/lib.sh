# shellcheck shell=bash
# Shared helpers for krunbox's scripts. Source it; it does nothing by itself.

# Everything downloaded or built by the scripts lives here, so it survives
# between runs (idempotence) and can be thrown away with one `rm -rf`.
KRUNBOX_CACHE_DIR="${KRUNBOX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/krunbox}"
export KRUNBOX_CACHE_DIR

# Progress goes to stderr so stdout stays clean for real output.
# Each line carries the wall-clock time, so CI's log shows what each phase took.
log() { printf '==> %(%H:%M:%S)T %s\n' -1 "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

export DEBIAN_FRONTEND=noninteractive

# cargo_target_dir: where cargo puts what it builds (./target, or CARGO_TARGET_DIR or cargo's
# configuration when they say otherwise), as an absolute path.
cargo_target_dir() {
    cargo metadata --format-version 1 --no-deps |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])'
}

# apt_update_once: `apt-get update`, at most once per script run. apt-cache
# and `apt-get download` see nothing on a machine whose lists were never fetched.
_krunbox_apt_updated=
apt_update_once() {
    [[ -n $_krunbox_apt_updated ]] && return 0
    log "apt-get update"
    apt-get update -qq >&2
    _krunbox_apt_updated=1
}

# apt_lists_present: true when the machine has fetched package lists before.
apt_lists_present() {
    compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null
}

# need_apt PKG...: install only the packages that are not installed yet.
need_apt() {
    local pkg missing=()
    for pkg in "$@"; do
        dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null | grep -qx installed ||
            missing+=("$pkg")
    done
    ((${#missing[@]})) || return 0
    # Lists that are absent or do not know a package need refreshing first.
    if ! apt_lists_present || ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
        apt_update_once
    fi
    log "apt-get install ${missing[*]}"
    if ! apt_install "${missing[@]}"; then
        # Stale lists point at files the mirror no longer has: refresh, retry once.
        [[ -z $_krunbox_apt_updated ]] || return 1
        apt_update_once
        apt_install "${missing[@]}"
    fi
}

# apt_install ARGS...: `apt-get install` that never removes an installed
# package (--no-remove) and shows dpkg's chatter only when it fails.
apt_install() {
    local out rc=0
    out=$(apt-get install -y -qq --no-install-recommends --no-remove "$@" 2>&1) || rc=$?
    ((rc == 0)) || printf '%s\n' "$out" >&2
    return "$rc"
}

# apt_private DIR APT-GET-ARGS...: run apt-get with extra sources from
# DIR/sources.list and private package lists and cache under DIR, so the
# machine's own apt configuration and lists are never changed. With
# PARTS=/dev/null the machine's sources.list.d is ignored as well.
apt_private() {
    local dir=$1
    shift
    mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
    # The cache is under $HOME, which apt's unprivileged _apt user cannot
    # enter: download as root instead of printing a warning every time.
    apt-get -o Dir::Etc::SourceList="$dir/sources.list" \
        -o Dir::Etc::SourceParts="${PARTS:-/etc/apt/sources.list.d}" \
        -o Dir::State::Lists="$dir/lists" -o Dir::Cache="$dir/cache" \
        -o APT::Sandbox::User=root -o Acquire::Languages=none "$@"
}

# debian_mirror: print the Debian mirror URI that this machine's apt
# configuration uses for bookworm main (e.g. http://HOST/debian), so no
# mirror host is ever written into the repository. `apt-get indextargets`
# reads the configured sources (both one-line and deb822 formats) and works
# before the first `apt-get update`. KRUNBOX_DEBIAN_MIRROR overrides it.
debian_mirror() {
    if [[ -n ${KRUNBOX_DEBIAN_MIRROR:-} ]]; then
        printf '%s\n' "${KRUNBOX_DEBIAN_MIRROR%/}"
        return
    fi
    local uri
    # shellcheck disable=SC2016 # $(...) are apt's format fields, not shell.
    uri=$(apt-get indextargets --format '$(SITE) $(RELEASE) $(CODENAME) $(COMPONENT)' 2>/dev/null |
        awk '($2 == "bookworm" || $3 == "bookworm") && $4 == "main" { print $1; exit }')
    [[ -n $uri ]] || die "no bookworm main source in the apt configuration (set KRUNBOX_DEBIAN_MIRROR)"
    printf '%s\n' "${uri%/}"
}
