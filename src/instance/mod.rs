//! A running sandbox: what `Instance` offers (`mod.rs`), how one boots (`boot.rs`: the parts
//! wired into a pipeline; `root.rs`, `attempt.rs`, `admit.rs`), and the task that watches its
//! VMM helper until it stops (`supervisor.rs`).

mod admit;
mod attempt;
mod boot;
mod dir;
mod machine;
mod pause;
mod restored;
mod root;
mod snapshot;
mod supervisor;

pub(crate) use boot::{boot, restore, restore_from};

use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::control::{Control, Gone};
use crate::error::{Error, Result};
use crate::helper;
use crate::logs::InstanceLogs;
use crate::process::{Command, Guest};
use crate::protocol::HostMessage;
use crate::rootfs;

/// How long the VMM may outlive its guest's control connection before it is killed.
const CLOSED_GRACE: Duration = Duration::from_secs(5);

/// How long [`Instance::shutdown`] waits for the guest to power off before killing the VMM.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How long a copy-on-write root's last blocks may take to reach its store when the VM stops.
const STORE_FINISH_DEADLINE: Duration = Duration::from_secs(120);

/// How long the supervisor waits for the VMM process after its helper exited, before it lets
/// go of the root's layer anyway (the VMM dies by `PDEATHSIG` within moments; this bounds a
/// process the kernel cannot kill, one stuck in an uninterruptible write).
const VMM_EXIT_DEADLINE: Duration = Duration::from_secs(30);

/// A booted microVM, from [`Sandbox::boot`](crate::Sandbox::boot).
///
/// Cloning gives another handle to the same VM. The VM stops on [`shutdown`](Self::shutdown),
/// or when the last handle is dropped (then it is killed at once).
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::{BuiltinImage, Rootfs, Sandbox};
///
/// let sandbox = Sandbox::builder().rootfs(Rootfs::builtin(BuiltinImage::Busybox)).build()?;
/// let vm = sandbox.boot().await?;
/// let out = vm.command("uname").arg("-r").output().await?;
/// println!("guest kernel: {}", out.stdout_text().trim());
/// vm.shutdown().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Instance {
    inner: Arc<Inner>,
}

struct Inner {
    control: Arc<Control>,
    vmm_pid: Option<u32>,
    /// The VMM process's pidfd: `vmm_pid` is not handed out once it has exited. (Only ever
    /// polled, never left half-changed by a panic: unwind-safe as the rest of `Inner` is.)
    vmm_process: std::panic::AssertUnwindSafe<Arc<helper::VmmProcess>>,
    shutdown_requested: Arc<AtomicBool>,
    next_id: AtomicU32,
    kernel_release: String,
    /// The image's configuration, for commands' defaults and the entrypoint.
    image_config: Option<crate::rootfs::ImageConfig>,
    /// Where commands start unless they say otherwise (a boot option; wins over the image's).
    current_dir: Option<std::path::PathBuf>,
    /// How the root was given, for [`Instance::facts`].
    root_kind: crate::RootKind,
    /// `Some(description)` once the VMM helper has exited.
    exited: watch::Receiver<Option<String>>,
    /// Asks the supervisor task to kill the VMM helper.
    kill: watch::Sender<bool>,
    /// Held so the helper's lifeline pipe stays open while the instance lives.
    _lifeline: OwnedFd,
    /// The library's end of the helper's command socket.
    commands: Arc<crate::vmm_commands::VmmCommands>,
    /// What snapshots need, when the sandbox allows them.
    snapshots: Option<crate::snapshot::SnapshotSource>,
    /// What the VMM helper's jail holds, as it reported before the VM started.
    isolation: crate::Isolation,
    /// Drains the guest console and the helper's output into bounded logs while the instance
    /// lives.
    _logs: Arc<InstanceLogs>,
    /// Serves the guest's network link while the instance lives (dropping it stops the task).
    network: Option<crate::net::service::NetService>,
    /// Serves the guest's mounts of host filesystems while the instance lives.
    _filesystems: crate::fs::service::FsService,
    /// The instance's share of the process's descriptors and blocking threads.
    budget: Arc<crate::budget::Budget>,
    /// The instance's id (`kb-` and 12 hex digits), in its span and its cgroup's name.
    id: String,
    /// The host's own work before the helper started.
    host_work: Duration,
    /// Held by a pause or a resume while it settles: one at a time. (Holds no data a panic
    /// could leave half-changed: unwind-safe as the rest of `Inner` is.)
    pausing: std::panic::AssertUnwindSafe<tokio::sync::Mutex<()>>,
    /// The `instance` span everything of this instance is traced in (only cloned and entered,
    /// never left half-changed by a panic).
    span: std::panic::AssertUnwindSafe<tracing::Span>,
    /// The helper's and the VMM's cgroup, where the host let one be made (removed when the
    /// instance is dropped).
    cgroup: Option<Arc<crate::cgroup::InstanceCgroup>>,
    /// A copy-on-write root's layer disk and an image build's output disk, served while the
    /// instance lives.
    _served_disks: Vec<rootfs::disk::DiskLink>,
    /// A writable root's layer while the VM runs (the helper holds it too; this one reports
    /// its usage and holds a persistent layer's lock), `None` once the VM has stopped.
    layer: Arc<std::sync::Mutex<Option<rootfs::Layer>>>,
    /// A copy-on-write root's attachment, for the store failures `shutdown` reports.
    /// (In a mutex only to be unwind-safe, as `Inner` must be.)
    cow: std::sync::Mutex<Option<Arc<rootfs::CowLayer>>>,
    dir: dir::InstanceDir,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Instance")
            .field("kernel_release", &self.kernel_release)
            .field("dir", &self.dir.path())
            .finish_non_exhaustive()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing the lifeline (a field) also ends the helper; this makes it immediate.
        let _ = self.kill.send(true);
        self.control.fail_all("the instance was dropped".into());
    }
}

