//! A hostile guest's virtqueue on a copy-on-write root's virtio-blk device in the helper: any
//! descriptor table, available ring, guest memory and disk size, served by the device's own
//! code over a socket pair to the library's real service over a real layer
//! (`krunbox_vmm::fuzzing::virtio_blk_queue`). Run with `cargo +nightly fuzz run virtio_blk_queue`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| krunbox_vmm::fuzzing::virtio_blk_queue(data));
