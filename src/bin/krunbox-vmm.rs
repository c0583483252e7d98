//! The VMM helper: one process per running microVM, started by the krunbox library.
//!
//! libkrun's `krun_start_enter` takes over the process that calls it, so it runs here rather
//! than in the library's process. See `krunbox::vmm`.

fn main() {
    std::process::exit(krunbox::vmm::helper_main());
}
