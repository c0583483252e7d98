//! The key snapshots' manifests are authenticated with: 32 random bytes in the cache
//! directory (`snapshot.key`, mode 0600, made on first use), as trusted as the seals and
//! image digests beside it. Only this user's processes can write a snapshot another of them
//! accepts; a snapshot carried to another user or machine is refused there.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

const KEY_FILE: &str = "snapshot.key";
const KEY_BYTES: usize = 32;

/// The user's snapshot key.
pub(crate) struct SnapshotKey([u8; KEY_BYTES]);

impl SnapshotKey {
    /// The key in `cache_dir`, made there (atomically, 0600) if there is none.
    pub(crate) fn load_or_create(cache_dir: &Path) -> std::io::Result<SnapshotKey> {
        let path = cache_dir.join(KEY_FILE);
        match Self::read(&path) {
            Ok(key) => return Ok(key),
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            Err(_) => {}
        }
        std::fs::create_dir_all(cache_dir)?;
        let mut key = [0u8; KEY_BYTES];
        getrandom(&mut key)?;
        // Written under a temporary name and linked into place: a second process making one
        // at the same moment keeps the first one's (link fails with EEXIST) and reads it.
        let tmp = tempfile::NamedTempFile::new_in(cache_dir)?;
        std::fs::set_permissions(
            tmp.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )?;
        tmp.as_file().write_all(&key)?;
        tmp.as_file().sync_all()?;
        match std::fs::hard_link(tmp.path(), &path) {
            Ok(()) => Ok(SnapshotKey(key)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Self::read(&path),
            Err(e) => Err(e),
        }
    }

    fn read(path: &Path) -> std::io::Result<SnapshotKey> {
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)?;
        let mut key = [0u8; KEY_BYTES];
        let mut rest = Vec::new();
        file.read_exact(&mut key)?;
        if file.read_to_end(&mut rest)? != 0 {
            return Err(std::io::Error::other(format!(
                "{} is longer than a snapshot key",
                path.display()
            )));
        }
        Ok(SnapshotKey(key))
    }

    /// HMAC-SHA256 of `bytes`, hex.
    pub(crate) fn sign(&self, bytes: &[u8]) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(bytes);
        hex::encode(mac.finalize().into_bytes())
    }

    /// Whether `signature` is this key's for `bytes` (compared in constant time).
    pub(crate) fn verify(&self, bytes: &[u8], signature: &str) -> bool {
        let Ok(signature) = hex::decode(signature) else {
            return false;
        };
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(bytes);
        mac.verify_slice(&signature).is_ok()
    }
}

fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: getrandom writes at most the given length into the buffer it is given.
        let got =
            unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if got < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
            continue;
        }
        filled += got as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_made_once_private_and_signs_what_only_it_verifies() {
        let cache = tempfile::tempdir().unwrap();
        let key = SnapshotKey::load_or_create(cache.path()).unwrap();
        let mode = std::fs::metadata(cache.path().join(KEY_FILE)).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o600
        );
        let again = SnapshotKey::load_or_create(cache.path()).unwrap();
        let signature = key.sign(b"manifest");
        assert!(again.verify(b"manifest", &signature));
        assert!(!again.verify(b"manifesT", &signature));
        assert!(!again.verify(b"manifest", "zz"));
        let other = SnapshotKey::load_or_create(tempfile::tempdir().unwrap().path()).unwrap();
        assert!(!other.verify(b"manifest", &signature));
    }
}
