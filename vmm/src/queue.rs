//! libkrun's activated queues, as the helper's devices serve them: rust-vmm queues built from
//! the rings' addresses (`krunbox_virtio::queue`), so that the queue code the helper and the library
//! share never touches libkrun's types.

/// Where libkrun's view of a queue the guest's driver activated says its rings lie (0 entries
/// for one it never made ready). The helper's devices serve rust-vmm queues built from it
/// (`virtqueue::queue`, which checks it), as the library does with a handed-over one.
pub(crate) fn ring_layout(queue: &krun_sys::device::Queue) -> krunbox_virtio::queue::RingLayout {
    krunbox_virtio::queue::RingLayout {
        size: if queue.ready { queue.size } else { 0 },
        descriptors: queue.desc_table.0,
        available: queue.avail_ring.0,
        used: queue.used_ring.0,
    }
}
