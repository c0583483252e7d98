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
use crate::protocol::fs::{FileType, FsErrorKind, FsOk, FsOp, MAX_FILE_CHUNK};

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
    /// Reads a whole file from the guest into memory.
    ///
    /// A relative path is relative to the guest's `/`. Reading a directory fails with
    /// [`FsErrorKind::IsADirectory`], a missing file with [`FsErrorKind::NotFound`], a FIFO,
    /// device or socket with [`FsErrorKind::NotAFile`], and a file larger than
    /// [`Limits::read_file_max`](crate::Limits::read_file_max) (64 MiB by default) with
    /// [`FsErrorKind::TooLarge`] (see [`Error::fs_kind`](crate::Error::fs_kind)): stream such
    /// a file with [`Instance::open_file`]. The host never holds more than the limit, also if
    /// the file grows while it is read or the guest misreports its size.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let hostname = vm.read_file("/etc/hostname").await?;
    /// println!("{}", String::from_utf8_lossy(&hostname));
    /// # Ok(()) }
    /// ```
    pub async fn read_file(&self, path: impl AsRef<Path>) -> Result<Vec<u8>> {
        read_whole(Target::new(self, "read_file", path.as_ref())?).await
    }

    /// Opens a guest file for streaming reads ([`AsyncRead`]), for files too large to hold in
    /// memory: there is no size limit, and the host holds at most two chunks (1 MiB) of it.
    /// Fails here if the file is missing, a directory, or not a regular file
    /// ([`FsErrorKind::NotAFile`]).
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

    /// Reads `len` bytes of a guest file from `offset` (fewer where the file ends first, none
    /// past its end): a piece of a log, a header, a window of a file of any size.
    ///
    /// A relative path is relative to the guest's `/`. Fails as [`Instance::read_file`] does
    /// for a missing file, a directory or what is not a regular file, and with
    /// [`FsErrorKind::TooLarge`] for a `len` past
    /// [`Limits::read_file_max`](crate::Limits::read_file_max), before anything is read.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.write_file("/tmp/greeting", "hello world").await?;
    /// assert_eq!(vm.read_file_range("/tmp/greeting", 6, 5).await?, b"world");
    /// # Ok(()) }
    /// ```
    pub async fn read_file_range(
        &self,
        path: impl AsRef<Path>,
        offset: u64,
        len: usize,
    ) -> Result<Vec<u8>> {
        read_range(
            Target::new(self, "read_file_range", path.as_ref())?,
            offset,
            len,
        )
        .await
    }
}

/// Reads `len` bytes at `offset` (fewer at the end of the file), never more than asked.
pub(super) async fn read_range(target: Target, offset: u64, len: usize) -> Result<Vec<u8>> {
    let limit = target.control.limits.read_file_max;
    if len as u64 > limit {
        return Err(too_large(
            &target,
            &format!("{len} bytes were asked for"),
            limit,
        ));
    }
    let mut data = Vec::with_capacity(len.min(MAX_FILE_CHUNK));
    while data.len() < len {
        let want = (len - data.len()).min(MAX_FILE_CHUNK);
        let chunk = match target
            .call(FsOp::Read {
                path: target.wire_path(),
                offset: offset.saturating_add(data.len() as u64),
                len: want as u32,
            })
            .await?
        {
            FsOk::Data(chunk) => chunk,
            other => return Err(target.unexpected("Data", &other)),
        };
        if chunk.is_empty() {
            break;
        }
        // The guest answers at most what was asked; more is a broken guest, not data.
        if chunk.len() > want {
            return Err(target.invalid(&format!(
                "the guest answered {} bytes to a read of {want}",
                chunk.len()
            )));
        }
        data.extend_from_slice(&chunk);
    }
    Ok(data)
}

/// Reads a whole file, never holding more than
/// [`Limits::read_file_max`](crate::Limits::read_file_max) bytes of it.
pub(super) async fn read_whole(target: Target) -> Result<Vec<u8>> {
    let limit = target.control.limits.read_file_max;
    // Type and size first: a device or FIFO is refused without a read, and a file past the
    // limit without moving its bytes. The guest may lie (or /proc files say 0), so the bytes
    // are counted against the limit as they arrive too.
    let meta = match target
        .call(FsOp::Metadata {
            path: target.wire_path(),
            follow: true,
        })
        .await?
    {
        FsOk::Metadata(meta) => meta,
        other => return Err(target.unexpected("Metadata", &other)),
    };
    match meta.file_type {
        FileType::File => {}
        FileType::Dir => {
            return Err(target.error(
                FsErrorKind::IsADirectory,
                format!(
                    "{} is a directory; list it with read_dir",
                    target.path.display()
                ),
            ))
        }
        _ => {
            return Err(target.error(
                FsErrorKind::NotAFile,
                format!(
                    "{} is not a regular file (a FIFO, device or socket); read_file reads \
                     regular files only: run a command such as `head -c N` to read from it",
                    target.path.display()
                ),
            ))
        }
    }
    if meta.len > limit {
        return Err(too_large(
            &target,
            &format!("the file is {} bytes", meta.len),
            limit,
        ));
    }
    let mut reader = GuestFileReader::open(target).await?;
    let mut data = Vec::new();
    loop {
        let chunk = &reader.chunk[reader.pos..];
        if data.len() as u64 + chunk.len() as u64 > limit {
            return Err(too_large(
                &reader.target,
                &format!("the file grew past {limit} bytes while it was read"),
                limit,
            ));
        }
        data.extend_from_slice(chunk);
        reader.pos = reader.chunk.len();
        poll_fn(|cx| reader.poll_fill(cx)).await?;
        if reader.eof {
            return Ok(data);
        }
    }
}

