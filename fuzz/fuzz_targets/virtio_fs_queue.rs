//! A hostile guest's virtqueue on a mount's virtio-fs device, handed over to the library: any
//! descriptor table, available ring and guest memory, served by the library's own code in a
//! real session (`krunbox::fuzzing::virtio_fs_queue`). Run with
//! `cargo +nightly fuzz run virtio_fs_queue`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| krunbox::fuzzing::virtio_fs_queue(data));
