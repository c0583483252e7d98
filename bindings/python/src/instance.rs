//! `Instance`: a running VM; `Completed`: what a finished command left.

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{CommandFailed, CommandTimeout, InvalidConfig};
use crate::runtime::{awaitable, block_on};

/// A running sandbox instance.
#[pyclass(module = "krunbox._krunbox", frozen)]
pub(crate) struct Instance {
    pub(crate) inner: krunbox::Instance,
}

impl Instance {
    pub(crate) fn new(inner: krunbox::Instance) -> Self {
        Instance { inner }
    }
}

/// How a command ended and what it wrote, as `subprocess.CompletedProcess` has it.
#[pyclass(module = "krunbox._krunbox", frozen, get_all)]
pub(crate) struct Completed {
    /// The program and its arguments.
    args: Vec<String>,
    /// The exit code; `-N` when signal N ended it; 124 when its timeout did.
    returncode: i32,
    /// Whether its timeout ended it.
    timed_out: bool,
    stdout: Py<PyBytes>,
    stderr: Py<PyBytes>,
}

#[pymethods]
impl Completed {
    /// A command's end as `run` reports it (for runs assembled from a `Process`).
    #[new]
    #[pyo3(signature = (args, returncode, stdout, stderr, *, timed_out = false))]
    fn new(
        args: Vec<String>,
        returncode: i32,
        stdout: Py<PyBytes>,
        stderr: Py<PyBytes>,
        timed_out: bool,
    ) -> Self {
        Completed {
            args,
            returncode,
            timed_out,
            stdout,
            stderr,
        }
    }

    /// stdout decoded as UTF-8 (invalid bytes replaced).
    #[getter]
    fn stdout_text(&self, py: Python<'_>) -> String {
        String::from_utf8_lossy(self.stdout.as_bytes(py)).into_owned()
    }

    /// stderr decoded as UTF-8 (invalid bytes replaced).
    #[getter]
    fn stderr_text(&self, py: Python<'_>) -> String {
        String::from_utf8_lossy(self.stderr.as_bytes(py)).into_owned()
    }

    /// Raises `CommandFailed` (`CommandTimeout` for a timeout) unless the exit code is 0.
    fn check_returncode(slf: &Bound<'_, Self>) -> PyResult<()> {
        let this = slf.get();
        if this.returncode == 0 {
            return Ok(());
        }
        let py = slf.py();
        let tail = tail(&this.stderr_text(py));
        let error = if this.timed_out {
            CommandTimeout::new_err(format!("{:?} timed out (exit code 124){tail}", this.args))
        } else {
            CommandFailed::new_err(format!(
                "{:?} exited with {}{tail}",
                this.args, this.returncode
            ))
        };
        error.value(py).setattr("result", slf)?;
        Err(error)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Completed(args={:?}, returncode={}, stdout={} bytes, stderr={} bytes)",
            self.args,
            self.returncode,
            self.stdout.as_bytes(py).len(),
            self.stderr.as_bytes(py).len()
        )
    }
}

/// The end of a command's stderr for an exception's message: its last line, at most 200 bytes.
fn tail(stderr: &str) -> String {
    let last = stderr.trim_end().lines().last().unwrap_or_default();
    if last.is_empty() {
        return String::new();
    }
    let mut cut = last.len().min(200);
    while !last.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(": {}", &last[..cut])
}

/// What `run` was asked to do, checked before anything is sent to the guest.
struct RunRequest {
    args: Vec<String>,
    timeout: Option<Duration>,
    cwd: Option<String>,
    env: Vec<(String, String)>,
    check: bool,
}

impl RunRequest {
    /// The program and arguments of `cmd`: a shell command line (run by `sh -c`, as
    /// `subprocess.run(..., shell=True)` takes it), or a list.
    fn args(cmd: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        match cmd.extract::<String>() {
            Ok(line) => Ok(vec!["sh".into(), "-c".into(), line]),
            Err(_) => cmd.extract(),
        }
    }

    fn new(
        cmd: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        cwd: Option<String>,
        env: Option<Vec<(String, String)>>,
        check: bool,
    ) -> PyResult<Self> {
        let args = Self::args(cmd)?;
        if args.is_empty() {
            return Err(InvalidConfig::new_err("run() needs a program to run"));
        }
        let timeout = match timeout {
            None => None,
            Some(seconds) if seconds.is_finite() && seconds > 0.0 => {
                Some(Duration::try_from_secs_f64(seconds).map_err(|_| {
                    InvalidConfig::new_err(format!("timeout={seconds} is too large"))
                })?)
            }
            Some(seconds) => {
                return Err(InvalidConfig::new_err(format!(
                    "timeout={seconds}: give a number of seconds above 0"
                )))
            }
        };
        Ok(RunRequest {
            args,
            timeout,
            cwd,
            env: env.unwrap_or_default(),
            check,
        })
    }

