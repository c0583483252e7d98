//! Fuzzing entry points (not API): the `host_dispatch`, `net_link`, `dns_query` and
//! `http_request` targets in `fuzz/` and their replays in this crate's tests.
//!
//! [`host_dispatch`] plays a hostile guest against the host's real control channel
//! (`Control`: its reader, dispatch, flow control, liveness check and `fail_all`, and
//! optionally the handshake before it). The fuzz input is a script of operations: the guest
//! writes raw bytes or well-formed messages (encoded with the protocol crate), and the host side
//! spawns processes, requests files, reads, drops readers, writes stdin, lets time pass, and so
//! on. After each operation the host is allowed to settle, and the harness checks:
//!
//! - nothing panics and nothing hangs (the host settles within a bounded number of scheduler
//!   turns; time is tokio's paused clock, so the liveness check runs at no cost);
//! - every host→guest message decodes; the host never credits output it did not receive, nor
//!   sends stdin beyond [`STDIN_WINDOW`] plus what the guest credited;
//! - output queued in the host for a stream never exceeds [`OUTPUT_WINDOW`];
//! - a guest that has only sent honest messages (as the harness models them) is never refused,
//!   and the first dishonest one ends the connection with a typed protocol violation; the host
//!   stops reading only after a violation;
//! - a hang is declared only after the guest was silent, never after it hung up;
//! - at the end, every pending call (process ends, output readers, file requests, stdin) is
//!   answered, and a stream whose process did not end is broken off, never cleanly ended.

#![allow(missing_docs)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use serde_bytes::ByteBuf;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{oneshot, Notify, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::control::{self, Control, Gone, Liveness, OutputItem, ProcessEnd};
use crate::error::{Error, Result};
use crate::limits::Limits;
use crate::output_queue::{OutputReceiver, TryRecvError};
use crate::protocol::fs::{
    DirEntry, FileMeta, FileType, FsError, FsErrorKind, FsOk, FsOp, FsReply, FsRequest,
};
use crate::protocol::limits::MAX_CHUNK;
use crate::protocol::{
    Credit, Exec, ExecErrorKind, ExecFailed, ExitStatus, Exited, Failure, FrameDecoder,
    GuestMessage, Hello, HostMessage, Output, Pong, ProcessRef, RootMount, Setup, SignalProcess,
    Started, StdinData, Stream, OUTPUT_WINDOW, PROTOCOL_VERSION, STDIN_WINDOW,
};

/// The liveness timeout the harness runs with (the check pings every 2.5 s).
const LIVENESS_TIMEOUT: Duration = Duration::from_secs(10);
/// One step of simulated time: half the liveness check's interval.
const TIME_STEP: Duration = Duration::from_millis(1250);
/// Scheduler turns after which a host that still makes progress on its own is hung.
const SETTLE_LIMIT: usize = 10_000;
/// Bounds on one input's work, so every input stays fast.
const MAX_TIME_STEPS: usize = 64;
const MAX_GUEST_BYTES: usize = 32 << 20;
const MAX_SHORT_READS: usize = 4096;
/// The host tracks at most this many processes and file requests (small, to hit the bounds).
const MAX_PROCESSES: usize = 6;
const MAX_FILE_REQUESTS: usize = 4;

/// The operations of a script: one byte (modulo the count), then the operation's arguments.
/// Missing argument bytes read as zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
#[allow(missing_docs)]
pub enum Op {
    /// Guest: raw bytes (u16 length, then the bytes).
    Raw = 0,
    /// Guest: `Started` (process, u32 pid).
    Started,
    /// Guest: `Output` (process, stream, u16 length/4).
    Output,
    /// Guest: `Output` of its remaining credit plus an i8 delta (process, stream, delta).
    OutputCredit,
    /// Guest: `Exited` (process, code/signal flag, i32).
    Exited,
    /// Guest: `ExecFailed` (process).
    ExecFailed,
    /// Guest: `StdinCredit` (process, mode: < 0x80 the stdin it holds + mode - 0x40, else a u32).
    StdinCredit,
    /// Guest: `FsReply` (file request, result kind, u16 size).
    FsReply,
    /// Guest: `Pong` (u8 seq delta from the last ping).
    Pong,
    /// Guest: `Hello` (right version or not).
    Hello,
    /// Guest: `Ready`.
    Ready,
    /// Guest: `SetupFailed`.
    SetupFailed,
    /// Host: spawn a process (register, send Exec).
    Spawn,
    /// Host: request a file read.
    FsRequest,
    /// Host: read from a process's stream (process, stream, u16 bytes/16).
    Read,
    /// Host: drop a stream's reader (process, stream).
    DropReader,
    /// Host: write stdin (process, u16 bytes/4).
    WriteStdin,
    /// Host: close stdin (process).
    CloseStdin,
    /// Host: drop a child (kill it, drop its readers and waits).
    DropChild,
    /// Time passes, in 1.25 s steps (1 to 16 steps).
    Sleep,
    /// Guest: how many bytes one host read may take from now on.
    ReadSize,
    /// Guest: hang up.
    Eof,
    /// Host: the instance stopped (as when the VMM exits).
    FailAll,
    /// Guest: answer pings by itself (toggle).
    AutoPong,
}

const OPS: u8 = Op::AutoPong as u8 + 1;

impl Op {
    fn from_byte(b: u8) -> Op {
        const ALL: [Op; OPS as usize] = [
            Op::Raw,
            Op::Started,
            Op::Output,
            Op::OutputCredit,
            Op::Exited,
            Op::ExecFailed,
            Op::StdinCredit,
            Op::FsReply,
            Op::Pong,
            Op::Hello,
            Op::Ready,
            Op::SetupFailed,
            Op::Spawn,
            Op::FsRequest,
            Op::Read,
            Op::DropReader,
            Op::WriteStdin,
            Op::CloseStdin,
            Op::DropChild,
            Op::Sleep,
            Op::ReadSize,
            Op::Eof,
            Op::FailAll,
            Op::AutoPong,
        ];
        ALL[usize::from(b % OPS)]
    }
}

/// Builds fuzz inputs (for seeds and tests): `Script::new(handshake)`, then operations.
#[derive(Debug, Clone, Default)]
pub struct Script(Vec<u8>);

#[allow(missing_docs)]
impl Script {
    /// With `handshake`, the guest must first say Hello and Ready to the host's real handshake.
    pub fn new(handshake: bool) -> Script {
        Script(vec![u8::from(handshake)])
    }
    /// The op and its argument bytes.
    pub fn op(mut self, op: Op, args: &[u8]) -> Script {
        self.0.push(op as u8);
        self.0.extend_from_slice(args);
        self
    }
    /// A raw guest message, encoded with the protocol crate.
    pub fn message(self, message: &GuestMessage) -> Script {
        let bytes = message.encode().expect("a valid message");
        let mut args = (bytes.len() as u16).to_le_bytes().to_vec();
        args.extend_from_slice(&bytes);
        self.op(Op::Raw, &args)
    }
    pub fn bytes(self) -> Vec<u8> {
        self.0
    }
}

/// Reads the script; past its end every byte is zero.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }
}

/// The in-memory connection: what the guest wrote and the host has not read yet, and what the
/// host wrote and the guest has not looked at yet.
struct Wire {
    to_host: VecDeque<u8>,
    eof: bool,
    max_read: usize,
    /// Reads cut short by `max_read` that are left (a budget that keeps every input fast).
    short_reads: usize,
    reader: Option<Waker>,
    from_host: Vec<u8>,
}

