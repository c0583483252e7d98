//! The reusable sandbox definition.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::artifacts::{ArtifactOverrides, Artifacts};
use crate::config::SandboxConfig;
use crate::error::{Error, Result};
use crate::instance::{self, Instance};
use crate::limits::Limits;
use crate::rootfs::{BuiltinImage, Rootfs};
use krunbox_protocol::vmm::KernelConfig;

/// Maximum vCPUs a sandbox may ask for (libkrun's own limit is higher; this keeps a typo from
/// asking for 200).
pub const MAX_CPUS: u8 = 32;
/// Smallest guest memory that boots the libkrunfw kernel with room for a command.
pub const MIN_MEMORY_MIB: u32 = 128;
/// The default [`SandboxBuilder::liveness_timeout`].
pub const DEFAULT_LIVENESS_TIMEOUT: Duration = Duration::from_secs(30);
/// Shortest [`SandboxBuilder::liveness_timeout`]: the check pings four times within it, and
/// a busy guest under emulation must get a fair chance to answer.
pub const MIN_LIVENESS_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest [`SandboxBuilder::liveness_timeout`]: beyond an hour a hung guest is not noticed
/// in any useful sense.
pub const MAX_LIVENESS_TIMEOUT: Duration = Duration::from_secs(3600);

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

impl Sandbox {
    /// Starts a definition with defaults: the busybox image, 1 vCPU, 512 MiB.
    pub fn builder() -> SandboxBuilder {
        SandboxBuilder::default()
    }

    /// The definition's image configuration, if it has one.
    pub(crate) fn image_config(&self) -> Option<&crate::rootfs::ImageConfig> {
        self.config.image_config.as_ref()
    }

    /// This definition with `rootfs` as its root (an image build's writable root over the
    /// definition's image).
    pub(crate) fn with_rootfs(&self, rootfs: Rootfs) -> Sandbox {
        let mut config = (*self.config).clone();
        config.rootfs = rootfs;
        Sandbox {
            config: Arc::new(config),
        }
    }

    /// Boots a new microVM from this definition and waits until it accepts commands.
    ///
    /// The root image's SHA-256 is checked first (a built-in image is built on first use);
    /// a mismatch refuses the boot.
    pub async fn boot(&self) -> Result<Instance> {
        instance::boot(self.config.clone()).await
    }

    /// Boots a new microVM from this definition with `options` for this boot alone: mounts
    /// besides the definition's, a hostname, the directory commands start in. The options are
    /// checked first ([`Error::InvalidConfig`]); see [`BootOptions`](crate::BootOptions).
    pub async fn boot_with(&self, options: crate::BootOptions) -> Result<Instance> {
        let config = options.apply(&self.config)?;
        instance::boot(Arc::new(config)).await
    }

    /// Restores `snapshot` (taken of an instance of this definition, or of one alike: the
    /// same image, vCPUs and memory) as a new running instance: its processes, files in
    /// memory and shell variables are as they were when the snapshot was taken. Each part is
    /// checked before the VM runs ([`Error::SnapshotTampered`]); the snapshot's memory is
    /// then mapped copy-on-write, not copied (nothing is read up front; the new instance's
    /// writes stay its own), so the snapshot's directory must stay as it is while the
    /// instance runs: a write to its `memory.img` reaches pages the guest has not touched yet,
    /// and a truncation stops the instance.
    ///
    /// ```no_run
    /// # async fn demo(sandbox: &krunbox::Sandbox, key_dir: &std::path::Path) -> krunbox::Result<()> {
    /// let snapshot = krunbox::Snapshot::open("/var/tmp/ready", key_dir)?;
    /// let vm = sandbox.restore(&snapshot).await?;
    /// vm.command("cat").arg("/tmp/state").status().await?;
    /// # Ok(()) }
    /// ```
    pub async fn restore(&self, snapshot: &crate::Snapshot) -> Result<Instance> {
        instance::restore(self.config.clone(), snapshot.clone()).await
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
    liveness_timeout: Duration,
    limits: Limits,
    cache_dir: Option<PathBuf>,
    overrides: ArtifactOverrides,
    kernel: Option<Kernel>,
    vmm_log_level: u32,
    required_isolation: Vec<crate::Layer>,
    console_log_max: u64,
    network: Option<crate::Network>,
    network_backend: Option<PathBuf>,
    mounts: Vec<crate::fs::Mount>,
    virtiofs_passthrough: Option<(PathBuf, String)>,
    image_config: Option<crate::rootfs::ImageConfig>,
    output_disk: Option<crate::rootfs::served::OutputDisk>,
    snapshots: bool,
    snapshot_key_dir: Option<PathBuf>,
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
            liveness_timeout: DEFAULT_LIVENESS_TIMEOUT,
            limits: Limits::default(),
            cache_dir: None,
            overrides: ArtifactOverrides::default(),
            kernel: None,
            vmm_log_level: std::env::var("KRUNBOX_VMM_LOG_LEVEL")
                .ok()
                .and_then(|v| v.parse().ok())
                // Info: a handful of lines per VM, among them how a vCPU stopped.
                .unwrap_or(3),
            required_isolation: Vec::new(),
            console_log_max: crate::logs::DEFAULT_CONSOLE_LOG_MAX,
            network: None,
            network_backend: None,
            mounts: Vec::new(),
            virtiofs_passthrough: None,
            image_config: None,
            output_disk: None,
            snapshots: false,
            snapshot_key_dir: None,
        }
    }
}

