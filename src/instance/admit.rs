//! Whether a helper whose guest completed the handshake is taken into service: its isolation
//! report, checked here too, so that a helper from another build that ignored a requirement
//! cannot slip through.

use crate::error::Error;

/// Why a helper whose guest completed the handshake was not taken into service.
pub(super) enum NotAdmitted {
    /// It wrote no readable isolation report.
    NoReport,
    /// Its jail does not hold, or lacks a required layer.
    Refused(crate::Isolation),
    /// A service of the instance could not start.
    Failed(Error),
}

impl NotAdmitted {
    /// The error a boot ends with, with the console's tail read once the helper is gone.
    pub fn into_error(self, required: &[crate::Layer], console_tail: String) -> Error {
        match self {
            NotAdmitted::NoReport => Error::VmExited {
                status: "the VMM helper started the VM without a readable isolation report".into(),
                console_tail,
            },
            NotAdmitted::Refused(isolation) => {
                isolation_refusal(Some(isolation), required, console_tail)
            }
            NotAdmitted::Failed(err) => err,
        }
    }
}

/// Takes a helper whose guest completed the handshake into service, or says why not, by its
/// isolation report. Returns the VMM's pid and the report.
pub(super) fn admit(
    report: Option<crate::jail::HelperReport>,
    jail: &crate::jail::JailConfig,
) -> std::result::Result<(u32, crate::Isolation), NotAdmitted> {
    let Some(crate::jail::HelperReport { vmm_pid, isolation }) = report else {
        return Err(NotAdmitted::NoReport);
    };
    if crate::jail::refusal(jail, &isolation).is_some() {
        return Err(NotAdmitted::Refused(isolation));
    }
    Ok((vmm_pid, isolation))
}

/// The error for a helper that exited with [`krunbox_protocol::vmm::ISOLATION_EXIT_CODE`]:
/// it refused to start the VM, and its report says why.
pub(super) fn isolation_refusal(
    report: Option<crate::Isolation>,
    required: &[crate::Layer],
    tail: String,
) -> Error {
    let Some(isolation) = report else {
        return Error::VmExited {
            status: "the VMM helper refused to start the VM and wrote no isolation report".into(),
            console_tail: tail,
        };
    };
    let breaches = isolation.breaches();
    if breaches.is_empty() {
        Error::IsolationUnavailable {
            missing: isolation.missing(required),
            isolation,
        }
    } else {
        Error::IsolationBreached {
            breaches,
            isolation,
        }
    }
}
