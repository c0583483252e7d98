//! Where krunbox finds what it needs at run time: the VMM helper binary, the guest-init binary,
//! and libkrunfw (the guest kernel).
//!
//! Each is looked for, in order: where the builder says (`SandboxBuilder::vmm_helper` and the
//! like); where an environment variable says (`KRUNBOX_VMM`, `KRUNBOX_GUEST_INIT`,
//! `KRUNBOX_LIBKRUNFW_DIR`); in the user's data directory ([`data_dir`]), where
//! [`Artifacts::install`] (and `krunbox setup`) put them; beside the running executable (a
//! cargo target directory: this workspace's own binaries, tests and benches; or where
//! `cargo install` put `krunbox` and `krunbox-vmm`); and, for guest-init and libkrunfw, in the
//! cache directory ([`cache_dir`]) where `scripts/setup.sh` puts what it builds and fetches
//! (`<cache>/guest-init`, `<cache>/libkrunfw/`). The installed layout:
//!
//! ```text
//! <data dir>/bin/krunbox-vmm
//! <data dir>/guest-init
//! <data dir>/libkrunfw/libkrunfw.so.5
//! ```

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The musl target guest-init is built for (a static binary runs on any root image).
pub const GUEST_INIT_TARGET: &str = "x86_64-unknown-linux-musl";

/// The library file libkrun loads the guest kernel from.
pub const LIBKRUNFW_SONAME: &str = "libkrunfw.so.5";

/// krunbox's cache directory: `$KRUNBOX_CACHE_DIR`, else `$XDG_CACHE_HOME/krunbox`, else
/// `~/.cache/krunbox`. Built-in images and libkrunfw live here.
///
/// ```
/// let dir = krunbox::cache_dir();
/// assert!(dir.is_absolute() || dir.starts_with("."));
/// ```
pub fn cache_dir() -> PathBuf {
    krunbox_rootfs::default_cache_dir()
}

/// krunbox's data directory, where installed artifacts live: `$KRUNBOX_DATA_DIR`, else
/// `$XDG_DATA_HOME/krunbox`, else `~/.local/share/krunbox`.
///
/// ```
/// let dir = krunbox::data_dir();
/// assert!(dir.ends_with("krunbox") || std::env::var_os("KRUNBOX_DATA_DIR").is_some());
/// ```
pub fn data_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KRUNBOX_DATA_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir).join("krunbox");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".local/share/krunbox")
}

/// A directory laid out like the data directory that this process searches first (after the
/// explicit paths and the environment variables): see [`search_first_in`].
static SEARCHED_FIRST: std::sync::RwLock<Option<PathBuf>> = std::sync::RwLock::new(None);

/// Makes this process look for the helper, guest-init and libkrunfw in `dir` (laid out as the
/// data directory is: `bin/krunbox-vmm`, `guest-init`, `libkrunfw/`) before the data
/// directory and the other usual places; the builder's paths and the environment variables
/// still come first. For a package that ships them beside itself (the Python wheel does):
/// unlike setting `KRUNBOX_VMM`, it is not inherited by the programs this process starts.
///
/// ```
/// krunbox::artifacts_search_first_in("/opt/my-agent/krunbox");
/// ```
pub fn search_first_in(dir: impl Into<PathBuf>) {
    *SEARCHED_FIRST.write().unwrap_or_else(|e| e.into_inner()) = Some(dir.into());
}

/// The usual places for `what`: the directory searched first, if one was given, then the data
/// directory.
fn installed_candidates(what: Installed) -> Vec<PathBuf> {
    let first = SEARCHED_FIRST
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    first
        .into_iter()
        .chain(std::iter::once(data_dir()))
        .map(|dir| installed(&dir, what))
        .collect()
}

/// Where an installed artifact lies below a data directory.
fn installed(data: &Path, what: Installed) -> PathBuf {
    match what {
        Installed::Helper => data.join("bin").join("krunbox-vmm"),
        Installed::GuestInit => data.join("guest-init"),
        Installed::Libkrunfw => data.join("libkrunfw"),
    }
}

#[derive(Clone, Copy)]
enum Installed {
    Helper,
    GuestInit,
    /// A directory holding `libkrunfw.so.5`.
    Libkrunfw,
}

