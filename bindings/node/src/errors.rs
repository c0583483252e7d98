//! The library's `Error` on its way to JavaScript: a napi error whose message carries the
//! variant's stable code (`krunbox::Error::code`) ahead of the library's one-line message,
//! as `[krunbox:Code] message`. The TypeScript API turns it into the `KrunboxError` subclass
//! of that code (`ts/errors.ts`); read raw, it is still a readable message.

/// The napi error for `error`.
pub(crate) fn to_napi(error: krunbox::Error) -> napi::Error {
    coded(error.code(), &error.to_string())
}

/// The napi error for an argument the binding itself refuses, before the library sees it.
pub(crate) fn invalid(message: impl std::fmt::Display) -> napi::Error {
    coded("InvalidConfig", &message.to_string())
}

fn coded(code: &str, message: &str) -> napi::Error {
    napi::Error::new(
        napi::Status::GenericFailure,
        format!("[krunbox:{code}] {message}"),
    )
}

/// A library result as a napi result.
pub(crate) trait OrNapi<T> {
    fn or_napi(self) -> napi::Result<T>;
}

impl<T> OrNapi<T> for krunbox::Result<T> {
    fn or_napi(self) -> napi::Result<T> {
        self.map_err(to_napi)
    }
}
