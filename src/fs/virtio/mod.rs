//! The transport in the helper: a virtio-fs device whose requests the library answers.
//!
//! The guest kernel's virtio-fs driver puts each FUSE request on a virtqueue: the request's
//! bytes in the descriptors it reads from, room for the reply in those it writes to. This
//! device, one per mount, runs in the `krunbox-vmm` helper (attached through
//! [`krun_sys::device`]) and serves no filesystem itself.
//!
//! Every VM with mounts is built in the library's memory file (`crate::guest_memory`): the
//! device then only keeps the transport (configuration, features, the rings' set-up) and,
//! when the guest's driver activates it, hands the queues over ([`handover`]): the rings'
//! addresses, the queues' notification eventfds and the interrupt eventfd go to the library
//! on the mount's socket, and the library serves the queues itself (`crate::fs::served`), with
//! no thread here and no hop per request. A ring that does not lie wholly in guest memory
//! leaves the device inert.
//!
//! Without that file (the device's unit tests and the `virtio_fs_queue` fuzz target, which
//! drive both ways) the device forwards: it copies each request's bytes to the mount's
//! socket, unparsed beyond the FUSE header's length, opcode and `unique`, and writes each
//! reply the library sends back into the guest's descriptors of the request with that
//! `unique`. Requests go on while earlier ones wait, so the library answers many at once and
//! in any order ([`super::service`]). Everything of the guest is bounded there: a request's
//! readable bytes (at most [`MAX_REQUEST`]) and its chain (libkrun's queue walks at most the
//! queue's size of descriptors; at most [`MAX_REPLY_DESCRIPTORS`] of them writable), the
//! requests waiting for a reply (at most [`QUEUE_SIZE`]), and a `unique` reused while in
//! flight is answered with nothing rather than replacing the first. A malformed request is
//! completed with no reply; the guest's own filesystem call fails, nothing else does. Two
//! threads per device: one pops both queues and forwards (blocking on the socket when the
//! library is busy, which holds the guest back), one reads replies and completes requests.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use krun_sys::device::{
    ActivateResult, DeviceQueue, EventFd, InterruptTransport, QueueConfig, VirtioDevice,
    VIRTIO_F_VERSION_1,
};
use virtio_queue::Queue;
use vm_memory::{GuestAddress, GuestMemoryMmap};

#[cfg(test)]
use crate::virtqueue::for_each_piece;
use crate::virtqueue::{
    self, complete, gather, receive_into_guest, scatter, send_from_guest, serve_notifications,
    ChainLimits, Drained, Popped,
};

use super::fuse::{is_unanswered, IN_HEADER_LEN, MAX_REQUEST};

pub(crate) mod fuzz;
pub(crate) mod handover;

/// virtio's device type for a filesystem (`VIRTIO_ID_FS`).
const VIRTIO_ID_FS: u32 = 26;

/// Descriptors in each queue. The guest's driver sizes its largest request by it (a page a
/// descriptor): 1024 leaves room for a 1 MiB write, the size the session negotiates.
pub(crate) const QUEUE_SIZE: u16 = 1024;

/// The high-priority queue (`FORGET`s) and one request queue.
const QUEUES: [QueueConfig; 2] = [QueueConfig::new(QUEUE_SIZE), QueueConfig::new(QUEUE_SIZE)];

/// The largest reply the library sends (a 1 MiB read and its header, with room to spare).
const MAX_REPLY: usize = MAX_REQUEST;

/// The most descriptors a request's reply may be spread over: a 1 MiB read is 256 pages and a
/// header. More is no request of the guest's driver, and each is remembered until the reply.
const MAX_REPLY_DESCRIPTORS: usize = 300;

/// A FUSE reply header: `len: u32, error: i32, unique: u64`.
const OUT_HEADER_LEN: usize = 16;

/// `FUSE_FORGET`, which gets no reply (nor do `BATCH_FORGET` and `INTERRUPT`: see
/// [`is_unanswered`]): such requests are completed as soon as they are forwarded.
#[cfg(test)]
const FUSE_FORGET: u32 = 2;

