//! A copy-on-write root's block I/O as a hostile guest drives it: writes and reads at any
//! offset and length, syncs, and a store that fails when the input says so, against a model
//! disk. Checks that nothing panics, what the layer holds stays within its bound, reads return what
//! was written, and nothing written is lost once the store works again
//! (`krunbox::fuzzing::layer_block`). Run with `cargo +nightly fuzz run layer_block`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| krunbox::fuzzing::layer_block(data));
