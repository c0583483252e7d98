//! A running sandbox: boot, supervision of the VMM helper, shutdown.

use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tracing::Instrument;

use crate::config::SandboxConfig;
use crate::control::{self, Control, Gone, Liveness};
use crate::error::{Error, Result};
use crate::helper;
use crate::logs::{BoundedLog, InstanceLogs};
use crate::process::{Command, Guest};
use crate::protocol::{FrameDecoder, HostMessage, LayerDevice, RootMount, Setup, WritableLayer};
use crate::rootfs::{self, Rootfs};
use krunbox_protocol::vmm::{LayerDisk, NetDeviceConfig, ServedDiskConfig, VmmConfig};

/// A boot whose guest prints nothing at all (not even guest-init's first console line) for
/// this long is stuck in early kernel boot; it is killed and retried, up to [`BOOT_ATTEMPTS`]
/// attempts in all, within the overall boot timeout. Seen under nested emulation, about once
/// in a hundred boots, before any krunbox code runs in the guest.
const BOOT_STALL: Duration = Duration::from_secs(45);

/// Boot attempts when the guest stalls before guest-init starts.
const BOOT_ATTEMPTS: u32 = 2;

/// How long the VMM may outlive its guest's control connection before it is killed.
const CLOSED_GRACE: Duration = Duration::from_secs(5);

/// How long [`Instance::shutdown`] waits for the guest to power off before killing the VMM.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

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
    image_config: Option<crate::rootfs::oci::ImageConfig>,
    /// `Some(description)` once the VMM helper has exited.
    exited: watch::Receiver<Option<String>>,
    /// Asks the supervisor task to kill the VMM helper.
    kill: watch::Sender<bool>,
    /// Held so the helper's lifeline pipe stays open while the instance lives.
    _lifeline: OwnedFd,
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
    dir: tempfile::TempDir,
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

/// The error for a helper that exited with [`krunbox_protocol::vmm::ISOLATION_EXIT_CODE`]: it refused to start the
/// VM, and its report says why.
fn isolation_refusal(
    report: Option<crate::Isolation>,
    required: &[crate::Layer],
    tail: String,
) -> Error {
    let Some(isolation) = report else {
        return Error::VmExited {
            status: "the VMM helper refused to start the VM and wrote no isolation report".into(),
            console_tail: tail,
        };
    };
    let breaches = isolation.breaches();
    if breaches.is_empty() {
        Error::IsolationUnavailable {
            missing: isolation.missing(required),
            isolation,
        }
    } else {
        Error::IsolationBreached {
            breaches,
            isolation,
        }
    }
}

pub(crate) async fn boot(config: Arc<SandboxConfig>) -> Result<Instance> {
    // Everything the instance does is traced in its span, which names it: the logs of
    // concurrent sandboxes can be told apart (tasks spawned for it carry the span along).
    let id = new_instance_id();
    let span = tracing::info_span!("instance", id = %id);
    boot_in_span(config, id, span.clone())
        .instrument(span)
        .await
}

/// A new instance's id: `kb-` and 12 random hex digits.
fn new_instance_id() -> String {
    let mut bytes = [0u8; 6];
    let read = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
    if read.is_err() {
        // Unique in this process at least: its pid and a counter.
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        bytes[..4].copy_from_slice(&std::process::id().to_be_bytes());
        bytes[4..].copy_from_slice(&(n as u16).to_be_bytes());
    }
    format!("kb-{}", hex::encode(bytes))
}

