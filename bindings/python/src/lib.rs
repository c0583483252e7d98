//! `krunbox._krunbox`: the native half of the `krunbox` Python package. Each class wraps the
//! library's own type; every call that waits on a VM comes twice, as an asyncio awaitable
//! (`boot`, `run`, ...) and as a blocking call that releases the GIL while it waits
//! (`boot_blocking`, ...), which `krunbox.sync` turns into the synchronous API.
//!
//! This process is the library's (host, trusted caller): nothing here parses guest bytes
//! beyond what the library already bounds.

mod bench;
mod callback;
mod doctor;
mod errors;
mod files;
mod fs;
mod images;
mod instance;
mod net;
mod observe;
mod pool;
mod process;
mod rootfs;
mod runtime;
mod sandbox;
mod snapshot;
mod tools;

use pyo3::prelude::*;

/// Makes this process find the helper, guest-init (and libkrunfw) in `dir` first, as a data
/// directory: the package's own, which it ships (not inherited by the programs it starts, as
/// an environment variable would be).
#[pyfunction]
fn _search_artifacts_first(dir: std::path::PathBuf) {
    krunbox::artifacts_search_first_in(dir);
}

#[pymodule]
fn _krunbox(module: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(module)?;
    module.add_class::<sandbox::Sandbox>()?;
    module.add_class::<instance::Instance>()?;
    module.add_class::<pool::Pool>()?;
    module.add_class::<snapshot::Snapshot>()?;
    module.add_class::<instance::Completed>()?;
    module.add_class::<process::Process>()?;
    module.add_class::<files::FileInfo>()?;
    module.add_class::<files::DirEntry>()?;
    module.add_class::<files::FileReader>()?;
    module.add_class::<files::FileWriter>()?;
    net::register(module)?;
    fs::register(module)?;
    module.add_class::<images::Images>()?;
    module.add_class::<images::Image>()?;
    module.add_class::<observe::NetworkEvents>()?;
    module.add_class::<rootfs::Rootfs>()?;
    module.add_class::<rootfs::DirectoryStore>()?;
    module.add_class::<rootfs::MemoryStore>()?;
    module.add_class::<tools::Toolbox>()?;
    module.add_class::<tools::ToolResult>()?;
    module.add_class::<tools::AuditEvents>()?;
    module.add_function(wrap_pyfunction!(tools::tool_definitions, module)?)?;
    module.add_function(wrap_pyfunction!(doctor::doctor, module)?)?;
    module.add_function(wrap_pyfunction!(_search_artifacts_first, module)?)?;
    module.add_function(wrap_pyfunction!(bench::rust_run_seconds, module)?)?;
    module.add("TIMEOUT_EXIT_CODE", krunbox::TIMEOUT_EXIT_CODE)?;
    module.add("MAX_OUTPUT", krunbox::DEFAULT_MAX_OUTPUT)?;
    module.add_function(wrap_pyfunction!(instance::command_args, module)?)?;
    Ok(())
}
