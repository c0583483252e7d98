//! Files in the guest: read, write, stat, list, remove (see `krunbox::protocol::fs`).
//!
//! Every operation is a request/response pair on the control channel, answered by guest-init
//! (as root, on its own thread). Data moves in chunks of at most
//! [`MAX_FILE_CHUNK`](crate::protocol::fs::MAX_FILE_CHUNK) bytes; streams keep up to
//! [`IN_FLIGHT`] chunk requests outstanding, which bounds memory and is the flow control.
//!
//! Paths are guest paths. A relative path is taken relative to the guest's `/` (there is no
//! working directory for file operations).

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fmt;
use std::future::{poll_fn, Future};
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_bytes::ByteBuf;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;

use crate::control::{Control, Gone};
use crate::error::{Error, Result};
use crate::instance::Instance;
use crate::protocol::fs::{
    FileMeta, FileType, FsError, FsErrorKind, FsOk, FsOp, FsReply, FsRequest, MAX_FILE_CHUNK,
};
use crate::protocol::limits::MAX_TEXT;
use crate::protocol::HostMessage;

/// Chunk requests a stream keeps outstanding: one being answered while the next is on its way.
const IN_FLIGHT: usize = 2;

/// Mode of files created by [`Instance::write_file`].
const FILE_MODE: u32 = 0o644;

/// Mode of directories created by [`Instance::create_dir_all`].
const DIR_MODE: u32 = 0o755;

/// What `stat` says about a file in the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Metadata {
    /// File, directory, symlink or other.
    pub file_type: FileType,
    /// Size in bytes (for a symlink, the length of its target).
    pub len: u64,
    /// Permission bits, `st_mode & 0o7777` (e.g. `0o644`).
    pub mode: u32,
    /// Owner's user id in the guest.
    pub uid: u32,
    /// Owner's group id in the guest.
    pub gid: u32,
    /// Last modification (the guest's clock).
    pub modified: SystemTime,
}

impl Metadata {
    /// Whether this is a regular file.
    pub fn is_file(&self) -> bool {
        self.file_type == FileType::File
    }

    /// Whether this is a directory.
    pub fn is_dir(&self) -> bool {
        self.file_type == FileType::Dir
    }

    /// Whether this is a symbolic link (only [`Instance::symlink_metadata`] reports these).
    pub fn is_symlink(&self) -> bool {
        self.file_type == FileType::Symlink
    }

    fn from_wire(meta: FileMeta) -> Metadata {
        let nanos = Duration::from_nanos(u64::from(meta.mtime_nanos.min(999_999_999)));
        let modified = if meta.mtime_secs >= 0 {
            UNIX_EPOCH.checked_add(Duration::from_secs(meta.mtime_secs as u64) + nanos)
        } else {
            UNIX_EPOCH
                .checked_sub(Duration::from_secs(meta.mtime_secs.unsigned_abs()))
                .and_then(|t| t.checked_add(nanos))
        };
        Metadata {
            file_type: meta.file_type,
            len: meta.len,
            mode: meta.mode & 0o7777,
            uid: meta.uid,
            gid: meta.gid,
            modified: modified.unwrap_or(UNIX_EPOCH),
        }
    }
}

/// One entry of a guest directory, from [`Instance::read_dir`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DirEntry {
    /// The file name (no directory part; Linux names are bytes, not necessarily UTF-8).
    pub name: OsString,
    /// The entry's own type: a symlink is reported as [`FileType::Symlink`], not followed.
    pub file_type: FileType,
}

/// One request on its way to the guest; resolves to guest-init's answer.
struct Pending {
    rx: oneshot::Receiver<FsReply>,
    control: Arc<Control>,
}

impl Future for Pending {
    type Output = Result<Result<FsOk, FsError>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Poll::Ready(match ready!(Pin::new(&mut self.rx).poll(cx)) {
            Ok(reply) => Ok(reply.result),
            Err(_) => Err(self
                .control
                .gone()
                .unwrap_or_else(|| {
                    Gone::Stopped("the instance stopped before answering a file operation".into())
                })
                .error()),
        })
    }
}

