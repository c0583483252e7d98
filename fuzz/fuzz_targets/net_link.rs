//! A hostile guest's network link: the bytes libkrun's virtio-net device writes to the library
//! (length-prefixed Ethernet frames the guest controls entirely), through the frame decoder and
//! the gateway (smoltcp behind the default-deny gate, the DNS refusal). Checks that nothing
//! panics and that what the gateway sends back stays bounded and well-formed
//! (`krunbox::fuzzing::net_link`). Run with `cargo +nightly fuzz run net_link`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| krunbox::fuzzing::net_link(data));
