//! Writing guest files: whole ([`Instance::write_file`]) or streamed ([`GuestFileWriter`]).

use std::collections::VecDeque;
use std::fmt;
use std::future::{poll_fn, Future};
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use serde_bytes::ByteBuf;
use tokio::io::AsyncWrite;

use super::request::{Pending, Target, IN_FLIGHT};
use super::to_io;
use crate::error::{Error, Result};
use crate::instance::Instance;
use crate::protocol::fs::{FsErrorKind, FsOk, FsOp, MAX_FILE_CHUNK};

/// Mode of files created by [`Instance::write_file`].
const FILE_MODE: u32 = 0o644;

/// How [`Instance::write_file_with`] writes a file: the mode a created file gets (`0o644`
/// unless set), and whether its missing parent directories are made first (no, unless set).
///
/// ```
/// use krunbox::WriteOptions;
/// let script = WriteOptions::new().mode(0o755).create_parents(true);
/// # let _ = script;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOptions {
    mode: u32,
    create_parents: bool,
}

impl WriteOptions {
    /// Mode `0o644`, parents not made.
    pub fn new() -> WriteOptions {
        WriteOptions {
            mode: FILE_MODE,
            create_parents: false,
        }
    }

    /// The exact mode of a created file (the umask does not apply), e.g. `0o755` for a script.
    pub fn mode(mut self, mode: u32) -> WriteOptions {
        self.mode = mode;
        self
    }

    /// Whether missing parent directories are made first (each `0o755`).
    pub fn create_parents(mut self, create: bool) -> WriteOptions {
        self.create_parents = create;
        self
    }
}

impl Default for WriteOptions {
    fn default() -> WriteOptions {
        WriteOptions::new()
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
        self.write_file_with(path, data, WriteOptions::new().mode(mode))
            .await
    }

    /// Like [`Instance::write_file`], with [`WriteOptions`]: the created file's mode, and
    /// whether missing parent directories are made first (each `0o755`, as
    /// [`Instance::create_dir_all`] makes them).
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// use krunbox::WriteOptions;
    /// let options = WriteOptions::new().create_parents(true).mode(0o600);
    /// vm.write_file_with("/tmp/work/config/token", b"...", options).await?;
    /// # Ok(()) }
    /// ```
    pub async fn write_file_with(
        &self,
        path: impl AsRef<Path>,
        data: impl AsRef<[u8]>,
        options: WriteOptions,
    ) -> Result<()> {
        let target = Target::new(self, "write_file", path.as_ref())?;
        if options.create_parents {
            if let Some(parent) = target.path.parent() {
                let parent = Target::new(self, "write_file", parent)?;
                parent
                    .call_done(FsOp::CreateDir {
                        path: parent.wire_path(),
                        mode: super::DIR_MODE,
                        parents: true,
                    })
                    .await?;
            }
        }
        let mode = options.mode;
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
}
