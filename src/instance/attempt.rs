//! One attempt at a boot: the helper started with every part's descriptors, and its guest
//! taken to the end of the handshake, or stopped (killed, waited for, its logs settled) with
//! the reason; a guest that shows no sign of life is given up for another attempt.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tracing::Instrument;

use super::root::{vmm_gone, RootPart};
use super::{admit::isolation_refusal, tail};
use crate::config::SandboxConfig;
use crate::control;
use crate::error::{Error, Result};
use crate::fs::service::FsService;
use crate::helper;
use crate::jail::HelperReport;
use crate::logs::{BoundedLog, InstanceLogs};
use crate::protocol::{FrameDecoder, Hello, Setup};
use crate::rootfs::disk::DiskLink;
use crate::snapshot::memory::InstanceMemory;
use krunbox_protocol::vmm::Inherited;

/// A boot whose guest prints nothing at all (not even guest-init's first console line) for
/// this long is stuck in early kernel boot; it is killed and retried, up to
/// [`super::boot::BOOT_ATTEMPTS`] attempts in all, within the overall boot timeout. Seen under
/// nested emulation, about once in a hundred boots, before any krunbox code runs in the guest.
pub(super) const BOOT_STALL: Duration = Duration::from_secs(45);

/// What stays the same across a boot's attempts.
pub(super) struct Plan<'a> {
    pub config: &'a SandboxConfig,
    /// The instance directory (logs, console, the helper's configuration).
    pub dir: &'a Path,
    pub vmm_config: &'a Path,
    /// Where the guest's control connection arrives.
    pub listener: &'a UnixListener,
    /// What the guest is told in the handshake.
    pub setup: &'a Setup,
    /// guest-init's bytes, handed to the helper as a file, never as a host path.
    pub guest_init: &'a File,
    /// The instance cgroup's `cgroup.procs`, which the helper moves itself into.
    pub cgroup_procs: Option<&'a OwnedFd>,
    /// What this boot restores, if it is a restore.
    pub restore: Option<&'a crate::snapshot::Restore>,
}

/// The parts whose devices are connected afresh for every attempt, so that a retried boot
/// starts new sessions and never sees an earlier attempt's frames.
pub(super) struct Devices<'a> {
    pub root: &'a mut RootPart,
    pub mounts: &'a mut FsService,
    pub disks: &'a mut [DiskLink],
}

/// A helper whose guest completed the handshake.
pub(super) struct Ready {
    pub child: tokio::process::Child,
    /// The helper exits when this closes (the instance holds it).
    pub lifeline: OwnedFd,
    pub stream: tokio::net::UnixStream,
    pub decoder: FrameDecoder,
    pub hello: Hello,
    /// The helper's isolation report, written before it started the VM.
    pub report: Option<HelperReport>,
    pub logs: InstanceLogs,
    /// The library's end of the guest's network link, for the network service.
    pub net_socket: Option<OwnedFd>,
    /// The library's end of the helper's command socket.
    pub commands: Arc<crate::vmm_commands::VmmCommands>,
    /// The guest's memory, when it is in a file of this process's, as snapshots see it.
    pub guest_memory: Option<Arc<InstanceMemory>>,
}

/// How an attempt ended, when it did not fail.
pub(super) enum Attempted {
    Ready(Box<Ready>),
    /// The guest showed no sign of life within [`BOOT_STALL`]: the helper is stopped and its
    /// VMM gone, the next attempt may start.
    Stalled,
}

