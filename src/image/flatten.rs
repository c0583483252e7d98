//! Flattening: a writable root's base and changes merged into one standalone image.
//!
//! The merge is done by the guest kernel, which already shows the merged tree as the root's
//! overlay: a VM boots the root with an output disk, an empty ext4 the host formats and serves
//! as a virtio-blk disk of ours (`served.rs`, `device/`), and copies its whole root into it
//! with `tar` (as root: owners,
//! modes, links and hard links kept; extended attributes where the image's tar can carry them).
//! Doing it in the guest means no host code reads the layer's filesystem or needs privileges to
//! make files of other owners. The host then writes the output disk's written extents into a
//! qcow2: a disk of its own that krunbox boots (`Rootfs::image`) and plain libkrun too.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::rootfs::layer::{format_ext4, Journal};
use crate::rootfs::persistent::qcow2_into_place;
use crate::rootfs::served::{DiskSource, OUTPUT_DISK_SERIAL};
use crate::rootfs::Rootfs;

/// The size of a flattened image's filesystem (32 GiB): what a root can hold to be flattened.
/// The qcow2 takes host disk only for what is written.
pub(crate) const FLAT_DISK_BYTES: u64 = 32 << 30;

/// Where the building VM mounts the output disk (in `/tmp`, which the copy leaves out).
pub(crate) const MOUNTED_AT: &str = "/tmp/.krunbox-flat";

/// How long the copy may take.
const COPY_DEADLINE: Duration = Duration::from_secs(3600);

/// A flattened image: an ext4 filesystem in a standalone qcow2 (no backing file), and its
/// SHA-256.
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::{BuiltinImage, Rootfs, Sandbox};
///
/// let root = Rootfs::persistent(Rootfs::builtin(BuiltinImage::Agent), "/var/lib/a/root.qcow2");
/// let flat = krunbox::image::flatten(&root, "/var/lib/a/flat.qcow2").await?;
/// // Boots on its own, read-only, with every change the persistent root had.
/// let vm = Sandbox::builder().rootfs(flat.rootfs()).build()?.boot().await?;
/// # let _ = vm; Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatImage {
    /// The qcow2 file.
    pub path: PathBuf,
    /// Its SHA-256, lowercase hex.
    pub sha256: String,
}

impl FlatImage {
    /// The image as a root for a sandbox (read-only; make it writable with
    /// [`Rootfs::ephemeral`] and friends, as any image).
    pub fn rootfs(&self) -> Rootfs {
        Rootfs::image(&self.path, "ext4", &self.sha256)
    }

    /// The image's bytes as a stream, to upload it somewhere.
    ///
    /// ```no_run
    /// # async fn demo(flat: krunbox::image::FlatImage) -> std::io::Result<()> {
    /// let mut bytes = flat.stream().await?;
    /// let mut copy = tokio::fs::File::create("/tmp/upload.qcow2").await?;
    /// tokio::io::copy(&mut bytes, &mut copy).await?;
    /// # Ok(()) }
    /// ```
    pub async fn stream(&self) -> std::io::Result<impl tokio::io::AsyncRead + Unpin> {
        tokio::fs::File::open(&self.path).await
    }
}

