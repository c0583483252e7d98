//! Workspaces: filesystems the host implements, mounted at guest paths.
//!
//! A [`VirtualFs`] is any host object that answers filesystem operations (a database, an
//! object store, a git tree, memory). [`SandboxBuilder::mount`](crate::SandboxBuilder::mount)
//! puts one at a guest path; every process in the guest then sees an ordinary POSIX directory
//! tree there, and never a host path. Two implementations ship: [`MemoryFs`] (in memory,
//! seedable, readable and writable by the host while the guest runs) and [`HostDir`] (a host
//! directory, read-only or read-write, that nothing in the guest can escape).
//!
//! The transport is FUSE over virtio-fs: each mount is a virtio-fs device in the VMM helper
//! (`virtio/`) whose queues, once the guest's driver activates it, this process serves itself
//! in the guest's memory (a file of ours the VM is built in: `served/`); this module decodes
//! each request (bounded and validated: the guest is hostile, see `fuse/`), calls the
//! implementation, and writes the reply into the request's buffers. docs/architecture.md
//! says why (and what else was weighed), and what the guest caches.
//!
//! ```no_run
//! # async fn demo() -> krunbox::Result<()> {
//! use krunbox::fs::MemoryFs;
//! use krunbox::{BuiltinImage, Rootfs, Sandbox};
//!
//! let workspace = MemoryFs::new();
//! workspace.write_file("/src/main.py", b"print('hi')\n").unwrap();
//! let sandbox = Sandbox::builder()
//!     .rootfs(Rootfs::builtin(BuiltinImage::Agent))
//!     .mount("/workspace", workspace.clone())
//!     .build()?;
//! let vm = sandbox.boot().await?;
//! vm.command("sh").args(["-c", "python3 /workspace/src/main.py > /workspace/out.txt"])
//!     .status().await?;
//! assert_eq!(workspace.read_file("/out.txt").unwrap(), b"hi\n");
//! # Ok(()) }
//! ```

mod by_path;
pub(crate) mod fuse;
pub(crate) mod handover;
mod host_dir;
mod memory;
pub(crate) mod served;
pub(crate) mod service;
mod types;
mod virtual_fs;
mod write_data;

use std::sync::Arc;
use std::time::Duration;

pub use async_trait::async_trait;
pub use by_path::{ByPath, PathFs, PathStat, MAX_INODES, MAX_LISTED};
pub use host_dir::{HostDir, Mask};
pub use memory::MemoryFs;
pub use types::*;
pub use virtual_fs::VirtualFs;
pub use write_data::WriteData;

/// How a filesystem is mounted in the guest.
///
/// ```
/// use std::time::Duration;
/// use krunbox::fs::MountOptions;
///
/// let options = MountOptions::new().read_only().cache(Duration::ZERO);
/// assert!(options.is_read_only());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MountOptions {
    read_only: bool,
    cache: CachePolicy,
}

impl MountOptions {
    /// Read-write, with the default cache policy ([`MountOptions::DEFAULT_CACHE`]).
    pub fn new() -> Self {
        MountOptions {
            read_only: false,
            cache: CachePolicy {
                entry_timeout: Self::DEFAULT_CACHE,
                attr_timeout: Self::DEFAULT_CACHE,
            },
        }
    }

    /// How long the guest trusts a name or an attribute it was told, by default: one second,
    /// so changes the host makes behind the guest's back show within a second, while a burst
    /// of `stat`s of the same files (a build, `git status`) costs one round trip each.
    pub const DEFAULT_CACHE: Duration = Duration::from_secs(1);

    /// The guest can read but never change anything (its kernel refuses writes with `EROFS`,
    /// and so does the host if a write gets through anyway).
    pub fn read_only(mut self) -> Self {
        self.read_only = true;
        self
    }

    /// How long the guest may cache names and attributes before asking again (`Duration::ZERO`:
    /// always ask; at most one hour).
    pub fn cache(mut self, timeout: Duration) -> Self {
        let timeout = timeout.min(Duration::from_secs(3600));
        self.cache = CachePolicy {
            entry_timeout: timeout,
            attr_timeout: timeout,
        };
        self
    }

