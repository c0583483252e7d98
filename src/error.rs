//! The one error type of the public API.

use std::path::PathBuf;
use std::time::Duration;

use crate::protocol::fs::FsErrorKind;
use crate::protocol::{ExecErrorKind, ProtocolError};

/// Everything that can go wrong booting a sandbox or running a command in it.
///
/// Each message says what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file krunbox needs at run time (VMM helper, guest-init, libkrunfw) was not found.
    #[error("{what} not found (looked in: {}); {fix}", display_paths(.looked_in))]
    MissingArtifact {
        /// What is missing.
        what: &'static str,
        /// Where krunbox looked.
        looked_in: Vec<PathBuf>,
        /// How to get it.
        fix: String,
    },
    /// The root image's SHA-256 differs from the recorded one: it was modified or corrupted.
    #[error("refusing to boot: image {path} has SHA-256 {actual}, expected {expected}; the image was modified or corrupted — rebuild it (`krunbox-rootfs build --force NAME`) or restore the original")]
    ImageDigestMismatch {
        /// The image file.
        path: PathBuf,
        /// The recorded digest.
        expected: String,
        /// What the file hashes to now.
        actual: String,
    },
    /// Building a built-in image failed.
    #[error("building the built-in image failed: {0}")]
    ImageBuild(#[from] krunbox_rootfs::BuildError),
    /// A writable root's layer could not be made (formatting or sealing it on the host).
    #[error("preparing the writable root's layer failed: {0}")]
    WritableLayer(String),
    /// A persistent root's layer is in use by another running instance (this process's or
    /// another's): one layer serves one running sandbox at a time.
    #[error("the root layer {path} is in use by another running sandbox; shut that one down first, or give this one a layer of its own")]
    RootInUse {
        /// The layer file.
        path: PathBuf,
    },
    /// A persistent root's layer was made over another base image: its changes belong to that
    /// image, so it is refused rather than laid over this one.
    #[error("the root layer {path} was made over the image with SHA-256 {recorded}, not this one ({expected}); boot it with its own base, or use another layer path")]
    RootBaseMismatch {
        /// The layer file.
        path: PathBuf,
        /// The digest of the base this sandbox boots.
        expected: String,
        /// The digest the layer records.
        recorded: String,
    },
    /// A persistent root's layer file is not one krunbox can use (not a qcow2 made by
    /// krunbox, or damaged).
    #[error("the root layer {path} cannot be used: {reason}")]
    RootLayer {
        /// The layer file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A copy-on-write root's [`BlockStore`](crate::rootfs::BlockStore) failed: at boot (it
    /// refused the base or was in use: the boot fails), or while the guest ran (the guest got
    /// `EIO`; [`Instance::shutdown`](crate::Instance::shutdown) reports the first failure).
    /// Blocks it could not take are not silently dropped: they were offered again at each
    /// sync and at shutdown, and this error says when they could not be stored. `shutdown`
    /// reports the run's first failure even when a later retry stored everything (the guest
    /// saw `EIO` then, and may have acted on it); the store's error comes as its message.
    /// Also a store an image is written into or read from
    /// ([`image::flatten_into_store`](crate::image::flatten_into_store)) that failed.
    #[error("the block store failed to {operation}: {source}")]
    BlockStore {
        /// What krunbox asked of the store (`attach`, `read`, `write`, `flush`, ...).
        operation: &'static str,
        /// The store's error.
        source: crate::rootfs::store::error::StoreError,
    },
    /// An image archive (`docker save`, an OCI layout) is not one krunbox can import: unreadable,
    /// a blob whose digest does not match, a layer that leaves the tree, another platform.
    #[error("the image archive {path} cannot be imported: {reason}")]
    ImageArchive {
        /// The archive.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Pulling an image from a registry failed ([`oci::pull`](crate::image::oci::pull)):
    /// `kind` says which way, so a caller can ask for credentials on
    /// [`PullFailure::Unauthorized`](crate::image::oci::PullFailure::Unauthorized).
    #[error("pulling {reference} failed: {reason}")]
    Registry {
        /// The image reference, as given.
        reference: String,
        /// What kind of failure it is.
        kind: crate::image::oci::failure::PullFailure,
        /// What happened, with what the registry said.
        reason: String,
    },
    /// A step of an image build ([`oci::build`](crate::image::oci::build)) failed: the image
    /// was not made.
    #[error("the build step `{step}` failed ({status}); its output ended with:\n{output}")]
    BuildStep {
        /// The step, as given.
        step: String,
        /// How it ended.
        status: String,
        /// The end of what it printed (stdout, then stderr; at most 8 KiB).
        output: String,
    },
    /// The sandbox definition is invalid.
    #[error("invalid sandbox configuration: {0}")]
    InvalidConfig(String),
    /// The VMM helper process could not be started.
    #[error("could not start the VMM helper {path}: {source}")]
    VmmSpawn {
        /// The helper binary.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The VM stopped unexpectedly (VMM crash, guest kernel panic, KVM failure).
    #[error("the microVM stopped unexpectedly ({status}){}", console_hint(.console_tail))]
    VmExited {
        /// How the helper process ended.
        status: String,
        /// The last lines of the guest console and VMM log.
        console_tail: String,
    },
    /// The guest did not finish booting in time.
    #[error("the microVM did not become ready within {after:?}; if this host cannot run KVM guests (see `krunbox doctor`), use the nested harness{}", console_hint(.console_tail))]
    BootTimeout {
        /// The boot deadline.
        after: Duration,
        /// The last lines of the guest console and VMM log.
        console_tail: String,
    },
    /// The VMM helper's jail did not hold: a canary reached what it must not (a host file, host
    /// loopback, a denied system call). The VM was not started.
    #[error("the VMM helper's confinement failed its canaries ({}); the VM was not started. \
             `krunbox doctor` shows the isolation layers this host provides:\n{isolation}",
             .breaches.iter().map(|b| format!("{}: {}", b.canary, b.detail)).collect::<Vec<_>>().join("; "))]
    IsolationBreached {
        /// The canaries that got through.
        breaches: Vec<crate::CanaryReport>,
        /// Everything the helper reported.
        isolation: crate::Isolation,
    },
    /// This host cannot provide an isolation layer the definition requires
    /// ([`SandboxBuilder::require_isolation`](crate::SandboxBuilder::require_isolation)). The
    /// VM was not started.
    #[error("this host cannot provide isolation the sandbox requires ({}); the VM was not started. \
             Enable what is missing (see `krunbox doctor`) or require less:\n{isolation}",
             .missing.iter().map(|l| format!("{}: {}", l.layer, l.detail)).collect::<Vec<_>>().join("; "))]
    IsolationUnavailable {
        /// The required layers that are not in force, with the reason for each.
        missing: Vec<crate::LayerReport>,
        /// Everything the helper reported.
        isolation: crate::Isolation,
    },
    /// The sandbox's network could not be set up on the host (its certificate authority, or
    /// the trust roots for upstream TLS). The VM was not started.
    #[error("setting up the sandbox's network failed: {0}")]
    NetworkSetup(String),
    /// guest-init could not finish setting up the guest.
    #[error("guest setup failed: {message}")]
    GuestSetup {
        /// guest-init's report.
        message: String,
    },
    /// The guest sent bytes that violate the control protocol. The guest is treated as hostile:
    /// the instance is shut down.
    #[error("the guest broke the control protocol: {0}; the instance was stopped")]
    Protocol(#[from] ProtocolError),
    /// The command could not be started in the guest.
    #[error("cannot run {program:?} in the guest: {message}")]
    Exec {
        /// The program.
        program: String,
        /// Not found, permission denied, or other.
        kind: ExecErrorKind,
        /// guest-init's description, with the errno text.
        message: String,
    },
    /// A file operation in the guest failed (`Instance::read_file`, `write_file`, ...).
    #[error("{op} {path:?} in the guest failed: {message}")]
    Fs {
        /// The operation, e.g. `"read_file"`.
        op: &'static str,
        /// The guest path it was given.
        path: PathBuf,
        /// Not found, permission denied, ...
        kind: FsErrorKind,
        /// guest-init's description, with the errno text.
        message: String,
    },
    /// The instance is no longer running (shut down, or the VM stopped).
    #[error("the sandbox instance is not running: {reason}")]
    InstanceGone {
        /// Why it stopped.
        reason: String,
    },
    /// A command's timeout passed, and the guest did not end it even after the host sent the
    /// kill itself: guest-init is wedged or was tampered with from inside the guest.
    #[error("the guest did not end a timed-out command within {after:?} of its timeout, even when told to kill it; the instance is unresponsive: shut it down and boot a new one")]
    GuestUnresponsive {
        /// How long past the timeout the host waited.
        after: Duration,
    },
    /// The liveness check found the guest silent: it left a ping unanswered and sent nothing
    /// else for this long (its vCPU, the VMM or guest-init stopped making progress). The VMM
    /// helper was killed; every pending call of the instance ends with this error. The bound
    /// is [`SandboxBuilder::liveness_timeout`](crate::SandboxBuilder::liveness_timeout).
    #[error("the guest sent nothing for {silent_for:?}, not even an answer to the liveness ping (its vCPU, the VMM or guest-init is stuck); the VM was killed: shut this instance down and boot a new one")]
    GuestHung {
        /// How long the guest was silent with a ping outstanding.
        silent_for: Duration,
    },
    /// The guest did not answer one request within
    /// [`Limits::request_timeout`](crate::Limits::request_timeout): a `spawn` waiting for its
    /// process to start, or a file request. The guest still answers the liveness check (else
    /// this would be [`Error::GuestHung`]), so the instance stays usable; the request itself is
    /// abandoned (a spawned process is killed).
    #[error("the guest did not answer {request} within {after:?}; guest-init is alive but this request is stuck (e.g. a file on a hung filesystem): retry, raise Limits::request_timeout, or boot a new instance")]
    RequestTimeout {
        /// Which request, e.g. `read_file "/data/x"` or `spawn "make"`.
        request: String,
        /// The deadline that passed.
        after: Duration,
    },
    /// [`Command::output`](crate::Command::output) collected more than its cap of one stream
    /// ([`Command::max_output`](crate::Command::max_output), default
    /// [`DEFAULT_MAX_OUTPUT`](crate::DEFAULT_MAX_OUTPUT)). The command's process group was
    /// killed.
    #[error("the command's {stream} exceeded {limit} bytes (the output() cap); the command was killed: raise it with Command::max_output, keep a prefix with Command::output_limit, or stream it with spawn()")]
    OutputLimitExceeded {
        /// `"stdout"` or `"stderr"`.
        stream: &'static str,
        /// The cap, in bytes.
        limit: usize,
    },
    /// A per-instance cap ([`Limits`](crate::Limits)) is reached: too many processes running
    /// or too many file requests waiting for the guest. Nothing was sent to the guest.
    #[error("this instance already has {limit} {what}, its cap (Limits::{knob}); wait for some to finish or raise the cap")]
    TooMany {
        /// What there are too many of, e.g. `"running processes"`.
        what: &'static str,
        /// The cap.
        limit: usize,
        /// The [`Limits`](crate::Limits) setting that raises it.
        knob: &'static str,
    },
    /// The instance is paused ([`Instance::pause`](crate::Instance::pause)): new commands and
    /// file operations are refused until it is resumed. Nothing was sent to the guest.
    #[error("the sandbox instance is paused: resume it (Instance::resume) before starting commands or file operations")]
    Paused,
    /// The VM's state could not be saved or set; the instance still runs as it did (its vCPUs
    /// were resumed) unless `reason` says otherwise.
    #[error("the VM's state could not be {step}: {reason}")]
    Snapshot {
        /// What was being done (`"saved"`, `"set"`, …).
        step: &'static str,
        /// Why it failed.
        reason: String,
    },
    /// A snapshot's manifest or one of its parts is not what the snapshot was written with
    /// (changed, truncated, or written with another user's key). No guest ran any of it (a
    /// restore stops its helper before the VM's state is loaded).
    #[error("the snapshot's {part} was changed after it was written ({why}); take a new snapshot")]
    SnapshotTampered {
        /// The file that differs.
        part: String,
        /// How it differs.
        why: String,
    },
    /// The command was cancelled through its [`CancellationToken`](tokio_util::sync::CancellationToken);
    /// its process group was killed.
    #[error("the command was cancelled; its process group was killed")]
    Cancelled,
    /// A host I/O error.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let context = context.into();
        move |source| Error::Io { context, source }
    }

    /// The kind of a failed file operation ([`Error::Fs`]), or `None` for other errors.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// use krunbox::FsErrorKind;
    ///
    /// match vm.read_file("/etc/motd").await {
    ///     Ok(text) => println!("{}", String::from_utf8_lossy(&text)),
    ///     Err(err) if err.fs_kind() == Some(FsErrorKind::NotFound) => println!("no motd"),
    ///     Err(err) => return Err(err),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn fs_kind(&self) -> Option<FsErrorKind> {
        match self {
            Error::Fs { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// The variant's name, a stable string for callers in other languages and for logs: the
    /// bindings give it as their errors' `code` (`"InvalidConfig"`, `"BootTimeout"`, ...). A
    /// name never changes meaning; new variants bring new names.
    ///
    /// ```
    /// let err = krunbox::Error::InvalidConfig("cpus must be at least 1".into());
    /// assert_eq!(err.code(), "InvalidConfig");
    /// ```
    pub fn code(&self) -> &'static str {
        match self {
            Error::MissingArtifact { .. } => "MissingArtifact",
            Error::ImageDigestMismatch { .. } => "ImageDigestMismatch",
            Error::ImageBuild(_) => "ImageBuild",
            Error::WritableLayer(_) => "WritableLayer",
            Error::RootInUse { .. } => "RootInUse",
            Error::RootBaseMismatch { .. } => "RootBaseMismatch",
            Error::RootLayer { .. } => "RootLayer",
            Error::BlockStore { .. } => "BlockStore",
            Error::ImageArchive { .. } => "ImageArchive",
            Error::Registry { .. } => "Registry",
            Error::BuildStep { .. } => "BuildStep",
            Error::InvalidConfig(_) => "InvalidConfig",
            Error::VmmSpawn { .. } => "VmmSpawn",
            Error::VmExited { .. } => "VmExited",
            Error::BootTimeout { .. } => "BootTimeout",
            Error::IsolationBreached { .. } => "IsolationBreached",
            Error::IsolationUnavailable { .. } => "IsolationUnavailable",
            Error::NetworkSetup(_) => "NetworkSetup",
            Error::GuestSetup { .. } => "GuestSetup",
            Error::Protocol(_) => "Protocol",
            Error::Exec { .. } => "Exec",
            Error::Fs { .. } => "Fs",
            Error::InstanceGone { .. } => "InstanceGone",
            Error::GuestUnresponsive { .. } => "GuestUnresponsive",
            Error::GuestHung { .. } => "GuestHung",
            Error::RequestTimeout { .. } => "RequestTimeout",
            Error::OutputLimitExceeded { .. } => "OutputLimitExceeded",
            Error::TooMany { .. } => "TooMany",
            Error::Paused => "Paused",
            Error::Snapshot { .. } => "Snapshot",
            Error::SnapshotTampered { .. } => "SnapshotTampered",
            Error::Cancelled => "Cancelled",
            Error::Io { .. } => "Io",
        }
    }
}

fn display_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn console_hint(tail: &str) -> String {
    if tail.trim().is_empty() {
        String::new()
    } else {
        format!("; last console output:\n{tail}")
    }
}

/// Shorthand for results in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
