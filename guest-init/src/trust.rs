//! The sandbox CA in the guest's trust: the bundle TLS clients read by default
//! ([`SYSTEM_BUNDLE`], where OpenSSL, curl, git and Python look on Debian-family images) holds
//! it for the boot, and the commands' environment names that bundle (`net::environment`).
//!
//! - **A read-only root** is never written: the bundle (the image's, plus the CA) is a file of
//!   guest-init's bound read-only over the image's. An image without one gets an empty file in
//!   its root overlay to bind over (`mounts.rs`, [`bound_files`]), so the bundle sits at the
//!   standard path in every image, where no mount of the caller's (over `/tmp` or `/run`, say)
//!   hides it.
//! - **A writable root** gets the CA the way the image's own tools install a local one
//!   (Debian's `update-ca-certificates`): the certificate under [`LOCAL_CA`] and the bundle
//!   rewritten, a regular file, with it; a later `update-ca-certificates` in the guest keeps it.
//!   A root that outlives the boot (copy-on-write, persistent) gets the previous boot's CA
//!   taken out again at the next boot (its key died with that boot's network), also when the
//!   next boot has no CA.

use std::fs;
use std::io;
use std::path::Path;

use crate::sys::{c, mount};

/// The system's CA bundle in Debian-family images.
pub const SYSTEM_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Where a writable root keeps the sandbox CA, as a local CA of the image's own.
pub const LOCAL_CA: &str = "/usr/local/share/ca-certificates/krunbox-sandbox.crt";

/// Where the bundle goes in an image with no `/etc` at all (nothing to bind over, nowhere to
/// add a file).
const OWN_BUNDLE: &str = "/tmp/.krunbox-ca-bundle.pem";

/// The bundle holding the sandbox CA, once installed.
static BUNDLE: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

/// The bundle that holds the sandbox CA, for the commands' environment (`None`: this boot has
/// no CA).
pub fn bundle() -> Option<&'static str> {
    BUNDLE.get().copied()
}

/// The files a read-only image must have for guest-init to bind over them: the bundle, when
/// this boot installs a CA.
pub fn bound_files(has_ca: bool) -> &'static [&'static str] {
    if has_ca {
        &[SYSTEM_BUNDLE]
    } else {
        &[]
    }
}

/// Puts `ca` (PEM) in the guest's trust, as the module says for a `writable_root` or a
/// read-only one; with no CA, a writable root only loses a previous boot's. A writable root
/// whose trust store cannot take it (no room, a bundle that is not text, a dangling link)
/// gets the read-only root's bind instead, said on the console, and its store is left as it
/// was.
pub fn install(ca: Option<&str>, writable_root: bool) -> io::Result<()> {
    if writable_root {
        match install_in_store(ca) {
            Ok(()) => {
                if ca.is_some() {
                    let _ = BUNDLE.set(SYSTEM_BUNDLE);
                }
                return Ok(());
            }
            Err(e) => eprintln!(
                "guest-init: the root's trust store could not take the sandbox CA ({e}): \
                 bound over it instead"
            ),
        }
    }
    match ca {
        Some(pem) => bind_bundle(pem),
        None => Ok(()),
    }
}

/// The most of a bundle read (Debian's is about 200 KiB).
const BUNDLE_MAX: u64 = 16 << 20;

/// The most of a certificate read.
const CERTIFICATE_MAX: u64 = 64 << 10;

/// The text of `path` when it is a regular file of at most `max` bytes (`None`: there is
/// none). Opened without following a final symlink and without blocking, so a link to
/// `/dev/zero` or a FIFO the guest left in its root is an error, not a hang.
fn read_text(path: &Path, max: u64) -> io::Result<Option<String>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = match fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
    };
    if !file.metadata()?.is_file() {
        return Err(io::Error::other(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(io::Error::other(format!(
            "{} is over {max} bytes",
            path.display()
        )));
    }
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|_| io::Error::other(format!("{} is not text", path.display())))
}

/// `text` with a final newline unless empty.
fn terminated(mut text: String) -> String {
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text
}

/// The image's bundle plus `pem`, bound read-only over it; in an image without `/etc`, a
/// bundle of its own on the scratch `/tmp`.
fn bind_bundle(pem: &str) -> io::Result<()> {
    // Where the bundle is (a link, as in RHEL-family images, is followed; the bind then lands
    // on what it leads to); without one (no /etc, a dangling link), a bundle of its own.
    let Ok(target) = fs::canonicalize(SYSTEM_BUNDLE) else {
        fs::write(OWN_BUNDLE, pem)?;
        let _ = BUNDLE.set(OWN_BUNDLE);
        return Ok(());
    };
    let bundle = terminated(read_text(&target, BUNDLE_MAX)?.unwrap_or_default()) + pem;
    const SCRATCH: &str = "/tmp/.krunbox-ca-scratch.pem";
    fs::write(SCRATCH, bundle)?;
    let result = mount(SCRATCH, SYSTEM_BUNDLE, None, libc::MS_BIND, None).and_then(|()| {
        mount(
            "none",
            SYSTEM_BUNDLE,
            None,
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
            None,
        )
    });
    let scratch = c(SCRATCH)?;
    // SAFETY: a valid C string; the bind mount keeps the file itself alive.
    unsafe { libc::unlink(scratch.as_ptr()) };
    result?;
    let _ = BUNDLE.set(SYSTEM_BUNDLE);
    Ok(())
}