    /// Whether the mount is read-only.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// The cache policy.
    pub fn cache_policy(&self) -> CachePolicy {
        self.cache
    }
}

impl Default for MountOptions {
    fn default() -> Self {
        Self::new()
    }
}

/// One filesystem mounted at one guest path (part of a sandbox definition).
#[derive(Clone)]
pub(crate) struct Mount {
    /// Absolute, normalised guest path.
    pub guest_path: String,
    pub fs: Arc<dyn VirtualFs>,
    pub options: MountOptions,
}

impl std::fmt::Debug for Mount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mount")
            .field("guest_path", &self.guest_path)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// Interrupts libkrun 1.19.7 gives an x86-64 guest's virtio-mmio devices (5 to 15), so the
/// most devices a VM can have.
const DEVICE_INTERRUPTS: usize = 11;

/// libkrun's own devices in every VM krunbox boots: balloon, entropy, console, the first
/// root's virtio-fs, the root image's disk and vsock.
const LIBKRUN_DEVICES: usize = 6;

/// The most mounts one sandbox can have: each is a virtio device of the VM, and of the 11 a
/// guest can have libkrun takes 6. A network takes one more, and so does a writable root
/// (its layer's disk), so a sandbox with both can have 3 mounts.
/// [`SandboxBuilder::build`](crate::SandboxBuilder::build) refuses more with
/// [`Error::InvalidConfig`](crate::Error::InvalidConfig).
///
/// ```
/// assert_eq!(krunbox::fs::MAX_MOUNTS, 5);
/// ```
pub const MAX_MOUNTS: usize = DEVICE_INTERRUPTS - LIBKRUN_DEVICES;

/// The longest guest mount path.
const MAX_GUEST_PATH: usize = 1024;

/// Checks a definition's mounts: absolute, normal guest paths (no `.`, `..`, empty components
/// or NUL), none under the guest's API filesystems, no two at one path, and no more than the
/// VM has devices for, besides `others` (what else takes a device: "a network", ...).
/// Returns them ordered so that a mount comes after the mounts that contain it.
pub(crate) fn check_mounts(mut mounts: Vec<Mount>, others: &[&str]) -> Result<Vec<Mount>, String> {
    let most = MAX_MOUNTS.saturating_sub(others.len());
    if mounts.len() > most {
        let besides = others
            .iter()
            .map(|other| format!(", one {other}"))
            .collect::<String>();
        return Err(format!(
            "at most {most} filesystems can be mounted in this sandbox, got {}: each is a \
             virtio device of the VM, and libkrun gives a guest {DEVICE_INTERRUPTS} devices, \
             {LIBKRUN_DEVICES} of them its own{besides}",
            mounts.len()
        ));
    }
    for mount in &mounts {
        let path = &mount.guest_path;
        let components: Vec<&str> = path.split('/').skip(1).collect();
        let normal = path.starts_with('/')
            && path.len() <= MAX_GUEST_PATH
            && !path.contains('\0')
            && components
                .iter()
                .all(|c| !c.is_empty() && *c != "." && *c != ".." && c.len() <= 255);
        if !normal || path == "/" {
            return Err(format!(
                "mount path {path:?} must be an absolute guest path other than / without \
                 empty, '.' or '..' components (like /workspace)"
            ));
        }
        if ["proc", "sys", "dev"].contains(&components[0]) {
            return Err(format!(
                "mount path {path:?} is inside the guest's /{}, which the guest kernel owns",
                components[0]
            ));
        }
    }
    mounts.sort_by(|a, b| a.guest_path.cmp(&b.guest_path));
    if let Some(pair) = mounts
        .windows(2)
        .find(|pair| pair[0].guest_path == pair[1].guest_path)
    {
        return Err(format!(
            "two filesystems are mounted at {:?}",
            pair[0].guest_path
        ));
    }
    // Sorted by path, a mount's parents (its prefixes) come before it.
    Ok(mounts)
}
