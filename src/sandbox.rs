//! The reusable sandbox definition.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::artifacts::{ArtifactOverrides, Artifacts};
use crate::error::{Error, Result};
use crate::instance::{self, Instance};
use crate::rootfs::{BuiltinImage, Rootfs};
use crate::vmm::KernelConfig;

/// Maximum vCPUs a sandbox may ask for (libkrun's own limit is higher; this keeps a typo from
/// asking for 200).
pub const MAX_CPUS: u8 = 32;
/// Smallest guest memory that boots the libkrunfw kernel with room for a command.
pub const MIN_MEMORY_MIB: u32 = 128;

/// A sandbox definition: what to boot. Built once, booted many times, each boot a fresh
/// microVM; cloning is cheap and shares the definition.
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::{BuiltinImage, Rootfs, Sandbox};
///
/// let sandbox = Sandbox::builder()
///     .rootfs(Rootfs::builtin(BuiltinImage::Agent))
///     .cpus(2)
///     .memory_mib(1024)
///     .build()?;
///
/// // Three VMs from one definition, at once.
/// let (a, b, c) = tokio::try_join!(sandbox.boot(), sandbox.boot(), sandbox.boot())?;
/// let out = a.command("python3").args(["-c", "print(6 * 7)"]).output().await?;
/// assert_eq!(out.stdout, b"42\n");
/// # drop((b, c)); Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Sandbox {
    config: Arc<SandboxConfig>,
}

#[derive(Debug)]
pub(crate) struct SandboxConfig {
    pub rootfs: Rootfs,
    pub cpus: u8,
    pub memory_mib: u32,
    pub hostname: String,
    pub boot_timeout: Duration,
    pub cache_dir: PathBuf,
    pub artifacts: Artifacts,
    pub kernel: Option<KernelConfig>,
    pub vmm_log_level: u32,
}

impl Sandbox {
    /// Starts a definition with defaults: the busybox image, 1 vCPU, 512 MiB.
    pub fn builder() -> SandboxBuilder {
        SandboxBuilder::default()
    }

    /// Boots a new microVM from this definition and waits until it accepts commands.
    ///
    /// The root image's SHA-256 is checked first (a built-in image is built on first use);
    /// a mismatch refuses the boot.
    pub async fn boot(&self) -> Result<Instance> {
        instance::boot(self.config.clone()).await
    }

    /// The root filesystem this definition boots.
    pub fn rootfs(&self) -> &Rootfs {
        &self.config.rootfs
    }

    /// The run-time files this definition uses.
    pub fn artifacts(&self) -> &Artifacts {
        &self.config.artifacts
    }
}

/// Builds a [`Sandbox`]. See [`Sandbox::builder`].
#[derive(Debug, Clone)]
pub struct SandboxBuilder {
    rootfs: Rootfs,
    cpus: u8,
    memory_mib: u32,
    hostname: String,
    boot_timeout: Duration,
    cache_dir: Option<PathBuf>,
    overrides: ArtifactOverrides,
    kernel: Option<KernelConfig>,
    vmm_log_level: u32,
}

impl Default for SandboxBuilder {
    fn default() -> Self {
        SandboxBuilder {
            rootfs: Rootfs::Builtin(BuiltinImage::Busybox),
            cpus: 1,
            memory_mib: 512,
            hostname: "krunbox".into(),
            // Generous: under nested emulation a boot takes tens of seconds.
            boot_timeout: Duration::from_secs(180),
            cache_dir: None,
            overrides: ArtifactOverrides::default(),
            kernel: None,
            vmm_log_level: std::env::var("KRUNBOX_VMM_LOG_LEVEL")
                .ok()
                .and_then(|v| v.parse().ok())
                // Info: a handful of lines per VM, among them how a vCPU stopped.
                .unwrap_or(3),
        }
    }
}

impl SandboxBuilder {
    /// The root filesystem.
    pub fn rootfs(mut self, rootfs: Rootfs) -> Self {
        self.rootfs = rootfs;
        self
    }

    /// Number of vCPUs (1..=32).
    pub fn cpus(mut self, cpus: u8) -> Self {
        self.cpus = cpus;
        self
    }

    /// Guest memory in MiB (at least 128).
    pub fn memory_mib(mut self, mib: u32) -> Self {
        self.memory_mib = mib;
        self
    }

    /// The guest's hostname.
    pub fn hostname(mut self, hostname: impl Into<String>) -> Self {
        self.hostname = hostname.into();
        self
    }

