//! What differs between boots of one definition ([`BootOptions`]): mounts, the hostname and
//! the directory commands start in. One [`Sandbox`](crate::Sandbox) then serves many lanes,
//! each booted with its own workspace.

use std::path::PathBuf;
use std::sync::Arc;

use crate::config::SandboxConfig;
use crate::error::{Error, Result};
use crate::fs::{Mount, MountOptions, VirtualFs};

/// Options for one boot: [`Sandbox::boot_with`](crate::Sandbox::boot_with). Each adds to or
/// replaces what the definition says; a boot without them is [`Sandbox::boot`](crate::Sandbox::boot).
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::fs::MemoryFs;
/// use krunbox::{BootOptions, BuiltinImage, Rootfs, Sandbox};
///
/// let sandbox = Sandbox::builder().rootfs(Rootfs::builtin(BuiltinImage::Agent)).build()?;
/// for lane in 0..3 {
///     let workspace = MemoryFs::new();
///     let vm = sandbox
///         .boot_with(
///             BootOptions::new()
///                 .mount("/workspace", workspace)
///                 .hostname(format!("agent-{lane}"))
///                 .current_dir("/workspace"),
///         )
///         .await?;
///     vm.command("git").arg("init").status().await?; // in /workspace
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
pub struct BootOptions {
    mounts: Vec<Mount>,
    hostname: Option<String>,
    current_dir: Option<PathBuf>,
}

impl BootOptions {
    /// No options: the definition as it is.
    pub fn new() -> BootOptions {
        BootOptions::default()
    }

    /// Mounts `fs` at `guest_path` for this boot, besides the definition's mounts (see
    /// [`SandboxBuilder::mount`](crate::SandboxBuilder::mount) for what a mount is).
    pub fn mount(self, guest_path: impl Into<String>, fs: impl VirtualFs) -> BootOptions {
        self.mount_with(guest_path, fs, MountOptions::new())
    }

    /// Mounts `fs` at `guest_path` with `options` (read-only, cache policy) for this boot.
    pub fn mount_with(
        mut self,
        guest_path: impl Into<String>,
        fs: impl VirtualFs,
        options: MountOptions,
    ) -> BootOptions {
        self.mounts.push(Mount {
            guest_path: guest_path.into(),
            fs: Arc::new(fs),
            options,
        });
        self
    }

    /// The guest's hostname for this boot, instead of the definition's
    /// ([`SandboxBuilder::hostname`](crate::SandboxBuilder::hostname)).
    pub fn hostname(mut self, hostname: impl Into<String>) -> BootOptions {
        self.hostname = Some(hostname.into());
        self
    }

    /// The directory every command of this boot starts in unless it says otherwise
    /// ([`Command::current_dir`](crate::Command::current_dir)); it wins over an image's own
    /// working directory. An absolute guest path.
    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> BootOptions {
        self.current_dir = Some(dir.into());
        self
    }

    /// The definition with these options applied, checked as the builder checks a definition:
    /// [`Error::InvalidConfig`] says what is wrong, before anything boots.
    pub(crate) fn apply(self, config: &SandboxConfig) -> Result<SandboxConfig> {
        let mut config = config.clone();
        if let Some(hostname) = self.hostname {
            crate::sandbox::check_hostname(&hostname)?;
            config.hostname = hostname;
        }
        if let Some(dir) = self.current_dir {
            use std::os::unix::ffi::OsStrExt;
            let bytes = dir.as_os_str().as_bytes();
            if !dir.is_absolute() || bytes.contains(&0) || bytes.len() > 4096 {
                return Err(Error::InvalidConfig(format!(
                    "current_dir {} must be an absolute guest path (like /workspace)",
                    dir.display()
                )));
            }
            config.current_dir = Some(dir);
        }
        if !self.mounts.is_empty() {
            let mut mounts = std::mem::take(&mut config.mounts);
            mounts.extend(self.mounts);
            let others = crate::sandbox::other_devices(&config);
            config.mounts =
                crate::fs::check_mounts(mounts, &others).map_err(Error::InvalidConfig)?;
        }
        Ok(config)
    }
}
