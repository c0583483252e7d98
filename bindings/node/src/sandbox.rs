//! `NativeSandbox`: a definition (root, resources, mounts, network), booted into instances
//! as often as wanted.

use napi_derive::napi;

use crate::errors::OrNapi;
use crate::fs::{Mounts, NativeMounts};
use crate::instance::NativeInstance;
use crate::net::NativeNetwork;
use crate::rootfs::NativeRootfs;

/// A definition's resources and name.
#[napi(object)]
pub struct SandboxOptions {
    pub cpus: Option<u8>,
    pub memory_mib: Option<u32>,
    pub hostname: Option<String>,
    /// Instances can be snapshotted.
    pub snapshots: Option<bool>,
    /// Where the key authenticating snapshots lives.
    pub snapshot_key_dir: Option<String>,
}

/// One boot's own options.
#[napi(object)]
pub struct BootSpec {
    pub hostname: Option<String>,
    /// The working directory of commands that do not say theirs.
    pub cwd: Option<String>,
}

/// A sandbox definition: what each instance boots from. Cheap to boot many times.
#[napi]
pub struct NativeSandbox {
    inner: krunbox::Sandbox,
}

#[napi]
impl NativeSandbox {
    #[napi(constructor)]
    pub fn new(
        rootfs: &NativeRootfs,
        options: SandboxOptions,
        mounts: Option<&NativeMounts>,
        network: Option<&NativeNetwork>,
    ) -> napi::Result<Self> {
        let mut builder = krunbox::Sandbox::builder().rootfs(rootfs.inner.clone());
        if let Some(cpus) = options.cpus {
            builder = builder.cpus(cpus);
        }
        if let Some(mib) = options.memory_mib {
            builder = builder.memory_mib(mib);
        }
        if let Some(hostname) = options.hostname {
            builder = builder.hostname(hostname);
        }
        builder = builder.with_mounts(mounts);
        if let Some(network) = network {
            builder = builder.network(network.inner.clone());
        }
        builder = builder.snapshots(options.snapshots.unwrap_or(false));
        if let Some(dir) = options.snapshot_key_dir {
            builder = builder.snapshot_key_dir(dir);
        }
        Ok(NativeSandbox {
            inner: builder.build().or_napi()?,
        })
    }

    /// A warm pool keeping `size` instances of this definition ready (booting in the
    /// background on the addon's runtime).
    #[napi]
    pub async fn pool(&self, size: u32) -> napi::Result<crate::pool::NativePool> {
        let pool = krunbox::Pool::new(&self.inner, size as usize).or_napi()?;
        Ok(crate::pool::NativePool::new(pool))
    }

    /// Restores `snapshot` as a new instance.
    #[napi]
    pub async fn restore(
        &self,
        snapshot: &crate::snapshot::NativeSnapshot,
    ) -> napi::Result<NativeInstance> {
        let instance = self.inner.restore(&snapshot.inner).await.or_napi()?;
        Ok(NativeInstance::new(instance))
    }

    /// Boots an instance with this boot's own mounts, hostname and working directory.
    #[napi]
    pub async fn boot(
        &self,
        spec: BootSpec,
        mounts: Option<&NativeMounts>,
    ) -> napi::Result<NativeInstance> {
        let mut options = krunbox::BootOptions::new().with_mounts(mounts);
        if let Some(hostname) = spec.hostname {
            options = options.hostname(hostname);
        }
        if let Some(cwd) = spec.cwd {
            options = options.current_dir(cwd);
        }
        let sandbox = self.inner.clone();
        let instance = sandbox.boot_with(options).await.or_napi()?;
        Ok(NativeInstance::new(instance))
    }
}
