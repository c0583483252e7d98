//! A hostile guest's DNS over TCP: everything it sends on one connection to the resolver's port
//! 53 (any bytes, cut into writes by their own values), served as the network service serves
//! it (`src/net/dns_stream.rs`: length-prefixed messages, each read as a datagram is). Checks
//! that nothing panics, that the connection's service ends once the guest closes, and that what
//! it sent back is whole length-prefixed responses (`krunbox::fuzzing::dns_stream`). Run with
//! `cargo +nightly fuzz run dns_stream`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| krunbox::fuzzing::dns_stream(data));