/// Resolved run-time files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Artifacts {
    /// The `krunbox-vmm` helper binary.
    pub vmm_helper: PathBuf,
    /// The static guest-init binary.
    pub guest_init: PathBuf,
    /// A directory containing `libkrunfw.so.5`, used as the helper's library path.
    pub libkrunfw_dir: PathBuf,
}

/// Optional overrides for [`Artifacts::locate`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ArtifactOverrides {
    pub vmm_helper: Option<PathBuf>,
    pub guest_init: Option<PathBuf>,
    pub libkrunfw_dir: Option<PathBuf>,
}

/// Directories near the running executable where cargo puts binaries: the executable's own
/// directory and, for test, bench and example binaries in `target/<profile>/deps` or
/// `target/<profile>/examples`, its parent.
fn exe_dirs() -> Vec<PathBuf> {
    let Ok(exe) = std::env::current_exe() else {
        return Vec::new();
    };
    let mut dirs = Vec::new();
    if let Some(dir) = exe.parent() {
        dirs.push(dir.to_path_buf());
        if dir
            .file_name()
            .is_some_and(|n| n == "deps" || n == "examples")
        {
            if let Some(parent) = dir.parent() {
                dirs.push(parent.to_path_buf());
            }
        }
    }
    dirs
}

fn first_file(candidates: &[PathBuf]) -> Option<PathBuf> {
    candidates.iter().find(|p| p.is_file()).cloned()
}

impl Artifacts {
    /// Finds every artifact, or says which one is missing and how to get it.
    ///
    /// Order for each: the explicit override, then an environment variable
    /// (`KRUNBOX_VMM`, `KRUNBOX_GUEST_INIT`, `KRUNBOX_LIBKRUNFW_DIR`), then the usual places.
    ///
    /// ```no_run
    /// let artifacts = krunbox::Artifacts::locate().unwrap();
    /// println!("guest-init: {}", artifacts.guest_init.display());
    /// ```
    pub fn locate() -> Result<Artifacts> {
        Self::locate_with(&ArtifactOverrides::default())
    }

    /// Copies these artifacts into the data directory `data` ([`data_dir`] is the usual one),
    /// where [`Artifacts::locate`] finds them from any program: each file is written beside
    /// its place and renamed over it, so a program starting meanwhile sees the old one or the
    /// new one, whole. Returns the installed artifacts.
    ///
    /// ```no_run
    /// // What `krunbox setup` does: install what this build found for the user.
    /// let installed = krunbox::Artifacts::locate()?.install(&krunbox::data_dir())?;
    /// println!("helper: {}", installed.vmm_helper.display());
    /// # Ok::<(), krunbox::Error>(())
    /// ```
    pub fn install(&self, data: &Path) -> Result<Artifacts> {
        let helper = installed(data, Installed::Helper);
        let guest_init = installed(data, Installed::GuestInit);
        let libkrunfw = installed(data, Installed::Libkrunfw);
        copy_into_place(&self.vmm_helper, &helper, 0o755)?;
        copy_into_place(&self.guest_init, &guest_init, 0o755)?;
        copy_into_place(
            &self.libkrunfw_dir.join(LIBKRUNFW_SONAME),
            &libkrunfw.join(LIBKRUNFW_SONAME),
            0o644,
        )?;
        Ok(Artifacts {
            vmm_helper: helper,
            guest_init,
            libkrunfw_dir: libkrunfw,
        })
    }

    pub(crate) fn locate_with(over: &ArtifactOverrides) -> Result<Artifacts> {
        Ok(Artifacts {
            vmm_helper: locate_vmm_helper(over.vmm_helper.as_deref())?,
            guest_init: locate_guest_init(over.guest_init.as_deref())?,
            libkrunfw_dir: locate_libkrunfw(over.libkrunfw_dir.as_deref())?,
        })
    }
}

