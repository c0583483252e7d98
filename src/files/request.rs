//! One file request on its way to the guest, and the subject (instance, path) errors name.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use serde_bytes::ByteBuf;
use std::os::unix::ffi::OsStrExt;
use tokio::sync::oneshot;

use crate::control::{Control, Gone};
use crate::error::{Error, Result};
use crate::instance::Instance;
use crate::protocol::fs::{FsError, FsErrorKind, FsOk, FsOp, FsReply, FsRequest};
use crate::protocol::limits::MAX_TEXT;
use crate::protocol::HostMessage;

/// Chunk requests a stream keeps outstanding: one being answered while the next is on its way.
pub(super) const IN_FLIGHT: usize = 2;

/// One request on its way to the guest; resolves to guest-init's answer.
pub(super) struct Pending {
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
pub(super) struct Target {
    pub(super) instance: Instance,
    pub(super) op: &'static str,
    /// Absolute guest path.
    pub(super) path: PathBuf,
}

impl Target {
    pub(super) fn new(instance: &Instance, op: &'static str, path: &Path) -> Result<Target> {
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

    pub(super) fn wire_path(&self) -> ByteBuf {
        ByteBuf::from(self.path.as_os_str().as_bytes().to_vec())
    }

    pub(super) fn error(&self, kind: FsErrorKind, message: String) -> Error {
        Error::Fs {
            op: self.op,
            path: self.path.clone(),
            kind,
            message,
        }
    }

    pub(super) fn invalid(&self, message: &str) -> Error {
        self.error(FsErrorKind::InvalidInput, message.into())
    }

    /// The guest's failure as a typed error.
    pub(super) fn failed(&self, err: FsError) -> Error {
        self.error(err.kind, err.message)
    }

    /// guest-init answered with the wrong kind of result.
    pub(super) fn unexpected(&self, expected: &str, got: &FsOk) -> Error {
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
    pub(super) fn replay(&self, err: &Error) -> Error {
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
    pub(super) fn send(&self, op: FsOp) -> Result<Pending> {
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

    pub(super) async fn call(&self, op: FsOp) -> Result<FsOk> {
        self.send(op)?.await?.map_err(|err| self.failed(err))
    }

    pub(super) async fn call_done(&self, op: FsOp) -> Result<()> {
        match self.call(op).await? {
            FsOk::Done => Ok(()),
            other => Err(self.unexpected("Done", &other)),
        }
    }
}
