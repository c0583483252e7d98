//! The helper's own virtio devices, attached to libkrun's VM through our patch
//! (`krun_sys::device`): a mount's virtio-fs device, which hands its queues over to the library
//! (`fs.rs`), and a writable root's virtio-blk device, which serves its disk from a file in place
//! or forwards each request to the library (`blk/`).

pub(crate) mod blk;
pub(crate) mod fs;
