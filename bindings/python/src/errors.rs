//! The library's `Error` as Python exceptions: a base `KrunboxError` and one subclass per
//! variant a caller acts on differently, each carrying the library's one-line message.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    krunbox,
    KrunboxError,
    PyException,
    "Anything krunbox reports; its message says what happened and what to do."
);
create_exception!(
    krunbox,
    InvalidConfig,
    KrunboxError,
    "A definition or argument krunbox refuses."
);
create_exception!(
    krunbox,
    MissingArtifact,
    KrunboxError,
    "A part krunbox needs (helper, guest-init, kernel) was not found: run `krunbox setup`."
);
create_exception!(
    krunbox,
    IsolationUnavailable,
    KrunboxError,
    "This host cannot confine the VMM helper as asked."
);
create_exception!(
    krunbox,
    ImageDigestMismatch,
    KrunboxError,
    "A root image's bytes are not the ones its digest names."
);
create_exception!(
    krunbox,
    BootFailed,
    KrunboxError,
    "The VM did not come up (its VMM exited, it timed out, or its setup failed)."
);
create_exception!(
    krunbox,
    ExecFailed,
    KrunboxError,
    "The guest could not start the program (not found, not executable, ...)."
);
create_exception!(
    krunbox,
    CommandFailed,
    KrunboxError,
    "`run(..., check=True)`: the command exited with a status other than 0."
);
create_exception!(
    krunbox,
    CommandTimeout,
    CommandFailed,
    "`run(..., check=True)`: the command's timeout killed it (exit code 124)."
);
create_exception!(
    krunbox,
    RequestTimeout,
    KrunboxError,
    "The guest did not answer one request in time; the instance stays usable."
);
create_exception!(
    krunbox,
    TooMany,
    KrunboxError,
    "An instance's cap (running processes, waiting requests) is reached."
);
create_exception!(
    krunbox,
    GuestHung,
    KrunboxError,
    "The guest stopped answering; the instance is gone."
);
create_exception!(
    krunbox,
    InstanceGone,
    KrunboxError,
    "The instance was shut down or its VM ended."
);
create_exception!(
    krunbox,
    OutputLimitExceeded,
    KrunboxError,
    "A command wrote more output than `run` collects."
);
create_exception!(krunbox, Cancelled, KrunboxError, "The call was cancelled.");
create_exception!(
    krunbox,
    Paused,
    KrunboxError,
    "The instance is paused: resume it before starting commands or file operations."
);
create_exception!(
    krunbox,
    GuestFsError,
    KrunboxError,
    "A file operation in the guest failed."
);
create_exception!(krunbox, StoreError, KrunboxError, "A block store failed.");
create_exception!(
    krunbox,
    SnapshotFailed,
    KrunboxError,
    "A snapshot could not be taken or restored; the instance runs as before."
);
create_exception!(
    krunbox,
    SnapshotTampered,
    KrunboxError,
    "A snapshot's manifest or a part of it changed after it was written; nothing of it was used."
);
create_exception!(
    krunbox,
    RootInUse,
    KrunboxError,
    "A persistent root or store is in use by another sandbox."
);

/// Adds the exception classes to the module.
pub(crate) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = module.py();
    module.add("KrunboxError", py.get_type::<KrunboxError>())?;
    module.add("InvalidConfig", py.get_type::<InvalidConfig>())?;
    module.add("MissingArtifact", py.get_type::<MissingArtifact>())?;
    module.add(
        "IsolationUnavailable",
        py.get_type::<IsolationUnavailable>(),
    )?;
    module.add("ImageDigestMismatch", py.get_type::<ImageDigestMismatch>())?;
    module.add("BootFailed", py.get_type::<BootFailed>())?;
    module.add("ExecFailed", py.get_type::<ExecFailed>())?;
    module.add("CommandFailed", py.get_type::<CommandFailed>())?;
    module.add("CommandTimeout", py.get_type::<CommandTimeout>())?;
    module.add("RequestTimeout", py.get_type::<RequestTimeout>())?;
    module.add("TooMany", py.get_type::<TooMany>())?;
    module.add("GuestHung", py.get_type::<GuestHung>())?;
    module.add("InstanceGone", py.get_type::<InstanceGone>())?;
    module.add("OutputLimitExceeded", py.get_type::<OutputLimitExceeded>())?;
    module.add("Cancelled", py.get_type::<Cancelled>())?;
    module.add("Paused", py.get_type::<Paused>())?;
    module.add("GuestFsError", py.get_type::<GuestFsError>())?;
    module.add("StoreError", py.get_type::<StoreError>())?;
    module.add("RootInUse", py.get_type::<RootInUse>())?;
    module.add("SnapshotFailed", py.get_type::<SnapshotFailed>())?;
    module.add("SnapshotTampered", py.get_type::<SnapshotTampered>())?;
    Ok(())
}

/// The exception for `error`, its message the library's.
pub(crate) fn to_py(error: krunbox::Error) -> PyErr {
    use krunbox::Error as E;
    let message = error.to_string();
    match error {
        E::InvalidConfig(_) => InvalidConfig::new_err(message),
        E::MissingArtifact { .. } => MissingArtifact::new_err(message),
        E::IsolationUnavailable { .. } | E::IsolationBreached { .. } => {
            IsolationUnavailable::new_err(message)
        }
        E::ImageDigestMismatch { .. } => ImageDigestMismatch::new_err(message),
        E::VmmSpawn { .. }
        | E::VmExited { .. }
        | E::BootTimeout { .. }
        | E::GuestSetup { .. }
        | E::NetworkSetup(_) => BootFailed::new_err(message),
        E::Exec { .. } => ExecFailed::new_err(message),
        E::RequestTimeout { .. } => RequestTimeout::new_err(message),
        E::GuestHung { .. } | E::GuestUnresponsive { .. } => GuestHung::new_err(message),
        E::TooMany { .. } => TooMany::new_err(message),
        E::InstanceGone { .. } => InstanceGone::new_err(message),
        E::OutputLimitExceeded { .. } => OutputLimitExceeded::new_err(message),
        E::Cancelled => Cancelled::new_err(message),
        E::Paused => Paused::new_err(message),
        E::Fs { .. } => GuestFsError::new_err(message),
        E::BlockStore { .. } => StoreError::new_err(message),
        E::RootInUse { .. } => RootInUse::new_err(message),
        E::Snapshot { .. } => SnapshotFailed::new_err(message),
        E::SnapshotTampered { .. } => SnapshotTampered::new_err(message),
        _ => KrunboxError::new_err(message),
    }
}