fn too_large(target: &Target, what: &str, limit: u64) -> crate::Error {
    target.error(
        FsErrorKind::TooLarge,
        format!(
            "{what}; read_file holds at most {limit} bytes in memory (Limits::read_file_max): \
             stream it with Instance::open_file, or raise the limit"
        ),
    )
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_bytes::ByteBuf;

    use super::*;
    use crate::limits::Limits;
    use crate::protocol::fs::{FileMeta, FsReply};
    use crate::protocol::{GuestMessage, HostMessage};
    use crate::scripted_guest::{self, Log};
    use crate::Error;

    fn meta(file_type: FileType, len: u64) -> FsOk {
        FsOk::Metadata(FileMeta {
            file_type,
            len,
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime_secs: 0,
            mtime_nanos: 0,
        })
    }

    /// A guest whose `stat` says `file_type` and `len`, and whose every read returns a full
    /// chunk of sevens (a file without end, whatever it announced).
    fn lying_guest(limits: Limits, file_type: FileType, len: u64) -> (Target, Log) {
        let (control, log) = scripted_guest::start(limits, move |message| {
            let HostMessage::Fs(request) = message else {
                return vec![];
            };
            let result = match &request.op {
                FsOp::Metadata { .. } => meta(file_type, len),
                FsOp::Read { len, .. } => FsOk::Data(ByteBuf::from(vec![7u8; *len as usize])),
                _ => FsOk::Done,
            };
            vec![GuestMessage::FsReply(FsReply {
                id: request.id,
                result: Ok(result),
            })]
        });
        let target = Target::with_control(control, "read_file", Path::new("/f")).unwrap();
        (target, log)
    }

    fn reads(log: &Log) -> usize {
        log.lock()
            .unwrap()
            .iter()
            .filter(|m| matches!(m, HostMessage::Fs(r) if matches!(r.op, FsOp::Read { .. })))
            .count()
    }

    fn kind_and_message(result: Result<Vec<u8>>) -> (FsErrorKind, String) {
        match result {
            Err(err @ Error::Fs { .. }) => (err.fs_kind().unwrap(), err.to_string()),
            other => panic!("expected a file error, got {:?}", other.map(|d| d.len())),
        }
    }

    /// The guest announces 10 bytes and then sends chunks without end: the host stops at the
    /// limit with a typed error, having asked for little more than the limit's worth.
    #[tokio::test(start_paused = true)]
    async fn read_file_holds_at_most_the_limit_when_the_guest_lies() {
        let limit = 2 * MAX_FILE_CHUNK as u64 + 1;
        let (target, log) = lying_guest(Limits::new().read_file_max(limit), FileType::File, 10);
        let read = tokio::time::timeout(std::time::Duration::from_secs(600), read_whole(target));
        let (kind, message) = kind_and_message(read.await.expect("the read must end"));
        assert_eq!(kind, FsErrorKind::TooLarge, "{message}");
        assert!(message.contains("grew past"), "{message}");
        assert!(message.contains("open_file"), "{message}");
        // Three chunks cross the limit; the stream keeps two more in flight.
        assert!(reads(&log) <= 3 + 2, "{} reads", reads(&log));
    }

    /// A file past the limit, or a FIFO or device, is refused on its `stat`, before any read.
    #[tokio::test(start_paused = true)]
    async fn read_file_refuses_big_files_and_devices_without_reading() {
        let (target, log) = lying_guest(Limits::new(), FileType::File, 10 << 30);
        let (kind, message) = kind_and_message(read_whole(target).await);
        assert_eq!(kind, FsErrorKind::TooLarge, "{message}");
        assert!(message.contains("10737418240 bytes"), "{message}");
        assert!(message.contains(&(64u64 << 20).to_string()), "{message}");
        assert_eq!(reads(&log), 0);

        let (target, log) = lying_guest(Limits::new(), FileType::Other, 0);
        let (kind, message) = kind_and_message(read_whole(target).await);
        assert_eq!(kind, FsErrorKind::NotAFile, "{message}");
        assert_eq!(reads(&log), 0);

        // Within the limit, the bytes arrive (the limit counts exactly).
        let (target, _) = lying_guest(
            Limits::new().read_file_max(MAX_FILE_CHUNK as u64),
            FileType::File,
            0,
        );
        let (kind, _) = kind_and_message(read_whole(target).await);
        assert_eq!(kind, FsErrorKind::TooLarge);
    }

    /// A range is read in chunks up to exactly its length, however much more the file has; a
    /// length past the limit is refused before any read.
    #[tokio::test(start_paused = true)]
    async fn a_range_reads_exactly_its_length_and_never_past_the_limit() {
        let len = 2 * MAX_FILE_CHUNK + 5;
        let (target, log) = lying_guest(Limits::new(), FileType::File, 10);
        let data = read_range(target, 7, len).await.unwrap();
        assert_eq!(data.len(), len);
        assert_eq!(reads(&log), 3);
        let (target, log) = lying_guest(Limits::new().read_file_max(100), FileType::File, 10);
        let (kind, message) = kind_and_message(read_range(target, 0, 101).await);
        assert_eq!(kind, FsErrorKind::TooLarge, "{message}");
        assert_eq!(reads(&log), 0);
    }
}
