//! A disk the host serves (a copy-on-write root's layer disk, an image build's output) as a
//! virtio-blk device of ours.
//!
//! The guest's block layer puts each request on the device's queue: a 16-byte header (type,
//! sector) the driver reads from, a write's data or room for a read's, and a status byte the
//! device writes last. This device runs in the `krunbox-vmm` helper (attached through
//! [`krun_sys::device`]) and checks each request; then, by the disk's [`Backing`]:
//! - **the library**: it holds no data itself; it forwards reads, writes and flushes to the
//!   library over a socket ([`disk_wire`](krunbox_virtio::disk_wire): its own header, then a write's data straight from guest
//!   memory), and completes each when the library's reply comes back (a read's data straight
//!   into guest memory, then the status). The library serves them from a layer over a
//!   `BlockStore` (its `rootfs/cow.rs`, through its disk service, `rootfs/disk/`).
//!   Requests go on while earlier ones wait: the guest keeps up to a queue's worth in flight.
//! - **a file** the library opened (a store that keeps its blocks in one local file, an image
//!   build's sparse output): it reads and writes the file in place, straight between guest
//!   memory and the file (`preadv`/`pwritev`, the one copy a raw disk makes), and a flush is
//!   `fdatasync`. Nothing crosses to the library while the guest runs.
//!
//! Everything of the guest is bounded here: a request's data (at most [`MAX_DATA`],
//! whole 512-byte sectors, inside the disk), its chain (at most [`QUEUE_SIZE`] descriptors, as
//! `krunbox_virtio::queue` walks them, indirect tables included; at most
//! [`MAX_WRITABLE_DESCRIPTORS`] writable), and the requests waiting for a reply (at most [`QUEUE_SIZE`]). A malformed request fails with
//! `VIRTIO_BLK_S_IOERR` (or is completed with nothing written when it has no room for a
//! status): the guest's own I/O fails, nothing else does. The device answers `GET_ID` itself
//! (the serial guest-init finds the disk by) and `VIRTIO_BLK_S_UNSUPP` to what it does not
//! serve (discard, write-zeroes, ...).
//!
//! Why a device of our own rather than the loop device over FUSE it replaced: see
//! docs/architecture.md, "Writable roots".

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use krun_sys::device::{
    ActivateResult, DeviceQueue, EventFd, InterruptTransport, QueueConfig, VirtioDevice,
    VIRTIO_F_VERSION_1,
};
use virtio_queue::Queue;
use vm_memory::{GuestAddress, GuestMemoryMmap};

use krunbox_virtio::disk_wire::{
    Operation, ReplyHeader, RequestHeader, Status, MAX_DATA, REPLY_HEADER_LEN,
};
use krunbox_virtio::queue::{
    self as virtqueue, complete, complete_unsignalled, gather, read_at_into_guest,
    receive_buffered_into_guest, scatter, send_from_guest, serve_notifications,
    write_at_from_guest, Chain, ChainLimits, Drained, Popped,
};

pub(crate) mod fuzz;

/// virtio's device type for a block device (`VIRTIO_ID_BLOCK`).
const VIRTIO_ID_BLOCK: u32 = 2;

/// Feature bits offered: segments of at most [`SEGMENT_SIZE`], at most [`MAX_SEGMENTS`] of
/// them, a 4 KiB logical block, and a volatile write cache the guest flushes (so a guest
/// `fsync` becomes a flush request, which the library makes durable).
const VIRTIO_BLK_F_SIZE_MAX: u32 = 1;
const VIRTIO_BLK_F_SEG_MAX: u32 = 2;
const VIRTIO_BLK_F_BLK_SIZE: u32 = 6;
const VIRTIO_BLK_F_FLUSH: u32 = 9;

/// Request types (`VIRTIO_BLK_T_*`).
const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;

/// The guest driver's request header: type, reserved, sector.
const BLK_HEADER_LEN: usize = 16;

/// A sector, the unit of the request header's position and of every request's length.
const SECTOR: u64 = 512;

/// The largest segment the driver may use, and how many: together [`MAX_DATA`].
const SEGMENT_SIZE: u32 = 4096;
const MAX_SEGMENTS: u32 = MAX_DATA / SEGMENT_SIZE;

/// The logical block size offered: the layer's ext4 uses 4 KiB blocks, and the layer keeps
/// dirty data as 4 KiB pages.
const BLOCK_SIZE: u32 = 4096;

/// Descriptors in the queue: room for the largest request ([`MAX_SEGMENTS`] and a header and
/// status) and for many small ones in flight.
pub(crate) const QUEUE_SIZE: u16 = 512;

