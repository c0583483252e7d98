//! Root filesystems: which image a sandbox boots, proving it is the image expected, and the
//! writable layer a writable root keeps its changes on (`layer.rs`, `persistent.rs`, `cow.rs`
//! over a [`BlockStore`] of `store/`).
//!
//! Every root image is identified by its SHA-256. Before each boot the image file is opened and
//! its digest compared with the expected one; the *same open file descriptor* is then handed
//! to the VMM, so a path swapped after the check cannot substitute another file. A mismatch
//! refuses the boot ([`Error::ImageDigestMismatch`]). The digest is computed once per state of
//! the file and sealed to it (`seal.rs`), so a boot's work does not grow with the image.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
pub use krunbox_rootfs::BuiltinImage;

mod block_cache;
pub(crate) mod cow;
pub(crate) mod disk;
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) mod fuzz;
mod image_config;
pub(crate) mod layer;
pub(crate) mod persistent;
pub(crate) mod seal;
pub(crate) mod served;
pub(crate) mod store;

pub(crate) use cow::CowLayer;
pub use image_config::ImageConfig;
pub use layer::RootUsage;
pub(crate) use layer::{mke2fs, MemoryLayer, LAYER_FSTYPE};
pub(crate) use persistent::{PersistentLayer, PERSISTENT_LAYER_FILE_BYTES};
pub use store::{
    async_trait, BlockStore, DirectoryStore, MemoryStore, StoreContext, StoreError, MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
};

/// A writable root's layer, as an instance holds it.
#[derive(Debug)]
pub(crate) enum Layer {
    /// [`Rootfs::Ephemeral`]'s.
    Memory(MemoryLayer),
    /// [`Rootfs::Persistent`]'s.
    Persistent(PersistentLayer),
    /// [`Rootfs::Cow`]'s: served by the library, no disk of the VMM's.
    Cow(std::sync::Arc<CowLayer>),
}

impl Layer {
    /// The layer disk's descriptor, handed to the VMM helper (none for a served layer).
    pub(crate) fn file(&self) -> Option<&File> {
        match self {
            Layer::Memory(layer) => Some(layer.file()),
            Layer::Persistent(layer) => Some(layer.file()),
            Layer::Cow(_) => None,
        }
    }

    /// What it holds on the host now, against the most it can.
    pub(crate) fn usage(&self) -> RootUsage {
        match self {
            Layer::Memory(layer) => layer.usage(),
            Layer::Persistent(layer) => layer.usage(),
            Layer::Cow(layer) => layer.usage(),
        }
    }
}

/// A [`BlockStore`] as a root definition holds it: clones share the store, and the mark that
/// one running sandbox has it attached (a second boot while one runs is refused with
/// [`StoreError::InUse`]). Two handles are equal when they share the store.
///
/// ```
/// use krunbox::rootfs::{MemoryStore, StoreHandle};
///
/// let handle = StoreHandle::new(MemoryStore::new());
/// assert_eq!(handle.clone(), handle);
/// assert_ne!(StoreHandle::new(MemoryStore::new()), handle);
/// ```
#[derive(Clone)]
pub struct StoreHandle {
    store: std::sync::Arc<dyn BlockStore>,
    attached: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl StoreHandle {
    /// Wraps a store.
    pub fn new(store: impl BlockStore) -> Self {
        StoreHandle {
            store: std::sync::Arc::new(store),
            attached: Default::default(),
        }
    }

    /// The store.
    pub fn store(&self) -> &dyn BlockStore {
        &*self.store
    }
}

impl<S: BlockStore> From<S> for StoreHandle {
    fn from(store: S) -> Self {
        StoreHandle::new(store)
    }
}

impl std::fmt::Debug for StoreHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreHandle")
            .field("block_size", &self.store.block_size())
            .finish_non_exhaustive()
    }
}

impl PartialEq for StoreHandle {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.attached, &other.attached)
    }
}

impl Eq for StoreHandle {}

