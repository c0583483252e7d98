//! The transport in the helper: a virtio-fs device whose requests the library answers.
//!
//! The guest kernel's virtio-fs driver puts each FUSE request on a virtqueue: the request's
//! bytes in the descriptors it reads from, room for the reply in those it writes to. This
//! device, one per mount, runs in the `krunbox-vmm` helper (attached through
//! [`krun_sys::device`]) and serves no filesystem itself: it copies each request's bytes to
//! the mount's socket, unparsed beyond the FUSE header's length, opcode and `unique`, and
//! writes each reply the library sends back into the guest's descriptors of the request with
//! that `unique`. Requests go on while earlier ones wait, so the library answers many at once
//! and in any order ([`super::service`]).
//!
//! Everything of the guest is bounded here: a request's readable bytes (at most
//! [`MAX_REQUEST`]) and its chain (libkrun's queue walks at most the queue's size of
//! descriptors; at most [`MAX_REPLY_DESCRIPTORS`] of them writable), the requests waiting for a
//! reply (at most [`QUEUE_SIZE`]), and a `unique` reused while in flight is answered with
//! nothing rather than replacing the first. A malformed request is completed with no reply; the guest's own
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
    ActivateResult, Bytes, DeviceQueue, EventFd, GuestAddress, GuestMemory, GuestMemoryError,
    GuestMemoryMmap, InterruptTransport, Queue, QueueConfig, VirtioDevice, VIRTIO_F_VERSION_1,
};

use super::fuse::{is_unanswered, IN_HEADER_LEN, MAX_REQUEST};

pub(crate) mod fuzz;

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
}

impl ForwardingFs {
    /// A device named `tag` whose requests go to, and replies come from, `socket`.
    pub(crate) fn new(tag: &str, socket: UnixStream) -> std::io::Result<Self> {
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
        })
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
        // Activated once: the sockets go to the threads. (A reset is refused: `reset` is not
        // implemented, so libkrun marks the device failed and never activates it again.)
        let Some((socket, replies)) = self.sockets.take() else {
            return self.inert("activated twice");
        };
        if queues.len() != QUEUES.len() {
            return self.inert("activated with the wrong number of queues");
        }
        // libkrun's transport does not check the rings the guest set up; its queue reads them
        // with `unwrap`. Rings outside guest memory, or of a bad size, leave the device inert.
        if queues.iter().any(|q| !q.queue.is_valid(&mem)) {
            return self.inert("a queue outside guest memory or of a bad size");
        }
        let mut events = Vec::new();
        let mut rings = Vec::new();
        for queue in queues {
            events.push(queue.event);
            rings.push(Arc::new(Mutex::new(queue.queue)));
        }
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

/// A request read off a queue: its head, its bytes' descriptors (checked: in guest memory, at
/// most [`MAX_REQUEST`] in all) and its reply's, or `None` for a chain that broke the bounds.
struct Request {
    head: u16,
    chain: Option<Chain>,
}

/// A request chain's descriptors, as (guest address, length).
struct Chain {
    readable: Vec<(GuestAddress, u32)>,
    readable_len: usize,
    reply_to: Vec<(GuestAddress, u32)>,
}

/// Messages up to this size are copied whole through a buffer of ours (one system call each
/// way); larger ones (reads and writes of file data) move between the socket and guest memory
/// directly, without that copy.
const SMALL_MESSAGE: usize = 64 * 1024;

/// Pops requests off both queues whenever the guest notifies one, and forwards them.
fn forward_requests(
    shared: &Shared,
    rings: &[Arc<Mutex<Queue>>],
    events: &[Arc<EventFd>],
    mut socket: UnixStream,
    tag: &str,
) {
    let mut fds: Vec<libc::pollfd> = events
        .iter()
        .map(|event| libc::pollfd {
            fd: event.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let mut buffer = Vec::with_capacity(SMALL_MESSAGE);
    let mut broken = vec![false; rings.len()];
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
            if broken[index] {
                continue;
            }
            match drain(shared, &rings[index], &mut socket, &mut buffer) {
                Ok(Drained::Empty) => {}
                Ok(Drained::Broken) => {
                    // Served no more: popping would find nothing, forever, while the ring
                    // says there is more.
                    eprintln!("krunbox-vmm: device {tag}: the guest broke queue {index}; it is no longer served");
                    broken[index] = true;
                }
                // The library is gone: the instance is being torn down.
                Err(_) => return,
            }
        }
    }
}

/// How [`drain`] left a queue.
#[derive(Debug, PartialEq, Eq)]
enum Drained {
    /// Nothing more on it; notifications are on.
    Empty,
    /// The guest's ring claims more than the queue holds, or entries no chain starts at.
    Broken,
}