async fn boot_in_span(
    config: Arc<SandboxConfig>,
    id: String,
    span: tracing::Span,
) -> Result<Instance> {
    let cache_dir = config.cache_dir.clone();
    let rootfs_def = config.rootfs.clone();
    let image = tokio::task::spawn_blocking(move || {
        let mut progress = |line: &str| tracing::info!(target: "krunbox::image", "{line}");
        let (path, fstype, sha256) = rootfs::resolve(&rootfs_def, &cache_dir, &mut progress)?;
        rootfs::verify(&path, &fstype, &sha256)
    })
    .await
    .map_err(|e| Error::io("verifying the root image")(std::io::Error::other(e)))??;
    tracing::debug!(image = %image.path.display(), sha256 = %image.sha256, "root image verified");

    // A persistent root's layer: opened (made on first use) and locked for this instance, and
    // checked to have been made over this very image.
    let mut persistent = match &config.rootfs {
        Rootfs::Persistent { path, .. } => {
            Some(rootfs::PersistentLayer::open(path, &image.sha256).await?)
        }
        _ => None,
    };
    // A copy-on-write root's store: attached (and its layer made on first use) for this
    // instance; given back when the VM stops, or if the boot fails (the guard, which also holds
    // each attempt's layer until the VMM that may write to it has exited).
    let cow = match config.rootfs.cow_store() {
        Some((store, max_dirty_bytes)) => Some(std::sync::Arc::new(
            store.attach(&image.sha256, max_dirty_bytes).await?,
        )),
        None => None,
    };
    let mut guard = LayerGuard {
        cow: cow.clone(),
        layer: None,
        vmm_gone: None,
    };
    let mut dir = tempfile::Builder::new()
        .prefix("krunbox-")
        .tempdir_in(crate::artifacts::runtime_dir())
        .map_err(Error::io("creating the instance directory"))?;
    // For debugging boots: keep the console and VMM logs after the instance is gone.
    if std::env::var_os("KRUNBOX_KEEP_INSTANCE_DIR").is_some() {
        dir.disable_cleanup(true);
        tracing::info!(dir = %dir.path().display(), "keeping the instance directory");
    }
    let socket = dir.path().join("control.sock");
    let listener =
        UnixListener::bind(&socket).map_err(Error::io(format!("binding {}", socket.display())))?;

    // Host filesystems: a virtio-fs device each in the helper, connected to this service
    // afresh for every boot attempt (guest-init mounts them during setup, before it reports
    // ready). A copy-on-write root's layer disk, or an image build's output disk, is a
    // virtio-blk device after them, served the same way.
    let fs_devices = config.mounts.len() as u32;
    // The instance's share of what all instances of this process share (descriptors held for
    // its guest, blocking threads): its mounts and network draw on it.
    let budget = crate::budget::Budget::new(&config.limits);
    let mut fs_service = crate::fs::service::FsService::new(config.mounts.clone(), budget.clone());
    let mut served_disks: Vec<(rootfs::served::DiskSource, &str)> = Vec::new();
    if let Some(cow) = &cow {
        served_disks.push((cow.source(), krunbox_protocol::LAYER_DISK_SERIAL));
    }
    if let Some(output) = &config.output_disk {
        served_disks.push((output.0.clone(), rootfs::served::OUTPUT_DISK_SERIAL));
    }
    let mut disk_services: Vec<_> = served_disks
        .iter()
        .map(|(disk, _)| rootfs::disk::DiskLink::new(disk))
        .collect();
    let mut jail = crate::jail::host::prepare(dir.path(), &config.required_isolation)?;
    let layer_in_memory = match &config.rootfs {
        Rootfs::Ephemeral {
            max_dirty_bytes, ..
        } => *max_dirty_bytes,
        _ => 0,
    };
    let (cgroup, placement) = crate::cgroup::for_instance(
        &id,
        config.memory_mib,
        layer_in_memory,
        config.limits.host_memory_overhead,
        config.cpus,
    );
    let cgroup = cgroup.map(Arc::new);
    jail.config.cgroup = placement;
    let cgroup_procs = match &cgroup {
        Some(cgroup) => Some(
            cgroup
                .procs()
                .map_err(Error::io("opening the cgroup's procs"))?,
        ),
        None => None,
    };
    let vmm_config = VmmConfig {
        cpus: config.cpus,
        memory_mib: config.memory_mib,
        root_fstype: image.fstype.clone(),
        root_qcow2: image.qcow2,
        root_image: image.path.clone(),
        control_socket: socket.clone(),
        fs_devices,
        guest_memory_file: fs_devices > 0,
        console: dir.path().join(crate::logs::CONSOLE_FIFO),
        jail: jail.config.clone(),
        kernel: config.kernel.clone(),
        log_level: config.vmm_log_level,
        network: config.network.as_ref().map(|n| NetDeviceConfig {
            mac: n.addressing().guest_mac,
        }),
        virtiofs_passthrough: config.virtiofs_passthrough.clone(),
        writable_layer: match &config.rootfs {
            Rootfs::Ephemeral {
                max_dirty_bytes, ..
            } => Some(LayerDisk {
                max_file_bytes: *max_dirty_bytes,
                qcow2: false,
            }),
            Rootfs::Persistent { .. } => Some(LayerDisk {
                max_file_bytes: rootfs::PERSISTENT_LAYER_FILE_BYTES,
                qcow2: true,
            }),
            _ => None,
        },
        served_disks: served_disks
            .iter()
            .map(|(disk, serial)| ServedDiskConfig {
                size: disk.size(),
                serial: (*serial).into(),
                in_place: matches!(disk, rootfs::served::DiskSource::InPlace { .. }),
            })
            .collect(),
    };
    // guest-init reaches the guest as bytes the helper serves from memory, never as a host path.
    let guest_init =
        std::fs::File::open(&config.artifacts.guest_init).map_err(Error::io(format!(
            "opening guest-init {}",
            config.artifacts.guest_init.display()
        )))?;
    let config_path = dir.path().join("vmm.json");
    std::fs::write(
        &config_path,
        serde_json::to_vec_pretty(&vmm_config).expect("VmmConfig serialises"),
    )
    .map_err(Error::io("writing the VMM configuration"))?;
    // Accept the guest's connection and finish the handshake, unless the VM dies or the
    // deadline passes first.
    let deadline = tokio::time::sleep(config.boot_timeout);
    tokio::pin!(deadline);
    // The sandbox CA of this boot, for intercepted HTTPS: the guest is told to trust it.
    let certificate_authority = match &config.network {
        Some(network) => network.certificate_authority(&config.hostname)?,
        None => None,
    };
    let setup = Setup {
        hostname: config.hostname.clone(),
        root: RootMount {
            device: "/dev/vda".into(),
            fstype: vmm_config.root_fstype.clone(),
            read_only: true,
            writable_layer: config.rootfs.is_writable().then(|| WritableLayer {
                device: match &cow {
                    Some(_) => LayerDevice::HostBlock {
                        serial: krunbox_protocol::LAYER_DISK_SERIAL.into(),
                    },
                    None => LayerDevice::Disk("/dev/vdb".into()),
                },
                fstype: rootfs::LAYER_FSTYPE.into(),
            }),
        },
        network: config
            .network
            .as_ref()
            .map(|n| n.guest_config(certificate_authority.as_deref())),
        mounts: config
            .mounts
            .iter()
            .map(|m| krunbox_protocol::GuestMount {
                path: m.guest_path.clone(),
                read_only: m.options.is_read_only(),
            })
            .collect(),
    };
    let console = dir.path().join("console.log");
    let mut attempt = 1;
    let (mut child, lifeline_write, stream, decoder, hello, report, logs, net_socket) = loop {
        // A writable root's layer. An ephemeral one is fresh for every attempt, so a retried
        // boot starts from the image again (formatting it runs mke2fs, off the async threads);
        // a persistent one is opened (and locked) once and handed to each attempt.
        guard.layer = match (config.rootfs.layer_quota(), &cow) {
            (Some(quota), _) => Some(rootfs::Layer::Memory(
                tokio::task::spawn_blocking(move || rootfs::MemoryLayer::create(quota))
                    .await
                    .map_err(|e| Error::WritableLayer(e.to_string()))??,
            )),
            (None, Some(cow)) => Some(rootfs::Layer::Cow(cow.clone())),
            (None, None) => persistent.take().map(rootfs::Layer::Persistent),
        };
        // What the guest and the helper print, each drained into a bounded log.
        let (vmm_log, log) = BoundedLog::vmm(dir.path(), crate::logs::VMM_LOG_MAX)?;
        let logs = InstanceLogs {
            console: BoundedLog::console(dir.path(), config.console_log_max)?,
            vmm: vmm_log,
        };
        guard.vmm_gone = Some(logs.vmm.ended());
        let pipe = || nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC);
        let (lifeline_read, lifeline_write) =
            pipe().map_err(|e| Error::io("creating the lifeline pipe")(e.into()))?;
        let (report_read, report_write) =
            pipe().map_err(|e| Error::io("creating the isolation report pipe")(e.into()))?;
        // The guest's network link: the helper gets one end for libkrun, the library serves
        // the other. A fresh pair per attempt, so a retried boot never sees old frames. A
        // benchmark's backend (passt) gets a fresh connection instead, and we serve nothing.
        let net_pair = match (&config.network, &config.network_backend) {
            (None, _) => None,
            (Some(_), None) => {
                let (ours, helper_end) = std::os::unix::net::UnixStream::pair()
                    .map_err(Error::io("creating the network socket pair"))?;
                Some((Some(ours), helper_end))
            }
            (Some(_), Some(backend)) => Some((
                None,
                std::os::unix::net::UnixStream::connect(backend).map_err(Error::io(format!(
                    "connecting to the network backend {}",
                    backend.display()
                )))?,
            )),
        };
        // The mounts' devices: fresh connections, so a retried boot starts new sessions.
        // The mounts' queues are served here, in the guest's memory (a fresh file for each
        // attempt).
        let (guest_memory, fs_ends) = if fs_devices > 0 {
            let memory = std::sync::Arc::new(
                crate::guest_memory::GuestMemoryFile::create(config.memory_mib)
                    .map_err(Error::io("creating the guest's memory"))?,
            );
            let ends = fs_service
                .connect(memory.clone())
                .map_err(Error::io("connecting the filesystem devices"))?;
            (Some(memory), ends)
        } else {
            (None, Vec::new())
        };
        let disk_ends = disk_services
            .iter_mut()
            .map(|service| service.connect())
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(Error::io("connecting the served disks' devices"))?;
        let mut child = {
            use krunbox_protocol::vmm::Inherited;
            use std::os::fd::AsRawFd;
            let mut handed = vec![
                (image.file.as_raw_fd(), Inherited::RootImage),
                (lifeline_read.as_raw_fd(), Inherited::Lifeline),
                (guest_init.as_raw_fd(), Inherited::GuestInit),
                (report_write.as_raw_fd(), Inherited::Report),
            ];
            if let Some((_, helper_end)) = &net_pair {
                handed.push((helper_end.as_raw_fd(), Inherited::Network));
            }
            if let Some(file) = guard.layer.as_ref().and_then(|layer| layer.file()) {
                handed.push((file.as_raw_fd(), Inherited::WritableLayer));
            }
            if let Some(memory) = &guest_memory {
                handed.push((memory.file().as_raw_fd(), Inherited::GuestMemory));
            }
            for (index, end) in fs_ends.iter().enumerate() {
                handed.push((end.as_raw_fd(), Inherited::FsDevice(index)));
            }
            for (index, (end, failures)) in disk_ends.iter().enumerate() {
                handed.push((end.as_raw_fd(), Inherited::ServedDisk(index)));
                if let Some(failures) = failures {
                    handed.push((failures.as_raw_fd(), Inherited::ServedDiskFailures(index)));
                }
            }
            helper::spawn(
                &config.artifacts.vmm_helper,
                &config.artifacts.libkrunfw_dir,
                &[config_path.as_os_str()],
                &handed,
                log,
                cgroup_procs.as_ref(),
            )?
        };
        drop(lifeline_read);
        drop(report_write);
        drop(fs_ends);
        drop(disk_ends);
        // Only the helper holds its end now: when it exits, the service reads EOF.
        let net_socket = net_pair.and_then(|(ours, _helper_end)| ours.map(OwnedFd::from));
        let report = tokio::spawn(crate::jail::host::read_report(report_read).in_current_span());

        let handshake = async {
            let (mut stream, _) = listener
                .accept()
                .await
                .map_err(Error::io("accepting the guest's control connection"))?;
            let mut decoder = FrameDecoder::new();
            let hello = control::handshake(&mut stream, &mut decoder, setup.clone()).await?;
            Ok::<_, Error>((stream, decoder, hello))
        };
        // guest-init's first act is a line on the console. No console output at all after
        // BOOT_STALL means the guest kernel never got that far.
        let stalled = async {
            let started = tokio::time::Instant::now();
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                if std::fs::metadata(&console).is_ok_and(|m| m.len() > 0) {
                    return std::future::pending::<()>().await;
                }
                if started.elapsed() >= BOOT_STALL {
                    return;
                }
            }
        };
        let mut report = report;
        let outcome = tokio::select! {
            result = handshake => result.map(Some),
            status = child.wait() => {
                logs.settle_after_exit().await;
                match status {
                    Ok(s) if s.code() == Some(krunbox_protocol::vmm::ISOLATION_EXIT_CODE) => {
                        let report = (&mut report).await.ok().flatten();
                        Err(isolation_refusal(
                            report.map(|r| r.isolation),
                            &config.required_isolation,
                            tail(dir.path()),
                        ))
                    }
                    status => Err(Error::VmExited {
                        status: status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()),
                        console_tail: tail(dir.path()),
                    }),
                }
            }
            _ = &mut deadline => {
                logs.settle().await;
                Err(Error::BootTimeout {
                    after: config.boot_timeout,
                    console_tail: tail(dir.path()),
                })
            }
            _ = stalled, if attempt < BOOT_ATTEMPTS => Ok(None),
        };
        match outcome {
            Ok(Some((stream, decoder, hello))) => {
                // The helper wrote its report before it started the VM.
                let report = (&mut report).await.ok().flatten();
                break (
                    child,
                    lifeline_write,
                    stream,
                    decoder,
                    hello,
                    report,
                    logs,
                    net_socket,
                );
            }
            Ok(None) => {
                tracing::warn!(
                    attempt,
                    "the guest kernel showed no sign of life within {BOOT_STALL:?} (guest-init never started); retrying the boot"
                );
                stop_helper(&mut child, &logs).await;
                // The next attempt's VMM gets the persistent layer once this one's is gone.
                vmm_gone(logs.vmm.ended()).await;
                if let Some(rootfs::Layer::Persistent(layer)) = guard.layer.take() {
                    persistent = Some(layer);
                }
                attempt += 1;
            }
            Err(err) => {
                stop_helper(&mut child, &logs).await;
                // A guest that died while the handshake failed explains the failure better.
                return Err(match err {
                    Error::GuestSetup { message } => Error::GuestSetup {
                        message: format!("{message}\n{}", tail(dir.path())),
                    },
                    other => other,
                });
            }
        }
    };
    drop(image);
    drop(listener);
    // The guest's network starts only for a helper whose jail holds.
    let admitted = admit(report, &jail.config).and_then(|(pid, isolation)| {
        let network = match (&config.network, net_socket) {
            (Some(network), Some(socket)) => Some(
                crate::net::service::NetService::start(
                    network,
                    socket,
                    certificate_authority,
                    budget.clone(),
                )
                .map_err(NotAdmitted::Failed)?,
            ),
            _ => None,
        };
        Ok((pid, isolation, network))
    });
    let (vmm_pid, isolation, network) = match admitted {
        Ok(admitted) => admitted,
        Err(why) => {
            stop_helper(&mut child, &logs).await;
            // The tail once the helper is gone and its logs settled: its last words too.
            return Err(why.into_error(&config.required_isolation, tail(dir.path())));
        }
    };
    drop(jail);
    let logs = Arc::new(logs);
    tracing::debug!(kernel = %hello.kernel_release, guest_init = %hello.guest_init, "guest ready");

    // With a pid namespace the VM runs in a child of the helper the library started (`child`):
    // that child is the VMM process; killing `child` ends it too, soon after.
    let vmm_process = Arc::new(helper::VmmProcess::watch(vmm_pid));
    let watched_vmm = vmm_process.clone();
    let vmm_pid = Some(vmm_pid);
    let control = Control::start(
        stream,
        decoder,
        Liveness::new(config.liveness_timeout),
        config.limits,
    );
    let (exited_tx, exited) = watch::channel(None);
    let (kill, mut kill_rx) = watch::channel(false);
    let shutdown_requested = Arc::new(AtomicBool::new(false));
    let requested = shutdown_requested.clone();
    let violated = control.violated.clone();
    let closed = control.closed.clone();
    let hung = control.hung.clone();
    let c = control.clone();
    let dir_path = dir.path().to_path_buf();
    let logs_of_vm = logs.clone();
    // The writable root's layer goes when the VM does (not when the last handle does): a
    // persistent layer's lock must be free for the next boot once this one has shut down, and
    // an ephemeral layer's memory comes back at once.
    // From here the supervisor gives the layer and the store back when the VM stops.
    let layer = Arc::new(std::sync::Mutex::new(guard.disarm()));
    let layer_of_vm = layer.clone();
    let cgroup_of_vm = cgroup.clone();
    tokio::spawn(async move {
        let status = loop {
            tokio::select! {
                status = child.wait() => break status,
                _ = violated.notified() => { let _ = child.start_kill(); }
                // The liveness check gave up on the guest: SIGKILL works on a stopped or
                // spinning helper too.
                _ = hung.notified() => { let _ = child.start_kill(); }
                _ = closed.notified() => {
                    // The guest hung up: normally because the VM is going down. Give the VMM a
                    // moment to exit so its status explains what happened; a VM that keeps
                    // running without its control channel is useless, so then stop it.
                    match tokio::time::timeout(CLOSED_GRACE, child.wait()).await {
                        Ok(status) => break status,
                        Err(_) => { let _ = child.start_kill(); }
                    }
                }
                changed = kill_rx.changed() => {
                    if changed.is_err() || *kill_rx.borrow() {
                        let _ = child.start_kill();
                    }
                }
            }
        };
        // The console's and the helper's last lines may still be in the FIFO and the pipe.
        logs_of_vm.settle_after_exit().await;
        let description = if let Some(hung @ Gone::Hung(_)) = c.gone() {
            // The liveness check killed it: that, not the kill's signal, is the story.
            format!("{hung}\n{}", tail(&dir_path))
        } else {
            match status {
                Ok(_) if requested.load(Ordering::SeqCst) => "the VM was shut down".to_string(),
                Ok(s) if s.success() => {
                    let tail = tail(&dir_path);
                    // libkrun logs this (at info level) when a vCPU exits with KVM_EXIT_SHUTDOWN.
                    let what = if tail.contains("KVM_EXIT_SHUTDOWN") {
                        "the guest CPU triple-faulted (KVM_EXIT_SHUTDOWN): a guest kernel crash, or \
                         a fault of the virtualization underneath (seen under nested emulation)"
                    } else {
                        "the guest stopped the VM (power-off, reset or kernel panic)"
                    };
                    format!("{what}\n{tail}")
                }
                Ok(s) if s.code() == Some(krunbox_protocol::vmm::LIFELINE_EXIT_CODE) => {
                    "the VMM helper exited because its instance handle was dropped".to_string()
                }
                Ok(s) => format!("the VM stopped ({s})\n{}", tail(&dir_path)),
                Err(e) => format!("waiting for the VMM failed: {e}"),
            }
        };
        let description = match cgroup_of_vm.as_ref().map(|c| c.oom_kills()) {
            Some(kills @ 1..) => format!(
                "the instance's cgroup killed its VMM for memory ({kills} OOM kills: the VMM \
                 passed memory.max, the guest's RAM and an overhead); {description}"
            ),
            _ => description,
        };
        c.fail_all(description.clone());
        // The VMM itself may outlive the helper `child` by a moment (killed, it dies by
        // PDEATHSIG): its last writes to the layer land before the layer is let go (a
        // persistent layer's lock, a copy-on-write store's flush and detach).
        if !vmm_process.exited_within(VMM_EXIT_DEADLINE).await {
            tracing::warn!(
                "the VMM process outlived its helper by {VMM_EXIT_DEADLINE:?}; letting its layer go"
            );
        }
        let layer = layer_of_vm.lock().unwrap_or_else(|e| e.into_inner()).take();
        // A copy-on-write layer's last blocks go to its store before anyone hears the VM
        // has stopped (so `shutdown` returns after they are stored).
        if let Some(rootfs::Layer::Cow(cow)) = &layer {
            // The store is the caller's code: a stalled one must not hold `shutdown` forever.
            // In a task of its own: past the deadline it still runs to its end (and detaches
            // the store); only the wait for it stops.
            let finishing = tokio::spawn({
                let cow = cow.clone();
                async move { cow.finish().await }
            }
.in_current_span());
            if tokio::time::timeout(STORE_FINISH_DEADLINE, finishing)
                .await
                .is_err()
            {
                cow.give_up(STORE_FINISH_DEADLINE);
            }
        }
        drop(layer);
        let _ = exited_tx.send(Some(description));
    }
.in_current_span());

    Ok(Instance {
        inner: Arc::new(Inner {
            control,
            vmm_pid,
            vmm_process: std::panic::AssertUnwindSafe(watched_vmm),
            shutdown_requested,
            next_id: AtomicU32::new(1),
            kernel_release: hello.kernel_release,
            image_config: config.image_config.clone(),
            exited,
            kill,
            _lifeline: lifeline_write,
            isolation,
            _logs: logs,
            network,
            _filesystems: fs_service,
            budget,
            id,
            span: std::panic::AssertUnwindSafe(span),
            cgroup,
            _served_disks: disk_services,
            layer,
            cow: std::sync::Mutex::new(cow),
            dir,
        }),
    })
}