    /// The library's command for it on `instance`.
    fn command(&self, instance: &krunbox::Instance) -> krunbox::Command {
        let mut command = instance.command(&self.args[0]);
        command.args(&self.args[1..]);
        if let Some(timeout) = self.timeout {
            command.timeout(timeout);
        }
        if let Some(cwd) = &self.cwd {
            command.current_dir(cwd);
        }
        command.envs(self.env.iter().map(|(k, v)| (k, v)));
        command
    }

    /// Runs it on `instance` to its end.
    async fn run(self, instance: krunbox::Instance) -> krunbox::Result<(Self, krunbox::Output)> {
        let output = self.command(&instance).output().await?;
        Ok((self, output))
    }

    /// Starts it on `instance`, stdin piped if asked (a pty's always is).
    async fn spawn(
        self,
        instance: krunbox::Instance,
        stdin: bool,
        pty: Option<(u16, u16)>,
    ) -> krunbox::Result<crate::process::Process> {
        let mut command = self.command(&instance);
        if stdin {
            command.stdin(krunbox::Stdio::piped());
        }
        if let Some((rows, cols)) = pty {
            command.pty(rows, cols);
        }
        let cancel = krunbox::CancellationToken::new();
        command.cancel_on(cancel.clone());
        let child = command.spawn().await?;
        Ok(crate::process::Process::new(child, cancel))
    }
}

/// The program and arguments `run` makes of `cmd` (a command line becomes `sh -c LINE`).
#[pyfunction]
pub(crate) fn command_args(cmd: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    RunRequest::args(cmd)
}

/// An exit status as Python's `subprocess` gives it: the code, `-N` for signal N (124 for a
/// timeout, whose kill is not the command's doing).
pub(crate) fn returncode(status: &krunbox::ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => -signal,
        (None, None) => -1,
    }
}

/// The `Completed` of a finished run, checked if asked.
fn completed(
    py: Python<'_>,
    (request, output): (RunRequest, krunbox::Output),
) -> PyResult<Py<Completed>> {
    let status = output.status;
    let returncode = returncode(&status);
    let done = Bound::new(
        py,
        Completed {
            args: request.args,
            returncode,
            timed_out: status.timed_out(),
            stdout: PyBytes::new(py, &output.stdout).unbind(),
            stderr: PyBytes::new(py, &output.stderr).unbind(),
        },
    )?;
    if request.check {
        Completed::check_returncode(&done)?;
    }
    Ok(done.unbind())
}

