//! The host end of the control channel: handshake, then one reader and one writer task
//! multiplexing every process of an instance by id.
//!
//! Every byte from the guest goes through [`FrameDecoder`] and [`GuestMessage::decode`], which
//! bound and validate it; the first violation stops the instance (the guest is hostile, and a
//! stream cannot be resynchronised after garbage).
//!
//! A third task checks that the guest is alive ([`Liveness`]): a guest that leaves a ping
//! unanswered and sends nothing else for the liveness timeout is declared hung.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::{mpsc, oneshot, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, MissedTickBehavior};
use tracing::Instrument;

use crate::error::{Error, Result};
use crate::limits::Limits;
use crate::output_queue::{output_queue, OutputReceiver, OutputSender};
use crate::pause_clock::{GuestDeadline, PauseClock};
use crate::protocol::fs::FsReply;
use crate::protocol::{
    ExecFailed, Exited, FrameDecoder, GuestMessage, Hello, HostMessage, Ping, ProtocolError, Setup,
    Stream, OUTPUT_WINDOW, PROTOCOL_VERSION, STDIN_WINDOW,
};

mod quiesce;
pub(crate) use quiesce::rejoin_handshake;

/// What the writer task writes: bytes, or the last bytes before it stops and hands back the
/// connection's write half ([`HostMessage::Quiesce`]); what follows waits in the queue until a
/// writer takes it again.
enum Outgoing {
    Bytes(Vec<u8>),
    Last(Vec<u8>, oneshot::Sender<Writer>),
}

/// A connection's write half, between writer tasks.
type Writer = Box<dyn AsyncWrite + Send + Unpin>;

/// The queue of bytes for the guest, held by the writer task of the current connection.
type Queue = Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Outgoing>>>;

/// Host-to-guest messages gathered into one write, at most (about) this many bytes.
const WRITE_BATCH: usize = 256 * 1024;

/// The longest pause between liveness pings.
const MAX_PING_INTERVAL: Duration = Duration::from_secs(5);

/// How the host checks that the guest is alive.
///
/// Every `interval` the host sends a [`Ping`] unless one is already unanswered. Any bytes from
/// the guest count as a sign of life (a guest streaming output need not answer at all; a pong
/// is what an idle guest sends). A guest that leaves a ping unanswered and sends nothing for
/// `timeout` is declared hung. A guest that freezes is therefore noticed between
/// `timeout - interval` and `timeout + interval` after it froze.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Liveness {
    pub timeout: Duration,
    pub interval: Duration,
}

impl Liveness {
    /// A check with this timeout, pinging every 5 s (or every quarter of a shorter timeout).
    pub fn new(timeout: Duration) -> Self {
        Liveness {
            timeout,
            interval: (timeout / 4).min(MAX_PING_INTERVAL),
        }
    }
}

/// Why the channel is unusable.
#[derive(Debug, Clone)]
pub(crate) enum Gone {
    /// The instance stopped (shut down, dropped, the VM ended, or the guest broke the
    /// protocol): why.
    Stopped(String),
    /// The liveness check found the guest silent for this long with a ping outstanding.
    Hung(Duration),
}

impl Gone {
    /// The error a pending or new call reports.
    pub fn error(&self) -> Error {
        match self {
            Gone::Stopped(reason) => Error::InstanceGone {
                reason: reason.clone(),
            },
            Gone::Hung(silent_for) => Error::GuestHung {
                silent_for: *silent_for,
            },
        }
    }
}

impl std::fmt::Display for Gone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Gone::Stopped(reason) => f.write_str(reason),
            Gone::Hung(_) => write!(f, "{}", self.error()),
        }
    }
}

/// The guest's half of the stream, counting reads that brought bytes: the liveness check's
/// evidence of progress.
struct Counting<R> {
    inner: R,
    reads: Arc<AtomicU64>,
}

impl<R: AsyncRead + Unpin> AsyncRead for Counting<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.reads.fetch_add(1, Ordering::Relaxed);
        }
        result
    }
}

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
        GuestMessage::Pong(_) => "Pong",
        GuestMessage::Quiesced(_) => "Quiesced",
        GuestMessage::Rejoin(_) => "Rejoin",
    }
}

/// How a process's life ended, as seen by the host.
#[derive(Debug)]
pub(crate) enum ProcessEnd {
    Exited(Exited),
    Failed(ExecFailed),
    /// The instance stopped (or was declared hung) first.
    Gone(Gone),
}

/// What a process's output channel carries.
#[derive(Debug)]
pub(crate) enum OutputItem {
    /// Bytes the process wrote.
    Data(Vec<u8>),
    /// The instance stopped before the process ended: the stream is incomplete, and a reader
    /// must hear that instead of a clean end of file.
    Broken(Gone),
}

impl crate::output_queue::Mergeable for OutputItem {
    fn merge_len(&self) -> Option<usize> {
        match self {
            OutputItem::Data(data) => Some(data.len()),
            OutputItem::Broken(_) => None,
        }
    }

