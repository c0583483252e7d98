//! The native half of the `krunbox` npm package: napi-rs classes wrapping the library's own
//! types, loaded by the package's TypeScript API (`ts/`), which is what users import.
//!
//! Every call that waits on a VM returns a Promise, run on napi's tokio runtime; nothing
//! here blocks Node's event loop. The user's JavaScript callbacks (a network policy, HTTP
//! middleware) are called back on the event loop through thread-safe functions
//! (`callback.rs`); what they throw or reject costs only their own flow or request.
//!
//! This process is the library's (host, trusted caller): nothing here parses guest bytes
//! beyond what the library already bounds.

mod bench;
mod callback;
mod errors;
mod files;
mod fs;
mod instance;
mod net;
mod observe;
mod pool;
mod process;
mod rootfs;
mod sandbox;
mod snapshot;
mod tools;

use napi_derive::napi;

/// Makes this process find the helper and guest-init (and libkrunfw) in `dir` first: the
/// package's own `artifacts/`, which it ships (not inherited by the programs it starts, as
/// an environment variable would be).
#[napi]
pub fn search_artifacts_first(dir: String) {
    krunbox::artifacts_search_first_in(std::path::PathBuf::from(dir));
}

/// The exit code of a command its timeout ended (124, as coreutils' `timeout` has it).
#[napi]
pub const TIMEOUT_EXIT_CODE: i32 = krunbox::TIMEOUT_EXIT_CODE;

/// The most bytes `exec` collects of each of stdout and stderr.
#[napi]
pub const MAX_OUTPUT: u32 = krunbox::DEFAULT_MAX_OUTPUT as u32;