/// How long a copy-on-write root's last blocks may take to reach its store when the VM stops.
const STORE_FINISH_DEADLINE: Duration = Duration::from_secs(120);

/// How long the supervisor waits for the VMM process after its helper exited, before it lets
/// go of the root's layer anyway (the VMM dies by `PDEATHSIG` within moments; this bounds a
/// process the kernel cannot kill, one stuck in an uninterruptible write).
const VMM_EXIT_DEADLINE: Duration = Duration::from_secs(30);

/// What a boot that fails or is dropped gives back: a copy-on-write root's store (what is
/// dirty stored, then detached) and the attempt's writable layer (a persistent layer's lock).
/// Both only once the helper and the VMM it started have exited (the end of the helper's log
/// pipe), at most [`VMM_EXIT_DEADLINE`] later: with a pid namespace the VMM dies by
/// `PDEATHSIG` after the helper, and a write of its must not land after the next holder took
/// the layer over.
struct LayerGuard {
    cow: Option<Arc<rootfs::CowLayer>>,
    layer: Option<rootfs::Layer>,
    /// The current attempt's helper log: true once the helper and the VMM have exited.
    vmm_gone: Option<watch::Receiver<bool>>,
}

impl LayerGuard {
    /// The boot succeeded: the layer goes to the supervisor, which gives it and the store back
    /// when the VM stops.
    fn disarm(&mut self) -> Option<rootfs::Layer> {
        self.cow = None;
        self.vmm_gone = None;
        self.layer.take()
    }
}