    fn merge(&mut self, later: Self) -> Result<(), Self> {
        match (self, later) {
            (OutputItem::Data(data), OutputItem::Data(more)) => {
                data.extend_from_slice(&more);
                Ok(())
            }
            (_, later) => Err(later),
        }
    }
}

/// A process's host-side state in a snapshot, for the restored instance to take over
/// ([`Control::saved_processes`], [`Control::adopt`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SavedProcess {
    /// The control channel's id for it.
    pub key: u32,
    /// The guest's pid, if it had started.
    pub pid: Option<u32>,
    pub pty: bool,
    /// Output bytes received and not credited, per stream (stdout, stderr).
    pub outstanding: [u64; 2],
    /// Stdin bytes sent and not credited by the guest.
    pub stdin_outstanding: u64,
}

/// The receiving ends for one process.
pub(crate) struct ProcessChannels {
    pub stdout: OutputReceiver<OutputItem>,
    pub stderr: OutputReceiver<OutputItem>,
    pub started: oneshot::Receiver<u32>,
    pub end: oneshot::Receiver<ProcessEnd>,
    /// Stdin bytes the guest allows, as permits (starts at [`crate::protocol::STDIN_WINDOW`]);
    /// closed when the process or the instance ends.
    pub stdin_credit: Arc<Semaphore>,
}

struct Slot {
    /// The guest's pid, once guest-init said it started.
    pid: Option<u32>,
    /// It runs in a pty (one output stream).
    pty: bool,
    stdout: Option<OutputSender<OutputItem>>,
    stderr: Option<OutputSender<OutputItem>>,
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
    /// File operations waiting for their reply, each holding one of
    /// [`Limits::max_pending_file_requests`] slots until the guest answers (also after the
    /// caller gave up on it: its reply is still expected, and not a protocol violation).
    fs: HashMap<u32, (oneshot::Sender<FsReply>, OwnedSemaphorePermit)>,
    /// Set once the channel is unusable; new processes fail with this reason.
    gone: Option<Gone>,
}

/// A live control channel.
pub(crate) struct Control {
    outgoing: mpsc::UnboundedSender<Outgoing>,
    /// The writer tasks' queue (one connection's writer at a time holds it; a channel, never
    /// left half-changed by a panic: unwind-safe as the rest of `Control` is).
    queue: std::panic::AssertUnwindSafe<Queue>,
    /// The token of the [`HostMessage::Quiesce`] sent, until the guest's `Quiesced` echoes it.
    quiescing: Mutex<Option<u64>>,
    /// Notified when the guest's `Quiesced` arrived.
    quiesced: Arc<Notify>,
    /// Set from the guest's `Quiesced` until the host resumes it: a frame from the guest
    /// meanwhile breaks the protocol.
    still: AtomicBool,
    /// The stopped writer's write half, once a quiesce was sent.
    parked: Mutex<Option<oneshot::Receiver<Writer>>>,
    /// A restored instance's processes, until taken over ([`Control::adopt`]).
    adopted: Mutex<HashMap<u32, (SavedProcess, ProcessChannels)>>,
    state: Mutex<State>,
    /// Notified when the guest broke the protocol: the instance must stop the VM.
    pub violated: Arc<Notify>,
    /// Notified when the connection ended without a protocol violation (EOF or I/O error).
    /// The instance then finds out from the VMM why, and ends pending processes with that.
    pub closed: Arc<Notify>,
    /// The protocol error, if that is why the channel ended.
    pub violation: Mutex<Option<ProtocolError>>,
    /// Notified when the liveness check declared the guest hung: the instance must kill the
    /// VMM.
    pub hung: Arc<Notify>,
    /// Reads from the guest that brought bytes.
    reads: Arc<AtomicU64>,
    /// Set when the reader stopped (end of stream, I/O error, violation): the connection's end
    /// is then the instance's to explain, not the liveness check's.
    reader_done: AtomicBool,
    /// The instance's bounds.
    pub limits: Limits,
    /// Slots for file requests waiting for the guest ([`Limits::max_pending_file_requests`]).
    fs_slots: Arc<Semaphore>,
    /// The next file request id (file requests have their own id space: the host keeps them
    /// apart from processes, and guest-init only echoes them).
    next_fs_id: AtomicU32,
    /// Whether the VM is paused, and for how long it has been.
    pause: Arc<PauseClock>,
}