/// The root filesystem of a sandbox.
///
/// An image ([`Rootfs::builtin`], [`Rootfs::image`]) is read-only: writes to it fail with
/// `EROFS`, and the guest gets tmpfs scratch space on `/tmp`, `/run`, `/var/tmp`, `/root` and
/// `/home`. [`Rootfs::ephemeral`] makes an image writable for one boot: every change lives in
/// host memory, bounded, and is gone when the instance stops.
///
/// ```
/// use krunbox::{BuiltinImage, Rootfs};
///
/// let tiny = Rootfs::builtin(BuiltinImage::Busybox);
/// let mine = Rootfs::image("/srv/images/tools.erofs", "erofs",
///     "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08");
/// // `apt-get install` works here; at most 512 MiB of changes, forgotten at shutdown.
/// let scratch = Rootfs::ephemeral(Rootfs::builtin(BuiltinImage::Agent), 512 << 20);
/// # let _ = (tiny, mine, scratch);
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
    /// `base`, writable for one boot. The image itself is never written: the guest's root is
    /// an overlay whose upper layer is an ext4 filesystem of exactly `max_dirty_bytes` in host
    /// memory (a sealed memfd, on a host disk only in a snapshot the caller takes). A guest
    /// that fills it gets `ENOSPC`;
    /// host memory held never passes the quota; everything written is gone when the instance
    /// stops, and each boot starts from `base` again. Only `/tmp` and `/run` are tmpfs.
    Ephemeral {
        /// The image underneath: [`Rootfs::Builtin`] or [`Rootfs::Image`].
        base: Box<Rootfs>,
        /// The quota of the guest's changes (file data and filesystem metadata together),
        /// between [`Rootfs::MIN_DIRTY_BYTES`] and [`Rootfs::MAX_DIRTY_BYTES`].
        max_dirty_bytes: u64,
    },
    /// `base`, writable, its changes kept between boots in a qcow2 file at `path`: made on
    /// first use (a disk of [`Rootfs::PERSISTENT_LAYER_BYTES`] that takes host disk only for what is
    /// written), recording `base`'s digest, so that a boot over another base fails closed
    /// ([`Error::RootBaseMismatch`]). One running sandbox at
    /// a time: a second boot while one runs gets
    /// [`Error::RootInUse`]. The image itself is never written.
    ///
    /// What is durable: what the guest wrote before a clean shutdown (guest-init syncs
    /// first), and what it `fsync`ed (the guest's flush reaches the file, which libkrun
    /// syncs). A VM killed mid-write leaves a file that still opens, with the guest's
    /// ext4 journal to replay.
    Persistent {
        /// The image underneath: [`Rootfs::Builtin`] or [`Rootfs::Image`].
        base: Box<Rootfs>,
        /// The layer's qcow2 file.
        path: PathBuf,
    },
    /// `base`, writable, its changes kept block by block in a [`BlockStore`] the program
    /// supplies (a layer disk of [`Rootfs::COW_LAYER_BYTES`], made in the store on first use
    /// and bound to `base`'s digest: another base fails closed). The guest's writes collect in
    /// at most `max_dirty_bytes` of host memory (with copies of recently used blocks, at most
    /// half of it, which give way to them), and reach the store:
    ///
    /// * when that much is dirty (stored, not yet flushed);
    /// * when the guest syncs (`fsync`, `fdatasync`, `sync`, and its ext4 journal's commits,
    ///   every 5 seconds while it writes): everything dirty is stored, then
    ///   [`BlockStore::flush`]ed, and only then does the guest's call return;
    /// * when the VM stops, however it stops (shut down, crashed, its VMM killed): stored and
    ///   flushed before [`Instance::shutdown`](crate::Instance::shutdown) returns.
    ///
    /// So what the guest synced is durable in the store when its sync returns, and everything
    /// it wrote is once the instance has stopped; if this process dies, the store holds at
    /// least what was synced, and the guest's journal makes it consistent. A store failure is
    /// `EIO` in the guest and [`Error::BlockStore`] from
    /// `shutdown`; the blocks it could not take are never silently dropped. One running
    /// sandbox per store.
    ///
    /// A store whose blocks are one local file ([`BlockStore::blocks_file`], as in a
    /// [`DirectoryStore`]) is served from that file in place,
    /// at a raw disk's speed: each write the guest's disk completes is in the file at once
    /// (it survives the VMM or this process dying), a guest sync `fdatasync`s it before it
    /// returns, and no dirty data is held in this process (`max_dirty_bytes` bounds nothing).
    Cow {
        /// The image underneath: [`Rootfs::Builtin`] or [`Rootfs::Image`].
        base: Box<Rootfs>,
        /// Where the layer's blocks live.
        store: StoreHandle,
        /// The most bytes held in host memory (written and not stored yet, and copies of
        /// stored blocks), between [`Rootfs::MIN_DIRTY_BYTES`] and [`Rootfs::MAX_DIRTY_BYTES`].
        max_dirty_bytes: u64,
    },
}

