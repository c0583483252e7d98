//! Virtio devices of the embedding program's own, in libkrun's device model.
//!
//! libkrun 1.19.7 builds every device itself from paths and flags; it has no way to let an
//! embedder serve a device. krunbox builds libkrun's `krun-vmm` with one small patch
//! (`krun-sys/hook/krun-vmm.patch`, applied by `scripts/libkrun-hook.sh`): a list of
//! devices that `krun_start_enter` attaches, as virtio-mmio devices after its own, when it builds
//! the VM. [`attach`] adds to that list; the types a device needs are re-exported here, so
//! that this crate stays krunbox's one boundary to libkrun.
//!
//! ```no_run
//! use std::sync::{Arc, Mutex};
//! # fn my_device() -> Arc<Mutex<dyn krun_sys::device::VirtioDevice>> { unimplemented!() }
//! krun_sys::device::attach("my-device", my_device());
//! // ... then Context::start_enter() builds the VM with it.
//! ```

use std::sync::{Arc, Mutex};

pub use krun_devices::virtio::{
    ActivateError, ActivateResult, Descriptor, DescriptorChain, DeviceQueue, InterruptTransport,
    Queue, QueueConfig, VirtioDevice,
};
pub use krun_utils::eventfd::EventFd;
pub use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemory, GuestMemoryError, GuestMemoryMmap,
    GuestMemoryRegion,
};

/// The virtio feature bit every modern device offers (`VIRTIO_F_VERSION_1`).
pub const VIRTIO_F_VERSION_1: u32 = 32;

/// Adds `device` to the devices the next VM this process starts gets, named `id` in libkrun's
/// device manager (ids must differ from each other and from libkrun's own, e.g. `"kbfs0"`).
pub fn attach(id: &str, device: Arc<Mutex<dyn VirtioDevice>>) {
    push(id, device, false);
}

/// [`attach`] for a device whose queues another process serves (in guest memory from
/// [`use_guest_memory_file`], told of the rings, the queues' notification eventfds and the
/// interrupt eventfd when the device activates). That process cannot set the transport's
/// interrupt status, so the transport reports a used buffer at every read of it: the guest's
/// driver then checks its rings on every interrupt of the device.
pub fn attach_served_elsewhere(id: &str, device: Arc<Mutex<dyn VirtioDevice>>) {
    push(id, device, true);
}

fn push(id: &str, device: Arc<Mutex<dyn VirtioDevice>>, served_elsewhere: bool) {
    krun_vmm::builder::EMBEDDER_DEVICES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .push((id.to_owned(), device, served_elsewhere));
}

/// Puts the next VM's guest memory in `file` instead of anonymous memory: every region of
/// guest memory, the kernel's range included (libkrunfw's kernel is copied there rather than
/// mapped), one after another at page-aligned offsets from 0, mapped shared. Another process
/// that maps the same file sees guest memory as the guest does. With `private`, mapped
/// copy-on-write instead: the guest starts from the file's contents, which it never changes
/// (the file may be read-only; a restore maps a snapshot's memory so). The file is not grown:
/// the VM fails to build, saying how many bytes it needs, when it is too small.
///
/// ```no_run
/// # fn memfd() -> std::fs::File { unimplemented!() }
/// krun_sys::device::use_guest_memory_file(memfd(), false);
/// // ... then Context::start_enter() builds the VM in it.
/// ```
pub fn use_guest_memory_file(file: std::fs::File, private: bool) {
    *krun_vmm::builder::EMBEDDER_GUEST_MEMORY
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some((file, private));
}
