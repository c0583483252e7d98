//! What every bench binary shares: the median of its rounds and its size knobs from the
//! environment.

/// The median of `values` (the upper one of an even count). Incomparable values (NaN) count as
/// equal.
pub fn median<T: PartialOrd + Copy>(mut values: Vec<T>) -> T {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    values[values.len() / 2]
}

/// Runs `command` in the guest and returns its output; a failure to run or an unsuccessful
/// status stops the bench, saying `what` with the command's status and output.
#[allow(dead_code)] // boot.rs, exec.rs and net.rs run their own commands
pub async fn checked_output(command: &mut krunbox::Command, what: &str) -> krunbox::Output {
    let out = command
        .output()
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}\n{}{}",
        out.status,
        out.stdout_text(),
        out.stderr_text()
    );
    out
}

/// The positive integer in the environment variable `name`, or `default` when it is unset;
/// anything else stops the bench, naming the variable.
#[allow(dead_code)] // boot.rs has no knobs
pub fn env_or(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => match v.parse() {
            Ok(n) if n > 0 => n,
            _ => panic!("{name}={v:?}: expected a positive integer"),
        },
        Err(_) => default,
    }
}
