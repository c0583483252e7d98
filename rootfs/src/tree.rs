//! Helpers shared by the image trees: directories, small files, mount points.
//!
//! Every mode is set explicitly (not left to the umask), so the tree, and so
//! the image, is the same whoever builds it.

use crate::{BuildError, IoContext};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Directories the guest needs whatever the image: guest-init mounts proc, sys,
/// dev, dev/pts and tmp over them; the rest are where programs expect to write
/// or find things. Modes follow Debian's base-files.
pub(crate) const MOUNT_POINTS: &[(&str, u32)] = &[
    ("proc", 0o555),
    ("sys", 0o555),
    ("dev", 0o755),
    ("dev/pts", 0o755),
    ("tmp", 0o1777),
    ("run", 0o755),
    ("root", 0o700),
    ("etc", 0o755),
    ("var", 0o755),
    ("var/tmp", 0o1777),
    ("home", 0o755),
];

/// `/etc/hosts`: a read-only root cannot gain one at run time, and resolvers
/// expect `localhost` to resolve without DNS.
pub(crate) const HOSTS: &str = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n";

/// Creates `dir` (and parents) and sets its mode.
pub(crate) fn mkdir(dir: &Path, mode: u32) -> Result<(), BuildError> {
    fs::create_dir_all(dir).at(dir)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(mode)).at(dir)
}

/// Writes `contents` to `path` and sets its mode.
pub(crate) fn write(path: &Path, contents: &str, mode: u32) -> Result<(), BuildError> {
    fs::write(path, contents).at(path)?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).at(path)
}

/// Makes every [`MOUNT_POINTS`] directory exist with its mode.
pub(crate) fn ensure_mount_points(root: &Path) -> Result<(), BuildError> {
    for &(dir, mode) in MOUNT_POINTS {
        mkdir(&root.join(dir), mode)?;
    }
    Ok(())
}

/// Removes everything inside `dir`, keeping `dir` itself.
pub(crate) fn empty_dir(dir: &Path) -> Result<(), BuildError> {
    for entry in fs::read_dir(dir).at(dir)? {
        let path = entry.at(dir)?.path();
        // symlink_metadata: a symlink to a directory is removed, never followed.
        if fs::symlink_metadata(&path).at(&path)?.is_dir() {
            fs::remove_dir_all(&path).at(&path)?;
        } else {
            fs::remove_file(&path).at(&path)?;
        }
    }
    Ok(())
}

/// Removes a file if it exists.
pub(crate) fn remove_file(path: &Path) -> Result<(), BuildError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e).at(path),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_have_exact_modes() {
        let dir = tempfile::tempdir().unwrap();
        ensure_mount_points(dir.path()).unwrap();
        for &(d, mode) in MOUNT_POINTS {
            let meta = fs::metadata(dir.path().join(d)).unwrap();
            assert!(meta.is_dir());
            assert_eq!(meta.permissions().mode() & 0o7777, mode, "{d}");
        }
    }
}