impl SandboxBuilder {
    /// Boots instances that can be snapshotted ([`Instance::snapshot`](crate::Instance::snapshot)):
    /// their guest memory is then a file this process holds (as with mounts), which costs a
    /// copy of the kernel into it at boot. Off by default.
    ///
    /// ```no_run
    /// # async fn demo() -> krunbox::Result<()> {
    /// let sandbox = krunbox::Sandbox::builder().snapshots(true).build()?;
    /// let vm = sandbox.boot().await?;
    /// let snapshot = vm.snapshot("/var/tmp/booted").await?;
    /// # Ok(()) }
    /// ```
    pub fn snapshots(mut self, on: bool) -> Self {
        self.snapshots = on;
        self
    }

    /// Where the key that authenticates this sandbox's snapshots lives (made there, 0600, on
    /// first use): only a process that reads it can write a snapshot another accepts.
    /// Default: the [`cache_dir`](Self::cache_dir).
    pub fn snapshot_key_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.snapshot_key_dir = Some(dir.into());
        self
    }

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

    /// The image's configuration (from [`oci::import`](crate::image::oci::import)): every
    /// [`Instance::command`](crate::Instance::command) gets its environment, working
    /// directory and user unless the command sets them itself, and
    /// [`Instance::entrypoint`](crate::Instance::entrypoint) runs its entrypoint.
    ///
    /// ```
    /// use krunbox::rootfs::ImageConfig;
    /// use krunbox::Sandbox;
    ///
    /// let config = ImageConfig {
    ///     cmd: vec!["python3".into(), "app.py".into()],
    ///     working_dir: Some("/app".into()),
    ///     ..Default::default()
    /// };
    /// let builder = Sandbox::builder().image_config(config);
    /// # let _ = builder;
    /// ```
    pub fn image_config(mut self, config: crate::rootfs::ImageConfig) -> Self {
        self.image_config = Some(config);
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

    /// How long a running guest may stay silent before it is declared hung (default 30 s;
    /// 1 s to 1 hour).
    ///
    /// The library pings the guest every 5 s (every quarter of a shorter timeout) while it
    /// hears nothing else; anything the guest sends counts as a sign of life, and guest-init
    /// answers a ping ahead of any output it has queued, so a busy guest is never mistaken for
    /// a hung one. A guest that leaves a ping unanswered and sends nothing for this long (its
    /// vCPU wedged, the VMM frozen, guest-init stuck) is declared hung: its VMM helper is
    /// killed and every pending and later call of the instance fails with
    /// [`Error::GuestHung`]. A guest that freezes is noticed between `timeout - interval` and
    /// `timeout + interval` later (25 to 35 s by default).
    ///
    /// ```no_run
    /// # async fn demo() -> krunbox::Result<()> {
    /// use std::time::Duration;
    /// use krunbox::Sandbox;
    ///
    /// let sandbox = Sandbox::builder().liveness_timeout(Duration::from_secs(60)).build()?;
    /// let vm = sandbox.boot().await?;
    /// match vm.command("make").output().await {
    ///     Err(krunbox::Error::GuestHung { .. }) => {
    ///         // The VM is gone: boot a new one and retry there.
    ///         let vm = sandbox.boot().await?;
    ///         vm.command("make").output().await?;
    ///     }
    ///     other => { other?; }
    /// }
    /// # Ok(()) }
    /// ```
    pub fn liveness_timeout(mut self, timeout: Duration) -> Self {
        self.liveness_timeout = timeout;
        self
    }

    /// Isolation layers the VMM helper must have in force, or the boot fails with
    /// [`Error::IsolationUnavailable`](crate::Error::IsolationUnavailable) before the guest
    /// runs. Whatever is required, the helper always applies every layer the host offers, and a
    /// boot whose canaries get through always fails
    /// ([`Error::IsolationBreached`](crate::Error::IsolationBreached)). Calls add up.
    ///
    /// ```no_run
    /// # async fn demo() -> krunbox::Result<()> {
    /// use krunbox::{Layer, Sandbox};
    ///
    /// let sandbox = Sandbox::builder()
    ///     .require_isolation([Layer::Seccomp, Layer::Landlock, Layer::UserNamespace])
    ///     .build()?;
    /// match sandbox.boot().await {
    ///     Err(krunbox::Error::IsolationUnavailable { missing, .. }) => {
    ///         for layer in missing {
    ///             eprintln!("missing {}: {}", layer.layer, layer.detail);
    ///         }
    ///     }
    ///     other => { other?; }
    /// }
    /// # Ok(()) }
    /// ```
    pub fn require_isolation(mut self, layers: impl IntoIterator<Item = crate::Layer>) -> Self {
        for layer in layers {
            if !self.required_isolation.contains(&layer) {
                self.required_isolation.push(layer);
            }
        }
        self
    }

    /// The most disk the guest console's log may take, in bytes (default
    /// [`DEFAULT_CONSOLE_LOG_MAX`](crate::DEFAULT_CONSOLE_LOG_MAX), 8 MiB). The guest writes its
    /// console at will; the host keeps two generations (`console.log` and `console.log.1` in
    /// the instance directory) of half this each, so the newest output is always kept for error
    /// messages. Between 64 KiB and 1 GiB.
    ///
    /// ```
    /// let sandbox = krunbox::Sandbox::builder().console_log_max(1 << 20).build();
    /// # let _ = sandbox;
    /// ```
    pub fn console_log_max(mut self, bytes: u64) -> Self {
        self.console_log_max = bytes;
        self
    }

    /// Gives the guest a network device served by the library, under `network`'s policy
    /// (see [`Network`](crate::Network)). Without this the guest has no network device at all.
    ///
    /// ```
    /// let sandbox = krunbox::Sandbox::builder()
    ///     .network(krunbox::Network::deny_all())
    ///     .build();
    /// # let _ = sandbox;
    /// ```
    pub fn network(mut self, network: crate::Network) -> Self {
        self.network = Some(network);
        self
    }

    /// Mounts `fs` at `guest_path` (absolute; created in the guest if missing), read-write with
    /// the default cache policy. Every boot of the definition mounts the same filesystem: a
    /// [`MemoryFs`](crate::fs::MemoryFs) keeps what one boot wrote for the next. See
    /// [`fs`](crate::fs) and [`mount_with`](Self::mount_with).
    ///
    /// ```
    /// use krunbox::fs::MemoryFs;
    /// use krunbox::Sandbox;
    ///
    /// let workspace = MemoryFs::new();
    /// let sandbox = Sandbox::builder().mount("/workspace", workspace.clone());
    /// # let _ = sandbox;
    /// ```
    pub fn mount(self, guest_path: impl Into<String>, fs: impl crate::fs::VirtualFs) -> Self {
        self.mount_with(guest_path, fs, crate::fs::MountOptions::new())
    }

    /// Mounts `fs` at `guest_path` with `options` (read-only, cache policy).
    ///
    /// ```
    /// use krunbox::fs::{HostDir, MountOptions};
    /// use krunbox::Sandbox;
    ///
    /// # fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let docs = HostDir::new("/usr/share/doc")?;
    /// let sandbox = Sandbox::builder()
    ///     .mount_with("/docs", docs, MountOptions::new().read_only())
    ///     .build()?;
    /// # let _ = sandbox; Ok(()) }
    /// ```
    pub fn mount_with(
        mut self,
        guest_path: impl Into<String>,
        fs: impl crate::fs::VirtualFs,
        options: crate::fs::MountOptions,
    ) -> Self {
        self.mounts.push(crate::fs::Mount {
            guest_path: guest_path.into(),
            fs: Arc::new(fs),
            options,
        });
        self
    }

    /// **Benchmarks only** (`benches/net.rs`), not a supported way to give a guest a network:
    /// the guest's network device is served by another program listening on the unix stream
    /// socket `socket` (the length-prefixed frames of libkrun's `krun_add_net_unixstream`, as
    /// passt speaks them) instead of by the library. At each boot the library connects to
    /// `socket` and hands that connection to the VMM helper as the device's backend; no
    /// [`Network`](crate::Network) service runs, so no policy decides anything and whatever
    /// the program lets through is reached. The guest is addressed as under
    /// [`Network::deny_all`](crate::Network::deny_all) (`10.0.2.15/24`, gateway and resolver
    /// `10.0.2.2`); a [`network`](Self::network) with a policy is refused. Kept so that our
    /// stack can be measured against passt serving the same guest, like krun-sys's
    /// `add_virtiofs` kept as a baseline.
    #[doc(hidden)]
    pub fn network_backend_for_benchmarks(mut self, socket: impl Into<PathBuf>) -> Self {
        self.network_backend = Some(socket.into());
        self
    }

    /// **Benchmarks only** (`benches/fs.rs`), NOT a supported way to share a directory with a
    /// guest: `host_dir` is served read-write by libkrun's own virtio-fs passthrough server,
    /// inside the VMM helper, as the virtio-fs device `tag`; the guest mounts it itself
    /// (`mount -t virtiofs TAG /some/dir`, as root). That server does not jail itself: a
    /// hostile guest kernel can send FUSE lookups of `..` past the shared directory, and only
    /// the helper's jail (which for this holds the directory and the helper's own
    /// `/proc/self/fd`, which the server needs) stands between it and the rest of the host;
    /// seccomp also lets this helper list, make and remove directory entries. Use
    /// [`mount`](Self::mount) with a [`HostDir`](crate::fs::HostDir) to share a directory.
    /// Kept so that our filesystems can be measured against libkrun's passthrough of the same
    /// directory in the same run, like [`network_backend_for_benchmarks`]
    /// (Self::network_backend_for_benchmarks) against passt. `build()` checks that `host_dir`
    /// is a directory and the tag is 1–36 bytes of letters, digits, `-` and `_`.
    #[doc(hidden)]
    pub fn virtiofs_passthrough_for_benchmarks(
        mut self,
        host_dir: impl Into<PathBuf>,
        tag: impl Into<String>,
    ) -> Self {
        self.virtiofs_passthrough = Some((host_dir.into(), tag.into()));
        self
    }

    /// Bounds on what the guest can make the host hold or wait for (request deadlines,
    /// `read_file` size, process and request counts). See [`Limits`].
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
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

    /// Boots this kernel instead of libkrunfw's. See [`Kernel`].
    ///
    /// ```no_run
    /// use krunbox::{Kernel, KernelFormat, Sandbox};
    ///
    /// let sandbox = Sandbox::builder()
    ///     .kernel(Kernel::new("/srv/kernels/vmlinux", KernelFormat::Elf).arg("loglevel=4"))
    ///     .build()?;
    /// # Ok::<(), krunbox::Error>(())
    /// ```
    pub fn kernel(mut self, kernel: Kernel) -> Self {
        self.kernel = Some(kernel);
        self
    }

    /// libkrun's log level in the VMM helper's log (0 off … 5 trace; default 3, info: a few
    /// lines per VM, including how its vCPUs stopped).
    pub fn vmm_log_level(mut self, level: u32) -> Self {
        self.vmm_log_level = level.min(5);
        self
    }

    /// Gives the VM `disk` as a virtio-blk disk with the serial
    /// [`OUTPUT_DISK_SERIAL`](crate::rootfs::served::OUTPUT_DISK_SERIAL), served from this
    /// process or in place: an image build's output (crate-internal: flatten and OCI import).
    pub(crate) fn output_disk(mut self, disk: crate::rootfs::served::DiskSource) -> Self {
        self.output_disk = Some(crate::rootfs::served::OutputDisk(disk));
        self
    }

    /// Checks the definition and finds the run-time files it needs.
    pub fn build(self) -> Result<Sandbox> {
        let console_range = crate::logs::CONSOLE_LOG_MAX_RANGE;
        if !console_range.contains(&self.console_log_max) {
            return Err(Error::InvalidConfig(format!(
                "console_log_max must be between {} KiB and {} MiB, got {} bytes",
                console_range.start() >> 10,
                console_range.end() >> 20,
                self.console_log_max
            )));
        }
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
        if !(MIN_LIVENESS_TIMEOUT..=MAX_LIVENESS_TIMEOUT).contains(&self.liveness_timeout) {
            return Err(Error::InvalidConfig(format!(
                "liveness_timeout must be between {MIN_LIVENESS_TIMEOUT:?} and \
                 {MAX_LIVENESS_TIMEOUT:?}, got {:?}",
                self.liveness_timeout
            )));
        }
        self.limits.validate()?;
        check_hostname(&self.hostname)?;
        self.rootfs.check()?;
        let network = match (&self.network_backend, self.network) {
            (Some(_), Some(network)) if !network.is_deny_all() => {
                return Err(Error::InvalidConfig(
                    "a network backend for benchmarks serves the link itself: a network \
                     policy would never be asked"
                        .into(),
                ))
            }
            (Some(_), network) => Some(network.unwrap_or_else(crate::Network::deny_all)),
            (None, network) => network,
        };
        let virtiofs_passthrough = self
            .virtiofs_passthrough
            .map(|(dir, tag)| passthrough_share(&dir, tag))
            .transpose()?;
        let kernel = self.kernel.map(Kernel::into_config).transpose()?;
        let artifacts = Artifacts::locate_with(&self.overrides)?;
        let cache_dir = self.cache_dir.unwrap_or_else(crate::cache_dir);
        let mut config = SandboxConfig {
            snapshots: self.snapshots,
            snapshot_key_dir: self.snapshot_key_dir.unwrap_or_else(|| cache_dir.clone()),
            rootfs: self.rootfs,
            cpus: self.cpus,
            memory_mib: self.memory_mib,
            hostname: self.hostname,
            boot_timeout: self.boot_timeout,
            liveness_timeout: self.liveness_timeout,
            limits: self.limits,
            cache_dir,
            artifacts,
            kernel,
            vmm_log_level: self.vmm_log_level,
            required_isolation: self.required_isolation,
            console_log_max: self.console_log_max,
            network,
            network_backend: self.network_backend,
            mounts: self.mounts,
            virtiofs_passthrough,
            image_config: self.image_config,
            output_disk: self.output_disk,
            current_dir: None,
        };
        let others = other_devices(&config);
        config.mounts = crate::fs::check_mounts(std::mem::take(&mut config.mounts), &others)
            .map_err(Error::InvalidConfig)?;
        Ok(Sandbox {
            config: Arc::new(config),
        })
    }
}

