//! The host end of the control channel: handshake, then one reader and one writer task
//! multiplexing every process of an instance by id.
//!
//! Every byte from the guest goes through [`FrameDecoder`] and [`GuestMessage::decode`], which
//! bound and validate it; the first violation stops the instance (the guest is hostile, and a
//! stream cannot be resynchronised after garbage).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, Notify, Semaphore};

use crate::error::{Error, Result};
use crate::protocol::fs::FsReply;
use crate::protocol::{
    ExecFailed, Exited, FrameDecoder, GuestMessage, Hello, HostMessage, ProtocolError, Setup,
    Stream, OUTPUT_WINDOW, PROTOCOL_VERSION,
};

/// Host-to-guest messages gathered into one write, at most (about) this many bytes.
const WRITE_BATCH: usize = 256 * 1024;

/// Reads until one whole guest message is decoded. `Ok(None)` on a clean end of stream.
pub(crate) async fn read_message<R: AsyncRead + Unpin>(
    reader: &mut R,
    decoder: &mut FrameDecoder,
    buf: &mut [u8],
) -> Result<Option<GuestMessage>> {
    loop {
        if let Some(frame) = decoder.next_frame()? {
            return Ok(Some(GuestMessage::decode(&frame)?));
        }
        let want = buf.len();
        let n = reader
            .read(&mut buf[..want])
            .await
            .map_err(Error::io("reading the guest control channel"))?;
        if n == 0 {
            decoder.finish()?;
            return Ok(None);
        }
        decoder.push(&buf[..n])?;
    }
}

/// Hello → version check → Setup → Ready. Returns the guest's hello.
pub(crate) async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    decoder: &mut FrameDecoder,
    setup: Setup,
) -> Result<Hello> {
    let mut buf = vec![0u8; 64 * 1024];
    let hello = match read_message(stream, decoder, &mut buf).await? {
        Some(GuestMessage::Hello(hello)) => hello,
        Some(other) => {
            return Err(Error::Protocol(ProtocolError::Malformed {
                message: "handshake",
                reason: format!("expected Hello first, got {}", message_name(&other)),
            }))
        }
        None => {
            return Err(Error::GuestSetup {
                message: "guest-init closed the control connection before saying hello".into(),
            })
        }
    };
    if hello.version != PROTOCOL_VERSION {
        return Err(Error::Protocol(ProtocolError::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs: hello.version,
        }));
    }
    let bytes = HostMessage::Setup(setup).encode()?;
    stream
        .write_all(&bytes)
        .await
        .map_err(Error::io("sending setup to the guest"))?;
    match read_message(stream, decoder, &mut buf).await? {
        Some(GuestMessage::Ready) => Ok(hello),
        Some(GuestMessage::SetupFailed(failure)) => Err(Error::GuestSetup {
            message: failure.message,
        }),
        Some(other) => Err(Error::Protocol(ProtocolError::Malformed {
            message: "handshake",
            reason: format!(
                "expected Ready or SetupFailed, got {}",
                message_name(&other)
            ),
        })),
        None => Err(Error::GuestSetup {
            message: "guest-init closed the control connection during setup".into(),
        }),
    }
}

fn message_name(m: &GuestMessage) -> &'static str {
    match m {
        GuestMessage::Hello(_) => "Hello",
        GuestMessage::Ready => "Ready",
        GuestMessage::SetupFailed(_) => "SetupFailed",
        GuestMessage::Started(_) => "Started",
        GuestMessage::Output(_) => "Output",
        GuestMessage::Exited(_) => "Exited",
        GuestMessage::ExecFailed(_) => "ExecFailed",
        GuestMessage::StdinCredit(_) => "StdinCredit",
        GuestMessage::FsReply(_) => "FsReply",
    }
}

/// How a process's life ended, as seen by the host.
#[derive(Debug)]
pub(crate) enum ProcessEnd {
    Exited(Exited),
    Failed(ExecFailed),
    /// The instance stopped first.
    Gone(String),
}

/// What a process's output channel carries.
#[derive(Debug)]
pub(crate) enum OutputItem {
    /// Bytes the process wrote.
    Data(Vec<u8>),
    /// The instance stopped before the process ended: the stream is incomplete, and a reader
    /// must hear that instead of a clean end of file.
    Broken(String),
}

/// The receiving ends for one process.
pub(crate) struct ProcessChannels {
    pub stdout: mpsc::UnboundedReceiver<OutputItem>,
    pub stderr: mpsc::UnboundedReceiver<OutputItem>,
    pub started: oneshot::Receiver<u32>,
    pub end: oneshot::Receiver<ProcessEnd>,
    /// Stdin bytes the guest allows, as permits (starts at [`crate::protocol::STDIN_WINDOW`]);
    /// closed when the process or the instance ends.
    pub stdin_credit: Arc<Semaphore>,
}

