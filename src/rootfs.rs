//! Root filesystems: which image a sandbox boots, and proving it is the image expected.
//!
//! Every root image is identified by its SHA-256. Before each boot the image file is opened,
//! hashed, and compared with the expected digest; the *same open file descriptor* is then handed
//! to the VMM, so a path swapped after the check cannot substitute another file. A mismatch
//! refuses the boot ([`Error::ImageDigestMismatch`]).

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
pub use krunbox_rootfs::BuiltinImage;

/// The root filesystem of a sandbox. The guest sees it read-only, with tmpfs scratch space on
/// `/tmp`, `/run`, `/var/tmp`, `/root` and `/home`.
///
/// ```
/// use krunbox::{BuiltinImage, Rootfs};
///
/// let tiny = Rootfs::builtin(BuiltinImage::Busybox);
/// let mine = Rootfs::image("/srv/images/tools.erofs", "erofs",
///     "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08");
/// # let _ = (tiny, mine);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rootfs {
    /// A built-in image, built from Debian packages into the cache on first use.
    Builtin(BuiltinImage),
    /// A user-supplied image file with its expected digest.
    Image {
        /// The image file.
        path: PathBuf,
        /// Filesystem type the guest mounts it as (`erofs`, `ext4`, …).
        fstype: String,
        /// Expected SHA-256, lowercase hex.
        sha256: String,
    },
}

impl Rootfs {
    /// A built-in image.
    pub fn builtin(image: BuiltinImage) -> Rootfs {
        Rootfs::Builtin(image)
    }

    /// A user-supplied image with the SHA-256 it must have.
    pub fn image(path: impl Into<PathBuf>, fstype: &str, sha256: &str) -> Rootfs {
        Rootfs::Image {
            path: path.into(),
            fstype: fstype.to_string(),
            sha256: sha256.to_ascii_lowercase(),
        }
    }
}

/// A root image that passed its digest check, held open.
#[derive(Debug)]
pub(crate) struct VerifiedImage {
    pub file: File,
    pub path: PathBuf,
    pub fstype: String,
    pub sha256: String,
}

/// Makes sure a built-in image exists (building it if needed, with progress through
/// `progress`) and returns its path, format and recorded digest.
pub(crate) fn resolve(
    rootfs: &Rootfs,
    cache_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<(PathBuf, String, String)> {
    match rootfs {
        Rootfs::Builtin(image) => {
            let manifest = match krunbox_rootfs::load(cache_dir, *image)? {
                Some(manifest) => manifest,
                None => {
                    progress(&format!(
                        "built-in image `{}` is not in {} yet: building it",
                        image.name(),
                        cache_dir.display()
                    ));
                    krunbox_rootfs::build(cache_dir, *image, progress)?
                }
            };
            Ok((
                krunbox_rootfs::image_path(cache_dir, *image),
                manifest.format,
                manifest.sha256,
            ))
        }
        Rootfs::Image {
            path,
            fstype,
            sha256,
        } => Ok((path.clone(), fstype.clone(), sha256.clone())),
    }
}

/// Opens `path`, hashes the open file, and fails closed on a mismatch.
pub(crate) fn verify(path: &Path, fstype: &str, expected: &str) -> Result<VerifiedImage> {
    let mut file =
        File::open(path).map_err(Error::io(format!("opening root image {}", path.display())))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(Error::io(format!("reading root image {}", path.display())))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let actual = hex::encode(hasher.finalize());
    if !actual.eq_ignore_ascii_case(expected) {
        return Err(Error::ImageDigestMismatch {
            path: path.to_path_buf(),
            expected: expected.to_string(),
            actual,
        });
    }
    Ok(VerifiedImage {
        file,
        path: path.to_path_buf(),
        fstype: fstype.to_string(),
        sha256: actual,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn digest_check_passes_and_fails_closed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::File::create(&path)
            .unwrap()
            .write_all(b"abc")
            .unwrap();
        let good = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        let verified = verify(&path, "erofs", good).unwrap();
        assert_eq!(verified.sha256, good);

        std::fs::write(&path, b"abd").unwrap();
        match verify(&path, "erofs", good) {
            Err(Error::ImageDigestMismatch {
                expected, actual, ..
            }) => {
                assert_eq!(expected, good);
                assert_ne!(actual, good);
            }
            other => panic!("expected a digest mismatch, got {other:?}"),
        }
        assert!(matches!(
            verify(&dir.path().join("missing"), "erofs", good),
            Err(Error::Io { .. })
        ));
    }
}
