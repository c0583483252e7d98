//! The control protocol between the krunbox host library and `guest-init`.
//!
//! This crate is the one place both sides of the host↔guest boundary share: the host library
//! re-exports it as `krunbox::protocol`, and the static `guest-init` binary links it directly.
//!
//! # Wire format
//!
//! The byte stream (a vsock connection in the guest, a unix socket on the host) carries
//! *frames*:
//!
//! ```text
//! +----------------+--------------+-----------------------------+
//! | body_len: u32  | kind: u16    | body: body_len bytes        |
//! | little endian  | little endian| postcard-encoded message    |
//! +----------------+--------------+-----------------------------+
//! ```
//!
//! * Every length is bounded before anything is allocated: a frame body is at most
//!   [`MAX_FRAME_BODY`] bytes, and each message has its own limits ([`limits`]).
//! * The `kind` is explicit (rather than a serde enum tag) so that a peer can recognise a
//!   message kind it does not know and report it precisely; new kinds get new numbers and old
//!   numbers are never reused.
//! * The first frame from the guest is [`GuestMessage::Hello`] carrying [`PROTOCOL_VERSION`];
//!   the host refuses a different version before it sends anything else.
//!
//! The guest is hostile: decoding never panics, whatever the bytes. [`FrameDecoder`] is a
//! sans-IO incremental decoder used by both sides (and by the fuzz target in `fuzz/`).
//!
//! # Example
//!
//! ```
//! use krunbox_protocol::{FrameDecoder, GuestMessage, Hello, PROTOCOL_VERSION};
//!
//! let hello = GuestMessage::Hello(Hello {
//!     version: PROTOCOL_VERSION,
//!     guest_init: "0.1.0".into(),
//!     kernel_release: "6.12.0".into(),
//! });
//! let bytes = hello.encode().unwrap();
//!
//! let mut decoder = FrameDecoder::new();
//! decoder.push(&bytes).unwrap();
//! let frame = decoder.next_frame().unwrap().expect("one whole frame");
//! assert_eq!(GuestMessage::decode(&frame).unwrap(), hello);
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod frame;
pub mod fs;
mod message;
pub mod search;
pub mod vmm;

pub use frame::{Frame, FrameDecoder, FRAME_HEADER_LEN, MAX_FRAME_BODY};
pub use message::*;

/// The fuzzing property, shared by `fuzz/` (cargo fuzz) and this crate's tests: feed `data` to
/// a decoder in chunks whose sizes come from the data itself, decode every frame in both
/// directions, and check that nothing panics, that the decoder never buffers more than one
/// frame, and that every message that decodes re-encodes to a frame that decodes to the same
/// message.
#[doc(hidden)]
pub fn fuzz_control_stream(data: &[u8]) {
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(split % 64) + 1;
    let mut decoder = FrameDecoder::new();
    for piece in rest.chunks(chunk) {
        if decoder.push(piece).is_err() {
            return;
        }
        loop {
            match decoder.next_frame() {
                Ok(Some(frame)) => {
                    if let Ok(message) = GuestMessage::decode(&frame) {
                        let again = GuestMessage::decode(&message.to_frame().expect("re-encodes"))
                            .expect("re-decodes");
                        assert_eq!(again, message);
                    }
                    if let Ok(message) = HostMessage::decode(&frame) {
                        let again = HostMessage::decode(&message.to_frame().expect("re-encodes"))
                            .expect("re-decodes");
                        assert_eq!(again, message);
                    }
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
        assert!(decoder.wanted() <= FRAME_HEADER_LEN + MAX_FRAME_BODY);
        assert!(decoder.buffered() <= 2 * (FRAME_HEADER_LEN + MAX_FRAME_BODY) + 64 * 1024);
    }
}

/// The protocol version spoken by this build. Bumped on any incompatible change.
pub const PROTOCOL_VERSION: u32 = 15;

/// The vsock port on the host (CID 2) that `guest-init` connects to for its control channel.
pub const CONTROL_PORT: u32 = 1024;

/// The virtio-fs tag of host filesystem `index` in [`Setup::mounts`]: `guest-init` mounts it
/// with `mount -t virtiofs`. The device is the host's (krunbox's helper), one per mount.
pub fn mount_tag(index: u32) -> String {
    format!("kbfs{index}")
}

/// Bounds on every variable-length field, checked on decode (and on encode, so a host bug
/// is caught on the host rather than rejected by the guest).
pub mod limits {
    /// Arguments in one command line, `argv[0]` included.
    pub const MAX_ARGS: usize = 4096;
    /// Environment variables for one command.
    pub const MAX_ENV: usize = 4096;
    /// Total bytes of argv plus environment for one command (Linux's own ARG_MAX is 2 MiB
    /// by default; we stay well inside one frame).
    pub const MAX_EXEC_BYTES: usize = 512 * 1024;
    /// One chunk of process output or input. Large: under nested emulation every message has a
    /// high fixed cost, so fewer, bigger chunks stream several times faster.
    pub const MAX_CHUNK: usize = 256 * 1024;
    /// Free-form text (error messages, version strings, hostnames, paths).
    pub const MAX_TEXT: usize = 4096;
}

/// Why bytes from the peer were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// A frame announced a body larger than [`MAX_FRAME_BODY`].
    #[error("frame body of {len} bytes exceeds the {max}-byte limit")]
    FrameTooLarge {
        /// Announced body length.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// The message kind is not one this side understands in this direction.
    #[error("unknown message kind {kind} in a {direction} frame")]
    UnknownKind {
        /// The kind number received.
        kind: u16,
        /// `"host-to-guest"` or `"guest-to-host"`.
        direction: &'static str,
    },
    /// The body did not decode as the message its kind names.
    #[error("malformed {message} message: {reason}")]
    Malformed {
        /// Message name.
        message: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// A field broke one of the [`limits`].
    #[error("{field} is out of bounds: {detail}")]
    OutOfBounds {
        /// Which field.
        field: &'static str,
        /// What bound was broken.
        detail: String,
    },
    /// The peer speaks another protocol version.
    #[error("protocol version mismatch: this side speaks {ours}, the peer {theirs}; rebuild guest-init and the host library from the same source")]
    VersionMismatch {
        /// Our version.
        ours: u32,
        /// The peer's version.
        theirs: u32,
    },
    /// The stream ended inside a frame.
    #[error("the stream ended inside a frame ({buffered} bytes of an unfinished frame)")]
    TruncatedFrame {
        /// Bytes that were buffered.
        buffered: usize,
    },
}