/// An operation's subject: which instance, which guest path, and the name errors report.
#[derive(Clone)]
struct Target {
    instance: Instance,
    op: &'static str,
    /// Absolute guest path.
    path: PathBuf,
}

impl Target {
    fn new(instance: &Instance, op: &'static str, path: &Path) -> Result<Target> {
        let target = Target {
            instance: instance.clone(),
            op,
            // Relative to the guest's `/`; an empty path stays empty (and is refused).
            path: if path.as_os_str().is_empty() {
                PathBuf::new()
            } else {
                Path::new("/").join(path)
            },
        };
        let bytes = target.path.as_os_str().as_bytes();
        if bytes.is_empty() {
            return Err(target.invalid("the path is empty"));
        }
        if bytes.contains(&0) {
            return Err(target.invalid("the path contains a NUL byte"));
        }
        if bytes.len() > MAX_TEXT {
            return Err(target.invalid(&format!(
                "the path is {} bytes long; the limit is {MAX_TEXT}",
                bytes.len()
            )));
        }
        Ok(target)
    }

    fn wire_path(&self) -> ByteBuf {
        ByteBuf::from(self.path.as_os_str().as_bytes().to_vec())
    }

    fn error(&self, kind: FsErrorKind, message: String) -> Error {
        Error::Fs {
            op: self.op,
            path: self.path.clone(),
            kind,
            message,
        }
    }

    fn invalid(&self, message: &str) -> Error {
        self.error(FsErrorKind::InvalidInput, message.into())
    }

    /// The guest's failure as a typed error.
    fn failed(&self, err: FsError) -> Error {
        self.error(err.kind, err.message)
    }

    /// guest-init answered with the wrong kind of result.
    fn unexpected(&self, expected: &str, got: &FsOk) -> Error {
        let got = match got {
            FsOk::Done => "Done",
            FsOk::Data(_) => "Data",
            FsOk::Metadata(_) => "Metadata",
            FsOk::Entries { .. } => "Entries",
        };
        self.error(
            FsErrorKind::Other,
            format!("guest-init answered {got} to a request expecting {expected}"),
        )
    }

    /// A copy of an error already reported once (streams keep failing after a failure).
    fn replay(&self, err: &Error) -> Error {
        match err {
            Error::Fs {
                op,
                path,
                kind,
                message,
            } => Error::Fs {
                op,
                path: path.clone(),
                kind: *kind,
                message: message.clone(),
            },
            Error::InstanceGone { reason } => Error::InstanceGone {
                reason: reason.clone(),
            },
            Error::GuestHung { silent_for } => Error::GuestHung {
                silent_for: *silent_for,
            },
            Error::Protocol(err) => Error::Protocol(err.clone()),
            other => self.error(FsErrorKind::Other, other.to_string()),
        }
    }

    /// Sends `op` now (so requests reach the guest in call order); the reply comes later.
    fn send(&self, op: FsOp) -> Result<Pending> {
        let control = self.instance.control()?;
        let request = FsRequest {
            id: self.instance.next_process_id(),
            op,
        };
        // Paths were checked in `new` and chunks are sized here, so this is a backstop: a bad
        // request must fail at the call, before a reply slot is registered for it.
        request
            .validate()
            .map_err(|err| self.invalid(&err.to_string()))?;
        let rx = control.register_fs(request.id)?;
        control.send(&HostMessage::Fs(request))?;
        Ok(Pending { rx, control })
    }

    async fn call(&self, op: FsOp) -> Result<FsOk> {
        self.send(op)?.await?.map_err(|err| self.failed(err))
    }

    async fn call_done(&self, op: FsOp) -> Result<()> {
        match self.call(op).await? {
            FsOk::Done => Ok(()),
            other => Err(self.unexpected("Done", &other)),
        }
    }
}

