//! The instance's directory (control socket, console, logs, the helper's configuration), and
//! the sweep that removes those whose owning process died without removing them (killed).
//!
//! An instance directory holds `owner.lock`, a file its process keeps open and `flock`ed for
//! as long as the directory is in use: the kernel lets go of the lock when the process ends,
//! however it ends. Each boot first sweeps the runtime directory: a `krunbox-*` directory of
//! this user's whose lock can be taken has no owner left, and is removed. A directory without
//! `owner.lock` is left alone (one being made, or kept with `KRUNBOX_KEEP_INSTANCE_DIR`): the
//! lock file is locked before it gets its name, so no sweep ever finds it unlocked while its
//! owner lives.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use crate::error::{Error, Result};

/// The lock file's name in an instance directory.
const OWNER: &str = "owner.lock";
/// Its name while it is being locked.
const OWNER_STAGED: &str = "owner.lock.new";
/// What every instance directory's name starts with.
const PREFIX: &str = "krunbox-";

/// An instance's directory, removed when dropped (unless kept for debugging).
pub(crate) struct InstanceDir {
    dir: tempfile::TempDir,
    /// Held (and locked) while the directory is in use; dropped after it is removed.
    _owner: Option<File>,
}

impl InstanceDir {
    /// A new directory in the runtime directory, after sweeping those left by processes that
    /// died (on the blocking pool: it reads the directory and may remove trees); kept after
    /// the instance with `KRUNBOX_KEEP_INSTANCE_DIR`, for debugging.
    pub(crate) async fn create() -> Result<InstanceDir> {
        let runtime = crate::artifacts::runtime_dir();
        let swept = runtime.clone();
        // A sweep that failed to run (its thread panicked) only leaves directories behind.
        let _ = tokio::task::spawn_blocking(move || sweep(&swept)).await;
        let mut dir = tempfile::Builder::new()
            .prefix(PREFIX)
            .tempdir_in(&runtime)
            .map_err(Error::io("creating the instance directory"))?;
        if std::env::var_os("KRUNBOX_KEEP_INSTANCE_DIR").is_some() {
            dir.disable_cleanup(true);
            tracing::info!(dir = %dir.path().display(), "keeping the instance directory");
            return Ok(InstanceDir { dir, _owner: None });
        }
        let owner = claim(dir.path()).map_err(Error::io("locking the instance directory"))?;
        Ok(InstanceDir {
            dir,
            _owner: Some(owner),
        })
    }

    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// `flock(fd, operation)`.
fn flock(file: &File, operation: libc::c_int) -> std::io::Result<()> {
    // SAFETY: flock takes an open descriptor (borrowed from `file` for the call) and flags.
    if unsafe { libc::flock(file.as_raw_fd(), operation) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Makes `dir`'s lock file, locked before it has its name.
fn claim(dir: &Path) -> std::io::Result<File> {
    let staged = dir.join(OWNER_STAGED);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&staged)?;
    flock(&file, libc::LOCK_EX)?;
    std::fs::rename(&staged, dir.join(OWNER))?;
    Ok(file)
}

/// Removes the instance directories in `runtime` whose owner is gone. Best effort: what
/// cannot be read or removed is left (and logged), the boot goes on.
fn sweep(runtime: &Path) {
    let Ok(entries) = std::fs::read_dir(runtime) else {
        return;
    };
    // SAFETY: geteuid cannot fail.
    let uid = unsafe { libc::geteuid() };
    for entry in entries.flatten() {
        let path = entry.path();
        let ours = entry.file_name().to_string_lossy().starts_with(PREFIX)
            && std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir() && m.uid() == uid);
        if !ours || !abandoned(&path) {
            continue;
        }
        match std::fs::remove_dir_all(&path) {
            // Another process's sweep got there first.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Ok(()) => tracing::info!(
                target: "krunbox",
                dir = %path.display(),
                "removed the instance directory of a process that ended without removing it"
            ),
            Err(e) => tracing::warn!(
                target: "krunbox",
                dir = %path.display(),
                "cannot remove an abandoned instance directory: {e}"
            ),
        }
    }
}

/// How old a staged lock file must be for its directory to count as abandoned: its process
/// died between making it and locking it, which takes microseconds.
const STAGED_GRACE: std::time::Duration = std::time::Duration::from_secs(60);

/// Whether `dir` has a lock file nobody holds (or only a staged one, old and unlocked: its
/// process died before it could rename it).
fn abandoned(dir: &Path) -> bool {
    let open = |name: &str| {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(dir.join(name))
    };
    if let Ok(file) = open(OWNER) {
        return flock(&file, libc::LOCK_EX | libc::LOCK_NB).is_ok();
    }
    let Ok(staged) = open(OWNER_STAGED) else {
        return false;
    };
    let old = staged
        .metadata()
        .and_then(|m| m.modified())
        .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > STAGED_GRACE));
    old && flock(&staged, libc::LOCK_EX | libc::LOCK_NB).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory whose lock is held survives a sweep; once the holder lets go it is swept;
    /// one without a lock file (being made, or kept), one whose lock is being staged and one of
    /// another name are never touched; one whose staging was abandoned long ago is swept.
    #[test]
    fn a_sweep_removes_only_directories_whose_owner_is_gone() {
        let runtime = tempfile::tempdir().unwrap();
        let live = runtime.path().join("krunbox-live");
        let crashed = runtime.path().join("krunbox-crashed-while-staging");
        let staging = runtime.path().join("krunbox-staging-now");
        let dead = runtime.path().join("krunbox-dead");
        let unlocked = runtime.path().join("krunbox-being-made");
        let other = runtime.path().join("other-dead");
        for dir in [&live, &dead, &unlocked, &other, &crashed, &staging] {
            std::fs::create_dir(dir).unwrap();
            std::fs::write(dir.join("console.log"), b"x").unwrap();
        }
        let held = claim(&live).unwrap();
        drop(claim(&dead).unwrap());
        drop(claim(&other).unwrap());
        assert!(live.join(OWNER).exists() && !live.join(OWNER_STAGED).exists());
        // A staged lock file: unlocked and old (its process died before the rename), or
        // unlocked and new (its process is between making and locking it).
        let old = std::time::SystemTime::now() - 2 * STAGED_GRACE;
        let file = File::create(crashed.join(OWNER_STAGED)).unwrap();
        file.set_modified(old).unwrap();
        File::create(staging.join(OWNER_STAGED)).unwrap();

        sweep(runtime.path());
        assert!(live.exists() && unlocked.exists() && other.exists() && staging.exists());
        assert!(!dead.exists() && !crashed.exists());

        drop(held);
        sweep(runtime.path());
        assert!(!live.exists());
        assert!(unlocked.exists() && other.exists());
    }
}
