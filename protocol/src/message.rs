//! The messages, their kind numbers, and their bounds.

use serde::{de::DeserializeOwned, Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::frame::{Frame, MAX_FRAME_BODY};
use crate::fs::{FsReply, FsRequest};
use crate::limits::*;
use crate::ProtocolError;

/// Host → guest messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMessage {
    /// Sent once, after the guest's hello: how to finish booting.
    Setup(Setup),
    /// Start a process.
    Exec(Exec),
    /// Send a signal to a process's whole process group.
    Signal(SignalProcess),
    /// Sync filesystems and power the VM off.
    Shutdown,
    /// Bytes for a process's stdin (or pty input); only as much as the guest granted.
    Stdin(StdinData),
    /// Close a process's stdin (EOF for the process).
    CloseStdin(ProcessRef),
    /// The host consumed output: the guest may send this many more bytes of that stream.
    Credit(Credit),
    /// Change a pty's window size (the process group gets SIGWINCH).
    Resize(Resize),
    /// A file operation.
    Fs(FsRequest),
    /// Liveness check: the guest answers with [`GuestMessage::Pong`] carrying the same `seq`,
    /// ahead of any output it has queued.
    Ping(Ping),
    /// Stop sending: the guest answers [`GuestMessage::Quiesced`] and sends nothing more until
    /// [`HostMessage::Resume`]; the host sends nothing after it either. With both directions
    /// still, the VM can be snapshotted with nothing in flight. If the connection breaks
    /// meanwhile (a restored copy's: its new VMM resets every vsock connection), the guest
    /// connects again, its first frame [`GuestMessage::Rejoin`].
    Quiesce(Quiesce),
    /// Go on: the answer to [`GuestMessage::Quiesced`] on the same connection, or to
    /// [`GuestMessage::Rejoin`] on a new one.
    Resume(Resume),
}

/// Guest → host messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestMessage {
    /// First frame on the connection.
    Hello(Hello),
    /// Setup finished: the guest accepts commands.
    Ready,
    /// Setup failed; the guest will power off.
    SetupFailed(Failure),
    /// A process started.
    Started(Started),
    /// A chunk of a process's stdout or stderr.
    Output(Output),
    /// A process ended (its streams are fully sent before this).
    Exited(Exited),
    /// A process could not be started.
    ExecFailed(ExecFailed),
    /// The guest wrote stdin bytes to the process: the host may send this many more.
    StdinCredit(Credit),
    /// The answer to a file operation.
    FsReply(FsReply),
    /// The answer to a [`HostMessage::Ping`].
    Pong(Pong),
    /// The answer to [`HostMessage::Quiesce`], with its token: the guest's last frame until
    /// [`HostMessage::Resume`].
    Quiesced(Quiesce),
    /// The first frame on a new connection, when the one a [`HostMessage::Quiesce`] stilled
    /// broke (the VM was restored from a snapshot).
    Rejoin(Rejoin),
}

/// Kind numbers. Never reuse a retired number.
mod kind {
    pub const SETUP: u16 = 1;
    pub const EXEC: u16 = 2;
    pub const SIGNAL: u16 = 3;
    pub const SHUTDOWN: u16 = 4;
    pub const STDIN: u16 = 5;
    pub const CLOSE_STDIN: u16 = 6;
    pub const CREDIT: u16 = 7;
    pub const RESIZE: u16 = 8;
    pub const FS: u16 = 9;
    pub const PING: u16 = 10;
    pub const QUIESCE: u16 = 11;
    pub const RESUME: u16 = 12;

    pub const HELLO: u16 = 101;
    pub const READY: u16 = 102;
    pub const SETUP_FAILED: u16 = 103;
    pub const STARTED: u16 = 104;
    pub const OUTPUT: u16 = 105;
    pub const EXITED: u16 = 106;
    pub const EXEC_FAILED: u16 = 107;
    pub const STDIN_CREDIT: u16 = 108;
    pub const FS_REPLY: u16 = 109;
    pub const PONG: u16 = 110;
    pub const QUIESCED: u16 = 111;
    pub const REJOIN: u16 = 112;
}

/// Output bytes of one stream the guest may send before the host grants more ([`Credit`]).
/// Bounds host memory per stream, and slows a guest process that writes faster than the
/// host reads (its pipe fills, its writes block).
pub const OUTPUT_WINDOW: u32 = 1024 * 1024;

/// Stdin bytes the host may send before the guest grants more ([`GuestMessage::StdinCredit`]).
pub const STDIN_WINDOW: u32 = 1024 * 1024;

/// How the guest mounts its root filesystem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootMount {
    /// Guest block device, e.g. `/dev/vda`.
    pub device: String,
    /// Filesystem type, e.g. `erofs`.
    pub fstype: String,
    /// Whether to mount it read-only.
    pub read_only: bool,
    /// A writable layer over the (read-only) image: the root becomes an overlay whose upper
    /// layer lives on this device; without one the root stays read-only.
    pub writable_layer: Option<WritableLayer>,
}

/// The block device a writable root keeps its changes on: the upper layer of an overlay over
/// the read-only image (guest-init keeps `upper/` and `work/` at the device's top).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WritableLayer {
    /// Where the device comes from.
    pub device: LayerDevice,
    /// Filesystem type, e.g. `ext4`.
    pub fstype: String,
}

/// Where a writable layer's block device comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LayerDevice {
    /// A disk of the VM, e.g. `/dev/vdb`.
    Disk(String),
    /// A virtio-blk disk the host serves block by block, found by its serial (guest-init
    /// looks for it in `/sys/block/*/serial`): [`LAYER_DISK_SERIAL`].
    HostBlock {
        /// The disk's serial.
        serial: String,
    },
}