/// Runs one attempt until the guest completes the handshake, the helper exits, `deadline`
/// passes or (with `may_stall`) the guest stalls. On every way out but `Ready` the helper is
/// stopped first.
pub(super) async fn run(
    plan: &Plan<'_>,
    parts: &mut Devices<'_>,
    deadline: std::pin::Pin<&mut tokio::time::Sleep>,
    may_stall: bool,
) -> Result<Attempted> {
    let config = plan.config;
    parts.root.next_layer(config, plan.restore).await?;
    // What the guest and the helper print, each drained into a bounded log.
    let (vmm_log, log) = BoundedLog::vmm(plan.dir, crate::logs::VMM_LOG_MAX)?;
    let (commands, command_ends) = crate::vmm_commands::VmmCommands::pair()
        .map_err(Error::io("creating the helper's command socket"))?;
    let logs = InstanceLogs {
        console: BoundedLog::console(plan.dir, config.console_log_max)?,
        vmm: vmm_log,
    };
    parts.root.guard.vmm_gone = Some(logs.vmm.ended());
    let pipe = || nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC);
    let (lifeline_read, lifeline) =
        pipe().map_err(|e| Error::io("creating the lifeline pipe")(e.into()))?;
    let (report_read, report_write) =
        pipe().map_err(|e| Error::io("creating the isolation report pipe")(e.into()))?;
    // A restore's helper builds its VM while the snapshot is copied in, until the gate opens
    // (a socket, so that writing to a helper that is gone is an error, not a SIGPIPE).
    let (gate_read, gate) = match plan.restore {
        Some(_) => {
            let (ours, helpers) = std::os::unix::net::UnixStream::pair()
                .map_err(Error::io("creating the restore's gate"))?;
            (Some(OwnedFd::from(helpers)), Some(ours))
        }
        None => (None, None),
    };
    let net_pair = network_link(config)?;
    let (guest_memory, fs_ends) = guest_memory(plan, parts)?;
    let disk_ends = parts
        .disks
        .iter_mut()
        .map(|service| service.connect())
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(Error::io("connecting the served disks' devices"))?;

    let mut handed: Vec<(RawFd, Inherited)> = vec![
        (lifeline_read.as_raw_fd(), Inherited::Lifeline),
        (plan.guest_init.as_raw_fd(), Inherited::GuestInit),
        (report_write.as_raw_fd(), Inherited::Report),
        (command_ends.socket.as_raw_fd(), Inherited::Command),
        (command_ends.state_file.as_raw_fd(), Inherited::MachineState),
    ];
    parts.root.hand_over(&mut handed);
    if let Some((_, helper_end)) = &net_pair {
        handed.push((helper_end.as_raw_fd(), Inherited::Network));
    }
    if let Some(memory) = &guest_memory {
        handed.push((memory.base().as_raw_fd(), Inherited::GuestMemory));
        handed.push((memory.private_pages().as_raw_fd(), Inherited::PrivatePages));
    }
    if let Some(gate_read) = &gate_read {
        handed.push((gate_read.as_raw_fd(), Inherited::RestoreGate));
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
    let mut child = helper::spawn(
        &config.artifacts.vmm_helper,
        &config.artifacts.libkrunfw_dir,
        &[plan.vmm_config.as_os_str()],
        &handed,
        log,
        plan.cgroup_procs,
    )?;
    // Only the helper holds these ends now: when it exits, each service reads EOF.
    drop((
        lifeline_read,
        report_write,
        fs_ends,
        disk_ends,
        command_ends,
        gate_read,
    ));
    let mut deadline = deadline;
    if let (Some(source), Some(gate), Some(memory)) = (plan.restore, gate, &guest_memory) {
        let filling = std::time::Instant::now();
        let layer = parts
            .root
            .guard
            .layer
            .as_ref()
            .and_then(|layer| layer.file());
        let layer = layer
            .map(|file| file.try_clone().map(Arc::new))
            .transpose()
            .map_err(Error::io("opening the writable layer again"))?;
        match fill_from_snapshot(source, memory, layer, &commands).await {
            // A helper gone already (its jail refused, say) reads nothing: the wait for the
            // guest below says why it went.
            Ok(state_len) => open_gate(gate, state_len),
            Err(e) => {
                drop(gate);
                stop_helper(&mut child, &logs).await;
                return Err(e);
            }
        }
        // The boot's time counts from here: a fork's wait for its source's stilling and
        // copy is not its boot's.
        let until = deadline.deadline() + filling.elapsed();
        deadline.as_mut().reset(until);
    }
    let net_socket = net_pair.and_then(|(ours, _helper_end)| ours.map(OwnedFd::from));
    let report = tokio::spawn(crate::jail::host::read_report(report_read).in_current_span());

    let ready = until_ready(plan, &mut child, &logs, report, deadline, may_stall).await;
    if let (Ok(Some(_)), Some(_), Some(memory)) = (&ready, plan.restore, &guest_memory) {
        // A fork's helper laid its source's pages over its memory before its vCPUs ran:
        // kept in its memory now, they need not be kept here too.
        if let Err(e) = memory.forget_private_pages() {
            tracing::warn!("emptying a restore's private-pages file: {e}");
        }
    }
    match ready {
        Ok(Some((stream, decoder, hello, report))) => Ok(Attempted::Ready(Box::new(Ready {
            child,
            lifeline,
            stream,
            decoder,
            hello,
            report,
            logs,
            net_socket,
            commands,
            guest_memory,
        }))),
        Ok(None) => {
            stop_helper(&mut child, &logs).await;
            // The next attempt's VMM gets a persistent layer once this one's is gone.
            vmm_gone(logs.vmm.ended()).await;
            Ok(Attempted::Stalled)
        }
        Err(err) => {
            stop_helper(&mut child, &logs).await;
            // A guest that died while the handshake failed explains the failure better.
            Err(match err {
                Error::GuestSetup { message } => Error::GuestSetup {
                    message: format!("{message}\n{}", tail(plan.dir)),
                },
                other => other,
            })
        }
    }
}

