//! The task that watches a running VM's helper until it exits: kills it when the guest breaks
//! the protocol, stops answering the liveness check, hangs up, or the instance asks; then says
//! why the VM stopped, fails every pending call with that, and gives the root's layer back
//! (a copy-on-write root's last blocks stored first, within a deadline).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tracing::Instrument;

use super::{tail, CLOSED_GRACE, STORE_FINISH_DEADLINE, VMM_EXIT_DEADLINE};
use crate::control::{Control, Gone};
use crate::logs::InstanceLogs;
use crate::rootfs;

/// What the supervisor watches and what it reports to.
pub(super) struct Supervisor {
    pub child: tokio::process::Child,
    pub control: Arc<Control>,
    /// True (or dropped) when the instance asks for the VM to be killed.
    pub kill: watch::Receiver<bool>,
    /// Set by `shutdown`: an exit after it is no failure.
    pub shutdown_requested: Arc<AtomicBool>,
    pub dir: PathBuf,
    pub logs: Arc<InstanceLogs>,
    pub cgroup: Option<Arc<crate::cgroup::InstanceCgroup>>,
    pub vmm_process: Arc<crate::helper::VmmProcess>,
    /// The root's layer, given back once the VMM has exited.
    pub layer: Arc<Mutex<Option<rootfs::Layer>>>,
    /// Where the description of the VM's end goes.
    pub exited: watch::Sender<Option<String>>,
}

impl Supervisor {
    /// Runs until the helper exited and everything of the VM was given back.
    pub async fn run(mut self) {
        let status = self.until_exit().await;
        // The console's and the helper's last lines may still be in the FIFO and the pipe.
        self.logs.settle_after_exit().await;
        let description = self.describe(status);
        self.control.fail_all(description.clone());
        // The VMM itself may outlive the helper by a moment (killed, it dies by PDEATHSIG):
        // its last writes to the layer land before the layer is let go (a persistent layer's
        // lock, a copy-on-write store's flush and detach).
        if !self.vmm_process.exited_within(VMM_EXIT_DEADLINE).await {
            tracing::warn!(
                "the VMM process outlived its helper by {VMM_EXIT_DEADLINE:?}; letting its layer go"
            );
        }
        let layer = self.layer.lock().unwrap_or_else(|e| e.into_inner()).take();
        give_back(layer).await;
        let _ = self.exited.send(Some(description));
    }

    async fn until_exit(&mut self) -> std::io::Result<std::process::ExitStatus> {
        let control = self.control.clone();
        loop {
            tokio::select! {
                status = self.child.wait() => return status,
                _ = control.violated.notified() => { let _ = self.child.start_kill(); }
                // The liveness check gave up on the guest: SIGKILL works on a stopped or
                // spinning helper too.
                _ = control.hung.notified() => { let _ = self.child.start_kill(); }
                _ = control.closed.notified() => {
                    // The guest hung up: normally because the VM is going down. Give the VMM a
                    // moment to exit so its status explains what happened; a VM that keeps
                    // running without its control channel is useless, so then stop it.
                    match tokio::time::timeout(CLOSED_GRACE, self.child.wait()).await {
                        Ok(status) => return status,
                        Err(_) => { let _ = self.child.start_kill(); }
                    }
                }
                changed = self.kill.changed() => {
                    if changed.is_err() || *self.kill.borrow() {
                        let _ = self.child.start_kill();
                    }
                }
            }
        }
    }

    /// Why the VM stopped, in words, with the console's tail where it explains.
    fn describe(&self, status: std::io::Result<std::process::ExitStatus>) -> String {
        let description = if let Some(hung @ Gone::Hung(_)) = self.control.gone() {
            // The liveness check killed it: that, not the kill's signal, is the story.
            format!("{hung}\n{}", tail(&self.dir))
        } else {
            match status {
                Ok(_) if self.shutdown_requested.load(Ordering::SeqCst) => {
                    "the VM was shut down".to_string()
                }
                Ok(s) if s.success() => {
                    let tail = tail(&self.dir);
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
                Ok(s) => format!("the VM stopped ({s})\n{}", tail(&self.dir)),
                Err(e) => format!("waiting for the VMM failed: {e}"),
            }
        };
        match self.cgroup.as_ref().map(|c| c.oom_kills()) {
            Some(kills @ 1..) => format!(
                "the instance's cgroup killed its VMM for memory ({kills} OOM kills: the VMM \
                 passed memory.max, the guest's RAM and an overhead); {description}"
            ),
            _ => description,
        }
    }
}

/// Lets the root's layer go; a copy-on-write layer's last blocks go to its store first (so
/// `shutdown` returns after they are stored).
async fn give_back(layer: Option<rootfs::Layer>) {
    if let Some(rootfs::Layer::Cow(cow)) = &layer {
        // The store is the caller's code: a stalled one must not hold `shutdown` forever. In a
        // task of its own: past the deadline it still runs to its end (and detaches the
        // store); only the wait for it stops.
        let finishing = tokio::spawn(
            {
                let cow = cow.clone();
                async move { cow.finish().await }
            }
            .in_current_span(),
        );
        if tokio::time::timeout(STORE_FINISH_DEADLINE, finishing)
            .await
            .is_err()
        {
            cow.give_up(STORE_FINISH_DEADLINE);
        }
    }
    drop(layer);
}