impl Control {
    /// Starts the reader, writer and liveness tasks on an established (post-handshake) stream.
    #[allow(dead_code)] // the tests, the fuzz harness and the scripted guest adopt nothing
    pub fn start<S>(
        stream: S,
        decoder: FrameDecoder,
        liveness: Liveness,
        limits: Limits,
    ) -> Arc<Control>
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        Self::start_adopting(stream, decoder, liveness, limits, &[])
    }

    /// [`Control::start`] for a restored instance: the snapshot's `processes` are adopted
    /// ([`Control::adopt`]) before the reader starts, so that what the restored guest sends
    /// about them at once finds their slots.
    pub fn start_adopting<S>(
        stream: S,
        decoder: FrameDecoder,
        liveness: Liveness,
        limits: Limits,
        processes: &[SavedProcess],
    ) -> Arc<Control>
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (outgoing, rx) = mpsc::unbounded_channel::<Outgoing>();
        let control = Arc::new(Control {
            outgoing,
            queue: std::panic::AssertUnwindSafe(Arc::new(tokio::sync::Mutex::new(rx))),
            quiescing: Mutex::new(None),
            quiesced: Arc::new(Notify::new()),
            still: AtomicBool::new(false),
            parked: Mutex::new(None),
            adopted: Mutex::new(HashMap::new()),
            state: Mutex::new(State::default()),
            violated: Arc::new(Notify::new()),
            closed: Arc::new(Notify::new()),
            violation: Mutex::new(None),
            hung: Arc::new(Notify::new()),
            reads: Arc::new(AtomicU64::new(0)),
            reader_done: AtomicBool::new(false),
            fs_slots: Arc::new(Semaphore::new(limits.max_pending_file_requests)),
            next_fs_id: AtomicU32::new(1),
            pause: Arc::new(PauseClock::default()),
            limits,
        });
        tokio::spawn(watch_liveness(Arc::downgrade(&control), liveness).in_current_span());
        control.adopt(processes);
        control.connect(stream, decoder);
        control
    }

    /// Serves `stream` (a connection past its handshake): a writer task takes the queue, a
    /// reader task dispatches what the guest sends.
    fn connect<S>(self: &Arc<Self>, stream: S, decoder: FrameDecoder)
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (reader, writer) = tokio::io::split(stream);
        let reader = Counting {
            inner: reader,
            reads: self.reads.clone(),
        };
        self.reader_done.store(false, Ordering::SeqCst);
        tokio::spawn(write_queue(Arc::clone(&self.queue), Box::new(writer)).in_current_span());
        tokio::spawn(read_guest(self.clone(), reader, decoder).in_current_span());
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
                slot.pid = Some(started.pid);
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
                            let _ = self.outgoing.send(Outgoing::Bytes(bytes));
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
                // As for Exited: a writer to the stdin of a process that is gone must hear so,
                // not wait for credit that can no longer come.
                slot.stdin_credit.close();
                if let Some(tx) = slot.end.take() {
                    let _ = tx.send(ProcessEnd::Failed(failed));
                }
            }
            GuestMessage::StdinCredit(credit) => {
                // A process that already ended may still have credit in flight.
                if let Some(slot) = state.procs.get(&credit.id) {
                    // A permit leaves the semaphore before its byte is sent, so the bytes the
                    // guest may still credit are at most the window minus the permits left.
                    // Credit beyond that would let the host queue more stdin than the window
                    // (docs/architecture.md, flow control): a forged message.
                    let window = STDIN_WINDOW as usize;
                    let outstanding = window.saturating_sub(slot.stdin_credit.available_permits());
                    if credit.bytes as usize > outstanding {
                        return Err(ProtocolError::OutOfBounds {
                            field: "stdin flow control",
                            detail: format!(
                                "the guest credited {} stdin bytes, but only {outstanding} were \
                                 outstanding",
                                credit.bytes
                            ),
                        });
                    }
                    slot.stdin_credit.add_permits(credit.bytes as usize);
                }
            }
            // Its arrival is what counts (see `Liveness`); a seq we never sent is harmless.
            GuestMessage::Pong(_) => {}
            GuestMessage::FsReply(reply) => {
                // Removing the entry frees its slot, whether or not the caller still waits.
                let (tx, _slot) = state.fs.remove(&reply.id).ok_or(ProtocolError::Malformed {
                    message: "FsReply",
                    reason: format!("no file operation with id {}", reply.id),
                })?;
                let _ = tx.send(reply);
            }
            other @ (GuestMessage::Hello(_)
            | GuestMessage::Ready
            | GuestMessage::SetupFailed(_)
            | GuestMessage::Quiesced(_)
            | GuestMessage::Rejoin(_)) => {
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
        self.fail(Gone::Stopped(reason));
    }

    /// Ends every pending call with the first reason the channel became unusable (this one,
    /// unless it already was) and refuses new ones.
    fn fail(&self, reason: Gone) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let reason = state.gone.get_or_insert(reason).clone();
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

    /// The liveness check found the guest silent: every pending call fails, and the instance
    /// is told to kill the VMM.
    fn declare_hung(&self, silent_for: Duration) {
        tracing::warn!(
            ?silent_for,
            "the guest left a liveness ping unanswered and sent nothing else; killing the VM"
        );
        self.fail(Gone::Hung(silent_for));
        self.hung.notify_one();
    }

    /// Marks the VM paused (or running again). While paused, new processes fail with
    /// [`Error::Paused`] (file operations check it as they start: `files/request.rs`), the
    /// deadlines made by [`Self::deadline`] stand still, and the liveness check sends no pings
    /// and blames no silence; from resuming on, it starts a new round.
    pub fn set_paused(&self, paused: bool) {
        self.pause.set(paused);
    }

    /// Whether the VM is marked paused.
    pub fn is_paused(&self) -> bool {
        self.pause.is_paused()
    }

    /// A deadline `after` from now in the guest's running time (pauses do not count).
    pub fn deadline(&self, after: Duration) -> GuestDeadline {
        GuestDeadline::after(&self.pause, after)
    }

    /// Why the channel is unusable, if it is.
    pub fn gone(&self) -> Option<Gone> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .gone
            .clone()
    }

    /// Registers process `id` (before its Exec is sent, so no message can outrun the slot).
    #[allow(dead_code)] // tests and the fuzz harness register processes without a pty
    pub fn register(&self, id: u32) -> Result<ProcessChannels> {
        self.register_process(id, false)
    }

    /// [`Control::register`], saying whether the process runs in a pty.
    pub fn register_process(&self, id: u32, pty: bool) -> Result<ProcessChannels> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = &state.gone {
            return Err(reason.error());
        }
        // No new process while paused (a file operation's next chunk is no new work: it
        // waits for the resume, within its own deadline that the pause does not use up).
        if self.pause.is_paused() {
            return Err(Error::Paused);
        }
        // A slot lives until the guest reports the process ended: a guest that never does
        // cannot make the host track processes without bound.
        if state.procs.len() >= self.limits.max_processes {
            return Err(Error::TooMany {
                what: "running processes",
                limit: self.limits.max_processes,
                knob: "max_processes",
            });
        }
        let (out_tx, stdout) = output_queue();
        let (err_tx, stderr) = output_queue();
        let (started_tx, started) = oneshot::channel();
        let (end_tx, end) = oneshot::channel();
        let stdin_credit = Arc::new(Semaphore::new(crate::protocol::STDIN_WINDOW as usize));
        state.procs.insert(
            id,
            Slot {
                pid: None,
                pty,
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
        // The count and the message move together (under the lock): a snapshot's count of
        // what is outstanding is then exactly what the guest has not been credited.
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match state.procs.get_mut(&id) {
            Some(slot) => {
                let o = &mut slot.outstanding[stream as usize];
                *o = o.saturating_sub(u64::from(bytes));
            }
            // Ended: the guest has nothing more to send.
            None => return,
        }
        let _ = self.send(&HostMessage::Credit(crate::protocol::Credit {
            id,
            stream,
            bytes,
        }));
        drop(state);
    }

    /// Registers process `id` and queues its `Exec` (`message`) as one step, refused while the
    /// VM is paused: an `Exec` is never queued behind a quiesce, so a snapshot's processes
    /// are exactly those whose `Exec` the guest read.
    pub fn register_and_send(
        &self,
        id: u32,
        pty: bool,
        message: &HostMessage,
    ) -> Result<ProcessChannels> {
        let bytes = message.encode()?;
        let channels = self.register_process(id, pty)?;
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if self.pause.is_paused() {
            drop(state);
            self.state
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .procs
                .remove(&id);
            return Err(Error::Paused);
        }
        let sent = self.outgoing.send(Outgoing::Bytes(bytes));
        drop(state);
        if sent.is_err() {
            return Err(self
                .gone()
                .unwrap_or_else(|| Gone::Stopped("the control channel is closed".into()))
                .error());
        }
        Ok(channels)
    }

    /// A fresh id for a file request.
    pub fn next_fs_id(&self) -> u32 {
        self.next_fs_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers file operation `id` (before its request is sent) and returns where its reply
    /// will arrive. The receiver errors if the instance stops first. Fails with
    /// [`Error::TooMany`] when [`Limits::max_pending_file_requests`] requests already wait.
    pub fn register_fs(&self, id: u32) -> Result<oneshot::Receiver<FsReply>> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(reason) = &state.gone {
            return Err(reason.error());
        }
        let slot = self
            .fs_slots
            .clone()
            .try_acquire_owned()
            .map_err(|_| Error::TooMany {
                what: "file requests waiting for the guest",
                limit: self.limits.max_pending_file_requests,
                knob: "max_pending_file_requests",
            })?;
        let (tx, rx) = oneshot::channel();
        state.fs.insert(id, (tx, slot));
        Ok(rx)
    }

    /// Queues a message for the guest.
    pub fn send(&self, message: &HostMessage) -> Result<()> {
        let bytes = message.encode()?;
        self.outgoing.send(Outgoing::Bytes(bytes)).map_err(|_| {
            self.gone()
                .unwrap_or_else(|| Gone::Stopped("the control channel is closed".into()))
                .error()
        })
    }
}

