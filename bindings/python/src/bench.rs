//! The Rust API's side of the Python bench (`benches/bench_exec.py`): the same runs the bench
//! times through Python, timed in Rust on the same instance, in the same process and run, so
//! the ratio is the binding's own cost. Not part of the package's API (hence the underscore).

use std::time::Instant;

use pyo3::prelude::*;

use crate::instance::Instance;
use crate::runtime::block_on;

/// Seconds `instance` takes to run `args` to its end, output collected, through the Rust API;
/// the run must exit 0 and write `stdout_bytes` to stdout.
#[pyfunction(name = "_rust_run_seconds")]
pub(crate) fn rust_run_seconds(
    py: Python<'_>,
    instance: &Instance,
    args: Vec<String>,
    stdout_bytes: usize,
) -> PyResult<f64> {
    let vm = instance.inner.clone();
    block_on(py, async move {
        let (program, rest) = args.split_first().ok_or_else(|| {
            krunbox::Error::InvalidConfig("the bench needs a program to run".into())
        })?;
        let start = Instant::now();
        let output = vm.command(program).args(rest).output().await?;
        let seconds = start.elapsed().as_secs_f64();
        if !output.status.success() || output.stdout.len() != stdout_bytes {
            return Err(krunbox::Error::InvalidConfig(format!(
                "the bench's run of {args:?} went wrong: {:?}, {} bytes of stdout",
                output.status,
                output.stdout.len()
            )));
        }
        Ok(seconds)
    })
}
