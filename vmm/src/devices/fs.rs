//! A mount's virtio-fs device in the helper, whose queues the library serves.
//!
//! The guest kernel's virtio-fs driver puts each FUSE request on a virtqueue: the request's
//! bytes in the descriptors it reads from, room for the reply in those it writes to. This
//! device, one per mount, runs in the `krunbox-vmm` helper (attached through
//! [`krun_sys::device`]) and serves no filesystem, and no request, itself.
//!
//! Every VM with mounts is built in the library's memory file (the library's `guest_memory.rs`): the
//! device keeps only the transport (configuration, features, the rings' set-up) and, when the
//! guest's driver activates it, hands the queues over ([`handover`]): the rings' addresses,
//! the queues' notification eventfds and the interrupt eventfd go to the library on the
//! mount's socket, and the library serves the queues itself (its `fs/served/`), with no
//! thread here and no hop per request. A ring that does not lie wholly in guest memory, or a
//! guest memory the library's file does not hold, leaves the device inert.

use std::os::unix::net::UnixStream;

use krun_sys::device::{
    ActivateResult, DeviceQueue, InterruptTransport, QueueConfig, VirtioDevice, VIRTIO_F_VERSION_1,
};
use vm_memory::GuestMemoryMmap;

use krunbox_virtio::handover::{self, QUEUE_SIZE};
use krunbox_virtio::queue as virtqueue;

/// virtio's device type for a filesystem (`VIRTIO_ID_FS`).
const VIRTIO_ID_FS: u32 = 26;

/// The high-priority queue (`FORGET`s) and one request queue.
const QUEUES: [QueueConfig; 2] = [QueueConfig::new(QUEUE_SIZE), QueueConfig::new(QUEUE_SIZE)];

/// One mount's device. Built in the helper before the VM, activated by the guest's driver.
pub(crate) struct HandOverFs {
    /// `tag[36]` then `num_request_queues: u32`, as the virtio-fs configuration space lays
    /// them out.
    config: [u8; 40],
    acked_features: u64,
    /// The mount's socket, until activation hands the queues over on it.
    socket: Option<UnixStream>,
    tag: String,
    activated: bool,
    /// After a hand-over, the mount's socket, kept open while the helper lives: the library
    /// sees the device gone when it closes.
    handed_over: Option<UnixStream>,
}

impl HandOverFs {
    /// A device named `tag` that hands its queues over to the library on `socket` when the
    /// guest's driver activates it. The VM's memory must be the library's file.
    pub(crate) fn new(tag: &str, socket: UnixStream) -> Self {
        let mut config = [0u8; 40];
        let name = tag.as_bytes();
        config[..name.len().min(36)].copy_from_slice(&name[..name.len().min(36)]);
        config[36..40].copy_from_slice(&1u32.to_le_bytes());
        HandOverFs {
            config,
            acked_features: 0,
            socket: Some(socket),
            tag: tag.to_owned(),
            activated: false,
            handed_over: None,
        }
    }

    /// Tells the library where the activated queues and guest memory lie, with the eventfds
    /// to serve them by ([`handover`]); nothing of the device runs here after.
    fn hand_over(
        &mut self,
        socket: UnixStream,
        mem: &GuestMemoryMmap,
        interrupt: &InterruptTransport,
        queues: &[DeviceQueue],
    ) -> ActivateResult {
        use std::os::fd::AsRawFd;
        use vm_memory::{GuestMemory, GuestMemoryRegion};
        let mut regions = Vec::new();
        for region in mem.iter() {
            let Some(offset) = region.file_offset() else {
                return self.inert("guest memory that is not in the library's file");
            };
            regions.push(krunbox_virtio::memory::MemoryRegion {
                guest_address: region.start_addr().0,
                len: region.len(),
                file_offset: offset.start(),
            });
        }
        if regions.len() > krunbox_virtio::memory::MAX_REGIONS {
            return self.inert("guest memory in too many regions to hand over");
        }
        let layout = |queue: &DeviceQueue| crate::queue::ring_layout(&queue.queue);
        let message = handover::HandOver {
            features: self.acked_features,
            rings: [layout(&queues[0]), layout(&queues[1])],
            regions,
        };
        let notifications = [queues[0].event.as_raw_fd(), queues[1].event.as_raw_fd()];
        if let Err(err) = handover::send(
            &socket,
            &message,
            notifications,
            interrupt.event().as_raw_fd(),
        ) {
            return self.inert(&format!("its queues could not be handed over: {err}"));
        }
        self.handed_over = Some(socket);
        self.activated = true;
        Ok(())
    }

    /// Leaves the device activated but serving nothing (its mount's calls in the guest then
    /// wait forever): for a guest that broke the device's setup. Never an error to libkrun,
    /// whose transport panics on a failed activation.
    fn inert(&mut self, why: &str) -> ActivateResult {
        eprintln!("krunbox-vmm: device {}: {why}; it serves nothing", self.tag);
        self.socket = None;
        self.activated = true;
        Ok(())
    }
}

impl VirtioDevice for HandOverFs {
    fn avail_features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
    }

    fn acked_features(&self) -> u64 {
        self.acked_features
    }

    fn set_acked_features(&mut self, acked_features: u64) {
        self.acked_features = acked_features & self.avail_features();
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_FS
    }

    fn device_name(&self) -> &str {
        "krunbox-fs"
    }

    fn queue_config(&self) -> &[QueueConfig] {
        &QUEUES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        virtqueue::read_config_space(&self.config, offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // The configuration space is read-only; a guest writing it changes nothing.
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: InterruptTransport,
        queues: Vec<DeviceQueue>,
    ) -> ActivateResult {
        // Activated once: the socket carries the hand-over. (A reset is refused: `reset` is
        // not implemented, so libkrun marks the device failed and never activates it again.)
        let Some(socket) = self.socket.take() else {
            return self.inert("activated twice");
        };
        if queues.len() != QUEUES.len() {
            return self.inert("activated with the wrong number of queues");
        }
        // libkrun's transport does not check the rings the guest set up. Rings outside guest
        // memory, or of a bad size, leave the device inert (the library checks them again).
        let in_memory = |q: &DeviceQueue| {
            virtqueue::queue(crate::queue::ring_layout(&q.queue), QUEUE_SIZE, &mem).is_some()
        };
        if !queues.iter().all(in_memory) {
            return self.inert("a queue outside guest memory or of a bad size");
        }
        self.hand_over(socket, &mem, &interrupt, &queues)
    }

    fn is_activated(&self) -> bool {
        self.activated
    }
}
