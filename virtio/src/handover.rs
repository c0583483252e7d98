//! The hand-over of an activated device's queues from the helper to the library.
//!
//! When the guest's driver activates a mount's device and the VM's memory is the library's
//! file (the library's `guest_memory.rs`), the helper sends one message on the mount's socket: where
//! guest memory lies in the file, each ring's size and addresses, and, as `SCM_RIGHTS`, each
//! queue's notification eventfd (which KVM signals when the guest notifies the queue) and the
//! device's interrupt eventfd (an irqfd: writing it interrupts the guest). From then on the
//! library serves the queues itself (its `fs/served/`) and the helper does nothing more
//! for the device.
//!
//! The message has a fixed size and layout, every field a little-endian `u64`: a magic
//! number, the features the driver acknowledged, the number of rings (2) and of memory regions
//! (at most [`MAX_REGIONS`]), then 2 rings of (size, descriptor table, available ring, used
//! ring) and [`MAX_REGIONS`] regions of (guest address, length, file offset), unused ones zero.
//! The library decodes it as a compromised helper could have written it.

use std::os::fd::{AsRawFd, RawFd};

pub use crate::memory::{MemoryRegion, MAX_REGIONS};
pub use crate::queue::RingLayout;

/// The first word of the message.
const MAGIC: u64 = u64::from_le_bytes(*b"KBQUEUES");

/// The rings a virtio-fs device of ours has: the high-priority one and one request queue.
pub const RINGS: usize = 2;

/// Descriptors in each ring. The guest's driver sizes its largest request by it (a page a
/// descriptor): 1024 leaves room for a 1 MiB write, the size the session negotiates.
pub const QUEUE_SIZE: u16 = 1024;

/// The fds that come with the message: each ring's notification, then the interrupt.
pub const FDS: usize = RINGS + 1;

/// The message's length in bytes.
pub const LEN: usize = 8 * (4 + 4 * RINGS + 3 * MAX_REGIONS);

/// What the helper tells the library about an activated device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandOver {
    /// The features the guest's driver acknowledged.
    pub features: u64,
    /// Where each ring lies.
    pub rings: [RingLayout; RINGS],
    /// Where guest memory lies in the file.
    pub regions: Vec<MemoryRegion>,
}

impl HandOver {
    /// The message's bytes. At most [`MAX_REGIONS`] regions (the helper checks).
    pub fn encode(&self) -> [u8; LEN] {
        let mut words = Vec::with_capacity(LEN / 8);
        words.extend([
            MAGIC,
            self.features,
            RINGS as u64,
            self.regions.len() as u64,
        ]);
        for ring in &self.rings {
            words.extend([
                u64::from(ring.size),
                ring.descriptors,
                ring.available,
                ring.used,
            ]);
        }
        for index in 0..MAX_REGIONS {
            let region = self.regions.get(index).copied().unwrap_or(MemoryRegion {
                guest_address: 0,
                len: 0,
                file_offset: 0,
            });
            words.extend([region.guest_address, region.len, region.file_offset]);
        }
        let mut bytes = [0u8; LEN];
        for (chunk, word) in bytes.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&word.to_le_bytes());
        }
        bytes
    }

    /// Reads a message, refusing one of another magic, ring count, region count or ring size
    /// (a power of two, at most `max_ring_size`). Whether the rings and regions make sense
    /// for the memory is for the caller, which maps it.
    pub fn decode(bytes: &[u8; LEN], max_ring_size: u16) -> Result<HandOver, String> {
        let mut words = bytes
            .chunks_exact(8)
            .map(|chunk| u64::from_le_bytes(chunk.try_into().expect("eight bytes")));
        let mut next = || words.next().expect("the message's length holds every word");
        if next() != MAGIC {
            return Err("not a queue hand-over".into());
        }
        let features = next();
        let rings = next();
        if rings != RINGS as u64 {
            return Err(format!("{rings} rings (a filesystem device has {RINGS})"));
        }
        let region_count = next();
        if region_count == 0 || region_count > MAX_REGIONS as u64 {
            return Err(format!(
                "{region_count} regions of guest memory (1 to {MAX_REGIONS})"
            ));
        }
        let mut layouts = [RingLayout::default(); RINGS];
        for layout in &mut layouts {
            let size = next();
            if size == 0 || !size.is_power_of_two() || size > u64::from(max_ring_size) {
                return Err(format!(
                    "a ring of {size} entries (a power of two up to {max_ring_size})"
                ));
            }
            *layout = RingLayout {
                size: size as u16,
                descriptors: next(),
                available: next(),
                used: next(),
            };
        }
        let mut regions = Vec::with_capacity(region_count as usize);
        for index in 0..MAX_REGIONS {
            let region = MemoryRegion {
                guest_address: next(),
                len: next(),
                file_offset: next(),
            };
            if (index as u64) < region_count {
                regions.push(region);
            }
        }
        Ok(HandOver {
            features,
            rings: layouts,
            regions,
        })
    }
}

/// Sends `hand_over` on `socket` with the rings' notification eventfds and the interrupt
/// eventfd (the helper's side).
pub fn send(
    socket: &std::os::unix::net::UnixStream,
    hand_over: &HandOver,
    notifications: [RawFd; RINGS],
    interrupt: RawFd,
) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let bytes = hand_over.encode();
    let fds = [notifications[0], notifications[1], interrupt];
    let control = [ControlMessage::ScmRights(&fds)];
    let mut sent = sendmsg::<()>(
        socket.as_raw_fd(),
        &[std::io::IoSlice::new(&bytes)],
        &control,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    // The fds went with the first byte; the rest, if the socket took less, follows alone.
    while sent < LEN {
        sent += nix::sys::socket::send(socket.as_raw_fd(), &bytes[sent..], MsgFlags::MSG_NOSIGNAL)?;
    }
    Ok(())
}

/// A hand-over of two rings and two regions, for tests on either side of it.
#[cfg(any(test, feature = "fixtures"))]
pub fn sample() -> HandOver {
    HandOver {
        features: 1 << 32,
        rings: [
            RingLayout {
                size: 1024,
                descriptors: 0x1000,
                available: 0x5000,
                used: 0x6000,
            },
            RingLayout {
                size: 256,
                descriptors: 0x10000,
                available: 0x11000,
                used: 0x12000,
            },
        ],
        regions: vec![
            MemoryRegion {
                guest_address: 0,
                len: 1 << 24,
                file_offset: 0,
            },
            MemoryRegion {
                guest_address: 1 << 24,
                len: 1 << 20,
                file_offset: 1 << 24,
            },
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hand_over_reads_back_as_written() {
        let hand_over = sample();
        assert_eq!(HandOver::decode(&hand_over.encode(), 1024), Ok(hand_over));
    }

    #[test]
    fn a_hand_over_of_other_magic_rings_regions_or_sizes_is_refused() {
        let good = sample().encode();
        let word = |index: usize, value: u64| {
            let mut bytes = good;
            bytes[index * 8..index * 8 + 8].copy_from_slice(&value.to_le_bytes());
            bytes
        };
        for (bytes, what) in [
            (word(0, 7), "magic"),
            (word(2, 3), "ring count"),
            (word(3, 0), "no region"),
            (word(3, MAX_REGIONS as u64 + 1), "region count"),
            (word(4, 0), "empty ring"),
            (word(4, 1000), "ring of no power of two"),
            (word(8, 2048), "ring larger than the device's"),
        ] {
            assert!(HandOver::decode(&bytes, 1024).is_err(), "{what} accepted");
        }
    }
}
