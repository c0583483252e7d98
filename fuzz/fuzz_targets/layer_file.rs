//! A persistent root's layer file as a compromised VMM helper could leave it: its record read
//! back through imago, as the library does at the next boot. Checks that nothing panics, no
//! other file is opened (a backing file is refused), and the result is a 64-hex digest or a
//! typed error (`krunbox::fuzzing::layer_file`). Run with `cargo +nightly fuzz run layer_file`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| krunbox::fuzzing::layer_file(data));