/// One mount's device. Built in the helper before the VM, activated by the guest's driver.
pub(crate) struct ForwardingFs {
    /// `tag[36]` then `num_request_queues: u32`, as the virtio-fs configuration space lays
    /// them out.
    config: [u8; 40],
    acked_features: u64,
    /// The mount's socket, twice (one for each thread), until activation hands them over.
    sockets: Option<(UnixStream, UnixStream)>,
    tag: String,
    activated: bool,
    /// Hand the queues over to the library at activation ([`handover`]) rather than
    /// forward each request: the VM's memory is the library's file.
    hand_over: bool,
    /// After a hand-over, the mount's socket, kept open while the helper lives: the library
    /// sees the device gone when it closes.
    handed_over: Option<UnixStream>,
}

impl ForwardingFs {
    /// A device named `tag` whose requests go to, and replies come from, `socket`; or, when
    /// `hand_over`, that hands its queues over to the library on `socket` at activation (the
    /// VM's memory must then be the library's file).
    pub(crate) fn new(tag: &str, socket: UnixStream, hand_over: bool) -> std::io::Result<Self> {
        let mut config = [0u8; 40];
        let name = tag.as_bytes();
        config[..name.len().min(36)].copy_from_slice(&name[..name.len().min(36)]);
        config[36..40].copy_from_slice(&1u32.to_le_bytes());
        // Cloned now, not when the guest activates the device: by then the guest could have
        // used up the helper's descriptors.
        let replies = socket.try_clone()?;
        Ok(ForwardingFs {
            config,
            acked_features: 0,
            sockets: Some((socket, replies)),
            tag: tag.to_owned(),
            activated: false,
            hand_over,
            handed_over: None,
        })
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
            regions.push(crate::guest_memory::MemoryRegion {
                guest_address: region.start_addr().0,
                len: region.len(),
                file_offset: offset.start(),
            });
        }
        if regions.len() > crate::guest_memory::MAX_REGIONS {
            return self.inert("guest memory in too many regions to hand over");
        }
        let layout = |queue: &DeviceQueue| crate::vmm::queue::ring_layout(&queue.queue);
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
        self.sockets = None;
        self.activated = true;
        Ok(())
    }
}

impl VirtioDevice for ForwardingFs {
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
        // Activated once: the sockets go to the threads. (A reset is refused: `reset` is not
        // implemented, so libkrun marks the device failed and never activates it again.)
        let Some((socket, replies)) = self.sockets.take() else {
            return self.inert("activated twice");
        };
        if queues.len() != QUEUES.len() {
            return self.inert("activated with the wrong number of queues");
        }
        // libkrun's transport does not check the rings the guest set up. Rings outside guest
        // memory, or of a bad size, leave the device inert.
        let Some(served) = queues
            .iter()
            .map(|q| virtqueue::queue(crate::vmm::queue::ring_layout(&q.queue), QUEUE_SIZE, &mem))
            .collect::<Option<Vec<Queue>>>()
        else {
            return self.inert("a queue outside guest memory or of a bad size");
        };
        if self.hand_over {
            return self.hand_over(socket, &mem, &interrupt, &queues);
        }
        let events: Vec<Arc<EventFd>> = queues.into_iter().map(|queue| queue.event).collect();
        let rings: Vec<Arc<Mutex<Queue>>> = served
            .into_iter()
            .map(|queue| Arc::new(Mutex::new(queue)))
            .collect();
        let shared = Arc::new(Shared::new(mem, move || interrupt.signal_used_queue()));
        let forwarding = shared.clone();
        let tag = self.tag.clone();
        let spawned = std::thread::Builder::new()
            .name("krunbox-fs-reply".into())
            .spawn(move || complete_replies(&shared, replies))
            .and_then(|_| {
                std::thread::Builder::new()
                    .name("krunbox-fs-req".into())
                    .spawn(move || forward_requests(&forwarding, &rings, &events, socket, &tag))
            });
        if spawned.is_err() {
            return self.inert("its threads could not start");
        }
        self.activated = true;
        Ok(())
    }

    fn is_activated(&self) -> bool {
        self.activated
    }
}

/// What the two threads share.
struct Shared {
    mem: GuestMemoryMmap,
    /// Interrupts the guest: some request is complete.
    signal: Box<dyn Fn() + Send + Sync>,
    /// Requests waiting for their reply, by `unique`.
    pending: Mutex<HashMap<u64, Pending>>,
}

