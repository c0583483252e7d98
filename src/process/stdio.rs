//! A child's streams: [`ChildStdout`] and [`ChildStderr`] (output chunks from the control
//! channel, credited back as they are read) and [`ChildStdin`] (writes within the guest's
//! credit).

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use serde_bytes::ByteBuf;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Semaphore;
use tokio_util::sync::PollSemaphore;

use crate::control::{Control, Gone, OutputItem};
use crate::output_queue::OutputReceiver;
use crate::protocol::{
    limits::MAX_CHUNK, HostMessage, ProcessRef, StdinData, Stream, OUTPUT_WINDOW,
};

impl Drop for Receiver {
    fn drop(&mut self) {
        // Bytes read but not yet credited, plus whatever arrives later, are released so the
        // process is not stalled by a reader that went away (the control task discards them).
        if self.uncredited > 0 {
            self.control.credit(self.id, self.stream, self.uncredited);
        }
        self.rx.close();
        while let Ok(item) = self.rx.try_recv() {
            if let OutputItem::Data(chunk) = item {
                self.control
                    .credit(self.id, self.stream, chunk.len() as u32);
            }
        }
    }
}

/// A child's standard input ([`AsyncWrite`]), for commands spawned with [`Stdio::piped`](crate::Stdio::piped) or a
/// pty. Writes wait while the guest has not yet consumed earlier input (bounded memory on both
/// sides). Shutting it down (or dropping it) closes the process's stdin.
pub struct ChildStdin {
    pub(super) control: Arc<Control>,
    pub(super) id: u32,
    pub(super) credit: PollSemaphore,
    pub(super) closed: bool,
}

impl fmt::Debug for ChildStdin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChildStdin")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

fn broken_pipe() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::BrokenPipe,
        "the guest process has ended",
    )
}

impl AsyncWrite for ChildStdin {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.closed {
            return Poll::Ready(Err(broken_pipe()));
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        // One permit is one byte the guest has room for.
        let first = match this.credit.poll_acquire(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(None) => return Poll::Ready(Err(broken_pipe())),
            Poll::Ready(Some(permit)) => permit,
        };
        let semaphore: &Semaphore = this.credit.as_ref();
        let extra = buf
            .len()
            .min(MAX_CHUNK)
            .saturating_sub(1)
            .min(semaphore.available_permits());
        let n = 1 + match semaphore.try_acquire_many(extra as u32) {
            Ok(permits) => {
                permits.forget();
                extra
            }
            Err(_) => 0,
        };
        first.forget();
        let message = HostMessage::Stdin(StdinData {
            id: this.id,
            data: ByteBuf::from(buf[..n].to_vec()),
        });
        match this.control.send(&message) {
            Ok(()) => Poll::Ready(Ok(n)),
            Err(_) => Poll::Ready(Err(broken_pipe())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if !this.closed {
            this.closed = true;
            let _ = this
                .control
                .send(&HostMessage::CloseStdin(ProcessRef { id: this.id }));
        }
        Poll::Ready(Ok(()))
    }
}

impl Drop for ChildStdin {
    fn drop(&mut self) {
        if !self.closed {
            let _ = self
                .control
                .send(&HostMessage::CloseStdin(ProcessRef { id: self.id }));
        }
    }
}

/// Chunks from the control channel, read as a byte stream. Consumed bytes are credited back
/// to the guest in batches, so at most [`OUTPUT_WINDOW`] bytes per stream wait in host memory.
pub(super) struct Receiver {
    rx: OutputReceiver<OutputItem>,
    chunk: Vec<u8>,
    /// Why the stream broke off, once it did: every later read reports it again.
    broken: Option<Gone>,
    pos: usize,
    control: Arc<Control>,
    id: u32,
    stream: Stream,
    uncredited: u32,
}

impl fmt::Debug for Receiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver")
            .field("id", &self.id)
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl Receiver {
    pub(super) fn new(
        rx: OutputReceiver<OutputItem>,
        control: Arc<Control>,
        id: u32,
        stream: Stream,
    ) -> Self {
        Receiver {
            rx,
            chunk: Vec::new(),
            broken: None,
            pos: 0,
            control,
            id,
            stream,
            uncredited: 0,
        }
    }

    fn poll_read(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        while self.pos == self.chunk.len() {
            if let Some(reason) = &self.broken {
                return Poll::Ready(Err(std::io::Error::other(reason.error())));
            }
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(OutputItem::Broken(reason))) => self.broken = Some(reason),
                Poll::Ready(Some(OutputItem::Data(chunk))) => {
                    // The chunk left the channel: credit once a quarter window accumulated.
                    self.uncredited += chunk.len() as u32;
                    if self.uncredited >= OUTPUT_WINDOW / 4 {
                        self.control.credit(self.id, self.stream, self.uncredited);
                        self.uncredited = 0;
                    }
                    self.chunk = chunk;
                    self.pos = 0;
                }
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
        let n = buf.remaining().min(self.chunk.len() - self.pos);
        buf.put_slice(&self.chunk[self.pos..self.pos + n]);
        self.pos += n;
        Poll::Ready(Ok(()))
    }
}

/// A child's standard output ([`AsyncRead`]); ends when the process and everything it started
/// have closed it.
///
/// If the VM stops before the process ends, the stream is incomplete: reads then fail with an
/// [`std::io::Error`] whose inner error is [`Error::InstanceGone`](crate::Error::InstanceGone), never a clean end of file.
///
/// ```no_run
/// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
/// use tokio::io::AsyncReadExt;
///
/// let mut child = vm.command("ls").arg("/").spawn().await?;
/// let mut listing = String::new();
/// match child.stdout.take().unwrap().read_to_string(&mut listing).await {
///     Ok(_) => println!("{listing}"),
///     Err(err) => match err.get_ref().and_then(|e| e.downcast_ref::<krunbox::Error>()) {
///         Some(krunbox::Error::InstanceGone { reason }) => eprintln!("VM stopped: {reason}"),
///         _ => eprintln!("reading failed: {err}"),
///     },
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct ChildStdout(pub(super) Receiver);

/// A child's standard error ([`AsyncRead`]); behaves like [`ChildStdout`].
#[derive(Debug)]
pub struct ChildStderr(pub(super) Receiver);

impl AsyncRead for ChildStdout {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.get_mut().0.poll_read(cx, buf)
    }
}

impl AsyncRead for ChildStderr {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.get_mut().0.poll_read(cx, buf)
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;
    use std::time::Duration;