/// The serial of a host-served layer disk.
pub const LAYER_DISK_SERIAL: &str = "krunbox-layer";

/// The most bytes of a disk's serial the guest sees (virtio-blk's `GET_ID`).
pub const LAYER_DISK_SERIAL_MAX: usize = 20;

/// Boot parameters the host sends after [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Setup {
    /// The guest's hostname.
    pub hostname: String,
    /// The root filesystem to switch to.
    pub root: RootMount,
    /// The network interface to configure, if the VM has one.
    pub network: Option<GuestNetwork>,
    /// Host filesystems to mount (virtio-fs devices named by
    /// [`mount_tag`](crate::mount_tag)), parents
    /// before the mounts inside them; at most [`MOUNTS_MAX`].
    pub mounts: Vec<GuestMount>,
}

/// A host filesystem the guest mounts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestMount {
    /// Absolute guest path, created if missing; at most [`MOUNT_PATH_MAX`] bytes.
    pub path: String,
    /// Mount it read-only.
    pub read_only: bool,
}

/// The most mounts [`Setup::mounts`] holds.
pub const MOUNTS_MAX: usize = 16;

/// The longest [`GuestMount::path`].
pub const MOUNT_PATH_MAX: usize = 1024;

/// The guest's network interface, as the host's gateway serves it: IPv4 only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestNetwork {
    /// The interface's MAC address: guest-init finds the interface by it.
    pub mac: [u8; 6],
    /// The guest's address.
    pub address: [u8; 4],
    /// Its prefix length (1-30).
    pub prefix_len: u8,
    /// The default route's gateway, on the interface's subnet.
    pub gateway: [u8; 4],
    /// Resolvers for `/etc/resolv.conf` (1-3, as glibc and musl read at most three).
    pub nameservers: Vec<[u8; 4]>,
    /// The sandbox CA's certificate (PEM, at most [`CA_CERTIFICATE_MAX`] bytes), for the
    /// guest's trust store: the host presents certificates it issued on intercepted HTTPS.
    pub ca_certificate: Option<String>,
    /// Variables every command gets unless it sets them itself (the secrets' placeholders):
    /// at most [`ENVIRONMENT_MAX`], names of letters, digits and `_`, values of at most
    /// [`ENVIRONMENT_VALUE_MAX`] bytes.
    pub environment: Vec<(String, String)>,
}

/// The largest CA certificate [`GuestNetwork`] carries.
pub const CA_CERTIFICATE_MAX: usize = 8 * 1024;

/// The most variables [`GuestNetwork::environment`] holds.
pub const ENVIRONMENT_MAX: usize = 64;

/// The longest name or value in [`GuestNetwork::environment`].
pub const ENVIRONMENT_VALUE_MAX: usize = 4096;

impl GuestNetwork {
    fn validate(&self) -> Result<(), ProtocolError> {
        let bad = |detail: String| ProtocolError::OutOfBounds {
            field: "network",
            detail,
        };
        if !(1..=30).contains(&self.prefix_len) {
            return Err(bad(format!("prefix length {}", self.prefix_len)));
        }
        if self.nameservers.is_empty() || self.nameservers.len() > 3 {
            return Err(bad(format!("{} nameservers", self.nameservers.len())));
        }
        if self.environment.len() > ENVIRONMENT_MAX {
            return Err(bad(format!("{} variables", self.environment.len())));
        }
        for (name, value) in &self.environment {
            let portable = !name.is_empty()
                && !name.starts_with(|c: char| c.is_ascii_digit())
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !portable
                || name.len() > ENVIRONMENT_VALUE_MAX
                || value.len() > ENVIRONMENT_VALUE_MAX
                || value.contains('\0')
            {
                return Err(bad(format!("the variable {name:?}")));
            }
        }
        if let Some(pem) = &self.ca_certificate {
            if pem.len() > CA_CERTIFICATE_MAX || !pem.starts_with("-----BEGIN CERTIFICATE-----") {
                return Err(bad(format!(
                    "a CA certificate of {} bytes that is not one PEM certificate",
                    pem.len()
                )));
            }
        }
        let mask = u32::MAX << (32 - u32::from(self.prefix_len));
        let (address, gateway) = (
            u32::from_be_bytes(self.address),
            u32::from_be_bytes(self.gateway),
        );
        if address & mask != gateway & mask || address == gateway {
            return Err(bad(
                "the gateway is not another address on the subnet".into()
            ));
        }
        Ok(())
    }
}

/// Start one process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exec {
    /// Host-chosen id, unique among this connection's live processes.
    pub id: u32,
    /// `argv[0]` is the program (looked up in the command's `PATH` if it has no `/`).
    pub argv: Vec<ByteBuf>,
    /// The complete environment; nothing else is inherited.
    pub env: Vec<(ByteBuf, ByteBuf)>,
    /// Working directory (default `/`).
    pub cwd: Option<ByteBuf>,
    /// User id to run as (default 0).
    pub uid: Option<u32>,
    /// Group id to run as (default: `uid`'s value, or 0).
    pub gid: Option<u32>,
    /// Kill the process group after this many milliseconds and report it as timed out.
    pub timeout_ms: Option<u64>,
    /// Give the process a stdin pipe fed by [`HostMessage::Stdin`] (otherwise `/dev/null`).
    pub stdin: bool,
    /// Run on a new pseudo-terminal of this size: stdin, stdout and stderr are the terminal,
    /// its output arrives as stdout, its input as stdin.
    pub pty: Option<PtySize>,
}

/// A terminal size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    /// Rows.
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

