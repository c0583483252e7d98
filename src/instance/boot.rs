//! Booting an instance, as a pipeline: each part of the sandbox (the root, the mounts, the
//! served disks, the network, the jail and its cgroup) is prepared, contributes its device to
//! the helper's configuration and its part of the guest's setup, and hands over its
//! descriptors for each attempt (`attempt.rs`); once the helper is admitted (`admit.rs`), the
//! network's task starts, and the supervisor (`supervisor.rs`) watches the VM from then on.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::UnixListener;
use tokio::sync::watch;
use tracing::Instrument;

use super::admit::{admit, NotAdmitted};
use super::attempt::{self, stop_helper, Attempted, Devices, Plan, BOOT_STALL};
use super::root::RootPart;
use super::supervisor::Supervisor;
use super::{tail, Inner, Instance};
use crate::config::SandboxConfig;
use crate::control::{Control, Liveness};
use crate::error::{Error, Result};
use crate::fs::service::FsService;
use crate::net::service::NetService;
use crate::net::CertificateAuthority;
use crate::protocol::Setup;
use crate::rootfs::disk::DiskLink;
use crate::rootfs::{self, Rootfs};
use krunbox_protocol::vmm::{NetDeviceConfig, ServedDiskConfig, VmmConfig};

/// Boot attempts when the guest stalls before guest-init starts.
pub(super) const BOOT_ATTEMPTS: u32 = 2;

pub(crate) async fn boot(config: Arc<SandboxConfig>) -> Result<Instance> {
    // Everything the instance does is traced in its span, which names it: the logs of
    // concurrent sandboxes can be told apart (tasks spawned for it carry the span along).
    let id = new_instance_id();
    let span = tracing::info_span!("instance", id = %id);
    boot_in_span(config, id, span.clone(), None)
        .instrument(span)
        .await
}

/// Boots an instance that is `snapshot` restored (see `Sandbox::restore`).
pub(crate) async fn restore(
    config: Arc<SandboxConfig>,
    snapshot: crate::Snapshot,
) -> Result<Instance> {
    let id = new_instance_id();
    let span = tracing::info_span!("instance", id = %id, restored = %snapshot.digest());
    let source = crate::snapshot::Restore::of(&snapshot);
    boot_in_span(config, id, span.clone(), Some(source))
        .instrument(span)
        .await
}

/// Boots an instance from `source` (a snapshot's or a fork's source's memory and state).
pub(crate) async fn restore_from(
    config: Arc<SandboxConfig>,
    source: crate::snapshot::Restore,
) -> Result<Instance> {
    let id = new_instance_id();
    let span = tracing::info_span!("instance", id = %id, forked = true);
    boot_in_span(config, id, span.clone(), Some(source))
        .instrument(span)
        .await
}

/// `config` with the secrets' placeholders a restored guest's environment holds (its
/// source's), so that its network service swaps those for the secrets.
fn with_saved_placeholders(
    config: Arc<SandboxConfig>,
    saved: &crate::snapshot::NetworkState,
) -> Arc<SandboxConfig> {
    match &config.network {
        Some(network) if !saved.placeholders.is_empty() => {
            let mut changed = (*config).clone();
            changed.network = Some(network.with_placeholders(&saved.placeholders));
            Arc::new(changed)
        }
        _ => config,
    }
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
    restore: Option<crate::snapshot::Restore>,
) -> Result<Instance> {
    let preparing = std::time::Instant::now();
    let config = match restore.as_ref().and_then(|r| r.manifest.network.as_ref()) {
        Some(saved) => with_saved_placeholders(config, saved),
        None => config,
    };
    let saved_ca = restore
        .as_ref()
        .and_then(|r| r.manifest.network.as_ref())
        .and_then(|network| network.ca.as_ref());
    let mut parts = Parts::prepare(&config, &id, saved_ca).await?;
    let mut vmm_config = parts.vmm_config(&config);
    if let Some(source) = &restore {
        check_restorable(&config, &source.manifest, &parts.root.image.sha256)?;
        vmm_config.guest_memory_file = true;
        vmm_config.guest_memory_private = true;
        vmm_config.restore = true;
    }
    let setup = parts.guest_setup(&config);
    let prepared = preparing.elapsed();
    tracing::debug!(
        ?prepared,
        "the boot's parts are prepared; starting the helper"
    );
    let mut ready = parts
        .start_helper(&config, &vmm_config, &setup, restore.as_ref())
        .await?;
    let host_work = prepared + parts.root.layer_work;
    let admitted = match parts.admit(&config, &mut ready) {
        Ok(admitted) => admitted,
        Err(why) => {
            stop_helper(&mut ready.child, &ready.logs).await;
            // The tail once the helper is gone and its logs settled: its last words too.
            return Err(why.into_error(&config.required_isolation, tail(parts.dir.path())));
        }
    };
    tracing::debug!(kernel = %ready.hello.kernel_release, guest_init = %ready.hello.guest_init, "guest ready");
    let (next_id, adopt) = restore
        .as_ref()
        .map_or((1, Vec::new()), |source| source.adoption());
    Ok(parts.into_instance(
        &config,
        *ready,
        admitted,
        Identity {
            id,
            span,
            host_work,
            next_id,
            adopt,
            definition: config.clone(),
        },
    ))
}