/// The writer task: writes what the queue holds, several messages in one write, until the
/// connection fails or it wrote the last bytes of a quiesce (then it hands the write half back).
async fn write_queue(queue: Queue, mut writer: Writer) {
    // A stopped writer lets go of the queue when it ends.
    let mut rx = queue.lock_owned().await;
    while let Some(first) = rx.recv().await {
        let (mut batch, mut last) = match first {
            Outgoing::Bytes(bytes) => (bytes, None),
            Outgoing::Last(bytes, hand_back) => (bytes, Some(hand_back)),
        };
        // Whatever else is already queued goes in the same write: libkrun turns each read of
        // its socket into one vsock packet, and fewer, fuller packets cost the guest less (see
        // guest-init's vsock module on packet-count limits).
        while last.is_none() && batch.len() < WRITE_BATCH {
            match rx.try_recv() {
                Ok(Outgoing::Bytes(more)) => batch.extend_from_slice(&more),
                Ok(Outgoing::Last(more, hand_back)) => {
                    batch.extend_from_slice(&more);
                    last = Some(hand_back);
                }
                Err(_) => break,
            }
        }
        if writer.write_all(&batch).await.is_err() {
            break;
        }
        if let Some(hand_back) = last {
            let _ = hand_back.send(writer);
            break;
        }
    }
}