/// Copies `from` to `to` (its directory made if need be) by way of a temporary file beside it,
/// renamed over `to` once whole, with `mode`. Copying a file onto itself changes nothing.
fn copy_into_place(from: &Path, to: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let failed = |what: &str| Error::io(format!("{what} {} to {}", from.display(), to.display()));
    if let (Ok(a), Ok(b)) = (from.canonicalize(), to.canonicalize()) {
        if a == b {
            return Ok(());
        }
    }
    let dir = to.parent().expect("an installed artifact has a directory");
    std::fs::create_dir_all(dir).map_err(failed("making the directory for"))?;
    let temporary = tempfile::NamedTempFile::new_in(dir).map_err(failed("installing"))?;
    std::fs::copy(from, temporary.path()).map_err(failed("copying"))?;
    std::fs::set_permissions(temporary.path(), std::fs::Permissions::from_mode(mode))
        .map_err(failed("installing"))?;
    temporary
        .persist(to)
        .map_err(|e| failed("installing")(e.error))?;
    Ok(())
}

fn explicit_or_env(explicit: Option<&Path>, var: &str) -> Option<PathBuf> {
    explicit
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os(var).map(PathBuf::from))
}

pub(crate) fn locate_vmm_helper(explicit: Option<&Path>) -> Result<PathBuf> {
    let candidates = match explicit_or_env(explicit, "KRUNBOX_VMM") {
        Some(p) => vec![p],
        None => installed_candidates(Installed::Helper)
            .into_iter()
            .chain(exe_dirs().into_iter().map(|d| d.join("krunbox-vmm")))
            .collect(),
    };
    first_file(&candidates).ok_or_else(|| Error::MissingArtifact {
        what: "the krunbox-vmm helper binary",
        looked_in: candidates,
        fix: "install it with `krunbox setup` (from a build of this repository: `scripts/setup.sh` makes one), or set KRUNBOX_VMM".into(),
    })
}

pub(crate) fn locate_guest_init(explicit: Option<&Path>) -> Result<PathBuf> {
    let candidates = match explicit_or_env(explicit, "KRUNBOX_GUEST_INIT") {
        Some(p) => vec![p],
        None => {
            let mut c = installed_candidates(Installed::GuestInit);
            for dir in exe_dirs() {
                // Only the musl build: a `guest-init` next to the host binaries in a cargo target
                // directory is the workspace's glibc build, which cannot run as the guest's init.
                // Inside a cargo target directory: target/<profile>[/deps] → target/<musl>/release.
                for ancestor in dir.ancestors().take(3) {
                    c.push(
                        ancestor
                            .join(GUEST_INIT_TARGET)
                            .join("release")
                            .join("guest-init"),
                    );
                }
            }
            // Where scripts/setup.sh copies its musl build: a `krunbox` installed with
            // `cargo install` finds it there (`krunbox setup` then installs it).
            c.push(cache_dir().join("guest-init"));
            c.dedup();
            c
        }
    };
    let found = first_file(&candidates).ok_or_else(|| Error::MissingArtifact {
        what: "the guest-init binary",
        looked_in: candidates,
        fix: format!(
            "install it with `krunbox setup`, build it with `cargo build -p guest-init --release --target {GUEST_INIT_TARGET}` (after `rustup target add {GUEST_INIT_TARGET}`), or set KRUNBOX_GUEST_INIT"
        ),
    })?;
    check_static_elf(&found)?;
    Ok(found)
}

/// guest-init runs before any root image is mounted, so it must be a static x86-64 ELF: no
/// program interpreter (PT_INTERP), which would be looked up in an empty root and fail with a
/// bare "ENOENT" from the guest kernel.
pub(crate) fn check_static_elf(path: &Path) -> Result<()> {
    const PT_INTERP: u32 = 3;
    let bad = |why: String| {
        Error::InvalidConfig(format!(
        "guest-init {} {why}; build it with `cargo build -p guest-init --release --target {GUEST_INIT_TARGET}`",
        path.display()
    ))
    };
    let bytes = std::fs::read(path).map_err(Error::io(format!("reading {}", path.display())))?;
    let u16_at = |o: usize| {
        bytes
            .get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
    };
    let u32_at = |o: usize| {
        bytes
            .get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |o: usize| {
        bytes
            .get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
    };
    // e_ident: magic, ELFCLASS64 (2), little endian (1); e_machine 62 = x86-64.
    if bytes.get(..6) != Some(&[0x7f, b'E', b'L', b'F', 2, 1][..]) || u16_at(18) != Some(62) {
        return Err(bad("is not an x86-64 ELF executable".into()));
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38))
    else {
        return Err(bad("has a truncated ELF header".into()));
    };
    for i in 0..phnum {
        let entry = phoff.saturating_add(i.saturating_mul(phentsize));
        match u32_at(entry) {
            Some(PT_INTERP) => {
                return Err(bad(
                    "is dynamically linked (it has an ELF interpreter); it must be static".into(),
                ))
            }
            Some(_) => {}
            None => return Err(bad("has truncated program headers".into())),
        }
    }
    Ok(())
}

