//! How every guest-init thread sends to the host ([`Outbox`]): frames queue for the one writer
//! thread that owns the socket's write half, and the answer to a liveness ping has a slot of its
//! own ([`PongSlot`]) so it never waits behind queued output. Process supervision, file
//! operations and the control loop all send through it.

use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};

use krunbox_protocol::{GuestMessage, Pong};

/// What the writer thread writes: an encoded frame (empty: only a wake-up for a pong), or the
/// last frame before it stops writing until the host resumes the channel
/// ([`Outbox::quiesce`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Outgoing {
    Frame(Vec<u8>),
    Last(Vec<u8>),
}

/// Sends one message to the host (through the writer thread). Returns false once the host is
/// gone.
#[derive(Clone)]
pub struct Outbox {
    tx: SyncSender<Outgoing>,
    pong: PongSlot,
}

/// The answer to the host's latest liveness ping, waiting for the writer thread. It is one
/// slot rather than a place in the queue: the queue may hold many output chunks, and a pong
/// must not wait behind them (nor block the control loop while the queue is full). Answering
/// only the latest ping is enough: the host counts any message as a sign of life.
#[derive(Clone, Default)]
pub struct PongSlot(Arc<Mutex<Option<u64>>>);

impl PongSlot {
    /// The encoded pong to write before the next queued frame, if a ping is unanswered.
    pub fn take(&self) -> Option<Vec<u8>> {
        let seq = self.0.lock().unwrap_or_else(|p| p.into_inner()).take()?;
        GuestMessage::Pong(Pong { seq }).encode().ok()
    }
}

impl Outbox {
    /// Wraps the writer thread's channel. The writer takes the [`PongSlot`] before every frame
    /// it receives from the channel.
    pub fn new(tx: SyncSender<Outgoing>) -> (Self, PongSlot) {
        let pong = PongSlot::default();
        (
            Outbox {
                tx,
                pong: pong.clone(),
            },
            pong,
        )
    }

    /// Encodes and queues a message; blocks while the queue is full (backpressure from the
    /// host's reading speed all the way to the process's pipe).
    pub fn send(&self, msg: &GuestMessage) -> bool {
        match msg.encode() {
            Ok(bytes) => self.tx.send(Outgoing::Frame(bytes)).is_ok(),
            Err(err) => {
                eprintln!("guest-init: cannot encode {msg:?}: {err}");
                true
            }
        }
    }

    /// Answers a liveness ping without ever blocking: the pong goes into its slot, and an empty
    /// frame wakes the writer if the queue has room. If it has none, the writer is busy with
    /// queued frames and writes the pong before the next one; either way the pong waits for at
    /// most the one frame being written.
    pub fn pong(&self, seq: u64) -> bool {
        *self.pong.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(seq);
        !matches!(
            self.tx.try_send(Outgoing::Frame(Vec::new())),
            Err(std::sync::mpsc::TrySendError::Disconnected(_))
        )
    }

    /// Queues `msg` (the answer to a quiesce) as the last frame the writer writes until the
    /// host resumes the channel; frames queued after it wait (and their senders block once
    /// the queue is full, as when the host reads slowly).
    pub fn quiesce(&self, msg: &GuestMessage) -> bool {
        match msg.encode() {
            Ok(bytes) => self.tx.send(Outgoing::Last(bytes)).is_ok(),
            Err(err) => {
                eprintln!("guest-init: cannot encode {msg:?}: {err}");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use krunbox_protocol::{FrameDecoder, Output, Stream};
    use serde_bytes::ByteBuf;
    use std::sync::mpsc::sync_channel;

    #[test]
    fn a_pong_never_blocks_and_jumps_a_full_queue() {
        let (tx, rx) = sync_channel::<Outgoing>(2);
        let (outbox, slot) = Outbox::new(tx);
        let output = GuestMessage::Output(Output {
            id: 1,
            stream: Stream::Stdout,
            data: ByteBuf::from(vec![7u8; 16]),
        });
        assert!(outbox.send(&output));
        assert!(outbox.send(&output));
        // The queue is full: a send would block here, a pong must not.
        assert!(outbox.pong(1));
        assert!(outbox.pong(2));
        // The writer takes the slot before the next queued frame: only the latest ping is
        // answered, once.
        let pong = slot.take().expect("a pong is waiting");
        let mut decoder = FrameDecoder::new();
        decoder.push(&pong).unwrap();
        let frame = decoder.next_frame().unwrap().unwrap();
        assert_eq!(
            GuestMessage::decode(&frame).unwrap(),
            GuestMessage::Pong(Pong { seq: 2 })
        );
        assert!(slot.take().is_none());
        // With room in the queue, an empty frame wakes an idle writer.
        rx.recv().unwrap();
        rx.recv().unwrap();
        assert!(outbox.pong(3));
        assert_eq!(rx.try_recv().unwrap(), Outgoing::Frame(Vec::new()));
        // Once the writer is gone, the pong says so.
        drop(rx);
        assert!(!outbox.pong(4));
    }
}
