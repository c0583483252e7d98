//! The stream between libkrun's virtio-net device and the host service: each Ethernet frame is
//! preceded by its length, a 4-byte big-endian number (passt's and gvproxy's framing, which
//! libkrun's unix stream backend speaks).
//!
//! [`FrameDecoder`] is sans-IO: it is fed whatever bytes arrived and yields whole frames or
//! typed errors. It never holds more than one frame of at most [`MAX_FRAME`] bytes. A length it
//! refuses (too short to be Ethernet, or above the MTU plus the Ethernet header) is reported
//! once and its bytes are skipped, so the stream stays in step: a guest that raises its MTU
//! loses those frames, not its network.

/// The guest's MTU (the IP packet size). Neither side offers segmentation offloads, so no frame
/// in either direction is larger than this plus [`ETHERNET_HEADER`].
pub const MTU: usize = 1500;

/// Destination MAC, source MAC, EtherType.
pub const ETHERNET_HEADER: usize = 14;

/// The largest frame accepted or sent.
pub const MAX_FRAME: usize = MTU + ETHERNET_HEADER;

/// The length prefix.
pub const LENGTH_PREFIX: usize = 4;

/// A frame the decoder refused. The decoder skips it and carries on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A frame longer than the MTU allows.
    #[error("a {len}-byte frame is larger than the {MAX_FRAME}-byte maximum (MTU {MTU})")]
    TooLarge {
        /// The length its prefix announced.
        len: u32,
    },
    /// A frame too short to hold an Ethernet header (including an empty one).
    #[error("a {len}-byte frame is shorter than an Ethernet header")]
    TooShort {
        /// The length its prefix announced.
        len: u32,
    },
    /// The stream ended inside a frame (or inside a length prefix).
    #[error("the stream ended {missing} bytes before the end of a frame")]
    Truncated {
        /// Bytes still expected.
        missing: usize,
    },
}

#[derive(Debug)]
enum State {
    /// Reading the length prefix; `have` bytes of it so far.
    Length {
        bytes: [u8; LENGTH_PREFIX],
        have: usize,
    },
    /// Reading a frame of `len` bytes into the buffer.
    Body { len: usize },
    /// Discarding a refused frame's remaining bytes.
    Skip { remaining: u64 },
}

