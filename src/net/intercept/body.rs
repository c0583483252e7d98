//! Bodies through interception: a request's on its way upstream, with secrets swapped in as
//! it streams ([`SwapBody`]); a response's on its way to the guest, holding the sandbox's
//! permit for an upstream request until it is over ([`Permitted`]).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use ::http::HeaderMap;
use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use super::super::audit::RequestRecord;
use super::super::secrets::StreamSwap;

/// The most bytes of output one frame of a [`SwapBody`] carries (and one value more at most).
const FRAME_MAX: usize = 64 * 1024;

/// A request body with the placeholders of secrets that opted in to bodies swapped for their
/// values (or only looked for), streamed: it holds at most one step of input and a
/// placeholder's length of what came before (see [`StreamSwap`]), whatever the body's size.
/// When it is dropped (sent, or abandoned), the request's audit record learns which secrets
/// were swapped in and which placeholders were left.
pub(crate) struct SwapBody<B> {
    inner: B,
    swap: StreamSwap,
    /// Input from `inner` not yet given to `swap`.
    input: Bytes,
    /// `inner` has ended (with these trailers, if it had them).
    ended: bool,
    trailers: Option<HeaderMap>,
    record: Arc<RequestRecord>,
    /// A response's body (values swapped back for placeholders), not a request's.
    response: bool,
}

impl<B> SwapBody<B> {
    /// A request's body on its way upstream, placeholders swapped for values.
    pub(crate) fn new(inner: B, swap: StreamSwap, record: Arc<RequestRecord>) -> Self {
        Self {
            inner,
            swap,
            input: Bytes::new(),
            ended: false,
            trailers: None,
            record,
            response: false,
        }
    }

    /// A response's body on its way to the guest, values of bound secrets swapped back for
    /// their placeholders ([`StreamSwap::for_response`]).
    pub(crate) fn response(inner: B, swap: StreamSwap, record: Arc<RequestRecord>) -> Self {
        let mut body = Self::new(inner, swap, record);
        body.response = true;
        body
    }
}

impl<B> Drop for SwapBody<B> {
    fn drop(&mut self) {
        let (swapped, left) = self.swap.found();
        if self.response {
            self.record.reflected(&swapped);
        } else {
            self.record.secrets(&swapped, &left);
        }
    }
}

impl<B> Body for SwapBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        loop {
            let end = this.ended && this.input.is_empty();
            let out = this.swap.pull(FRAME_MAX, end);
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(out.into()))));
            }
            if !this.input.is_empty() && this.swap.wants_input() {
                this.swap.push(&mut this.input);
                continue;
            }
            if end {
                return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => this.input = data,
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            this.trailers = Some(trailers);
                            this.ended = true;
                        }
                    }
                },
                Some(Err(err)) => return Poll::Ready(Some(Err(err))),
                None => this.ended = true,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.input.is_empty() && self.swap.is_empty() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        if self.swap.swaps() {
            // Values are not as long as placeholders: the length is not known.
            SizeHint::default()
        } else {
            // Only looked at: the bytes are the input's.
            self.inner.size_hint()
        }
    }
}

/// A response body that holds its request's permit (one of the sandbox's
/// [`MAX_UPSTREAM_REQUESTS`](crate::net::stack::MAX_UPSTREAM_REQUESTS)) until it ends or is
/// dropped.
pub(crate) struct Permitted<B> {
    inner: B,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl<B> Permitted<B> {
    pub(crate) fn new(inner: B, permit: tokio::sync::OwnedSemaphorePermit) -> Self {
        Self {
            inner,
            permit: Some(permit),
        }
    }
}

impl<B> Body for Permitted<B>
where
    B: Body + Unpin,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.get_mut();
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        if !matches!(frame, Some(Ok(_))) {
            // Ended or failed: the request is no longer in flight.
            this.permit = None;
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
