//! Reading guest files: whole ([`Instance::read_file`]) or streamed ([`GuestFileReader`]).

use std::collections::VecDeque;
use std::fmt;
use std::future::{poll_fn, Future};
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};

use super::request::{Pending, Target, IN_FLIGHT};
use super::to_io;
use crate::error::{Error, Result};
use crate::instance::Instance;
use crate::protocol::fs::{FsErrorKind, FsOk, FsOp, MAX_FILE_CHUNK};

/// Reads a guest file as a stream: implements [`AsyncRead`]. From [`Instance::open_file`].
///
/// Up to two chunk reads are in flight while the caller consumes the previous one, so memory
/// stays under about 1.5 MiB whatever the file's size. After an error every further read fails.
pub struct GuestFileReader {
    target: Target,
    /// Offset of the next chunk to request.
    next: u64,
    /// Outstanding reads of `MAX_FILE_CHUNK` bytes, by offset, in file order.
    in_flight: VecDeque<(u64, Pending)>,
    /// The chunk being consumed, and its offset in the file.
    chunk: Vec<u8>,
    chunk_offset: u64,
    pos: usize,
    eof: bool,
    failure: Option<Error>,
}

impl fmt::Debug for GuestFileReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuestFileReader")
            .field("path", &self.target.path)
            .field(
                "position",
                &(self.next - (self.chunk.len() - self.pos) as u64),
            )
            .field("eof", &self.eof)
            .finish_non_exhaustive()
    }
}

impl GuestFileReader {
    /// Starts reading and waits for the first chunk, so that a missing file or a directory
    /// fails here with a typed error.
    async fn open(target: Target) -> Result<GuestFileReader> {
        let mut reader = GuestFileReader {
            target,
            next: 0,
            in_flight: VecDeque::with_capacity(IN_FLIGHT),
            chunk: Vec::new(),
            chunk_offset: 0,
            pos: 0,
            eof: false,
            failure: None,
        };
        poll_fn(|cx| reader.poll_fill(cx)).await?;
        Ok(reader)
    }

    /// The guest path being read.
    pub fn path(&self) -> &Path {
        &self.target.path
    }

    /// Keeps [`IN_FLIGHT`] reads outstanding.
    fn top_up(&mut self) -> Result<()> {
        while self.in_flight.len() < IN_FLIGHT {
            let pending = self.target.send(FsOp::Read {
                path: self.target.wire_path(),
                offset: self.next,
                len: MAX_FILE_CHUNK as u32,
            })?;
            self.in_flight.push_back((self.next, pending));
            self.next += MAX_FILE_CHUNK as u64;
        }
        Ok(())
    }

    /// Ready when there are unread bytes in `chunk`, or at end of file.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        loop {
            if self.pos < self.chunk.len() || self.eof {
                return Poll::Ready(Ok(()));
            }
            if let Some(err) = &self.failure {
                return Poll::Ready(Err(self.target.replay(err)));
            }
            if let Err(err) = ready!(self.poll_chunk(cx)) {
                self.in_flight.clear();
                self.failure = Some(self.target.replay(&err));
                return Poll::Ready(Err(err));
            }
        }
    }

    /// Receives the next chunk in file order into `chunk`.
    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.top_up()?;
        let (offset, pending) = self.in_flight.front_mut().expect("topped up");
        let offset = *offset;
        let result = ready!(Pin::new(pending).poll(cx));
        self.in_flight.pop_front();
        let data = match result?.map_err(|err| self.target.failed(err))? {
            FsOk::Data(data) => data.into_vec(),
            other => return Poll::Ready(Err(self.target.unexpected("Data", &other))),
        };
        if data.len() > MAX_FILE_CHUNK {
            return Poll::Ready(Err(self.target.error(
                FsErrorKind::Other,
                format!(
                    "guest-init returned {} bytes for a smaller read",
                    data.len()
                ),
            )));
        }
        if data.is_empty() {
            self.eof = true;
            self.in_flight.clear();
        } else if data.len() < MAX_FILE_CHUNK {
            // Short (normally the end of the file): the reads already sent ask for the wrong
            // offsets. Continue right after these bytes; an empty answer then confirms EOF.
            self.in_flight.clear();
            self.next = offset + data.len() as u64;
        }
        self.chunk_offset = offset;
        self.chunk = data;
        self.pos = 0;
        if !self.eof {
            // Keep the guest busy while the caller consumes this chunk. A failure to send shows
            // up at the next poll, after these bytes.
            let _ = self.top_up();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for GuestFileReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        ready!(this.poll_fill(cx)).map_err(to_io)?;
        let n = buf.remaining().min(this.chunk.len() - this.pos);
        buf.put_slice(&this.chunk[this.pos..this.pos + n]);
        this.pos += n;
        Poll::Ready(Ok(()))
    }
}

impl Instance {
    /// Reads a whole file from the guest.
    ///
    /// A relative path is relative to the guest's `/`. Reading a directory fails with
    /// [`FsErrorKind::IsADirectory`], a missing file with [`FsErrorKind::NotFound`] (see
    /// [`Error::fs_kind`]).
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let hostname = vm.read_file("/etc/hostname").await?;
    /// println!("{}", String::from_utf8_lossy(&hostname));
    /// # Ok(()) }
    /// ```
    pub async fn read_file(&self, path: impl AsRef<Path>) -> Result<Vec<u8>> {
        let target = Target::new(self, "read_file", path.as_ref())?;
        let mut reader = GuestFileReader::open(target).await?;
        let mut data = std::mem::take(&mut reader.chunk);
        reader.pos = 0;
        loop {
            poll_fn(|cx| reader.poll_fill(cx)).await?;
            if reader.eof {
                return Ok(data);
            }
            data.extend_from_slice(&reader.chunk[reader.pos..]);
            reader.pos = reader.chunk.len();
        }
    }

    /// Opens a guest file for streaming reads ([`AsyncRead`]), for files too large to hold in
    /// memory. Fails here if the file is missing or is a directory.
    ///
    /// A relative path is relative to the guest's `/`.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let mut guest = vm.open_file("/tmp/big.bin").await?;
    /// let mut local = tokio::fs::File::create("big.bin").await.unwrap();
    /// tokio::io::copy(&mut guest, &mut local).await.unwrap();
    /// # Ok(()) }
    /// ```
    pub async fn open_file(&self, path: impl AsRef<Path>) -> Result<GuestFileReader> {
        GuestFileReader::open(Target::new(self, "open_file", path.as_ref())?).await
    }
}