fn tail(dir: &Path) -> String {
    crate::logs::tail(dir, 25)
}

impl Instance {
    /// The VMM helper's confinement: every isolation layer (in force or not, and why) and
    /// the outcome of each canary, as the helper reported them before it started this VM.
    /// Every canary of a running instance was blocked: a boot where one got through fails.
    ///
    /// ```no_run
    /// # async fn demo(vm: krunbox::Instance) {
    /// use krunbox::Layer;
    ///
    /// let isolation = vm.isolation();
    /// if !isolation.is_enforced(Layer::Landlock) {
    ///     eprintln!("no Landlock on this host:\n{isolation}");
    /// }
    /// # }
    /// ```
    pub fn isolation(&self) -> &crate::Isolation {
        &self.inner.isolation
    }

    /// The host address (on `127.0.0.1`) where the guest's TCP `guest_port` is published
    /// ([`Network::publish`](crate::Network::publish)); `None` if it is not.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) {
    /// if let Some(address) = vm.published_address(8000) {
    ///     println!("the guest's server: http://{address}/");
    /// }
    /// # }
    /// ```
    pub fn published_address(&self, guest_port: u16) -> Option<std::net::SocketAddr> {
        self.inner.network.as_ref()?.published_address(guest_port)
    }

    /// The network's audit events from now on: every decision on a flow, every upstream that
    /// could not be reached, every connection to a published port (see
    /// [`NetworkEvent`](crate::net::NetworkEvent)). `None` without a network. A consumer that
    /// falls more than 4096 events behind is told how many it missed.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) {
    /// use tokio::sync::broadcast::error::RecvError;
    ///
    /// let mut events = vm.network_events().expect("a network");
    /// loop {
    ///     match events.recv().await {
    ///         Ok(event) => println!("{event:?}"),
    ///         Err(RecvError::Lagged(missed)) => eprintln!("missed {missed} events"),
    ///         Err(RecvError::Closed) => break,
    ///     }
    /// }
    /// # }
    /// ```
    pub fn network_events(
        &self,
    ) -> Option<tokio::sync::broadcast::Receiver<crate::net::NetworkEvent>> {
        Some(self.inner.network.as_ref()?.events())
    }

