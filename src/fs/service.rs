//! An instance's mounts: each one's socket to its device in the helper, and the task that
//! serves its queues once the device hands them over.
//!
//! Each mount is a virtio-fs device in the `krunbox-vmm` helper ([`super::virtio`]), which
//! hands its queues over on the mount's socket when the guest's driver activates it; from then
//! on the library serves them itself ([`super::served`]), each request answered by the mount's
//! FUSE session. Everything belongs to the instance: dropping the service ends every task.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use tokio::net::UnixStream;
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::fuse::Session;
use super::Mount;
use crate::guest_memory::GuestMemoryFile;

/// Serves an instance's mounts while it lives.
pub(crate) struct FsService {
    /// Read only to connect (no state of theirs is held here across a call that can panic).
    mounts: std::panic::AssertUnwindSafe<Vec<Mount>>,
    connections: Vec<JoinHandle<()>>,
    /// The instance's share of the process's descriptors and blocking threads.
    budget: Arc<crate::budget::Budget>,
}

impl Drop for FsService {
    fn drop(&mut self) {
        for connection in &self.connections {
            connection.abort();
        }
    }
}

impl FsService {
    /// A service for `mounts`, connected to no helper yet, whose filesystems' calls are
    /// charged to `budget`.
    pub(crate) fn new(mounts: Vec<Mount>, budget: Arc<crate::budget::Budget>) -> Self {
        FsService {
            mounts: std::panic::AssertUnwindSafe(mounts),
            connections: Vec::new(),
            budget,
        }
    }

    /// Connects every mount afresh, for one boot attempt: a socket pair each, whose one end is
    /// served from now on (with a new FUSE session, replacing an earlier attempt's) and whose
    /// other ends, in mount order, go to the helper. Each device hands its queues over on its
    /// socket when the guest's driver activates it, and they are served here, in guest memory
    /// mapped from `memory`, the VM's memory file ([`super::served`]). Must run inside the
    /// tokio runtime.
    pub(crate) fn connect(
        &mut self,
        memory: Arc<GuestMemoryFile>,
    ) -> std::io::Result<Vec<OwnedFd>> {
        for connection in self.connections.drain(..) {
            connection.abort();
        }
        let mut helper_ends = Vec::with_capacity(self.mounts.len());
        for mount in self.mounts.iter() {
            let (ours, helper_end) = std::os::unix::net::UnixStream::pair()?;
            ours.set_nonblocking(true)?;
            let stream = UnixStream::from_std(ours)?;
            let session = Arc::new(
                Session::new(mount.fs.clone(), mount.options).with_budget(self.budget.clone()),
            );
            let path = mount.guest_path.clone();
            let memory = memory.clone();
            self.connections.push(tokio::spawn(async move {
                if let Err(err) = super::served::serve(stream, session, memory).await {
                    tracing::warn!(target: "krunbox::fs", mount = %path, %err, "a mount's connection ended");
                }
            }
.in_current_span()));
            helper_ends.push(OwnedFd::from(helper_end));
        }
        Ok(helper_ends)
    }
}