#[pymethods]
impl Instance {
    /// Runs `cmd` (a list of program and arguments, or a shell command line) to its end and
    /// returns a `Completed` (awaitable).
    #[pyo3(signature = (cmd, *, timeout = None, cwd = None, env = None, check = false))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        cmd: &Bound<'py, PyAny>,
        timeout: Option<f64>,
        cwd: Option<String>,
        env: Option<Vec<(String, String)>>,
        check: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let request = RunRequest::new(cmd, timeout, cwd, env, check)?;
        let instance = self.inner.clone();
        let ran = awaitable(py, async move { request.run(instance).await.map(Ran) })?;
        Ok(ran)
    }

    /// `run`, waiting here with the GIL released.
    #[pyo3(signature = (cmd, *, timeout = None, cwd = None, env = None, check = false))]
    fn run_blocking(
        &self,
        py: Python<'_>,
        cmd: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        cwd: Option<String>,
        env: Option<Vec<(String, String)>>,
        check: bool,
    ) -> PyResult<Py<Completed>> {
        let request = RunRequest::new(cmd, timeout, cwd, env, check)?;
        let instance = self.inner.clone();
        let ran = block_on(py, request.run(instance))?;
        completed(py, ran)
    }

    /// Starts `cmd` and returns its `Process` at once (awaitable): its stdout and stderr read
    /// as they come, its stdin written when `stdin=True`; `pty=(rows, cols)` runs it on a
    /// terminal of that size (stdout is then the terminal's output, stdin its keyboard).
    #[pyo3(signature = (
        cmd, *, stdin = false, pty = None, timeout = None, cwd = None, env = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn spawn<'py>(
        &self,
        py: Python<'py>,
        cmd: &Bound<'py, PyAny>,
        stdin: bool,
        pty: Option<(u16, u16)>,
        timeout: Option<f64>,
        cwd: Option<String>,
        env: Option<Vec<(String, String)>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let request = RunRequest::new(cmd, timeout, cwd, env, false)?;
        let instance = self.inner.clone();
        awaitable(py, request.spawn(instance, stdin, pty))
    }

    /// `spawn`, waiting here with the GIL released.
    #[pyo3(signature = (
        cmd, *, stdin = false, pty = None, timeout = None, cwd = None, env = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn spawn_blocking(
        &self,
        py: Python<'_>,
        cmd: &Bound<'_, PyAny>,
        stdin: bool,
        pty: Option<(u16, u16)>,
        timeout: Option<f64>,
        cwd: Option<String>,
        env: Option<Vec<(String, String)>>,
    ) -> PyResult<crate::process::Process> {
        let request = RunRequest::new(cmd, timeout, cwd, env, false)?;
        let instance = self.inner.clone();
        block_on(py, request.spawn(instance, stdin, pty))
    }

    /// The file at `path` in the guest, whole (awaitable; at most the library's read limit).
    fn read_file<'py>(&self, py: Python<'py>, path: String) -> PyResult<Bound<'py, PyAny>> {
        let instance = self.inner.clone();
        awaitable(py, async move { instance.read_file(path).await.map(Bytes) })
    }

    /// `read_file`, waiting here with the GIL released.
    fn read_file_blocking<'py>(
        &self,
        py: Python<'py>,
        path: String,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let instance = self.inner.clone();
        let data = block_on(py, async move { instance.read_file(path).await })?;
        Ok(PyBytes::new(py, &data))
    }

    /// Writes `data` to `path` in the guest, replacing it (awaitable).
    fn write_file<'py>(
        &self,
        py: Python<'py>,
        path: String,
        data: Vec<u8>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let instance = self.inner.clone();
        awaitable(py, async move { instance.write_file(path, data).await })
    }

    /// `write_file`, waiting here with the GIL released.
    fn write_file_blocking(&self, py: Python<'_>, path: String, data: Vec<u8>) -> PyResult<()> {
        let instance = self.inner.clone();
        block_on(py, async move { instance.write_file(path, data).await })
    }

    /// Stops the VM (awaitable). Calls after it fail with `InstanceGone`.
    fn shutdown<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let instance = self.inner.clone();
        awaitable(py, async move { instance.shutdown().await })
    }

    /// `shutdown`, waiting here with the GIL released.
    fn shutdown_blocking(&self, py: Python<'_>) -> PyResult<()> {
        let instance = self.inner.clone();
        block_on(py, async move { instance.shutdown().await })
    }

    /// Stops the VM's vCPUs and devices until `resume` (awaitable).
    fn pause<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let instance = self.inner.clone();
        awaitable(py, async move { instance.pause().await })
    }

    /// `pause`, waiting here with the GIL released.
    fn pause_blocking(&self, py: Python<'_>) -> PyResult<()> {
        let instance = self.inner.clone();
        block_on(py, async move { instance.pause().await })
    }

    /// Resumes a paused VM (awaitable).
    fn resume<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let instance = self.inner.clone();
        awaitable(py, async move { instance.resume().await })
    }

    /// `resume`, waiting here with the GIL released.
    fn resume_blocking(&self, py: Python<'_>) -> PyResult<()> {
        let instance = self.inner.clone();
        block_on(py, async move { instance.resume().await })
    }

    /// Whether the VM is paused.
    fn is_paused(&self) -> bool {
        self.inner.is_paused()
    }

    /// The host's own work in this boot before the VM started, in seconds.
    fn host_boot_work(&self) -> f64 {
        self.inner.host_boot_work().as_secs_f64()
    }
}

/// A finished run on its way back to Python: made a `Completed` (and checked) with the GIL.
struct Ran((RunRequest, krunbox::Output));

impl<'py> IntoPyObject<'py> for Ran {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        Ok(completed(py, self.0)?.into_bound(py).into_any())
    }
}

/// Bytes on their way back to Python, as `bytes` (a `Vec<u8>` would become a list).
pub(crate) struct Bytes(pub(crate) Vec<u8>);

impl<'py> IntoPyObject<'py> for Bytes {
    type Target = PyBytes;
    type Output = Bound<'py, PyBytes>;
    type Error = std::convert::Infallible;

    fn into_pyobject(self, py: Python<'py>) -> Result<Self::Output, Self::Error> {
        Ok(PyBytes::new(py, &self.0))
    }
}