    /// Builds a command to run `program` in this VM, with the image's defaults (its
    /// environment, directory and user) and the boot's directory
    /// ([`BootOptions::current_dir`](crate::BootOptions::current_dir)) set; each can be
    /// changed on the command.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let status = vm.command("true").status().await?;
    /// assert!(status.success());
    /// # Ok(()) }
    /// ```
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut command = Command::new(self.inner.clone(), program.as_ref());
        if let Some(config) = &self.inner.image_config {
            for (key, value) in &config.env {
                command.env(key, value);
            }
            if let Some(dir) = &config.working_dir {
                command.current_dir(dir);
            }
            if let Some((uid, gid)) = config.user {
                command.uid(uid).gid(gid);
            }
        }
        if let Some(dir) = &self.inner.current_dir {
            command.current_dir(dir);
        }
        command
    }

    /// The image's entrypoint with its default arguments (its `Entrypoint` then its `Cmd`),
    /// with the image's environment, directory and user (see
    /// [`SandboxBuilder::image_config`](crate::SandboxBuilder::image_config)): what `docker run
    /// IMAGE` runs. Arguments added with [`Command::arg`] come after `Cmd`; to replace `Cmd`, as
    /// `docker run IMAGE ARGS...` does, use [`Instance::entrypoint_with`]. Fails when the
    /// sandbox was given no image configuration, or one with neither.
    ///
    /// ```no_run
    /// # async fn demo(vm: krunbox::Instance) -> krunbox::Result<()> {
    /// let status = vm.entrypoint()?.status().await?;
    /// # let _ = status; Ok(()) }
    /// ```
    pub fn entrypoint(&self) -> Result<Command> {
        let cmd = self
            .inner
            .image_config
            .as_ref()
            .map(|c| c.cmd.clone())
            .unwrap_or_default();
        self.entrypoint_with(cmd)
    }

    /// The image's `Entrypoint` with `args` in place of its `Cmd` (what `docker run IMAGE
    /// ARGS...` runs); without an `Entrypoint`, `args` are the command itself.
    ///
    /// ```no_run
    /// # async fn demo(vm: krunbox::Instance) -> krunbox::Result<()> {
    /// let out = vm.entrypoint_with(["--version"])?.output().await?;
    /// # let _ = out; Ok(()) }
    /// ```
    pub fn entrypoint_with<I, S>(&self, args: I) -> Result<Command>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let entrypoint = self
            .inner
            .image_config
            .as_ref()
            .map(|c| c.entrypoint.clone())
            .unwrap_or_default();
        let mut words = entrypoint
            .into_iter()
            .chain(args.into_iter().map(Into::into));
        let Some(program) = words.next() else {
            return Err(Error::InvalidConfig(
                "the sandbox's image names no entrypoint or command \
                 (SandboxBuilder::image_config), and no arguments were given"
                    .into(),
            ));
        };
        let mut command = self.command(program);
        command.args(words);
        Ok(command)
    }

    /// The guest kernel's release (`uname -r` inside the VM), as reported at boot.
    pub fn kernel_release(&self) -> &str {
        &self.inner.kernel_release
    }

    /// How much of a writable root ([`Rootfs::ephemeral`](crate::Rootfs::ephemeral),
    /// [`Rootfs::persistent`](crate::Rootfs::persistent)) the guest's changes take now on
    /// the host (memory, or the layer file's disk), or, for [`Rootfs::cow`](crate::Rootfs::cow),
    /// the host memory its layer holds (changes not stored yet, and copies of stored blocks;
    /// nothing for a store served in place, whose file holds every change at once);
    /// `None` for a read-only root and once the VM has stopped. It never passes [`RootUsage::max_bytes`](crate::RootUsage::max_bytes).
    ///
    /// ```no_run
    /// # async fn demo(vm: krunbox::Instance) -> krunbox::Result<()> {
    /// if let Some(usage) = vm.root_usage() {
    ///     println!("{} of {} bytes", usage.held_bytes, usage.max_bytes);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn root_usage(&self) -> Option<crate::RootUsage> {
        let layer = self.inner.layer.lock().unwrap_or_else(|e| e.into_inner());
        layer.as_ref().map(|layer| layer.usage())
    }

    /// How this instance's root was given.
    pub(crate) fn root_kind(&self) -> crate::RootKind {
        self.inner.root_kind
    }

    /// Whether this instance's guest has a network device.
    pub(crate) fn has_network(&self) -> bool {
        self.inner.network.is_some()
    }

    /// The instance's id: `kb-` and 12 random hex digits, unique among running instances. Every
    /// `tracing` event of the instance is in a span `instance` with this `id` (its boot, its
    /// processes, files and network flows in spans of their own below it), and its cgroup, where
    /// it has one, is named after it.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) {
    /// assert!(vm.id().starts_with("kb-"));
    /// # }
    /// ```
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The host's own work in this instance's boot before its VMM helper started: finding and
    /// verifying the image, the writable root's layer (an ephemeral root's is formatted for
    /// each boot) or store, the instance's directory, the jail's and the cgroup's preparation. An image is hashed once per state of its file and
    /// sealed (docs/architecture.md, "Boot, step by step"), so this does not grow with the
    /// image's size; the first boot of a new or changed image includes its hash.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) {
    /// println!("host work before the VM started: {:?}", vm.host_boot_work());
    /// # }
    /// ```
    pub fn host_boot_work(&self) -> Duration {
        self.inner.host_work
    }

    /// The instance's `tracing` span: parent of the spans of its processes, files and flows;
    /// callers can enter it, or make their own spans its children.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) {
    /// let _entered = vm.span().enter();
    /// tracing::info!("about to run the agent's step");
    /// # }
    /// ```
    pub fn span(&self) -> &tracing::Span {
        &self.inner.span
    }

    /// What the VM has cost the host since it booted, and holds now: its processes' CPU time,
    /// memory (now and at most), block I/O, the network's totals, the descriptors the host
    /// holds for its guest, the writable root's use. Fails with
    /// [`Error::InstanceGone`] once the VM has stopped.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.command("sh").args(["-c", "head -c 100000000 /dev/zero | sha256sum"]).status().await?;
    /// let metrics = vm.metrics()?;
    /// println!("{:?} of CPU, {} MiB at most", metrics.cpu_time, metrics.memory_peak_bytes >> 20);
    /// # Ok(()) }
    /// ```
    pub fn metrics(&self) -> Result<crate::Metrics> {
        let gone = || Error::InstanceGone {
            reason: "its VMM process has exited: no metrics to read".into(),
        };
        let pid = self.vmm_pid().ok_or_else(gone)?;
        let (figures, source) = match &self.inner.cgroup {
            Some(cgroup) => (cgroup.figures(), crate::MetricsSource::Cgroup),
            None => (
                crate::metrics::of_process(pid),
                crate::MetricsSource::Process,
            ),
        };
        let figures = figures.ok_or_else(gone)?;
        Ok(crate::Metrics {
            cpu_time: figures.cpu_time,
            memory_bytes: figures.memory_bytes,
            memory_peak_bytes: figures.memory_peak_bytes,
            disk_read_bytes: figures.disk_read_bytes,
            disk_written_bytes: figures.disk_written_bytes,
            network: self.inner.network.as_ref().map(|n| n.metrics()),
            host_descriptors: self.inner.budget.descriptors_held() as u64,
            host_descriptors_max: self.inner.budget.max_descriptors() as u64,
            root: self.root_usage(),
            source,
            host_boot_work: self.inner.host_work,
        })
    }

    /// The host pid of the process that runs this VM (for monitoring its CPU and memory), or
    /// `None` once that process has exited or the VM is no longer running
    /// ([`Instance::is_running`] is false). It is `krunbox-vmm`; where the host allows a pid
    /// namespace it is the helper's child, pid 1 in that namespace (see
    /// [`Instance::isolation`]). Like any pid it is a snapshot: the process may exit right
    /// after this returns.
    ///
    /// ```no_run
    /// # async fn demo(vm: krunbox::Instance) {
    /// if let Some(pid) = vm.vmm_pid() {
    ///     let status = std::fs::read_to_string(format!("/proc/{pid}/status"));
    ///     println!("{status:?}");
    /// }
    /// # }
    /// ```
    pub fn vmm_pid(&self) -> Option<u32> {
        // Not only once the supervisor has recorded the exit: a VM declared hung is being
        // killed, and a VM whose process ended is reaped (its pid free for reuse) a while
        // before the supervisor gets there (the console drained, the VMM's last writes
        // waited for).
        if self.is_running() && !self.inner.vmm_process.has_exited() {
            self.inner.vmm_pid
        } else {
            None
        }
    }

    /// Whether the VM is still running. False once it stopped, was shut down, broke the
    /// protocol, or was declared hung by the liveness check
    /// ([`SandboxBuilder::liveness_timeout`](crate::SandboxBuilder::liveness_timeout)).
    pub fn is_running(&self) -> bool {
        self.inner.exited.borrow().is_none() && self.inner.control.gone().is_none()
    }

    /// The protocol violation that stopped this instance, if the guest sent garbage.
    pub fn protocol_violation(&self) -> Option<crate::protocol::ProtocolError> {
        self.inner.protocol_violation()
    }

    /// Asks the guest to sync and power off, and waits for the VM to stop (killing it if it
    /// takes longer than a few seconds). Running processes are ended.
    ///
    /// ```no_run
    /// # async fn demo(vm: krunbox::Instance) -> krunbox::Result<()> {
    /// vm.shutdown().await?;
    /// # Ok(()) }
    /// ```
    pub async fn shutdown(&self) -> Result<()> {
        // A paused guest cannot power off: started again, so it can.
        if self.is_paused() {
            let _ = self.resume().await;
        }
        self.inner.shutdown_requested.store(true, Ordering::SeqCst);
        let _ = self.inner.control.send(&HostMessage::Shutdown);
        let mut exited = self.inner.exited.clone();
        let wait = exited.wait_for(|e| e.is_some());
        if tokio::time::timeout(SHUTDOWN_GRACE, wait).await.is_err() {
            tracing::warn!("guest did not power off in {SHUTDOWN_GRACE:?}; killing the VMM");
            let _ = self.inner.kill.send(true);
            let _ = exited.wait_for(|e| e.is_some()).await;
        }
        // The supervisor stored a copy-on-write root's last blocks before it said "exited".
        let cow = self.inner.cow.lock().unwrap_or_else(|e| e.into_inner());
        match cow.as_ref().and_then(|cow| cow.failure()) {
            Some(failure) => Err(failure),
            None => Ok(()),
        }
    }

    pub(crate) fn control(&self) -> Result<Arc<Control>> {
        self.inner.control()
    }
}