/// Decodes the length-prefixed stream into Ethernet frames, holding at most one frame.
#[derive(Debug)]
pub struct FrameDecoder {
    state: State,
    frame: Vec<u8>,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameDecoder {
    /// A decoder at the start of a stream.
    pub fn new() -> Self {
        Self {
            state: State::Length {
                bytes: [0; LENGTH_PREFIX],
                have: 0,
            },
            frame: Vec::with_capacity(MAX_FRAME),
        }
    }

    /// Consumes bytes from the front of `input` until one frame is complete (returned, and
    /// `input` then starts after it), a frame is refused (the error; its body will be skipped
    /// by later calls), or `input` is used up (`None`). Call it again while it returns `Some`.
    pub fn decode(&mut self, input: &mut &[u8]) -> Option<Result<Vec<u8>, FrameError>> {
        loop {
            if input.is_empty() {
                return None;
            }
            match &mut self.state {
                State::Length { bytes, have } => {
                    let take = (LENGTH_PREFIX - *have).min(input.len());
                    bytes[*have..*have + take].copy_from_slice(&input[..take]);
                    *have += take;
                    *input = &input[take..];
                    if *have < LENGTH_PREFIX {
                        return None;
                    }
                    let len = u32::from_be_bytes(*bytes);
                    let refused = if (len as usize) < ETHERNET_HEADER {
                        Some(FrameError::TooShort { len })
                    } else if len as usize > MAX_FRAME {
                        Some(FrameError::TooLarge { len })
                    } else {
                        None
                    };
                    if let Some(err) = refused {
                        self.state = State::Skip {
                            remaining: u64::from(len),
                        };
                        return Some(Err(err));
                    }
                    self.frame.clear();
                    self.state = State::Body { len: len as usize };
                }
                State::Body { len } => {
                    let take = (*len - self.frame.len()).min(input.len());
                    self.frame.extend_from_slice(&input[..take]);
                    *input = &input[take..];
                    if self.frame.len() < *len {
                        return None;
                    }
                    self.state = State::Length {
                        bytes: [0; LENGTH_PREFIX],
                        have: 0,
                    };
                    let frame = self.frame.clone();
                    self.frame.clear();
                    return Some(Ok(frame));
                }
                State::Skip { remaining } => {
                    let take = (*remaining).min(input.len() as u64) as usize;
                    *remaining -= take as u64;
                    *input = &input[take..];
                    if *remaining == 0 {
                        self.state = State::Length {
                            bytes: [0; LENGTH_PREFIX],
                            have: 0,
                        };
                    }
                }
            }
        }
    }

    /// The stream ended: an error if it ended inside a frame or a length prefix.
    pub fn finish(&self) -> Result<(), FrameError> {
        let missing = match &self.state {
            State::Length { have: 0, .. } => 0,
            State::Length { have, .. } => LENGTH_PREFIX - have,
            State::Body { len } => len - self.frame.len(),
            State::Skip { remaining } => usize::try_from(*remaining).unwrap_or(usize::MAX),
        };
        if missing == 0 {
            Ok(())
        } else {
            Err(FrameError::Truncated { missing })
        }
    }
}

/// Appends `frame` with its length prefix to `out`. Frames above [`MAX_FRAME`] are a bug of
/// the stack (its MTU is [`MTU`]) and are refused rather than sent: libkrun's reader trusts the
/// length.
pub fn encode(frame: &[u8], out: &mut Vec<u8>) -> Result<(), FrameError> {
    if frame.len() > MAX_FRAME {
        return Err(FrameError::TooLarge {
            len: frame.len() as u32,
        });
    }
    if frame.len() < ETHERNET_HEADER {
        return Err(FrameError::TooShort {
            len: frame.len() as u32,
        });
    }
    out.extend_from_slice(&(frame.len() as u32).to_be_bytes());
    out.extend_from_slice(frame);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(frames: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for f in frames {
            out.extend_from_slice(&(f.len() as u32).to_be_bytes());
            out.extend_from_slice(f);
        }
        out
    }

    fn decode_all(
        decoder: &mut FrameDecoder,
        mut input: &[u8],
    ) -> Vec<Result<Vec<u8>, FrameError>> {
        let mut out = Vec::new();
        while let Some(item) = decoder.decode(&mut input) {
            out.push(item);
        }
        assert!(
            input.is_empty(),
            "the decoder consumes everything it is given"
        );
        out
    }

    #[test]
    fn frames_come_out_whole_however_the_stream_is_cut() {
        let a = vec![1u8; 60];
        let b = vec![2u8; MAX_FRAME];
        let stream = framed(&[&a, &b, &a]);
        for cut in [1, 3, 4, 5, 61, 64, 1000, stream.len()] {
            let mut decoder = FrameDecoder::new();
            let mut got = Vec::new();
            for chunk in stream.chunks(cut) {
                got.extend(decode_all(&mut decoder, chunk));
            }
            assert_eq!(
                got,
                vec![Ok(a.clone()), Ok(b.clone()), Ok(a.clone())],
                "cut {cut}"
            );
            decoder.finish().unwrap();
        }
    }

    #[test]
    fn oversized_and_short_frames_are_refused_and_skipped_without_losing_step() {
        let good = vec![7u8; 64];
        let big = vec![0u8; MAX_FRAME + 1];
        let mut stream = framed(&[&big, &[1, 2, 3], &[], &good]);
        // The largest frame libkrun can send (64 KiB of a raised MTU): skipped, not held.
        stream.extend_from_slice(&65_550u32.to_be_bytes());
        stream.extend(std::iter::repeat_n(9u8, 65_550));
        stream.extend(framed(&[&good]));
        let mut decoder = FrameDecoder::new();
        let got: Vec<_> = stream
            .chunks(700)
            .flat_map(|c| decode_all(&mut decoder, c))
            .collect();
        assert_eq!(
            got,
            vec![
                Err(FrameError::TooLarge {
                    len: MAX_FRAME as u32 + 1
                }),
                Err(FrameError::TooShort { len: 3 }),
                Err(FrameError::TooShort { len: 0 }),
                Ok(good.clone()),
                Err(FrameError::TooLarge { len: 65_550 }),
                Ok(good),
            ]
        );
        assert!(
            decoder.frame.capacity() <= MAX_FRAME,
            "never held a big frame"
        );
    }

    #[test]
    fn a_truncated_stream_is_reported_at_its_end() {
        let mut decoder = FrameDecoder::new();
        assert!(decode_all(&mut decoder, &[0, 0]).is_empty());
        assert_eq!(decoder.finish(), Err(FrameError::Truncated { missing: 2 }));
        let mut decoder = FrameDecoder::new();
        let stream = framed(&[&[5u8; 100]]);
        assert!(decode_all(&mut decoder, &stream[..50]).is_empty());
        assert_eq!(decoder.finish(), Err(FrameError::Truncated { missing: 54 }));
        // Inside a refused frame's body.
        let mut decoder = FrameDecoder::new();
        let got = decode_all(&mut decoder, &u32::MAX.to_be_bytes());
        assert_eq!(got, vec![Err(FrameError::TooLarge { len: u32::MAX })]);
        assert_eq!(
            decoder.finish(),
            Err(FrameError::Truncated {
                missing: u32::MAX as usize
            })
        );
    }

    #[test]
    fn garbage_never_panics_and_never_yields_an_out_of_bounds_frame() {
        let mut next = crate::fuzzing::xorshift(0x9e37_79b9_7f4a_7c15);
        for _ in 0..200 {
            let len = (next() % 8192) as usize;
            let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            // Plausible lengths now and then, so bodies are decoded too.
            for i in (0..bytes.len().saturating_sub(4)).step_by(97) {
                if next().is_multiple_of(2) {
                    let l = (next() % 1600) as u32;
                    bytes[i..i + 4].copy_from_slice(&l.to_be_bytes());
                }
            }
            let mut decoder = FrameDecoder::new();
            let cut = 1 + (next() % 600) as usize;
            for chunk in bytes.chunks(cut) {
                for frame in decode_all(&mut decoder, chunk).into_iter().flatten() {
                    assert!((ETHERNET_HEADER..=MAX_FRAME).contains(&frame.len()));
                }
            }
            let _ = decoder.finish();
        }
    }

    #[test]
    fn encoding_prefixes_the_length_and_refuses_what_libkrun_could_not_take() {
        let mut out = Vec::new();
        encode(&[3u8; 60], &mut out).unwrap();
        assert_eq!(&out[..4], &60u32.to_be_bytes());
        let mut decoder = FrameDecoder::new();
        assert_eq!(decode_all(&mut decoder, &out), vec![Ok(vec![3u8; 60])]);
        assert!(encode(&vec![0u8; MAX_FRAME + 1], &mut out).is_err());
        assert!(encode(&[0u8; 10], &mut out).is_err());
        assert_eq!(out.len(), 64, "nothing appended for a refused frame");
    }
}
