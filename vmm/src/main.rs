//! The VMM helper: one process per running microVM, started by the krunbox library.
//!
//! libkrun's `krun_start_enter` takes over the process that calls it, so it runs here rather
//! than in the library's process. Everything of it is in this crate's library
//! (`krunbox_vmm::helper_main`).

fn main() {
    std::process::exit(krunbox_vmm::helper_main());
}
