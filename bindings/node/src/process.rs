//! `NativeProcess`: a command started by `spawn`, its streams read and written while it runs.
//! The TypeScript API makes web streams of these reads and writes.

use std::sync::Arc;

use krunbox::{ChildStderr, ChildStdin, ChildStdout};
use napi::bindgen_prelude::Buffer;
use napi_derive::napi;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;

use crate::errors::{invalid, OrNapi};
use crate::instance::exit_code;

/// The most bytes one read of a stream returns.
const READ_MAX: u32 = 1 << 20;

/// How a process ended.
#[napi(object)]
pub struct ProcessExit {
    /// Its exit code; 128 + N when signal N ended it; 124 when its timeout did.
    pub exit_code: i32,
    pub signal: Option<i32>,
    pub timed_out: bool,
}

/// A running guest process.
#[napi]
pub struct NativeProcess {
    pid: u32,
    terminal: bool,
    control: krunbox::ChildControl,
    /// Cancelled by `kill`: the library kills the process group then.
    cancel: krunbox::CancellationToken,
    child: Arc<Mutex<krunbox::Child>>,
    stdout: Arc<Mutex<Option<ChildStdout>>>,
    stderr: Arc<Mutex<Option<ChildStderr>>>,
    stdin: Arc<Mutex<Option<ChildStdin>>>,
}

impl NativeProcess {
    pub(crate) fn new(mut child: krunbox::Child, cancel: krunbox::CancellationToken) -> Self {
        NativeProcess {
            pid: child.id(),
            terminal: child.is_terminal(),
            control: child.control(),
            cancel,
            stdout: Arc::new(Mutex::new(child.stdout.take())),
            stderr: Arc::new(Mutex::new(child.stderr.take())),
            stdin: Arc::new(Mutex::new(child.stdin.take())),
            child: Arc::new(Mutex::new(child)),
        }
    }
}

/// Up to `max` bytes of `stream`: fewer if that is what is there, empty at its end.
async fn read_some<R: AsyncRead + Unpin>(
    stream: Arc<Mutex<Option<R>>>,
    max: u32,
) -> napi::Result<Buffer> {
    let mut stream = stream.lock().await;
    let Some(reader) = stream.as_mut() else {
        return Ok(Vec::new().into());
    };
    let mut buf = vec![0u8; max.clamp(1, READ_MAX) as usize];
    let n = reader
        .read(&mut buf)
        .await
        .map_err(|source| krunbox::Error::Io {
            context: "reading the process's output".into(),
            source,
        })
        .or_napi()?;
    // Exactly what was read: the buffer handed to JavaScript keeps its whole allocation,
    // which V8 does not count.
    buf.truncate(n);
    buf.shrink_to_fit();
    Ok(buf.into())
}

#[napi]
impl NativeProcess {
    /// The process id in the guest.
    #[napi(getter)]
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether it runs on a terminal.
    #[napi(getter)]
    pub fn terminal(&self) -> bool {
        self.terminal
    }

    /// Up to `max` bytes of stdout: what is there once something is, empty at its end. (A
    /// terminal's whole output is its stdout.)
    #[napi]
    pub async fn read_stdout(&self, max: u32) -> napi::Result<Buffer> {
        read_some(self.stdout.clone(), max).await
    }

    /// Up to `max` bytes of stderr, empty at its end.
    #[napi]
    pub async fn read_stderr(&self, max: u32) -> napi::Result<Buffer> {
        read_some(self.stderr.clone(), max).await
    }

    /// Writes `data` to stdin, whole.
    #[napi]
    pub async fn write_stdin(&self, data: Buffer) -> napi::Result<()> {
        let data = data.to_vec();
        let mut stdin = self.stdin.lock().await;
        let Some(writer) = stdin.as_mut() else {
            return Err(invalid(
                "the process's stdin is closed, or it was spawned without stdin",
            ));
        };
        let failed = |source| krunbox::Error::Io {
            context: "writing to the process's stdin".into(),
            source,
        };
        writer.write_all(&data).await.map_err(failed).or_napi()?;
        writer.flush().await.map_err(failed).or_napi()
    }

    /// Closes stdin: the process reads its end.
    #[napi]
    pub async fn close_stdin(&self) -> napi::Result<()> {
        if let Some(mut writer) = self.stdin.lock().await.take() {
            writer
                .shutdown()
                .await
                .map_err(|source| krunbox::Error::Io {
                    context: "closing the process's stdin".into(),
                    source,
                })
                .or_napi()?;
        }
        Ok(())
    }

    /// Waits for the process to end. Output not read yet stays readable.
    #[napi]
    pub async fn wait(&self) -> napi::Result<ProcessExit> {
        let status = self.child.lock().await.wait().await.or_napi()?;
        let (exit_code, signal) = exit_code(&status);
        Ok(ProcessExit {
            exit_code,
            signal,
            timed_out: status.timed_out(),
        })
    }

    /// Sends signal `signal` (a number: 15 is SIGTERM) to the process group.
    #[napi]
    pub fn signal(&self, signal: i32) -> napi::Result<()> {
        if !(1..=64).contains(&signal) {
            return Err(invalid(format!(
                "{signal} is not a signal number (1 to 64)"
            )));
        }
        self.control.signal(signal).or_napi()
    }

    /// Kills the process group (SIGKILL).
    #[napi]
    pub fn kill(&self) {
        self.cancel.cancel();
    }

    /// Changes the terminal's size (a process spawned on one); its foreground group gets
    /// SIGWINCH.
    #[napi]
    pub fn resize(&self, rows: u16, cols: u16) -> napi::Result<()> {
        self.control.resize(rows, cols).or_napi()
    }
}
