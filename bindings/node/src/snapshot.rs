//! Snapshots for Node: `NativeSnapshot`, an instance's `snapshot`, `fork`, `processes` and
//! `attach`, and a definition's `restore` (in `sandbox.rs`).

use napi_derive::napi;

use crate::errors::OrNapi;
use crate::instance::NativeInstance;
use crate::process::NativeProcess;

/// A snapshot on disk, its manifest checked.
#[napi]
pub struct NativeSnapshot {
    pub(crate) inner: krunbox::Snapshot,
}

#[napi]
impl NativeSnapshot {
    /// Opens the snapshot in `dir`, checking its manifest with the key in `key_dir`.
    #[napi(factory)]
    pub fn open(dir: String, key_dir: String) -> napi::Result<Self> {
        krunbox::Snapshot::open(dir, key_dir)
            .map(|inner| NativeSnapshot { inner })
            .or_napi()
    }

    /// Its directory.
    #[napi(getter)]
    pub fn dir(&self) -> String {
        self.inner.dir().display().to_string()
    }

    /// SHA-256 of its manifest (hex).
    #[napi(getter)]
    pub fn digest(&self) -> String {
        self.inner.digest().to_owned()
    }

    /// Hashes every part (off the JavaScript thread); `SnapshotTampered` names one that
    /// changed.
    #[napi]
    pub async fn verify(&self) -> napi::Result<()> {
        let snapshot = self.inner.clone();
        tokio::task::spawn_blocking(move || snapshot.verify())
            .await
            .map_err(|e| napi::Error::from_reason(e.to_string()))?
            .or_napi()
    }
}

#[napi]
impl NativeInstance {
    /// Writes a snapshot of the instance into the new directory `dir`.
    #[napi]
    pub async fn snapshot(&self, dir: String) -> napi::Result<NativeSnapshot> {
        let inner = self.inner.snapshot(dir).await.or_napi()?;
        Ok(NativeSnapshot { inner })
    }

    /// Forks the instance into `n` new ones.
    #[napi]
    pub async fn fork(&self, n: u32) -> napi::Result<Vec<NativeInstance>> {
        let forks = self.inner.fork(n as usize).await.or_napi()?;
        Ok(forks.into_iter().map(NativeInstance::new).collect())
    }

    /// The guest pids of a restored instance's processes not attached yet.
    #[napi]
    pub fn processes(&self) -> Vec<u32> {
        self.inner.processes()
    }

    /// Takes over process `pid` of a restored instance.
    #[napi]
    pub fn attach(&self, pid: u32) -> napi::Result<NativeProcess> {
        let child = self.inner.attach(pid).or_napi()?;
        Ok(NativeProcess::new(child, krunbox::CancellationToken::new()))
    }
}
