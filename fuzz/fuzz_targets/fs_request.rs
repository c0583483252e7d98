//! A hostile guest's bytes on a mount's connection: FUSE requests (any bytes), framed, decoded
//! and answered as the library answers them, by a session over a small MemoryFs. Checks that
//! nothing panics and that every reply is one well-formed FUSE reply to its request
//! (`krunbox::fuzzing::fs_request`). Run with `cargo +nightly fuzz run fs_request`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| krunbox::fuzzing::fs_request(data));
