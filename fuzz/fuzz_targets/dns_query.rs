//! A hostile guest's DNS: one datagram to the gateway's resolver (any bytes), read as the
//! service reads it (`src/net/dns.rs`, hickory-proto), and a query answered every way the
//! service answers one. Checks that nothing panics and that every answer fits a UDP answer and
//! parses back as a response to that query, an `A` answer holding exactly the one address given
//! (`krunbox::fuzzing::dns_query`). Run with `cargo +nightly fuzz run dns_query`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| krunbox::fuzzing::dns_query(data));