/// As an `io::Error` (for the `AsyncRead`/`AsyncWrite` impls), keeping the typed error inside:
/// `err.get_ref()` and `downcast_ref::<krunbox::Error>()` give it back.
fn to_io(err: Error) -> io::Error {
    let kind = match &err {
        Error::Fs { kind, .. } => match kind {
            FsErrorKind::NotFound => io::ErrorKind::NotFound,
            FsErrorKind::PermissionDenied => io::ErrorKind::PermissionDenied,
            FsErrorKind::IsADirectory => io::ErrorKind::IsADirectory,
            FsErrorKind::NotADirectory => io::ErrorKind::NotADirectory,
            FsErrorKind::AlreadyExists => io::ErrorKind::AlreadyExists,
            FsErrorKind::DirectoryNotEmpty => io::ErrorKind::DirectoryNotEmpty,
            FsErrorKind::InvalidInput => io::ErrorKind::InvalidInput,
            FsErrorKind::Other => io::ErrorKind::Other,
            FsErrorKind::NotAFile => io::ErrorKind::InvalidInput,
            FsErrorKind::TooLarge => io::ErrorKind::FileTooLarge,
        },
        Error::InstanceGone { .. } | Error::GuestHung { .. } => io::ErrorKind::BrokenPipe,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, err)
}

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

/// Writes a guest file as a stream: implements [`AsyncWrite`]. From [`Instance::create_file`].
///
/// Bytes are buffered up to one chunk, then sent; at most two chunk writes are in flight.
/// `shutdown()` (or [`GuestFileWriter::finish`], which returns the typed error) sends the rest,
/// waits for every write, and `fsync`s the file. `flush()` waits until the guest has written
/// everything so far (not synced). Dropping the writer without finishing discards what is
/// still buffered. After an error every further call fails.
pub struct GuestFileWriter {
    target: Target,
    buf: Vec<u8>,
    /// File offset of `buf[0]`.
    offset: u64,
    in_flight: VecDeque<Pending>,
    sync: Option<Pending>,
    finished: bool,
    failure: Option<Error>,
}

impl fmt::Debug for GuestFileWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuestFileWriter")
            .field("path", &self.target.path)
            .field("position", &(self.offset + self.buf.len() as u64))
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl GuestFileWriter {
    /// A writer continuing at `offset` of a file that already exists.
    fn new(target: Target, offset: u64) -> GuestFileWriter {
        GuestFileWriter {
            target,
            buf: Vec::new(),
            offset,
            in_flight: VecDeque::with_capacity(IN_FLIGHT),
            sync: None,
            finished: false,
            failure: None,
        }
    }

    /// The guest path being written.
    pub fn path(&self) -> &Path {
        &self.target.path
    }

    /// Sends what is buffered, waits until the guest has written all of it, `fsync`s the file
    /// and reports any error on the way, typed.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// use tokio::io::AsyncWriteExt;
    ///
    /// let mut file = vm.create_file("/tmp/log.txt", 0o600).await?;
    /// file.write_all(b"line one\n").await.unwrap();
    /// file.finish().await?;
    /// # Ok(()) }
    /// ```
    pub async fn finish(mut self) -> Result<()> {
        poll_fn(|cx| self.poll_finish(cx)).await
    }

    /// Remembers the first failure so later calls report it again.
    fn record<T>(&mut self, result: Result<T>) -> Result<T> {
        if let Err(err) = &result {
            if self.failure.is_none() {
                self.failure = Some(self.target.replay(err));
            }
            self.in_flight.clear();
            self.sync = None;
        }
        result
    }

    fn check_usable(&self) -> Result<()> {
        if let Some(err) = &self.failure {
            return Err(self.target.replay(err));
        }
        if self.finished {
            return Err(self.target.error(
                FsErrorKind::InvalidInput,
                "the writer was already finished".into(),
            ));
        }
        Ok(())
    }

    /// Waits for the oldest outstanding write.
    fn poll_oldest(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let pending = self.in_flight.front_mut().expect("a write in flight");
        let result = ready!(Pin::new(pending).poll(cx));
        self.in_flight.pop_front();
        Poll::Ready(match result?.map_err(|err| self.target.failed(err))? {
            FsOk::Done => Ok(()),
            other => Err(self.target.unexpected("Done", &other)),
        })
    }

    /// Sends the buffer as one chunk once a slot is free.
    fn poll_send_buf(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        while self.in_flight.len() >= IN_FLIGHT {
            ready!(self.poll_oldest(cx))?;
        }
        let data = std::mem::take(&mut self.buf);
        let len = data.len() as u64;
        let pending = self.target.send(FsOp::Write {
            path: self.target.wire_path(),
            offset: self.offset,
            data: ByteBuf::from(data),
            mode: 0,
            create: false,
            truncate: false,
        })?;
        self.in_flight.push_back(pending);
        self.offset += len;
        Poll::Ready(Ok(()))
    }

    fn poll_write_inner(&mut self, cx: &mut Context<'_>, data: &[u8]) -> Poll<Result<usize>> {
        self.check_usable()?;
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if self.buf.len() >= MAX_FILE_CHUNK {
            let sent = ready!(self.poll_send_buf(cx));
            self.record(sent)?;
        }
        if self.buf.capacity() == 0 {
            self.buf.reserve_exact(MAX_FILE_CHUNK);
        }
        let n = data.len().min(MAX_FILE_CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_flush_inner(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.check_usable()?;
        let result = ready!(self.poll_drain(cx));
        Poll::Ready(self.record(result))
    }

    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if !self.buf.is_empty() {
            ready!(self.poll_send_buf(cx))?;
        }
        while !self.in_flight.is_empty() {
            ready!(self.poll_oldest(cx))?;
        }
        Poll::Ready(Ok(()))
    }

    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if self.finished && self.failure.is_none() {
            return Poll::Ready(Ok(()));
        }
        self.check_usable()?;
        let result = ready!(self.poll_drain_and_sync(cx));
        let result = self.record(result);
        if result.is_ok() {
            self.finished = true;
        }
        Poll::Ready(result)
    }

    fn poll_drain_and_sync(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        ready!(self.poll_drain(cx))?;
        if self.sync.is_none() {
            self.sync = Some(self.target.send(FsOp::Sync {
                path: self.target.wire_path(),
            })?);
        }
        let result = ready!(Pin::new(self.sync.as_mut().expect("sync sent")).poll(cx));
        self.sync = None;
        Poll::Ready(match result?.map_err(|err| self.target.failed(err))? {
            FsOk::Done => Ok(()),
            other => Err(self.target.unexpected("Done", &other)),
        })
    }
}

