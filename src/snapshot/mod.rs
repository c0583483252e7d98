//! Snapshots of a running instance: its guest memory, the KVM state of its VM and vCPUs, and
//! its devices' transports, written to a directory while the instance is stilled for a moment;
//! restored by `Sandbox::restore` and, without a directory, by `Instance::fork`
//! (docs/architecture.md, "Snapshots, restore and fork").
//!
//! A snapshot's directory holds `memory.img` (guest memory: its data at the same offsets,
//! holes kept), `machine.json` (what the helper saved), `layer.img` (an ephemeral root's layer
//! disk, if any) and `manifest.json`: what the snapshot is (sizes, versions, the token its
//! guest rejoins with, what its network expects of a host: the sandbox CA, the secrets'
//! placeholders), each part's extents and digest, authenticated with a key of this user's
//! ([`key`]). The directory is 0700 and every file 0600. [`Snapshot::open`] refuses a snapshot
//! whose manifest or any part changed, before anything of it is used.

pub(crate) mod copy;
mod key;
pub(crate) mod memory;
pub(crate) mod part;

/// Where the seals of snapshot parts' digests are kept, for snapshots whose key is in
/// `key_dir`: beside the key, as trusted as it.
pub(crate) fn seals_dir(key_dir: &Path) -> PathBuf {
    crate::rootfs::seal::seals_dir(key_dir)
}

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
pub(crate) use key::SnapshotKey;
pub(crate) use part::Part;

/// The format this build writes and reads.
pub(crate) const FORMAT: &str = "krunbox-snapshot-2";

/// The largest manifest read (a fragmented guest memory lists many extents).
const MAX_MANIFEST_BYTES: u64 = 16 << 20;

pub(crate) const MANIFEST: &str = "manifest.json";
pub(crate) const MEMORY: &str = "memory.img";
pub(crate) const MACHINE: &str = "machine.json";
pub(crate) const LAYER: &str = "layer.img";

/// What a snapshot is, as its manifest says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Manifest {
    pub format: String,
    /// The krunbox that wrote it.
    pub krunbox: String,
    /// The control protocol its guest-init speaks.
    pub protocol: u32,
    pub cpus: u8,
    pub memory_mib: u32,
    /// The root image's SHA-256: a restore needs the very image (its pages may be cached in
    /// guest memory).
    pub image_sha256: String,
    /// The guest kernel's release, as its guest-init said at boot.
    pub kernel_release: String,
    /// guest-init's SHA-256: a restored guest's guest-init is served again from the
    /// restoring VMM (its pages fault in from there), so it must be the same binary.
    pub guest_init_sha256: String,
    /// The quiesce token the snapshotted guest rejoins its new host with.
    pub token: u64,
    /// The next process id the instance would have given.
    pub next_process_id: u32,
    /// The processes the instance tracked, which the restored instance takes over.
    pub processes: Vec<crate::control::SavedProcess>,
    pub memory: Part,
    pub machine: Part,
    /// An ephemeral root's layer disk (`layer.img`), when the instance had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<Part>,
    /// What the guest's network expects of its host, when it had a network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkState>,
}

/// What a guest with a network expects of its host that a fresh network service would not
/// give it: the sandbox CA it trusts (the key too: the manifest is in a directory only its
/// owner reads, as guest memory is) and the placeholders its environment holds for secrets.
/// A restore's or fork's service is made with these.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NetworkState {
    pub ca: Option<crate::net::SavedCa>,
    /// Each secret's environment variable and the placeholder the guest holds for it.
    pub placeholders: Vec<(String, String)>,
}

/// The manifest with its authentication, as `manifest.json` holds it.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Signed {
    manifest: Manifest,
    /// HMAC-SHA256 of the manifest's JSON, with the user's snapshot key.
    hmac: String,
}

/// A snapshot on disk, checked.
///
/// ```no_run
/// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
/// let snapshot = vm.snapshot("/var/tmp/warm-python").await?;
/// println!("{} ({})", snapshot.dir().display(), snapshot.digest());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Snapshot {
    dir: PathBuf,
    manifest: Arc<Manifest>,
    digest: String,
    /// Where the seals of its parts' digests are kept: beside the key (see [`part`]).
    seals: PathBuf,
}