impl Drop for LayerGuard {
    fn drop(&mut self) {
        let (cow, layer) = (self.cow.take(), self.layer.take());
        if cow.is_none() && layer.is_none() {
            return;
        }
        let gone = self.vmm_gone.take();
        let give_back = async move {
            if let Some(gone) = gone {
                vmm_gone(gone).await;
            }
            drop(layer);
            if let Some(cow) = cow {
                cow.finish().await;
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(give_back);
            }
            // A boot future dropped outside any runtime: nothing can wait; the layer goes now
            // and the store stays attached until the program ends (its lock with it).
            Err(_) => tracing::warn!(
                "a boot was dropped outside a tokio runtime; its layer is let go without waiting for the VMM"
            ),
        }
    }
}

/// Stops a helper whose boot failed, on every failure path alike: kills it, waits for it, and
/// lets its logs settle, so the error's tail holds its last words.
async fn stop_helper(child: &mut tokio::process::Child, logs: &crate::logs::InstanceLogs) {
    let _ = child.start_kill();
    let _ = child.wait().await;
    logs.settle_after_exit().await;
}

/// Why a helper whose guest completed the handshake was not taken into service.
enum NotAdmitted {
    /// It wrote no readable isolation report.
    NoReport,
    /// Its jail does not hold, or lacks a required layer.
    Refused(crate::Isolation),
    /// A service of the instance could not start.
    Failed(Error),
}