/// Checks a guest hostname: 1-64 letters, digits, `-` and `.`.
pub(crate) fn check_hostname(hostname: &str) -> Result<()> {
    let valid = !hostname.is_empty()
        && hostname.len() <= 64
        && hostname
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if !valid {
        return Err(Error::InvalidConfig(format!(
            "hostname {hostname:?} must be 1-64 characters of letters, digits, '-' and '.'"
        )));
    }
    Ok(())
}

/// What else of a definition takes one of the VM's devices, besides its mounts (for the
/// mounts' bound and its message).
pub(crate) fn other_devices(config: &SandboxConfig) -> Vec<&'static str> {
    let mut others = Vec::new();
    if config.network.is_some() {
        others.push("for the network");
    }
    if config.rootfs.is_writable() {
        others.push("for the writable root's layer");
    }
    if config.virtiofs_passthrough.is_some() {
        others.push("for the benchmark's passthrough");
    }
    if config.output_disk.is_some() {
        others.push("for the output disk");
    }
    others
}

/// How a custom kernel file is packaged (libkrun's `KRUN_KERNEL_FORMAT_*`).
///
/// libkrun loads each format on some architectures only; [`SandboxBuilder::build`] refuses a
/// format this one cannot load. On x86-64: [`Elf`](Self::Elf) and the three `Image*` formats.
/// On arm64 and riscv64: [`PeGzip`](Self::PeGzip).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KernelFormat {
    /// An uncompressed ELF `vmlinux` (x86-64).
    Elf,
    /// A PE image with a gzip-compressed kernel inside, such as arm64's `Image.gz` EFI stub
    /// (arm64, riscv64).
    PeGzip,
    /// A file holding a bzip2-compressed ELF kernel (x86-64).
    ImageBzip2,
    /// A file holding a gzip-compressed ELF kernel (x86-64).
    ImageGzip,
    /// A file holding a zstd-compressed ELF kernel (x86-64).
    ImageZstd,
}

