//! The transport in the helper: a virtio-fs device whose requests the library answers.
//!
//! The guest kernel's virtio-fs driver puts each FUSE request on a virtqueue: the request's
//! bytes in the descriptors it reads from, room for the reply in those it writes to. This
//! device, one per mount, runs in the `krunbox-vmm` helper (attached through
//! [`krun_sys::device`]) and serves no filesystem itself: it copies each request's bytes to
//! the mount's socket, unparsed beyond the FUSE header's length, opcode and `unique`, and
//! writes each reply the library sends back into the guest's descriptors of the request with
//! that `unique`. Requests go on while earlier ones wait, so the library answers many at once
//! and in any order ([`super::service`] is the same server the guest-init relay used).
//!
//! Everything of the guest is bounded here: a request's readable bytes (at most
//! [`MAX_REQUEST`]) and its chain (libkrun's queue walks at most the queue's size of
//! descriptors), the requests waiting for a reply (at most one per descriptor head, so at most
//! [`QUEUE_SIZE`]), and a `unique` reused while in flight is answered with nothing rather than
//! replacing the first. A malformed request is completed with no reply; the guest's own
//! filesystem call fails, nothing else does.
//!
//! Two threads per device: one pops both queues and forwards (blocking on the socket when the
//! library is busy, which holds the guest back), one reads replies and completes requests.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use krun_sys::device::{
    ActivateError, ActivateResult, Bytes, DeviceQueue, EventFd, GuestAddress, GuestMemoryMmap,
    InterruptTransport, Queue, QueueConfig, VirtioDevice, VIRTIO_F_VERSION_1,
};

use super::fuse::{IN_HEADER_LEN, MAX_REQUEST};

/// virtio's device type for a filesystem (`VIRTIO_ID_FS`).
const VIRTIO_ID_FS: u32 = 26;

/// Descriptors in each queue. The guest's driver sizes its largest request by it (a page a
/// descriptor): 1024 leaves room for a 1 MiB write, the size the session negotiates.
pub(crate) const QUEUE_SIZE: u16 = 1024;

/// The high-priority queue (`FORGET`s) and one request queue.
const QUEUES: [QueueConfig; 2] = [QueueConfig::new(QUEUE_SIZE), QueueConfig::new(QUEUE_SIZE)];

/// The largest reply the library sends (a 1 MiB read and its header, with room to spare).
const MAX_REPLY: usize = MAX_REQUEST;

/// A FUSE reply header: `len: u32, error: i32, unique: u64`.
const OUT_HEADER_LEN: usize = 16;

/// Opcodes that get no reply (`FUSE_FORGET`, `FUSE_BATCH_FORGET`): their descriptors are
/// completed as soon as they are forwarded.
const FUSE_FORGET: u32 = 2;
const FUSE_BATCH_FORGET: u32 = 42;

/// One mount's device. Built in the helper before the VM, activated by the guest's driver.
pub(crate) struct ForwardingFs {
    /// `tag[36]` then `num_request_queues: u32`, as the virtio-fs configuration space lays
    /// them out.
    config: [u8; 40],
    acked_features: u64,
    socket: Option<UnixStream>,
    activated: bool,
}

