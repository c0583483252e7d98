//! The virtio pieces both of krunbox's host processes share: the library (which serves a
//! mount's queues itself once they are handed over) and the jailed `krunbox-vmm` helper (whose
//! devices serve a disk's queue). Nothing here links libkrun, and nothing here runs in the
//! guest; what the guest writes into its memory is read by this code as hostile.
//!
//! - [`queue`]: walking a hostile guest's virtqueue, bounded, and moving bytes between its
//!   memory and sockets or files.
//! - [`memory`]: where guest memory lies in the library's file.
//! - [`handover`]: the helper's message that hands a device's queues to the library.
//! - [`disk_wire`]: the requests the helper's disk device forwards to the library, and the
//!   replies.

pub mod disk_wire;
pub mod handover;
pub mod memory;
pub mod queue;
