//! A guest init that exits at once, for krunbox's tests: PID 1 ending makes the guest kernel
//! panic ("Attempted to kill init!"), which with libkrun's `panic=-1` stops the VM. It is how a
//! real guest kernel panic looks from the host.

fn main() {
    println!("panic-init: exiting as PID 1");
    std::process::exit(1);
}
