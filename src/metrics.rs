//! What an instance costs the host: its VMM's CPU time, memory and block I/O (from its cgroup
//! where it has one, else from `/proc` of the VMM process), the network's running totals, the
//! descriptors the host holds for its guest, and its writable root's use.

use std::time::Duration;

use crate::rootfs::RootUsage;

/// What an instance has cost the host since it booted, and holds now
/// ([`Instance::metrics`](crate::Instance::metrics)). Serializes as JSON for machines.
///
/// ```no_run
/// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
/// let metrics = vm.metrics()?;
/// println!(
///     "cpu {:?}, memory {} MiB (peak {} MiB)",
///     metrics.cpu_time,
///     metrics.memory_bytes >> 20,
///     metrics.memory_peak_bytes >> 20,
/// );
/// println!("{}", serde_json::to_string(&metrics).unwrap());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Metrics {
    /// CPU time the VM's processes used (user and system, every vCPU and device thread).
    #[serde(serialize_with = "seconds")]
    pub cpu_time: Duration,
    /// Host memory the VM's processes hold now: the guest memory it touched and the VMM's own.
    pub memory_bytes: u64,
    /// The most they held at once.
    pub memory_peak_bytes: u64,
    /// Bytes the VM's processes read from storage (a disk served in place, the image); `None`
    /// where the host does not say.
    pub disk_read_bytes: Option<u64>,
    /// Bytes they wrote to storage; `None` where the host does not say.
    pub disk_written_bytes: Option<u64>,
    /// The network's totals; `None` without a network.
    pub network: Option<NetworkMetrics>,
    /// Descriptors the host holds for the guest now (a `HostDir`'s inodes and open files,
    /// upstream sockets), and the most it may ([`Limits::host_descriptors`](crate::Limits::host_descriptors)
    /// within the process's share).
    pub host_descriptors: u64,
    /// The most [`host_descriptors`](Self::host_descriptors) may reach.
    pub host_descriptors_max: u64,
    /// A writable root's use; `None` for a read-only root.
    pub root: Option<RootUsage>,
    /// Where the VM's CPU, memory and I/O figures come from.
    pub source: MetricsSource,
    /// The host's own work in the instance's boot before its VM started
    /// ([`Instance::host_boot_work`](crate::Instance::host_boot_work)).
    #[serde(serialize_with = "seconds")]
    pub host_boot_work: Duration,
}

/// Where [`Metrics`]' process figures come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum MetricsSource {
    /// The instance's own cgroup: the helper, the VMM and every thread of theirs.
    Cgroup,
    /// `/proc` of the VMM process (no cgroup of its own on this host).
    Process,
}

/// A sandbox network's running totals ([`Metrics::network`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct NetworkMetrics {
    /// Bytes the guest sent on granted connections and UDP flows.
    pub bytes_from_guest: u64,
    /// Bytes the guest received on them.
    pub bytes_to_guest: u64,
    /// Flows (DNS queries, connections, UDP flows) the policy granted.
    pub flows_granted: u64,
    /// Flows denied.
    pub flows_denied: u64,
    /// Requests on intercepted connections.
    pub requests: u64,
    /// Connections open now.
    pub open_connections: u64,
}

fn seconds<S: serde::Serializer>(duration: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64(duration.as_secs_f64())
}

/// The CPU, memory and I/O figures of one source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcessFigures {
    pub cpu_time: Duration,
    pub memory_bytes: u64,
    pub memory_peak_bytes: u64,
    pub disk_read_bytes: Option<u64>,
    pub disk_written_bytes: Option<u64>,
}

/// The figures `/proc` gives for process `pid` (all its threads); `None` if it is gone.
pub(crate) fn of_process(pid: u32) -> Option<ProcessFigures> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    // /proc/PID/io needs ptrace access, which a jailed helper may not give: then unknown.
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok();
    let cpu_time = cpu_time_of_stat(&stat)?;
    let kib = |field: &str| -> Option<u64> { field_value(&status, field).map(|v| v * 1024) };
    Some(ProcessFigures {
        cpu_time,
        memory_bytes: kib("VmRSS:")?,
        memory_peak_bytes: kib("VmHWM:")?,
        disk_read_bytes: io.as_deref().and_then(|io| field_value(io, "read_bytes:")),
        disk_written_bytes: io.as_deref().and_then(|io| field_value(io, "write_bytes:")),
    })
}

/// User and system time from a `/proc/PID/stat` line. The command name (field 2) may hold
/// spaces and parentheses, so fields are counted from its last `)`.
fn cpu_time_of_stat(stat: &str) -> Option<Duration> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3, utime field 14, stime field 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .ok()
        .filter(|t| *t > 0)?;
    Some(Duration::from_micros((utime + stime) * 1_000_000 / ticks))
}

/// The first number after `name` on its line of a `name value [unit]` listing.
pub(crate) fn field_value(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(name))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_read_from_proc() {
        // Some CPU time to find.
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_add(i ^ (x >> 3));
        }
        assert_ne!(x, 1);
        let figures = of_process(std::process::id()).unwrap();
        assert!(figures.cpu_time > Duration::ZERO);
        assert!(figures.memory_bytes > 0);
        assert!(figures.memory_peak_bytes >= figures.memory_bytes);
        assert!(of_process(u32::MAX).is_none());
    }

    #[test]
    fn a_command_name_with_spaces_and_parentheses_is_skipped() {
        let stat = "42 (a (b) c) R 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 1 0";
        // SAFETY: sysconf has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        assert_eq!(
            cpu_time_of_stat(stat),
            Some(Duration::from_micros(300 * 1_000_000 / ticks))
        );
        assert_eq!(cpu_time_of_stat("garbage"), None);
        assert_eq!(field_value("VmRSS:\t  1234 kB\n", "VmRSS:"), Some(1234));
    }
}
