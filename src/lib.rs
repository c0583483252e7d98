//! # krunbox
//!
//! Run untrusted commands — shells, compilers, package managers, model-written code — inside
//! libkrun microVMs, from async Rust.
//!
//! A [`Sandbox`] is a reusable definition (root filesystem, vCPUs, memory). Each
//! [`Sandbox::boot`] starts a fresh microVM and returns an [`Instance`], on which
//! [`Instance::command`] builds commands shaped like [`tokio::process::Command`].
//!
//! ```no_run
//! use std::time::Duration;
//! use krunbox::{BuiltinImage, Rootfs, Sandbox};
//!
//! #[tokio::main]
//! async fn main() -> krunbox::Result<()> {
//!     let sandbox = Sandbox::builder()
//!         .rootfs(Rootfs::builtin(BuiltinImage::Agent))
//!         .build()?;
//!     let vm = sandbox.boot().await?;
//!     let out = vm
//!         .command("python3")
//!         .args(["-c", "import platform; print(platform.release())"])
//!         .timeout(Duration::from_secs(30))
//!         .output()
//!         .await?;
//!     println!("{} -> {}", out.status, out.stdout_text());
//!     vm.shutdown().await
//! }
//! ```
//!
//! ## How it fits together
//!
//! Each running VM is a `krunbox-vmm` helper process (libkrun's `krun_start_enter` takes over
//! the process that calls it). Inside the VM, krunbox's own `guest-init` is PID 1; it talks to
//! this library over vsock using the [`protocol`] crate. See `docs/architecture.md`.

#![warn(missing_docs)]

mod artifacts;
mod boot_options;
mod budget;
mod callback;
mod capabilities;
mod cgroup;
mod config;
mod control;
mod error;
mod facts;
mod files;
pub mod fs;
/// The fuzz harness's entry points (not API): built for this crate's tests and with the
/// `fuzzing` feature, which `fuzz/` enables.
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
mod guest_memory;
mod helper;
pub mod image;
mod instance;
mod jail;
mod limits;
mod logs;
mod metrics;
pub mod net;
mod output_queue;
mod pause_clock;
mod pool;
mod process;
pub mod rootfs;
mod sandbox;
#[cfg(test)]
mod scripted_guest;
mod snapshot;
pub mod tools;
mod vmm_commands;

/// The host↔guest control protocol (shared with `guest-init`).
pub mod protocol {
    pub use krunbox_protocol::*;
}

pub use artifacts::{cache_dir, data_dir, search_first_in as artifacts_search_first_in, Artifacts};
pub use boot_options::BootOptions;
pub use capabilities::{HostCapabilities, ImageState, KvmStatus};
pub use error::{Error, Result};
pub use facts::{Distro, GuestFacts, PackageManager, RootKind, COMMANDS};
pub use files::{
    DirEntry, GuestFileReader, GuestFileWriter, Metadata, Search, SearchCut, SearchHit,
    SearchResults, WriteOptions,
};
pub use instance::Instance;
pub use jail::{Canary, CanaryReport, Isolation, Layer, LayerReport};
pub use limits::{
    Limits, DEFAULT_HOST_DESCRIPTORS, DEFAULT_HOST_MEMORY_OVERHEAD,
    DEFAULT_MAX_PENDING_FILE_REQUESTS, DEFAULT_MAX_PROCESSES, DEFAULT_READ_DIR_MAX_ENTRIES,
    DEFAULT_READ_FILE_MAX, DEFAULT_REQUEST_TIMEOUT, MAX_REQUEST_TIMEOUT, MIN_REQUEST_TIMEOUT,
};
pub use logs::DEFAULT_CONSOLE_LOG_MAX;
pub use metrics::{Metrics, MetricsSource, NetworkMetrics};
pub use net::Network;
pub use pool::{Pool, MAX_POOL_SIZE};
pub use process::{
    Child, ChildControl, ChildStderr, ChildStdin, ChildStdout, Command, ExitStatus, Output, Stdio,
    DEFAULT_MAX_OUTPUT, TIMEOUT_EXIT_CODE,
};
pub use protocol::fs::{FileType, FsErrorKind};
pub use rootfs::{BuiltinImage, RootUsage, Rootfs};
pub use sandbox::{
    Kernel, KernelFormat, Sandbox, SandboxBuilder, DEFAULT_LIVENESS_TIMEOUT, MAX_CPUS,
    MAX_LIVENESS_TIMEOUT, MIN_LIVENESS_TIMEOUT, MIN_MEMORY_MIB,
};
pub use snapshot::Snapshot;
pub use tokio_util::sync::CancellationToken;

// The README's Rust examples compile, as doc tests of this crate.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
