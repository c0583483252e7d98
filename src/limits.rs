//! Per-instance bounds on what the guest can make the host hold or wait for.
//!
//! The guest is hostile: assume guest-init was replaced by the attacker's program. No host
//! allocation grows with what the guest sends unless it is counted against one of these bounds
//! (or a protocol bound in [`crate::protocol::limits`]), and no host call waits on the guest
//! without a deadline. docs/security.md lists every bound with the test that proves it.

use std::time::Duration;

use crate::error::{Error, Result};

/// The default [`Limits::request_timeout`]: long enough for `remove_all` of a large tree or a
/// busy guest under nested emulation, short enough that a stuck request is noticed.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// Shortest [`Limits::request_timeout`].
pub const MIN_REQUEST_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest [`Limits::request_timeout`].
pub const MAX_REQUEST_TIMEOUT: Duration = Duration::from_secs(3600);
/// The default [`Limits::read_file_max`]: 64 MiB. Larger files are read with
/// [`Instance::open_file`](crate::Instance::open_file), which streams in bounded memory.
pub const DEFAULT_READ_FILE_MAX: u64 = 64 * 1024 * 1024;
/// The default [`Limits::read_dir_max_entries`]. With names of at most
/// [`MAX_NAME`](crate::protocol::fs::MAX_NAME) bytes a listing holds at most about 20 MiB.
pub const DEFAULT_READ_DIR_MAX_ENTRIES: usize = 65_536;
/// The default [`Limits::max_processes`].
pub const DEFAULT_MAX_PROCESSES: usize = 1024;
/// The default [`Limits::max_pending_file_requests`].
pub const DEFAULT_MAX_PENDING_FILE_REQUESTS: usize = 1024;
/// The default for [`Limits::host_descriptors`]: room for a `HostDir`'s whole inode table and
/// every handle, and the network's sockets.
pub const DEFAULT_HOST_DESCRIPTORS: usize = 1 << 17;
/// The default for [`Limits::host_memory_overhead`]: libkrun's own heap and threads, the
/// guest kernel's image, device buffers.
pub const DEFAULT_HOST_MEMORY_OVERHEAD: u64 = 256 << 20;

/// Bounds for one instance, set on the definition with
/// [`SandboxBuilder::limits`](crate::SandboxBuilder::limits). Every field has a default that
/// suits an ordinary workload; each bound, when hit, is a typed error that says which bound
/// and how to raise it, and the instance stays usable.
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use std::time::Duration;
/// use krunbox::{Limits, Sandbox};
///
/// let sandbox = Sandbox::builder()
///     .limits(Limits::new().read_file_max(256 << 20).request_timeout(Duration::from_secs(600)))
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub(crate) request_timeout: Duration,
    pub(crate) read_file_max: u64,
    pub(crate) read_dir_max_entries: usize,
    pub(crate) max_processes: usize,
    pub(crate) max_pending_file_requests: usize,
    pub(crate) host_descriptors: usize,
    pub(crate) host_memory_overhead: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            read_file_max: DEFAULT_READ_FILE_MAX,
            read_dir_max_entries: DEFAULT_READ_DIR_MAX_ENTRIES,
            max_processes: DEFAULT_MAX_PROCESSES,
            max_pending_file_requests: DEFAULT_MAX_PENDING_FILE_REQUESTS,
            host_descriptors: DEFAULT_HOST_DESCRIPTORS,
            host_memory_overhead: DEFAULT_HOST_MEMORY_OVERHEAD,
        }
    }
}

impl Limits {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long the host waits for the guest to answer one request: a `spawn` waiting for the
    /// process to start, and every file request (each chunk of a stream is one). Past it the
    /// call fails with [`Error::RequestTimeout`]. Default [`DEFAULT_REQUEST_TIMEOUT`]; between
    /// [`MIN_REQUEST_TIMEOUT`] and [`MAX_REQUEST_TIMEOUT`].
    ///
    /// This is not the liveness check (which notices a guest that stopped altogether,
    /// [`Error::GuestHung`]): it covers a guest that is alive but leaves one request
    /// unanswered, e.g. a file on a stuck filesystem.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// The largest file [`Instance::read_file`](crate::Instance::read_file) reads into memory
    /// (default [`DEFAULT_READ_FILE_MAX`]); a larger one fails with
    /// [`FsErrorKind::TooLarge`](crate::FsErrorKind::TooLarge). Stream large files with
    /// [`Instance::open_file`](crate::Instance::open_file) instead.
    pub fn read_file_max(mut self, bytes: u64) -> Self {
        self.read_file_max = bytes;
        self
    }

    /// The most entries [`Instance::read_dir`](crate::Instance::read_dir) collects (default
    /// [`DEFAULT_READ_DIR_MAX_ENTRIES`]); a larger directory fails with
    /// [`FsErrorKind::TooLarge`](crate::FsErrorKind::TooLarge).
    pub fn read_dir_max_entries(mut self, entries: usize) -> Self {
        self.read_dir_max_entries = entries;
        self
    }