/// The trust store of a writable root, at `root` (`/` in the guest; a directory in tests).
fn install_in_store(ca: Option<&str>) -> io::Result<()> {
    install_in_store_at(Path::new("/"), ca)
}

fn install_in_store_at(root: &Path, ca: Option<&str>) -> io::Result<()> {
    let at = |path: &str| root.join(path.trim_start_matches('/'));
    let local_ca = at(LOCAL_CA);
    let previous = read_text(&local_ca, CERTIFICATE_MAX)?;
    if previous.is_none() && ca.is_none() {
        return Ok(());
    }
    // A bundle that is a link (to where the image's own tools keep it) is rewritten where it
    // leads, so the link and those tools keep working; a dangling one is an error.
    let mut system_bundle = at(SYSTEM_BUNDLE);
    if fs::symlink_metadata(&system_bundle).is_ok_and(|m| m.file_type().is_symlink()) {
        system_bundle = fs::canonicalize(&system_bundle)?;
    }
    let mut bundle = read_text(&system_bundle, BUNDLE_MAX)?.unwrap_or_default();
    if let Some(previous) = previous.as_deref().map(str::trim).filter(|p| !p.is_empty()) {
        bundle = bundle
            .replace(&format!("{previous}\n"), "")
            .replace(previous, "");
    }
    match ca {
        Some(pem) => {
            fs::create_dir_all(local_ca.parent().expect("a path with a parent"))?;
            fs::write(&local_ca, pem)?;
            bundle = terminated(bundle) + pem;
        }
        None => fs::remove_file(&local_ca)?,
    }
    let dir = system_bundle.parent().expect("a path with a parent");
    fs::create_dir_all(dir)?;
    // Whole or not at all: a new file renamed over the old one.
    let fresh = dir.join(".krunbox-ca-certificates.crt.new");
    fs::write(&fresh, terminated(bundle))?;
    fs::rename(&fresh, &system_bundle)
}

#[cfg(test)]
mod tests {
    use super::*;

    const IMAGE_CA: &str = "-----BEGIN CERTIFICATE-----\nimage\n-----END CERTIFICATE-----\n";

    fn pem(name: &str) -> String {
        format!("-----BEGIN CERTIFICATE-----\n{name}\n-----END CERTIFICATE-----\n")
    }

    fn root(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("guest-init-trust-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("etc/ssl/certs")).unwrap();
        fs::write(dir.join("etc/ssl/certs/ca-certificates.crt"), IMAGE_CA).unwrap();
        dir
    }

    fn read(root: &Path, path: &str) -> String {
        fs::read_to_string(root.join(path.trim_start_matches('/'))).unwrap()
    }

    /// Three boots of one persisted root: the first CA is added, the second replaces it (the
    /// first leaves the bundle), a boot without a CA takes the second out; the image's own
    /// certificates stay throughout.
    #[test]
    fn a_writable_root_holds_exactly_the_current_boots_ca() {
        let dir = root("store");
        install_in_store_at(&dir, Some(&pem("first"))).unwrap();
        assert_eq!(
            read(&dir, SYSTEM_BUNDLE),
            format!("{IMAGE_CA}{}", pem("first"))
        );
        assert_eq!(read(&dir, LOCAL_CA), pem("first"));
        install_in_store_at(&dir, Some(&pem("second"))).unwrap();
        assert_eq!(
            read(&dir, SYSTEM_BUNDLE),
            format!("{IMAGE_CA}{}", pem("second"))
        );
        install_in_store_at(&dir, None).unwrap();
        assert_eq!(read(&dir, SYSTEM_BUNDLE), IMAGE_CA);
        assert!(!dir.join(LOCAL_CA.trim_start_matches('/')).exists());
        // Nothing to do, nothing written.
        install_in_store_at(&dir, None).unwrap();
        assert_eq!(read(&dir, SYSTEM_BUNDLE), IMAGE_CA);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// An image without a bundle or the directories gets them.
    #[test]
    fn a_writable_root_without_a_bundle_gets_one() {
        let dir = root("bare");
        fs::remove_dir_all(dir.join("etc")).unwrap();
        install_in_store_at(&dir, Some(&pem("only"))).unwrap();
        assert_eq!(read(&dir, SYSTEM_BUNDLE), pem("only"));
        fs::remove_dir_all(&dir).unwrap();
    }
}