impl Rootfs {
    /// The smallest quota of a writable root (16 MiB).
    pub const MIN_DIRTY_BYTES: u64 = layer::MIN_LAYER_BYTES;

    /// The largest quota of a writable root (1 TiB).
    pub const MAX_DIRTY_BYTES: u64 = layer::MAX_LAYER_BYTES;

    /// The size of a persistent root's layer disk (32 GiB): what its changes can grow to. Its
    /// file takes host disk only for what is written.
    pub const PERSISTENT_LAYER_BYTES: u64 = persistent::PERSISTENT_LAYER_BYTES;

    /// The size of a copy-on-write root's layer disk (32 GiB): what its changes can grow to.
    /// Its store holds only the blocks written.
    pub const COW_LAYER_BYTES: u64 = cow::COW_LAYER_BYTES;

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

    /// `base` made writable for one boot, its changes held in at most `max_dirty_bytes` of
    /// host memory (see [`Rootfs::Ephemeral`]). Checked when the sandbox is built: `base` must
    /// be an image, and the quota within [`Rootfs::MIN_DIRTY_BYTES`]..=[`Rootfs::MAX_DIRTY_BYTES`].
    ///
    /// ```no_run
    /// # async fn demo() -> krunbox::Result<()> {
    /// use krunbox::{BuiltinImage, Rootfs, Sandbox};
    ///
    /// let sandbox = Sandbox::builder()
    ///     .rootfs(Rootfs::ephemeral(Rootfs::builtin(BuiltinImage::Busybox), 64 << 20))
    ///     .build()?;
    /// let vm = sandbox.boot().await?;
    /// vm.command("sh").args(["-c", "echo hi > /etc/motd"]).status().await?;
    /// let usage = vm.root_usage().expect("a writable root");
    /// assert!(usage.held_bytes <= usage.max_bytes);
    /// vm.shutdown().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn ephemeral(base: Rootfs, max_dirty_bytes: u64) -> Rootfs {
        Rootfs::Ephemeral {
            base: Box::new(base),
            max_dirty_bytes,
        }
    }

    /// `base` made writable with its changes kept in the qcow2 file at `path` between boots
    /// (see [`Rootfs::Persistent`]).
    ///
    /// ```no_run
    /// # async fn demo() -> krunbox::Result<()> {
    /// use krunbox::{BuiltinImage, Rootfs, Sandbox};
    ///
    /// let base = Rootfs::builtin(BuiltinImage::Agent);
    /// let sandbox = Sandbox::builder()
    ///     .rootfs(Rootfs::persistent(base, "/var/lib/myagent/root.qcow2"))
    ///     .build()?;
    /// let vm = sandbox.boot().await?;
    /// vm.command("pip").args(["install", "--user", "requests"]).status().await?;
    /// vm.shutdown().await?; // the next boot of `sandbox` has it installed
    /// # Ok(())
    /// # }
    /// ```
    pub fn persistent(base: Rootfs, path: impl Into<PathBuf>) -> Rootfs {
        Rootfs::Persistent {
            base: Box::new(base),
            path: path.into(),
        }
    }

    /// `base` made writable with its changes kept in `store` between boots, at most
    /// `max_dirty_bytes` of them in host memory at a time (see [`Rootfs::Cow`] for when they
    /// reach the store).
    ///
    /// The value only describes the base and its store (the design's `compose`): nothing is
    /// attached until a boot, and the same description is what
    /// [`image::flatten_into_store`](crate::image::flatten_into_store) and its siblings merge
    /// into a standalone image.
    ///
    /// ```no_run
    /// # async fn demo() -> krunbox::Result<()> {
    /// use krunbox::rootfs::DirectoryStore;
    /// use krunbox::{BuiltinImage, Rootfs, Sandbox};
    ///
    /// let store = DirectoryStore::open("/var/lib/myagent/root")?;
    /// let base = Rootfs::builtin(BuiltinImage::Agent);
    /// let sandbox = Sandbox::builder()
    ///     .rootfs(Rootfs::cow(base, store, 64 << 20))
    ///     .build()?;
    /// let vm = sandbox.boot().await?;
    /// vm.command("sh").args(["-c", "echo kept > /etc/motd"]).status().await?;
    /// vm.shutdown().await?; // everything is in the store now
    /// # Ok(())
    /// # }
    /// ```
    #[doc(alias = "compose")]
    pub fn cow(base: Rootfs, store: impl Into<StoreHandle>, max_dirty_bytes: u64) -> Rootfs {
        Rootfs::Cow {
            base: Box::new(base),
            store: store.into(),
            max_dirty_bytes,
        }
    }

    /// The quota of an ephemeral root's layer.
    pub(crate) fn layer_quota(&self) -> Option<u64> {
        match self {
            Rootfs::Ephemeral {
                max_dirty_bytes, ..
            } => Some(*max_dirty_bytes),
            _ => None,
        }
    }

    /// Whether the root is writable (has a layer).
    pub(crate) fn is_writable(&self) -> bool {
        matches!(
            self,
            Rootfs::Ephemeral { .. } | Rootfs::Persistent { .. } | Rootfs::Cow { .. }
        )
    }

    /// Checks the definition (digests are hex, a writable root is over an image and its quota
    /// within bounds) so that a bad one fails when the sandbox is built, not at each boot.
    pub(crate) fn check(&self) -> Result<()> {
        match self {
            Rootfs::Builtin(_) => Ok(()),
            Rootfs::Image { sha256, .. } => {
                if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(Error::InvalidConfig(format!(
                        "image sha256 must be 64 hex digits, got {sha256:?}"
                    )));
                }
                Ok(())
            }
            Rootfs::Ephemeral {
                base,
                max_dirty_bytes,
            } => {
                base.check_as_base()?;
                layer::check_quota(*max_dirty_bytes)
            }
            Rootfs::Persistent { base, path } => {
                base.check_as_base()?;
                if path.file_name().is_none() {
                    return Err(Error::InvalidConfig(format!(
                        "a persistent root's layer must be a file path, got {}",
                        path.display()
                    )));
                }
                Ok(())
            }
            Rootfs::Cow {
                base,
                store,
                max_dirty_bytes,
            } => {
                base.check_as_base()?;
                layer::check_quota(*max_dirty_bytes)?;
                store::check_block_size(store.store.block_size()).map_err(Error::InvalidConfig)
            }
        }
    }

    /// Checks a writable root's base: an image (not another writable root), itself valid.
    fn check_as_base(&self) -> Result<()> {
        if self.is_writable() {
            return Err(Error::InvalidConfig(
                "a writable root's base must be an image (Rootfs::builtin or Rootfs::image), \
                 not another writable root"
                    .into(),
            ));
        }
        self.check()
    }

    /// A copy-on-write root's store and its bound on dirty bytes.
    pub(crate) fn cow_store(&self) -> Option<(&StoreHandle, u64)> {
        match self {
            Rootfs::Cow {
                store,
                max_dirty_bytes,
                ..
            } => Some((store, *max_dirty_bytes)),
            _ => None,
        }
    }
}

