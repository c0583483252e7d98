//! The smallest possible guest init: power off at once. krunbox's boot benchmark uses it as
//! the "bare libkrun" baseline — same VMM, kernel and root image as a real boot, with none of
//! guest-init's work (mounts, vsock handshake, root switch, process supervision).

fn main() {
    guest_init::sys::power_off();
}
