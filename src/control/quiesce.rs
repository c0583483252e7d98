//! Stilling the control channel for a snapshot ([`HostMessage::Quiesce`]): the host sends
//! `Quiesce{token}` and then nothing more; the guest answers `Quiesced{token}` and then sends
//! nothing more. Everything either side sent before has then been read by the other, so
//! nothing is in flight when the VM's state is saved. `Resume` lets both go on, what each
//! queued meanwhile first. (A restored copy's connection breaks instead; its guest connects
//! again with `Rejoin`: docs/snapshots-plan.md.)

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::oneshot;
use tracing::Instrument;

use super::{message_name, read_message, Control, Outgoing, ProcessChannels, SavedProcess};
use crate::error::{Error, Result};
use crate::protocol::{
    FrameDecoder, GuestMessage, HostMessage, ProtocolError, Quiesce, Resume, Stream, OUTPUT_WINDOW,
    PROTOCOL_VERSION, STDIN_WINDOW,
};

impl Control {
    /// Quiesces the channel: sends `Quiesce` as the last bytes until [`Control::resume`] and
    /// waits (up to `deadline`) for the guest's `Quiesced`. The caller marks the VM paused
    /// first ([`Control::set_paused`]), so that no new work starts and the liveness check
    /// waits. Returns the processes as the guest will know them: counted as `Quiesce` is
    /// queued, under the lock that credits and `Exec`s are queued under, so what is queued
    /// behind it (and so never reaches a snapshot of the guest) is not counted. On an error
    /// the channel is unusable: a guest that does not quiesce as asked is not trusted to do
    /// anything else.
    pub async fn quiesce(&self, token: u64, deadline: Duration) -> Result<Vec<SavedProcess>> {
        *self.quiescing.lock().unwrap_or_else(|p| p.into_inner()) = Some(token);
        let quiesced = self.quiesced.notified();
        let (hand_back, parked) = oneshot::channel();
        *self.parked.lock().unwrap_or_else(|p| p.into_inner()) = Some(parked);
        let bytes = HostMessage::Quiesce(Quiesce { token }).encode()?;
        let processes = {
            let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if self
                .outgoing
                .send(Outgoing::Last(bytes, hand_back))
                .is_err()
            {
                drop(state);
                return Err(self.gone_error());
            }
            saved_processes(&state)
        };
        // A guest that dies meanwhile makes the channel gone, which this sees within a poll.
        // (Not `closed`: the instance's supervisor waits on that.)
        let gone = async {
            while self.gone().is_none() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::select! {
            () = quiesced => Ok(processes),
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

    /// Takes over a snapshot's processes in a restored instance: a slot each, their channels
    /// kept for [`Control::take_adopted`]. What the snapshotted host had received and not
    /// credited stays with that host, so it is credited back here at once (the guest's
    /// window is whole again); stdin the guest had not credited yet it credits as it writes it.
    pub fn adopt(&self, processes: &[SavedProcess]) {
        for saved in processes {
            // At a restore's start nothing refuses a slot (the restore checked the count).
            let Ok(channels) = self.register_process(saved.key, saved.pty) else {
                tracing::warn!(
                    key = saved.key,
                    "a snapshot's process could not be taken over"
                );
                continue;
            };
            {
                let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(slot) = state.procs.get_mut(&saved.key) {
                    slot.pid = saved.pid;
                    slot.outstanding = saved.outstanding;
                    if let Some(tx) = slot.started.take() {
                        if let Some(pid) = saved.pid {
                            let _ = tx.send(pid);
                        } else {
                            slot.started = Some(tx);
                        }
                    }
                }
            }
            let owed = (saved.stdin_outstanding.min(STDIN_WINDOW as u64)) as u32;
            if let Ok(permits) = channels.stdin_credit.clone().try_acquire_many_owned(owed) {
                permits.forget();
            }
            for (stream, bytes) in [Stream::Stdout, Stream::Stderr]
                .into_iter()
                .zip(saved.outstanding)
            {
                if bytes > 0 {
                    self.credit(
                        saved.key,
                        stream,
                        bytes.min(u64::from(OUTPUT_WINDOW)) as u32,
                    );
                }
            }
            self.adopted
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(saved.key, (saved.clone(), channels));
        }
    }

    /// The channels of an adopted process, once (see [`Control::adopt`]).
    pub fn take_adopted(&self, key: u32) -> Option<(SavedProcess, ProcessChannels)> {
        self.adopted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key)
    }

    /// The adopted processes not taken yet, each with its pid as the guest said it last (one
    /// that had not started at the snapshot has one once it has).
    pub fn adopted(&self) -> Vec<SavedProcess> {
        let adopted = self.adopted.lock().unwrap_or_else(|p| p.into_inner());
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut list: Vec<SavedProcess> = adopted
            .values()
            .map(|(saved, _)| SavedProcess {
                pid: state
                    .procs
                    .get(&saved.key)
                    .and_then(|slot| slot.pid)
                    .or(saved.pid),
                ..saved.clone()
            })
            .collect();
        list.sort_by_key(|p| p.key);
        list
    }

    fn gone_error(&self) -> Error {
        self.gone()
            .map(|gone| gone.error())
            .unwrap_or_else(|| Error::InstanceGone {
                reason: "the control connection ended while it was quiesced".into(),
            })
    }
}

/// Every process `state` tracks, as a snapshot keeps it.
fn saved_processes(state: &super::State) -> Vec<SavedProcess> {
    let mut saved: Vec<SavedProcess> = state
        .procs
        .iter()
        .map(|(&key, slot)| SavedProcess {
            key,
            pid: slot.pid,
            pty: slot.pty,
            outstanding: slot.outstanding,
            stdin_outstanding: (STDIN_WINDOW as u64)
                .saturating_sub(slot.stdin_credit.available_permits() as u64),
        })
        .collect();
    saved.sort_by_key(|p| p.key);
    saved
}

/// A restored guest's first connection: its first frame must be `Rejoin` with the snapshot's
/// `token` and our protocol version; the host answers `Resume` (the guest sets its wall clock
/// from it: it stood still since the snapshot). Returns the decoder, which may already hold
/// what the guest sent next.
pub(crate) async fn rejoin_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    token: u64,
) -> Result<FrameDecoder> {
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; 64 * 1024];
    let malformed = |reason: String| {
        Error::Protocol(ProtocolError::Malformed {
            message: "rejoin",
            reason,
        })
    };
    let rejoin = match read_message(stream, &mut decoder, &mut buf).await? {
        Some(GuestMessage::Rejoin(rejoin)) => rejoin,
        Some(other) => {
            return Err(malformed(format!(
                "expected Rejoin first, got {}",
                message_name(&other)
            )))
        }
        None => {
            return Err(Error::GuestSetup {
                message: "the restored guest closed its control connection before rejoining".into(),
            })
        }
    };
    if rejoin.version != PROTOCOL_VERSION {
        return Err(Error::Protocol(ProtocolError::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs: rejoin.version,
        }));
    }
    if rejoin.token != token {
        return Err(malformed("a Rejoin with another snapshot's token".into()));
    }
    let bytes = HostMessage::Resume(Resume {
        unix_time_ns: unix_time_ns(),
    })
    .encode()?;
    stream
        .write_all(&bytes)
        .await
        .map_err(Error::io("answering the restored guest"))?;
    Ok(decoder)
}

/// The host's wall-clock time in nanoseconds since the Unix epoch (0 for a clock before it).
pub(super) fn unix_time_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
