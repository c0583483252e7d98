//! A zstd layer's tar stream: every frame of it, in order, skipping skippable frames.
//!
//! ruzstd decodes one frame at a time, and its streaming reader stops after the first; layers
//! written by parallel compressors, and `zstd:chunked` layers (many frames, then a skippable
//! frame of metadata), need all of them. This loop over frames is the part no crate gives.

use std::io::{BufRead, Read};

use ruzstd::decoding::errors::{FrameDecoderError, ReadFrameHeaderError};
use ruzstd::decoding::{BlockDecodingStrategy, FrameDecoder};

/// The largest window a frame may ask for: what one frame's decoding holds in memory. zstd's
/// own tools need `--long` to write larger ones.
pub(super) const MAX_WINDOW: u64 = 128 << 20;

/// Decodes the zstd frames of `source` one after another.
pub(super) struct Frames<R> {
    source: R,
    decoder: FrameDecoder,
    in_frame: bool,
}

impl<R: BufRead> Frames<R> {
    pub(super) fn new(source: R) -> Self {
        let mut decoder = FrameDecoder::new();
        decoder.set_max_window_size(MAX_WINDOW);
        Frames {
            source,
            decoder,
            in_frame: false,
        }
    }
}

impl<R: BufRead> Read for Frames<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if self.in_frame {
                while self.decoder.can_collect() == 0 && !self.decoder.is_finished() {
                    self.decoder
                        .decode_blocks(&mut self.source, BlockDecodingStrategy::UptoBlocks(1))
                        .map_err(std::io::Error::other)?;
                }
                let n = self.decoder.read(buf)?;
                if n > 0 {
                    return Ok(n);
                }
                if self.decoder.is_finished() && self.decoder.can_collect() == 0 {
                    self.in_frame = false;
                }
                continue;
            }
            // Between frames: the end of the stream, or another frame's header.
            if self.source.fill_buf()?.is_empty() {
                return Ok(0);
            }
            match self.decoder.reset(&mut self.source) {
                Ok(()) => self.in_frame = true,
                Err(FrameDecoderError::ReadFrameHeaderError(ReadFrameHeaderError::SkipFrame {
                    length,
                    ..
                })) => {
                    let skipped = std::io::copy(
                        &mut (&mut self.source).take(length.into()),
                        &mut std::io::sink(),
                    )?;
                    if skipped != u64::from(length) {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "a zstd skippable frame is cut short",
                        ));
                    }
                }
                Err(e) => return Err(std::io::Error::other(e)),
            }
        }
    }
}

/// Fuzzing: `data` as a layer's bytes, decompressed by what its first bytes say it is, read to
/// the end (at most 64 MiB of it). Checks that nothing panics.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn fuzz_layer_stream(data: &[u8]) {
    let Ok(reader) = super::decompress(Box::new(std::io::Cursor::new(data.to_vec()))) else {
        return;
    };
    let _ = std::io::copy(&mut reader.take(64 << 20), &mut std::io::sink());
}

#[cfg(test)]
mod tests {
    use super::*;
    use ruzstd::encoding::{compress_to_vec, CompressionLevel};

    #[test]
    fn committed_layer_stream_corpus_replays() {
        crate::fuzzing::replay_corpus("layer_stream", fuzz_layer_stream);
    }

    /// `KRUNBOX_WRITE_FUZZ_SEEDS=1 cargo test --lib committed_layer_stream_seeds` writes them.
    #[test]
    fn committed_layer_stream_seeds_are_the_generated_ones() {
        crate::fuzzing::assert_committed_seeds("layer_stream", &seeds());
    }

    /// Seeds: a zstd stream of two frames and a skippable frame, a gzip stream, plain bytes.
    fn seeds() -> Vec<Vec<u8>> {
        let mut zstd = compress_to_vec(&b"first frame"[..], CompressionLevel::Fastest);
        zstd.extend_from_slice(&0x184D_2A50u32.to_le_bytes());
        zstd.extend_from_slice(&2u32.to_le_bytes());
        zstd.extend_from_slice(b"ok");
        zstd.extend(compress_to_vec(&[7u8; 3000][..], CompressionLevel::Fastest));
        let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gzip, b"a gzip'd layer").unwrap();
        vec![zstd, gzip.finish().unwrap(), b"plain tar bytes".to_vec()]
    }

    fn decode(bytes: &[u8]) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::new();
        Frames::new(bytes).read_to_end(&mut out)?;
        Ok(out)
    }

    #[test]
    fn every_frame_decodes_and_skippable_frames_are_skipped() {
        let one: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let two = b"the second frame".to_vec();
        let mut stream = compress_to_vec(&one[..], CompressionLevel::Fastest);
        // A skippable frame (magic 0x184D2A50..5F, little-endian length, then its bytes).
        stream.extend_from_slice(&0x184D_2A53u32.to_le_bytes());
        stream.extend_from_slice(&5u32.to_le_bytes());
        stream.extend_from_slice(b"meta!");
        stream.extend(compress_to_vec(&two[..], CompressionLevel::Fastest));
        let mut expected = one.clone();
        expected.extend_from_slice(&two);
        assert_eq!(decode(&stream).unwrap(), expected);
        assert_eq!(decode(&[]).unwrap(), b"");

        // Cut short, or garbage after a frame: an error, never a silent end.
        assert!(decode(&stream[..stream.len() - 3]).is_err());
        let mut garbage = compress_to_vec(&two[..], CompressionLevel::Fastest);
        garbage.extend_from_slice(b"not a frame");
        assert!(decode(&garbage).is_err());
    }
}