/// Input for a process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StdinData {
    /// The process id from [`Exec::id`].
    pub id: u32,
    /// At most [`MAX_CHUNK`] bytes.
    pub data: ByteBuf,
}

/// Names a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessRef {
    /// The process id from [`Exec::id`].
    pub id: u32,
}

/// Permission to send more bytes of one stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Credit {
    /// The process id from [`Exec::id`].
    pub id: u32,
    /// Which output stream (ignored for stdin credit).
    pub stream: Stream,
    /// How many more bytes.
    pub bytes: u32,
}

/// A new pty window size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resize {
    /// The process id from [`Exec::id`].
    pub id: u32,
    /// The size.
    pub size: PtySize,
}

/// Signal a process group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalProcess {
    /// The process id from [`Exec::id`].
    pub id: u32,
    /// Linux signal number.
    pub signal: i32,
}

/// A liveness check from the host. The host pings only while it waits to hear anything from
/// the guest; any guest message counts as a sign of life, a [`Pong`] is just the one the guest
/// sends when it has nothing else to say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ping {
    /// Chosen by the host; echoed in the [`Pong`].
    pub seq: u64,
}

/// The host asks the guest to stop sending ([`HostMessage::Quiesce`]); the guest's
/// [`GuestMessage::Quiesced`] echoes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quiesce {
    /// Chosen by the host (at random); the guest echoes it in `Quiesced` and `Rejoin`.
    pub token: u64,
}

/// The guest's first frame on the connection after a [`Quiesce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejoin {
    /// Must equal [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// The token of the [`Quiesce`] it follows.
    pub token: u64,
}

/// The host's answer to a [`Quiesce`]'s `Quiesced` or to a [`Rejoin`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resume {
    /// The host's wall-clock time (nanoseconds since the Unix epoch): the guest sets its own
    /// to it, since a snapshotted guest's clocks stand still while its state is saved, and a
    /// restored guest's where they were when it was saved.
    pub unix_time_ns: u64,
}

/// The guest's answer to a [`Ping`]. A `seq` the host never sent is harmless: the host only
/// notes that the guest is alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pong {
    /// The [`Ping::seq`] answered.
    pub seq: u64,
}

/// The guest's greeting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Must equal [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// guest-init's crate version.
    pub guest_init: String,
    /// `uname -r` of the guest kernel.
    pub kernel_release: String,
}

/// A failure described by the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// Human-readable description, including the failing step and errno text.
    pub message: String,
}

/// A process started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Started {
    /// The process id from [`Exec::id`].
    pub id: u32,
    /// Its pid inside the guest.
    pub pid: u32,
}

/// Which output stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Stream {
    /// File descriptor 1.
    Stdout,
    /// File descriptor 2.
    Stderr,
}

/// A chunk of output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Output {
    /// The process id from [`Exec::id`].
    pub id: u32,
    /// Which stream.
    pub stream: Stream,
    /// At most [`MAX_CHUNK`] bytes.
    pub data: ByteBuf,
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitStatus {
    /// It exited with this code.
    Code(i32),
    /// It was terminated by this signal.
    Signal(i32),
}

/// A process ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exited {
    /// The process id from [`Exec::id`].
    pub id: u32,
    /// Exit code or signal.
    pub status: ExitStatus,
    /// Whether guest-init killed it because its timeout expired.
    pub timed_out: bool,
}

/// Why a process could not start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExecErrorKind {
    /// The program (or the working directory) does not exist.
    NotFound,
    /// Not executable, or not permitted.
    PermissionDenied,
    /// Anything else.
    Other,
}

/// A process could not be started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecFailed {
    /// The process id from [`Exec::id`].
    pub id: u32,
    /// Classification for typed host errors.
    pub kind: ExecErrorKind,
    /// The errno, if one applies.
    pub errno: i32,
    /// What failed, e.g. `chdir /nope: No such file or directory`.
    pub message: String,
}

fn encode_body<T: Serialize>(kind: u16, value: &T) -> Result<Frame, ProtocolError> {
    let body = postcard::to_allocvec(value).map_err(|e| ProtocolError::Malformed {
        message: "outgoing",
        reason: e.to_string(),
    })?;
    if body.len() > MAX_FRAME_BODY {
        return Err(ProtocolError::FrameTooLarge {
            len: body.len() as u64,
            max: MAX_FRAME_BODY,
        });
    }
    Ok(Frame { kind, body })
}

fn decode_body<T: DeserializeOwned>(
    message: &'static str,
    body: &[u8],
) -> Result<T, ProtocolError> {
    let (value, rest) = postcard::take_from_bytes(body).map_err(|e| ProtocolError::Malformed {
        message,
        reason: e.to_string(),
    })?;
    if !rest.is_empty() {
        return Err(ProtocolError::Malformed {
            message,
            reason: format!("{} trailing bytes", rest.len()),
        });
    }
    Ok(value)
}

fn expect_empty(message: &'static str, body: &[u8]) -> Result<(), ProtocolError> {
    if body.is_empty() {
        Ok(())
    } else {
        Err(ProtocolError::Malformed {
            message,
            reason: format!("expected an empty body, got {} bytes", body.len()),
        })
    }
}

fn bound(field: &'static str, len: usize, max: usize) -> Result<(), ProtocolError> {
    if len > max {
        return Err(ProtocolError::OutOfBounds {
            field,
            detail: format!("{len} > {max}"),
        });
    }
    Ok(())
}

fn no_nul(field: &'static str, bytes: &[u8]) -> Result<(), ProtocolError> {
    if bytes.contains(&0) {
        return Err(ProtocolError::OutOfBounds {
            field,
            detail: "contains a NUL byte".into(),
        });
    }
    Ok(())
}