impl AsyncWrite for GuestFileWriter {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_inner(cx, buf).map_err(to_io)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_flush_inner(cx).map_err(to_io)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_finish(cx).map_err(to_io)
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

    /// Writes `data` as the whole content of a guest file, creating it with mode `0o644` or
    /// truncating it, then `fsync`s it. An existing file keeps its mode and owner.
    ///
    /// A relative path is relative to the guest's `/`. The image's root is read-only: write
    /// under the scratch directories (`/tmp`, `/root`, `/home`, `/run`, `/var/tmp`).
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.write_file("/tmp/input.txt", b"hello\n").await?;
    /// let out = vm.command("cat").arg("/tmp/input.txt").output().await?;
    /// assert_eq!(out.stdout, b"hello\n");
    /// # Ok(()) }
    /// ```
    pub async fn write_file(&self, path: impl AsRef<Path>, data: impl AsRef<[u8]>) -> Result<()> {
        self.write_file_with_mode(path, data, FILE_MODE).await
    }

    /// Like [`Instance::write_file`], but a created file gets exactly `mode` (the umask does not
    /// apply), e.g. `0o755` for a script.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.write_file_with_mode("/tmp/run.sh", "#!/bin/sh\necho hi\n", 0o755).await?;
    /// assert!(vm.command("/tmp/run.sh").status().await?.success());
    /// # Ok(()) }
    /// ```
    pub async fn write_file_with_mode(
        &self,
        path: impl AsRef<Path>,
        data: impl AsRef<[u8]>,
        mode: u32,
    ) -> Result<()> {
        let target = Target::new(self, "write_file", path.as_ref())?;
        let data = data.as_ref();
        // The first chunk creates and truncates; it must land before any later chunk.
        let first = data.len().min(MAX_FILE_CHUNK);
        target
            .call_done(FsOp::Write {
                path: target.wire_path(),
                offset: 0,
                data: ByteBuf::from(data[..first].to_vec()),
                mode,
                create: true,
                truncate: true,
            })
            .await?;
        let mut writer = GuestFileWriter::new(target, first as u64);
        let mut rest = &data[first..];
        while !rest.is_empty() {
            let n = poll_fn(|cx| writer.poll_write_inner(cx, rest)).await?;
            rest = &rest[n..];
        }
        writer.finish().await
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

    /// Creates (or truncates) a guest file for streaming writes ([`AsyncWrite`]); a created file
    /// gets exactly `mode`. Finish with [`GuestFileWriter::finish`] (or `shutdown()`), which
    /// syncs the file and reports errors.
    ///
    /// A relative path is relative to the guest's `/`.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let mut local = tokio::fs::File::open("dataset.csv").await.unwrap();
    /// let mut guest = vm.create_file("/tmp/dataset.csv", 0o644).await?;
    /// tokio::io::copy(&mut local, &mut guest).await.unwrap();
    /// guest.finish().await?;
    /// # Ok(()) }
    /// ```
    pub async fn create_file(&self, path: impl AsRef<Path>, mode: u32) -> Result<GuestFileWriter> {
        let target = Target::new(self, "create_file", path.as_ref())?;
        target
            .call_done(FsOp::Write {
                path: target.wire_path(),
                offset: 0,
                data: ByteBuf::new(),
                mode,
                create: true,
                truncate: true,
            })
            .await?;
        Ok(GuestFileWriter::new(target, 0))
    }

    async fn stat(&self, op: &'static str, path: &Path, follow: bool) -> Result<Metadata> {
        let target = Target::new(self, op, path)?;
        match target
            .call(FsOp::Metadata {
                path: target.wire_path(),
                follow,
            })
            .await?
        {
            FsOk::Metadata(meta) => Ok(Metadata::from_wire(meta)),
            other => Err(target.unexpected("Metadata", &other)),
        }
    }

    /// Metadata of a guest path, following symlinks (`stat`).
    ///
    /// A relative path is relative to the guest's `/`.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let meta = vm.metadata("/etc/passwd").await?;
    /// println!("{} bytes, mode {:o}", meta.len, meta.mode);
    /// # Ok(()) }
    /// ```
    pub async fn metadata(&self, path: impl AsRef<Path>) -> Result<Metadata> {
        self.stat("metadata", path.as_ref(), true).await
    }

    /// Metadata of a guest path without following a final symlink (`lstat`): a symlink is
    /// reported as [`FileType::Symlink`].
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let meta = vm.symlink_metadata("/bin/sh").await?;
    /// println!("/bin/sh is a symlink: {}", meta.is_symlink());
    /// # Ok(()) }
    /// ```
    pub async fn symlink_metadata(&self, path: impl AsRef<Path>) -> Result<Metadata> {
        self.stat("symlink_metadata", path.as_ref(), false).await
    }

    /// Lists a guest directory, sorted by name (byte order), without `.` and `..`. Large
    /// directories arrive in pages, all collected here.
    ///
    /// A relative path is relative to the guest's `/`.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// for entry in vm.read_dir("/etc").await? {
    ///     println!("{:?} {:?}", entry.file_type, entry.name);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn read_dir(&self, path: impl AsRef<Path>) -> Result<Vec<DirEntry>> {
        let target = Target::new(self, "read_dir", path.as_ref())?;
        let mut all: Vec<DirEntry> = Vec::new();
        let mut after: Option<ByteBuf> = None;
        loop {
            let (entries, complete) = match target
                .call(FsOp::ReadDir {
                    path: target.wire_path(),
                    after: after.clone(),
                })
                .await?
            {
                FsOk::Entries { entries, complete } => (entries, complete),
                other => return Err(target.unexpected("Entries", &other)),
            };
            // Every page must continue strictly after the last name, in order: otherwise
            // paging would not terminate.
            let mut last = after.take();
            for entry in entries {
                if last.as_ref().is_some_and(|l| entry.name <= *l) {
                    return Err(target.error(
                        FsErrorKind::Other,
                        "guest-init listed the directory out of order".into(),
                    ));
                }
                all.push(DirEntry {
                    name: OsString::from_vec(entry.name.to_vec()),
                    file_type: entry.file_type,
                });
                last = Some(entry.name);
            }
            if complete {
                return Ok(all);
            }
            if last.is_none() {
                return Err(target.error(
                    FsErrorKind::Other,
                    "guest-init sent an empty page of an incomplete listing".into(),
                ));
            }
            after = last;
        }
    }

