//! Frame boundaries: a sans-IO decoder that never buffers more than one bounded frame.

use crate::ProtocolError;

/// Bytes in a frame header: `u32` body length, `u16` kind.
pub const FRAME_HEADER_LEN: usize = 6;

/// The largest frame body either side accepts. Large enough for a full command line
/// (see [`crate::limits::MAX_EXEC_BYTES`]) plus slack; output travels in much smaller chunks.
pub const MAX_FRAME_BODY: usize = 1024 * 1024;

/// One frame: a message kind and its still-encoded body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The message kind number.
    pub kind: u16,
    /// The postcard-encoded body.
    pub body: Vec<u8>,
}

impl Frame {
    /// Serialises header and body into one buffer ready to write.
    ///
    /// Fails if the body is larger than [`MAX_FRAME_BODY`].
    pub fn to_bytes(&self) -> Result<Vec<u8>, ProtocolError> {
        if self.body.len() > MAX_FRAME_BODY {
            return Err(ProtocolError::FrameTooLarge {
                len: self.body.len() as u64,
                max: MAX_FRAME_BODY,
            });
        }
        let mut out = Vec::with_capacity(FRAME_HEADER_LEN + self.body.len());
        out.extend_from_slice(&(self.body.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.kind.to_le_bytes());
        out.extend_from_slice(&self.body);
        Ok(out)
    }
}

/// Incremental frame decoder: push bytes as they arrive, pop whole frames.
///
/// It holds at most one header plus one bounded body; a header announcing an oversized body is
/// refused as soon as its six bytes are seen, before any allocation for the body.
///
/// ```
/// use krunbox_protocol::{Frame, FrameDecoder};
///
/// let bytes = Frame { kind: 7, body: vec![1, 2, 3] }.to_bytes().unwrap();
/// let mut decoder = FrameDecoder::new();
/// decoder.push(&bytes[..4]).unwrap();          // half a header: nothing yet
/// assert!(decoder.next_frame().unwrap().is_none());
/// decoder.push(&bytes[4..]).unwrap();
/// assert_eq!(decoder.next_frame().unwrap(), Some(Frame { kind: 7, body: vec![1, 2, 3] }));
/// ```
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    /// Where the unconsumed bytes of `buf` start (frames are taken from the front without
    /// moving the rest each time; the consumed prefix is dropped in bulk).
    start: usize,
    /// Set once a protocol error was seen: the stream cannot be resynchronised.
    poisoned: Option<ProtocolError>,
}

impl FrameDecoder {
    /// A decoder with nothing buffered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes. Fails (and stays failed) if they make an invalid header.
    ///
    /// Callers bound how much they push before taking frames out (a read buffer's worth), so
    /// the decoder holds at most that plus one frame.
    pub fn push(&mut self, bytes: &[u8]) -> Result<(), ProtocolError> {
        if let Some(err) = &self.poisoned {
            return Err(err.clone());
        }
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        } else if self.start > 64 * 1024 && self.start * 2 > self.buf.len() {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
        self.check_header()
    }

    fn pending(&self) -> &[u8] {
        &self.buf[self.start..]
    }

    fn check_header(&mut self) -> Result<(), ProtocolError> {
        let pending = self.pending();
        if pending.len() >= FRAME_HEADER_LEN {
            let len = u32::from_le_bytes([pending[0], pending[1], pending[2], pending[3]]);
            if len as usize > MAX_FRAME_BODY {
                let err = ProtocolError::FrameTooLarge {
                    len: len as u64,
                    max: MAX_FRAME_BODY,
                };
                self.poisoned = Some(err.clone());
                self.buf = Vec::new();
                self.start = 0;
                return Err(err);
            }
        }
        Ok(())
    }

    /// How many bytes the decoder wants before it can make progress. Readers use it to cap a
    /// single read so that the buffer never holds more than one frame plus one header.
    pub fn wanted(&self) -> usize {
        if self.buf.len() < FRAME_HEADER_LEN {
            return FRAME_HEADER_LEN - self.buf.len();
        }
        let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        (FRAME_HEADER_LEN + len)
            .saturating_sub(self.buf.len())
            .max(1)
    }

    /// Bytes held, consumed or not (for bounds checks and tests).
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Pops the next whole frame, if one is buffered.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, ProtocolError> {
        if let Some(err) = &self.poisoned {
            return Err(err.clone());
        }
        let pending = self.pending();
        if pending.len() < FRAME_HEADER_LEN {
            return Ok(None);
        }
        let len = u32::from_le_bytes([pending[0], pending[1], pending[2], pending[3]]) as usize;
        let kind = u16::from_le_bytes([pending[4], pending[5]]);
        let total = FRAME_HEADER_LEN + len;
        if pending.len() < total {
            return Ok(None);
        }
        let body = pending[FRAME_HEADER_LEN..total].to_vec();
        self.start += total;
        self.check_header()?;
        Ok(Some(Frame { kind, body }))
    }

    /// Call at end of stream: an error if the stream stopped inside a frame.
    pub fn finish(&self) -> Result<(), ProtocolError> {
        if self.pending().is_empty() {
            Ok(())
        } else {
            Err(ProtocolError::TruncatedFrame {
                buffered: self.pending().len(),
            })
        }
    }
}
