//! What every bench binary shares: the median of its rounds and its size knobs from the
//! environment.

/// The median of `values` (the upper one of an even count). Incomparable values (NaN) count as
/// equal.
pub fn median<T: PartialOrd + Copy>(mut values: Vec<T>) -> T {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    values[values.len() / 2]
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