/// Whether `snapshot` can be restored as an instance of `config`, whose image has
/// `image_sha256`: the same image, vCPUs and memory, and nothing outside guest memory that
/// a snapshot does not keep yet.
fn check_restorable(
    config: &SandboxConfig,
    manifest: &crate::snapshot::Manifest,
    image_sha256: &str,
) -> Result<()> {
    let refuse = |reason: String| Error::Snapshot {
        step: "restored",
        reason,
    };
    if let Some(why) = unsupported(config) {
        return Err(refuse(format!("this sandbox cannot restore one: {why}")));
    }
    if (manifest.cpus, manifest.memory_mib) != (config.cpus, config.memory_mib) {
        return Err(refuse(format!(
            "it was taken with {} vCPUs and {} MiB, this sandbox has {} and {} MiB",
            manifest.cpus, manifest.memory_mib, config.cpus, config.memory_mib
        )));
    }
    if manifest.network.is_some() != config.network.is_some() {
        let has = |network: bool| if network { "a network" } else { "no network" };
        return Err(refuse(format!(
            "it was taken with {}, this sandbox has {}",
            has(manifest.network.is_some()),
            has(config.network.is_some())
        )));
    }
    let layer_bytes = config.rootfs.layer_quota().map(|quota| quota & !4095);
    if manifest.layer.as_ref().map(|layer| layer.length) != layer_bytes {
        let had = |bytes: Option<u64>| match bytes {
            Some(bytes) => format!("an ephemeral root of {} MiB", bytes >> 20),
            None => "no writable root".to_owned(),
        };
        return Err(refuse(format!(
            "it was taken with {}, this sandbox has {}",
            had(manifest.layer.as_ref().map(|layer| layer.length)),
            had(layer_bytes)
        )));
    }
    if manifest.processes.len() > config.limits.max_processes {
        return Err(refuse(format!(
            "it holds {} processes, past this sandbox's max_processes ({})",
            manifest.processes.len(),
            config.limits.max_processes
        )));
    }
    if manifest.krunbox != env!("CARGO_PKG_VERSION") {
        return Err(refuse(format!(
            "krunbox {} wrote it; this is krunbox {}",
            manifest.krunbox,
            env!("CARGO_PKG_VERSION")
        )));
    }
    if manifest.guest_init_sha256 != super::snapshot::guest_init_sha256(config)? {
        return Err(refuse(
            "it was taken with another guest-init than this sandbox boots".into(),
        ));
    }
    if manifest.image_sha256 != image_sha256 {
        return Err(refuse(format!(
            "it was taken with the image sha256:{}, this sandbox boots sha256:{image_sha256}",
            manifest.image_sha256
        )));
    }
    Ok(())
}