impl StoreHandle {
    /// The store (guarded: a panic in it fails only its call) and the handle's claim on it,
    /// for a use other than a boot (an image written or read).
    pub(crate) fn take(
        &self,
    ) -> std::result::Result<(std::sync::Arc<dyn BlockStore>, store::Claim), StoreError> {
        let claim = store::Claim::take(self.attached.clone())?;
        Ok((
            std::sync::Arc::new(store::Guarded(self.store.clone())),
            claim,
        ))
    }

    /// Attaches the store for one boot over `base_sha256` (see [`CowLayer::attach`]).
    pub(crate) async fn attach(&self, base_sha256: &str, max_dirty_bytes: u64) -> Result<CowLayer> {
        CowLayer::attach(
            self.store.clone(),
            self.attached.clone(),
            base_sha256,
            max_dirty_bytes,
        )
        .await
    }
}

/// A root image that passed its digest check, held open.
#[derive(Debug)]
pub(crate) struct VerifiedImage {
    pub file: File,
    pub path: PathBuf,
    pub fstype: String,
    pub sha256: String,
    /// A qcow2 image (a flattened root) rather than a raw filesystem image.
    pub qcow2: bool,
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
        Rootfs::Ephemeral { base, .. }
        | Rootfs::Persistent { base, .. }
        | Rootfs::Cow { base, .. } => {
            if base.is_writable() {
                return Err(Error::InvalidConfig(
                    "a writable root's base must be an image".into(),
                ));
            }
            resolve(base, cache_dir, progress)
        }
    }
}