impl ForwardingFs {
    /// A device named `tag` whose requests go to, and replies come from, `socket`.
    pub(crate) fn new(tag: &str, socket: UnixStream) -> Self {
        let mut config = [0u8; 40];
        let name = tag.as_bytes();
        config[..name.len().min(36)].copy_from_slice(&name[..name.len().min(36)]);
        config[36..40].copy_from_slice(&1u32.to_le_bytes());
        ForwardingFs {
            config,
            acked_features: 0,
            socket: Some(socket),
            activated: false,
        }
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
        let start = (offset as usize).min(self.config.len());
        let end = start.saturating_add(data.len()).min(self.config.len());
        data[..end - start].copy_from_slice(&self.config[start..end]);
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
        // Activated once: the socket goes to the threads (a guest that resets the device and
        // activates it again finds it gone, and its mount stops working).
        let socket = self.socket.take().ok_or(ActivateError::BadActivate)?;
        if queues.len() != QUEUES.len() {
            return Err(ActivateError::BadActivate);
        }
        let replies = socket.try_clone().map_err(|_| ActivateError::BadActivate)?;
        let mut events = Vec::new();
        let mut rings = Vec::new();
        for queue in queues {
            events.push(queue.event);
            rings.push(Arc::new(Mutex::new(queue.queue)));
        }
        let shared = Arc::new(Shared {
            mem,
            interrupt,
            request_queue: rings[1].clone(),
            pending: Mutex::new(HashMap::new()),
        });
        let forwarding = shared.clone();
        std::thread::Builder::new()
            .name("krunbox-fs-req".into())
            .spawn(move || forward_requests(&forwarding, &rings, &events, socket))
            .map_err(|_| ActivateError::BadActivate)?;
        std::thread::Builder::new()
            .name("krunbox-fs-reply".into())
            .spawn(move || complete_replies(&shared, replies))
            .map_err(|_| ActivateError::BadActivate)?;
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
    interrupt: InterruptTransport,
    /// The request queue: popped by one thread, completed by the other.
    request_queue: Arc<Mutex<Queue>>,
    /// Requests waiting for their reply, by `unique`.
    pending: Mutex<HashMap<u64, Pending>>,
}

/// A forwarded request: its chain's head and where its reply goes.
struct Pending {
    head: u16,
    reply_to: Vec<(GuestAddress, u32)>,
}

/// A request read off a queue.
struct Request {
    head: u16,
    bytes: Vec<u8>,
    reply_to: Vec<(GuestAddress, u32)>,
}

/// Pops requests off both queues whenever the guest notifies one, and forwards them.
fn forward_requests(
    shared: &Shared,
    rings: &[Arc<Mutex<Queue>>],
    events: &[Arc<EventFd>],
    mut socket: UnixStream,
) {
    let mut fds: Vec<libc::pollfd> = events
        .iter()
        .map(|event| libc::pollfd {
            fd: event.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: poll on a live array of pollfds of our own eventfds.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if ready < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        for (index, fd) in fds.iter_mut().enumerate() {
            if fd.revents == 0 {
                continue;
            }
            fd.revents = 0;
            let _ = events[index].read();
            if drain(shared, &rings[index], &mut socket).is_err() {
                // The library is gone: the instance is being torn down.
                return;
            }
        }
    }
}

/// Forwards everything on one queue, with notifications off while there is more.
fn drain(shared: &Shared, ring: &Mutex<Queue>, socket: &mut UnixStream) -> std::io::Result<()> {
    loop {
        let request = {
            let mut queue = ring.lock().unwrap_or_else(|p| p.into_inner());
            match pop(&mut queue, &shared.mem) {
                Some(request) => request,
                None => {
                    // Notifications back on; if the guest added requests meanwhile, go on.
                    let more = queue.enable_notification(&shared.mem).unwrap_or(false);
                    if more {
                        let _ = queue.disable_notification(&shared.mem);
                        continue;
                    }
                    return Ok(());
                }
            }
        };
        forward(shared, ring, request, socket)?;
    }
}

/// The next request on `queue`: its readable bytes and its writable descriptors. A chain that
/// breaks the bounds is returned with no bytes (to be completed unanswered).
fn pop(queue: &mut Queue, mem: &GuestMemoryMmap) -> Option<Request> {
    let _ = queue.disable_notification(mem);
    let head = queue.pop(mem)?;
    let index = head.index;
    let mut bytes = Vec::new();
    let mut reply_to = Vec::new();
    let mut valid = true;
    let mut readable_total = 0usize;
    for descriptor in head.into_iter() {
        if descriptor.is_write_only() {
            reply_to.push((descriptor.addr, descriptor.len));
            continue;
        }
        readable_total = readable_total.saturating_add(descriptor.len as usize);
        if !reply_to.is_empty() || readable_total > MAX_REQUEST {
            // Readable after writable, or more than any request: not a FUSE request.
            valid = false;
            break;
        }
        let start = bytes.len();
        bytes.resize(start + descriptor.len as usize, 0);
        if mem
            .read_slice(&mut bytes[start..], descriptor.addr)
            .is_err()
        {
            valid = false;
            break;
        }
    }
    if !valid {
        bytes.clear();
    }
    Some(Request {
        head: index,
        bytes,
        reply_to,
    })
}

/// Sends one request to the library, or completes it at once when it gets no reply.
fn forward(
    shared: &Shared,
    ring: &Mutex<Queue>,
    request: Request,
    socket: &mut UnixStream,
) -> std::io::Result<()> {
    let header = parse_in_header(&request.bytes);
    let Some((opcode, unique)) = header else {
        complete(shared, ring, request.head, 0);
        return Ok(());
    };
    if matches!(opcode, FUSE_FORGET | FUSE_BATCH_FORGET) {
        socket.write_all(&request.bytes)?;
        complete(shared, ring, request.head, 0);
        return Ok(());
    }
    {
        let mut pending = shared.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.contains_key(&unique) || pending.len() >= usize::from(QUEUE_SIZE) {
            drop(pending);
            complete(shared, ring, request.head, 0);
            return Ok(());
        }
        // Recorded before it is sent: the reply may come back before this thread goes on.
        pending.insert(
            unique,
            Pending {
                head: request.head,
                reply_to: request.reply_to,
            },
        );
    }
    socket.write_all(&request.bytes)
}

/// The opcode and `unique` of a request whose header's length matches its bytes.
fn parse_in_header(bytes: &[u8]) -> Option<(u32, u64)> {
    if bytes.len() < IN_HEADER_LEN {
        return None;
    }
    let length = u32::from_le_bytes(bytes[0..4].try_into().ok()?) as usize;
    if length != bytes.len() {
        return None;
    }
    let opcode = u32::from_le_bytes(bytes[4..8].try_into().ok()?);
    let unique = u64::from_le_bytes(bytes[8..16].try_into().ok()?);
    Some((opcode, unique))
}

/// Marks a request done, having written `written` bytes of reply, and interrupts the guest.
fn complete(shared: &Shared, ring: &Mutex<Queue>, head: u16, written: u32) {
    let mut queue = ring.lock().unwrap_or_else(|p| p.into_inner());
    if queue.add_used(&shared.mem, head, written).is_ok()
        && queue.needs_notification(&shared.mem).unwrap_or(true)
    {
        shared.interrupt.signal_used_queue();
    }
}

/// Reads the library's replies and completes the requests they answer.
fn complete_replies(shared: &Shared, mut socket: UnixStream) {
    let mut reply = Vec::with_capacity(64 * 1024);
    loop {
        let mut header = [0u8; OUT_HEADER_LEN];
        if socket.read_exact(&mut header).is_err() {
            return;
        }
        let length = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
        if !(OUT_HEADER_LEN..=MAX_REPLY).contains(&length) {
            // The library never sends this; the framing is lost, so stop.
            return;
        }
        let unique = u64::from_le_bytes(header[8..16].try_into().expect("eight bytes"));
        reply.clear();
        reply.extend_from_slice(&header);
        reply.resize(length, 0);
        if socket.read_exact(&mut reply[OUT_HEADER_LEN..]).is_err() {
            return;
        }
        let waiting = shared
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&unique);
        let Some(waiting) = waiting else {
            continue;
        };
        let written = write_reply(&shared.mem, &reply, &waiting.reply_to);
        complete(shared, &shared.request_queue, waiting.head, written);
    }
}

/// Copies `reply` into the guest's writable descriptors, as much as they hold.
fn write_reply(mem: &GuestMemoryMmap, reply: &[u8], reply_to: &[(GuestAddress, u32)]) -> u32 {
    let mut rest = reply;
    let mut written = 0u32;
    for (address, length) in reply_to {
        if rest.is_empty() {
            break;
        }
        let take = rest.len().min(*length as usize);
        if mem.write_slice(&rest[..take], *address).is_err() {
            break;
        }
        written += take as u32;
        rest = &rest[take..];
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_header_is_checked_against_the_bytes() {
        let mut request = vec![0u8; IN_HEADER_LEN + 8];
        request[0..4].copy_from_slice(&((IN_HEADER_LEN + 8) as u32).to_le_bytes());
        request[4..8].copy_from_slice(&15u32.to_le_bytes());
        request[8..16].copy_from_slice(&77u64.to_le_bytes());
        assert_eq!(parse_in_header(&request), Some((15, 77)));
        // A length that is not the request's own, and a request shorter than a header.
        request[0..4].copy_from_slice(&9u32.to_le_bytes());
        assert_eq!(parse_in_header(&request), None);
        assert_eq!(parse_in_header(&request[..IN_HEADER_LEN - 1]), None);
    }
}
