//! `python -m krunbox doctor`: whether this host can boot microVMs, and what krunbox found.

use std::path::PathBuf;

use pyo3::prelude::*;

/// The host's report (the `krunbox doctor` text) and whether it can boot guests, probed with
/// the helper and guest-init in `artifacts` (the package's own) where present. Boots a probe
/// VM when KVM looks usable, so it takes seconds; waits with the GIL released.
#[pyfunction]
#[pyo3(signature = (artifacts = None))]
pub(crate) fn doctor(py: Python<'_>, artifacts: Option<PathBuf>) -> (String, bool) {
    let shipped = |part: &str| {
        artifacts
            .as_ref()
            .map(|dir| dir.join(part))
            .filter(|path| path.is_file())
    };
    let (helper, guest_init) = (shipped("bin/krunbox-vmm"), shipped("guest-init"));
    let runtime = pyo3_async_runtimes::tokio::get_runtime();
    let capabilities =
        py.detach(|| runtime.block_on(krunbox::HostCapabilities::probe_with(helper, guest_init)));
    (capabilities.report(), capabilities.can_boot_guests())
}