/// The host's end of the connection.
struct HostEnd(Arc<Mutex<Wire>>);

impl AsyncRead for HostEnd {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let mut wire = self.0.lock().unwrap();
        if wire.to_host.is_empty() {
            if !wire.eof {
                wire.reader = Some(cx.waker().clone());
                return Poll::Pending;
            }
            return Poll::Ready(Ok(()));
        }
        let mut n = buf.remaining().min(wire.to_host.len());
        if wire.short_reads > 0 && n > wire.max_read {
            wire.short_reads -= 1;
            n = wire.max_read;
        }
        let (a, b) = wire.to_host.as_slices();
        let from_a = n.min(a.len());
        buf.put_slice(&a[..from_a]);
        buf.put_slice(&b[..n - from_a]);
        wire.to_host.drain(..n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for HostEnd {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.0.lock().unwrap().from_host.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Whether `notify` holds a permit (consuming it).
fn notified(notify: &Notify) -> bool {
    let future = notify.notified();
    let mut future = std::pin::pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    future.as_mut().poll(&mut cx).is_ready()
}

/// What the guest knows of one process, from the host's messages and its own.
#[derive(Default)]
struct GuestProc {
    /// Exec seen, and no Exited/ExecFailed sent.
    live: bool,
    /// Output bytes sent and credited back, per stream.
    sent: [u64; 2],
    credited: [u64; 2],
    /// Stdin bytes received, and credited back.
    stdin_received: u64,
    stdin_credited: u64,
}

impl GuestProc {
    fn credit(&self, stream: usize) -> u64 {
        (u64::from(OUTPUT_WINDOW) + self.credited[stream]).saturating_sub(self.sent[stream])
    }
}

/// The host side's view of one stream: a model of `ChildStdout`'s receiver (which credits a
/// chunk when it takes it off the channel, in quarter windows, and on drop gives back
/// everything) over the real channel.
struct Reader {
    rx: OutputReceiver<OutputItem>,
    /// Taken off the channel only to look at: still "in the channel" for the model.
    queued: VecDeque<Vec<u8>>,
    queued_bytes: u64,
    uncredited: u32,
    broken: bool,
    /// The channel ended (its sender dropped).
    done: bool,
}

impl Reader {
    fn new(rx: OutputReceiver<OutputItem>) -> Reader {
        Reader {
            rx,
            queued: VecDeque::new(),
            queued_bytes: 0,
            uncredited: 0,
            broken: false,
            done: false,
        }
    }

    fn observe(&mut self) {
        loop {
            match self.rx.try_recv() {
                Ok(OutputItem::Data(chunk)) => {
                    assert!(!self.broken, "data after the stream broke off");
                    assert!(!chunk.is_empty(), "an empty chunk was queued");
                    self.queued_bytes += chunk.len() as u64;
                    self.queued.push_back(chunk);
                }
                Ok(OutputItem::Broken(_)) => {
                    assert!(!self.broken, "broken twice");
                    self.broken = true;
                }
                Err(TryRecvError::Empty) => return,
                Err(TryRecvError::Disconnected) => {
                    self.done = true;
                    return;
                }
            }
        }
    }

    fn read(&mut self, control: &Control, id: u32, stream: Stream, mut want: usize) {
        self.observe();
        while want > 0 {
            let Some(chunk) = self.queued.pop_front() else {
                return;
            };
            self.queued_bytes -= chunk.len() as u64;
            want = want.saturating_sub(chunk.len());
            self.uncredited += chunk.len() as u32;
            if self.uncredited >= OUTPUT_WINDOW / 4 {
                control.credit(id, stream, self.uncredited);
                self.uncredited = 0;
            }
        }
    }

    fn drop_with_credit(mut self, control: &Control, id: u32, stream: Stream) {
        if self.uncredited > 0 {
            control.credit(id, stream, self.uncredited);
        }
        self.rx.close();
        for chunk in self.queued.drain(..) {
            control.credit(id, stream, chunk.len() as u32);
        }
        while let Ok(item) = self.rx.try_recv() {
            if let OutputItem::Data(chunk) = item {
                control.credit(id, stream, chunk.len() as u32);
            }
        }
    }
}

struct HostProc {
    id: u32,
    readers: [Option<Reader>; 2],
    started: Option<oneshot::Receiver<u32>>,
    end: Option<oneshot::Receiver<ProcessEnd>>,
    /// How it ended, once the harness saw it: Some(true) for Gone, Some(false) for an end the
    /// guest reported.
    gone_end: Option<bool>,
    stdin: Arc<Semaphore>,
    stdin_closed: bool,
}

struct HostFs {
    id: u32,
    rx: Option<oneshot::Receiver<FsReply>>,
}

type HandshakeTask = JoinHandle<(HostEnd, FrameDecoder, Result<Hello>)>;

struct Harness {
    wire: Arc<Mutex<Wire>>,
    control: Option<Arc<Control>>,
    handshake: Option<HandshakeTask>,
    /// Handshake mode: guest messages honest so far (Hello, then Ready).
    handshake_step: u8,
    guest_decoder: FrameDecoder,
    guest_procs: HashMap<u32, GuestProc>,
    guest_fs: HashSet<u32>,
    setup_seen: bool,
    last_ping: u64,
    auto_pong: bool,
    procs: Vec<HostProc>,
    fs: Vec<HostFs>,
    next_id: u32,
    /// Every guest byte so far was an honest message and the host was never stopped
    /// otherwise: the host's verdicts can be predicted.
    honest: bool,
    eof: bool,
    last_guest_write: Instant,
    guest_bytes: usize,
    /// Decodes what the guest wrote, as the host does.
    tap: FrameDecoder,
    tap_dead: bool,
    time_steps: usize,
    violated_seen: bool,
    hung_seen: bool,
}

/// The fuzz property: run `data` as a script (see the module docs). Must run on a
/// current-thread tokio runtime with time enabled and paused (`start_paused(true)`).
pub async fn host_dispatch(data: &[u8]) -> Outcome {
    let mut input = Input(data);
    let handshake = input.u8() & 1 == 1;
    let wire = Arc::new(Mutex::new(Wire {
        to_host: VecDeque::new(),
        eof: false,
        max_read: usize::MAX,
        short_reads: MAX_SHORT_READS,
        reader: None,
        from_host: Vec::new(),
    }));
    let mut h = Harness {
        wire: wire.clone(),
        control: None,
        handshake: None,
        handshake_step: 0,
        guest_decoder: FrameDecoder::new(),
        guest_procs: HashMap::new(),
        guest_fs: HashSet::new(),
        setup_seen: false,
        last_ping: 0,
        auto_pong: false,
        procs: Vec::new(),
        fs: Vec::new(),
        next_id: 1,
        honest: true,
        eof: false,
        last_guest_write: Instant::now(),
        guest_bytes: 0,
        tap: FrameDecoder::new(),
        tap_dead: false,
        time_steps: 0,
        violated_seen: false,
        hung_seen: false,
    };
    let stream = HostEnd(wire);
    if handshake {
        let setup = Setup {
            hostname: "fuzz".into(),
            root: RootMount {
                device: "/dev/vda".into(),
                fstype: "erofs".into(),
                read_only: true,
                writable_layer: None,
            },
            network: None,
            mounts: Vec::new(),
        };
        h.handshake = Some(tokio::spawn(async move {
            let mut stream = stream;
            let mut decoder = FrameDecoder::new();
            let result = control::handshake(&mut stream, &mut decoder, setup).await;
            (stream, decoder, result)
        }));
    } else {
        h.start(stream, FrameDecoder::new());
    }
    while !input.0.is_empty() {
        h.step(&mut input).await;
    }
    h.finish().await
}

/// How a [`host_dispatch`] run ended (for tests of the seeds).
#[derive(Debug, Default)]
pub struct Outcome {
    /// The control channel ran (the handshake, if any, succeeded).
    pub started: bool,
    /// The protocol violation that ended the connection.
    pub violation: Option<crate::protocol::ProtocolError>,
    /// The liveness check declared the guest hung.
    pub hung: bool,
    /// Every guest message was honest (and the host was not stopped otherwise).
    pub honest: bool,
    /// Output bytes the guest sent, and the host credited back, over all streams.
    pub output_sent: u64,
    pub output_credited: u64,
}

impl Harness {
    fn start(&mut self, stream: HostEnd, decoder: FrameDecoder) {
        let limits = Limits::default()
            .max_processes(MAX_PROCESSES)
            .max_pending_file_requests(MAX_FILE_REQUESTS);
        self.control = Some(Control::start(
            stream,
            decoder,
            Liveness::new(LIVENESS_TIMEOUT),
            limits,
        ));
    }

    fn gone(&self) -> Option<Gone> {
        self.control.as_ref().and_then(|c| c.gone())
    }

    fn violation(&self) -> bool {
        self.control
            .as_ref()
            .is_some_and(|c| c.violation.lock().unwrap().is_some())
    }

    /// The guest writes `bytes`.
    fn guest_write(&mut self, bytes: &[u8]) {
        if self.eof || bytes.is_empty() {
            return;
        }
        self.guest_bytes += bytes.len();
        self.last_guest_write = Instant::now();
        {
            let mut wire = self.wire.lock().unwrap();
            wire.to_host.extend(bytes);
            if let Some(waker) = wire.reader.take() {
                waker.wake();
            }
        }
        self.tap(bytes);
    }

    /// The guest's view of what it sent: the same bytes the host reads, decoded the same way
    /// (raw bytes may carry messages too). Once they stop decoding, the host stops reading.
    fn tap(&mut self, bytes: &[u8]) {
        if self.tap_dead || self.tap.push(bytes).is_err() {
            self.tap_dead = true;
            return;
        }
        loop {
            let message = match self.tap.next_frame() {
                Ok(Some(frame)) => match GuestMessage::decode(&frame) {
                    Ok(message) => message,
                    Err(_) => break self.tap_dead = true,
                },
                Ok(None) => return,
                Err(_) => break self.tap_dead = true,
            };
            match message {
                GuestMessage::Output(output) => {
                    if let Some(p) = self.guest_procs.get_mut(&output.id) {
                        p.sent[output.stream as usize] += output.data.len() as u64;
                    }
                }
                GuestMessage::Exited(Exited { id, .. })
                | GuestMessage::ExecFailed(ExecFailed { id, .. }) => {
                    if let Some(p) = self.guest_procs.get_mut(&id) {
                        p.live = false;
                    }
                }
                GuestMessage::StdinCredit(credit) => {
                    if let Some(p) = self.guest_procs.get_mut(&credit.id) {
                        p.stdin_credited += u64::from(credit.bytes);
                    }
                }
                GuestMessage::FsReply(reply) => {
                    self.guest_fs.remove(&reply.id);
                }
                _ => {}
            }
        }
    }

    /// Lets the host run until it makes no more progress on its own, then looks at what it
    /// sent.
    async fn settle(&mut self) {
        // The guest's automatic pongs are written as it reads: settle again after them.
        loop {
            let written = self.guest_bytes;
            self.settle_host().await;
            self.drain_host();
            if self.guest_bytes == written {
                return;
            }
        }
    }

    async fn settle_host(&mut self) {
        let mut last = (usize::MAX, usize::MAX);
        let mut stable = 0;
        let mut turns = 0;
        // A guest write wakes the reader; what it sends wakes the writer, which runs in the
        // same scheduler turn. Two turns without a change mean the host is idle.
        while stable < 2 {
            tokio::task::yield_now().await;
            let now = {
                let wire = self.wire.lock().unwrap();
                (wire.to_host.len(), wire.from_host.len())
            };
            if now == last {
                stable += 1;
            } else {
                stable = 0;
                last = now;
            }
            turns += 1;
            assert!(turns < SETTLE_LIMIT, "the host never settled");
        }
    }

    /// The guest reads what the host sent: every message must decode, and respect the flow
    /// control.
    fn drain_host(&mut self) {
        let bytes = std::mem::take(&mut self.wire.lock().unwrap().from_host);
        self.guest_decoder
            .push(&bytes)
            .expect("the host sent a frame the guest's decoder refuses");
        let mut pongs = Vec::new();
        while let Some(frame) = self
            .guest_decoder
            .next_frame()
            .expect("the host sent a bad frame")
        {
            let message = HostMessage::decode(&frame).expect("the host sent a malformed message");
            match message {
                HostMessage::Setup(_) => {
                    assert!(self.handshake.is_some(), "Setup without a handshake");
                    assert!(!self.setup_seen, "Setup twice");
                    self.setup_seen = true;
                }
                HostMessage::Exec(exec) => {
                    let fresh = self
                        .guest_procs
                        .insert(
                            exec.id,
                            GuestProc {
                                live: true,
                                ..GuestProc::default()
                            },
                        )
                        .is_none();
                    assert!(fresh, "the host reused process id {}", exec.id);
                }
                HostMessage::Stdin(data) => {
                    assert!(!data.data.is_empty(), "empty stdin");
                    let p = self
                        .guest_procs
                        .get_mut(&data.id)
                        .expect("stdin for a process never started");
                    p.stdin_received += data.data.len() as u64;
                    assert!(
                        p.stdin_received <= u64::from(STDIN_WINDOW) + p.stdin_credited,
                        "the host sent stdin past its window"
                    );
                }
                HostMessage::Credit(credit) => {
                    let p = self
                        .guest_procs
                        .get_mut(&credit.id)
                        .expect("credit for a process never started");
                    let s = credit.stream as usize;
                    p.credited[s] += u64::from(credit.bytes);
                    assert!(
                        p.credited[s] <= p.sent[s],
                        "the host credited {} bytes of {:?} but received only {}",
                        p.credited[s],
                        credit.stream,
                        p.sent[s]
                    );
                }
                HostMessage::Fs(request) => {
                    assert!(self.guest_fs.insert(request.id), "file request id reused");
                }
                HostMessage::Ping(ping) => {
                    self.last_ping = ping.seq;
                    if self.auto_pong {
                        pongs.push(ping.seq);
                    }
                }
                HostMessage::CloseStdin(_)
                | HostMessage::Signal(_)
                | HostMessage::Resize(_)
                | HostMessage::Shutdown => {}
                // Only a snapshot quiesces the channel, and this harness takes none.
                HostMessage::Quiesce(_) | HostMessage::Resume(_) => {
                    panic!("the host quiesced the channel with no snapshot asked for")
                }
            }
        }
        for seq in pongs {
            let bytes = GuestMessage::Pong(Pong { seq }).encode().unwrap();
            self.guest_write(&bytes);
        }
    }

    /// The checks that hold after every step.
    fn check(&mut self) {
        let Some(control) = self.control.clone() else {
            return;
        };
        let violation = self.violation();
        let gone = control.gone();
        if violation {
            assert!(gone.is_some(), "a violation left the channel usable");
            if !self.violated_seen {
                assert!(notified(&control.violated), "a violation was not reported");
                self.violated_seen = true;
            }
        }
        if !self.wire.lock().unwrap().to_host.is_empty() {
            assert!(
                violation,
                "the host stopped reading without a protocol violation"
            );
        }
        if let Some(Gone::Hung(silent_for)) = &gone {
            if !self.hung_seen {
                self.hung_seen = true;
                assert!(!self.eof, "a guest that hung up was declared hung");
                assert!(*silent_for >= LIVENESS_TIMEOUT);
                let liveness = Liveness::new(LIVENESS_TIMEOUT);
                assert!(
                    self.last_guest_write.elapsed() >= liveness.timeout - liveness.interval,
                    "declared hung {:?} after the guest last wrote",
                    self.last_guest_write.elapsed()
                );
                assert!(notified(&control.hung), "a hang was not reported");
            }
        }
        for p in &mut self.procs {
            for reader in p.readers.iter_mut().flatten() {
                reader.observe();
                assert!(
                    reader.queued_bytes + u64::from(reader.uncredited) <= u64::from(OUTPUT_WINDOW),
                    "the host holds {} bytes of output, past the window",
                    reader.queued_bytes + u64::from(reader.uncredited)
                );
            }
            assert!(p.stdin.available_permits() <= STDIN_WINDOW as usize);
            if let Some(rx) = &mut p.end {
                match rx.try_recv() {
                    Ok(end) => {
                        p.end = None;
                        p.gone_end = Some(match end {
                            ProcessEnd::Exited(exited) => {
                                assert_eq!(exited.id, p.id);
                                false
                            }
                            ProcessEnd::Failed(failed) => {
                                assert_eq!(failed.id, p.id);
                                false
                            }
                            ProcessEnd::Gone(_) => {
                                assert!(gone.is_some(), "a process ended as gone, the channel not");
                                true
                            }
                        });
                    }
                    Err(oneshot::error::TryRecvError::Empty) => {}
                    Err(oneshot::error::TryRecvError::Closed) => panic!("a process end was lost"),
                }
            }
        }
        for f in &mut self.fs {
            if let Some(rx) = &mut f.rx {
                match rx.try_recv() {
                    Ok(reply) => {
                        assert_eq!(reply.id, f.id);
                        f.rx = None;
                    }
                    Err(oneshot::error::TryRecvError::Empty) => {}
                    Err(oneshot::error::TryRecvError::Closed) => {
                        assert!(gone.is_some(), "a file request was dropped unanswered");
                        f.rx = None;
                    }
                }
            }
        }
    }

    fn pick_proc(&mut self, input: &mut Input) -> u32 {
        let b = input.u8();
        if b >= 0xf0 || self.procs.is_empty() {
            return if b >= 0xf0 { input.u32() } else { u32::from(b) };
        }
        self.procs[usize::from(b) % self.procs.len()].id
    }

    fn pick_fs(&mut self, input: &mut Input) -> u32 {
        let b = input.u8();
        if b >= 0xf0 || self.fs.is_empty() {
            return if b >= 0xf0 { input.u32() } else { u32::from(b) };
        }
        self.fs[usize::from(b) % self.fs.len()].id
    }

    fn proc_index(&self, i: u8) -> Option<usize> {
        (!self.procs.is_empty()).then(|| usize::from(i) % self.procs.len())
    }

    fn live(&self, id: u32) -> bool {
        self.guest_procs.get(&id).is_some_and(|p| p.live)
    }

    /// A well-formed guest message from the script, and whether an honest guest could send it
    /// now.
    fn guest_message(&mut self, op: Op, input: &mut Input) -> Option<(GuestMessage, bool)> {
        let post_setup = self.handshake.is_none();
        Some(match op {
            Op::Started => {
                let id = self.pick_proc(input);
                let pid = input.u32();
                let honest = self.live(id);
                (GuestMessage::Started(Started { id, pid }), honest)
            }
            Op::Output | Op::OutputCredit => {
                let id = self.pick_proc(input);
                let stream = if input.u8() & 1 == 0 {
                    Stream::Stdout
                } else {
                    Stream::Stderr
                };
                let s = stream as usize;
                let credit = self.guest_procs.get(&id).map_or(0, |p| p.credit(s));
                let len = if op == Op::Output {
                    1 + usize::from(input.u16()) * 4
                } else {
                    let delta = i64::from(input.u8() as i8);
                    (credit as i64 + delta).clamp(1, MAX_CHUNK as i64) as usize
                };
                let honest = self.live(id) && len as u64 <= credit;
                let data = ByteBuf::from(vec![b'o'; len]);
                (GuestMessage::Output(Output { id, stream, data }), honest)
            }
            Op::Exited => {
                let id = self.pick_proc(input);
                let signal = input.u8() & 1 == 1;
                let value = input.u32() as i32;
                let status = if signal {
                    ExitStatus::Signal(value)
                } else {
                    ExitStatus::Code(value)
                };
                let timed_out = input.u8() & 1 == 1;
                let honest = self.live(id);
                let exited = Exited {
                    id,
                    status,
                    timed_out,
                };
                (GuestMessage::Exited(exited), honest)
            }
            Op::ExecFailed => {
                let id = self.pick_proc(input);
                let honest = self.live(id);
                let failed = ExecFailed {
                    id,
                    kind: ExecErrorKind::NotFound,
                    errno: 2,
                    message: "execvp sh: No such file or directory".into(),
                };
                (GuestMessage::ExecFailed(failed), honest)
            }
            Op::StdinCredit => {
                let id = self.pick_proc(input);
                let mode = input.u8();
                let holds = self
                    .guest_procs
                    .get(&id)
                    .map_or(0, |p| p.stdin_received.saturating_sub(p.stdin_credited));
                let bytes = if mode < 0x80 {
                    (holds as i64 + i64::from(mode) - 0x40).clamp(0, i64::from(u32::MAX)) as u32
                } else {
                    input.u32()
                };
                // Credit for a process that ended (or never was) is ignored.
                let honest = !self.live(id) || u64::from(bytes) <= holds;
                let credit = Credit {
                    id,
                    stream: Stream::Stdout,
                    bytes,
                };
                (GuestMessage::StdinCredit(credit), honest)
            }
            Op::FsReply => {
                let id = self.pick_fs(input);
                let kind = input.u8();
                let size = usize::from(input.u16());
                let result = match kind % 5 {
                    0 => Ok(FsOk::Done),
                    1 => Ok(FsOk::Data(ByteBuf::from(vec![b'f'; size % 8192]))),
                    2 => Ok(FsOk::Metadata(FileMeta {
                        file_type: FileType::File,
                        len: size as u64,
                        mode: 0o644,
                        uid: 0,
                        gid: 0,
                        mtime_secs: 0,
                        mtime_nanos: 0,
                    })),
                    3 => Ok(FsOk::Entries {
                        entries: (0..size % 16)
                            .map(|i| DirEntry {
                                name: ByteBuf::from(format!("e{i}").into_bytes()),
                                file_type: FileType::File,
                            })
                            .collect(),
                        complete: kind & 0x80 != 0,
                    }),
                    _ => Err(FsError {
                        kind: FsErrorKind::NotFound,
                        errno: 2,
                        message: "open /f: No such file or directory".into(),
                    }),
                };
                let honest = self.guest_fs.contains(&id);
                (GuestMessage::FsReply(FsReply { id, result }), honest)
            }
            Op::Pong => {
                let seq = self.last_ping.wrapping_add(u64::from(input.u8()));
                (GuestMessage::Pong(Pong { seq }), post_setup)
            }
            Op::Hello => {
                let version = if input.u8() & 1 == 0 {
                    PROTOCOL_VERSION
                } else {
                    PROTOCOL_VERSION + 1
                };
                let honest = !post_setup && self.handshake_step == 0 && version == PROTOCOL_VERSION;
                self.handshake_step = self.handshake_step.saturating_add(1);
                let hello = Hello {
                    version,
                    guest_init: "0.1.0".into(),
                    kernel_release: "6.12.0".into(),
                };
                (GuestMessage::Hello(hello), honest)
            }
            Op::Ready => {
                let honest = !post_setup && self.handshake_step == 1;
                self.handshake_step = self.handshake_step.saturating_add(1);
                (GuestMessage::Ready, honest)
            }
            Op::SetupFailed => {
                let failure = Failure {
                    message: "mount /dev/vda: No such device".into(),
                };
                self.handshake_step = self.handshake_step.saturating_add(2);
                (GuestMessage::SetupFailed(failure), false)
            }
            _ => return None,
        })
    }

    async fn step(&mut self, input: &mut Input<'_>) {
        let op = Op::from_byte(input.u8());
        // Whether the host's verdict on this step can be predicted, and what it must be.
        let predictable = self.honest && self.control.is_some() && self.gone().is_none();
        let mut expect_violation = None;
        match op {
            Op::Raw => {
                let len = usize::from(input.u16()) % 4097;
                let bytes = input.take(len).to_vec();
                if !bytes.is_empty() && !self.eof {
                    self.honest = false;
                }
                self.guest_write(&bytes);
            }
            Op::Spawn => self.spawn(input.u8()),
            Op::FsRequest => self.fs_request(),
            Op::Read => {
                let i = input.u8();
                let s = usize::from(input.u8() & 1);
                let want = usize::from(input.u16()) * 16;
                if let (Some(control), Some(k)) = (&self.control, self.proc_index(i)) {
                    let p = &mut self.procs[k];
                    if let Some(reader) = &mut p.readers[s] {
                        reader.read(control, p.id, stream(s), want);
                    }
                }
            }
            Op::DropReader => {
                let i = input.u8();
                let s = usize::from(input.u8() & 1);
                if let (Some(control), Some(k)) = (&self.control, self.proc_index(i)) {
                    let p = &mut self.procs[k];
                    if let Some(reader) = p.readers[s].take() {
                        reader.drop_with_credit(control, p.id, stream(s));
                    }
                }
            }
            Op::WriteStdin => {
                let i = input.u8();
                let want = (1 + usize::from(input.u16()) * 4).min(MAX_CHUNK);
                if let (Some(control), Some(k)) = (&self.control, self.proc_index(i)) {
                    let p = &self.procs[k];
                    // As ChildStdin does: a permit per byte, taken before the bytes are sent.
                    let n = want.min(p.stdin.available_permits());
                    if !p.stdin_closed && n > 0 {
                        if let Ok(permits) = p.stdin.try_acquire_many(n as u32) {
                            permits.forget();
                            let data = ByteBuf::from(vec![b'i'; n]);
                            let _ = control.send(&HostMessage::Stdin(StdinData { id: p.id, data }));
                        }
                    }
                }
            }
            Op::CloseStdin => {
                let i = input.u8();
                if let (Some(control), Some(k)) = (&self.control, self.proc_index(i)) {
                    let p = &mut self.procs[k];
                    if !p.stdin_closed {
                        p.stdin_closed = true;
                        let _ = control.send(&HostMessage::CloseStdin(ProcessRef { id: p.id }));
                    }
                }
            }
            Op::DropChild => {
                let i = input.u8();
                if let (Some(control), Some(k)) = (&self.control, self.proc_index(i)) {
                    let p = &mut self.procs[k];
                    let _ = control.send(&HostMessage::Signal(SignalProcess {
                        id: p.id,
                        signal: libc::SIGKILL,
                    }));
                    for (s, reader) in p.readers.iter_mut().enumerate() {
                        if let Some(reader) = reader.take() {
                            reader.drop_with_credit(control, p.id, stream(s));
                        }
                    }
                    p.started = None;
                    p.end = None;
                    p.stdin_closed = true;
                }
            }
            Op::Sleep => {
                let steps = usize::from(input.u8() % 16) + 1;
                for _ in 0..steps {
                    if self.time_steps >= MAX_TIME_STEPS {
                        break;
                    }
                    self.time_steps += 1;
                    tokio::time::sleep(TIME_STEP).await;
                    self.settle().await;
                    self.after_step().await;
                }
            }
            Op::ReadSize => {
                let size = [1, 7, 64, 4096, 65536, usize::MAX][usize::from(input.u8() % 6)];
                self.wire.lock().unwrap().max_read = size;
            }
            Op::Eof => {
                self.eof = true;
                let mut wire = self.wire.lock().unwrap();
                wire.eof = true;
                if let Some(waker) = wire.reader.take() {
                    waker.wake();
                }
            }
            Op::FailAll => {
                if let Some(control) = &self.control {
                    control.fail_all("the VM stopped".into());
                    self.honest = false;
                }
            }
            Op::AutoPong => self.auto_pong = !self.auto_pong,
            _ => {
                let (message, honest) = self.guest_message(op, input).expect("a guest message");
                if self.guest_bytes < MAX_GUEST_BYTES && !self.eof {
                    let bytes = message.encode().expect("the harness builds valid messages");
                    self.guest_write(&bytes);
                    if predictable {
                        expect_violation = Some(!honest);
                    }
                    self.honest &= honest;
                } else {
                    self.honest = false;
                }
            }
        }
        self.settle().await;
        if let Some(expected) = expect_violation {
            let violation = self.violation();
            if expected {
                assert!(violation, "the host accepted a dishonest {op:?}");
            } else {
                let v = self
                    .control
                    .as_ref()
                    .unwrap()
                    .violation
                    .lock()
                    .unwrap()
                    .clone();
                assert!(!violation, "the host refused an honest {op:?}: {v:?}");
            }
        }
        self.after_step().await;
    }

    /// Checks, and finishes the handshake once the host is done with it.
    async fn after_step(&mut self) {
        if self
            .handshake
            .as_ref()
            .is_some_and(|task| task.is_finished())
        {
            let (stream, decoder, result) = self.handshake.take().unwrap().await.unwrap();
            match result {
                Ok(hello) => {
                    assert_eq!(hello.version, PROTOCOL_VERSION);
                    assert!(self.setup_seen, "no Setup before Ready");
                    self.start(stream, decoder);
                    self.settle().await;
                }
                Err(err) => {
                    assert!(
                        matches!(err, Error::Protocol(_) | Error::GuestSetup { .. }),
                        "the handshake failed with {err:?}"
                    );
                    assert!(
                        !self.honest || self.handshake_step < 2 || self.eof,
                        "an honest handshake failed: {err:?}"
                    );
                    // As the instance does: no control channel, the boot failed.
                    self.eof = true;
                    self.honest = false;
                }
            }
        } else if self.handshake.is_some() && self.honest && self.handshake_step == 2 {
            panic!("the guest said Hello and Ready, but the handshake did not finish");
        }
        self.check();
    }

    fn spawn(&mut self, flags: u8) {
        let Some(control) = self.control.clone() else {
            return;
        };
        let id = self.next_id;
        self.next_id += 1;
        match control.register(id) {
            Ok(channels) => {
                let exec = Exec {
                    id,
                    argv: vec![ByteBuf::from(b"sh".to_vec())],
                    env: vec![],
                    cwd: None,
                    uid: None,
                    gid: None,
                    timeout_ms: None,
                    stdin: flags & 1 == 1,
                    pty: None,
                };
                control.send(&HostMessage::Exec(exec)).unwrap();
                self.procs.push(HostProc {
                    id,
                    readers: [
                        Some(Reader::new(channels.stdout)),
                        Some(Reader::new(channels.stderr)),
                    ],
                    started: Some(channels.started),
                    end: Some(channels.end),
                    gone_end: None,
                    stdin: channels.stdin_credit,
                    stdin_closed: false,
                });
            }
            Err(err) => self.refused(err),
        }
    }

    fn fs_request(&mut self) {
        let Some(control) = self.control.clone() else {
            return;
        };
        let id = self.next_id;
        self.next_id += 1;
        match control.register_fs(id) {
            Ok(rx) => {
                let request = FsRequest {
                    id,
                    op: FsOp::Read {
                        path: ByteBuf::from(b"/etc/hostname".to_vec()),
                        offset: 0,
                        len: 4096,
                    },
                };
                control.send(&HostMessage::Fs(request)).unwrap();
                self.fs.push(HostFs { id, rx: Some(rx) });
            }
            Err(err) => self.refused(err),
        }
    }

    /// A new call was refused: because of a bound, or because the channel is gone.
    fn refused(&self, err: Error) {
        match err {
            Error::TooMany { .. } => {}
            Error::InstanceGone { .. } | Error::GuestHung { .. } => {
                assert!(self.gone().is_some(), "refused as gone: {err:?}")
            }
            other => panic!("a new call failed with {other:?}"),
        }
    }

    async fn finish(&mut self) -> Outcome {
        if !self.eof {
            let mut wire = self.wire.lock().unwrap();
            wire.eof = true;
            if let Some(waker) = wire.reader.take() {
                waker.wake();
            }
        }
        self.eof = true;
        self.settle().await;
        self.after_step().await;
        assert!(
            self.handshake.is_none(),
            "the handshake outlived the connection"
        );
        let Some(control) = self.control.clone() else {
            return Outcome::default();
        };
        let outcome = Outcome {
            started: true,
            violation: control.violation.lock().unwrap().clone(),
            hung: matches!(control.gone(), Some(Gone::Hung(_))),
            honest: self.honest,
            output_sent: self
                .guest_procs
                .values()
                .map(|p| p.sent[0] + p.sent[1])
                .sum(),
            output_credited: self
                .guest_procs
                .values()
                .map(|p| p.credited[0] + p.credited[1])
                .sum(),
        };
        // The connection ended: either with a typed violation or as closed, never both.
        let closed = notified(&control.closed);
        let violation = self.violation();
        assert!(
            closed != violation,
            "closed: {closed}, violation: {violation}"
        );
        // The instance then ends everything still pending.
        control.fail_all("the VM stopped".into());
        self.settle().await;
        self.check();
        for p in &mut self.procs {
            if let Some(rx) = &mut p.started {
                assert!(!matches!(
                    rx.try_recv(),
                    Err(oneshot::error::TryRecvError::Empty)
                ));
            }
            assert!(p.end.is_none(), "a process end was never answered");
            assert!(p.stdin.is_closed(), "stdin outlived the channel");
            for reader in p.readers.iter_mut().flatten() {
                reader.observe();
                assert!(reader.done, "an output stream was never ended");
                if let Some(gone) = p.gone_end {
                    assert_eq!(
                        reader.broken, gone,
                        "a stream must break off exactly when its process did not end"
                    );
                }
            }
        }
        for f in &self.fs {
            assert!(f.rx.is_none(), "a file request was never answered");
        }
        let next = self.next_id;
        assert!(control.register(next).is_err());
        assert!(control.register_fs(next + 1).is_err());
        assert!(matches!(
            control.gone().map(|g| g.error()),
            Some(Error::InstanceGone { .. } | Error::GuestHung { .. })
        ));
        outcome
    }
}

fn stream(s: usize) -> Stream {
    if s == 0 {
        Stream::Stdout
    } else {
        Stream::Stderr
    }
}

/// Meaningful scripts to start the fuzzer from (`fuzz/corpus/host_dispatch/` holds them and
/// what the fuzzer found from them).
pub fn host_dispatch_seeds() -> Vec<Vec<u8>> {
    let started = |s: Script| s.op(Op::Spawn, &[1]).op(Op::Started, &[0, 7, 0, 0, 0]);
    let mut seeds = vec![
        // A process that writes a little to each stream, is read and exits.
        started(Script::new(false))
            .op(Op::Output, &[0, 0, 10, 0])
            .op(Op::Output, &[0, 1, 3, 0])
            .op(Op::Read, &[0, 0, 0xff, 0xff])
            .op(Op::Read, &[0, 1, 0xff, 0xff])
            .op(Op::Exited, &[0, 0, 0, 0, 0, 0, 0]),
        // Stdin within its window, credited back exactly, then closed; the process fails.
        started(Script::new(false))
            .op(Op::WriteStdin, &[0, 0xff, 0x40])
            .op(Op::StdinCredit, &[0, 0x40])
            .op(Op::WriteStdin, &[0, 0xff, 0xff])
            .op(Op::StdinCredit, &[0, 0x40])
            .op(Op::CloseStdin, &[0])
            .op(Op::ExecFailed, &[0]),
        // A file read answered with data, another with an error.
        Script::new(false)
            .op(Op::FsRequest, &[])
            .op(Op::FsRequest, &[])
            .op(Op::FsReply, &[0, 1, 0, 16])
            .op(Op::FsReply, &[1, 4, 0, 0]),
        // The real handshake first, then a process and a directory page.
        started(Script::new(true).op(Op::Hello, &[0]).op(Op::Ready, &[]))
            .op(Op::FsRequest, &[])
            .op(Op::FsReply, &[0, 0x83, 5, 0])
            .op(Op::Exited, &[0, 1, 9, 0, 0, 0, 1]),
        // A guest that answers pings is alive for a minute; then it stops and is declared hung.
        started(Script::new(false))
            .op(Op::AutoPong, &[])
            .op(Op::Sleep, &[15])
            .op(Op::Sleep, &[15])
            .op(Op::Sleep, &[15])
            .op(Op::AutoPong, &[])
            .op(Op::Sleep, &[15]),
        // A busy guest never answers a ping but streams output: alive.
        started(Script::new(false))
            .op(Op::Output, &[0, 0, 1, 0])
            .op(Op::Sleep, &[5])
            .op(Op::Output, &[0, 0, 1, 0])
            .op(Op::Sleep, &[5])
            .op(Op::Pong, &[0]),
        // A window of output, read (credited); another window, then one byte past it.
        started(Script::new(false))
            .op(Op::OutputCredit, &[0, 0, 0])
            .op(Op::OutputCredit, &[0, 0, 0])
            .op(Op::OutputCredit, &[0, 0, 0])
            .op(Op::OutputCredit, &[0, 0, 0])
            .op(Op::Read, &[0, 0, 0xff, 0xff])
            .op(Op::OutputCredit, &[0, 0, 0])
            .op(Op::OutputCredit, &[0, 0, 0])
            .op(Op::OutputCredit, &[0, 0, 0])
            .op(Op::OutputCredit, &[0, 0, 0])
            .op(Op::OutputCredit, &[0, 0, 1]),
        // Nobody reads stderr: the host discards and credits in quarter windows.
        started(Script::new(false))
            .op(Op::DropReader, &[0, 1])
            .op(Op::OutputCredit, &[0, 1, 0])
            .op(Op::OutputCredit, &[0, 1, 0])
            .op(Op::OutputCredit, &[0, 1, 0])
            .op(Op::OutputCredit, &[0, 1, 0])
            .op(Op::OutputCredit, &[0, 1, 0])
            .op(Op::DropChild, &[0])
            .op(Op::Exited, &[0, 1, 9, 0, 0, 0, 0]),
        // Excess stdin credit.
        started(Script::new(false))
            .op(Op::WriteStdin, &[0, 10, 0])
            .op(Op::StdinCredit, &[0, 0x41]),
        // Messages for nobody, and setup messages after setup.
        Script::new(false).op(Op::Output, &[0, 0, 1, 0]),
        Script::new(false)
            .op(Op::FsRequest, &[])
            .op(Op::FsReply, &[0xf0, 9, 0, 0, 0, 0, 0, 0]),
        started(Script::new(false)).op(Op::Hello, &[0]),
        started(Script::new(false)).op(Op::Ready, &[]),
        // A wrong version, and setup that fails.
        Script::new(true).op(Op::Hello, &[1]),
        Script::new(true)
            .op(Op::Hello, &[0])
            .op(Op::SetupFailed, &[]),
        // The bounds: more processes and file requests than the host tracks.
        Script::new(false)
            .op(Op::Spawn, &[0])
            .op(Op::Spawn, &[0])
            .op(Op::Spawn, &[0])
            .op(Op::Spawn, &[0])
            .op(Op::Spawn, &[0])
            .op(Op::Spawn, &[0])
            .op(Op::Spawn, &[0])
            .op(Op::FsRequest, &[])
            .op(Op::FsRequest, &[])
            .op(Op::FsRequest, &[])
            .op(Op::FsRequest, &[])
            .op(Op::FsRequest, &[])
            .op(Op::Exited, &[0, 0, 0, 0, 0, 0, 0])
            .op(Op::Spawn, &[0]),
        // The VM stops with everything pending.
        started(Script::new(false))
            .op(Op::FsRequest, &[])
            .op(Op::Output, &[0, 0, 1, 0])
            .op(Op::FailAll, &[])
            .op(Op::Output, &[0, 0, 1, 0]),
        // The guest hangs up in the middle of a frame, read a byte at a time.
        started(Script::new(false))
            .op(Op::ReadSize, &[0])
            .op(Op::Raw, &[3, 0, 9, 0, 0])
            .op(Op::Eof, &[]),
    ];
    // The same conversation as raw frames from the protocol's encoder.
    let id = 1;
    let messages = [
        GuestMessage::Started(Started { id, pid: 42 }),
        GuestMessage::Output(Output {
            id,
            stream: Stream::Stdout,
            data: ByteBuf::from(b"hello\n".to_vec()),
        }),
        GuestMessage::Output(Output {
            id,
            stream: Stream::Stderr,
            data: ByteBuf::from(b"warning\n".to_vec()),
        }),
        GuestMessage::StdinCredit(Credit {
            id,
            stream: Stream::Stdout,
            bytes: 5,
        }),
        GuestMessage::Pong(Pong { seq: 1 }),
        GuestMessage::FsReply(FsReply {
            id: 2,
            result: Ok(FsOk::Data(ByteBuf::from(b"fuzz\n".to_vec()))),
        }),
        GuestMessage::Exited(Exited {
            id,
            status: ExitStatus::Code(0),
            timed_out: false,
        }),
    ];
    let mut raw = Script::new(false)
        .op(Op::Spawn, &[1])
        .op(Op::FsRequest, &[])
        .op(Op::WriteStdin, &[0, 1, 0]);
    for message in &messages {
        raw = raw.message(message);
    }
    seeds.push(raw.op(Op::Read, &[0, 0, 1, 0]));
    let mut handshake = Script::new(true);
    for message in [
        GuestMessage::Hello(Hello {
            version: PROTOCOL_VERSION,
            guest_init: "0.1.0".into(),
            kernel_release: "6.12.0".into(),
        }),
        GuestMessage::Ready,
        GuestMessage::Pong(Pong { seq: 0 }),
    ] {
        handshake = handshake.message(&message);
    }
    seeds.push(handshake);
    seeds.into_iter().map(Script::bytes).collect()
}

/// A hostile guest's network link against the host's frame decoder and gateway: `data` is the
/// stream libkrun would write (any bytes), cut into reads by its own bytes. Panics if the
/// gateway's output passes its bound or holds a frame libkrun could not take.
pub fn net_link(data: &[u8]) {
    crate::net::fuzz_link(data)
}

/// A hostile guest's DNS datagram to the gateway: `data` is parsed as the service parses it,
/// and a query it would put to the policy is answered every way the service answers one (an
/// address, no records, each failure code). Panics if an answer is larger than a UDP answer may
/// be, does not parse back as a response with the query's id and questions, or (for an `A`
/// query) holds anything but the one address given.
pub fn dns_query(data: &[u8]) {
    crate::net::dns::fuzz_query(data)
}

/// A hostile guest's DNS over TCP (`src/net/dns_stream.rs`): `data` is all it sends on one
/// connection to the resolver's port 53, cut into writes by its own bytes; each query is
/// answered with an address. Panics if anything panics, if the connection's service does not
/// end once the guest closes its end, or if what it sent back is not whole length-prefixed
/// responses.
pub fn dns_stream(data: &[u8]) {
    crate::net::dns_stream::fuzz_stream(data)
}

/// A hostile guest's bytes on an intercepted connection (`src/net/intercept/`), as plain HTTP
/// and as what is inside its TLS: `data` is served as production serves it (HTTP/1.1 or HTTP/2
/// with prior knowledge, each request checked, stripped, put through middleware (one answers
/// some requests itself) and, over TLS, its secrets swapped) on in-memory pipes, with a fake
/// origin upstream; no network. Panics if anything panics, if the connection does not end once
/// the guest finishes sending, or if a request reached the origin that middleware answered,
/// with another Host, a hop-by-hop header, changes beyond the swap of bound secrets'
/// placeholders in its headers (and, for the secrets that opted in, its query or body), or a
/// secret's value anywhere else (see `src/net/intercept/fuzz.rs`).
pub fn http_request(data: &[u8]) {
    crate::net::Intercept::fuzz_http(data)
}

/// A hostile guest's bytes on a mount's connection (`src/fs/fuse/`): FUSE requests framed by
/// their headers, decoded and answered by a session over a small `MemoryFs`, as the service
/// does. Panics if anything panics or a reply is not one well-formed reply to its request.
pub fn fs_request(data: &[u8]) {
    crate::fs::fuse::fuzz::fuzz_session(data)
}

/// A hostile guest's virtqueue on a mount's virtio-fs device, handed over to the library
/// (`src/fs/served/`): any descriptor table, available ring and memory, served by the library's
/// code in a real session over a small `MemoryFs`. Panics if anything panics (a request's task
/// too) or hangs, or a completion names a chain the guest did not offer (or one offered once
/// twice).
pub fn virtio_fs_queue(data: &[u8]) {
    crate::fs::served::fuzz::fuzz_queue(data)
}

/// The library's disk service (`rootfs/disk/`) over a fresh copy-on-write layer in a
/// `MemoryStore`: what the helper's virtio-blk device forwards to in its unit tests and its
/// fuzz target (`vmm/src/devices/blk/`), so that both ends of the wire are the real ones.
#[derive(Clone)]
pub struct MemoryLayerDisk(Arc<crate::rootfs::cow::CowLayer>);

impl MemoryLayerDisk {
    /// A fresh, unformatted layer of 16 KiB blocks holding at most 1 MiB unwritten.
    pub fn new() -> MemoryLayerDisk {
        let store = crate::rootfs::MemoryStore::with_block_size(16384).expect("a block size");
        MemoryLayerDisk(Arc::new(crate::rootfs::cow::CowLayer::unformatted(
            Arc::new(store),
            1 << 20,
        )))
    }

    /// Serves the requests the device forwards on `stream` until it closes or breaks the
    /// framing (the service's own error).
    pub async fn serve(&self, stream: tokio::net::UnixStream) -> std::io::Result<()> {
        crate::rootfs::disk::serve(stream, self.0.clone()).await
    }

    /// Up to `len` bytes of the disk at `offset`, as the layer holds them.
    pub async fn read(&self, offset: u64, len: u32) -> std::result::Result<Vec<u8>, String> {
        self.0.read(offset, len).await.map_err(|e| format!("{e:?}"))
    }

    /// The disk's size in bytes.
    pub fn size(&self) -> u64 {
        use crate::rootfs::served::ServedDisk;
        self.0.size()
    }

    /// Bytes written and not yet flushed to the store.
    pub fn dirty_bytes(&self) -> u64 {
        self.0.dirty_bytes()
    }
}

impl Default for MemoryLayerDisk {
    fn default() -> Self {
        MemoryLayerDisk::new()
    }
}

/// A persistent root's layer file as a compromised VMM helper could leave it
/// (`src/rootfs/fuzz.rs`): its record read back through imago never panics, never opens another
/// file, and gives a 64-hex digest or a typed error.
pub fn layer_file(data: &[u8]) {
    crate::rootfs::fuzz::fuzz_layer_file(data)
}

/// A copy-on-write root's block I/O as a hostile guest drives it (`src/rootfs/fuzz.rs`): any
/// offsets and lengths, syncs, a store that fails at times. Panics if the dirty bytes pass
/// their bound, a read returns other than the model disk holds, or a write is lost.
pub fn layer_block(data: &[u8]) {
    crate::rootfs::fuzz::fuzz_layer_block(data)
}

/// An image's layers as a registry or archive could hand them over (`src/image/oci/merge.rs`):
/// tar streams merged with whiteouts and opaque directories. Panics if the merge panics or
/// writes a stream with a path twice, a whiteout, a path out of the tree, or a hard link to a
/// path not written before it.
pub fn oci_layers(data: &[u8]) {
    crate::image::oci::merge::fuzz_oci_layers(data)
}

/// A layer's bytes as a registry or archive could hand them over (`src/image/oci/zstd.rs` and
/// `decompress`): gzip, zstd (every frame, skippable frames skipped) or plain. Panics if
/// decompressing panics.
pub fn layer_stream(data: &[u8]) {
    crate::image::oci::zstd::fuzz_layer_stream(data)
}

/// Replays every file of the committed corpus `fuzz/corpus/TARGET` through `property`, for
/// the fuzz targets' corpus tests: a file that fails it fails the test, naming the file.
pub fn replay_corpus(target: &str, property: impl Fn(&[u8]) + std::panic::RefUnwindSafe) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let result = std::panic::catch_unwind(|| property(&data));
        assert!(result.is_ok(), "{} fails the property", path.display());
    }
}

/// A small deterministic generator (xorshift64) for the fuzz properties' replayable samples:
/// no dependency, the same numbers every run for the same `seed`.
#[cfg(test)]
pub(crate) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

/// Runs `property` on `rounds` mutations of `seeds` (bytes overwritten, cut short and
/// repeated), drawn from [`xorshift`]`(seed)`.
#[cfg(test)]
pub(crate) fn mutate_seeds(seeds: &[Vec<u8>], rounds: usize, seed: u64, property: impl Fn(&[u8])) {
    let mut next = xorshift(seed);
    for _ in 0..rounds {
        let mut bytes = seeds[next() as usize % seeds.len()].clone();
        for _ in 0..1 + next() % 4 {
            let i = next() as usize % bytes.len();
            match next() % 3 {
                0 => bytes[i] = next() as u8,
                1 => bytes.truncate(i),
                _ => bytes.extend_from_within(i..),
            }
            if bytes.is_empty() {
                break;
            }
        }
        property(&bytes);
    }
}

/// Asserts that `fuzz/corpus/TARGET/seed-NN` hold exactly `seeds` (rewriting them first when
/// `KRUNBOX_WRITE_FUZZ_SEEDS` is set), for the fuzz targets' seed tests.
pub fn assert_committed_seeds(target: &str, seeds: &[Vec<u8>]) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let write = std::env::var_os("KRUNBOX_WRITE_FUZZ_SEEDS").is_some();
    for (i, seed) in seeds.iter().enumerate() {
        let path = dir.join(format!("seed-{i:02}"));
        if write {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, seed).unwrap();
        }
        let committed = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (KRUNBOX_WRITE_FUZZ_SEEDS=1 writes them)",
                path.display()
            )
        });
        assert_eq!(&committed, seed, "{} is stale", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(data: &[u8]) -> Outcome {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(host_dispatch(data))
    }

    #[test]
    fn the_seeds_hold_the_property() {
        let outcomes: Vec<Outcome> = host_dispatch_seeds().iter().map(|s| run(s)).collect();
        let violation = |i: usize| {
            let o: &Outcome = &outcomes[i];
            o.violation
                .as_ref()
                .map(|v| v.to_string())
                .unwrap_or_default()
        };
        // The honest conversations run to the end untouched.
        for i in [0, 1, 2, 3, 5, 7, 15, 18, 19] {
            let o = &outcomes[i];
            assert!(
                o.started && o.violation.is_none() && !o.hung,
                "seed {i}: {o:?}"
            );
        }
        assert!(outcomes[4].hung && outcomes[4].violation.is_none());
        assert!(
            violation(6).contains("output flow control"),
            "{}",
            violation(6)
        );
        assert!(
            outcomes[7].output_credited >= outcomes[7].output_sent - u64::from(OUTPUT_WINDOW / 4)
        );
        assert!(violation(8).contains("stdin flow control"));
        assert!(violation(9).contains("no process"));
        assert!(violation(10).contains("no file operation"));
        assert!(violation(11).contains("Hello after setup"));
        assert!(violation(12).contains("Ready after setup"));
        assert!(!outcomes[13].started && !outcomes[14].started);
        assert!(violation(17).contains("ended inside a frame"));
    }

    /// The committed corpus (what the fuzzer kept, minimized), replayed on every test run.
    #[test]
    fn the_fuzz_corpus_holds_the_property() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/host_dispatch");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            let result = std::panic::catch_unwind(|| drop(run(&data)));
            assert!(result.is_ok(), "{} fails the property", path.display());
        }
    }

    /// The corpus holds the seeds as they are generated now (`seed-NN`), so the fuzzer starts
    /// from them. After changing the seeds, write them with
    /// `KRUNBOX_WRITE_FUZZ_SEEDS=1 cargo test --lib committed_host_dispatch_seeds`.
    #[test]
    fn committed_host_dispatch_seeds_are_the_generated_ones() {
        assert_committed_seeds("host_dispatch", &host_dispatch_seeds());
    }
}