/// Forwards everything on one queue, with notifications off while there is more.
fn drain(
    shared: &Shared,
    ring: &Arc<Mutex<Queue>>,
    socket: &mut UnixStream,
    buffer: &mut Vec<u8>,
) -> std::io::Result<Drained> {
    loop {
        let request = {
            let mut queue = ring.lock().unwrap_or_else(|p| p.into_inner());
            // The ring was checked to lie in guest memory when the device was activated, so
            // reading its index does not fail. The index is read once here and the decision
            // made on that reading: the guest adds entries while we look, so a second reading
            // (after `pop` found none) may show one that was not there for `pop`, and taking
            // that for a broken ring stopped the queue for good under a busy guest.
            let available = queue.len(&shared.mem);
            if available > queue.actual_size() {
                return Ok(Drained::Broken);
            }
            if available == 0 {
                // Notifications back on; if the guest added requests meanwhile, go on.
                let more = queue.enable_notification(&shared.mem).unwrap_or(false);
                if more {
                    let _ = queue.disable_notification(&shared.mem);
                    continue;
                }
                return Ok(Drained::Empty);
            }
            match pop(&mut queue, &shared.mem) {
                Some(request) => request,
                // An entry was there (the index never goes back for an honest guest), and no
                // chain starts at it.
                None => return Ok(Drained::Broken),
            }
        };
        forward(shared, ring, request, socket, buffer)?;
    }
}

/// The next request on `queue`, its descriptors checked.
fn pop(queue: &mut Queue, mem: &GuestMemoryMmap) -> Option<Request> {
    let _ = queue.disable_notification(mem);
    let head = queue.pop(mem)?;
    let index = head.index;
    let mut chain = Chain {
        readable: Vec::new(),
        readable_len: 0,
        reply_to: Vec::new(),
    };
    let mut valid = true;
    for descriptor in head.into_iter() {
        if !mem.check_range(descriptor.addr, descriptor.len as usize) {
            valid = false;
            break;
        }
        if descriptor.is_write_only() {
            if chain.reply_to.len() == MAX_REPLY_DESCRIPTORS {
                valid = false;
                break;
            }
            chain.reply_to.push((descriptor.addr, descriptor.len));
            continue;
        }
        chain.readable_len = chain.readable_len.saturating_add(descriptor.len as usize);
        if !chain.reply_to.is_empty() || chain.readable_len > MAX_REQUEST {
            // Readable after writable, or more than any request: not a FUSE request.
            valid = false;
            break;
        }
        chain.readable.push((descriptor.addr, descriptor.len));
    }
    Some(Request {
        head: index,
        chain: valid.then_some(chain),
    })
}

/// Calls `each` with the (address, length) pieces of bytes `skip..skip + len` of `regions`.
fn for_each_piece(
    regions: &[(GuestAddress, u32)],
    mut skip: usize,
    mut len: usize,
    mut each: impl FnMut(GuestAddress, usize) -> std::io::Result<()>,
) -> std::io::Result<()> {
    for (address, region_len) in regions {
        if len == 0 {
            break;
        }
        let region_len = *region_len as usize;
        if skip >= region_len {
            skip -= region_len;
            continue;
        }
        let take = (region_len - skip).min(len);
        each(GuestAddress(address.0 + skip as u64), take)?;
        len -= take;
        skip = 0;
    }
    Ok(())
}

/// A guest memory access that failed in a range [`pop`] checked: never expected.
fn memory_error(err: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(format!("guest memory: {err}"))
}

/// Copies bytes `skip..skip + out.len()` of `regions` into `out`.
fn gather(
    mem: &GuestMemoryMmap,
    regions: &[(GuestAddress, u32)],
    skip: usize,
    out: &mut [u8],
) -> std::io::Result<()> {
    let mut at = 0;
    for_each_piece(regions, skip, out.len(), |address, len| {
        mem.read_slice(&mut out[at..at + len], address)
            .map_err(memory_error)?;
        at += len;
        Ok(())
    })
}

/// Sends one request to the library, or completes it at once when it gets no reply. The
/// library gets the header as checked here (a guest changing its memory meanwhile changes
/// only the bytes after it, never the framing).
fn forward(
    shared: &Shared,
    ring: &Arc<Mutex<Queue>>,
    request: Request,
    socket: &mut UnixStream,
    buffer: &mut Vec<u8>,
) -> std::io::Result<()> {
    let Some(chain) = request.chain else {
        complete(shared, ring, request.head, 0);
        return Ok(());
    };
    let fail = |unique: u64| {
        let written = fail_request(&shared.mem, &chain.reply_to, unique);
        complete(shared, ring, request.head, written);
        Ok(())
    };
    let mut header = [0u8; IN_HEADER_LEN];
    let parsed = if chain.readable_len >= IN_HEADER_LEN {
        gather(&shared.mem, &chain.readable, 0, &mut header).ok();
        parse_in_header(&header, chain.readable_len)
    } else {
        None
    };
    let Some((opcode, unique)) = parsed else {
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
                reply_to: chain.reply_to,
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
        socket.write_all(&header)?;
        for_each_piece(&chain.readable, IN_HEADER_LEN, rest, |address, len| {
            write_from_guest(&shared.mem, address, len, socket)
        })?;
    }
    if !answered {
        complete(shared, ring, request.head, 0);
    }
    Ok(())
}

