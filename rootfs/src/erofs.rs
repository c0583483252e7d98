//! Turning a directory tree into an EROFS image with `mkfs.erofs`, reproducibly.

use crate::cmd::run;
use crate::{BuildError, BuiltinImage};
use sha2::{Digest, Sha256};
use std::path::Path;
use std::process::Command;

/// The one timestamp of every image: each inode's mtime/ctime, the superblock's
/// build time, and `SOURCE_DATE_EPOCH` for mmdebstrap. 2024-01-01T00:00:00Z; not
/// 0, because some tools reject dates before 1980 (zip, Python's zipimport).
pub(crate) const SOURCE_DATE_EPOCH: u64 = 1_704_067_200;

/// Data compression: none.
///
/// libkrunfw's x86_64 kernel config (config-libkrunfw_x86_64, Linux 6.12) sets
/// `CONFIG_EROFS_FS=y`, `_XATTR` and `_SECURITY` but does not list
/// `CONFIG_EROFS_FS_ZIP` nor `CONFIG_LZ4_DECOMPRESS` (its aarch64 and riscv64
/// configs do), so a compressed image is not known to mount on every guest.
/// Uncompressed also makes reads zero-copy. Should the config gain
/// `CONFIG_EROFS_FS_ZIP=y`, setting this to `Some("lz4hc,12")` (passed as `-z`)
/// shrinks the agent image from about 205 MB to about 116 MB.
const COMPRESSION: Option<&str> = None;

/// `mkfs.erofs` options that make the image a function of the tree's contents
/// only. Directory entries are always written in sorted order by mkfs.erofs,
/// whatever order the source directory lists them in.
fn reproducible_args(image: BuiltinImage) -> Vec<String> {
    let mut args = vec![
        // Same timestamp on every inode and in the superblock.
        format!("-T{SOURCE_DATE_EPOCH}"),
        // A fixed UUID per image instead of a random one.
        format!("-U{}", fs_uuid(image)),
        // uid/gid 0 everywhere, whoever owns the build tree.
        "--all-root".to_string(),
        // No extended attributes: the only ones a build tree can carry come from
        // the build host (SELinux labels, overlayfs markers), not from Debian
        // packages, whose files carry none (none of the packages used here sets
        // file capabilities).
        "-x-1".to_string(),
    ];
    if let Some(algorithm) = COMPRESSION {
        args.push(format!("-z{algorithm}"));
    }
    args
}

/// Builds `out` from the directory `root`.
pub(crate) fn mkfs(
    image: BuiltinImage,
    root: &Path,
    out: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<(), BuildError> {
    let mut cmd = Command::new("mkfs.erofs");
    cmd.args(reproducible_args(image))
        .arg(out)
        .arg(root)
        .env("SOURCE_DATE_EPOCH", SOURCE_DATE_EPOCH.to_string());
    progress(&format!("{image}: {}", crate::cmd::describe(&cmd)));
    // mkfs.erofs redraws a progress line per file on stdout: not forwarded.
    run(&mut cmd, &mut |_| {})?;
    Ok(())
}

/// A fixed, per-image file system UUID: the first 128 bits of
/// SHA-256("krunbox-rootfs:<name>"), marked as an RFC 9562 version-8 UUID.
pub(crate) fn fs_uuid(image: BuiltinImage) -> String {
    let digest = Sha256::digest(format!("krunbox-rootfs:{}", image.name()));
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest[..16]);
    b[6] = (b[6] & 0x0f) | 0x80; // version 8
    b[8] = (b[8] & 0x3f) | 0x80; // RFC variant
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_fixed_distinct_and_well_formed() {
        let a = fs_uuid(BuiltinImage::Busybox);
        let b = fs_uuid(BuiltinImage::Agent);
        assert_eq!(a, fs_uuid(BuiltinImage::Busybox));
        assert_ne!(a, b);
        for u in [&a, &b] {
            let parts: Vec<_> = u.split('-').map(str::len).collect();
            assert_eq!(parts, [8, 4, 4, 4, 12], "{u}");
            assert_eq!(&u[14..15], "8", "{u}");
        }
    }

    #[test]
    fn args_pin_time_uuid_and_owner() {
        let args = reproducible_args(BuiltinImage::Busybox).join(" ");
        assert!(args.contains("-T1704067200"), "{args}");
        assert!(args.contains("--all-root"), "{args}");
        assert!(args.contains(&format!("-U{}", fs_uuid(BuiltinImage::Busybox))));
    }
}
