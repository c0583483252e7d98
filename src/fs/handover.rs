//! The hand-over of an activated device's queues from the helper to the library.
//!
//! When the guest's driver activates a mount's device and the VM's memory is the library's
//! file (`crate::guest_memory`), the helper sends one message on the mount's socket: where
//! guest memory lies in the file, each ring's size and addresses, and, as `SCM_RIGHTS`, each
//! queue's notification eventfd (which KVM signals when the guest notifies the queue) and the
//! device's interrupt eventfd (an irqfd: writing it interrupts the guest). From then on the
//! library serves the queues itself ([`crate::fs::served`]) and the helper does nothing more
//! for the device.
//!
//! The message has a fixed size and layout, every field a little-endian `u64`: a magic
//! number, the features the driver acknowledged, the number of rings (2) and of memory regions
//! (at most [`MAX_REGIONS`]), then 2 rings of (size, descriptor table, available ring, used
//! ring) and [`MAX_REGIONS`] regions of (guest address, length, file offset), unused ones zero.
//! The library decodes it as a compromised helper could have written it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::guest_memory::{MemoryRegion, MAX_REGIONS};
pub(crate) use crate::virtqueue::RingLayout;

/// The first word of the message.
const MAGIC: u64 = u64::from_le_bytes(*b"KBQUEUES");

/// The rings a virtio-fs device of ours has: the high-priority one and one request queue.
pub(crate) const RINGS: usize = 2;

/// Descriptors in each ring. The guest's driver sizes its largest request by it (a page a
/// descriptor): 1024 leaves room for a 1 MiB write, the size the session negotiates.
pub(crate) const QUEUE_SIZE: u16 = 1024;

/// The fds that come with the message: each ring's notification, then the interrupt.
pub(crate) const FDS: usize = RINGS + 1;

/// The most fds one `SCM_RIGHTS` message carries (Linux's `SCM_MAX_FD`).
const SCM_MAX_FD: usize = 253;

/// The message's length in bytes.
pub(crate) const LEN: usize = 8 * (4 + 4 * RINGS + 3 * MAX_REGIONS);

/// What the helper tells the library about an activated device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HandOver {
    pub features: u64,
    pub rings: [RingLayout; RINGS],
    pub regions: Vec<MemoryRegion>,
}

/// Queues and memory the helper handed over, with the eventfds.
#[derive(Debug)]
pub(crate) struct Received {
    pub hand_over: HandOver,
    /// Each ring's notification eventfd.
    pub notifications: [OwnedFd; RINGS],
    /// The device's interrupt eventfd.
    pub interrupt: OwnedFd,
}

