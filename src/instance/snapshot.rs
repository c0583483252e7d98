//! Taking a snapshot of a running instance (docs/snapshots-plan.md, "Order of operations").
//!
//! The instance is stilled in steps, each undone in reverse whatever happens: new work is
//! refused and the control channel quiesced (nothing in flight either way); the vCPUs are
//! paused and the devices given a moment to answer every request already made (then each
//! queue's position is its used ring's index); the helper saves the VM's KVM state and its
//! devices' transports; the whole VMM is stopped while guest memory is copied, so no device
//! writes into it meanwhile. Then everything runs again, and the guest sets its clock.

use std::time::{Duration, Instant};

use krunbox_protocol::vmm::command::{VmmCommand, VmmReply};

use super::machine::{random_token, QUIESCE_DEADLINE};
use super::Instance;
use crate::error::{Error, Result};
use std::sync::Arc;
use tracing::Instrument;

use crate::snapshot::memory::InstanceMemory;
use crate::snapshot::{self, Manifest, Snapshot, SnapshotKey, Staging};

/// How long the devices may take to answer the requests made before the vCPUs paused.
const DRAIN_DEADLINE: Duration = Duration::from_secs(5);

/// How often the helper is asked whether they have.
const DRAIN_POLL: Duration = Duration::from_millis(5);

impl Instance {
    /// Takes a snapshot of the running instance into the new directory `dir`: its guest
    /// memory, the state of its VM, vCPUs and devices, an ephemeral root's layer, checked
    /// whole by [`Snapshot::open`]. The instance is stilled meanwhile (new commands and file
    /// operations fail with [`Error::Paused`]; running processes wait) and goes on
    /// afterwards. Needs a sandbox built with [`snapshots(true)`](crate::SandboxBuilder::snapshots),
    /// an image or ephemeral root and no mounts (for now). A network's open connections do
    /// not come along: a restore or fork has a network service of its own, its sandbox's
    /// policy deciding each flow its guest starts, and the guest's old connections are reset.
    /// [`Sandbox::restore`](crate::Sandbox::restore) brings a snapshot back.
    ///
    /// ```no_run
    /// # async fn demo() -> krunbox::Result<()> {
    /// let sandbox = krunbox::Sandbox::builder().snapshots(true).build()?;
    /// let vm = sandbox.boot().await?;
    /// vm.command("sh").args(["-c", "echo ready > /tmp/state"]).status().await?;
    /// let snapshot = vm.snapshot("/var/tmp/ready").await?;
    /// println!("{}", snapshot.digest());
    /// # Ok(()) }
    /// ```
    pub async fn snapshot(&self, dir: impl AsRef<std::path::Path>) -> Result<Snapshot> {
        let source = self.snapshot_source()?;
        let key = SnapshotKey::load_or_create(&source.key_dir).map_err(Error::io(format!(
            "making the snapshot key in {}",
            source.key_dir.display()
        )))?;
        let staging = Staging::new(dir.as_ref())?;
        let token = random_token();
        let one_at_a_time = source.memory.one_at_a_time().await;
        let layer = self.memory_layer()?;
        let (memory, dir) = (source.memory.clone(), staging.path().to_path_buf());
        let (parts, _, processes) = self
            .stilled(token, Freeze::No, one_at_a_time, move |state| async move {
                let parts = copy_parts(memory, layer, dir, state).await?;
                Ok((parts, Vec::new()))
            })
            .await?;
        // Sealed once the source runs again (a seal may wait for a clock tick).
        let seals = snapshot::seals_dir(&source.key_dir);
        for (part, file) in parts.iter().flatten() {
            snapshot::part::seal(file, part, &seals);
        }
        let [memory, machine, layer] = parts.map(|part| part.map(|(part, _)| part));
        let (Some(memory), Some(machine)) = (memory, machine) else {
            unreachable!("copy_parts writes memory and machine state always")
        };
        let manifest = self.manifest(source, token, processes, memory, machine, layer)?;
        let digest = Snapshot::sign(staging.path(), manifest, &key)?;
        let dir = staging.finish()?;
        tracing::info!(dir = %dir.display(), %digest, "snapshot taken");
        Snapshot::open(&dir, &source.key_dir)
    }

