//! A sandbox definition as a boot reads it ([`SandboxConfig`]), with its boot's options
//! applied.
//!
//! Apart from the public `Sandbox` that checks and holds it: `Sandbox::boot` starts the boot
//! (`instance.rs`), and the boot reads these settings, so with them in `sandbox.rs` each would
//! depend on the other.

use std::path::PathBuf;
use std::time::Duration;

use crate::artifacts::Artifacts;
use crate::limits::Limits;
use crate::rootfs::Rootfs;
use krunbox_protocol::vmm::KernelConfig;

/// A definition as [`SandboxBuilder::build`](crate::SandboxBuilder::build) checked it, with the
/// run-time files found; shared, unchanged, by every boot of it.
#[derive(Debug, Clone)]
pub(crate) struct SandboxConfig {
    pub rootfs: Rootfs,
    pub cpus: u8,
    pub memory_mib: u32,
    pub hostname: String,
    pub boot_timeout: Duration,
    pub liveness_timeout: Duration,
    pub limits: Limits,
    pub cache_dir: PathBuf,
    pub artifacts: Artifacts,
    pub kernel: Option<KernelConfig>,
    pub vmm_log_level: u32,
    pub required_isolation: Vec<crate::Layer>,
    pub console_log_max: u64,
    pub network: Option<crate::Network>,
    /// Benchmarks only: a unix socket whose listener serves the guest's link instead of the
    /// library (`SandboxBuilder::network_backend_for_benchmarks`); `network` is then deny-all
    /// and only addresses the guest.
    pub network_backend: Option<PathBuf>,
    /// Host filesystems mounted in the guest, parents before the mounts inside them.
    pub mounts: Vec<crate::fs::Mount>,
    /// Benchmarks only: a host directory served by libkrun's own virtio-fs passthrough
    /// (`SandboxBuilder::virtiofs_passthrough_for_benchmarks`), checked: absolute, a directory.
    pub virtiofs_passthrough: Option<krunbox_protocol::vmm::PassthroughShare>,
    /// An image's configuration: defaults for commands, the entrypoint.
    pub image_config: Option<crate::rootfs::ImageConfig>,
    /// An image build's output disk (crate-internal).
    pub output_disk: Option<crate::rootfs::served::OutputDisk>,
    /// Where commands start unless they say otherwise (a boot's option).
    pub current_dir: Option<PathBuf>,
    /// Instances can be snapshotted: their guest memory is a file the library holds.
    pub snapshots: bool,
    /// Where the key authenticating snapshots lives.
    pub snapshot_key_dir: PathBuf,
}