type Handshake = (
    tokio::net::UnixStream,
    FrameDecoder,
    Hello,
    Option<HelperReport>,
);

/// Waits for the first of: the guest's handshake (`Some`), the helper's exit, the deadline
/// (errors), or the guest's stall (`None`, only `may_stall`).
async fn until_ready(
    plan: &Plan<'_>,
    child: &mut tokio::process::Child,
    logs: &InstanceLogs,
    mut report: tokio::task::JoinHandle<Option<HelperReport>>,
    deadline: std::pin::Pin<&mut tokio::time::Sleep>,
    may_stall: bool,
) -> Result<Option<Handshake>> {
    let config = plan.config;
    let handshake = async {
        let (mut stream, _) = plan
            .listener
            .accept()
            .await
            .map_err(Error::io("accepting the guest's control connection"))?;
        let (decoder, hello) = match plan.restore {
            None => {
                let mut decoder = FrameDecoder::new();
                let hello =
                    control::handshake(&mut stream, &mut decoder, plan.setup.clone()).await?;
                (decoder, hello)
            }
            // A restored guest has booted already: it rejoins with its snapshot's token.
            Some(source) => {
                let manifest = &source.manifest;
                let decoder = control::rejoin_handshake(&mut stream, manifest.token).await?;
                let hello = Hello {
                    version: crate::protocol::PROTOCOL_VERSION,
                    guest_init: String::new(),
                    kernel_release: manifest.kernel_release.clone(),
                };
                (decoder, hello)
            }
        };
        Ok::<_, Error>((stream, decoder, hello))
    };
    let console = plan.dir.join("console.log");
    tokio::select! {
        result = handshake => {
            let (stream, decoder, hello) = result?;
            // The helper wrote its report before it started the VM.
            let report = (&mut report).await.ok().flatten();
            Ok(Some((stream, decoder, hello, report)))
        }
        status = child.wait() => {
            logs.settle_after_exit().await;
            match status {
                Ok(s) if s.code() == Some(krunbox_protocol::vmm::ISOLATION_EXIT_CODE) => {
                    let report = (&mut report).await.ok().flatten();
                    Err(isolation_refusal(
                        report.map(|r| r.isolation),
                        &config.required_isolation,
                        tail(plan.dir),
                    ))
                }
                status => Err(Error::VmExited {
                    status: status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()),
                    console_tail: tail(plan.dir),
                }),
            }
        }
        _ = deadline => {
            logs.settle().await;
            Err(Error::BootTimeout {
                after: config.boot_timeout,
                console_tail: tail(plan.dir),
            })
        }
        _ = stalled(&console), if may_stall => Ok(None),
    }
}

/// Returns once [`BOOT_STALL`] passed with nothing on the guest's console (guest-init's first
/// act is a line there: none means the guest kernel never got that far); never otherwise.
async fn stalled(console: &Path) {
    let started = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if std::fs::metadata(console).is_ok_and(|m| m.len() > 0) {
            return std::future::pending::<()>().await;
        }
        if started.elapsed() >= BOOT_STALL {
            return;
        }
    }
}