/// Answers a request the library never sees with `EIO` (the guest kernel reads the reply
/// header whatever the used length says, so a request completed with no header would
/// "succeed" with whatever its buffers held). Returns the bytes written: 16, or 0 when the
/// chain has no room for a header.
fn fail_request(mem: &GuestMemoryMmap, reply_to: &[(GuestAddress, u32)], unique: u64) -> u32 {
    let room: usize = reply_to.iter().map(|(_, l)| *l as usize).sum();
    if room < OUT_HEADER_LEN {
        return 0;
    }
    let mut header = [0u8; OUT_HEADER_LEN];
    header[0..4].copy_from_slice(&(OUT_HEADER_LEN as u32).to_le_bytes());
    header[4..8].copy_from_slice(&(-libc::EIO).to_le_bytes());
    header[8..16].copy_from_slice(&unique.to_le_bytes());
    match scatter(mem, reply_to, &header) {
        Ok(()) => OUT_HEADER_LEN as u32,
        Err(_) => 0,
    }
}

/// Writes `len` bytes of guest memory at `address` to `socket`.
fn write_from_guest(
    mem: &GuestMemoryMmap,
    address: GuestAddress,
    len: usize,
    socket: &mut UnixStream,
) -> std::io::Result<()> {
    move_all(address, len, std::io::ErrorKind::WriteZero, |at, left| {
        mem.write_volatile_to(at, socket, left)
    })
}

/// Reads `len` bytes from `socket` into guest memory at `address`.
fn read_into_guest(
    mem: &GuestMemoryMmap,
    address: GuestAddress,
    len: usize,
    socket: &mut UnixStream,
) -> std::io::Result<()> {
    move_all(
        address,
        len,
        std::io::ErrorKind::UnexpectedEof,
        |at, left| mem.read_volatile_from(at, socket, left),
    )
}

/// Moves `len` bytes at `address` with `step` (one system call, at most the bytes left, how
/// many it moved) until all have moved, again after `EINTR`; a step that moves nothing is
/// `ended`.
fn move_all(
    address: GuestAddress,
    len: usize,
    ended: std::io::ErrorKind,
    mut step: impl FnMut(GuestAddress, usize) -> Result<usize, GuestMemoryError>,
) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        match step(GuestAddress(address.0 + done as u64), len - done) {
            Ok(0) => return Err(ended.into()),
            Ok(moved) => done += moved,
            Err(GuestMemoryError::IOError(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(memory_error(e)),
        }
    }
    Ok(())
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

/// Marks a request done, having written `written` bytes of reply, and interrupts the guest.
fn complete(shared: &Shared, ring: &Mutex<Queue>, head: u16, written: u32) {
    let mut queue = ring.lock().unwrap_or_else(|p| p.into_inner());
    if queue.add_used(&shared.mem, head, written).is_ok()
        && queue.needs_notification(&shared.mem).unwrap_or(true)
    {
        (shared.signal)();
    }
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
            scatter(mem, &waiting.reply_to, &buffer[..fits])?;
        } else {
            scatter(mem, &waiting.reply_to, &header[..fits.min(OUT_HEADER_LEN)])?;
            let into_guest = fits.saturating_sub(OUT_HEADER_LEN);
            for_each_piece(
                &waiting.reply_to,
                OUT_HEADER_LEN,
                into_guest,
                |address, len| read_into_guest(mem, address, len, &mut socket),
            )?;
            let left = (body - into_guest) as u64;
            std::io::copy(&mut (&socket).take(left), &mut std::io::sink())?;
        }
        complete(shared, &waiting.ring, waiting.head, fits as u32);
    }
}

/// Copies `bytes` into the start of `regions` (which hold at least as many).
fn scatter(
    mem: &GuestMemoryMmap,
    regions: &[(GuestAddress, u32)],
    bytes: &[u8],
) -> std::io::Result<()> {
    let mut at = 0;
    for_each_piece(regions, 0, bytes.len(), |address, len| {
        mem.write_slice(&bytes[at..at + len], address)
            .map_err(memory_error)?;
        at += len;
        Ok(())
    })
}

#[cfg(test)]
mod tests;
