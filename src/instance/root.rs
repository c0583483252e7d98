//! The root's part of a boot: the image proved to be the one asked for, a writable root's
//! layer (fresh for each attempt, or opened once and handed to each), and what both ask of the
//! helper (its root disk, its layer disk) and of the guest (how to mount them).

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use tokio::sync::watch;

use super::VMM_EXIT_DEADLINE;
use crate::config::SandboxConfig;
use crate::error::{Error, Result};
use crate::protocol::{LayerDevice, RootMount, WritableLayer};
use crate::rootfs::{self, Rootfs};
use krunbox_protocol::vmm::{Inherited, LayerDisk};

/// A boot's root, from the verified image to the layer of the current attempt.
/// (Fields drop in order: the guard first, which gives the layer and the store back once the
/// VMM is gone, the image last.)
pub(super) struct RootPart {
    /// Gives the layer and the store back if the boot fails or is dropped.
    pub guard: LayerGuard,
    /// A copy-on-write root's attachment to its store.
    pub cow: Option<Arc<rootfs::CowLayer>>,
    /// A persistent root's layer between attempts (opened and locked once).
    persistent: Option<rootfs::PersistentLayer>,
    /// The image, verified against its digest, held open: the helper gets this very file.
    pub image: rootfs::VerifiedImage,
    /// How long making the current attempt's layer took (an ephemeral root's runs mke2fs):
    /// host work of the boot's, as preparing the parts is.
    pub layer_work: std::time::Duration,
}

impl RootPart {
    /// Resolves the image (building a built-in one on first use), verifies the open file, and
    /// opens a persistent layer or attaches a copy-on-write store, each checked to have been
    /// made over this very image.
    pub async fn prepare(config: &SandboxConfig) -> Result<RootPart> {
        let cache_dir = config.cache_dir.clone();
        let rootfs_def = config.rootfs.clone();
        let image = tokio::task::spawn_blocking(move || {
            let mut progress = |line: &str| tracing::info!(target: "krunbox::image", "{line}");
            let (path, fstype, sha256) = rootfs::resolve(&rootfs_def, &cache_dir, &mut progress)?;
            let seals = rootfs::seal::seals_dir(&cache_dir);
            rootfs::verify(&path, &fstype, &sha256, Some(&seals))
        })
        .await
        .map_err(|e| Error::io("verifying the root image")(std::io::Error::other(e)))??;
        tracing::debug!(image = %image.path.display(), sha256 = %image.sha256, "root image verified");

        let persistent = match &config.rootfs {
            Rootfs::Persistent { path, .. } => {
                Some(rootfs::PersistentLayer::open(path, &image.sha256).await?)
            }
            _ => None,
        };
        let cow = match config.rootfs.cow_store() {
            Some((store, max_dirty_bytes)) => Some(Arc::new(
                store.attach(&image.sha256, max_dirty_bytes).await?,
            )),
            None => None,
        };
        let guard = LayerGuard {
            cow: cow.clone(),
            layer: None,
            vmm_gone: None,
        };
        Ok(RootPart {
            guard,
            cow,
            persistent,
            image,
            layer_work: std::time::Duration::ZERO,
        })
    }

    /// The helper's writable layer disk: an ephemeral root's in memory, a persistent root's
    /// qcow2 file. (A copy-on-write root's is a served disk: [`Self::served_disk`].)
    pub fn layer_disk(config: &SandboxConfig) -> Option<LayerDisk> {
        match &config.rootfs {
            Rootfs::Ephemeral {
                max_dirty_bytes, ..
            } => Some(LayerDisk {
                max_file_bytes: *max_dirty_bytes,
                qcow2: false,
            }),
            Rootfs::Persistent { .. } => Some(LayerDisk {
                max_file_bytes: rootfs::PERSISTENT_LAYER_FILE_BYTES,
                qcow2: true,
            }),
            _ => None,
        }
    }

    /// A copy-on-write root's layer disk, served to the guest as a disk of ours.
    pub fn served_disk(&self) -> Option<rootfs::served::DiskSource> {
        self.cow.as_ref().map(|cow| cow.source())
    }

    /// How the guest mounts its root: the image read-only, and a writable layer over it.
    pub fn guest_mount(&self, config: &SandboxConfig) -> RootMount {
        RootMount {
            device: "/dev/vda".into(),
            fstype: self.image.fstype.clone(),
            read_only: true,
            writable_layer: config.rootfs.is_writable().then(|| WritableLayer {
                device: match &self.cow {
                    Some(_) => LayerDevice::HostBlock {
                        serial: krunbox_protocol::LAYER_DISK_SERIAL.into(),
                    },
                    None => LayerDevice::Disk("/dev/vdb".into()),
                },
                fstype: rootfs::LAYER_FSTYPE.into(),
            }),
        }
    }