/// The guest's memory for this attempt, when it is in a file of this process's, and the
/// mounts' ends: a fresh memfd (mapped shared: the mounts' queues are served here, in it), or
/// a restore's file, mapped copy-on-write (a snapshot's `memory.img`, opened here and checked
/// by [`fill_from_snapshot`] while the helper builds its VM; a fork's source's memory).
fn guest_memory(
    plan: &Plan<'_>,
    parts: &mut Devices<'_>,
) -> Result<(Option<Arc<InstanceMemory>>, Vec<OwnedFd>)> {
    let config = plan.config;
    let private = |base| {
        InstanceMemory::new(base, true)
            .map(|memory| (Some(Arc::new(memory)), Vec::new()))
            .map_err(Error::io("creating the guest's private-pages file"))
    };
    match plan.restore.map(|source| (&source.from, &source.manifest)) {
        Some((crate::snapshot::RestoreFrom::Fork { memory, pages, .. }, _)) => {
            let memory = InstanceMemory::with_pages(memory.clone(), true, pages.clone());
            Ok((Some(Arc::new(memory)), Vec::new()))
        }
        Some((crate::snapshot::RestoreFrom::Dir { dir, .. }, manifest)) => {
            let length = crate::guest_memory::GuestMemoryFile::len_for(config.memory_mib);
            if manifest.memory.length != length {
                return Err(Error::Snapshot {
                    step: "restored",
                    reason: format!(
                        "its memory has {} bytes, this VM's {length}",
                        manifest.memory.length
                    ),
                });
            }
            let file = crate::snapshot::part::open(dir, &manifest.memory)
                .map_err(crate::snapshot::part_error)?;
            only_owner_writes(&file, dir)?;
            private(Arc::new(file))
        }
        None if config.mounts.is_empty() && !config.snapshots => Ok((None, Vec::new())),
        None => {
            let memory = Arc::new(
                crate::guest_memory::GuestMemoryFile::create(
                    config.memory_mib,
                    // A fork seals its source's memory against writes once it froze it.
                    match config.snapshots {
                        true => crate::guest_memory::LaterSeals::Write,
                        false => crate::guest_memory::LaterSeals::None,
                    },
                )
                .map_err(Error::io("creating the guest's memory"))?,
            );
            let ends = parts
                .mounts
                .connect(memory.clone())
                .map_err(Error::io("connecting the filesystem devices"))?;
            let memory = InstanceMemory::new(memory.shared_file(), false)
                .map_err(Error::io("creating the guest's private-pages file"))?;
            Ok((Some(Arc::new(memory)), ends))
        }
    }
}

/// Refuses a snapshot's memory file that another user could write: it is mapped, not copied,
/// so a write after the check would reach the guest (its owner's are the documented limit).
fn only_owner_writes(file: &File, dir: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = file
        .metadata()
        .map_err(Error::io("reading the snapshot's memory file"))?;
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if meta.uid() != euid || meta.mode() & 0o022 != 0 {
        return Err(Error::Snapshot {
            step: "restored",
            reason: format!(
                "{} is not this user's alone to write (owner {}, mode {:o}): `chmod go-w` it, or copy the snapshot",
                dir.join(crate::snapshot::MEMORY).display(),
                meta.uid(),
                meta.mode() & 0o7777
            ),
        });
    }
    Ok(())
}

/// Fills a restore's machine-state file and checks its memory (from a snapshot's directory,
/// or once a fork's source has frozen or filled its memory) while its helper builds the VM;
/// returns the state's length, for the gate. A snapshot's memory is checked whole (the VM
/// maps all of it), its state as it is copied: nothing of a changed part runs
/// ([`Error::SnapshotTampered`]: the caller closes the gate unopened, so the helper never
/// loads the state nor starts a vCPU).
async fn fill_from_snapshot(
    source: &crate::snapshot::Restore,
    memory: &Arc<InstanceMemory>,
    layer: Option<Arc<File>>,
    commands: &Arc<crate::vmm_commands::VmmCommands>,
) -> Result<u64> {
    Ok(match &source.from {
        crate::snapshot::RestoreFrom::Dir { dir, seals } => {
            let (dir, seals) = (dir.clone(), seals.clone());
            let manifest = source.manifest.clone();
            let (memory, commands) = (memory.clone(), commands.clone());
            tokio::task::spawn_blocking(move || {
                copy_parts_in(
                    &dir,
                    &seals,
                    &manifest,
                    &memory,
                    layer.as_deref(),
                    &commands,
                )
            })
            .await
            .map_err(|e| Error::Snapshot {
                step: "restored",
                reason: e.to_string(),
            })??;
            source.manifest.machine.length
        }
        crate::snapshot::RestoreFrom::Fork { filled, .. } => {
            let fork = crate::snapshot::Restore::fork_state(filled).await?;
            std::os::unix::fs::FileExt::write_all_at(commands.state_file(), &fork.state, 0)
                .map_err(Error::io("writing the fork's machine state"))?;
            fork.state.len() as u64
        }
    })
}