impl Snapshot {
    /// The snapshot's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// SHA-256 of its manifest (hex), which names every part's digest: pin it to accept this
    /// snapshot and no other.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// Opens the snapshot in `dir`: reads its manifest and checks its authentication with the
    /// key in `key_dir` (the sandbox's [`snapshot_key_dir`]
    /// (crate::SandboxBuilder::snapshot_key_dir)) and its format. The parts are checked by
    /// a restore before its VM runs (a part whose file is unchanged since its digest was
    /// sealed is not read again, see [`part`]), or now, every byte, with
    /// [`verify`](Self::verify). A changed manifest is [`Error::SnapshotTampered`].
    pub fn open(dir: impl AsRef<Path>, key_dir: impl AsRef<Path>) -> Result<Snapshot> {
        let dir = dir.as_ref().to_path_buf();
        let key = SnapshotKey::load_or_create(key_dir.as_ref())
            .map_err(Error::io("reading the snapshot key"))?;
        let (manifest, digest) = read_manifest(&dir, &key)?;
        Ok(Snapshot {
            dir,
            manifest: Arc::new(manifest),
            digest,
            seals: seals_dir(key_dir.as_ref()),
        })
    }

    /// Reads every part and checks its digest: [`Error::SnapshotTampered`] names the first
    /// that changed.
    pub fn verify(&self) -> Result<()> {
        let layer = self.manifest.layer.as_ref();
        for part in [&self.manifest.memory, &self.manifest.machine]
            .into_iter()
            .chain(layer)
        {
            part::read(&self.dir, part, None, None).map_err(part_error)?;
        }
        Ok(())
    }

    /// Writes `manifest` (signed with `key`) into `dir`, which holds its parts; returns the
    /// snapshot's digest.
    pub(crate) fn sign(dir: &Path, manifest: Manifest, key: &SnapshotKey) -> Result<String> {
        let body = serde_json::to_vec(&manifest).expect("a manifest always serializes");
        let signed = Signed {
            hmac: key.sign(&body),
            manifest,
        };
        let bytes = serde_json::to_vec(&signed).expect("a manifest always serializes");
        let path = dir.join(MANIFEST);
        // 0600, as the parts: it may hold the sandbox CA's key.
        std::os::unix::fs::OpenOptionsExt::mode(
            std::fs::File::options().write(true).create_new(true),
            0o600,
        )
        .open(&path)
        .and_then(|mut file| {
            std::io::Write::write_all(&mut file, &bytes)?;
            file.sync_all()
        })
        .map_err(Error::io(format!("writing {}", path.display())))?;
        Ok(hex::encode(Sha256::digest(&bytes)))
    }
}

fn read_manifest(dir: &Path, key: &SnapshotKey) -> Result<(Manifest, String)> {
    use std::io::Read;
    let path = dir.join(MANIFEST);
    let mut bytes = Vec::new();
    std::fs::File::open(&path)
        .and_then(|file| file.take(MAX_MANIFEST_BYTES + 1).read_to_end(&mut bytes))
        .map_err(Error::io(format!("reading {}", path.display())))?;
    let tampered = |why: &str| Error::SnapshotTampered {
        part: MANIFEST.into(),
        why: why.into(),
    };
    if bytes.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(tampered("it is longer than any manifest"));
    }
    let signed: Signed =
        serde_json::from_slice(&bytes).map_err(|_| tampered("it is not a snapshot manifest"))?;
    let body = serde_json::to_vec(&signed.manifest).expect("a manifest always serializes");
    if !key.verify(&body, &signed.hmac) {
        return Err(tampered(
            "its authentication fails: it changed, or another user's key made it",
        ));
    }
    let manifest = signed.manifest;
    if manifest.format != FORMAT || manifest.protocol != crate::protocol::PROTOCOL_VERSION {
        return Err(Error::Snapshot {
            step: "opened",
            reason: format!(
                "it is a {} snapshot of protocol {}; this krunbox reads {FORMAT} of protocol {}",
                manifest.format,
                manifest.protocol,
                crate::protocol::PROTOCOL_VERSION
            ),
        });
    }
    Ok((manifest, hex::encode(Sha256::digest(&bytes))))
}

pub(crate) fn part_error(e: part::PartError) -> Error {
    match e {
        part::PartError::Tampered { name, why } => Error::SnapshotTampered { part: name, why },
        part::PartError::Io { name, source } => Error::Io {
            context: format!("reading the snapshot's {name}"),
            source,
        },
    }
}