    /// The most processes the host tracks at once (spawned and not yet reported ended by the
    /// guest; default [`DEFAULT_MAX_PROCESSES`]). One more `spawn` fails at once with
    /// [`Error::TooMany`] (it does not wait: a caller could be waiting on the very processes
    /// that hold the slots).
    pub fn max_processes(mut self, processes: usize) -> Self {
        self.max_processes = processes;
        self
    }

    /// The most file requests waiting for the guest's answer at once (default
    /// [`DEFAULT_MAX_PENDING_FILE_REQUESTS`]; each open stream keeps up to two). One more fails
    /// at once with [`Error::TooMany`]. A request that timed out keeps its slot until the guest
    /// answers it, so a guest that never answers cannot make the host track requests without
    /// bound. At least 2.
    pub fn max_pending_file_requests(mut self, requests: usize) -> Self {
        self.max_pending_file_requests = requests;
        self
    }

    /// The most descriptors the host process holds at once for this instance's guest: a
    /// `HostDir`'s inodes and open files, the network's upstream sockets (default
    /// [`DEFAULT_HOST_DESCRIPTORS`]). Whatever this says, one instance never holds more than
    /// half of what the process may open beyond a reserve the library keeps for its own work
    /// (its `RLIMIT_NOFILE`, which the library raises as far as it may — with
    /// `CAP_SYS_RESOURCE` to the kernel's `fs.nr_open` — less an eighth and at least 1024: on a
    /// host whose hard limit is low and cannot be raised, one instance gets at most half of
    /// it; raise it with `ulimit -Hn` or systemd's `LimitNOFILE=`),
    /// so a guest that floods a mount or the network cannot make another instance's boot,
    /// connection or file call fail. Past it the guest's own call fails: a lookup or open with
    /// `ENFILE`, a connection refused.
    ///
    /// ```
    /// let limits = krunbox::Limits::new().host_descriptors(4096);
    /// ```
    pub fn host_descriptors(mut self, descriptors: usize) -> Self {
        self.host_descriptors = descriptors;
        self
    }

    /// Host memory the instance's VMM may hold beyond its guest's RAM and a memory-backed
    /// writable root (an ephemeral root's quota), where it runs in a cgroup of its own
    /// ([`Layer::Cgroup`](crate::Layer::Cgroup)): its `memory.max` is the three together.
    /// Default [`DEFAULT_HOST_MEMORY_OVERHEAD`]. A VMM that passes it is killed by the host's
    /// OOM killer; the instance then fails with [`Error::InstanceGone`] saying so.
    ///
    /// ```
    /// let limits = krunbox::Limits::new().host_memory_overhead(128 << 20);
    /// ```
    pub fn host_memory_overhead(mut self, bytes: u64) -> Self {
        self.host_memory_overhead = bytes;
        self
    }

    /// Refuses values that would make the instance unusable.
    pub(crate) fn validate(&self) -> Result<()> {
        if !(MIN_REQUEST_TIMEOUT..=MAX_REQUEST_TIMEOUT).contains(&self.request_timeout) {
            return Err(Error::InvalidConfig(format!(
                "limits: request_timeout must be between {MIN_REQUEST_TIMEOUT:?} and \
                 {MAX_REQUEST_TIMEOUT:?}, got {:?}",
                self.request_timeout
            )));
        }
        if self.max_processes == 0 {
            return Err(Error::InvalidConfig(
                "limits: max_processes must be at least 1".into(),
            ));
        }
        if self.host_descriptors < 64 {
            return Err(Error::InvalidConfig(
                "limits: host_descriptors must be at least 64 (a network and a mount need some)"
                    .into(),
            ));
        }
        if self.max_pending_file_requests < 2 {
            return Err(Error::InvalidConfig(
                "limits: max_pending_file_requests must be at least 2 (a file stream keeps two \
                 requests in flight)"
                    .into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_documented_values() {
        let limits = Limits::new();
        assert_eq!(limits.request_timeout, Duration::from_secs(120));
        assert_eq!(limits.read_file_max, 64 << 20);
        assert_eq!(limits.read_dir_max_entries, 65_536);
        assert_eq!(limits.max_processes, 1024);
        assert_eq!(limits.max_pending_file_requests, 1024);
        assert_eq!(limits.host_descriptors, 131_072);
        assert_eq!(limits.host_memory_overhead, 256 << 20);
        limits.validate().unwrap();
    }

    #[test]
    fn unusable_values_are_refused() {
        for bad in [
            Limits::new().request_timeout(Duration::from_millis(10)),
            Limits::new().request_timeout(Duration::from_secs(7200)),
            Limits::new().max_processes(0),
            Limits::new().max_pending_file_requests(1),
            Limits::new().host_descriptors(10),
        ] {
            assert!(
                matches!(bad.validate(), Err(Error::InvalidConfig(_))),
                "{bad:?}"
            );
        }
    }
}