/// The reader task of one connection: dispatches every message (the guest's `Quiesced` to
/// whoever quiesced it).
async fn read_guest<R: AsyncRead + Unpin>(c: Arc<Control>, mut reader: R, decoder: FrameDecoder) {
    let mut decoder = decoder;
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        let violation = match read_message(&mut reader, &mut decoder, &mut buf).await {
            Ok(Some(message)) if c.still.load(Ordering::SeqCst) => ProtocolError::Malformed {
                message: "control",
                reason: format!("{} while quiesced", message_name(&message)),
            },
            Ok(Some(GuestMessage::Quiesced(q))) if c.take_quiescing(q.token) => {
                c.still.store(true, Ordering::SeqCst);
                c.quiesced.notify_one();
                continue;
            }
            Ok(Some(message)) => match c.dispatch(message) {
                Ok(()) => continue,
                Err(err) => err,
            },
            Err(Error::Protocol(err)) => err,
            Ok(None) | Err(_) => {
                c.closed.notify_one();
                break;
            }
        };
        c.fail_all(c.violate(violation));
        break;
    }
    c.reader_done.store(true, Ordering::SeqCst);
}

/// The liveness task: pings the guest and declares it hung when a ping stays unanswered and
/// nothing else arrives for `liveness.timeout` (see [`Liveness`]). Ends with the channel.
async fn watch_liveness(control: Weak<Control>, liveness: Liveness) {
    let mut ticker =
        tokio::time::interval_at(Instant::now() + liveness.interval, liveness.interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut seq = 0u64;
    // The first ping sent since the guest was last heard from: when, and the read count then.
    let mut silent: Option<(Instant, u64)> = None;
    let mut last_wake = Instant::now();
    loop {
        let deadline = silent.map(|(sent, _)| sent + liveness.timeout);
        tokio::select! {
            _ = ticker.tick() => {}
            _ = tokio::time::sleep_until(deadline.unwrap_or(last_wake)), if deadline.is_some() => {}
        }
        let Some(control) = control.upgrade() else {
            return;
        };
        if control.gone().is_some() || control.reader_done.load(Ordering::SeqCst) {
            return;
        }
        let now = Instant::now();
        // This task wakes at least every interval. A longer gap means the host's own runtime
        // was starved (then the reader may not have had its turn either): start over rather
        // than blame the guest.
        let starved = now.duration_since(last_wake) > liveness.interval * 2;
        last_wake = now;
        if control.is_paused() {
            // A paused VM answers nothing: no ping, no blame, and a new round on resuming.
            silent = None;
            continue;
        }
        let reads = control.reads.load(Ordering::Relaxed);
        match silent {
            // Heard from (or we cannot tell): a new round with a new ping.
            Some((_, seen)) if reads != seen || starved => {}
            Some((sent, _)) if now.duration_since(sent) >= liveness.timeout => {
                return control.declare_hung(now.duration_since(sent));
            }
            // Still waiting for an answer to the outstanding ping.
            Some(_) => continue,
            None => {}
        }
        seq = seq.wrapping_add(1);
        if control.send(&HostMessage::Ping(Ping { seq })).is_err() {
            return;
        }
        silent = Some((now, reads));
    }
}

#[cfg(test)]
mod tests {
    //! The liveness check, against a scripted guest over an in-memory stream, in tokio's
    //! paused time (so minutes of silence take no time and the bounds are exact).

    use serde_bytes::ByteBuf;
    use tokio::io::{DuplexStream, ReadHalf, WriteHalf};

    use super::*;
    use crate::protocol::{Output, Pong, Quiesce, Resume};

    const TIMEOUT: Duration = Duration::from_secs(10);

    /// The guest's side: answers pings while `answer` is set (and reads everything always, as
    /// a frozen guest's socket buffer would accept bytes for a while), counting them.
    async fn fake_guest(
        mut reader: ReadHalf<DuplexStream>,
        writer: Arc<tokio::sync::Mutex<WriteHalf<DuplexStream>>>,
        answer: Arc<AtomicBool>,
        pings: Arc<AtomicU64>,
    ) {
        let mut decoder = FrameDecoder::new();
        let mut buf = vec![0u8; 4096];
        loop {
            while let Some(frame) = decoder.next_frame().unwrap() {
                if let HostMessage::Ping(ping) = HostMessage::decode(&frame).unwrap() {
                    pings.fetch_add(1, Ordering::SeqCst);
                    if answer.load(Ordering::SeqCst) {
                        let pong = GuestMessage::Pong(Pong { seq: ping.seq }).encode().unwrap();
                        writer.lock().await.write_all(&pong).await.unwrap();
                    }
                }
            }
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => decoder.push(&buf[..n]).unwrap(),
            }
        }
    }

    struct Setup {
        control: Arc<Control>,
        writer: Arc<tokio::sync::Mutex<WriteHalf<DuplexStream>>>,
        answer: Arc<AtomicBool>,
        pings: Arc<AtomicU64>,
        guest: tokio::task::JoinHandle<()>,
    }

    fn setup() -> Setup {
        let (host, guest) = tokio::io::duplex(1 << 20);
        let control = Control::start(
            host,
            FrameDecoder::new(),
            Liveness::new(TIMEOUT),
            Limits::default(),
        );
        let (reader, writer) = tokio::io::split(guest);
        let writer = Arc::new(tokio::sync::Mutex::new(writer));
        let answer = Arc::new(AtomicBool::new(true));
        let pings = Arc::new(AtomicU64::new(0));
        let guest = tokio::spawn(fake_guest(
            reader,
            writer.clone(),
            answer.clone(),
            pings.clone(),
        ));
        Setup {
            control,
            writer,
            answer,
            pings,
            guest,
        }
    }

    /// A process that failed after it started (ExecFailed after Started) closes its stdin
    /// like one that exited: a writer fails at once instead of waiting forever for credit.
    /// (Found by the host_dispatch fuzz target.)
    #[tokio::test(start_paused = true)]
    async fn exec_failed_closes_stdin() {
        let s = setup();
        let process = s.control.register(1).unwrap();
        let mut writer = s.writer.lock().await;
        for message in [
            GuestMessage::Started(crate::protocol::Started { id: 1, pid: 7 }),
            GuestMessage::ExecFailed(ExecFailed {
                id: 1,
                kind: crate::protocol::ExecErrorKind::Other,
                errno: 0,
                message: "the process failed".into(),
            }),
        ] {
            writer.write_all(&message.encode().unwrap()).await.unwrap();
        }
        drop(writer);
        assert!(matches!(process.end.await, Ok(ProcessEnd::Failed(_))));
        assert!(process.stdin_credit.is_closed());
        assert!(s.control.violation.lock().unwrap().is_none());
        s.guest.abort();
    }

    /// Stdin credit may return only bytes the host sent: the real amount is accepted, one byte
    /// more is a protocol violation that stops the instance.
    #[tokio::test(start_paused = true)]
    async fn stdin_credit_beyond_what_was_sent_is_a_violation() {
        let s = setup();
        let process = s.control.register(1).unwrap();
        let window = STDIN_WINDOW as usize;
        // As ChildStdin does: take permits for 1000 bytes, then "send" them.
        process
            .stdin_credit
            .acquire_many(1000)
            .await
            .unwrap()
            .forget();
        let credit = |bytes: u32| {
            GuestMessage::StdinCredit(crate::protocol::Credit {
                id: 1,
                stream: Stream::Stdout,
                bytes,
            })
            .encode()
            .unwrap()
        };
        s.writer
            .lock()
            .await
            .write_all(&credit(1000))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(s.control.violation.lock().unwrap().is_none());
        assert_eq!(process.stdin_credit.available_permits(), window);

        s.writer.lock().await.write_all(&credit(1)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let violation = s.control.violation.lock().unwrap().take();
        assert!(
            matches!(
                violation,
                Some(ProtocolError::OutOfBounds {
                    field: "stdin flow control",
                    ..
                })
            ),
            "{violation:?}"
        );
        // Host memory stayed bounded: the window never grew.
        assert_eq!(process.stdin_credit.available_permits(), window);
        s.guest.abort();
    }

    #[test]
    fn the_interval_is_five_seconds_or_a_quarter_of_a_shorter_timeout() {
        assert_eq!(
            Liveness::new(Duration::from_secs(30)).interval,
            Duration::from_secs(5)
        );
        assert_eq!(
            Liveness::new(Duration::from_secs(10)).interval,
            Duration::from_millis(2500)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_guest_that_stops_answering_is_declared_hung_and_every_pending_call_hears_it() {
        let s = setup();
        let mut process = s.control.register(1).unwrap();
        let fs = s.control.register_fs(2).unwrap();

        // Two minutes of a guest that answers: never declared hung, and pinged at a modest
        // rate (one ping per interval at most).
        tokio::time::sleep(Duration::from_secs(120)).await;
        assert!(s.control.gone().is_none());
        assert!(process.end.try_recv().is_err(), "still pending");

        // The guest freezes.
        s.answer.store(false, Ordering::SeqCst);
        let frozen = Instant::now();
        let end = tokio::time::timeout(TIMEOUT * 3, process.end)
            .await
            .expect("declared hung, not left waiting")
            .expect("the pending wait is answered");
        let elapsed = frozen.elapsed();
        let interval = Liveness::new(TIMEOUT).interval;
        assert!(
            elapsed >= TIMEOUT - interval && elapsed <= TIMEOUT + interval,
            "declared hung {elapsed:?} after the guest froze; the bound is {TIMEOUT:?} ± {interval:?}"
        );
        assert!(matches!(end, ProcessEnd::Gone(Gone::Hung(d)) if d >= TIMEOUT));
        // Every other pending call hears it too, as the typed error.
        assert!(matches!(
            process.stdout.recv().await,
            Some(OutputItem::Broken(Gone::Hung(_)))
        ));
        assert!(matches!(
            process.stderr.recv().await,
            Some(OutputItem::Broken(Gone::Hung(_)))
        ));
        assert!(fs.await.is_err());
        assert!(process.stdin_credit.is_closed());
        assert!(matches!(
            s.control.gone().map(|g| g.error()),
            Some(Error::GuestHung { .. })
        ));
        // The instance was told to kill the VMM (a stored permit: notified at once).
        tokio::time::timeout(Duration::from_millis(1), s.control.hung.notified())
            .await
            .expect("the hung notification");
        // New calls are refused with it.
        assert!(matches!(
            s.control.register(3).err(),
            Some(Error::GuestHung { .. })
        ));
        assert!(matches!(
            s.control.register_fs(4).err(),
            Some(Error::GuestHung { .. })
        ));
        let message = Gone::Hung(TIMEOUT).error().to_string();
        assert!(message.contains("boot a new one"), "{message}");

        // About 130 s at one ping per 2.5 s at most (one per round trip: a ping and the check
        // that sees its answer share a tick).
        let pings = s.pings.load(Ordering::SeqCst);
        assert!((20..=53).contains(&pings), "{pings} pings");
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_guest_is_alive_without_answering_a_single_ping() {
        let s = setup();
        s.answer.store(false, Ordering::SeqCst);
        let mut process = s.control.register(1).unwrap();
        // Output every 3 s for two minutes, and never a pong: any message is a sign of life.
        for _ in 0..40 {
            let output = GuestMessage::Output(Output {
                id: 1,
                stream: Stream::Stdout,
                data: ByteBuf::from(b"x".to_vec()),
            })
            .encode()
            .unwrap();
            s.writer.lock().await.write_all(&output).await.unwrap();
            tokio::time::sleep(Duration::from_secs(3)).await;
            assert!(s.control.gone().is_none(), "a streaming guest is alive");
        }
        assert!(process.end.try_recv().is_err(), "still pending");
        // Then silence: declared hung within the bound.
        let quiet = Instant::now();
        tokio::time::timeout(TIMEOUT * 3, process.end)
            .await
            .expect("declared hung once silent")
            .unwrap();
        assert!(quiet.elapsed() <= TIMEOUT + Liveness::new(TIMEOUT).interval);
    }

    #[tokio::test(start_paused = true)]
    async fn a_paused_guest_is_neither_pinged_nor_called_hung_and_new_work_is_refused() {
        let s = setup();
        let mut process = s.control.register(1).unwrap();
        tokio::time::sleep(TIMEOUT).await;
        s.answer.store(false, Ordering::SeqCst);
        s.control.set_paused(true);
        let pinged = s.pings.load(Ordering::SeqCst);
        // Ten timeouts of silence while paused: no ping sent, nothing declared.
        tokio::time::sleep(TIMEOUT * 10).await;
        assert!(s.control.gone().is_none());
        assert!(
            s.pings.load(Ordering::SeqCst) <= pinged + 1,
            "pings while paused"
        );
        assert!(matches!(s.control.register(2).err(), Some(Error::Paused)));
        // A file operation's next chunk is no new work: it is sent, to be answered on resume.
        assert!(s.control.register_fs(3).is_ok());
        assert!(
            process.end.try_recv().is_err(),
            "a running process stays pending"
        );
        // Resumed: checked again from a new round, so a guest still silent is declared hung
        // within the bound.
        s.control.set_paused(false);
        let resumed = Instant::now();
        tokio::time::timeout(TIMEOUT * 3, process.end)
            .await
            .expect("declared hung once silent after the resume")
            .unwrap();
        assert!(resumed.elapsed() <= TIMEOUT + Liveness::new(TIMEOUT).interval);
        assert!(resumed.elapsed() >= TIMEOUT - Liveness::new(TIMEOUT).interval);
    }

    #[tokio::test(start_paused = true)]
    async fn a_guest_that_hangs_up_is_not_called_hung() {
        let s = setup();
        let mut process = s.control.register(1).unwrap();
        // The guest closed its end of the connection (the VM is going down) while the host's
        // pings still find room: the VMM's exit status explains that, not the liveness check.
        s.answer.store(false, Ordering::SeqCst);
        s.writer.lock().await.shutdown().await.unwrap();
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(
            !s.guest.is_finished(),
            "the guest still reads what the host sends"
        );
        assert!(s.control.gone().is_none());
        assert!(process.end.try_recv().is_err());
        s.control.fail_all("the VM stopped".into());
        assert!(matches!(
            process.end.await,
            Ok(ProcessEnd::Gone(Gone::Stopped(_)))
        ));
    }

    /// The guest's side of a bare connection: the next host message, or `None` if none comes
    /// within a second (of tokio's paused time).
    async fn next_from_host(
        reader: &mut ReadHalf<DuplexStream>,
        decoder: &mut FrameDecoder,
    ) -> Option<HostMessage> {
        let mut buf = vec![0u8; 4096];
        loop {
            if let Some(frame) = decoder.next_frame().unwrap() {
                return Some(HostMessage::decode(&frame).unwrap());
            }
            let n = tokio::time::timeout(Duration::from_secs(1), reader.read(&mut buf))
                .await
                .ok()?
                .unwrap();
            decoder.push(&buf[..n]).unwrap();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiesced_channel_holds_what_the_host_sends_until_it_resumes() {
        let (host, guest) = tokio::io::duplex(1 << 20);
        let control = Control::start(
            host,
            FrameDecoder::new(),
            Liveness::new(TIMEOUT),
            Limits::default(),
        );
        let (mut reader, mut writer) = tokio::io::split(guest);
        let mut decoder = FrameDecoder::new();
        let _process = control.register(1).unwrap();
        control.set_paused(true);
        let quiescing = {
            let control = control.clone();
            tokio::spawn(async move { control.quiesce(7, Duration::from_secs(5)).await })
        };
        assert_eq!(
            next_from_host(&mut reader, &mut decoder).await,
            Some(HostMessage::Quiesce(Quiesce { token: 7 }))
        );
        // Sent while quiesced: it waits on the host, so nothing is in flight.
        control.credit(1, Stream::Stdout, 0);
        let quiesced = GuestMessage::Quiesced(Quiesce { token: 7 })
            .encode()
            .unwrap();
        writer.write_all(&quiesced).await.unwrap();
        quiescing.await.unwrap().unwrap();
        assert_eq!(next_from_host(&mut reader, &mut decoder).await, None);

        control.resume().await.unwrap();
        assert!(matches!(
            next_from_host(&mut reader, &mut decoder).await,
            Some(HostMessage::Resume(Resume { unix_time_ns })) if unix_time_ns > 0
        ));
        assert!(matches!(
            next_from_host(&mut reader, &mut decoder).await,
            Some(HostMessage::Credit(crate::protocol::Credit { id: 1, .. }))
        ));
        assert!(control.violation.lock().unwrap().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_guest_that_sends_while_quiesced_or_echoes_another_token_breaks_the_protocol() {
        for (token, after) in [(9, true), (8, false)] {
            let (host, guest) = tokio::io::duplex(1 << 20);
            let control = Control::start(
                host,
                FrameDecoder::new(),
                Liveness::new(TIMEOUT),
                Limits::default(),
            );
            let (_reader, mut writer) = tokio::io::split(guest);
            control.set_paused(true);
            let quiescing = {
                let control = control.clone();
                tokio::spawn(async move { control.quiesce(9, Duration::from_secs(5)).await })
            };
            let mut frames = GuestMessage::Quiesced(Quiesce { token }).encode().unwrap();
            if after {
                frames.extend(GuestMessage::Pong(Pong { seq: 1 }).encode().unwrap());
            }
            writer.write_all(&frames).await.unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
            let violation = control.violation.lock().unwrap().take();
            assert!(
                matches!(&violation, Some(ProtocolError::Malformed { .. })),
                "{violation:?}"
            );
            // A wrong token is no answer: the quiesce fails with the channel.
            if !after {
                assert!(quiescing.await.unwrap().is_err());
            }
        }
    }
}