const QUEUES: [QueueConfig; 1] = [QueueConfig::new(QUEUE_SIZE)];

/// The most writable descriptors a chain may have: a read's segments and the status byte.
const MAX_WRITABLE_DESCRIPTORS: usize = MAX_SEGMENTS as usize + 1;

/// The bounds of a request chain: a header and a write's data readable, a read's segments
/// and the status writable.
const LIMITS: ChainLimits = ChainLimits {
    max_readable: BLK_HEADER_LEN + MAX_DATA as usize,
    max_writable_descriptors: MAX_WRITABLE_DESCRIPTORS,
};

/// `GET_ID`'s answer is at most this long.
const SERIAL_LEN: usize = krunbox_protocol::LAYER_DISK_SERIAL_MAX;

/// Where a served disk's requests go.
pub(crate) enum Backing {
    /// To the library, over this socket.
    Library(UnixStream),
    /// Into this file, read and written in place (a regular file: blocks at their disk
    /// offsets, holes and the part past its end reading as zeros); each request that fails
    /// adds one to the eventfd after it, the library's count of failures.
    File(File, File),
}

/// What activation hands the device's threads.
enum Ready {
    /// The socket, twice (one for each thread).
    Library(UnixStream, UnixStream),
    File(File, File),
}

/// A served disk's device, built in the helper before the VM, activated by the guest's
/// driver.
pub(crate) struct ServedBlock {
    /// `struct virtio_blk_config` up to `blk_size`: capacity in sectors, `size_max`,
    /// `seg_max`, geometry (unused), `blk_size`.
    config: [u8; 24],
    serial: [u8; SERIAL_LEN],
    acked_features: u64,
    /// The backing, until activation hands it over.
    backing: Option<Ready>,
    capacity: u64,
    activated: bool,
}

impl ServedBlock {
    /// A disk of `size` bytes (whole sectors: rounded down) named `serial` (at most 20 bytes
    /// are shown), served from `backing`.
    pub(crate) fn new(size: u64, serial: &str, backing: Backing) -> std::io::Result<Self> {
        let capacity = size / SECTOR;
        let mut config = [0u8; 24];
        config[0..8].copy_from_slice(&capacity.to_le_bytes());
        config[8..12].copy_from_slice(&SEGMENT_SIZE.to_le_bytes());
        config[12..16].copy_from_slice(&MAX_SEGMENTS.to_le_bytes());
        config[20..24].copy_from_slice(&BLOCK_SIZE.to_le_bytes());
        let mut name = [0u8; SERIAL_LEN];
        let bytes = serial.as_bytes();
        name[..bytes.len().min(SERIAL_LEN)].copy_from_slice(&bytes[..bytes.len().min(SERIAL_LEN)]);
        let backing = match backing {
            Backing::Library(socket) => {
                // Cloned now, not when the guest activates the device: by then the guest could
                // have used up the helper's descriptors.
                let replies = socket.try_clone()?;
                Ready::Library(socket, replies)
            }
            Backing::File(file, failures) => {
                if !file.metadata()?.is_file() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "an in-place disk must be a regular file",
                    ));
                }
                Ready::File(file, failures)
            }
        };
        Ok(ServedBlock {
            config,
            serial: name,
            acked_features: 0,
            backing: Some(backing),
            capacity: capacity * SECTOR,
            activated: false,
        })
    }

    /// Leaves the device activated but serving nothing (the guest's I/O on it then waits
    /// forever): for a guest that broke the device's setup. Never an error to libkrun, whose
    /// transport panics on a failed activation.
    fn inert(&mut self, why: &str) -> ActivateResult {
        eprintln!("krunbox-vmm: a served disk's device: {why}; it serves nothing");
        self.backing = None;
        self.activated = true;
        Ok(())
    }
}

impl VirtioDevice for ServedBlock {
    fn avail_features(&self) -> u64 {
        [
            VIRTIO_F_VERSION_1,
            VIRTIO_BLK_F_SIZE_MAX,
            VIRTIO_BLK_F_SEG_MAX,
            VIRTIO_BLK_F_BLK_SIZE,
            VIRTIO_BLK_F_FLUSH,
        ]
        .iter()
        .fold(0, |features, bit| features | 1 << bit)
    }

    fn acked_features(&self) -> u64 {
        self.acked_features
    }