fn text(field: &'static str, s: &str) -> Result<(), ProtocolError> {
    bound(field, s.len(), MAX_TEXT)
}

impl Exec {
    /// Checks every bound and the C-string rules execve imposes.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        bound("argv count", self.argv.len(), MAX_ARGS)?;
        bound("env count", self.env.len(), MAX_ENV)?;
        if self.argv.is_empty() {
            return Err(ProtocolError::OutOfBounds {
                field: "argv",
                detail: "is empty (argv[0] names the program)".into(),
            });
        }
        if self.argv[0].is_empty() {
            return Err(ProtocolError::OutOfBounds {
                field: "argv[0]",
                detail: "is empty".into(),
            });
        }
        let mut total = 0usize;
        for arg in &self.argv {
            no_nul("argv", arg)?;
            total += arg.len() + 1;
        }
        for (key, value) in &self.env {
            no_nul("env key", key)?;
            no_nul("env value", value)?;
            if key.is_empty() || key.contains(&b'=') {
                return Err(ProtocolError::OutOfBounds {
                    field: "env key",
                    detail: "is empty or contains '='".into(),
                });
            }
            total += key.len() + value.len() + 2;
        }
        bound("argv+env bytes", total, MAX_EXEC_BYTES)?;
        if let Some(cwd) = &self.cwd {
            no_nul("cwd", cwd)?;
            bound("cwd", cwd.len(), MAX_TEXT)?;
        }
        if let Some(size) = self.pty {
            if size.rows == 0 || size.cols == 0 {
                return Err(ProtocolError::OutOfBounds {
                    field: "pty size",
                    detail: "rows and columns must be at least 1".into(),
                });
            }
        }
        Ok(())
    }
}

impl Setup {
    fn validate(&self) -> Result<(), ProtocolError> {
        text("hostname", &self.hostname)?;
        text("root device", &self.root.device)?;
        text("root fstype", &self.root.fstype)?;
        for (field, s) in [
            ("hostname", &self.hostname),
            ("root device", &self.root.device),
            ("root fstype", &self.root.fstype),
        ] {
            no_nul(field, s.as_bytes())?;
        }
        if let Some(layer) = &self.root.writable_layer {
            let (field, name) = match &layer.device {
                LayerDevice::Disk(device) => ("layer device", device),
                LayerDevice::HostBlock { serial } => ("layer disk serial", serial),
            };
            for (field, s) in [(field, name), ("layer fstype", &layer.fstype)] {
                text(field, s)?;
                no_nul(field, s.as_bytes())?;
            }
            if matches!(&layer.device, LayerDevice::HostBlock { serial } if serial.len() > LAYER_DISK_SERIAL_MAX)
            {
                return Err(ProtocolError::OutOfBounds {
                    field: "layer disk serial",
                    detail: format!(
                        "{name:?} (a disk shows at most {LAYER_DISK_SERIAL_MAX} bytes)"
                    ),
                });
            }
        }
        if let Some(network) = &self.network {
            network.validate()?;
        }
        if self.mounts.len() > MOUNTS_MAX {
            return Err(ProtocolError::OutOfBounds {
                field: "mounts",
                detail: format!("{} mounts", self.mounts.len()),
            });
        }
        for mount in &self.mounts {
            let normal = mount.path.starts_with('/')
                && mount.path.len() > 1
                && mount.path.len() <= MOUNT_PATH_MAX
                && mount.path[1..]
                    .split('/')
                    .all(|c| !c.is_empty() && c != "." && c != "..");
            no_nul("mount path", mount.path.as_bytes())?;
            if !normal {
                return Err(ProtocolError::OutOfBounds {
                    field: "mounts",
                    detail: format!("the mount path {:?}", mount.path),
                });
            }
        }
        Ok(())
    }
}

impl HostMessage {
    /// Encodes into a frame, checking bounds first.
    pub fn to_frame(&self) -> Result<Frame, ProtocolError> {
        match self {
            HostMessage::Setup(m) => {
                m.validate()?;
                encode_body(kind::SETUP, m)
            }
            HostMessage::Exec(m) => {
                m.validate()?;
                encode_body(kind::EXEC, m)
            }
            HostMessage::Signal(m) => encode_body(kind::SIGNAL, m),
            HostMessage::Shutdown => Ok(Frame {
                kind: kind::SHUTDOWN,
                body: Vec::new(),
            }),
            HostMessage::Stdin(m) => {
                bound("stdin chunk", m.data.len(), MAX_CHUNK)?;
                encode_body(kind::STDIN, m)
            }
            HostMessage::CloseStdin(m) => encode_body(kind::CLOSE_STDIN, m),
            HostMessage::Credit(m) => encode_body(kind::CREDIT, m),
            HostMessage::Resize(m) => encode_body(kind::RESIZE, m),
            HostMessage::Fs(m) => {
                m.validate()?;
                encode_body(kind::FS, m)
            }
            HostMessage::Ping(m) => encode_body(kind::PING, m),
            HostMessage::Quiesce(m) => encode_body(kind::QUIESCE, m),
            HostMessage::Resume(m) => encode_body(kind::RESUME, m),
        }
    }

    /// Encodes into wire bytes (header + body).
    pub fn encode(&self) -> Result<Vec<u8>, ProtocolError> {
        self.to_frame()?.to_bytes()
    }