impl KernelFormat {
    /// libkrun's number for the format. Raw (0) is left out on purpose: on x86-64 libkrun maps
    /// a raw file as if it were libkrunfw's bundle, at a fixed address no raw kernel we know of
    /// is linked for.
    fn libkrun_number(self) -> u32 {
        match self {
            KernelFormat::Elf => 1,
            KernelFormat::PeGzip => 2,
            KernelFormat::ImageBzip2 => 3,
            KernelFormat::ImageGzip => 4,
            KernelFormat::ImageZstd => 5,
        }
    }

    /// Whether libkrun can load this format on the architecture krunbox was built for.
    fn loads_here(self) -> bool {
        match self {
            KernelFormat::PeGzip => cfg!(any(target_arch = "aarch64", target_arch = "riscv64")),
            KernelFormat::Elf
            | KernelFormat::ImageBzip2
            | KernelFormat::ImageGzip
            | KernelFormat::ImageZstd => cfg!(target_arch = "x86_64"),
        }
    }
}

/// What guest-init needs on the kernel command line: libkrun's own default line plus
/// `init=/init.krun`, which is exactly what libkrun passes when no command line is given. A
/// command line given to `krun_set_kernel` replaces that part (libkrun still appends its own
/// settings after it), so with extra arguments it must carry these too. Each one, and why:
/// `console=hvc0` (the console log), `rootfstype=virtiofs rw` (the host-less virtio-fs device that
/// holds guest-init is the initial root), `init=/init.krun` (guest-init's name there), `reboot=k
/// panic=-1 panic_print=0` (a panic stops the VM at once, which the library reports),
/// `nomodule` (no module loading: everything the guest needs is built in), `quiet`,
/// `no-kvmapf` (no async page faults: libkrun's vCPUs do not handle them).
const GUEST_INIT_CMDLINE: &str = "reboot=k panic=-1 panic_print=0 nomodule console=hvc0 \
                                  rootfstype=virtiofs rw quiet no-kvmapf init=/init.krun";