/// Merges `root` (a writable root: its base image and its changes) into one standalone
/// image at `output` (a qcow2, replaced if it exists): see [`FlatImage`]. Boots `root` once to
/// do it (so a persistent root or a store must not be in use). What is merged is the root's
/// whole tree but `/proc`, `/sys`, `/dev`, `/tmp` and `/run` (left as empty directories): owners,
/// modes, symbolic and hard links; extended attributes only where the image's `tar` carries
/// them (GNU tar does, busybox's does not).
pub async fn flatten(root: &Rootfs, output: impl AsRef<Path>) -> Result<FlatImage> {
    let output = output.as_ref();
    if !root.is_writable() {
        return Err(Error::InvalidConfig(
            "flatten merges a writable root's changes into its base: this root is an image \
             already (boot it as it is)"
                .into(),
        ));
    }
    let build = ImageBuild::start(output).await?;
    let sandbox = crate::Sandbox::builder()
        .rootfs(root.clone())
        .memory_mib(512)
        .output_disk(build.disk())
        .build()?;
    let vm = sandbox.boot().await?;
    let copied = vm
        .command("sh")
        .args(["-c", &copy_script()])
        .timeout(COPY_DEADLINE)
        .output()
        .await;
    let shutdown = vm.shutdown().await;
    let copied = copied?;
    if !copied.status.success() {
        return Err(Error::WritableLayer(format!(
            "flattening: copying the root in the guest failed ({}): {}{}",
            copied.status,
            copied.stdout_text(),
            copied.stderr_text()
        )));
    }
    shutdown?;
    build.finish().await
}

/// Like [`flatten`], with the image's bytes written to `dest` (an upload's body, a pipe, a file
/// of the caller's) rather than left at a path: a qcow2 is made with seeks, so it is made in a
/// temporary directory first (`TMPDIR`, else `/tmp`; gone after), which must have room for the
/// image twice while it is made. Returns its size and SHA-256, which
/// booting it from wherever it lands needs (`Rootfs::image(path, "ext4", sha256)`).
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::rootfs::MemoryStore;
/// use krunbox::{BuiltinImage, Rootfs};
///
/// let root = Rootfs::cow(Rootfs::builtin(BuiltinImage::Busybox), MemoryStore::new(), 32 << 20);
/// let mut upload = tokio::fs::File::create("/tmp/lane.qcow2").await.unwrap();
/// let written = krunbox::image::flatten_into(&root, &mut upload).await?;
/// println!("{} bytes, sha256 {}", written.len, written.sha256);
/// # Ok(()) }
/// ```
pub async fn flatten_into<W>(root: &Rootfs, dest: &mut W) -> Result<WrittenImage>
where
    W: tokio::io::AsyncWrite + Unpin + ?Sized,
{
    let scratch = scratch_dir()?;
    let flat = flatten(root, scratch.path().join("image.qcow2")).await?;
    write_to(&flat, dest).await
}

/// A directory to flatten into before the image goes where it is wanted (`TMPDIR`, else
/// `/tmp`; removed when dropped).
pub(super) fn scratch_dir() -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix("krunbox-flatten-")
        .tempdir()
        .map_err(|source| Error::Io {
            context: format!(
                "making a scratch directory in {}",
                std::env::temp_dir().display()
            ),
            source,
        })
}

/// Copies the image file `flat` into `dest` (see [`flatten_into`]).
pub(super) async fn write_to<W>(flat: &FlatImage, dest: &mut W) -> Result<WrittenImage>
where
    W: tokio::io::AsyncWrite + Unpin + ?Sized,
{
    let mut image = flat.stream().await.map_err(|source| Error::Io {
        context: format!("reading the image {}", flat.path.display()),
        source,
    })?;
    let len = tokio::io::copy(&mut image, dest)
        .await
        .map_err(|source| Error::Io {
            context: "writing the flattened image to its destination".into(),
            source,
        })?;
    tokio::io::AsyncWriteExt::flush(dest)
        .await
        .map_err(|source| Error::Io {
            context: "flushing the flattened image's destination".into(),
            source,
        })?;
    Ok(WrittenImage {
        len,
        sha256: flat.sha256.clone(),
    })
}

/// What [`flatten_into`] wrote: the image's size in bytes and its SHA-256 (lowercase hex).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenImage {
    /// Bytes written.
    pub len: u64,
    /// Their SHA-256, lowercase hex.
    pub sha256: String,
}