    /// Decodes and validates a frame received by the guest.
    pub fn decode(frame: &Frame) -> Result<Self, ProtocolError> {
        let body = &frame.body[..];
        Ok(match frame.kind {
            kind::SETUP => {
                let m: Setup = decode_body("Setup", body)?;
                m.validate()?;
                HostMessage::Setup(m)
            }
            kind::EXEC => {
                let m: Exec = decode_body("Exec", body)?;
                m.validate()?;
                HostMessage::Exec(m)
            }
            kind::SIGNAL => HostMessage::Signal(decode_body("Signal", body)?),
            kind::SHUTDOWN => {
                expect_empty("Shutdown", body)?;
                HostMessage::Shutdown
            }
            kind::STDIN => {
                let m: StdinData = decode_body("Stdin", body)?;
                bound("stdin chunk", m.data.len(), MAX_CHUNK)?;
                HostMessage::Stdin(m)
            }
            kind::CLOSE_STDIN => HostMessage::CloseStdin(decode_body("CloseStdin", body)?),
            kind::CREDIT => HostMessage::Credit(decode_body("Credit", body)?),
            kind::RESIZE => HostMessage::Resize(decode_body("Resize", body)?),
            kind::FS => {
                let m: FsRequest = decode_body("Fs", body)?;
                m.validate()?;
                HostMessage::Fs(m)
            }
            kind::PING => HostMessage::Ping(decode_body("Ping", body)?),
            kind::QUIESCE => HostMessage::Quiesce(decode_body("Quiesce", body)?),
            kind::RESUME => HostMessage::Resume(decode_body("Resume", body)?),
            kind => {
                return Err(ProtocolError::UnknownKind {
                    kind,
                    direction: "host-to-guest",
                })
            }
        })
    }
}

impl GuestMessage {
    /// Encodes into a frame, checking bounds first.
    pub fn to_frame(&self) -> Result<Frame, ProtocolError> {
        self.validate()?;
        match self {
            GuestMessage::Hello(m) => encode_body(kind::HELLO, m),
            GuestMessage::Ready => Ok(Frame {
                kind: kind::READY,
                body: Vec::new(),
            }),
            GuestMessage::SetupFailed(m) => encode_body(kind::SETUP_FAILED, m),
            GuestMessage::Started(m) => encode_body(kind::STARTED, m),
            GuestMessage::Output(m) => encode_body(kind::OUTPUT, m),
            GuestMessage::Exited(m) => encode_body(kind::EXITED, m),
            GuestMessage::ExecFailed(m) => encode_body(kind::EXEC_FAILED, m),
            GuestMessage::StdinCredit(m) => encode_body(kind::STDIN_CREDIT, m),
            GuestMessage::FsReply(m) => encode_body(kind::FS_REPLY, m),
            GuestMessage::Pong(m) => encode_body(kind::PONG, m),
            GuestMessage::Quiesced(m) => encode_body(kind::QUIESCED, m),
            GuestMessage::Rejoin(m) => encode_body(kind::REJOIN, m),
        }
    }

    /// Encodes into wire bytes (header + body).
    pub fn encode(&self) -> Result<Vec<u8>, ProtocolError> {
        self.to_frame()?.to_bytes()
    }

    fn validate(&self) -> Result<(), ProtocolError> {
        match self {
            GuestMessage::Hello(m) => {
                text("guest_init version", &m.guest_init)?;
                text("kernel release", &m.kernel_release)
            }
            GuestMessage::SetupFailed(m) => text("failure message", &m.message),
            GuestMessage::ExecFailed(m) => text("exec failure message", &m.message),
            // An empty chunk costs nothing against the output window but is still one item
            // the host queues: unbounded memory for a forged stream of them. guest-init never
            // sends one (a read of 0 bytes is the end of the stream).
            GuestMessage::Output(m) if m.data.is_empty() => Err(ProtocolError::Malformed {
                message: "Output",
                reason: "an empty output chunk".into(),
            }),
            GuestMessage::Output(m) => bound("output chunk", m.data.len(), MAX_CHUNK),
            GuestMessage::FsReply(m) => m.validate(),
            GuestMessage::Ready
            | GuestMessage::Started(_)
            | GuestMessage::Exited(_)
            | GuestMessage::StdinCredit(_)
            | GuestMessage::Pong(_)
            | GuestMessage::Quiesced(_)
            | GuestMessage::Rejoin(_) => Ok(()),
        }
    }