/// Parameters of [`GUEST_INIT_CMDLINE`] an extra argument may not set again: with another
/// value the guest boots without guest-init, or without the console the library reads, and
/// the boot hangs until its timeout instead of failing.
const RESERVED_KERNEL_PARAMS: &[&str] = &[
    "init",
    "rdinit",
    "root",
    "rootfstype",
    "rootflags",
    "console",
    "panic",
    "reboot",
];

/// Longest kernel command line the guest takes: Linux's `COMMAND_LINE_SIZE` on x86-64 and
/// arm64, and libkrun's own limit on riscv64.
const MAX_CMDLINE: usize = if cfg!(target_arch = "riscv64") {
    1024
} else {
    2048
};

/// Room left on the command line for what libkrun appends after ours (its environment
/// settings and the `--` that separates init's arguments).
const LIBKRUN_CMDLINE_ROOM: usize = 256;

/// A guest kernel to boot instead of libkrunfw's, for [`SandboxBuilder::kernel`].
///
/// The kernel must have built in what guest-init uses: virtio-mmio, virtio-fs (its first root),
/// virtio-blk and the root image's filesystem (erofs for the built-in images), vsock over
/// virtio, devpts, tmpfs and a `hvc0` console. libkrunfw's kernel configuration has all of them.
///
/// There is no initramfs option on purpose: the kernel would run the initramfs' `/init`
/// instead of guest-init, and the boot would never become ready.
///
/// ```
/// use krunbox::{Kernel, KernelFormat};
///
/// let kernel = Kernel::new("/srv/kernels/vmlinux", KernelFormat::Elf).arg("loglevel=4");
/// # drop(kernel);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    path: PathBuf,
    format: KernelFormat,
    args: Vec<String>,
}

