//! Where krunbox finds what it needs at run time: the VMM helper binary, the guest-init binary,
//! and libkrunfw (the guest kernel).
//!
//! Each can be given explicitly (builder or environment variable); otherwise krunbox looks
//! where its own build and set-up put them.

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

    pub(crate) fn locate_with(over: &ArtifactOverrides) -> Result<Artifacts> {
        Ok(Artifacts {
            vmm_helper: locate_vmm_helper(over.vmm_helper.as_deref())?,
            guest_init: locate_guest_init(over.guest_init.as_deref())?,
            libkrunfw_dir: locate_libkrunfw(over.libkrunfw_dir.as_deref())?,
        })
    }
}

fn explicit_or_env(explicit: Option<&Path>, var: &str) -> Option<PathBuf> {
    explicit
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os(var).map(PathBuf::from))
}

pub(crate) fn locate_vmm_helper(explicit: Option<&Path>) -> Result<PathBuf> {
    let candidates = match explicit_or_env(explicit, "KRUNBOX_VMM") {
        Some(p) => vec![p],
        None => exe_dirs()
            .into_iter()
            .map(|d| d.join("krunbox-vmm"))
            .collect(),
    };
    first_file(&candidates).ok_or_else(|| Error::MissingArtifact {
        what: "the krunbox-vmm helper binary",
        looked_in: candidates,
        fix: "build it with `cargo build --bin krunbox-vmm` (it is installed next to `krunbox`), or set KRUNBOX_VMM".into(),
    })
}

pub(crate) fn locate_guest_init(explicit: Option<&Path>) -> Result<PathBuf> {
    let candidates = match explicit_or_env(explicit, "KRUNBOX_GUEST_INIT") {
        Some(p) => vec![p],
        None => {
            let mut c = Vec::new();
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
            c.dedup();
            c
        }
    };
    let found = first_file(&candidates).ok_or_else(|| Error::MissingArtifact {
        what: "the guest-init binary",
        looked_in: candidates,
        fix: format!(
            "build it with `cargo build -p guest-init --release --target {GUEST_INIT_TARGET}` (after `rustup target add {GUEST_INIT_TARGET}`), or set KRUNBOX_GUEST_INIT"
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
        None => vec![cache_dir().join("libkrunfw")],
    };
    candidates
        .iter()
        .find(|d| d.join(LIBKRUNFW_SONAME).exists())
        .cloned()
        .ok_or_else(|| Error::MissingArtifact {
            what: "libkrunfw (the guest kernel, libkrunfw.so.5)",
            looked_in: candidates,
            fix: "run `scripts/fetch-libkrunfw.sh` (fetches Debian's libkrunfw5 into the krunbox cache), or set KRUNBOX_LIBKRUNFW_DIR to a directory containing libkrunfw.so.5".into(),
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