impl Shared {
    fn new(mem: GuestMemoryMmap, signal: impl Fn() + Send + Sync + 'static) -> Self {
        Shared {
            mem,
            signal: Box::new(signal),
            pending: Mutex::new(HashMap::new()),
        }
    }
}

/// A forwarded request: its queue, its chain's head and where its reply goes.
struct Pending {
    ring: Arc<Mutex<Queue>>,
    head: u16,
    reply_to: Vec<(GuestAddress, u32)>,
}

/// Messages up to this size are copied whole through a buffer of ours (one system call each
/// way); larger ones (reads and writes of file data) move between the socket and guest memory
/// directly, without that copy.
const SMALL_MESSAGE: usize = 64 * 1024;

/// The bounds of a request chain: a request's bytes within [`MAX_REQUEST`], its reply's room in
/// at most [`MAX_REPLY_DESCRIPTORS`] descriptors.
pub(crate) const LIMITS: ChainLimits = ChainLimits {
    max_readable: MAX_REQUEST,
    max_writable_descriptors: MAX_REPLY_DESCRIPTORS,
};

/// Pops requests off both queues whenever the guest notifies one, and forwards them.
fn forward_requests(
    shared: &Shared,
    rings: &[Arc<Mutex<Queue>>],
    events: &[Arc<EventFd>],
    mut socket: UnixStream,
    tag: &str,
) {
    let mut buffer = Vec::with_capacity(SMALL_MESSAGE);
    serve_notifications(events, tag, |index| {
        drain(shared, &rings[index], &mut socket, &mut buffer)
    });
}

/// Forwards everything on one queue.
fn drain(
    shared: &Shared,
    ring: &Arc<Mutex<Queue>>,
    socket: &mut UnixStream,
    buffer: &mut Vec<u8>,
) -> std::io::Result<Drained> {
    virtqueue::drain(&shared.mem, ring, LIMITS, |request| {
        forward(shared, ring, request, socket, buffer)
    })
}

/// Sends one request to the library, or completes it at once when it gets no reply. The
/// library gets the header as checked here (a guest changing its memory meanwhile changes
/// only the bytes after it, never the framing).
fn forward(
    shared: &Shared,
    ring: &Arc<Mutex<Queue>>,
    request: Popped,
    socket: &mut UnixStream,
    buffer: &mut Vec<u8>,
) -> std::io::Result<()> {
    let Some(chain) = request.chain else {
        complete(&shared.mem, ring, request.head, 0, &*shared.signal);
        return Ok(());
    };
    let fail = |unique: u64| {
        let written = fail_request(&shared.mem, &chain.writable, unique);
        complete(&shared.mem, ring, request.head, written, &*shared.signal);
        Ok(())
    };
    let Some((header, opcode, unique)) = read_in_header(&shared.mem, &chain) else {
        return fail(0);
    };
    let answered = !is_unanswered(opcode);
    if answered {
        if unique == 0 {
            // The library sends nothing for id 0 (a notification's id).
            return fail(0);
        }
        let mut pending = shared.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.contains_key(&unique) || pending.len() >= usize::from(QUEUE_SIZE) {
            drop(pending);
            return fail(unique);
        }
        // Recorded before it is sent: the reply may come back before this thread goes on.
        pending.insert(
            unique,
            Pending {
                ring: ring.clone(),
                head: request.head,
                reply_to: chain.writable,
            },
        );
    }
    let rest = chain.readable_len - IN_HEADER_LEN;
    if chain.readable_len <= SMALL_MESSAGE {
        buffer.clear();
        buffer.extend_from_slice(&header);
        buffer.resize(chain.readable_len, 0);
        gather(
            &shared.mem,
            &chain.readable,
            IN_HEADER_LEN,
            &mut buffer[IN_HEADER_LEN..],
        )?;
        socket.write_all(buffer)?;
    } else {
        send_from_guest(
            &shared.mem,
            &header,
            &chain.readable,
            IN_HEADER_LEN,
            rest,
            socket,
        )?;
    }
    if !answered {
        complete(&shared.mem, ring, request.head, 0, &*shared.signal);
    }
    Ok(())
}