    /// Forks the running instance into `n` new ones: each starts where this one is now (its
    /// processes, which each fork [`attach`](Self::attach)es, its files in memory, its
    /// shell variables) and goes its own way from there, as this one does. Nothing goes to
    /// disk and nothing is copied: this instance is stilled as for a
    /// [`snapshot`](Self::snapshot) (the same scope) while its memory is frozen as it is,
    /// and it and every fork map that memory copy-on-write (a page is copied only for the
    /// one that writes it); the forks' VMs are built meanwhile. (An instance that is itself
    /// a fork or a restore has its memory merged into one file for its forks first.) All or
    /// none: if one fork fails, those that started are stopped.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.command("sh").args(["-c", "echo base > /tmp/state"]).status().await?;
    /// let forks = vm.fork(2).await?;
    /// for (i, fork) in forks.iter().enumerate() {
    ///     fork.command("sh").args(["-c", &format!("echo {i} >> /tmp/state")]).status().await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn fork(&self, n: usize) -> Result<Vec<Instance>> {
        if n == 0 || n > crate::MAX_POOL_SIZE {
            return Err(Error::InvalidConfig(format!(
                "a fork makes 1 to {} instances, not {n}",
                crate::MAX_POOL_SIZE
            )));
        }
        let source = self.snapshot_source()?;
        let fixed_ports = source
            .definition
            .network
            .as_ref()
            .map_or(Vec::new(), |network| {
                network
                    .published()
                    .iter()
                    .filter(|port| port.host_port != 0)
                    .map(|port| port.host_port)
                    .collect()
            });
        if !fixed_ports.is_empty() {
            return Err(Error::InvalidConfig(format!(
                "this instance publishes fixed host ports {fixed_ports:?}, which its forks cannot \
                 also listen on: publish with host port 0 (any free port) to fork it"
            )));
        }
        let token = random_token();
        let one_at_a_time = source.memory.one_at_a_time().await;
        // Memory mapped shared is frozen in place; memory mapped copy-on-write already keeps
        // its file as it is (made sure of: the forks share it), and its own pages are laid
        // over that file in each fork.
        let freeze = match source.memory.is_private() {
            false => Freeze::InPlace,
            true => {
                source.memory.ensure_frozen().map_err(|e| Error::Snapshot {
                    step: "frozen",
                    reason: format!("the memory its forks would share can be written: {e}"),
                })?;
                Freeze::No
            }
        };
        let layer = self.memory_layer()?;
        let copies = ForkCopies::make(n, &source.memory, layer.as_ref())?;
        let manifest = self.fork_manifest(source, token, layer.as_ref())?;
        // Each fork's helper jails itself and builds its VM while this one is stilled; the
        // forks' guests run once it is.
        let (filled, filled_rx) = tokio::sync::watch::channel(None);
        let definition = source.definition.0.clone();
        let boots: Vec<_> = (0..n)
            .map(|i| {
                let restore = snapshot::Restore {
                    manifest: manifest.clone(),
                    from: snapshot::RestoreFrom::Fork {
                        memory: source.memory.base().clone(),
                        pages: copies.pages[i].clone(),
                        layer: copies.layers[i].clone(),
                        filled: filled_rx.clone(),
                    },
                };
                super::restore_from(definition.clone(), restore)
            })
            .collect();
        let memory = source.memory.clone();
        let copy_and_tell = async move {
            // Nothing of memory is copied but the source's own pages, if it has any; its
            // ephemeral layer is (a memfd cannot share another's pages).
            let stilled = self
                .stilled(token, freeze, one_at_a_time, move |state| async move {
                    tokio::task::spawn_blocking(move || copies.fill(&memory, layer.as_ref()))
                        .await
                        .map_err(|e| Error::Snapshot {
                            step: "copied",
                            reason: e.to_string(),
                        })?
                        .map_err(Error::io(
                            "copying the source's pages and layer for its forks",
                        ))?;
                    Ok(((), state))
                })
                .await;
            let outcome = match &stilled {
                Ok(((), state, processes)) => Ok(Arc::new(snapshot::ForkState {
                    state: state.clone(),
                    processes: processes.clone(),
                    next_process_id: self.inner.next_id.load(std::sync::atomic::Ordering::SeqCst),
                })),
                Err(e) => Err(e.to_string()),
            };
            let _ = filled.send(Some(outcome));
            stilled.map(|_| ())
        };
        let (stilled, booted) = tokio::join!(copy_and_tell, futures_util::future::join_all(boots));
        let mut forks = Vec::with_capacity(n);
        let mut failed = stilled.err();
        for boot in booted {
            match boot {
                Ok(fork) => forks.push(fork),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        match failed {
            None => Ok(forks),
            Some(e) => {
                // All or none: the forks that did start are stopped.
                for fork in forks {
                    let _ = fork.shutdown().await;
                }
                Err(e)
            }
        }
    }

    /// What a snapshot of this instance, stilled with `token`, would say for a fork: its
    /// parts are in memory, not on disk, and the processes and machine state come once the
    /// source is stilled.
    fn fork_manifest(
        &self,
        source: &snapshot::SnapshotSource,
        token: u64,
        layer: Option<&std::fs::File>,
    ) -> Result<Manifest> {
        let in_memory = |name: &str, length: u64| snapshot::Part {
            name: name.to_owned(),
            length,
            extents: Vec::new(),
            sha256: String::new(),
        };
        let length = |file: &std::fs::File| file.metadata().map_or(0, |m| m.len());
        self.manifest(
            source,
            token,
            Vec::new(),
            in_memory(snapshot::MEMORY, source.memory.len().unwrap_or(0)),
            in_memory(snapshot::MACHINE, 0),
            layer.map(|file| in_memory(snapshot::LAYER, length(file))),
        )
    }

    /// What a snapshot of this instance, stilled with `token`, says it is.
    fn manifest(
        &self,
        source: &snapshot::SnapshotSource,
        token: u64,
        processes: Vec<crate::control::SavedProcess>,
        memory: snapshot::Part,
        machine: snapshot::Part,
        layer: Option<snapshot::Part>,
    ) -> Result<Manifest> {
        Ok(Manifest {
            format: snapshot::FORMAT.into(),
            krunbox: env!("CARGO_PKG_VERSION").into(),
            protocol: crate::protocol::PROTOCOL_VERSION,
            cpus: source.cpus,
            memory_mib: source.memory_mib,
            image_sha256: source.image_sha256.clone(),
            kernel_release: self.inner.kernel_release.clone(),
            guest_init_sha256: guest_init_sha256(&source.definition.0)?,
            token,
            next_process_id: self.inner.next_id.load(std::sync::atomic::Ordering::SeqCst),
            memory,
            machine,
            layer,
            network: source.network.clone(),
            processes,
        })
    }

    /// An ephemeral root's layer disk (a memfd; the VMM writes it), when the instance has one.
    fn memory_layer(&self) -> Result<Option<std::fs::File>> {
        let layer = self.inner.layer.lock().unwrap_or_else(|e| e.into_inner());
        match layer.as_ref() {
            Some(crate::rootfs::Layer::Memory(layer)) => Ok(Some(
                layer
                    .file()
                    .try_clone()
                    .map_err(Error::io("opening the writable layer again"))?,
            )),
            _ => Ok(None),
        }
    }

    /// What snapshots of this instance need, or why it cannot be snapshotted.
    fn snapshot_source(&self) -> Result<&snapshot::SnapshotSource> {
        let source = self.inner.snapshots.as_ref().ok_or_else(|| {
            Error::InvalidConfig(
                "this instance cannot be snapshotted: build its sandbox with .snapshots(true)"
                    .into(),
            )
        })?;
        if let Some(why) = &source.unsupported {
            return Err(Error::InvalidConfig(format!(
                "this instance cannot be snapshotted yet: {why}"
            )));
        }
        Ok(source)
    }

    /// Stills the instance (new work refused, the channel quiesced with `token`, the vCPUs
    /// paused, the devices caught up, the machine state saved, the VMM stopped), runs `copy`
    /// with the machine state, and lets everything run again whatever happened. Returns what
    /// `copy` made and the processes the channel tracked. It runs as a task of its own, so a
    /// caller that gives up on it (a timeout, a cancelled task) never leaves the instance
    /// stilled half-way: the steps are undone all the same.
    async fn stilled<T, F, Fut>(
        &self,
        token: u64,
        freeze: Freeze,
        one_at_a_time: tokio::sync::OwnedMutexGuard<()>,
        copy: F,
    ) -> Result<(T, Vec<u8>, Vec<crate::control::SavedProcess>)>
    where
        T: Send + 'static,
        F: FnOnce(Vec<u8>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<(T, Vec<u8>)>> + Send + 'static,
    {
        let this = self.clone();
        // The task holds the instance's one-at-a-time guard: it goes on without its caller.
        let stilling = async move {
            let _one_at_a_time = one_at_a_time;
            this.stilled_here(token, freeze, copy).await
        };
        tokio::spawn(stilling.in_current_span())
            .await
            .map_err(|e| Error::Snapshot {
                step: "saved",
                reason: format!("the snapshot's task failed: {e}"),
            })?
    }

    async fn stilled_here<T, F, Fut>(
        &self,
        token: u64,
        freeze: Freeze,
        copy: F,
    ) -> Result<(T, Vec<u8>, Vec<crate::control::SavedProcess>)>
    where
        F: FnOnce(Vec<u8>) -> Fut,
        Fut: std::future::Future<Output = Result<(T, Vec<u8>)>>,
    {
        // Not beside a pause or resume: a stopped helper answers nothing.
        let _one_at_a_time = self.inner.pausing.lock().await;
        let control = self.control()?;
        if control.is_paused() {
            return Err(Error::Paused);
        }
        control.set_paused(true);
        let stilled = async {
            let processes = control.quiesce(token, QUIESCE_DEADLINE).await?;
            tracing::debug!("quiesced");
            let made = self.capture(freeze, copy).await;
            control.resume().await?;
            tracing::debug!("resumed");
            made.map(|(made, state)| (made, state, processes))
        }
        .await;
        control.set_paused(false);
        stilled
    }

    /// With the channel quiesced: pauses the vCPUs, waits for the devices, saves the machine
    /// state, and runs `copy` with it while the VMM is stopped (so no device writes guest
    /// memory meanwhile). The VMM runs and the vCPUs are resumed afterwards whatever happened
    /// (also after a pause that failed half-way: some vCPUs may have paused). `copy` returns
    /// what it made and the state (to keep, or empty).
    async fn capture<T, F, Fut>(&self, freeze: Freeze, copy: F) -> Result<(T, Vec<u8>)>
    where
        F: FnOnce(Vec<u8>) -> Fut,
        Fut: std::future::Future<Output = Result<(T, Vec<u8>)>>,
    {
        let captured = async {
            self.machine_command(VmmCommand::PauseVcpus, "saved")
                .await?;
            tracing::debug!("vCPUs paused");
            self.wait_for_devices().await?;
            let bytes = match self
                .machine_command(VmmCommand::SaveMachineState, "saved")
                .await?
            {
                VmmReply::Saved { bytes } => bytes,
                other => {
                    return Err(Error::Snapshot {
                        step: "saved",
                        reason: format!("the helper answered {other:?}"),
                    })
                }
            };
            let state =
                self.inner
                    .commands
                    .saved_state(bytes)
                    .map_err(|reason| Error::Snapshot {
                        step: "saved",
                        reason,
                    })?;
            self.prepare_memory(freeze).await?;
            if let Err(e) = self.stop_vm(true).await {
                // Some threads may have stopped: let them all go on.
                let _ = self.stop_vm(false).await;
                return Err(e);
            }
            tracing::debug!("machine state saved, VMM stopped");
            let copied = copy(state).await;
            tracing::debug!("copied");
            let started = self.stop_vm(false).await;
            let made = copied?;
            started?;
            Ok(made)
        }
        .await;
        let resumed = self
            .machine_command(VmmCommand::ResumeVcpus, "resumed")
            .await;
        let made = captured?;
        resumed?;
        Ok(made)
    }

    /// With the vCPUs paused and the machine state saved: memory mapped copy-on-write has its
    /// helper write the guest's own pages out (to be merged over its file); a fork freezes
    /// memory mapped shared in place (its helper maps it copy-on-write from now on).
    async fn prepare_memory(&self, freeze: Freeze) -> Result<()> {
        let memory = &self.snapshot_source()?.memory;
        let (command, step) = if memory.is_private() {
            // Written afresh: pages left from a use that failed half-way are not the guest's.
            memory
                .forget_private_pages()
                .map_err(Error::io("emptying the private-pages file"))?;
            (VmmCommand::WritePrivatePages, "saved")
        } else if freeze == Freeze::InPlace {
            // Before asking: a remap that failed half-way leaves some regions copy-on-write,
            // and only the merge of their own pages over the file is right for both kinds.
            memory.set_private();
            (VmmCommand::MapPrivately, "frozen")
        } else {
            return Ok(());
        };
        match self.machine_command(command, step).await? {
            VmmReply::Written { pages } => tracing::debug!(pages, "the guest's own pages written"),
            VmmReply::Done => {
                memory.seal_base().map_err(|e| Error::Snapshot {
                    step,
                    reason: format!("sealing the frozen memory against writes: {e}"),
                })?;
                tracing::debug!("guest memory frozen, mapped copy-on-write")
            }
            other => return Err(super::machine::unexpected(step, &other)),
        }
        Ok(())
    }

    /// Waits until no device has a request it has not answered (the vCPUs are paused, so no
    /// new ones come).
    async fn wait_for_devices(&self) -> Result<()> {
        let start = Instant::now();
        loop {
            match self
                .machine_command(VmmCommand::QueuesInFlight, "saved")
                .await?
            {
                VmmReply::InFlight { queues: 0 } => return Ok(()),
                VmmReply::InFlight { queues } if start.elapsed() >= DRAIN_DEADLINE => {
                    return Err(Error::Snapshot {
                        step: "saved",
                        reason: format!(
                            "{queues} device queues still held requests after {DRAIN_DEADLINE:?}"
                        ),
                    })
                }
                VmmReply::InFlight { .. } => tokio::time::sleep(DRAIN_POLL).await,
                other => {
                    return Err(Error::Snapshot {
                        step: "saved",
                        reason: format!("the helper answered {other:?}"),
                    })
                }
            }
        }
    }
}

/// The SHA-256 of the guest-init `config` boots with (megabytes: sealed to its file's state
/// as images are, so a fork or restore does not hash it again).
pub(super) fn guest_init_sha256(config: &crate::config::SandboxConfig) -> Result<String> {
    let path = &config.artifacts.guest_init;
    let seals = crate::rootfs::seal::seals_dir(&config.cache_dir);
    std::fs::File::open(path)
        .and_then(|mut file| crate::rootfs::seal::digest_of(&mut file, Some(&seals)))
        .map(|(digest, _)| digest)
        .map_err(Error::io(format!("hashing guest-init {}", path.display())))
}

/// What each fork gets of its own from its source, filled while the source is stilled: a
/// private-pages file (the source's own pages, when its memory is mapped copy-on-write;
/// empty otherwise) and an ephemeral root's layer.
struct ForkCopies {
    pages: Vec<Arc<std::fs::File>>,
    layers: Vec<Option<Arc<std::fs::File>>>,
}

impl ForkCopies {
    /// `n` forks' empty files, as long as `memory`'s and `layer`'s.
    fn make(n: usize, memory: &InstanceMemory, layer: Option<&std::fs::File>) -> Result<Self> {
        let memory_len = memory.len().map_err(Error::io("sizing guest memory"))?;
        let layer_len = layer
            .map(|layer| layer.metadata().map(|m| m.len()))
            .transpose()
            .map_err(Error::io("sizing the layer"))?;
        let mut copies = ForkCopies {
            pages: Vec::with_capacity(n),
            layers: Vec::with_capacity(n),
        };
        for _ in 0..n {
            let pages = InstanceMemory::pages_file(memory_len)
                .map_err(Error::io("creating a fork's private-pages file"))?;
            copies.pages.push(Arc::new(pages));
            copies.layers.push(match layer_len {
                None => None,
                Some(len) => Some(Arc::new(
                    crate::rootfs::MemoryLayer::empty(len)?
                        .file()
                        .try_clone()
                        .map_err(Error::io("a fork's layer"))?,
                )),
            });
        }
        Ok(copies)
    }

    /// Copies the source's own pages (just written by its helper) and `layer` into each
    /// fork's files, in the kernel; the source's pages file is emptied after.
    fn fill(&self, memory: &InstanceMemory, layer: Option<&std::fs::File>) -> std::io::Result<()> {
        if memory.is_private() {
            for pages in &self.pages {
                memory.copy_private_pages_to(pages)?;
            }
            memory.forget_private_pages()?;
        }
        if let Some(layer) = layer {
            for to in self.layers.iter().flatten() {
                snapshot::copy::copy_data(layer, to)?;
            }
        }
        Ok(())
    }
}

/// Whether a stilling freezes guest memory mapped shared in place (a fork's source).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Freeze {
    No,
    InPlace,
}

/// Writes guest memory, the machine state and an ephemeral root's layer into `dir` (on the
/// blocking pool): each part and its new file. Memory mapped copy-on-write is merged first
/// (its file and the pages the guest made its own, which its helper has just written out).
async fn copy_parts(
    memory: Arc<InstanceMemory>,
    layer: Option<std::fs::File>,
    dir: std::path::PathBuf,
    state: Vec<u8>,
) -> Result<[Option<(snapshot::Part, std::fs::File)>; 3]> {
    tokio::task::spawn_blocking(move || {
        let memory = match memory.is_private() {
            false => snapshot::part::write(memory.base(), &dir, snapshot::MEMORY)?,
            true => {
                let merged = crate::guest_memory::sealed_memfd(
                    c"krunbox-snapshot-memory",
                    memory.len()?,
                    crate::guest_memory::LaterSeals::None,
                )?;
                memory.merge_into(&merged)?;
                snapshot::part::write(&merged, &dir, snapshot::MEMORY)?
            }
        };
        let state_file = tempfile::tempfile()?;
        std::os::unix::fs::FileExt::write_all_at(&state_file, &state, 0)?;
        let machine = snapshot::part::write(&state_file, &dir, snapshot::MACHINE)?;
        let layer = layer
            .map(|layer| snapshot::part::write(&layer, &dir, snapshot::LAYER))
            .transpose()?;
        Ok::<_, std::io::Error>([Some(memory), Some(machine), layer])
    })
    .await
    .map_err(|e| Error::Snapshot {
        step: "written",
        reason: e.to_string(),
    })?
    .map_err(Error::io("writing the snapshot"))
}