    fn set_acked_features(&mut self, acked_features: u64) {
        self.acked_features = acked_features & self.avail_features();
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn device_name(&self) -> &str {
        "krunbox-blk"
    }

    fn queue_config(&self) -> &[QueueConfig] {
        &QUEUES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // Past the fields offered, the space reads as zeros.
        virtqueue::read_config_space(&self.config, offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // Nothing offered is writable (no `CONFIG_WCE`); a guest writing changes nothing.
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: InterruptTransport,
        queues: Vec<DeviceQueue>,
    ) -> ActivateResult {
        // Activated once (a reset is refused: `reset` is not implemented, so libkrun marks the
        // device failed and never activates it again).
        let Some(backing) = self.backing.take() else {
            return self.inert("activated twice");
        };
        let mut queues = queues;
        let Some(queue) = queues.pop().filter(|_| queues.is_empty()) else {
            return self.inert("activated with the wrong number of queues");
        };
        // libkrun's transport does not check the rings the guest set up. Rings outside guest
        // memory, or of a bad size, leave the device inert.
        let layout = crate::queue::ring_layout(&queue.queue);
        let Some(ring) = virtqueue::queue(layout, QUEUE_SIZE, &mem) else {
            return self.inert("a queue outside guest memory or of a bad size");
        };
        let shared = Arc::new(Shared {
            mem,
            signal: Box::new(move || interrupt.signal_used_queue()),
            ring: Mutex::new(ring),
            pending: Mutex::new(Pending::default()),
            capacity: self.capacity,
            serial: self.serial,
        });
        let event = queue.event;
        let spawned = match backing {
            Ready::Library(socket, replies) => {
                let forwarding = shared.clone();
                std::thread::Builder::new()
                    .name("krunbox-blk-reply".into())
                    .spawn(move || {
                        let _ = serve_replies(&shared, replies);
                    })
                    .and_then(|_| {
                        std::thread::Builder::new()
                            .name("krunbox-blk-req".into())
                            .spawn(move || forward_requests(&forwarding, event, socket))
                    })
            }
            Ready::File(file, failures) => std::thread::Builder::new()
                .name("krunbox-blk-file".into())
                .spawn(move || serve_in_place(&shared, event, &file, &failures)),
        };
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
    ring: Mutex<Queue>,
    pending: Mutex<Pending>,
    /// The disk's size in bytes.
    capacity: u64,
    serial: [u8; SERIAL_LEN],
}

/// Requests forwarded and waiting for their reply, by the id they were sent with.
#[derive(Default)]
struct Pending {
    waiting: HashMap<u32, Waiting>,
    next_id: u32,
}

/// A forwarded request: its chain's head, its writable descriptors (a read's data, then the
/// status byte at their very end) and how many bytes of data its reply brings.
struct Waiting {
    head: u16,
    writable: Vec<(GuestAddress, u32)>,
    data_len: u32,
}

/// Pops requests off the queue whenever the guest notifies it, and forwards them.
fn forward_requests(shared: &Shared, event: Arc<EventFd>, mut socket: UnixStream) {
    serve_notifications(&[event], "the layer disk", |_| drain(shared, &mut socket));
}

/// Forwards (or answers) everything on the queue.
fn drain(shared: &Shared, socket: &mut UnixStream) -> std::io::Result<Drained> {
    virtqueue::drain(&shared.mem, &shared.ring, LIMITS, |request| {
        forward(shared, request, socket)
    })
}

/// What the device makes of a checked chain.
enum Decision {
    /// Forward it to the library.
    Forward(RequestHeader),
    /// Answer it here with this status, after `data` written at the start of its writable
    /// room.
    Answer(Status, Vec<u8>),
}

/// Checks one request's header and chain against the disk, and decides.
fn decide(shared: &Shared, chain: &Chain) -> std::io::Result<Decision> {
    let fail = Ok(Decision::Answer(Status::IoError, Vec::new()));
    if chain.readable_len < BLK_HEADER_LEN {
        return fail;
    }
    let mut header = [0u8; BLK_HEADER_LEN];
    gather(&shared.mem, &chain.readable, 0, &mut header)?;
    let kind = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
    let sector = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    // The status byte is the writable room's last; a read's data is the room before it.
    let room = chain.writable_len() - 1;
    let (operation, length) = match kind {
        T_IN => (Operation::Read, room),
        T_OUT => (Operation::Write, chain.readable_len - BLK_HEADER_LEN),
        T_FLUSH => (Operation::Flush, 0),
        T_GET_ID => {
            let shown = room.min(SERIAL_LEN);
            return Ok(Decision::Answer(
                Status::Ok,
                shared.serial[..shown].to_vec(),
            ));
        }
        _ => return Ok(Decision::Answer(Status::Unsupported, Vec::new())),
    };
    if length > MAX_DATA as usize || !(length as u64).is_multiple_of(SECTOR) {
        return fail;
    }
    // A flush's sector means nothing (the driver sends 0).
    let offset = match operation {
        Operation::Flush => 0,
        _ => match sector.checked_mul(SECTOR) {
            Some(offset) => offset,
            None => return fail,
        },
    };
    let request = RequestHeader {
        id: 0,
        operation,
        offset,
        length: length as u32,
    };
    if !request.fits(shared.capacity) {
        return fail;
    }
    Ok(Decision::Forward(request))
}

/// Forwards one request to the library, or answers it at once.
fn forward(shared: &Shared, request: Popped, socket: &mut UnixStream) -> std::io::Result<()> {
    let head = request.head;
    let Some(chain) = request.chain.filter(|chain| chain.writable_len() > 0) else {
        // Broke the bounds, or has no room for a status: nothing can be said to the guest.
        complete(&shared.mem, &shared.ring, head, 0, &*shared.signal);
        return Ok(());
    };
    let answer_here = |status: Status, data: &[u8]| -> std::io::Result<()> {
        let written = answer(&shared.mem, &chain.writable, status, data)?;
        complete(&shared.mem, &shared.ring, head, written, &*shared.signal);
        Ok(())
    };
    let mut header = match decide(shared, &chain)? {
        Decision::Answer(status, data) => return answer_here(status, &data),
        Decision::Forward(header) => header,
    };
    {
        let mut pending = shared.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.waiting.len() >= usize::from(QUEUE_SIZE) {
            drop(pending);
            return answer_here(Status::IoError, &[]);
        }
        // Ids in use are skipped (the counter wraps, and at most a queue's worth wait).
        while pending.waiting.contains_key(&pending.next_id) {
            pending.next_id = pending.next_id.wrapping_add(1);
        }
        header.id = pending.next_id;
        pending.next_id = pending.next_id.wrapping_add(1);
        // Recorded before it is sent: the reply may come back before this thread goes on.
        pending.waiting.insert(
            header.id,
            Waiting {
                head,
                data_len: if header.operation == Operation::Read {
                    header.length
                } else {
                    0
                },
                writable: chain.writable.clone(),
            },
        );
    }
    let data = if header.operation == Operation::Write {
        header.length as usize
    } else {
        0
    };
    send_from_guest(
        &shared.mem,
        &header.encode(),
        &chain.readable,
        BLK_HEADER_LEN,
        data,
        socket,
    )
}

/// Serves the queue from `file` in place whenever the guest notifies it, counting failures in
/// the eventfd `failures`.
fn serve_in_place(shared: &Shared, event: Arc<EventFd>, file: &File, failures: &File) {
    serve_notifications(&[event], "a served disk", |_| {
        drain_in_place(shared, file, failures)
    });
}

/// Serves everything on the queue from `file`, interrupting the guest once for every
/// [`IN_PLACE_SIGNAL_EVERY`] completions it asked to hear of, and once for the rest.
fn drain_in_place(shared: &Shared, file: &File, failures: &File) -> std::io::Result<Drained> {
    let mut unsignalled = 0usize;
    let drained = virtqueue::drain(&shared.mem, &shared.ring, LIMITS, |request| {
        if in_place(shared, request, file, failures)? {
            unsignalled += 1;
        }
        // A long queue of requests is not held back until the last one is done.
        if unsignalled >= IN_PLACE_SIGNAL_EVERY {
            (shared.signal)();
            unsignalled = 0;
        }
        Ok(())
    });
    if unsignalled > 0 {
        (shared.signal)();
    }
    drained
}

/// Requests completed in place between two interrupts, at most: the guest hears of a batch
/// at once (an interrupt is costly), and of a long batch's first requests before its last.
const IN_PLACE_SIGNAL_EVERY: usize = 32;

/// Serves one request from `file`; returns whether the guest asked to hear of its completion.
/// A failure adds one to the eventfd `failures`.
fn in_place(
    shared: &Shared,
    request: Popped,
    file: &File,
    failures: &File,
) -> std::io::Result<bool> {
    let head = request.head;
    let Some(chain) = request.chain.filter(|chain| chain.writable_len() > 0) else {
        // Broke the bounds, or has no room for a status: nothing can be said to the guest.
        return Ok(complete_unsignalled(&shared.mem, &shared.ring, head, 0));
    };
    let (status, data) = match decide(shared, &chain)? {
        Decision::Answer(status, data) => (status, data),
        Decision::Forward(header) => {
            let length = header.length as usize;
            let done = match header.operation {
                Operation::Read => {
                    read_at_into_guest(&shared.mem, &chain.writable, 0, length, file, header.offset)
                }
                Operation::Write => write_at_from_guest(
                    &shared.mem,
                    &chain.readable,
                    BLK_HEADER_LEN,
                    length,
                    file,
                    header.offset,
                ),
                Operation::Flush => file.sync_data(),
            };
            match done {
                // A read's data is in place already: the status is all that is left to write.
                Ok(()) if header.operation == Operation::Read => {
                    let room = chain.writable_len();
                    scatter(&shared.mem, &chain.writable, room - 1, &[Status::Ok.byte()])?;
                    let written = length as u32 + 1;
                    return Ok(complete_unsignalled(
                        &shared.mem,
                        &shared.ring,
                        head,
                        written,
                    ));
                }
                Ok(()) => (Status::Ok, Vec::new()),
                Err(err) => {
                    // Counted for the library, which reports it when the VM has stopped (an
                    // eventfd write of 8 bytes adds them; it fails only at the counter's
                    // maximum, far past any count that matters).
                    let _ = std::io::Write::write(&mut &*failures, &1u64.to_ne_bytes());
                    // Told a few times, not once per request: a full host disk fails every
                    // write the guest retries, and the log is bounded.
                    static TOLD: std::sync::atomic::AtomicU32 =
                        std::sync::atomic::AtomicU32::new(0);
                    if TOLD.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < 4 {
                        eprintln!(
                            "krunbox-vmm: a served disk's {:?} failed: {err}",
                            header.operation
                        );
                    }
                    (Status::IoError, Vec::new())
                }
            }
        }
    };
    let written = answer(&shared.mem, &chain.writable, status, &data)?;
    Ok(complete_unsignalled(
        &shared.mem,
        &shared.ring,
        head,
        written,
    ))
}

/// Writes `data` at the start of `writable` and `status` into its last byte; returns the bytes
/// written, as the used ring reports them.
fn answer(
    mem: &GuestMemoryMmap,
    writable: &[(GuestAddress, u32)],
    status: Status,
    data: &[u8],
) -> std::io::Result<u32> {
    let room: usize = writable.iter().map(|(_, len)| *len as usize).sum();
    scatter(mem, writable, 0, data)?;
    scatter(mem, writable, room - 1, &[status.byte()])?;
    Ok(data.len() as u32 + 1)
}

/// Reads the library's replies and completes the requests they answer. Replies come several
/// to a read; the guest is interrupted once for all the replies at hand.
fn serve_replies(shared: &Shared, socket: UnixStream) -> std::io::Result<()> {
    let mut reader = std::io::BufReader::with_capacity(64 * 1024, socket);
    let mut unsignalled = false;
    loop {
        if unsignalled && reader.buffer().len() < REPLY_HEADER_LEN {
            (shared.signal)();
            unsignalled = false;
        }
        let mut bytes = [0u8; REPLY_HEADER_LEN];
        reader.read_exact(&mut bytes)?;
        // A header the library never sends loses the framing: stop.
        let reply = ReplyHeader::decode(&bytes).ok_or(std::io::ErrorKind::InvalidData)?;
        let waiting = shared
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .waiting
            .remove(&reply.id);
        let Some(waiting) = waiting else {
            // Nobody waits for it (never sent by the library): skip its bytes.
            std::io::copy(
                &mut (&mut reader).take(u64::from(reply.length)),
                &mut std::io::sink(),
            )?;
            continue;
        };
        let mut status = reply.status;
        if reply.length != 0 {
            if reply.length != waiting.data_len {
                // Not what was asked for: the library never sends this.
                return Err(std::io::ErrorKind::InvalidData.into());
            }
            receive_buffered_into_guest(
                &shared.mem,
                &waiting.writable,
                0,
                reply.length as usize,
                &mut reader,
            )?;
        } else if status == Status::Ok && waiting.data_len != 0 {
            status = Status::IoError;
        }
        let room: usize = waiting.writable.iter().map(|(_, len)| *len as usize).sum();
        scatter(&shared.mem, &waiting.writable, room - 1, &[status.byte()])?;
        let written = if status == Status::Ok {
            reply.length + 1
        } else {
            1
        };
        unsignalled |= complete_unsignalled(&shared.mem, &shared.ring, waiting.head, written);
    }
}

#[cfg(test)]
mod tests;
