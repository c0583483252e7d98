//! A hostile guest's virtqueue on a mount's virtio-fs device in the helper: any descriptor
//! table, available ring and guest memory, served by the device's own code over a socket pair
//! to a library that answers every request (`krunbox::fuzzing::virtio_fs_queue`). Run with
//! `cargo +nightly fuzz run virtio_fs_queue`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| krunbox::fuzzing::virtio_fs_queue(data));