/// The bytes of the image file a root boots from, as a stream, to upload or copy it: a
/// built-in image (built first if the cache has none), an image file, a flattened image; for
/// a writable root, its base image (its changes are not in it: [`flatten_into`] merges them).
/// The bytes are the image container's (an erofs or ext4 filesystem, a qcow2), not the files
/// inside it.
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::{BuiltinImage, Rootfs};
/// let mut bytes = krunbox::image::bytes(&Rootfs::builtin(BuiltinImage::Busybox)).await?;
/// let mut copy = tokio::fs::File::create("/tmp/busybox.img").await.unwrap();
/// tokio::io::copy(&mut bytes, &mut copy).await.unwrap();
/// # Ok(()) }
/// ```
pub async fn bytes(root: &Rootfs) -> Result<tokio::fs::File> {
    let root = root.clone();
    let cache = crate::cache_dir();
    let (path, _, _) = tokio::task::spawn_blocking(move || {
        crate::rootfs::resolve(&root, &cache, &mut |_: &str| {})
    })
    .await
    .map_err(|e| Error::Io {
        context: "finding the image".into(),
        source: std::io::Error::other(e),
    })??;
    tokio::fs::File::open(&path)
        .await
        .map_err(|source| Error::Io {
            context: format!("opening the image {}", path.display()),
            source,
        })
}

/// An image being built: an empty ext4 (journal-less) in a sparse scratch file beside the
/// output, which a VM fills through [`ImageBuild::disk`] (the guest finds the disk by its
/// serial and mounts it, see [`mount_output`] and [`unmount_output`]); then
/// [`ImageBuild::finish`] writes its extents into a standalone qcow2 at the output path.
pub(crate) struct ImageBuild {
    output: PathBuf,
    scratch: tempfile::NamedTempFile,
    disk: DiskSource,
}

/// The guest's script to mount a build's output disk at [`MOUNTED_AT`] (`set -e` first).
pub(crate) fn mount_output() -> String {
    format!(
        r#"set -e
disk=
for d in /sys/block/*; do
  if [ "$(cat "$d/serial" 2>/dev/null)" = {OUTPUT_DISK_SERIAL} ]; then disk=/dev/${{d##*/}}; fi
done
[ -n "$disk" ] || {{ echo "no disk with the serial {OUTPUT_DISK_SERIAL} in /sys/block" >&2; exit 1; }}
mkdir -p {MOUNTED_AT}
mount -t ext4 "$disk" {MOUNTED_AT}
"#
    )
}

/// The guest's script to give the image the mount points guest-init needs, and unmount it.
pub(crate) fn unmount_output() -> String {
    format!(
        "for d in proc sys dev run; do mkdir -p {MOUNTED_AT}/$d; done
mkdir -p {MOUNTED_AT}/tmp && chmod 1777 {MOUNTED_AT}/tmp
umount {MOUNTED_AT}
sync
"
    )
}

impl ImageBuild {
    /// Formats the scratch disk for an image that will be at `output`.
    pub(crate) async fn start(output: &Path) -> Result<ImageBuild> {
        let dir = crate::rootfs::dir_of(output);
        if output.file_name().is_none() {
            return Err(Error::InvalidConfig(format!(
                "{} names no file",
                output.display()
            )));
        }
        let failed = failed_at(output);
        let scratch = tempfile::Builder::new()
            .prefix(".krunbox-image-")
            .tempfile_in(dir)
            .map_err(failed("making the scratch disk"))?;
        scratch
            .as_file()
            .set_len(FLAT_DISK_BYTES)
            .map_err(failed("sizing the scratch disk"))?;
        let scratch_path = scratch.path().to_path_buf();
        tokio::task::spawn_blocking(move || format_ext4(&scratch_path, Journal::Without))
            .await
            .map_err(|e| Error::WritableLayer(e.to_string()))??;
        // Served in place: the helper's device writes the guest's blocks straight into it.
        let disk = DiskSource::in_place(
            Arc::new(
                scratch
                    .as_file()
                    .try_clone()
                    .map_err(failed("opening the scratch disk"))?,
            ),
            FLAT_DISK_BYTES,
        )
        .map_err(failed("counting the scratch disk's failures"))?;
        Ok(ImageBuild {
            output: output.to_path_buf(),
            scratch,
            disk,
        })
    }