impl HandOver {
    /// The message's bytes. At most [`MAX_REGIONS`] regions (the helper checks).
    pub(crate) fn encode(&self) -> [u8; LEN] {
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
    pub(crate) fn decode(bytes: &[u8; LEN], max_ring_size: u16) -> Result<HandOver, String> {
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
pub(crate) fn send(
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

/// Receives a hand-over from the helper on `socket` (the library's side): the message and
/// exactly [`FDS`] fds, or an error saying what was wrong. `Ok(None)` when the helper closed the
/// socket first.
pub(crate) async fn receive(
    socket: &tokio::net::UnixStream,
    max_ring_size: u16,
) -> std::io::Result<Option<Received>> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let invalid = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let mut bytes = [0u8; LEN];
    let mut filled = 0;
    let mut fds: Vec<OwnedFd> = Vec::new();
    while filled < LEN {
        socket.readable().await?;
        let got = socket.try_io(tokio::io::Interest::READABLE, || {
            // Room for as many fds as one message can carry (`SCM_MAX_FD`), so the kernel
            // never truncates the control data: fds it installed for a truncated message
            // could not be closed.
            let mut space = nix::cmsg_space!([RawFd; SCM_MAX_FD]);
            let mut iov = [std::io::IoSliceMut::new(&mut bytes[filled..])];
            let message = recvmsg::<()>(
                socket.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
            )?;
            let truncated = message.flags.contains(MsgFlags::MSG_CTRUNC);
            let mut received = Vec::new();
            for control in message.cmsgs().map_err(std::io::Error::from)? {
                if let ControlMessageOwned::ScmRights(raw) = control {
                    // SAFETY: the kernel just installed these fds in this process for us;
                    // nothing else owns them.
                    received.extend(
                        raw.into_iter()
                            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                    );
                }
            }
            Ok((message.bytes, truncated, received))
        });
        let (count, truncated, received) = match got {
            Ok(got) => got,
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(err) => return Err(err),
        };
        fds.extend(received);
        // Counted as they come: a helper sending a byte at a time with fds each would
        // otherwise fill this process's descriptor table before the message ends.
        if truncated || fds.len() > FDS {
            return Err(invalid(
                "the helper sent more fds than a hand-over has".into(),
            ));
        }
        if count == 0 {
            return if filled == 0 {
                Ok(None)
            } else {
                Err(invalid(
                    "the helper closed the socket within a hand-over".into(),
                ))
            };
        }
        filled += count;
    }
    if fds.len() != FDS {
        return Err(invalid(format!(
            "a hand-over with {} fds ({FDS} expected)",
            fds.len()
        )));
    }
    for fd in &fds {
        if !is_eventfd(fd) {
            return Err(invalid(
                "a hand-over with an fd that is not an eventfd".into(),
            ));
        }
    }
    let hand_over = HandOver::decode(&bytes, max_ring_size).map_err(invalid)?;
    let mut fds = fds.into_iter();
    let mut take = || fds.next().expect("counted");
    Ok(Some(Received {
        hand_over,
        notifications: [take(), take()],
        interrupt: take(),
    }))
}

/// Whether `fd` is an eventfd (the kernel names its file `anon_inode:[eventfd]`).
fn is_eventfd(fd: &OwnedFd) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|target| target.as_os_str() == "anon_inode:[eventfd]")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> HandOver {
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

    #[tokio::test]
    async fn a_hand_over_arrives_with_its_eventfds_and_nothing_else_is_taken_for_one() {
        let (helper, library) = std::os::unix::net::UnixStream::pair().unwrap();
        library.set_nonblocking(true).unwrap();
        let library = tokio::net::UnixStream::from_std(library).unwrap();
        let events: Vec<OwnedFd> = (0..3)
            .map(|_| OwnedFd::from(nix::sys::eventfd::EventFd::new().unwrap()))
            .collect();
        let raw: Vec<RawFd> = events.iter().map(|fd| fd.as_raw_fd()).collect();
        send(&helper, &sample(), [raw[0], raw[1]], raw[2]).unwrap();
        let received = receive(&library, 1024).await.unwrap().unwrap();
        assert_eq!(received.hand_over, sample());
        // The interrupt fd is the same eventfd: what is written to ours is read from theirs.
        nix::unistd::write(&received.interrupt, &1u64.to_ne_bytes()).unwrap();
        let mut count = [0u8; 8];
        nix::unistd::read(&events[2], &mut count).unwrap();
        assert_eq!(u64::from_ne_bytes(count), 1);

        // A socket instead of an eventfd is refused.
        let (helper, library) = std::os::unix::net::UnixStream::pair().unwrap();
        library.set_nonblocking(true).unwrap();
        let library = tokio::net::UnixStream::from_std(library).unwrap();
        let stranger = std::os::unix::net::UnixStream::pair().unwrap().0;
        send(&helper, &sample(), [raw[0], stranger.as_raw_fd()], raw[2]).unwrap();
        assert!(receive(&library, 1024).await.is_err());

        // A helper that sends fds with every byte is stopped at the fourth fd.
        let (helper, library) = std::os::unix::net::UnixStream::pair().unwrap();
        library.set_nonblocking(true).unwrap();
        let library = tokio::net::UnixStream::from_std(library).unwrap();
        for _ in 0..2 {
            let control = [nix::sys::socket::ControlMessage::ScmRights(&raw)];
            nix::sys::socket::sendmsg::<()>(
                helper.as_raw_fd(),
                &[std::io::IoSlice::new(&sample().encode()[..1])],
                &control,
                nix::sys::socket::MsgFlags::empty(),
                None,
            )
            .unwrap();
        }
        let err = receive(&library, 1024).await.unwrap_err();
        assert!(err.to_string().contains("more fds"), "{err}");

        // A helper that closes first sends nothing.
        let (helper, library) = std::os::unix::net::UnixStream::pair().unwrap();
        library.set_nonblocking(true).unwrap();
        let library = tokio::net::UnixStream::from_std(library).unwrap();
        drop(helper);
        assert!(receive(&library, 1024).await.unwrap().is_none());
    }
}
