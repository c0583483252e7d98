//! `NativeInstance`: a running VM, and the commands run in it to their end (`exec`) or
//! started (`spawn`, in `process.rs`).

use std::collections::HashMap;
use std::time::Duration;

use napi::bindgen_prelude::{Buffer, PromiseRaw};
use napi::Env;
use napi_derive::napi;

use crate::errors::{invalid, OrNapi};
use crate::process::NativeProcess;

/// A running sandbox instance.
#[napi]
pub struct NativeInstance {
    pub(crate) inner: krunbox::Instance,
}

impl NativeInstance {
    pub(crate) fn new(inner: krunbox::Instance) -> Self {
        NativeInstance { inner }
    }
}

/// How a command runs.
#[napi(object)]
pub struct CommandOptions {
    pub cwd: Option<String>,
    pub env: Option<HashMap<String, String>>,
    /// Killed (its process group) after this many milliseconds; it then exits with 124.
    pub timeout_ms: Option<f64>,
    /// `spawn`: its stdin is a pipe to write to.
    pub stdin: Option<bool>,
    /// `spawn`: it runs on a terminal of `rows` x `cols`.
    pub rows: Option<u16>,
    pub cols: Option<u16>,
}

/// How a command ended and what it wrote.
#[napi(object)]
pub struct ExecOutput {
    /// Its exit code; 128 + N when signal N ended it; 124 when its timeout did.
    pub exit_code: i32,
    /// The signal that ended it, if one did.
    pub signal: Option<i32>,
    /// Whether its timeout ended it.
    pub timed_out: bool,
    pub stdout: Buffer,
    pub stderr: Buffer,
}

/// Cancels what it is given to (`exec`, `spawn`): the command's process group is killed.
#[napi]
#[derive(Default)]
pub struct NativeCancel {
    pub(crate) token: krunbox::CancellationToken,
}

#[napi]
impl NativeCancel {
    #[napi(constructor)]
    pub fn new() -> Self {
        NativeCancel::default()
    }

    #[napi]
    pub fn cancel(&self) {
        self.token.cancel();
    }
}

/// A command checked before anything is sent to the guest.
pub(crate) struct Request {
    args: Vec<String>,
    options: CommandOptions,
    timeout: Option<Duration>,
}

impl Request {
    fn new(args: Vec<String>, options: CommandOptions) -> napi::Result<Self> {
        if args.is_empty() {
            return Err(invalid("a command needs a program to run"));
        }
        let timeout = match options.timeout_ms {
            None => None,
            Some(ms) if ms.is_finite() && ms > 0.0 => Some(
                Duration::try_from_secs_f64(ms / 1000.0)
                    .map_err(|_| invalid(format!("timeoutMs={ms} is too large")))?,
            ),
            Some(ms) => {
                return Err(invalid(format!(
                    "timeoutMs={ms}: give a number of milliseconds above 0"
                )))
            }
        };
        Ok(Request {
            args,
            options,
            timeout,
        })
    }

    /// The library's command for it on `instance`.
    fn command(&self, instance: &krunbox::Instance) -> krunbox::Command {
        let mut command = instance.command(&self.args[0]);
        command.args(&self.args[1..]);
        if let Some(timeout) = self.timeout {
            command.timeout(timeout);
        }
        if let Some(cwd) = &self.options.cwd {
            command.current_dir(cwd);
        }
        if let Some(env) = &self.options.env {
            command.envs(env.iter());
        }
        command
    }
}

/// A finished command's exit code as a shell gives it.
pub(crate) fn exit_code(status: &krunbox::ExitStatus) -> (i32, Option<i32>) {
    match (status.code(), status.signal()) {
        (Some(code), _) => (code, None),
        (None, Some(signal)) => (128 + signal, Some(signal)),
        (None, None) => (-1, None),
    }
}

#[napi]
impl NativeInstance {
    /// Runs `args` to its end; cancelled (its process group killed) through `cancel`.
    #[napi(ts_return_type = "Promise<ExecOutput>")]
    pub fn exec<'env>(
        &self,
        env: &'env Env,
        args: Vec<String>,
        options: CommandOptions,
        cancel: Option<&NativeCancel>,
    ) -> napi::Result<PromiseRaw<'env, ExecOutput>> {
        let request = Request::new(args, options)?;
        let mut command = request.command(&self.inner);
        if let Some(cancel) = cancel {
            command.cancel_on(cancel.token.clone());
        }
        env.spawn_future(async move {
            let output = command.output().await.or_napi()?;
            let (exit_code, signal) = exit_code(&output.status);
            Ok(ExecOutput {
                exit_code,
                signal,
                timed_out: output.status.timed_out(),
                stdout: output.stdout.into(),
                stderr: output.stderr.into(),
            })
        })
    }

    /// Starts `args` and resolves to its process once it runs.
    #[napi(ts_return_type = "Promise<NativeProcess>")]
    pub fn spawn<'env>(
        &self,
        env: &'env Env,
        args: Vec<String>,
        options: CommandOptions,
    ) -> napi::Result<PromiseRaw<'env, NativeProcess>> {
        let request = Request::new(args, options)?;
        let mut command = request.command(&self.inner);
        if request.options.stdin.unwrap_or(false) {
            command.stdin(krunbox::Stdio::piped());
        }
        match (request.options.rows, request.options.cols) {
            (Some(rows), Some(cols)) => {
                command.pty(rows, cols);
            }
            (None, None) => {}
            _ => return Err(invalid("a terminal needs both rows and cols")),
        }
        let cancel = krunbox::CancellationToken::new();
        command.cancel_on(cancel.clone());
        env.spawn_future(async move {
            let child = command.spawn().await.or_napi()?;
            Ok(NativeProcess::new(child, cancel))
        })
    }

    /// Stops the VM. Calls after it fail with `InstanceGone`.
    #[napi]
    pub async fn shutdown(&self) -> napi::Result<()> {
        self.inner.shutdown().await.or_napi()
    }

    /// Stops the VM's vCPUs and devices until `resume`.
    #[napi]
    pub async fn pause(&self) -> napi::Result<()> {
        self.inner.pause().await.or_napi()
    }

    /// Resumes a paused VM where it stopped.
    #[napi]
    pub async fn resume(&self) -> napi::Result<()> {
        self.inner.resume().await.or_napi()
    }

    /// Whether the VM is paused.
    #[napi]
    pub fn is_paused(&self) -> bool {
        self.inner.is_paused()
    }

    /// The host's own work in this boot before the VM started, in milliseconds.
    #[napi]
    pub fn host_boot_work_ms(&self) -> f64 {
        self.inner.host_boot_work().as_secs_f64() * 1000.0
    }
}