struct Slot {
    stdout: Option<mpsc::UnboundedSender<OutputItem>>,
    stderr: Option<mpsc::UnboundedSender<OutputItem>>,
    started: Option<oneshot::Sender<u32>>,
    end: Option<oneshot::Sender<ProcessEnd>>,
    stdin_credit: Arc<Semaphore>,
    /// Output bytes received and not yet credited back, per stream: the guest may never have
    /// more than [`OUTPUT_WINDOW`] outstanding.
    outstanding: [u64; 2],
    /// Bytes discarded (their reader is gone) and not yet credited, per stream.
    discarded: [u64; 2],
}

#[derive(Default)]
struct State {
    procs: HashMap<u32, Slot>,
    /// File operations waiting for their reply.
    fs: HashMap<u32, oneshot::Sender<FsReply>>,
    /// Set once the channel is unusable; new processes fail with this reason.
    gone: Option<String>,
}

/// A live control channel.
pub(crate) struct Control {
    outgoing: mpsc::UnboundedSender<Vec<u8>>,
    state: Mutex<State>,
    /// Notified when the guest broke the protocol: the instance must stop the VM.
    pub violated: Arc<Notify>,
    /// Notified when the connection ended without a protocol violation (EOF or I/O error).
    /// The instance then finds out from the VMM why, and ends pending processes with that.
    pub closed: Arc<Notify>,
    /// The protocol error, if that is why the channel ended.
    pub violation: Mutex<Option<ProtocolError>>,
}

impl Control {
    /// Starts the reader and writer tasks on an established (post-handshake) stream.
    pub fn start<S>(stream: S, decoder: FrameDecoder) -> Arc<Control>
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (mut reader, mut writer) = tokio::io::split(stream);
        let (outgoing, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let control = Arc::new(Control {
            outgoing,
            state: Mutex::new(State::default()),
            violated: Arc::new(Notify::new()),
            closed: Arc::new(Notify::new()),
            violation: Mutex::new(None),
        });

        tokio::spawn(async move {
            while let Some(mut batch) = rx.recv().await {
                // Whatever else is already queued goes in the same write: libkrun turns each
                // read of its socket into one vsock packet, and fewer, fuller packets cost the
                // guest less (see guest-init's vsock module on packet-count limits).
                while batch.len() < WRITE_BATCH {
                    match rx.try_recv() {
                        Ok(more) => batch.extend_from_slice(&more),
                        Err(_) => break,
                    }
                }
                if writer.write_all(&batch).await.is_err() {
                    break;
                }
            }
        });

        let c = control.clone();
        tokio::spawn(async move {
            let mut decoder = decoder;
            let mut buf = vec![0u8; 256 * 1024];
            loop {
                match read_message(&mut reader, &mut decoder, &mut buf).await {
                    Ok(Some(message)) => {
                        if let Err(err) = c.dispatch(message) {
                            break c.fail_all(c.violate(err));
                        }
                    }
                    Err(Error::Protocol(err)) => break c.fail_all(c.violate(err)),
                    Ok(None) | Err(_) => break c.closed.notify_one(),
                }
            }
        });
        control
    }

    fn violate(&self, err: ProtocolError) -> String {
        tracing::warn!(error = %err, "guest broke the control protocol; stopping the instance");
        let reason = format!("the guest broke the control protocol: {err}");
        *self.violation.lock().unwrap_or_else(|p| p.into_inner()) = Some(err);
        self.violated.notify_one();
        reason
    }

