//! The Rust API's side of the Node bench (`benches/bench_exec.ts`): the same runs the bench
//! times through the TypeScript API, timed in Rust on the same instance, in the same process
//! and run, so the ratio is the binding's own cost. Not part of the package's API.

use std::time::Instant;

use napi_derive::napi;

use crate::errors::{invalid, OrNapi};
use crate::instance::NativeInstance;

/// Seconds `instance` takes to run `args` to its end, output collected, through the Rust API;
/// the run must exit 0 and write `stdout_bytes` to stdout.
// napi-derive registers an async free function only outside cfg(test).
#[cfg_attr(test, allow(dead_code))]
#[napi]
pub async fn rust_exec_seconds(
    instance: &NativeInstance,
    args: Vec<String>,
    stdout_bytes: u32,
) -> napi::Result<f64> {
    let (program, rest) = args
        .split_first()
        .ok_or_else(|| invalid("the bench needs a program to run"))?;
    let start = Instant::now();
    let output = instance
        .inner
        .command(program)
        .args(rest)
        .output()
        .await
        .or_napi()?;
    let seconds = start.elapsed().as_secs_f64();
    if !output.status.success() || output.stdout.len() != stdout_bytes as usize {
        return Err(invalid(format!(
            "the bench's run of {args:?} went wrong: {:?}, {} bytes of stdout",
            output.status,
            output.stdout.len()
        )));
    }
    Ok(seconds)
}
