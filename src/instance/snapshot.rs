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
use crate::snapshot::{self, Manifest, Snapshot, SnapshotKey, Staging};

/// How long the devices may take to answer the requests made before the vCPUs paused.
const DRAIN_DEADLINE: Duration = Duration::from_secs(5);

/// How often the helper is asked whether they have.
const DRAIN_POLL: Duration = Duration::from_millis(5);

impl Instance {
    /// Takes a snapshot of the running instance into the new directory `dir`: its guest
    /// memory, the state of its VM, vCPUs and devices, checked whole by [`Snapshot::open`].
    /// The instance is stilled meanwhile (new commands and file operations fail with
    /// [`Error::Paused`]; running processes wait) and goes on afterwards. Needs a sandbox
    /// built with [`snapshots(true)`](crate::SandboxBuilder::snapshots), an image root and no
    /// mounts or network (for now). Restoring one is the next stage of this work.
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
        let key = SnapshotKey::load_or_create(&source.key_dir).map_err(Error::io(format!(
            "making the snapshot key in {}",
            source.key_dir.display()
        )))?;
        let staging = Staging::new(dir.as_ref())?;
        // Not beside a pause or resume: a stopped helper answers nothing.
        let _one_at_a_time = self.inner.pausing.lock().await;
        let control = self.control()?;
        if control.is_paused() {
            return Err(Error::Paused);
        }
        control.set_paused(true);
        let token = random_token();
        let written = async {
            control.quiesce(token, QUIESCE_DEADLINE).await?;
            let processes = control.saved_processes();
            let parts = self.capture(&staging).await;
            control.resume().await?;
            parts.map(|(memory, machine)| (memory, machine, processes))
        }
        .await;
        control.set_paused(false);
        let (memory, machine, processes) = written?;
        let manifest = Manifest {
            format: snapshot::FORMAT.into(),
            krunbox: env!("CARGO_PKG_VERSION").into(),
            protocol: crate::protocol::PROTOCOL_VERSION,
            cpus: source.cpus,
            memory_mib: source.memory_mib,
            image_sha256: source.image_sha256.clone(),
            kernel_release: self.inner.kernel_release.clone(),
            token,
            next_process_id: self.inner.next_id.load(std::sync::atomic::Ordering::SeqCst),
            memory,
            machine,
            processes,
        };
        let sealed = Snapshot::seal(staging.path().to_path_buf(), manifest, &key)?;
        let digest = sealed.digest().to_owned();
        let dir = staging.finish()?;
        tracing::info!(dir = %dir.display(), %digest, "snapshot taken");
        Snapshot::open(&dir, &source.key_dir)
    }

    /// Forks the running instance into `n` new ones: each starts where this one is now (its
    /// processes, which each fork [`attach`](Self::attach)es, its files in memory, its
    /// shell variables) and goes its own way from there, as this one does. A snapshot taken
    /// into a temporary directory and restored `n` times (then removed); the same scope as
    /// [`snapshot`](Self::snapshot).
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
        let scratch = tempfile::Builder::new()
            .prefix("krunbox-fork-")
            .tempdir()
            .map_err(Error::io("making a directory for the fork's snapshot"))?;
        let snapshot = self.snapshot(scratch.path().join("snapshot")).await?;
        let definition = self
            .inner
            .snapshots
            .as_ref()
            .expect("a snapshot was taken")
            .definition
            .0
            .clone();
        let mut forks = Vec::with_capacity(n);
        for _ in 0..n {
            forks.push(super::restore(definition.clone(), snapshot.clone()).await?);
        }
        Ok(forks)
    }

    /// With the channel quiesced: pauses the vCPUs, waits for the devices, saves the machine
    /// state, and copies it and guest memory into `staging` with the VMM stopped. The vCPUs
    /// run again afterwards whatever happened.
    async fn capture(&self, staging: &Staging) -> Result<(snapshot::Part, snapshot::Part)> {
        self.machine_command(VmmCommand::PauseVcpus, "saved")
            .await?;
        let captured = async {
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
            self.stop_vm(true).await?;
            let copied = self.copy_parts(staging, state).await;
            let started = self.stop_vm(false).await;
            let parts = copied?;
            started?;
            Ok(parts)
        }
        .await;
        let resumed = self
            .machine_command(VmmCommand::ResumeVcpus, "resumed")
            .await;
        let parts = captured?;
        resumed?;
        Ok(parts)
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

    /// Writes guest memory and the machine state into `staging` (on the blocking pool).
    async fn copy_parts(
        &self,
        staging: &Staging,
        state: Vec<u8>,
    ) -> Result<(snapshot::Part, snapshot::Part)> {
        let source = self
            .inner
            .snapshots
            .as_ref()
            .expect("checked by snapshot()");
        let memory = source.memory.clone();
        let dir = staging.path().to_path_buf();
        tokio::task::spawn_blocking(move || {
            let memory = snapshot::part::write(memory.file(), &dir, snapshot::MEMORY)?;
            let state_file = tempfile::tempfile()?;
            std::os::unix::fs::FileExt::write_all_at(&state_file, &state, 0)?;
            let machine = snapshot::part::write(&state_file, &dir, snapshot::MACHINE)?;
            Ok::<_, std::io::Error>((memory, machine))
        })
        .await
        .map_err(|e| Error::Snapshot {
            step: "written",
            reason: e.to_string(),
        })?
        .map_err(Error::io("writing the snapshot"))
    }
}