pub(crate) fn locate_libkrunfw(explicit: Option<&Path>) -> Result<PathBuf> {
    let candidates = match explicit_or_env(explicit, "KRUNBOX_LIBKRUNFW_DIR") {
        Some(p) => vec![p],
        None => {
            let mut c = installed_candidates(Installed::Libkrunfw);
            c.push(cache_dir().join("libkrunfw"));
            c
        }
    };
    candidates
        .iter()
        .find(|d| d.join(LIBKRUNFW_SONAME).exists())
        .cloned()
        .ok_or_else(|| Error::MissingArtifact {
            what: "libkrunfw (the guest kernel, libkrunfw.so.5)",
            looked_in: candidates,
            fix: "install it with `krunbox setup`, run `scripts/fetch-libkrunfw.sh` (fetches Debian's libkrunfw5 into the krunbox cache), or set KRUNBOX_LIBKRUNFW_DIR to a directory containing libkrunfw.so.5".into(),
        })
}

/// Where per-instance sockets and logs live: a local filesystem (unix sockets can't live on
/// network filesystems), short paths (sun_path is 108 bytes).
pub(crate) fn runtime_dir() -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|d| d.is_dir())
        .unwrap_or_else(std::env::temp_dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Installed artifacts land in the documented layout, whole and executable, and installing
    /// again over them (or onto themselves) leaves them as they were.
    #[test]
    fn artifacts_install_into_the_data_directory_layout() {
        use std::os::unix::fs::PermissionsExt;
        let from = tempfile::tempdir().unwrap();
        let helper = from.path().join("krunbox-vmm");
        let init = from.path().join("guest-init");
        std::fs::write(&helper, b"helper bytes").unwrap();
        std::fs::write(&init, b"init bytes").unwrap();
        std::fs::create_dir(from.path().join("fw")).unwrap();
        std::fs::write(from.path().join("fw").join(LIBKRUNFW_SONAME), b"kernel").unwrap();
        let found = Artifacts {
            vmm_helper: helper,
            guest_init: init,
            libkrunfw_dir: from.path().join("fw"),
        };
        let data = tempfile::tempdir().unwrap();
        let installed = found.install(data.path()).unwrap();
        assert_eq!(installed.vmm_helper, data.path().join("bin/krunbox-vmm"));
        assert_eq!(installed.guest_init, data.path().join("guest-init"));
        assert_eq!(installed.libkrunfw_dir, data.path().join("libkrunfw"));
        assert_eq!(
            std::fs::read(&installed.vmm_helper).unwrap(),
            b"helper bytes"
        );
        let mode = std::fs::metadata(&installed.vmm_helper)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
        assert_eq!(
            std::fs::read(installed.libkrunfw_dir.join(LIBKRUNFW_SONAME)).unwrap(),
            b"kernel"
        );
        // Again, from the installed copies themselves: nothing changes, nothing is left over.
        let again = installed.install(data.path()).unwrap();
        assert_eq!(again, installed);
        assert_eq!(std::fs::read(&again.guest_init).unwrap(), b"init bytes");
        let entries = std::fs::read_dir(data.path()).unwrap().count();
        assert_eq!(entries, 3, "bin/, guest-init, libkrunfw/ and nothing else");
    }

    #[test]
    fn dynamic_and_non_elf_binaries_are_refused_as_guest_init() {
        // The test binary itself is a dynamically linked glibc executable.
        let me = std::env::current_exe().unwrap();
        let err = check_static_elf(&me).unwrap_err();
        assert!(err.to_string().contains("dynamically linked"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("init");
        std::fs::write(&text, b"#!/bin/sh\n").unwrap();
        assert!(check_static_elf(&text)
            .unwrap_err()
            .to_string()
            .contains("not an x86-64 ELF"));
        std::fs::write(&text, b"\x7fELF\x02\x01").unwrap();
        assert!(check_static_elf(&text).is_err());
    }
}