    /// The layer for the next attempt. An ephemeral one is fresh for every attempt, so a
    /// retried boot starts from the image again (formatting it runs mke2fs, off the async
    /// threads); a restore's is empty (the snapshot's layer is copied in before its guest
    /// runs), a fork's the one its source fills; a persistent one is opened (and locked) once
    /// and handed to each attempt.
    pub async fn next_layer(
        &mut self,
        config: &SandboxConfig,
        restore: Option<&crate::snapshot::Restore>,
    ) -> Result<()> {
        use crate::snapshot::RestoreFrom;
        let making = std::time::Instant::now();
        self.guard.layer = match (config.rootfs.layer_quota(), &self.cow) {
            (Some(quota), _) => Some(rootfs::Layer::Memory(match restore.map(|r| &r.from) {
                None => tokio::task::spawn_blocking(move || rootfs::MemoryLayer::create(quota))
                    .await
                    .map_err(|e| Error::WritableLayer(e.to_string()))??,
                Some(RestoreFrom::Dir { .. }) => rootfs::MemoryLayer::empty(quota)?,
                Some(RestoreFrom::Fork {
                    layer: Some(file), ..
                }) => file
                    .try_clone()
                    .and_then(rootfs::MemoryLayer::of_file)
                    .map_err(|e| Error::WritableLayer(e.to_string()))?,
                Some(RestoreFrom::Fork { layer: None, .. }) => {
                    return Err(Error::Snapshot {
                        step: "restored",
                        reason: "a fork of an instance without a writable layer cannot have one"
                            .into(),
                    })
                }
            })),
            (None, Some(cow)) => Some(rootfs::Layer::Cow(cow.clone())),
            (None, None) => self.persistent.take().map(rootfs::Layer::Persistent),
        };
        self.layer_work = making.elapsed();
        Ok(())
    }

    /// An attempt was given up and its VMM is gone: a persistent layer waits for the next.
    pub fn attempt_abandoned(&mut self) {
        if let Some(rootfs::Layer::Persistent(layer)) = self.guard.layer.take() {
            self.persistent = Some(layer);
        }
    }

    /// The descriptors the root hands the helper: the image, and the attempt's layer file.
    pub fn hand_over(&self, handed: &mut Vec<(RawFd, Inherited)>) {
        handed.push((self.image.file.as_raw_fd(), Inherited::RootImage));
        if let Some(file) = self.guard.layer.as_ref().and_then(|layer| layer.file()) {
            handed.push((file.as_raw_fd(), Inherited::WritableLayer));
        }
    }
}

/// What a boot that fails or is dropped gives back: a copy-on-write root's store (what is
/// dirty stored, then detached) and the attempt's writable layer (a persistent layer's lock).
/// Both only once the helper and the VMM it started have exited (the end of the helper's log
/// pipe), at most [`VMM_EXIT_DEADLINE`] later: with a pid namespace the VMM dies by
/// `PDEATHSIG` after the helper, and a write of its must not land after the next holder took
/// the layer over.
pub(super) struct LayerGuard {
    pub cow: Option<Arc<rootfs::CowLayer>>,
    pub layer: Option<rootfs::Layer>,
    /// The current attempt's helper log: true once the helper and the VMM have exited.
    pub vmm_gone: Option<watch::Receiver<bool>>,
}

impl LayerGuard {
    /// The boot succeeded: the layer goes to the supervisor, which gives it and the store back
    /// when the VM stops.
    pub fn disarm(&mut self) -> Option<rootfs::Layer> {
        self.cow = None;
        self.vmm_gone = None;
        self.layer.take()
    }
}

impl Drop for LayerGuard {
    fn drop(&mut self) {
        let (cow, layer) = (self.cow.take(), self.layer.take());
        if cow.is_none() && layer.is_none() {
            return;
        }
        let gone = self.vmm_gone.take();
        let give_back = async move {
            if let Some(gone) = gone {
                vmm_gone(gone).await;
            }
            drop(layer);
            if let Some(cow) = cow {
                cow.finish().await;
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(give_back);
            }
            // A boot future dropped outside any runtime: nothing can wait; the layer goes now
            // and the store stays attached until the program ends (its lock with it).
            Err(_) => tracing::warn!(
                "a boot was dropped outside a tokio runtime; its layer is let go without waiting for the VMM"
            ),
        }
    }
}

/// Waits until the helper and the VMM have both exited (`gone`: the helper's log pipe ended),
/// at most [`VMM_EXIT_DEADLINE`], then warns.
pub(super) async fn vmm_gone(mut gone: watch::Receiver<bool>) {
    if tokio::time::timeout(VMM_EXIT_DEADLINE, gone.wait_for(|ended| *ended))
        .await
        .is_err()
    {
        tracing::warn!(
            "the VMM outlived its helper by {VMM_EXIT_DEADLINE:?}; letting its layer go"
        );
    }
}
