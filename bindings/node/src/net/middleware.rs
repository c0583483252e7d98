//! HTTP middleware written in JavaScript. The policy registers a middleware function in
//! TypeScript and names it here by id; each intercepted request goes to the one runner
//! callback with that id, which calls it with a `Request` whose `headers` it may change,
//! and resolves to the headers to send (or to an answer sent to the guest instead).

use std::sync::Arc;

use krunbox::net::{HeaderMap, HeaderName, HeaderValue, RequestHead, StatusCode};
use napi_derive::napi;

use crate::callback::{Callback, Notify};

/// An intercepted request on its way upstream, as the middleware runner gets it.
#[napi(object)]
pub struct HttpRequestInfo {
    /// The registered middleware to run.
    pub middleware: u32,
    /// The trusted hostname it goes to (never taken from the request).
    pub hostname: String,
    /// "https" or "http".
    pub scheme: String,
    pub method: String,
    /// The path and query.
    pub path: String,
    /// [name, value] pairs; values that are not text left out.
    pub headers: Vec<Vec<String>>,
}

/// What the middleware made of it: the headers to send, or an answer instead.
#[napi(object)]
pub struct HttpRequestResult {
    /// [name, value] pairs replacing the request's headers; none when the middleware left
    /// them as they were (they then go on untouched, values that are not text included).
    pub headers: Option<Vec<Vec<String>>>,
    /// An HTTP status (200 to 999) to answer the guest with instead of going upstream.
    pub status: Option<u32>,
    /// The answer's text.
    pub body: Option<String>,
}

/// Runs registered middleware, and releases registrations when their flows are done.
pub(crate) struct Hub {
    run: Callback<HttpRequestInfo, HttpRequestResult>,
    release: Notify<ReleaseInfo>,
}

/// What the TypeScript side may forget: one middleware (`middleware`), or what a policy call
/// registered (`call`; `taken` when the native side took its verdict, whose middleware it
/// releases one by one).
#[napi(object)]
pub struct ReleaseInfo {
    pub middleware: Option<u32>,
    pub call: Option<u32>,
    pub taken: Option<bool>,
}

impl Hub {
    pub(crate) fn new(
        run: Callback<HttpRequestInfo, HttpRequestResult>,
        release: Notify<ReleaseInfo>,
    ) -> Self {
        Hub { run, release }
    }

    /// Policy call `call` is over.
    pub(crate) fn settle(&self, call: u32, taken: bool) {
        self.release.send(ReleaseInfo {
            middleware: None,
            call: Some(call),
            taken: Some(taken),
        });
    }

    /// The library's middleware for registration `id`, which it releases when dropped.
    pub(crate) fn middleware(self: &Arc<Self>, id: u32) -> JsMiddleware {
        JsMiddleware {
            id,
            hub: Arc::clone(self),
        }
    }
}

/// One registered JavaScript middleware as the library's.
pub(crate) struct JsMiddleware {
    id: u32,
    hub: Arc<Hub>,
}

impl Drop for JsMiddleware {
    fn drop(&mut self) {
        self.hub.release.send(ReleaseInfo {
            middleware: Some(self.id),
            call: None,
            taken: None,
        });
    }
}

fn pairs(headers: &HeaderMap) -> Vec<Vec<String>> {
    headers
        .iter()
        .filter_map(|(name, value)| {
            Some(vec![
                name.as_str().to_owned(),
                value.to_str().ok()?.to_owned(),
            ])
        })
        .collect()
}

fn header_map(pairs: Vec<Vec<String>>) -> Result<HeaderMap, String> {
    let mut headers = HeaderMap::new();
    for pair in pairs {
        let [name, value] = <[String; 2]>::try_from(pair)
            .map_err(|_| "a header must be a [name, value] pair".to_string())?;
        let name = HeaderName::try_from(name.as_str())
            .map_err(|_| format!("{name:?} is not an HTTP header name"))?;
        let value = HeaderValue::from_str(&value)
            .map_err(|_| format!("the value for {name:?} is not a header value"))?;
        headers.append(name, value);
    }
    Ok(headers)
}

fn answer(
    result: HttpRequestResult,
) -> Result<(Option<HeaderMap>, Option<krunbox::net::Answer>), String> {
    let headers = result.headers.map(header_map).transpose()?;
    let Some(status) = result.status else {
        return Ok((headers, None));
    };
    // 1xx are not final answers: a request answered so could not end.
    let status = u16::try_from(status)
        .ok()
        .filter(|s| (200..=999).contains(s))
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| format!("{status} is not an HTTP status an answer can have (200 to 999)"))?;
    let answer = krunbox::net::Answer::new(status, result.body.unwrap_or_default());
    Ok((headers, Some(answer)))
}

#[krunbox::net::async_trait]
impl krunbox::net::Middleware for JsMiddleware {
    async fn handle(&self, head: &mut RequestHead) -> Option<krunbox::net::Answer> {
        let request = HttpRequestInfo {
            middleware: self.id,
            hostname: head.hostname().to_owned(),
            scheme: head.scheme().as_str().to_owned(),
            method: head.method().as_str().to_owned(),
            path: head.path().to_owned(),
            headers: pairs(head.headers()),
        };
        match self.hub.run.call(request).await.and_then(answer) {
            Ok((headers, answer)) => {
                if let Some(headers) = headers {
                    *head.headers_mut() = headers;
                }
                answer
            }
            Err(error) => {
                tracing::warn!(%error, "HTTP middleware failed; the request is answered 500");
                Some(krunbox::net::Answer::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the sandbox's middleware failed on this request\n",
                ))
            }
        }
    }
}