    /// Decodes and validates a frame received by the host. Hostile input gives an error,
    /// never a panic.
    pub fn decode(frame: &Frame) -> Result<Self, ProtocolError> {
        let body = &frame.body[..];
        let message = match frame.kind {
            kind::HELLO => GuestMessage::Hello(decode_body("Hello", body)?),
            kind::READY => {
                expect_empty("Ready", body)?;
                GuestMessage::Ready
            }
            kind::SETUP_FAILED => GuestMessage::SetupFailed(decode_body("SetupFailed", body)?),
            kind::STARTED => GuestMessage::Started(decode_body("Started", body)?),
            kind::OUTPUT => GuestMessage::Output(decode_body("Output", body)?),
            kind::EXITED => GuestMessage::Exited(decode_body("Exited", body)?),
            kind::EXEC_FAILED => GuestMessage::ExecFailed(decode_body("ExecFailed", body)?),
            kind::STDIN_CREDIT => GuestMessage::StdinCredit(decode_body("StdinCredit", body)?),
            kind::FS_REPLY => GuestMessage::FsReply(decode_body("FsReply", body)?),
            kind::PONG => GuestMessage::Pong(decode_body("Pong", body)?),
            kind::QUIESCED => GuestMessage::Quiesced(decode_body("Quiesced", body)?),
            kind::REJOIN => GuestMessage::Rejoin(decode_body("Rejoin", body)?),
            kind => {
                return Err(ProtocolError::UnknownKind {
                    kind,
                    direction: "guest-to-host",
                })
            }
        };
        message.validate()?;
        Ok(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FrameDecoder, FRAME_HEADER_LEN, PROTOCOL_VERSION};

    fn exec() -> Exec {
        Exec {
            id: 3,
            argv: vec![ByteBuf::from(b"sh".to_vec()), ByteBuf::from(b"-c".to_vec())],
            env: vec![(
                ByteBuf::from(b"PATH".to_vec()),
                ByteBuf::from(b"/bin".to_vec()),
            )],
            cwd: Some(ByteBuf::from(b"/tmp".to_vec())),
            uid: Some(1000),
            gid: None,
            timeout_ms: Some(2000),
            stdin: true,
            pty: Some(PtySize { rows: 24, cols: 80 }),
        }
    }

    fn all_guest_messages() -> Vec<GuestMessage> {
        vec![
            GuestMessage::Hello(Hello {
                version: PROTOCOL_VERSION,
                guest_init: "0.1.0".into(),
                kernel_release: "6.12.91".into(),
            }),
            GuestMessage::Ready,
            GuestMessage::SetupFailed(Failure {
                message: "mount /dev/vda: EINVAL".into(),
            }),
            GuestMessage::Started(Started { id: 1, pid: 42 }),
            GuestMessage::Output(Output {
                id: 1,
                stream: Stream::Stderr,
                data: ByteBuf::from(vec![0u8, 255, 10]),
            }),
            GuestMessage::Exited(Exited {
                id: 1,
                status: ExitStatus::Signal(9),
                timed_out: true,
            }),
            GuestMessage::ExecFailed(ExecFailed {
                id: 2,
                kind: ExecErrorKind::NotFound,
                errno: 2,
                message: "nope".into(),
            }),
            GuestMessage::StdinCredit(Credit {
                id: 1,
                stream: Stream::Stdout,
                bytes: 4096,
            }),
            GuestMessage::FsReply(FsReply {
                id: 9,
                result: Ok(crate::fs::FsOk::Entries {
                    entries: vec![crate::fs::DirEntry {
                        name: ByteBuf::from(b"a".to_vec()),
                        file_type: crate::fs::FileType::Dir,
                    }],
                    complete: true,
                }),
            }),
            GuestMessage::FsReply(FsReply {
                id: 10,
                result: Err(crate::fs::FsError {
                    kind: crate::fs::FsErrorKind::IsADirectory,
                    errno: 21,
                    message: "read /tmp".into(),
                }),
            }),
            GuestMessage::Pong(Pong { seq: u64::MAX }),
            GuestMessage::Quiesced(Quiesce { token: 3 }),
            GuestMessage::Rejoin(Rejoin {
                version: PROTOCOL_VERSION,
                token: 3,
            }),
        ]
    }

    #[test]
    fn a_network_setup_is_checked_on_both_ends() {
        let good = GuestNetwork {
            mac: [2, 0, 0, 0, 0, 15],
            address: [10, 0, 2, 15],
            prefix_len: 24,
            gateway: [10, 0, 2, 2],
            nameservers: vec![[10, 0, 2, 2]],
            ca_certificate: Some(
                "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".into(),
            ),
            environment: vec![("OPENAI_API_KEY".into(), "krunbox-secret-00".into())],
        };
        let setup = |network: GuestNetwork| {
            HostMessage::Setup(Setup {
                hostname: "box".into(),
                root: RootMount {
                    device: "/dev/vda".into(),
                    fstype: "erofs".into(),
                    read_only: true,
                    writable_layer: None,
                },
                network: Some(network),
                mounts: vec![],
            })
        };
        assert!(setup(good.clone()).encode().is_ok());
        for bad in [
            GuestNetwork {
                prefix_len: 0,
                ..good.clone()
            },
            GuestNetwork {
                prefix_len: 31,
                ..good.clone()
            },
            GuestNetwork {
                gateway: [10, 0, 3, 2],
                ..good.clone()
            },
            GuestNetwork {
                gateway: good.address,
                ..good.clone()
            },
            GuestNetwork {
                nameservers: vec![],
                ..good.clone()
            },
            GuestNetwork {
                nameservers: vec![[1, 1, 1, 1]; 4],
                ..good.clone()
            },
            GuestNetwork {
                ca_certificate: Some("not a certificate".into()),
                ..good.clone()
            },
            GuestNetwork {
                environment: vec![("BAD=NAME".into(), "x".into())],
                ..good.clone()
            },
            GuestNetwork {
                environment: vec![("K".into(), "nul\0".into())],
                ..good.clone()
            },
            GuestNetwork {
                environment: vec![("K".into(), "x".into()); ENVIRONMENT_MAX + 1],
                ..good.clone()
            },
            GuestNetwork {
                ca_certificate: Some(format!(
                    "-----BEGIN CERTIFICATE-----\n{}",
                    "A".repeat(CA_CERTIFICATE_MAX)
                )),
                ..good.clone()
            },
        ] {
            assert!(
                matches!(
                    setup(bad.clone()).encode(),
                    Err(ProtocolError::OutOfBounds { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn every_message_round_trips_through_the_decoder() {
        let mut wire = Vec::new();
        for m in all_guest_messages() {
            wire.extend(m.encode().unwrap());
        }
        let host = vec![
            HostMessage::Setup(Setup {
                hostname: "box".into(),
                root: RootMount {
                    device: "/dev/vda".into(),
                    fstype: "erofs".into(),
                    read_only: true,
                    writable_layer: Some(WritableLayer {
                        device: LayerDevice::HostBlock {
                            serial: LAYER_DISK_SERIAL.into(),
                        },
                        fstype: "ext4".into(),
                    }),
                },
                network: Some(GuestNetwork {
                    mac: [2, 0, 0, 0, 0, 15],
                    address: [10, 0, 2, 15],
                    prefix_len: 24,
                    gateway: [10, 0, 2, 2],
                    nameservers: vec![[10, 0, 2, 2]],
                    ca_certificate: None,
                    environment: Vec::new(),
                }),
                mounts: vec![
                    GuestMount {
                        path: "/workspace".into(),
                        read_only: false,
                    },
                    GuestMount {
                        path: "/workspace/docs".into(),
                        read_only: true,
                    },
                ],
            }),
            HostMessage::Exec(exec()),
            HostMessage::Signal(SignalProcess { id: 3, signal: 9 }),
            HostMessage::Shutdown,
            HostMessage::Stdin(StdinData {
                id: 3,
                data: ByteBuf::from(b"input".to_vec()),
            }),
            HostMessage::CloseStdin(ProcessRef { id: 3 }),
            HostMessage::Credit(Credit {
                id: 3,
                stream: Stream::Stderr,
                bytes: 65536,
            }),
            HostMessage::Resize(Resize {
                id: 3,
                size: PtySize {
                    rows: 50,
                    cols: 132,
                },
            }),
            HostMessage::Fs(FsRequest {
                id: 4,
                op: crate::fs::FsOp::Write {
                    path: ByteBuf::from(b"/tmp/f".to_vec()),
                    offset: 0,
                    data: ByteBuf::from(vec![1, 2, 3]),
                    mode: 0o644,
                    create: true,
                    truncate: true,
                },
            }),
            HostMessage::Ping(Ping { seq: 7 }),
            HostMessage::Quiesce(Quiesce { token: u64::MAX }),
            HostMessage::Resume(Resume {
                unix_time_ns: 1_800_000_000_000_000_000,
            }),
        ];
        // Byte-at-a-time delivery exercises every partial state of the decoder.
        let mut decoder = FrameDecoder::new();
        let mut got = Vec::new();
        for byte in &wire {
            decoder.push(std::slice::from_ref(byte)).unwrap();
            while let Some(frame) = decoder.next_frame().unwrap() {
                got.push(GuestMessage::decode(&frame).unwrap());
            }
        }
        decoder.finish().unwrap();
        assert_eq!(got, all_guest_messages());

        for m in host {
            let mut decoder = FrameDecoder::new();
            decoder.push(&m.encode().unwrap()).unwrap();
            let frame = decoder.next_frame().unwrap().unwrap();
            assert_eq!(HostMessage::decode(&frame).unwrap(), m);
        }
    }

    #[test]
    fn oversized_header_is_refused_before_the_body_arrives() {
        let mut decoder = FrameDecoder::new();
        let mut header = ((MAX_FRAME_BODY + 1) as u32).to_le_bytes().to_vec();
        header.extend_from_slice(&101u16.to_le_bytes());
        let err = decoder.push(&header).unwrap_err();
        assert!(matches!(err, ProtocolError::FrameTooLarge { .. }), "{err}");
        // Once poisoned, it stays poisoned: a stream can't be resynchronised.
        assert!(decoder.push(&[0; 16]).is_err());
        assert!(decoder.next_frame().is_err());
    }

    #[test]
    fn unknown_kinds_and_wrong_directions_are_typed_errors() {
        let frame = Frame {
            kind: 999,
            body: vec![],
        };
        assert!(matches!(
            GuestMessage::decode(&frame),
            Err(ProtocolError::UnknownKind { kind: 999, .. })
        ));
        // A host-to-guest kind arriving at the host is unknown there.
        let exec_frame = HostMessage::Exec(exec()).to_frame().unwrap();
        assert!(matches!(
            GuestMessage::decode(&exec_frame),
            Err(ProtocolError::UnknownKind { .. })
        ));
    }

    #[test]
    fn an_empty_output_chunk_is_refused_both_ways() {
        let empty = GuestMessage::Output(Output {
            id: 1,
            stream: Stream::Stdout,
            data: ByteBuf::new(),
        });
        assert!(matches!(
            empty.encode(),
            Err(ProtocolError::Malformed {
                message: "Output",
                ..
            })
        ));
        // Forged on the wire, as a hostile guest would: the host refuses to decode it.
        let body = postcard::to_allocvec(&Output {
            id: 1,
            stream: Stream::Stdout,
            data: ByteBuf::new(),
        })
        .unwrap();
        let frame = Frame {
            kind: kind::OUTPUT,
            body,
        };
        assert!(matches!(
            GuestMessage::decode(&frame),
            Err(ProtocolError::Malformed {
                message: "Output",
                ..
            })
        ));
        // One byte is a chunk like any other.
        let one = GuestMessage::Output(Output {
            id: 1,
            stream: Stream::Stdout,
            data: ByteBuf::from(vec![7]),
        });
        let frame = one.to_frame().unwrap();
        assert_eq!(GuestMessage::decode(&frame).unwrap(), one);
    }

    #[test]
    fn garbage_bodies_are_malformed_not_panics() {
        let mut state = 0x9e3779b97f4a7c15u64;
        for len in 0..300usize {
            let body: Vec<u8> = (0..len)
                .map(|_| {
                    // xorshift: deterministic pseudo-random bytes.
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect();
            for kind in [
                1u16, 2, 3, 4, 5, 6, 7, 8, 9, 10, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110,
                0, 65535,
            ] {
                let frame = Frame {
                    kind,
                    body: body.clone(),
                };
                // Whatever decode accepts must satisfy every bound encode checks: decode
                // re-validates, so a hostile peer cannot slip past the limits.
                if let Ok(m) = GuestMessage::decode(&frame) {
                    assert!(m.encode().is_ok(), "decoded an out-of-bounds {m:?}");
                }
                if let Ok(m) = HostMessage::decode(&frame) {
                    assert!(m.encode().is_ok(), "decoded an out-of-bounds {m:?}");
                }
                if kind == 0 || kind == 65535 {
                    assert!(GuestMessage::decode(&frame).is_err(), "unknown kind {kind}");
                    assert!(HostMessage::decode(&frame).is_err(), "unknown kind {kind}");
                }
            }
        }
    }

    #[test]
    fn the_fuzz_property_holds_on_valid_streams_and_mutations_of_them() {
        let mut wire = vec![7u8];
        for m in all_guest_messages() {
            wire.extend(m.encode().unwrap());
        }
        wire.extend(HostMessage::Exec(exec()).encode().unwrap());
        wire.extend(HostMessage::Ping(Ping { seq: 1 << 40 }).encode().unwrap());
        crate::fuzz_control_stream(&wire);
        // Every single-byte corruption of a valid stream: no panic, invariants hold.
        let mut state = 0x2545f4914f6cdd1du64;
        for i in 1..wire.len() {
            for _ in 0..4 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let mut mutated = wire.clone();
                mutated[i] = state as u8;
                crate::fuzz_control_stream(&mutated);
            }
        }
    }

    #[test]
    fn ping_and_pong_carry_exactly_one_sequence_number() {
        for seq in [0, 1, 127, 128, u64::MAX] {
            let frame = HostMessage::Ping(Ping { seq }).to_frame().unwrap();
            assert!(frame.body.len() <= 10, "a u64 varint is at most 10 bytes");
            assert_eq!(
                HostMessage::decode(&frame).unwrap(),
                HostMessage::Ping(Ping { seq })
            );
            let frame = GuestMessage::Pong(Pong { seq }).to_frame().unwrap();
            assert_eq!(
                GuestMessage::decode(&frame).unwrap(),
                GuestMessage::Pong(Pong { seq })
            );
        }
        // Empty, overlong (an 11-byte varint) and trailing bytes are malformed, not panics.
        for body in [vec![], vec![0x80; 11], vec![1, 0]] {
            let pong = Frame {
                kind: kind::PONG,
                body: body.clone(),
            };
            assert!(matches!(
                GuestMessage::decode(&pong),
                Err(ProtocolError::Malformed { .. })
            ));
            let ping = Frame {
                kind: kind::PING,
                body,
            };
            assert!(matches!(
                HostMessage::decode(&ping),
                Err(ProtocolError::Malformed { .. })
            ));
        }
        // Each travels one way only.
        let ping = HostMessage::Ping(Ping { seq: 1 }).to_frame().unwrap();
        assert!(matches!(
            GuestMessage::decode(&ping),
            Err(ProtocolError::UnknownKind { kind: 10, .. })
        ));
        let pong = GuestMessage::Pong(Pong { seq: 1 }).to_frame().unwrap();
        assert!(matches!(
            HostMessage::decode(&pong),
            Err(ProtocolError::UnknownKind { kind: 110, .. })
        ));
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let mut frame = GuestMessage::Started(Started { id: 1, pid: 2 })
            .to_frame()
            .unwrap();
        frame.body.push(0);
        assert!(matches!(
            GuestMessage::decode(&frame),
            Err(ProtocolError::Malformed { .. })
        ));
    }

    #[test]
    fn exec_bounds_are_enforced_on_both_ends() {
        let mut bad = exec();
        bad.argv[0] = ByteBuf::from(b"s\0h".to_vec());
        assert!(HostMessage::Exec(bad.clone()).encode().is_err());
        // A hostile encoder skipping validation is still caught by decode.
        let frame = Frame {
            kind: 2,
            body: postcard::to_allocvec(&bad).unwrap(),
        };
        assert!(matches!(
            HostMessage::decode(&frame),
            Err(ProtocolError::OutOfBounds { .. })
        ));

        let mut empty = exec();
        empty.argv.clear();
        assert!(HostMessage::Exec(empty).encode().is_err());

        let mut bad_env = exec();
        bad_env
            .env
            .push((ByteBuf::from(b"A=B".to_vec()), ByteBuf::new()));
        assert!(HostMessage::Exec(bad_env).encode().is_err());

        let mut huge = exec();
        huge.argv.push(ByteBuf::from(vec![b'x'; MAX_EXEC_BYTES]));
        assert!(HostMessage::Exec(huge).encode().is_err());
    }

    #[test]
    fn output_chunks_are_bounded() {
        let big = GuestMessage::Output(Output {
            id: 1,
            stream: Stream::Stdout,
            data: ByteBuf::from(vec![0; MAX_CHUNK + 1]),
        });
        assert!(big.encode().is_err());
        // Same bytes built by hand (as a hostile guest would) are refused on decode.
        let body = postcard::to_allocvec(&Output {
            id: 1,
            stream: Stream::Stdout,
            data: ByteBuf::from(vec![0; MAX_CHUNK + 1]),
        })
        .unwrap();
        let frame = Frame { kind: 105, body };
        assert!(GuestMessage::decode(&frame).is_err());
    }

    #[test]
    fn truncated_stream_is_reported() {
        let bytes = GuestMessage::Ready.encode().unwrap();
        let mut decoder = FrameDecoder::new();
        decoder.push(&bytes[..FRAME_HEADER_LEN - 1]).unwrap();
        assert!(decoder.next_frame().unwrap().is_none());
        assert!(matches!(
            decoder.finish(),
            Err(ProtocolError::TruncatedFrame { buffered: 5 })
        ));
    }
}
