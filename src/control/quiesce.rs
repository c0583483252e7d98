//! Stilling the control channel for a snapshot ([`HostMessage::Quiesce`]): the host sends
//! `Quiesce{token}` and then nothing more; the guest answers `Quiesced{token}` and then sends
//! nothing more. Everything either side sent before has then been read by the other, so
//! nothing is in flight when the VM's state is saved. `Resume` lets both go on, what each
//! queued meanwhile first. (A restored copy's connection breaks instead; its guest connects
//! again with `Rejoin`: docs/snapshots-plan.md.)

use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::sync::oneshot;
use tracing::Instrument;

use super::{Control, Outgoing};
use crate::error::{Error, Result};
use crate::protocol::{HostMessage, Quiesce, Resume};

impl Control {
    /// Quiesces the channel: sends `Quiesce` as the last bytes until [`Control::resume`] and
    /// waits (up to `deadline`) for the guest's `Quiesced`. The caller marks the VM paused
    /// first ([`Control::set_paused`]), so that no new work starts and the liveness check
    /// waits. On an error the channel is unusable: a guest that does not quiesce as asked is
    /// not trusted to do anything else.
    pub async fn quiesce(&self, token: u64, deadline: Duration) -> Result<()> {
        *self.quiescing.lock().unwrap_or_else(|p| p.into_inner()) = Some(token);
        let quiesced = self.quiesced.notified();
        let (hand_back, parked) = oneshot::channel();
        *self.parked.lock().unwrap_or_else(|p| p.into_inner()) = Some(parked);
        let bytes = HostMessage::Quiesce(Quiesce { token }).encode()?;
        if self
            .outgoing
            .send(Outgoing::Last(bytes, hand_back))
            .is_err()
        {
            return Err(self.gone_error());
        }
        // A guest that dies meanwhile makes the channel gone, which this sees within a poll.
        // (Not `closed`: the instance's supervisor waits on that.)
        let gone = async {
            while self.gone().is_none() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::select! {
            () = quiesced => Ok(()),
            () = gone => Err(self.gone_error()),
            () = tokio::time::sleep(deadline) => {
                let reason = format!("the guest did not quiesce within {deadline:?}");
                self.fail_all(reason.clone());
                // The instance stops the VM, as for any breach of the protocol.
                self.violated.notify_one();
                Err(Error::InstanceGone { reason })
            }
        }
    }

    /// Whether `token` is the one the guest was asked to quiesce with (then no longer).
    pub(super) fn take_quiescing(&self, token: u64) -> bool {
        let mut quiescing = self.quiescing.lock().unwrap_or_else(|p| p.into_inner());
        if *quiescing == Some(token) {
            *quiescing = None;
            return true;
        }
        false
    }

    /// Ends a quiesce: writes `Resume` (with the host's wall-clock time, which the guest sets),
    /// then what was queued meanwhile, and lets the guest send again.
    pub async fn resume(&self) -> Result<()> {
        let parked = self.parked.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(parked) = parked else {
            return Err(Error::InstanceGone {
                reason: "resuming a control channel that was not quiesced".into(),
            });
        };
        let mut writer = parked.await.map_err(|_| self.gone_error())?;
        self.still.store(false, std::sync::atomic::Ordering::SeqCst);
        let bytes = HostMessage::Resume(Resume {
            unix_time_ns: unix_time_ns(),
        })
        .encode()?;
        writer
            .write_all(&bytes)
            .await
            .map_err(Error::io("resuming the guest's control channel"))?;
        tokio::spawn(
            super::write_queue(std::sync::Arc::clone(&self.queue), writer).in_current_span(),
        );
        Ok(())
    }

    fn gone_error(&self) -> Error {
        self.gone()
            .map(|gone| gone.error())
            .unwrap_or_else(|| Error::InstanceGone {
                reason: "the control connection ended while it was quiesced".into(),
            })
    }
}

/// The host's wall-clock time in nanoseconds since the Unix epoch (0 for a clock before it).
pub(super) fn unix_time_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
