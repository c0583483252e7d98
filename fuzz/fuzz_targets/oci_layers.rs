//! An image's layers as a registry or an archive could hand them over: tar streams (any bytes,
//! cut into up to four layers at `\n--layer--\n`) merged with whiteouts and opaque directories.
//! Checks that nothing panics and that a merge that succeeds writes a tar stream with no path
//! twice, no whiteout, nothing out of the tree, and no hard link to a path not written before it
//! (`krunbox::fuzzing::oci_layers`). Run with `cargo +nightly fuzz run oci_layers`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| krunbox::fuzzing::oci_layers(data));