    use serde_bytes::ByteBuf;

    use crate::limits::Limits;
    use crate::protocol::{
        limits::MAX_CHUNK, Exec, GuestMessage, HostMessage, Output, ProtocolError, Started, Stream,
        OUTPUT_WINDOW,
    };
    use crate::scripted_guest;

    /// A guest that sends output past its credit (a window and one chunk, with nobody
    /// reading) breaks the protocol: the instance stops, and the host never queued more than
    /// the window.
    #[tokio::test(start_paused = true)]
    async fn output_past_the_window_stops_the_instance() {
        let chunks = OUTPUT_WINDOW as usize / MAX_CHUNK + 1;
        let (control, _) = scripted_guest::start(Limits::new(), move |message| {
            let HostMessage::Exec(exec) = message else {
                return vec![];
            };
            let mut answers = vec![GuestMessage::Started(Started {
                id: exec.id,
                pid: 1,
            })];
            answers.extend((0..chunks).map(|_| {
                GuestMessage::Output(Output {
                    id: exec.id,
                    stream: Stream::Stdout,
                    data: ByteBuf::from(vec![b'y'; MAX_CHUNK]),
                })
            }));
            answers
        });
        let exec = HostMessage::Exec(Exec {
            id: 1,
            argv: vec![ByteBuf::from(b"yes".to_vec())],
            env: vec![],
            cwd: None,
            uid: None,
            gid: None,
            timeout_ms: None,
            stdin: false,
            pty: None,
        });
        let mut started = super::super::start(&control, 1, &exec, OsStr::new("yes"))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let violation = control.violation.lock().unwrap().clone();
        assert!(
            matches!(
                violation,
                Some(ProtocolError::OutOfBounds {
                    field: "output flow control",
                    ..
                })
            ),
            "{violation:?}"
        );
        let mut queued = 0;
        while let Ok(crate::control::OutputItem::Data(chunk)) = started.channels.stdout.try_recv() {
            queued += chunk.len();
        }
        assert!(queued <= OUTPUT_WINDOW as usize, "{queued} bytes queued");
        assert!(control.gone().is_some());
    }
}