    /// Removes a file, a symlink (not its target) or an empty directory.
    ///
    /// A relative path is relative to the guest's `/`. A non-empty directory fails with
    /// [`FsErrorKind::DirectoryNotEmpty`]; use [`Instance::remove_all`].
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.remove("/tmp/input.txt").await?;
    /// # Ok(()) }
    /// ```
    pub async fn remove(&self, path: impl AsRef<Path>) -> Result<()> {
        let target = Target::new(self, "remove", path.as_ref())?;
        target
            .call_done(FsOp::Remove {
                path: target.wire_path(),
                recursive: false,
            })
            .await
    }

    /// Removes a path and, if it is a directory, everything under it. Symlinks inside are
    /// removed themselves, never followed.
    ///
    /// A relative path is relative to the guest's `/`. A missing path is
    /// [`FsErrorKind::NotFound`].
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.remove_all("/tmp/build").await?;
    /// # Ok(()) }
    /// ```
    pub async fn remove_all(&self, path: impl AsRef<Path>) -> Result<()> {
        let target = Target::new(self, "remove_all", path.as_ref())?;
        target
            .call_done(FsOp::Remove {
                path: target.wire_path(),
                recursive: true,
            })
            .await
    }

    /// Creates a directory with exactly `mode` (the umask does not apply). Its parent must
    /// exist, and the directory must not ([`FsErrorKind::AlreadyExists`]).
    ///
    /// A relative path is relative to the guest's `/`.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.create_dir("/tmp/private", 0o700).await?;
    /// # Ok(()) }
    /// ```
    pub async fn create_dir(&self, path: impl AsRef<Path>, mode: u32) -> Result<()> {
        let target = Target::new(self, "create_dir", path.as_ref())?;
        target
            .call_done(FsOp::CreateDir {
                path: target.wire_path(),
                mode,
                parents: false,
            })
            .await
    }