impl Kernel {
    /// A kernel file in the given format. A relative path is taken from the current directory
    /// when the sandbox is built.
    ///
    /// ```
    /// use krunbox::{Kernel, KernelFormat};
    ///
    /// let kernel = Kernel::new("/boot/vmlinuz.zst", KernelFormat::ImageZstd);
    /// # drop(kernel);
    /// ```
    pub fn new(path: impl Into<PathBuf>, format: KernelFormat) -> Self {
        Kernel {
            path: path.into(),
            format,
            args: Vec::new(),
        }
    }

    /// Appends one argument to the kernel command line, after the ones guest-init needs. Each
    /// argument is one word of printable ASCII without quotes; the parameters guest-init
    /// depends on (`init`, `root`, `console`, ...) cannot be set.
    ///
    /// ```
    /// use krunbox::{Kernel, KernelFormat};
    ///
    /// let kernel = Kernel::new("/srv/vmlinux", KernelFormat::Elf).arg("mitigations=off");
    /// # drop(kernel);
    /// ```
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Appends several arguments to the kernel command line. See [`Kernel::arg`].
    ///
    /// ```
    /// use krunbox::{Kernel, KernelFormat};
    ///
    /// let kernel = Kernel::new("/srv/vmlinux", KernelFormat::Elf).args(["loglevel=7", "nokaslr"]);
    /// # drop(kernel);
    /// ```
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Checks the file, format and arguments and turns them into what the VMM helper is given.
    fn into_config(self) -> Result<KernelConfig> {
        if !self.format.loads_here() {
            return Err(Error::InvalidConfig(format!(
                "libkrun cannot load a {:?} kernel on {}; see KernelFormat for the formats it \
                 loads there",
                self.format,
                std::env::consts::ARCH
            )));
        }
        // Absolute, so the VMM helper finds the same file whatever its working directory.
        let path = std::fs::canonicalize(&self.path).map_err(|e| {
            Error::InvalidConfig(format!(
                "cannot use the kernel {}: {e}; give the path of a readable file",
                self.path.display()
            ))
        })?;
        if !path.is_file() {
            return Err(Error::InvalidConfig(format!(
                "the kernel {} is not a regular file",
                path.display()
            )));
        }
        for arg in &self.args {
            check_kernel_arg(arg)?;
        }
        let cmdline = (!self.args.is_empty()).then(|| {
            std::iter::once(GUEST_INIT_CMDLINE)
                .chain(self.args.iter().map(String::as_str))
                .collect::<Vec<_>>()
                .join(" ")
        });
        let room = MAX_CMDLINE - LIBKRUN_CMDLINE_ROOM;
        if let Some(line) = cmdline.as_ref().filter(|line| line.len() > room) {
            return Err(Error::InvalidConfig(format!(
                "the kernel command line would be {} bytes; keep the extra arguments under {} \
                 bytes",
                line.len(),
                room - GUEST_INIT_CMDLINE.len() - 1
            )));
        }
        Ok(KernelConfig {
            path,
            format: self.format.libkrun_number(),
            cmdline,
        })
    }
}

