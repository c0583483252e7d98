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

/// One request on its way to the guest; resolves to guest-init's answer, or to
/// [`Error::RequestTimeout`] once [`Limits::request_timeout`](crate::Limits::request_timeout)
/// passed without one (counted from the send, so a caller that consumes a stream slowly does
/// not use up the guest's time).
pub(super) struct Pending {
    rx: oneshot::Receiver<FsReply>,
    control: Arc<Control>,
    /// In the guest's running time: a pause does not use it up.
    deadline: Pin<Box<dyn Future<Output = ()> + Send>>,
    /// `read_file "/x"`, for the timeout's message.
    request: String,
}

impl Future for Pending {
    type Output = Result<Result<FsOk, FsError>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let answer = Pin::new(&mut self.rx).poll(cx);
        if answer.is_pending() && self.deadline.as_mut().poll(cx).is_ready() {
            // The reply may still come; the control channel keeps its slot until then.
            return Poll::Ready(Err(Error::RequestTimeout {
                request: std::mem::take(&mut self.request),
                after: self.control.limits.request_timeout,
            }));
        }
        Poll::Ready(match ready!(answer) {
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
    pub(super) control: Arc<Control>,
    pub(super) op: &'static str,
    /// Absolute guest path.
    pub(super) path: PathBuf,
    /// The operation's span, `file`, below the instance's: its requests are traced in it.
    span: tracing::Span,
}

impl Target {
    pub(super) fn new(instance: &Instance, op: &'static str, path: &Path) -> Result<Target> {
        let mut target = Target::with_control(instance.control()?, op, path)?;
        target.span = tracing::info_span!(
            parent: instance.span(),
            "file",
            op,
            path = %target.path.display()
        );
        Ok(target)
    }

    /// [`Target::new`] on a bare control channel (the scripted guest of unit tests).
    pub(super) fn with_control(
        control: Arc<Control>,
        op: &'static str,
        path: &Path,
    ) -> Result<Target> {
        // A file operation starts only on a running VM; once started, its later chunks wait
        // out a pause (their deadline does not count it).
        if control.is_paused() {
            return Err(Error::Paused);
        }
        let target = Target {
            control,
            span: tracing::Span::none(),
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
            FsOk::Found(_) => "Found",
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
            Error::RequestTimeout { request, after } => Error::RequestTimeout {
                request: request.clone(),
                after: *after,
            },
            Error::TooMany { what, limit, knob } => Error::TooMany {
                what,
                limit: *limit,
                knob,
            },
            other => self.error(FsErrorKind::Other, other.to_string()),
        }
    }

    /// Sends `op` now (so requests reach the guest in call order); the reply comes later.
    pub(super) fn send(&self, op: FsOp) -> Result<Pending> {
        let control = self.control.clone();
        let request = FsRequest {
            id: control.next_fs_id(),
            op,
        };
        // Paths were checked in `new` and chunks are sized here, so this is a backstop: a bad
        // request must fail at the call, before a reply slot is registered for it.
        request
            .validate()
            .map_err(|err| self.invalid(&err.to_string()))?;
        let rx = control.register_fs(request.id)?;
        tracing::trace!(parent: &self.span, id = request.id, "file request sent");
        control.send(&HostMessage::Fs(request))?;
        Ok(Pending {
            rx,
            deadline: Box::pin(control.deadline(control.limits.request_timeout).elapsed()),
            control,
            request: format!("{} {:?}", self.op, self.path),
        })
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use tokio::time::Instant;

    use super::*;
    use crate::limits::Limits;
    use crate::protocol::GuestMessage;
    use crate::scripted_guest;

    fn sync_op() -> FsOp {
        FsOp::Sync {
            path: ByteBuf::from(b"/x".to_vec()),
        }
    }

    fn done(id: u32) -> GuestMessage {
        GuestMessage::FsReply(FsReply {
            id,
            result: Ok(FsOk::Done),
        })
    }

    /// A guest that leaves its first file request unanswered until the next one comes, then
    /// answers both (the late one first).
    fn holding_the_first_request(timeout: Duration) -> Arc<Control> {
        let first = Arc::new(Mutex::new(None));
        let (control, _) =
            scripted_guest::start(Limits::new().request_timeout(timeout), move |message| {
                let HostMessage::Fs(request) = message else {
                    return vec![];
                };
                let mut first = first.lock().unwrap();
                match *first {
                    None => {
                        *first = Some(request.id);
                        vec![]
                    }
                    Some(late) => vec![done(late), done(request.id)],
                }
            });
        control
    }

    /// A pause of the VM neither starts a file operation nor uses up the deadline of one in
    /// flight: a request sent just before a pause ten times its deadline is still answered
    /// after the resume.
    #[tokio::test(start_paused = true)]
    async fn a_pause_refuses_new_file_operations_and_stops_the_deadlines_of_those_in_flight() {
        let timeout = Duration::from_secs(60);
        let control = holding_the_first_request(timeout);
        let target = Target::with_control(control.clone(), "remove", Path::new("/x")).unwrap();
        let pending = target.send(sync_op()).unwrap();
        control.set_paused(true);
        assert!(matches!(
            Target::with_control(control.clone(), "remove", Path::new("/y")),
            Err(Error::Paused)
        ));
        let waiting = tokio::spawn(pending);
        tokio::time::sleep(timeout * 10).await;
        assert!(!waiting.is_finished(), "the deadline ran while paused");
        control.set_paused(false);
        tokio::time::sleep(timeout / 2).await;
        assert!(!waiting.is_finished(), "the deadline ran while paused");
        // The next request makes the guest answer the held one, within what is left of its
        // deadline.
        target.call_done(sync_op()).await.unwrap();
        let answer = waiting.await.unwrap().unwrap();
        assert!(answer.is_ok(), "{answer:?}");
    }

    /// A guest that answers pings (so the liveness check is content) but not one file request:
    /// the request fails at its deadline, the instance stays usable, and the late answer, when
    /// it comes, is not mistaken for a forged one.
    #[tokio::test(start_paused = true)]
    async fn a_request_the_guest_never_answers_fails_at_its_deadline() {
        // Longer than the liveness timeout (30 s): this is not the liveness check.
        let timeout = Duration::from_secs(60);
        let control = holding_the_first_request(timeout);
        let target = Target::with_control(control.clone(), "remove", Path::new("/x")).unwrap();
        let started = Instant::now();
        let err = tokio::time::timeout(timeout * 10, target.call(sync_op()))
            .await
            .expect("the request must not wait forever")
            .unwrap_err();
        let waited = started.elapsed();
        assert!(
            matches!(&err, Error::RequestTimeout { request, after }
                if *after == timeout && request == "remove \"/x\""),
            "{err:?}"
        );
        assert!(
            waited >= timeout && waited < timeout + Duration::from_secs(1),
            "{waited:?}"
        );
        assert!(err.to_string().contains("request_timeout"), "{err}");
        assert!(control.gone().is_none(), "the instance stays usable");

        target.call_done(sync_op()).await.unwrap();
        assert!(control.violation.lock().unwrap().is_none());
        assert!(control.gone().is_none());
    }

    /// File requests waiting for the guest are capped; one more fails at once, and requests the
    /// caller gave up on keep their slots until the guest answers them.
    #[tokio::test(start_paused = true)]
    async fn file_requests_past_the_cap_fail_at_once() {
        let (control, log) = scripted_guest::start(
            Limits::new()
                .max_pending_file_requests(2)
                .request_timeout(Duration::from_secs(1)),
            |_| vec![],
        );
        let target = Target::with_control(control.clone(), "remove", Path::new("/x")).unwrap();
        let a = target.send(sync_op()).unwrap();
        let b = target.send(sync_op()).unwrap();
        let too_many = |result: Result<Pending>| {
            matches!(
                result,
                Err(Error::TooMany {
                    limit: 2,
                    knob: "max_pending_file_requests",
                    ..
                })
            )
        };
        assert!(too_many(target.send(sync_op())));
        assert!(matches!(a.await, Err(Error::RequestTimeout { .. })));
        drop(b);
        assert!(too_many(target.send(sync_op())), "abandoned, not answered");
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(
            log.lock().unwrap().len(),
            2,
            "nothing past the cap was sent"
        );
    }
}