    /// The output disk, for the building VM ([`SandboxBuilder::output_disk`](crate::SandboxBuilder)).
    pub(crate) fn disk(&self) -> DiskSource {
        self.disk.clone()
    }

    /// Writes the filled disk's extents into a qcow2 at the output path (whole or absent:
    /// written beside it, then renamed) and hashes it.
    pub(crate) async fn finish(self) -> Result<FlatImage> {
        let output = self.output;
        let failed = failed_at(&output);
        // The guest's copy got EIO for these, and may not have said so.
        if let DiskSource::InPlace { failures, .. } = &self.disk {
            let count = failures.take();
            if count > 0 {
                return Err(failed("writing the scratch disk")(std::io::Error::other(format!(
                    "{count} of the VM's reads, writes or flushes of it failed (the VMM's log says why)"
                ))));
            }
        }
        let raw = self
            .scratch
            .as_file()
            .try_clone()
            .map_err(failed("opening the scratch disk"))?;
        qcow2_into_place(raw, &output)
            .await
            .map_err(failed("writing the qcow2"))?;
        let sha256 = tokio::task::spawn_blocking({
            let output = output.clone();
            move || File::open(&output).and_then(crate::rootfs::sha256_hex)
        })
        .await
        .map_err(|e| Error::WritableLayer(e.to_string()))?
        .map_err(failed("hashing the image"))?;
        Ok(FlatImage {
            path: output.clone(),
            sha256,
        })
    }
}

fn failed_at(output: &Path) -> impl Fn(&str) -> Box<dyn Fn(std::io::Error) -> Error> + '_ {
    move |what: &str| {
        let context = format!("making the image {}: {what}", output.display());
        Box::new(move |source| Error::Io {
            context: context.clone(),
            source,
        })
    }
}

/// The guest's part: mount the output disk, copy the root into it with the image's `tar`
/// (leaving out the kernel's and the scratch filesystems: named one by one, as busybox's tar
/// has no `--exclude`; as root, both tars keep owners and modes), make their mount points,
/// unmount.
fn copy_script() -> String {
    format!(
        r#"{mount}
cd /
xattrs=
if tar --help 2>&1 | grep -q -- --xattrs; then xattrs="--xattrs --xattrs-include=*"; fi
set --
for entry in .[!.]* ..?* *; do
  case $entry in
    proc|sys|dev|tmp|run) ;;
    *) if [ -e "$entry" ] || [ -L "$entry" ]; then set -- "$@" "$entry"; fi ;;
  esac
done
# No pipefail in every sh (dash has none): the reading tar's status is kept by hand, so a
# read error in the root (EIO from a failing store) fails the flatten, not only a write error.
{{ tar -c $xattrs -f - "$@"; echo $? > /tmp/.krunbox-read-status; }} | tar -x $xattrs -f - -C {MOUNTED_AT}
read -r status < /tmp/.krunbox-read-status
[ "$status" = 0 ] || {{ echo "reading the root failed (tar exit $status)" >&2; exit 1; }}
{unmount}"#,
        mount = mount_output(),
        unmount = unmount_output()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_image_is_written_whole_to_a_writer_with_its_size_and_digest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("image.qcow2");
        let bytes: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let flat = FlatImage {
            path,
            sha256: "recorded digest".into(),
        };
        let mut dest = Vec::new();
        let written = write_to(&flat, &mut dest).await.unwrap();
        assert_eq!(dest, bytes);
        assert_eq!(
            written,
            WrittenImage {
                len: bytes.len() as u64,
                sha256: "recorded digest".into()
            }
        );
    }
}