/// What a restore starts from: a snapshot's manifest, and where its memory and machine state
/// are.
pub(crate) struct Restore {
    pub manifest: Manifest,
    pub from: RestoreFrom,
}

pub(crate) enum RestoreFrom {
    /// A snapshot's directory: its memory is checked whole and mapped, its machine state
    /// checked as it is copied (either not read again when sealed unchanged).
    Dir {
        dir: PathBuf,
        /// Where its parts' seals are (see [`part`]).
        seals: PathBuf,
    },
    /// A fork: the file of its source's memory that the fork maps copy-on-write (frozen
    /// before the fork's guest runs: in place while the source is stilled, as the fork's
    /// helper builds its VM, or long before); `filled` says with which machine state,
    /// processes and pages of the source's own once the source is stilled, or why it never
    /// will be.
    Fork {
        memory: Arc<std::fs::File>,
        /// The fork's own private-pages file: its source's own pages once filled (empty when
        /// the source's memory was mapped shared), laid over `memory` at the gate.
        pages: Arc<std::fs::File>,
        /// The fork's own ephemeral layer (empty; its source copies its layer into it while
        /// stilled), when the source has one.
        layer: Option<Arc<std::fs::File>>,
        filled: ForkFilled,
    },
}

/// What a fork's source says once it is stilled: `None` until then.
pub(crate) type ForkFilled = tokio::sync::watch::Receiver<Option<Result<Arc<ForkState>, String>>>;

/// A fork's machine state and what its guest runs, as its source was stilled.
pub(crate) struct ForkState {
    pub state: Vec<u8>,
    pub processes: Vec<crate::control::SavedProcess>,
    pub next_process_id: u32,
}

impl Restore {
    /// A restore of `snapshot`.
    pub(crate) fn of(snapshot: &Snapshot) -> Restore {
        Restore {
            manifest: (*snapshot.manifest).clone(),
            from: RestoreFrom::Dir {
                dir: snapshot.dir.clone(),
                seals: snapshot.seals.clone(),
            },
        }
    }

    /// A fork's state, once its source is stilled.
    pub(crate) async fn fork_state(filled: &ForkFilled) -> Result<Arc<ForkState>> {
        let abandoned = || Error::Snapshot {
            step: "stilled",
            reason: "the fork's source gave up before it was stilled".into(),
        };
        let mut filled = filled.clone();
        let outcome = filled
            .wait_for(Option::is_some)
            .await
            .map_err(|_| abandoned())?
            .clone();
        outcome
            .ok_or_else(abandoned)?
            .map_err(|reason| Error::Snapshot {
                step: "stilled",
                reason,
            })
    }

    /// The id the restored instance's next process gets, and the processes it adopts (a
    /// fork's: known once filled, which a guest that rejoined was).
    pub(crate) fn adoption(&self) -> (u32, Vec<crate::control::SavedProcess>) {
        if let RestoreFrom::Fork { filled, .. } = &self.from {
            if let Some(Ok(fork)) = &*filled.borrow() {
                return (fork.next_process_id, fork.processes.clone());
            }
        }
        (
            self.manifest.next_process_id,
            self.manifest.processes.clone(),
        )
    }
}

/// What an instance booted with snapshots on keeps to take them.
pub(crate) struct SnapshotSource {
    pub memory: Arc<memory::InstanceMemory>,
    /// What its guest's network expects of a host (its snapshots and forks carry it).
    pub network: Option<NetworkState>,
    pub cpus: u8,
    pub memory_mib: u32,
    pub image_sha256: String,
    pub key_dir: PathBuf,
    /// Why this instance cannot be snapshotted (yet), if it cannot.
    pub unsupported: Option<String>,
    /// The definition the instance was booted from, which its forks are restored as. (Only
    /// cloned, never left half-changed by a panic: unwind-safe as the rest of the instance.)
    pub definition: std::panic::AssertUnwindSafe<Arc<crate::config::SandboxConfig>>,
}

/// Writes a snapshot's parts into a fresh directory beside `dir` that becomes `dir` once
/// whole (a half-written snapshot never sits at `dir`).
pub(crate) struct Staging {
    pub tmp: tempfile::TempDir,
    pub dir: PathBuf,
}