/// Answers a request the library never sees with `EIO` (the guest kernel reads the reply
/// header whatever the used length says, so a request completed with no header would
/// "succeed" with whatever its buffers held). Returns the bytes written: 16, or 0 when the
/// chain has no room for a header.
pub(crate) fn fail_request(
    mem: &GuestMemoryMmap,
    reply_to: &[(GuestAddress, u32)],
    unique: u64,
) -> u32 {
    let room: usize = reply_to.iter().map(|(_, l)| *l as usize).sum();
    if room < OUT_HEADER_LEN {
        return 0;
    }
    let mut header = [0u8; OUT_HEADER_LEN];
    header[0..4].copy_from_slice(&(OUT_HEADER_LEN as u32).to_le_bytes());
    header[4..8].copy_from_slice(&(-libc::EIO).to_le_bytes());
    header[8..16].copy_from_slice(&unique.to_le_bytes());
    match scatter(mem, reply_to, 0, &header) {
        Ok(()) => OUT_HEADER_LEN as u32,
        Err(_) => 0,
    }
}

/// A request chain's FUSE header, copied out of guest memory once, with its opcode and
/// `unique`; `None` when the chain is shorter than a header or the header's length is not
/// the chain's.
pub(crate) fn read_in_header(
    mem: &GuestMemoryMmap,
    chain: &virtqueue::Chain,
) -> Option<([u8; IN_HEADER_LEN], u32, u64)> {
    if chain.readable_len < IN_HEADER_LEN {
        return None;
    }
    let mut header = [0u8; IN_HEADER_LEN];
    gather(mem, &chain.readable, 0, &mut header).ok();
    let (opcode, unique) = parse_in_header(&header, chain.readable_len)?;
    Some((header, opcode, unique))
}

/// The opcode and `unique` of a request header whose length field is `total`.
fn parse_in_header(header: &[u8; IN_HEADER_LEN], total: usize) -> Option<(u32, u64)> {
    let length = u32::from_le_bytes(header[0..4].try_into().ok()?) as usize;
    if length != total {
        return None;
    }
    let opcode = u32::from_le_bytes(header[4..8].try_into().ok()?);
    let unique = u64::from_le_bytes(header[8..16].try_into().ok()?);
    Some((opcode, unique))
}

/// Reads the library's replies and completes the requests they answer.
fn complete_replies(shared: &Shared, socket: UnixStream) {
    let _ = serve_replies(shared, socket);
}

fn serve_replies(shared: &Shared, mut socket: UnixStream) -> std::io::Result<()> {
    let mut buffer = Vec::with_capacity(SMALL_MESSAGE);
    loop {
        let mut header = [0u8; OUT_HEADER_LEN];
        socket.read_exact(&mut header)?;
        let length = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
        if !(OUT_HEADER_LEN..=MAX_REPLY).contains(&length) {
            // The library never sends this; the framing is lost, so stop.
            return Err(std::io::ErrorKind::InvalidData.into());
        }
        let unique = u64::from_le_bytes(header[8..16].try_into().expect("eight bytes"));
        let waiting = shared
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&unique);
        let body = length - OUT_HEADER_LEN;
        let Some(waiting) = waiting else {
            // Nobody waits for it (never sent by the library): skip its bytes.
            std::io::copy(&mut (&socket).take(body as u64), &mut std::io::sink())?;
            continue;
        };
        let room: usize = waiting.reply_to.iter().map(|(_, l)| *l as usize).sum();
        let fits = length.min(room);
        let mem = &shared.mem;
        if length <= SMALL_MESSAGE {
            buffer.clear();
            buffer.extend_from_slice(&header);
            buffer.resize(length, 0);
            socket.read_exact(&mut buffer[OUT_HEADER_LEN..])?;
            scatter(mem, &waiting.reply_to, 0, &buffer[..fits])?;
        } else {
            scatter(
                mem,
                &waiting.reply_to,
                0,
                &header[..fits.min(OUT_HEADER_LEN)],
            )?;
            let into_guest = fits.saturating_sub(OUT_HEADER_LEN);
            receive_into_guest(
                mem,
                &waiting.reply_to,
                OUT_HEADER_LEN,
                into_guest,
                &mut socket,
            )?;
            let left = (body - into_guest) as u64;
            std::io::copy(&mut (&socket).take(left), &mut std::io::sink())?;
        }
        complete(
            &shared.mem,
            &waiting.ring,
            waiting.head,
            fits as u32,
            &*shared.signal,
        );
    }
}

#[cfg(test)]
mod tests;