    /// Creates a directory and its missing parents, each with mode `0o755`; an existing
    /// directory is not an error.
    ///
    /// A relative path is relative to the guest's `/`.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// vm.create_dir_all("/tmp/work/src/bin").await?;
    /// # Ok(()) }
    /// ```
    pub async fn create_dir_all(&self, path: impl AsRef<Path>) -> Result<()> {
        let target = Target::new(self, "create_dir_all", path.as_ref())?;
        target
            .call_done(FsOp::CreateDir {
                path: target.wire_path(),
                mode: DIR_MODE,
                parents: true,
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send + 'static>() {}

    #[test]
    fn streams_can_move_between_tasks() {
        assert_send::<GuestFileReader>();
        assert_send::<GuestFileWriter>();
    }

    #[test]
    fn wire_metadata_becomes_system_time() {
        let wire = |secs, nanos| FileMeta {
            file_type: FileType::File,
            len: 3,
            mode: 0o100644,
            uid: 0,
            gid: 0,
            mtime_secs: secs,
            mtime_nanos: nanos,
        };
        let meta = Metadata::from_wire(wire(1_700_000_000, 5));
        assert_eq!(meta.modified, UNIX_EPOCH + Duration::new(1_700_000_000, 5));
        assert_eq!(meta.mode, 0o644);
        assert!(meta.is_file());
        let before = Metadata::from_wire(wire(-10, 500_000_000));
        assert_eq!(
            before.modified,
            UNIX_EPOCH - Duration::from_secs(10) + Duration::from_millis(500)
        );
    }

    #[test]
    fn io_errors_keep_the_typed_error() {
        let err = to_io(Error::Fs {
            op: "read_file",
            path: "/x".into(),
            kind: FsErrorKind::IsADirectory,
            message: "read /x: Is a directory (os error 21)".into(),
        });
        assert_eq!(err.kind(), io::ErrorKind::IsADirectory);
        let inner = err.get_ref().unwrap().downcast_ref::<Error>().unwrap();
        assert_eq!(inner.fs_kind(), Some(FsErrorKind::IsADirectory));
        assert_eq!(
            inner.to_string(),
            "read_file \"/x\" in the guest failed: read /x: Is a directory (os error 21)"
        );
    }
}