/// The SHA-256 (lowercase hex) of everything `reader` gives.
pub(crate) fn sha256_hex(mut reader: impl Read) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    std::io::copy(&mut reader, &mut hasher)?;
    Ok(hex::encode(hasher.finalize()))
}

/// The directory a file at `path` goes in (`.` for a bare file name).
pub(crate) fn dir_of(path: &Path) -> &Path {
    path.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Opens `path`, hashes the open file (unless this process or a seal in `seals` knows the
/// digest of the same unchanged inode: [`seal::digest_of`]), and fails closed on a mismatch.
pub(crate) fn verify(
    path: &Path,
    fstype: &str,
    expected: &str,
    seals: Option<&Path>,
) -> Result<VerifiedImage> {
    let mut file =
        File::open(path).map_err(Error::io(format!("opening root image {}", path.display())))?;
    let (actual, _) = seal::digest_of(&mut file, seals)
        .map_err(Error::io(format!("reading root image {}", path.display())))?;
    if !actual.eq_ignore_ascii_case(expected) {
        return Err(Error::ImageDigestMismatch {
            path: path.to_path_buf(),
            expected: expected.to_string(),
            actual,
        });
    }
    // A qcow2 (what `flatten` makes) boots as one, if it stands alone: a backing or data file
    // would be a second, unverified source of the root's bytes.
    let mut magic = [0u8; 4];
    let qcow2 = std::os::unix::fs::FileExt::read_exact_at(&file, &mut magic, 0).is_ok()
        && &magic == b"QFI\xfb";
    if qcow2 {
        persistent::check_standalone_qcow2(&file).map_err(|reason| {
            Error::InvalidConfig(format!(
                "the root image {} is a qcow2 krunbox cannot boot: {reason}",
                path.display()
            ))
        })?;
    }
    Ok(VerifiedImage {
        file,
        path: path.to_path_buf(),
        fstype: fstype.to_string(),
        sha256: actual,
        qcow2,
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
        let verified = verify(&path, "erofs", good, None).unwrap();
        assert_eq!(verified.sha256, good);

        std::fs::write(&path, b"abd").unwrap();
        match verify(&path, "erofs", good, None) {
            Err(Error::ImageDigestMismatch {
                expected, actual, ..
            }) => {
                assert_eq!(expected, good);
                assert_ne!(actual, good);
            }
            other => panic!("expected a digest mismatch, got {other:?}"),
        }
        assert!(matches!(
            verify(&dir.path().join("missing"), "erofs", good, None),
            Err(Error::Io { .. })
        ));
    }
}
