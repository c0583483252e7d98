//! A layer's bytes as a registry or an archive could hand them over: gzip, zstd (several
//! frames, skippable frames) or plain, decompressed and read to the end. Checks that nothing
//! panics (`krunbox::fuzzing::layer_stream`). Run with `cargo +nightly fuzz run layer_stream`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| krunbox::fuzzing::layer_stream(data));