    fn dispatch(&self, message: GuestMessage) -> Result<(), ProtocolError> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let unknown = |id: u32| ProtocolError::Malformed {
            message: "process message",
            reason: format!("no process with id {id}"),
        };
        match message {
            GuestMessage::Started(started) => {
                let slot = state
                    .procs
                    .get_mut(&started.id)
                    .ok_or(unknown(started.id))?;
                if let Some(tx) = slot.started.take() {
                    let _ = tx.send(started.pid);
                }
            }
            GuestMessage::Output(output) => {
                let slot = state.procs.get_mut(&output.id).ok_or(unknown(output.id))?;
                let index = output.stream as usize;
                slot.outstanding[index] += output.data.len() as u64;
                if slot.outstanding[index] > u64::from(OUTPUT_WINDOW) {
                    return Err(ProtocolError::OutOfBounds {
                        field: "output flow control",
                        detail: format!(
                            "the guest sent {} bytes of {:?} past its credit",
                            slot.outstanding[index] - u64::from(OUTPUT_WINDOW),
                            output.stream
                        ),
                    });
                }
                let tx = match output.stream {
                    Stream::Stdout => &slot.stdout,
                    Stream::Stderr => &slot.stderr,
                };
                let len = output.data.len() as u32;
                let delivered = tx
                    .as_ref()
                    .is_some_and(|tx| tx.send(OutputItem::Data(output.data.into_vec())).is_ok());
                if !delivered {
                    // Nobody reads this stream any more: discard, and let the guest go on.
                    // Credit in quarter windows, like a reader does: one tiny message per
                    // discarded chunk would flood the guest's vsock queue with packets.
                    slot.discarded[index] += u64::from(len);
                    if slot.discarded[index] >= u64::from(OUTPUT_WINDOW / 4) {
                        let bytes = std::mem::take(&mut slot.discarded[index]);
                        slot.outstanding[index] -= bytes;
                        let credit = crate::protocol::Credit {
                            id: output.id,
                            stream: output.stream,
                            bytes: bytes as u32,
                        };
                        if let Ok(bytes) = HostMessage::Credit(credit).encode() {
                            let _ = self.outgoing.send(bytes);
                        }
                    }
                }
            }
            GuestMessage::Exited(exited) => {
                let mut slot = state.procs.remove(&exited.id).ok_or(unknown(exited.id))?;
                slot.stdin_credit.close();
                if let Some(tx) = slot.end.take() {
                    let _ = tx.send(ProcessEnd::Exited(exited));
                }
            }
            GuestMessage::ExecFailed(failed) => {
                let mut slot = state.procs.remove(&failed.id).ok_or(unknown(failed.id))?;
                if let Some(tx) = slot.end.take() {
                    let _ = tx.send(ProcessEnd::Failed(failed));
                }
            }
            GuestMessage::StdinCredit(credit) => {
                // A process that already ended may still have credit in flight.
                if let Some(slot) = state.procs.get(&credit.id) {
                    let room = Semaphore::MAX_PERMITS - slot.stdin_credit.available_permits();
                    slot.stdin_credit
                        .add_permits((credit.bytes as usize).min(room));
                }
            }
            GuestMessage::FsReply(reply) => {
                let tx = state.fs.remove(&reply.id).ok_or(ProtocolError::Malformed {
                    message: "FsReply",
                    reason: format!("no file operation with id {}", reply.id),
                })?;
                let _ = tx.send(reply);
            }
            other @ (GuestMessage::Hello(_)
            | GuestMessage::Ready
            | GuestMessage::SetupFailed(_)) => {
                return Err(ProtocolError::Malformed {
                    message: "control",
                    reason: format!("{} after setup", message_name(&other)),
                });
            }
        }
        Ok(())
    }

    /// Ends every pending process with `reason` and refuses new ones.
    pub fn fail_all(&self, reason: String) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.gone.is_none() {
            state.gone = Some(reason.clone());
        }
        for (_, mut slot) in state.procs.drain() {
            for tx in [slot.stdout.take(), slot.stderr.take()]
                .into_iter()
                .flatten()
            {
                let _ = tx.send(OutputItem::Broken(reason.clone()));
            }
            if let Some(tx) = slot.end.take() {
                let _ = tx.send(ProcessEnd::Gone(reason.clone()));
            }
            slot.stdin_credit.close();
        }
        // Dropping the senders wakes every file operation with a closed-channel error.
        state.fs.clear();
    }

    /// Why the channel is unusable, if it is.
    pub fn gone(&self) -> Option<String> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .gone
            .clone()
    }

    /// Registers process `id` (before its Exec is sent, so no message can outrun the slot).
    pub fn register(&self, id: u32) -> Result<ProcessChannels> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = &state.gone {
            return Err(Error::InstanceGone {
                reason: reason.clone(),
            });
        }
        let (out_tx, stdout) = mpsc::unbounded_channel();
        let (err_tx, stderr) = mpsc::unbounded_channel();
        let (started_tx, started) = oneshot::channel();
        let (end_tx, end) = oneshot::channel();
        let stdin_credit = Arc::new(Semaphore::new(crate::protocol::STDIN_WINDOW as usize));
        state.procs.insert(
            id,
            Slot {
                stdout: Some(out_tx),
                stderr: Some(err_tx),
                started: Some(started_tx),
                end: Some(end_tx),
                stdin_credit: stdin_credit.clone(),
                outstanding: [0, 0],
                discarded: [0, 0],
            },
        );
        Ok(ProcessChannels {
            stdout,
            stderr,
            started,
            end,
            stdin_credit,
        })
    }

    /// Records that the host consumed `bytes` of a stream and tells the guest it may send more.
    pub fn credit(&self, id: u32, stream: Stream, bytes: u32) {
        {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            match state.procs.get_mut(&id) {
                Some(slot) => {
                    let o = &mut slot.outstanding[stream as usize];
                    *o = o.saturating_sub(u64::from(bytes));
                }
                // Ended: the guest has nothing more to send.
                None => return,
            }
        }
        let _ = self.send(&HostMessage::Credit(crate::protocol::Credit {
            id,
            stream,
            bytes,
        }));
    }

    /// Registers file operation `id` (before its request is sent) and returns where its reply
    /// will arrive. The receiver errors if the instance stops first.
    pub fn register_fs(&self, id: u32) -> Result<oneshot::Receiver<FsReply>> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = &state.gone {
            return Err(Error::InstanceGone {
                reason: reason.clone(),
            });
        }
        let (tx, rx) = oneshot::channel();
        state.fs.insert(id, tx);
        Ok(rx)
    }

    /// Queues a message for the guest.
    pub fn send(&self, message: &HostMessage) -> Result<()> {
        let bytes = message.encode()?;
        self.outgoing.send(bytes).map_err(|_| Error::InstanceGone {
            reason: self
                .gone()
                .unwrap_or_else(|| "the control channel is closed".into()),
        })
    }
}