/// The parts of a sandbox a boot wires together, once each is prepared. (Fields drop in
/// order, as a failed boot lets them go: the services first, the root's layer last, once the
/// VMM that may write to it is gone.)
struct Parts {
    /// The sandbox CA of this boot, for intercepted HTTPS (the guest is told to trust it).
    certificate_authority: Option<Arc<CertificateAuthority>>,
    cgroup_procs: Option<OwnedFd>,
    cgroup: Option<Arc<crate::cgroup::InstanceCgroup>>,
    /// The jail's configuration and the canaries' targets (held until the helper is admitted).
    jail: Option<crate::jail::host::JailHost>,
    disks: Vec<DiskLink>,
    /// A copy-on-write root's layer disk and an image build's output disk, with their serials.
    served_disks: Vec<(rootfs::served::DiskSource, &'static str)>,
    /// The mounts of host filesystems, served in this process.
    mounts: FsService,
    /// The instance's share of what this process's instances share.
    budget: Arc<crate::budget::Budget>,
    /// Where the guest's control connection arrives (until it has).
    listener: Option<UnixListener>,
    /// The instance's directory: the control socket, the console, the logs.
    dir: super::dir::InstanceDir,
    /// The verified image and the writable root's layer.
    root: RootPart,
    /// What snapshots of the instance carry for its guest's network.
    network_state: Option<crate::snapshot::NetworkState>,
}

impl Parts {
    /// Each part prepared, checking what it can before anything starts. `saved_ca`: the
    /// sandbox CA a restored guest trusts (its source's), instead of a new one.
    async fn prepare(
        config: &SandboxConfig,
        id: &str,
        saved_ca: Option<&crate::net::SavedCa>,
    ) -> Result<Parts> {
        let start = std::time::Instant::now();
        let root = RootPart::prepare(config).await?;
        let root_ready = start.elapsed();
        let dir = super::dir::InstanceDir::create().await?;
        let dir_ready = start.elapsed();
        let socket = dir.path().join(CONTROL_SOCKET);
        let listener = UnixListener::bind(&socket)
            .map_err(Error::io(format!("binding {}", socket.display())))?;
        // Descriptors held for the guest and blocking threads: its mounts and network draw on it.
        let budget = crate::budget::Budget::new(&config.limits);
        let mounts = FsService::new(config.mounts.clone(), budget.clone());
        // A virtio-blk device each, after the mounts' devices.
        let served_disks: Vec<_> = root
            .served_disk()
            .map(|disk| (disk, krunbox_protocol::LAYER_DISK_SERIAL))
            .into_iter()
            .chain(
                config
                    .output_disk
                    .as_ref()
                    .map(|output| (output.0.clone(), rootfs::served::OUTPUT_DISK_SERIAL)),
            )
            .collect();
        let disks = served_disks
            .iter()
            .map(|(disk, _)| DiskLink::new(disk))
            .collect();
        let mut jail = crate::jail::host::prepare(dir.path(), &config.required_isolation)?;
        let (cgroup, placement) = crate::cgroup::for_instance(
            id,
            config.memory_mib,
            match &config.rootfs {
                Rootfs::Ephemeral {
                    max_dirty_bytes, ..
                } => *max_dirty_bytes,
                _ => 0,
            },
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
        let certificate_authority = match (&config.network, saved_ca) {
            (Some(_), Some(saved)) => Some(Arc::new(crate::net::intercept_ca_from_saved(saved)?)),
            (Some(network), None) => network.certificate_authority(&config.hostname)?,
            (None, _) => None,
        };
        // What its snapshots must carry for the guest's network (see `NetworkState`).
        let network_state = match &config.network {
            Some(network) if config.snapshots => Some(crate::snapshot::NetworkState {
                ca: certificate_authority.as_ref().map(|ca| ca.saved()),
                placeholders: network
                    .secrets()
                    .iter()
                    .map(|s| (s.env_var().to_owned(), s.placeholder().to_owned()))
                    .collect(),
            }),
            _ => None,
        };
        tracing::debug!(?root_ready, ?dir_ready, all = ?start.elapsed(), "parts prepared");
        Ok(Parts {
            network_state,
            root,
            dir,
            listener: Some(listener),
            budget,
            mounts,
            served_disks,
            disks,
            jail: Some(jail),
            cgroup,
            cgroup_procs,
            certificate_authority,
        })
    }

    /// What each part asks of the helper: its devices, its jail.
    fn vmm_config(&self, config: &SandboxConfig) -> VmmConfig {
        let image = &self.root.image;
        VmmConfig {
            cpus: config.cpus,
            memory_mib: config.memory_mib,
            root_fstype: image.fstype.clone(),
            root_qcow2: image.qcow2,
            root_image: image.path.clone(),
            control_socket: self.dir.path().join(CONTROL_SOCKET),
            fs_devices: config.mounts.len() as u32,
            guest_memory_file: !config.mounts.is_empty() || config.snapshots,
            guest_memory_private: false,
            command_socket: true,
            restore: false,
            console: self.dir.path().join(crate::logs::CONSOLE_FIFO),
            jail: self
                .jail
                .as_ref()
                .expect("held until admitted")
                .config
                .clone(),
            kernel: config.kernel.clone(),
            log_level: config.vmm_log_level,
            network: config.network.as_ref().map(|n| NetDeviceConfig {
                mac: n.addressing().guest_mac,
            }),
            virtiofs_passthrough: config.virtiofs_passthrough.clone(),
            writable_layer: RootPart::layer_disk(config),
            served_disks: self
                .served_disks
                .iter()
                .map(|(disk, serial)| ServedDiskConfig {
                    size: disk.size(),
                    serial: (*serial).into(),
                    in_place: matches!(disk, rootfs::served::DiskSource::InPlace { .. }),
                })
                .collect(),
        }
    }

    /// What each part asks of the guest: how to mount its root and its mounts, its network.
    fn guest_setup(&self, config: &SandboxConfig) -> Setup {
        Setup {
            hostname: config.hostname.clone(),
            root: self.root.guest_mount(config),
            network: config
                .network
                .as_ref()
                .map(|n| n.guest_config(self.certificate_authority.as_deref())),
            mounts: config
                .mounts
                .iter()
                .map(|m| krunbox_protocol::GuestMount {
                    path: m.guest_path.clone(),
                    read_only: m.options.is_read_only(),
                })
                .collect(),
        }
    }

    /// The helper, started until its guest completes the handshake, within the boot timeout;
    /// a guest that stalls before guest-init starts is given up for another attempt.
    async fn start_helper(
        &mut self,
        config: &SandboxConfig,
        vmm_config: &VmmConfig,
        setup: &Setup,
        restore: Option<&crate::snapshot::Restore>,
    ) -> Result<Box<attempt::Ready>> {
        let vmm_config_path = self.dir.path().join("vmm.json");
        std::fs::write(
            &vmm_config_path,
            serde_json::to_vec_pretty(vmm_config).expect("VmmConfig serialises"),
        )
        .map_err(Error::io("writing the VMM configuration"))?;
        // guest-init reaches the guest as bytes the helper serves from memory, never as a
        // host path.
        let guest_init =
            std::fs::File::open(&config.artifacts.guest_init).map_err(Error::io(format!(
                "opening guest-init {}",
                config.artifacts.guest_init.display()
            )))?;
        let listener = self.listener.take().expect("one start per boot");
        let plan = Plan {
            config,
            dir: self.dir.path(),
            vmm_config: &vmm_config_path,
            listener: &listener,
            setup,
            guest_init: &guest_init,
            cgroup_procs: self.cgroup_procs.as_ref(),
            restore,
        };
        let deadline = tokio::time::sleep(config.boot_timeout);
        tokio::pin!(deadline);
        let mut attempt = 1;
        loop {
            let mut devices = Devices {
                root: &mut self.root,
                mounts: &mut self.mounts,
                disks: &mut self.disks,
            };
            // A restored guest prints nothing on its console: no sign of life to wait for.
            let may_stall = attempt < BOOT_ATTEMPTS && restore.is_none();
            match attempt::run(&plan, &mut devices, deadline.as_mut(), may_stall).await? {
                Attempted::Ready(ready) => return Ok(ready),
                Attempted::Stalled => {
                    tracing::warn!(
                        attempt,
                        "the guest kernel showed no sign of life within {BOOT_STALL:?} (guest-init never started); retrying the boot"
                    );
                    self.root.attempt_abandoned();
                    attempt += 1;
                }
            }
        }
    }

    /// Takes the helper into service if its jail holds, and only then starts the guest's
    /// network: the VMM's pid, the jail's report and the network service.
    fn admit(
        &mut self,
        config: &SandboxConfig,
        ready: &mut attempt::Ready,
    ) -> std::result::Result<Admitted, NotAdmitted> {
        let jail = self.jail.take().expect("held until admitted");
        let (pid, isolation) = admit(ready.report.take(), &jail.config)?;
        let network = match (&config.network, ready.net_socket.take()) {
            (Some(network), Some(socket)) => Some(
                NetService::start(
                    network,
                    socket,
                    self.certificate_authority.take(),
                    self.budget.clone(),
                )
                .map_err(NotAdmitted::Failed)?,
            ),
            _ => None,
        };
        Ok(Admitted {
            vmm_pid: pid,
            isolation,
            network,
        })
    }

    /// The running instance: its control channel, the supervisor that watches its helper, and
    /// every part's service held for as long as it lives.
    fn into_instance(
        mut self,
        config: &SandboxConfig,
        ready: attempt::Ready,
        admitted: Admitted,
        identity: Identity,
    ) -> Instance {
        let Identity {
            id,
            span,
            host_work,
            next_id,
            adopt,
            definition,
        } = identity;
        let Admitted {
            vmm_pid,
            isolation,
            network,
        } = admitted;
        let logs = Arc::new(ready.logs);
        // With a pid namespace the VM runs in a child of the helper the library started
        // (`ready.child`): that child is the VMM process; killing the helper ends it too.
        let vmm_process = Arc::new(crate::helper::VmmProcess::watch(vmm_pid));
        let control = Control::start_adopting(
            ready.stream,
            ready.decoder,
            Liveness::new(config.liveness_timeout),
            config.limits,
            &adopt,
        );
        let (exited_tx, exited) = watch::channel(None);
        let (kill, kill_rx) = watch::channel(false);
        let shutdown_requested = Arc::new(AtomicBool::new(false));
        // The writable root's layer goes when the VM does (not when the last handle does): a
        // persistent layer's lock must be free for the next boot once this one has shut down,
        // and an ephemeral layer's memory comes back at once. From here the supervisor gives
        // the layer and the store back when the VM stops.
        let layer = Arc::new(Mutex::new(self.root.guard.disarm()));
        tokio::spawn(
            Supervisor {
                child: ready.child,
                control: control.clone(),
                kill: kill_rx,
                shutdown_requested: shutdown_requested.clone(),
                dir: self.dir.path().to_path_buf(),
                logs: logs.clone(),
                cgroup: self.cgroup.clone(),
                vmm_process: vmm_process.clone(),
                layer: layer.clone(),
                exited: exited_tx,
            }
            .run()
            .in_current_span(),
        );
        Instance {
            inner: Arc::new(Inner {
                control,
                vmm_pid: Some(vmm_pid),
                vmm_process: std::panic::AssertUnwindSafe(vmm_process),
                shutdown_requested,
                next_id: AtomicU32::new(next_id),
                kernel_release: ready.hello.kernel_release,
                image_config: config.image_config.clone(),
                current_dir: config.current_dir.clone(),
                root_kind: crate::RootKind::of(&config.rootfs),
                exited,
                kill,
                _lifeline: ready.lifeline,
                commands: ready.commands,
                snapshots: snapshot_source(
                    definition,
                    ready.guest_memory,
                    &self.root.image.sha256,
                    self.network_state.take(),
                ),
                isolation,
                _logs: logs,
                network,
                _filesystems: self.mounts,
                budget: self.budget,
                id,
                host_work,
                pausing: std::panic::AssertUnwindSafe(tokio::sync::Mutex::new(())),
                span: std::panic::AssertUnwindSafe(span),
                cgroup: self.cgroup,
                _served_disks: self.disks,
                layer,
                cow: std::sync::Mutex::new(self.root.cow.take()),
                dir: self.dir,
            }),
        }
    }
}

/// Who a new instance is: its id, its span, and what its boot cost the host.
struct Identity {
    id: String,
    span: tracing::Span,
    /// The host's own work before the helper started (see [`Instance::host_boot_work`]).
    host_work: std::time::Duration,
    /// The first process id it gives (a restored instance goes on from its snapshot's).
    next_id: u32,
    /// A restored instance's processes, which it takes over.
    adopt: Vec<crate::control::SavedProcess>,
    /// The definition it was booted from (a fork restores more of it).
    definition: Arc<SandboxConfig>,
}

/// A helper taken into service.
struct Admitted {
    vmm_pid: u32,
    /// What its jail holds, as it reported before the VM started.
    isolation: crate::Isolation,
    /// The guest's network, started once the helper was admitted.
    network: Option<NetService>,
}

/// The control socket's name in the instance's directory.
const CONTROL_SOCKET: &str = "control.sock";

/// What an instance of `config` keeps to take snapshots, when its sandbox allows them.
fn snapshot_source(
    config: Arc<SandboxConfig>,
    memory: Option<Arc<crate::snapshot::memory::InstanceMemory>>,
    image_sha256: &str,
    network: Option<crate::snapshot::NetworkState>,
) -> Option<crate::snapshot::SnapshotSource> {
    let memory = memory.filter(|_| config.snapshots)?;
    Some(crate::snapshot::SnapshotSource {
        memory,
        network,
        cpus: config.cpus,
        memory_mib: config.memory_mib,
        image_sha256: image_sha256.to_owned(),
        key_dir: config.snapshot_key_dir.clone(),
        unsupported: unsupported(&config).map(str::to_owned),
        definition: std::panic::AssertUnwindSafe(config),
    })
}

/// Why an instance of `config` cannot be snapshotted or restored yet, if it cannot: what
/// stage 1 of docs/snapshots-plan.md leaves out, state held outside the VM's memory.
fn unsupported(config: &SandboxConfig) -> Option<&'static str> {
    if !config.mounts.is_empty() {
        Some("it has mounts (their servers' state is in this process)")
    } else if config.network_backend.is_some() {
        Some("its network is a benchmark's backend, outside this process")
    } else if !matches!(
        crate::RootKind::of(&config.rootfs),
        crate::RootKind::Image | crate::RootKind::Ephemeral
    ) {
        Some("its root keeps its changes (a copy-on-write or persistent layer outlives it)")
    } else if config.output_disk.is_some() || config.virtiofs_passthrough.is_some() {
        Some("it has a disk or share served outside guest memory")
    } else {
        None
    }
}