impl Inner {
    fn protocol_violation(&self) -> Option<crate::protocol::ProtocolError> {
        self.control
            .violation
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Processes hold the instance's shared state itself (not an [`Instance`]), so they keep the VM
/// alive exactly as a handle does while naming only what they use.
impl Guest for Inner {
    fn control(&self) -> Result<Arc<Control>> {
        // A hung guest says so, also after its VMM was killed.
        if let Some(hung @ Gone::Hung(_)) = self.control.gone() {
            return Err(hung.error());
        }
        if let Some(reason) = self.exited.borrow().as_ref() {
            return Err(Error::InstanceGone {
                reason: reason.clone(),
            });
        }
        if let Some(err) = self.protocol_violation() {
            return Err(Error::Protocol(err));
        }
        Ok(self.control.clone())
    }

    fn next_process_id(&self) -> u32 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn span(&self) -> tracing::Span {
        self.span.0.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::root::LayerGuard;
    use super::*;
    use crate::logs::BoundedLog;

    /// A boot that fails or is dropped lets a persistent layer's lock go only once every process
    /// holding the helper's log pipe has exited: here a `sleep` stands for a VMM that outlives
    /// its helper (as one in a pid namespace does, dying by `PDEATHSIG`).
    #[tokio::test]
    async fn a_failed_boot_lets_its_layer_go_only_after_the_vmm_exited() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("root.qcow2");
        let base = "ab".repeat(32);
        let (log, write_end) = BoundedLog::vmm(dir.path(), 1 << 20).unwrap();
        let mut vmm = std::process::Command::new("sleep")
            .arg("30")
            .stdout(std::process::Stdio::from(write_end))
            .spawn()
            .expect("sleep");
        let layer = rootfs::PersistentLayer::open(&path, &base).await.unwrap();
        let guard = LayerGuard {
            cow: None,
            layer: Some(rootfs::Layer::Persistent(layer)),
            vmm_gone: Some(log.ended()),
        };
        // The boot fails: its guard and its logs go, the "VMM" lives on.
        drop(guard);
        drop(log);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            matches!(
                rootfs::PersistentLayer::open(&path, &base).await,
                Err(Error::RootInUse { .. })
            ),
            "the layer was let go while the VMM still ran"
        );
        vmm.kill().unwrap();
        vmm.wait().unwrap();
        let started = std::time::Instant::now();
        loop {
            match rootfs::PersistentLayer::open(&path, &base).await {
                Ok(_) => break,
                Err(Error::RootInUse { .. }) if started.elapsed() < Duration::from_secs(10) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(err) => panic!("the layer was not let go after the VMM exited: {err}"),
            }
        }
    }
}
