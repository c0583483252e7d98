//! The VM's KVM state (registers, FPU, LAPIC, MSRs, irqchip, clock), read and set through the
//! helper's command socket: the first step of snapshots (docs/snapshots-plan.md), which save it
//! beside guest memory and the devices' state.

use std::time::Duration;

use krunbox_protocol::vmm::command::{VmmCommand, VmmReply};

use super::Instance;
use crate::error::{Error, Result};

/// How long the helper may take to answer one command: each waits at most a second per vCPU
/// (krunbox has at most 8), and the helper's event loop may be busy with a device meanwhile.
const COMMAND_DEADLINE: Duration = Duration::from_secs(15);

/// How long the helper may take per GiB of guest memory to write the guest's own pages out
/// ([`VmmCommand::WritePrivatePages`]), beyond [`COMMAND_DEADLINE`]: a page a time through
/// the kernel, which nested emulation slows to tens of MB/s.
const PAGES_DEADLINE_PER_GIB: Duration = Duration::from_secs(60);

/// How long the guest may take to answer a quiesce (it answers from its control loop, which
/// may be busy with a file operation).
pub(super) const QUIESCE_DEADLINE: Duration = Duration::from_secs(30);

/// A token no one can guess for a quiesce (its `Quiesced` must echo it), from the kernel's
/// random source.
pub(super) fn random_token() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into the buffer it is given.
    let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if got != bytes.len() as isize {
        // Never short for 8 bytes once the pool is ready (it is, long after boot); a token
        // that repeats only lets a guest echo it, which it can anyway.
        return std::process::id() as u64;
    }
    u64::from_le_bytes(bytes)
}

impl Instance {
    /// Pauses the vCPUs, saves the KVM state of the VM and of each vCPU, waits `hold`, sets
    /// the saved state back and resumes the vCPUs; returns the state's size in bytes. The
    /// guest goes on where it was, its clocks too: they do not count `hold` (the saved
    /// kvmclock and TSC are set back), which is how the VM test of snapshots' first step
    /// (`tests/lifecycle.rs`) sees that the state was set at all. Not API: snapshots will be.
    #[doc(hidden)]
    pub async fn round_trip_machine_state(&self, hold: Duration) -> Result<u64> {
        // Not beside a pause or resume: a stopped helper answers nothing.
        let _one_at_a_time = self.inner.pausing.lock().await;
        let control = self.control()?;
        if control.is_paused() {
            return Err(Error::Paused);
        }
        // No new work meanwhile, and nothing in flight on the control channel.
        control.set_paused(true);
        let result = async {
            control.quiesce(random_token(), QUIESCE_DEADLINE).await?;
            let saved = self.save_and_set_back(hold).await;
            control.resume().await?;
            saved
        }
        .await;
        control.set_paused(false);
        result
    }

    /// Pauses the vCPUs, saves their state and the VM's, waits `hold`, sets the state back and
    /// resumes the vCPUs (whatever happened before).
    async fn save_and_set_back(&self, hold: Duration) -> Result<u64> {
        let round_trip = async {
            // A pause that failed half-way may have paused some vCPUs: resumed below.
            self.machine_command(VmmCommand::PauseVcpus, "saved")
                .await?;
            let bytes = match self
                .machine_command(VmmCommand::SaveMachineState, "saved")
                .await?
            {
                VmmReply::Saved { bytes } => bytes,
                other => return Err(unexpected("saved", &other)),
            };
            tokio::time::sleep(hold).await;
            self.machine_command(VmmCommand::RestoreMachineState { bytes }, "set")
                .await?;
            Ok(bytes)
        }
        .await;
        let resumed = self
            .machine_command(VmmCommand::ResumeVcpus, "resumed")
            .await;
        let bytes = round_trip?;
        resumed?;
        Ok(bytes)
    }

    /// Sends `command` to the helper; a reply that says it failed is an error.
    pub(super) async fn machine_command(
        &self,
        command: VmmCommand,
        step: &'static str,
    ) -> Result<VmmReply> {
        let deadline = match command {
            VmmCommand::WritePrivatePages => {
                let gib = self
                    .inner
                    .snapshots
                    .as_ref()
                    .map_or(0, |source| source.memory_mib.div_ceil(1024));
                COMMAND_DEADLINE + PAGES_DEADLINE_PER_GIB * gib
            }
            _ => COMMAND_DEADLINE,
        };
        let reply = self
            .inner
            .commands
            .send(command, deadline)
            .await
            .map_err(|reason| Error::Snapshot { step, reason })?;
        match reply {
            VmmReply::Failed { reason } => Err(Error::Snapshot { step, reason }),
            reply => Ok(reply),
        }
    }
}

pub(super) fn unexpected(step: &'static str, reply: &VmmReply) -> Error {
    Error::Snapshot {
        step,
        reason: format!("the helper answered {reply:?}"),
    }
}
