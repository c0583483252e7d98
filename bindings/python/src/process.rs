//! `Process`: a command started by `Instance.spawn`, its streams read and written while it
//! runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use krunbox::{ChildStderr, ChildStdin, ChildStdout};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;

use crate::errors::InvalidConfig;
use crate::instance::{returncode, Bytes};
use crate::runtime::{awaitable, block_on};

/// The most bytes one read of a stream returns.
const READ_MAX: usize = 1 << 20;

/// A running guest process.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct Process {
    pid: u32,
    control: krunbox::ChildControl,
    /// Cancelled by `kill`: the library kills the process group then.
    cancel: krunbox::CancellationToken,
    child: Arc<Mutex<krunbox::Child>>,
    stdout: Arc<Mutex<Option<ChildStdout>>>,
    stderr: Arc<Mutex<Option<ChildStderr>>>,
    stdin: Arc<Mutex<Option<ChildStdin>>>,
    /// Whether its timeout ended it, known once `wait` has returned.
    timed_out: Arc<AtomicBool>,
}

impl Process {
    pub(crate) fn new(mut child: krunbox::Child, cancel: krunbox::CancellationToken) -> Self {
        Process {
            pid: child.id(),
            control: child.control(),
            cancel,
            stdout: Arc::new(Mutex::new(child.stdout.take())),
            stderr: Arc::new(Mutex::new(child.stderr.take())),
            stdin: Arc::new(Mutex::new(child.stdin.take())),
            child: Arc::new(Mutex::new(child)),
            timed_out: Arc::new(AtomicBool::new(false)),
        }
    }
}

/// Up to `max` bytes of `stream`: fewer if that is what is there, empty at its end.
async fn read_some<R: AsyncRead + Unpin>(
    stream: Arc<Mutex<Option<R>>>,
    max: usize,
) -> krunbox::Result<Bytes> {
    let mut stream = stream.lock().await;
    let Some(reader) = stream.as_mut() else {
        return Ok(Bytes(Vec::new()));
    };
    let mut buf = vec![0u8; max.clamp(1, READ_MAX)];
    let n = reader
        .read(&mut buf)
        .await
        .map_err(|source| krunbox::Error::Io {
            context: "reading the process's output".into(),
            source,
        })?;
    buf.truncate(n);
    Ok(Bytes(buf))
}

async fn write_all(stdin: Arc<Mutex<Option<ChildStdin>>>, data: Vec<u8>) -> krunbox::Result<()> {
    let mut stdin = stdin.lock().await;
    let Some(writer) = stdin.as_mut() else {
        return Err(krunbox::Error::InvalidConfig(
            "the process's stdin is closed, or it was spawned without stdin=True".into(),
        ));
    };
    let failed = |source| krunbox::Error::Io {
        context: "writing to the process's stdin".into(),
        source,
    };
    writer.write_all(&data).await.map_err(failed)?;
    writer.flush().await.map_err(failed)
}

async fn close(stdin: Arc<Mutex<Option<ChildStdin>>>) -> krunbox::Result<()> {
    if let Some(mut writer) = stdin.lock().await.take() {
        writer
            .shutdown()
            .await
            .map_err(|source| krunbox::Error::Io {
                context: "closing the process's stdin".into(),
                source,
            })?;
    }
    Ok(())
}

async fn wait(
    child: Arc<Mutex<krunbox::Child>>,
    timed_out: Arc<AtomicBool>,
) -> krunbox::Result<i32> {
    let status = child.lock().await.wait().await?;
    timed_out.store(status.timed_out(), Ordering::Relaxed);
    Ok(returncode(&status))
}

#[pymethods]
impl Process {
    /// Whether its `timeout` ended it (known once `wait` has returned).
    #[getter]
    fn timed_out(&self) -> bool {
        self.timed_out.load(Ordering::Relaxed)
    }

    /// The process id in the guest.
    #[getter]
    fn pid(&self) -> u32 {
        self.pid
    }

    /// Up to `max` bytes of stdout (awaitable): what is there once something is, `b""` at
    /// its end. (A pty's whole output is its stdout.)
    #[pyo3(signature = (max = 65536))]
    fn read_stdout<'py>(&self, py: Python<'py>, max: usize) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, read_some(self.stdout.clone(), max))
    }

    /// Up to `max` bytes of stderr (awaitable), `b""` at its end.
    #[pyo3(signature = (max = 65536))]
    fn read_stderr<'py>(&self, py: Python<'py>, max: usize) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, read_some(self.stderr.clone(), max))
    }

    /// `read_stdout`, waiting here with the GIL released.
    #[pyo3(signature = (max = 65536))]
    fn read_stdout_blocking<'py>(
        &self,
        py: Python<'py>,
        max: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let data = block_on(py, read_some(self.stdout.clone(), max))?;
        Ok(PyBytes::new(py, &data.0))
    }

    /// `read_stderr`, waiting here with the GIL released.
    #[pyo3(signature = (max = 65536))]
    fn read_stderr_blocking<'py>(
        &self,
        py: Python<'py>,
        max: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let data = block_on(py, read_some(self.stderr.clone(), max))?;
        Ok(PyBytes::new(py, &data.0))
    }

    /// Writes `data` to stdin, whole (awaitable).
    fn write_stdin<'py>(&self, py: Python<'py>, data: Vec<u8>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, write_all(self.stdin.clone(), data))
    }

    /// `write_stdin`, waiting here with the GIL released.
    fn write_stdin_blocking(&self, py: Python<'_>, data: Vec<u8>) -> PyResult<()> {
        block_on(py, write_all(self.stdin.clone(), data))
    }

    /// Closes stdin: the process reads its end (awaitable).
    fn close_stdin<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, close(self.stdin.clone()))
    }

    /// `close_stdin`, waiting here with the GIL released.
    fn close_stdin_blocking(&self, py: Python<'_>) -> PyResult<()> {
        block_on(py, close(self.stdin.clone()))
    }

    /// Waits for the process to end and returns its exit code (`-N` for signal N, 124 for its
    /// timeout) (awaitable). Output not read yet stays readable.
    fn wait<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, wait(self.child.clone(), self.timed_out.clone()))
    }

    /// `wait`, waiting here with the GIL released.
    fn wait_blocking(&self, py: Python<'_>) -> PyResult<i32> {
        block_on(py, wait(self.child.clone(), self.timed_out.clone()))
    }

    /// Sends signal `signal` (a number, e.g. `signal.SIGTERM`) to the process group.
    fn signal(&self, signal: i32) -> PyResult<()> {
        if !(1..=64).contains(&signal) {
            return Err(InvalidConfig::new_err(format!(
                "{signal} is not a signal number (1 to 64)"
            )));
        }
        self.control.signal(signal).map_err(crate::errors::to_py)
    }

    /// Kills the process group (SIGKILL); `wait` then returns -9.
    fn kill(&self) {
        self.cancel.cancel();
    }

    /// Changes the pty's size (a process spawned with `pty=`); its foreground group gets
    /// SIGWINCH.
    fn resize(&self, rows: u16, cols: u16) -> PyResult<()> {
        self.control
            .resize(rows, cols)
            .map_err(crate::errors::to_py)
    }
}