impl Staging {
    pub(crate) fn new(dir: &Path) -> Result<Staging> {
        if dir.exists() {
            return Err(Error::InvalidConfig(format!(
                "{} exists: a snapshot goes into a new directory",
                dir.display()
            )));
        }
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        // 0700: it holds guest memory, whatever secrets the guest held.
        let tmp = tempfile::Builder::new()
            .prefix(".krunbox-snapshot-")
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .tempdir_in(&parent)
            .map_err(Error::io(format!(
                "making a directory in {}",
                parent.display()
            )))?;
        Ok(Staging {
            tmp,
            dir: dir.to_path_buf(),
        })
    }

    pub(crate) fn path(&self) -> &Path {
        self.tmp.path()
    }

    /// Moves the whole snapshot to its place.
    pub(crate) fn finish(self) -> Result<PathBuf> {
        let tmp = self.tmp.keep();
        std::fs::rename(&tmp, &self.dir).map_err(|e| {
            let _ = std::fs::remove_dir_all(&tmp);
            Error::io(format!("moving the snapshot to {}", self.dir.display()))(e)
        })?;
        Ok(self.dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(key_dir: &Path, into: &Path) -> Snapshot {
        let staging = Staging::new(into).unwrap();
        let memory = tempfile::tempfile().unwrap();
        memory.set_len(8 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&memory, b"guest", 4096).unwrap();
        let machine = tempfile::tempfile().unwrap();
        std::os::unix::fs::FileExt::write_all_at(&machine, b"{\"vm\":1}", 0).unwrap();
        let manifest = Manifest {
            format: FORMAT.into(),
            krunbox: env!("CARGO_PKG_VERSION").into(),
            protocol: crate::protocol::PROTOCOL_VERSION,
            cpus: 1,
            memory_mib: 8,
            image_sha256: "00".repeat(32),
            kernel_release: "6.12".into(),
            guest_init_sha256: "11".repeat(32),
            token: 7,
            next_process_id: 3,
            processes: Vec::new(),
            memory: part::write(&memory, staging.path(), MEMORY).unwrap().0,
            machine: part::write(&machine, staging.path(), MACHINE).unwrap().0,
            layer: None,
            network: None,
        };
        let key = SnapshotKey::load_or_create(key_dir).unwrap();
        Snapshot::sign(staging.path(), manifest, &key).unwrap();
        staging.finish().unwrap();
        Snapshot::open(into, key_dir).unwrap()
    }

    #[test]
    fn a_snapshot_opens_as_written_and_refuses_any_change_to_its_manifest_or_parts() {
        let keys = tempfile::tempdir().unwrap();
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("snap");
        let snapshot = written(keys.path(), &dir);
        assert_eq!(snapshot.manifest.token, 7);
        assert_eq!(snapshot.digest().len(), 64);

        // A byte of memory.
        let memory = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(MEMORY))
            .unwrap();
        std::os::unix::fs::FileExt::write_all_at(&memory, b"G", 4096).unwrap();
        let err = Snapshot::open(&dir, keys.path())
            .unwrap()
            .verify()
            .unwrap_err();
        assert!(
            matches!(&err, Error::SnapshotTampered { part, .. } if part == MEMORY),
            "{err}"
        );
        std::os::unix::fs::FileExt::write_all_at(&memory, b"g", 4096).unwrap();
        Snapshot::open(&dir, keys.path()).unwrap().verify().unwrap();

        // The manifest, even where it stays valid JSON: the token a guest rejoins with.
        let manifest = std::fs::read_to_string(dir.join(MANIFEST)).unwrap();
        std::fs::write(
            dir.join(MANIFEST),
            manifest.replace("\"token\":7", "\"token\":8"),
        )
        .unwrap();
        let err = Snapshot::open(&dir, keys.path()).unwrap_err();
        assert!(
            matches!(&err, Error::SnapshotTampered { part, .. } if part == MANIFEST),
            "{err}"
        );
        std::fs::write(dir.join(MANIFEST), &manifest).unwrap();

        // Another user's key.
        let stranger = tempfile::tempdir().unwrap();
        assert!(matches!(
            Snapshot::open(&dir, stranger.path()),
            Err(Error::SnapshotTampered { .. })
        ));
        Snapshot::open(&dir, keys.path()).unwrap();
    }
}