/// One extra kernel argument: a single printable word that cannot end the command line early
/// (`--`), swallow what libkrun appends (a quote), or override what guest-init needs.
fn check_kernel_arg(arg: &str) -> Result<()> {
    if arg.is_empty() || !arg.bytes().all(|b| b.is_ascii_graphic() && b != b'"') {
        return Err(Error::InvalidConfig(format!(
            "kernel argument {arg:?} must be one word of printable ASCII without quotes; pass \
             each argument separately"
        )));
    }
    if arg == "--" {
        return Err(Error::InvalidConfig(
            "kernel argument \"--\" would end the kernel's own parameters; leave it out".into(),
        ));
    }
    let name = arg.split_once('=').map_or(arg, |(name, _)| name);
    if RESERVED_KERNEL_PARAMS.contains(&name) {
        return Err(Error::InvalidConfig(format!(
            "kernel argument {arg:?} sets {name}, which krunbox sets itself so that guest-init \
             boots; leave it out"
        )));
    }
    Ok(())
}

/// Checks a benchmark's passthrough share: the tag (virtio-fs allows 36 bytes; ours are plain
/// names, and not the first root's) and the directory, made absolute and canonical so that the
/// helper binds the very directory the caller named.
fn passthrough_share(dir: &Path, tag: String) -> Result<krunbox_protocol::vmm::PassthroughShare> {
    let plain = (1..=36).contains(&tag.len())
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !plain {
        return Err(Error::InvalidConfig(format!(
            "virtio-fs tag {tag:?} must be 1-36 letters, digits, '-' and '_'"
        )));
    }
    let dir = std::fs::canonicalize(dir)
        .ok()
        .filter(|d| d.is_dir())
        .ok_or_else(|| {
            Error::InvalidConfig(format!(
                "{} is not a directory to share with virtio-fs",
                dir.display()
            ))
        })?;
    Ok(krunbox_protocol::vmm::PassthroughShare { tag, dir })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `boot()`'s future can be spawned on a multi-threaded runtime (whatever the root: a
    /// persistent root's imago work runs on a thread of its own for this). Checked when the
    /// tests compile: never called, it needs no sandbox.
    #[allow(dead_code)]
    fn boot_is_send(sandbox: &Sandbox) {
        fn assert_send<T: Send>(_: &T) {}
        assert_send(&sandbox.boot());
    }

    #[test]
    fn a_benchmark_passthrough_share_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let share = passthrough_share(dir.path(), "baseline".into()).unwrap();
        assert_eq!(share.dir, dir.path().canonicalize().unwrap());
        for tag in ["", "/dev/root", "a b", &"x".repeat(37)] {
            let err = passthrough_share(dir.path(), tag.into()).unwrap_err();
            assert!(err.to_string().contains("virtio-fs tag"), "{err}");
        }
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        for path in [file, dir.path().join("missing")] {
            let err = passthrough_share(&path, "baseline".into()).unwrap_err();
            assert!(err.to_string().contains("not a directory"), "{err}");
        }
    }

    #[test]
    fn a_benchmark_network_backend_takes_no_policy() {
        let policy = crate::Network::with_policy(|_: crate::net::Flow| async {
            crate::net::Verdict::deny()
        });
        let err = Sandbox::builder()
            .network(policy)
            .network_backend_for_benchmarks("/nonexistent/passt.sock")
            .build()
            .unwrap_err();
        assert!(
            err.to_string().contains("policy would never be asked"),
            "{err}"
        );
    }

    #[test]
    fn a_custom_kernel_is_checked_when_the_definition_is_built() {
        let err = Sandbox::builder()
            .kernel(Kernel::new("/nonexistent/vmlinux", KernelFormat::Elf))
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("/nonexistent/vmlinux"), "{err}");
        let err = Sandbox::builder()
            .kernel(Kernel::new("/", KernelFormat::ImageGzip))
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        let kernel = tempfile::NamedTempFile::new().unwrap();
        let with = |arg: &str| {
            Kernel::new(kernel.path(), KernelFormat::ImageZstd)
                .arg(arg)
                .into_config()
        };
        for bad in ["two words", "", "tab\there", "nul\0", "say=\"x", "é"] {
            let err = with(bad).unwrap_err();
            assert!(err.to_string().contains("one word"), "{bad:?}: {err}");
        }
        for reserved in [
            "init=/bin/sh",
            "rdinit=/init",
            "console=ttyS0",
            "root=/dev/vda",
        ] {
            let err = with(reserved).unwrap_err();
            assert!(
                err.to_string().contains("krunbox sets itself"),
                "{reserved}: {err}"
            );
        }
        assert!(with("--").unwrap_err().to_string().contains("\"--\""));
        let err = with(&"x".repeat(4000)).unwrap_err();
        assert!(err.to_string().contains("command line"), "{err}");
        let config = with("loglevel=4").unwrap();
        assert_eq!(config.format, 5);
        let cmdline = config.cmdline.unwrap();
        assert_eq!(cmdline, format!("{GUEST_INIT_CMDLINE} loglevel=4"));
        // Without extra arguments libkrun's own command line is used unchanged.
        let config = Kernel::new(kernel.path(), KernelFormat::ImageBzip2)
            .into_config()
            .unwrap();
        assert_eq!((config.format, config.cmdline), (3, None));
    }

    #[test]
    fn a_relative_kernel_path_is_made_absolute() {
        // A file in the current directory, named relative to it.
        let file = tempfile::NamedTempFile::new_in(".").unwrap();
        let relative = PathBuf::from(file.path().file_name().unwrap());
        assert!(relative.is_relative());
        let config = Kernel::new(&relative, KernelFormat::ImageGzip)
            .into_config()
            .unwrap();
        assert!(config.path.is_absolute(), "{}", config.path.display());
        assert_eq!(config.path, file.path().canonicalize().unwrap());
    }

    #[test]
    fn kernel_formats_this_architecture_cannot_load_are_refused() {
        let kernel = tempfile::NamedTempFile::new().unwrap();
        let unloadable = if cfg!(target_arch = "x86_64") {
            KernelFormat::PeGzip
        } else {
            KernelFormat::Elf
        };
        let err = Kernel::new(kernel.path(), unloadable)
            .into_config()
            .unwrap_err();
        assert!(err.to_string().contains("cannot load"), "{err}");
    }

    #[test]
    fn invalid_definitions_are_refused_with_the_reason() {
        let err = Sandbox::builder().cpus(0).build().unwrap_err();
        assert!(err.to_string().contains("cpus must be between 1"), "{err}");
        let err = Sandbox::builder().memory_mib(16).build().unwrap_err();
        assert!(err.to_string().contains("at least 128 MiB"), "{err}");
        let err = Sandbox::builder().hostname("a b").build().unwrap_err();
        assert!(err.to_string().contains("hostname"), "{err}");
        for absurd in [
            Duration::ZERO,
            Duration::from_millis(999),
            Duration::from_secs(3601),
            Duration::MAX,
        ] {
            let err = Sandbox::builder()
                .liveness_timeout(absurd)
                .build()
                .unwrap_err();
            assert!(
                matches!(&err, Error::InvalidConfig(m) if m.contains("liveness_timeout")),
                "{absurd:?}: {err}"
            );
        }
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
                assert!(fix.contains("krunbox setup"), "{fix}");
            }
            other => panic!("expected MissingArtifact, got {other:?}"),
        }
    }
}