    /// How long a boot may take before it fails with [`Error::BootTimeout`].
    pub fn boot_timeout(mut self, timeout: Duration) -> Self {
        self.boot_timeout = timeout;
        self
    }

    /// Where built-in images are cached (default [`crate::cache_dir`]).
    pub fn cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cache_dir = Some(dir.into());
        self
    }

    /// Uses this guest-init binary instead of the one krunbox finds.
    pub fn guest_init(mut self, path: impl Into<PathBuf>) -> Self {
        self.overrides.guest_init = Some(path.into());
        self
    }

    /// Uses this `krunbox-vmm` helper binary instead of the one krunbox finds.
    pub fn vmm_helper(mut self, path: impl Into<PathBuf>) -> Self {
        self.overrides.vmm_helper = Some(path.into());
        self
    }

    /// Loads libkrunfw from this directory instead of the krunbox cache.
    pub fn libkrunfw_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.overrides.libkrunfw_dir = Some(dir.into());
        self
    }

    /// Boots this kernel instead of libkrunfw's. `format` is libkrun's kernel format number
    /// (0 raw, 1 ELF, 2 PE+gzip, 3 image+bz2, 4 image+gzip, 5 image+zstd).
    pub fn kernel(
        mut self,
        path: impl Into<PathBuf>,
        format: u32,
        initramfs: Option<PathBuf>,
        cmdline: Option<String>,
    ) -> Self {
        self.kernel = Some(KernelConfig {
            path: path.into(),
            format,
            initramfs,
            cmdline,
        });
        self
    }

    /// libkrun's log level in the VMM helper's log (0 off … 5 trace; default 3, info: a few
    /// lines per VM, including how its vCPUs stopped).
    pub fn vmm_log_level(mut self, level: u32) -> Self {
        self.vmm_log_level = level.min(5);
        self
    }

    /// Checks the definition and finds the run-time files it needs.
    pub fn build(self) -> Result<Sandbox> {
        if self.cpus == 0 || self.cpus > MAX_CPUS {
            return Err(Error::InvalidConfig(format!(
                "cpus must be between 1 and {MAX_CPUS}, got {}",
                self.cpus
            )));
        }
        if self.memory_mib < MIN_MEMORY_MIB {
            return Err(Error::InvalidConfig(format!(
                "memory must be at least {MIN_MEMORY_MIB} MiB, got {}",
                self.memory_mib
            )));
        }
        let valid_hostname = !self.hostname.is_empty()
            && self.hostname.len() <= 64
            && self
                .hostname
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
        if !valid_hostname {
            return Err(Error::InvalidConfig(format!(
                "hostname {:?} must be 1-64 characters of letters, digits, '-' and '.'",
                self.hostname
            )));
        }
        if let Rootfs::Image { sha256, .. } = &self.rootfs {
            if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(Error::InvalidConfig(format!(
                    "image sha256 must be 64 hex digits, got {sha256:?}"
                )));
            }
        }
        let artifacts = Artifacts::locate_with(&self.overrides)?;
        Ok(Sandbox {
            config: Arc::new(SandboxConfig {
                rootfs: self.rootfs,
                cpus: self.cpus,
                memory_mib: self.memory_mib,
                hostname: self.hostname,
                boot_timeout: self.boot_timeout,
                cache_dir: self.cache_dir.unwrap_or_else(crate::cache_dir),
                artifacts,
                kernel: self.kernel,
                vmm_log_level: self.vmm_log_level,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_definitions_are_refused_with_the_reason() {
        let err = Sandbox::builder().cpus(0).build().unwrap_err();
        assert!(err.to_string().contains("cpus must be between 1"), "{err}");
        let err = Sandbox::builder().memory_mib(16).build().unwrap_err();
        assert!(err.to_string().contains("at least 128 MiB"), "{err}");
        let err = Sandbox::builder().hostname("a b").build().unwrap_err();
        assert!(err.to_string().contains("hostname"), "{err}");
        let err = Sandbox::builder()
            .rootfs(Rootfs::image("/x.img", "erofs", "nothex"))
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("64 hex digits"), "{err}");
    }

    #[test]
    fn missing_artifacts_say_how_to_get_them() {
        let err = Sandbox::builder()
            .vmm_helper("/nonexistent/krunbox-vmm")
            .build()
            .unwrap_err();
        match err {
            Error::MissingArtifact { what, fix, .. } => {
                assert!(what.contains("krunbox-vmm"));
                assert!(fix.contains("cargo build"));
            }
            other => panic!("expected MissingArtifact, got {other:?}"),
        }
    }
}
