//! Hostile bytes on the control channel: everything the guest can send the host (and the host
//! the guest) goes through this decoder. Run with `cargo +nightly fuzz run control_stream`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    krunbox_protocol::fuzz_control_stream(data);
});