/// Tells the helper waiting at `gate` that the restore's memory and state are in place, and
/// the state's length. A helper that is gone is not an error here (see the caller).
fn open_gate(gate: std::os::unix::net::UnixStream, state_len: u64) {
    use std::os::fd::AsRawFd;
    let sent = nix::sys::socket::send(
        gate.as_raw_fd(),
        &state_len.to_le_bytes(),
        nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
    );
    // Eight bytes into an empty socket buffer go at once, or the helper is gone.
    if let Err(e) = sent {
        tracing::debug!("the restore's helper did not take its gate: {e}");
    }
}

/// Checks a snapshot's memory (the file `memory` maps) whole and copies its machine state
/// from `dir` into the machine-state file and its layer into `layer` (the attempt's, empty),
/// each checked as it is copied (a part sealed unchanged is not read, see `snapshot::part`).
fn copy_parts_in(
    dir: &std::path::Path,
    seals: &std::path::Path,
    manifest: &crate::snapshot::Manifest,
    memory: &InstanceMemory,
    layer: Option<&File>,
    commands: &crate::vmm_commands::VmmCommands,
) -> Result<()> {
    let max_state = krunbox_protocol::vmm::command::MAX_STATE_BYTES as u64;
    if manifest.machine.length > max_state {
        return Err(Error::Snapshot {
            step: "restored",
            reason: format!(
                "its machine state has {} bytes, more than any ({max_state})",
                manifest.machine.length
            ),
        });
    }
    let memory = crate::snapshot::part::check_whole(memory.base(), &manifest.memory, seals)
        .map_err(crate::snapshot::part_error)?;
    // As long as the part (holes read as zeros), as `part::read` needs.
    commands
        .state_file()
        .set_len(manifest.machine.length)
        .map_err(Error::io("sizing the machine-state file"))?;
    let machine = crate::snapshot::part::read(
        dir,
        &manifest.machine,
        Some(commands.state_file()),
        Some(seals),
    )
    .map_err(crate::snapshot::part_error)?;
    // `check_restorable` matched the layer's presence and size to this sandbox's root.
    let layer = match (&manifest.layer, layer) {
        (Some(part), Some(into)) => Some(
            crate::snapshot::part::read(dir, part, Some(into), Some(seals))
                .map_err(crate::snapshot::part_error)?,
        ),
        _ => None,
    };
    tracing::debug!(
        ?memory,
        ?machine,
        ?layer,
        "the snapshot's parts are checked and copied"
    );
    Ok(())
}

/// The guest's network link, when it has a network: the helper gets one end for libkrun, the
/// library serves the other (`Some(ours)`). A benchmark's backend (passt) gets a fresh
/// connection instead, and the library serves nothing (`None`).
fn network_link(config: &SandboxConfig) -> Result<Option<(Option<UnixStream>, UnixStream)>> {
    Ok(match (&config.network, &config.network_backend) {
        (None, _) => None,
        (Some(_), None) => {
            let (ours, helper_end) =
                UnixStream::pair().map_err(Error::io("creating the network socket pair"))?;
            Some((Some(ours), helper_end))
        }
        (Some(_), Some(backend)) => Some((
            None,
            UnixStream::connect(backend).map_err(Error::io(format!(
                "connecting to the network backend {}",
                backend.display()
            )))?,
        )),
    })
}

/// Stops a helper whose boot failed, on every failure path alike: kills it, waits for it, and
/// lets its logs settle, so the error's tail holds its last words.
pub(super) async fn stop_helper(child: &mut tokio::process::Child, logs: &InstanceLogs) {
    let _ = child.start_kill();
    let _ = child.wait().await;
    logs.settle_after_exit().await;
}