impl NotAdmitted {
    /// The error a boot ends with, with the console's tail read once the helper is gone.
    fn into_error(self, required: &[crate::Layer], console_tail: String) -> Error {
        match self {
            NotAdmitted::NoReport => Error::VmExited {
                status: "the VMM helper started the VM without a readable isolation report".into(),
                console_tail,
            },
            NotAdmitted::Refused(isolation) => {
                isolation_refusal(Some(isolation), required, console_tail)
            }
            NotAdmitted::Failed(err) => err,
        }
    }
}

/// Takes a helper whose guest completed the handshake into service, or says why not, by its
/// isolation report (checked here too, so a helper from another build that ignored a
/// requirement cannot slip through). Returns the VMM's pid and the report.
fn admit(
    report: Option<crate::jail::HelperReport>,
    jail: &crate::jail::JailConfig,
) -> std::result::Result<(u32, crate::Isolation), NotAdmitted> {
    let Some(crate::jail::HelperReport { vmm_pid, isolation }) = report else {
        return Err(NotAdmitted::NoReport);
    };
    if crate::jail::refusal(jail, &isolation).is_some() {
        return Err(NotAdmitted::Refused(isolation));
    }
    Ok((vmm_pid, isolation))
}

/// Waits until the helper and the VMM have both exited (`gone`: the helper's log pipe ended),
/// at most [`VMM_EXIT_DEADLINE`], then warns.
async fn vmm_gone(mut gone: watch::Receiver<bool>) {
    if tokio::time::timeout(VMM_EXIT_DEADLINE, gone.wait_for(|ended| *ended))
        .await
        .is_err()
    {
        tracing::warn!(
            "the VMM outlived its helper by {VMM_EXIT_DEADLINE:?}; letting its layer go"
        );
    }
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

    /// Builds a command to run `program` in this VM.
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
    use super::*;

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
