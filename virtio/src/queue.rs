//! What the library and the helper share for the devices they serve: walking a hostile
//! guest's virtqueue and moving bytes between its memory and a socket or a file.
//!
//! A copy-on-write root's virtio-blk device in the `krunbox-vmm` helper (`vmm/devices/blk/`)
//! pops request chains off its queue and serves them from a file in place or forwards them
//! over a socket to the library; the library serves a mount's queues itself once the helper's
//! virtio-fs device hands them over (`fs/served/`). The queue handling is the same for both
//! and lives here: a chain is walked once, checked against the device's bounds and guest
//! memory, and kept as the guest addresses of its readable bytes and of its writable room.
//!
//! The queues are rust-vmm's (`virtio-queue`), built from the ring addresses the guest's driver
//! set up ([`RingLayout`]), never libkrun's: this module is libkrun-free, so the library that
//! uses it does not link libkrun.

use std::num::Wrapping;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryMmap};

/// Where one virtqueue's rings lie in guest memory, and how many entries it has, as the
/// guest's driver set it up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RingLayout {
    /// Entries (a power of two; 0 for a queue the driver never made ready).
    pub size: u16,
    /// The descriptor table's guest address.
    pub descriptors: u64,
    /// The available ring's guest address.
    pub available: u64,
    /// The used ring's guest address.
    pub used: u64,
}

/// The queue `layout` describes, of at most `max_size` entries, ready to serve; `None` when
/// it is of a bad size, misaligned, or any of its rings is not wholly in `mem`.
pub fn queue(layout: RingLayout, max_size: u16, mem: &GuestMemoryMmap) -> Option<Queue> {
    // rust-vmm's queue takes a ring at guest address 0 for one never set up, and then pops
    // nothing: refused here, so that the device goes inert at once rather than at its first
    // request.
    if layout.available == 0 {
        return None;
    }
    let mut queue = Queue::new(max_size).ok()?;
    queue.try_set_size(layout.size).ok()?;
    queue
        .try_set_desc_table_address(GuestAddress(layout.descriptors))
        .ok()?;
    queue
        .try_set_avail_ring_address(GuestAddress(layout.available))
        .ok()?;
    queue
        .try_set_used_ring_address(GuestAddress(layout.used))
        .ok()?;
    queue.set_ready(true);
    rings_in_memory(&queue, mem).then_some(queue)
}

/// Reads a device's configuration space `config` at `offset` into `data` (what lies past its
/// end reads as zeros); both devices' spaces are fixed when they are made, and read-only.
pub fn read_config_space(config: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let start = usize::try_from(offset)
        .unwrap_or(usize::MAX)
        .min(config.len());
    let end = start.saturating_add(data.len()).min(config.len());
    data[..end - start].copy_from_slice(&config[start..end]);
}

/// Whether `queue` is ready and each of its three rings lies wholly in guest memory. Both
/// libkrun's and rust-vmm's `is_valid` check only the address just past each ring's end: a
/// ring starting in a hole of guest memory (below 4 GiB for a guest of more than 3.25 GiB)
/// passes them, and libkrun's queue then panics reading it.
fn rings_in_memory(queue: &Queue, mem: &GuestMemoryMmap) -> bool {
    let size = usize::from(queue.size());
    // With VIRTIO_RING_F_EVENT_IDX each ring has two bytes more; counted either way.
    queue.is_valid(mem)
        && mem.check_range(GuestAddress(queue.desc_table()), 16 * size)
        && mem.check_range(GuestAddress(queue.avail_ring()), 6 + 2 * size + 2)
        && mem.check_range(GuestAddress(queue.used_ring()), 6 + 8 * size + 2)
}

/// A device's bounds on one request chain.
#[derive(Debug, Clone, Copy)]
pub struct ChainLimits {
    /// The most bytes the readable descriptors may hold in all.
    pub max_readable: usize,
    /// The most writable descriptors (each is remembered until the request completes).
    pub max_writable_descriptors: usize,
}

/// A request read off a queue: its head, and its descriptors, or `None` for a chain that broke
/// the bounds (the device completes it without forwarding it).
pub struct Popped {
    pub head: u16,
    pub chain: Option<Chain>,
}

/// A request chain's descriptors as (guest address, length): every one checked to lie in guest
/// memory, the readable ones all before the writable ones.
pub struct Chain {
    pub readable: Vec<(GuestAddress, u32)>,
    pub readable_len: usize,
    pub writable: Vec<(GuestAddress, u32)>,
}

impl Chain {
    /// The writable descriptors' room in bytes.
    pub fn writable_len(&self) -> usize {
        self.writable.iter().map(|(_, len)| *len as usize).sum()
    }
}

/// The next request on `queue`, its descriptors checked against `limits` and guest memory.
/// `None` when the entry names no descriptor of the queue: the ring is broken.
pub fn pop(queue: &mut Queue, mem: &GuestMemoryMmap, limits: ChainLimits) -> Option<Popped> {
    let _ = queue.disable_notification(mem);
    let head = queue.pop_descriptor_chain(mem)?;
    let index = head.head_index();
    if index >= queue.size() {
        return None;
    }
    let mut chain = Chain {
        readable: Vec::new(),
        readable_len: 0,
        writable: Vec::new(),
    };
    // rust-vmm's chain ends quietly where it cannot go on (a link past the table, a loop, a
    // descriptor it cannot read): a chain whose last descriptor still links on was cut there,
    // and is refused rather than forwarded short. It also follows indirect tables, which our
    // devices never offer (VIRTIO_RING_F_INDIRECT_DESC) and which could make a chain of up to
    // 65,535 descriptors: a chain is refused past the queue's size, as libkrun's queue bounded
    // it, and one that yields no descriptor (an indirect table that could not be read) too.
    let mut links_on = false;
    let mut valid = true;
    let mut descriptors = 0u32;
    for descriptor in head {
        descriptors += 1;
        if descriptors > u32::from(queue.size()) {
            valid = false;
            break;
        }
        links_on = descriptor.has_next();
        let (addr, len) = (descriptor.addr(), descriptor.len());
        if !mem.check_range(addr, len as usize) {
            valid = false;
            break;
        }
        if descriptor.is_write_only() {
            if chain.writable.len() == limits.max_writable_descriptors {
                valid = false;
                break;
            }
            chain.writable.push((addr, len));
            continue;
        }
        chain.readable_len = chain.readable_len.saturating_add(len as usize);
        if !chain.writable.is_empty() || chain.readable_len > limits.max_readable {
            // Readable after writable, or more than any request of the device.
            valid = false;
            break;
        }
        chain.readable.push((addr, len));
    }
    Some(Popped {
        head: index,
        chain: (valid && !links_on && descriptors > 0).then_some(chain),
    })
}

/// How many entries the guest made available that were not taken yet, or `None` when the
/// ring cannot be read (never, for a ring [`queue`] accepted).
fn available(queue: &Queue, mem: &GuestMemoryMmap) -> Option<u16> {
    let index = queue.avail_idx(mem, Ordering::Acquire).ok()?;
    Some((index - Wrapping(queue.next_avail())).0)
}

/// How [`drain`] left a queue.
#[derive(Debug, PartialEq, Eq)]
pub enum Drained {
    /// Nothing more on it; notifications are on.
    Empty,
    /// The guest's ring claims more than the queue holds, or entries no chain starts at.
    Broken,
}

/// Hands everything on one queue to `forward`, with notifications off while there is more.
pub fn drain(
    mem: &GuestMemoryMmap,
    ring: &Mutex<Queue>,
    limits: ChainLimits,
    mut forward: impl FnMut(Popped) -> std::io::Result<()>,
) -> std::io::Result<Drained> {
    loop {
        match next_request(mem, ring, limits) {
            Next::Request(request) => forward(request)?,
            Next::Drained(drained) => return Ok(drained),
        }
    }
}

/// What [`next_request`] found on a queue.
pub enum Next {
    /// A request, taken off the queue (notifications are off).
    Request(Popped),
    /// None: the queue is empty or broken.
    Drained(Drained),
}

/// The next request on one queue, with notifications off while there is more, or how the
/// queue was left when there is none.
pub fn next_request(mem: &GuestMemoryMmap, ring: &Mutex<Queue>, limits: ChainLimits) -> Next {
    let mut queue = ring.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        // The ring was checked to lie in guest memory when the device was activated, so
        // reading its index does not fail. The index is read once here and the decision
        // made on that reading: the guest adds entries while we look, so a second reading
        // (after `pop` found none) may show one that was not there for `pop`, and taking
        // that for a broken ring stopped the queue for good under a busy guest.
        let Some(available) = available(&queue, mem) else {
            return Next::Drained(Drained::Broken);
        };
        if available > queue.size() {
            return Next::Drained(Drained::Broken);
        }
        if available == 0 {
            // Notifications back on; if the guest added requests meanwhile, go on.
            let more = queue.enable_notification(mem).unwrap_or(false);
            if more {
                let _ = queue.disable_notification(mem);
                continue;
            }
            return Next::Drained(Drained::Empty);
        }
        return match pop(&mut queue, mem, limits) {
            Some(request) => Next::Request(request),
            // An entry was there (the index never goes back for an honest guest), and no
            // chain starts at it.
            None => Next::Drained(Drained::Broken),
        };
    }
}

/// Waits for the guest's notifications on `events` (one per ring) and drains the notified
/// ring with `drain_one(index)`, until draining fails (the library is gone). A ring the guest
/// broke is no longer served: popping would find nothing, forever, while the ring says there
/// is more.
pub fn serve_notifications(
    events: &[Arc<impl AsRawFd>],
    tag: &str,
    mut drain_one: impl FnMut(usize) -> std::io::Result<Drained>,
) {
    let mut fds: Vec<libc::pollfd> = events
        .iter()
        .map(|event| libc::pollfd {
            fd: event.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let mut broken = vec![false; events.len()];
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
            clear_eventfd(fd.fd);
            if broken[index] {
                continue;
            }
            match drain_one(index) {
                Ok(Drained::Empty) => {}
                Ok(Drained::Broken) => {
                    eprintln!("krunbox-vmm: device {tag}: the guest broke queue {index}; it is no longer served");
                    broken[index] = true;
                }
                // The library is gone: the instance is being torn down.
                Err(_) => return,
            }
        }
    }
}

/// Reads an eventfd's count, so that `poll` waits for the next write. The count itself does
/// not matter: a notified ring is drained whole.
fn clear_eventfd(fd: std::os::fd::RawFd) {
    let mut count = [0u8; 8];
    // SAFETY: an 8-byte read into a live buffer of 8 bytes.
    let _ = unsafe { libc::read(fd, count.as_mut_ptr().cast(), count.len()) };
}

/// Marks a request done, having written `written` bytes into its chain, and interrupts the
/// guest with `signal` when it asked to be.
pub fn complete(
    mem: &GuestMemoryMmap,
    ring: &Mutex<Queue>,
    head: u16,
    written: u32,
    signal: &(dyn Fn() + Send + Sync),
) {
    if complete_unsignalled(mem, ring, head, written) {
        signal();
    }
}

/// Marks a request done, having written `written` bytes into its chain; returns whether the
/// guest asked to be interrupted (the caller does it, once for several completions).
pub fn complete_unsignalled(
    mem: &GuestMemoryMmap,
    ring: &Mutex<Queue>,
    head: u16,
    written: u32,
) -> bool {
    let mut queue = ring.lock().unwrap_or_else(|p| p.into_inner());
    queue.add_used(mem, head, written).is_ok() && queue.needs_notification(mem).unwrap_or(true)
}

/// Calls `each` with the (address, length) pieces of bytes `skip..skip + len` of `regions`.
pub fn for_each_piece(
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
pub fn memory_error(err: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(format!("guest memory: {err}"))
}

/// Copies bytes `skip..skip + out.len()` of `regions` into `out`.
pub fn gather(
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

/// Copies `bytes` into `regions` from byte `skip` on (they hold at least as many).
pub fn scatter(
    mem: &GuestMemoryMmap,
    regions: &[(GuestAddress, u32)],
    skip: usize,
    bytes: &[u8],
) -> std::io::Result<()> {
    let mut at = 0;
    for_each_piece(regions, skip, bytes.len(), |address, len| {
        mem.write_slice(&bytes[at..at + len], address)
            .map_err(memory_error)?;
        at += len;
        Ok(())
    })
}

/// Writes `prefix` and then bytes `skip..skip + len` of `regions` to `socket`, straight from
/// guest memory: one `writev` for all of it where the socket takes it.
pub fn send_from_guest(
    mem: &GuestMemoryMmap,
    prefix: &[u8],
    regions: &[(GuestAddress, u32)],
    skip: usize,
    len: usize,
    socket: &mut UnixStream,
) -> std::io::Result<()> {
    let mut iovecs = vec![libc::iovec {
        iov_base: prefix.as_ptr() as *mut libc::c_void,
        iov_len: prefix.len(),
    }];
    host_iovecs(mem, regions, skip, len, &mut iovecs)?;
    // SAFETY: the iovecs point at `prefix` (alive for this call) and into guest memory (mapped
    // while `mem` lives), and `writev` only reads through them.
    unsafe { transfer_all(socket.as_raw_fd(), &mut iovecs, Direction::Send) }
}

/// Reads `len` bytes from `socket` into bytes `skip..skip + len` of `regions`, straight into
/// guest memory: one `readv` for all of it where the socket has it.
pub fn receive_into_guest(
    mem: &GuestMemoryMmap,
    regions: &[(GuestAddress, u32)],
    skip: usize,
    len: usize,
    socket: &mut UnixStream,
) -> std::io::Result<()> {
    let mut iovecs = Vec::new();
    host_iovecs(mem, regions, skip, len, &mut iovecs)?;
    // SAFETY: the iovecs point into guest memory, mapped and writable while `mem` lives (the
    // guest may change those bytes meanwhile: its own business, and `readv` does not care).
    unsafe { transfer_all(socket.as_raw_fd(), &mut iovecs, Direction::Receive) }
}

/// Writes bytes `skip..skip + len` of `regions` into `file` at `offset`, straight from guest
/// memory: one `pwritev` for all of it where the file takes it.
pub fn write_at_from_guest(
    mem: &GuestMemoryMmap,
    regions: &[(GuestAddress, u32)],
    skip: usize,
    len: usize,
    file: &impl AsRawFd,
    offset: u64,
) -> std::io::Result<()> {
    let mut iovecs = Vec::new();
    host_iovecs(mem, regions, skip, len, &mut iovecs)?;
    // SAFETY: the iovecs point into guest memory (mapped while `mem` lives), and `pwritev`
    // only reads through them.
    unsafe { transfer_all(file.as_raw_fd(), &mut iovecs, Direction::WriteAt(offset)) }
}

/// Writes bytes `skip..skip + len` of `regions` into `file` at `offset` as
/// [`write_at_from_guest`] does, but a failure after some bytes were written is not an error:
/// it returns how many were (as `pwrite` does, so a write that fills the disk is a short one).
pub fn write_some_at_from_guest(
    mem: &GuestMemoryMmap,
    regions: &[(GuestAddress, u32)],
    skip: usize,
    len: usize,
    file: &impl AsRawFd,
    offset: u64,
) -> std::io::Result<usize> {
    let mut iovecs = Vec::new();
    host_iovecs(mem, regions, skip, len, &mut iovecs)?;
    let mut done = 0;
    // SAFETY: the iovecs point into guest memory (mapped while `mem` lives), and `pwritev`
    // only reads through them.
    let result = unsafe {
        transfer_counted(
            file.as_raw_fd(),
            &mut iovecs,
            Direction::WriteAt(offset),
            &mut done,
        )
    };
    match result {
        Err(err) if done == 0 => Err(err),
        _ => Ok(done as usize),
    }
}

/// Reads `len` bytes of `file` at `offset` into bytes `skip..skip + len` of `regions`,
/// straight into guest memory: one `preadv` for all of it where the file has it. Past the
/// file's end the bytes are zeros (a sparse disk file need not reach its disk's end).
pub fn read_at_into_guest(
    mem: &GuestMemoryMmap,
    regions: &[(GuestAddress, u32)],
    skip: usize,
    len: usize,
    file: &std::fs::File,
    offset: u64,
) -> std::io::Result<()> {
    let mut iovecs = Vec::new();
    host_iovecs(mem, regions, skip, len, &mut iovecs)?;
    // SAFETY: the iovecs point into guest memory, mapped and writable while `mem` lives.
    unsafe { transfer_all(file.as_raw_fd(), &mut iovecs, Direction::ReadAt(offset)) }
}

/// Reads `len` bytes from `reader` into bytes `skip..skip + len` of `regions`: what `reader`
/// holds already, then the rest straight from its socket into guest memory.
pub fn receive_buffered_into_guest(
    mem: &GuestMemoryMmap,
    regions: &[(GuestAddress, u32)],
    skip: usize,
    len: usize,
    reader: &mut std::io::BufReader<UnixStream>,
) -> std::io::Result<()> {
    use std::io::BufRead;
    let buffered = reader.buffer().len().min(len);
    scatter(mem, regions, skip, &reader.buffer()[..buffered])?;
    reader.consume(buffered);
    if len > buffered {
        receive_into_guest(
            mem,
            regions,
            skip + buffered,
            len - buffered,
            reader.get_mut(),
        )?;
    }
    Ok(())
}

/// Appends the host addresses of bytes `skip..skip + len` of `regions` as iovecs. Every range
/// was checked to lie in guest memory when the chain was popped.
fn host_iovecs(
    mem: &GuestMemoryMmap,
    regions: &[(GuestAddress, u32)],
    skip: usize,
    len: usize,
    iovecs: &mut Vec<libc::iovec>,
) -> std::io::Result<()> {
    for_each_piece(regions, skip, len, |address, len| {
        for slice in mem.get_slices(address, len) {
            let slice = slice.map_err(memory_error)?;
            iovecs.push(libc::iovec {
                iov_base: slice.ptr_guard_mut().as_ptr() as *mut libc::c_void,
                iov_len: slice.len(),
            });
        }
        Ok(())
    })
}

/// Which way [`transfer_all`] moves bytes: through a socket, or to or from a file at an
/// offset.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Send,
    Receive,
    WriteAt(u64),
    ReadAt(u64),
}

/// Moves every byte of `iovecs` to or from `fd`, in as few system calls as it takes (at most
/// `IOV_MAX` iovecs each), again after `EINTR`. A call that moves nothing is the end of the
/// socket (`WriteZero` or `UnexpectedEof`), or of the file: a positional read then fills the
/// rest with zeros, a positional write fails with `WriteZero`.
///
/// # Safety
/// Every iovec must point at memory valid for its length, writable to receive or read.
unsafe fn transfer_all(
    fd: std::os::fd::RawFd,
    iovecs: &mut [libc::iovec],
    direction: Direction,
) -> std::io::Result<()> {
    let mut done = 0;
    // SAFETY: the caller vouches for the iovecs.
    unsafe { transfer_counted(fd, iovecs, direction, &mut done) }
}

/// [`transfer_all`], counting in `done` (0 on entry: a positional transfer's offset advances
/// by it) the bytes moved, also those before a failure.
///
/// # Safety
/// As for [`transfer_all`].
unsafe fn transfer_counted(
    fd: std::os::fd::RawFd,
    iovecs: &mut [libc::iovec],
    direction: Direction,
    done: &mut u64,
) -> std::io::Result<()> {
    /// Linux's `IOV_MAX`.
    const IOV_MAX: usize = 1024;
    debug_assert_eq!(*done, 0, "a positional transfer starts at its offset");
    let mut at = 0;
    loop {
        while at < iovecs.len() && iovecs[at].iov_len == 0 {
            at += 1;
        }
        if at == iovecs.len() {
            return Ok(());
        }
        let batch = &iovecs[at..iovecs.len().min(at + IOV_MAX)];
        // SAFETY: the caller vouches for the iovecs.
        let count = batch.len() as libc::c_int;
        let moved = unsafe {
            match direction {
                Direction::Send => libc::writev(fd, batch.as_ptr(), count),
                Direction::Receive => libc::readv(fd, batch.as_ptr(), count),
                Direction::WriteAt(offset) => {
                    libc::pwritev(fd, batch.as_ptr(), count, (offset + *done) as libc::off_t)
                }
                Direction::ReadAt(offset) => {
                    libc::preadv(fd, batch.as_ptr(), count, (offset + *done) as libc::off_t)
                }
            }
        };
        if moved < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if moved == 0 {
            return match direction {
                Direction::Send | Direction::WriteAt(_) => {
                    Err(std::io::ErrorKind::WriteZero.into())
                }
                Direction::Receive => Err(std::io::ErrorKind::UnexpectedEof.into()),
                Direction::ReadAt(_) => {
                    for iovec in &iovecs[at..] {
                        // SAFETY: the caller vouches that each iovec is writable memory of its
                        // length (the first one advanced past what was read, still inside it).
                        unsafe {
                            std::ptr::write_bytes(iovec.iov_base as *mut u8, 0, iovec.iov_len)
                        };
                    }
                    Ok(())
                }
            };
        }
        *done += moved as u64;
        let mut moved = moved as usize;
        while moved > 0 {
            let first = &mut iovecs[at];
            if moved >= first.iov_len {
                moved -= first.iov_len;
                at += 1;
            } else {
                // SAFETY: still inside the same iovec's memory.
                first.iov_base =
                    unsafe { (first.iov_base as *mut u8).add(moved) } as *mut libc::c_void;
                first.iov_len -= moved;
                moved = 0;
            }
        }
    }
}

/// A queue laid out at fixed places in guest memory, as a driver leaves it: for the devices'
/// unit tests and fuzz targets, which play the guest's driver.
#[cfg(any(test, feature = "fixtures"))]
pub mod laid_out {
    use virtio_queue::desc::split::Descriptor;
    use virtio_queue::Queue;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    use super::RingLayout;

    /// Where the descriptor table, the available ring and the used ring are.
    pub const DESC_TABLE: u64 = 0;
    pub const AVAIL_RING: u64 = 0x1000;
    pub const USED_RING: u64 = 0x2000;

    /// A queue of `size` whose rings are at [`DESC_TABLE`], [`AVAIL_RING`] and [`USED_RING`],
    /// ready.
    pub fn laid_out_queue(size: u16, mem: &GuestMemoryMmap) -> Queue {
        super::queue(layout(size), size, mem).expect("a queue laid out in memory")
    }

    /// Where [`laid_out_queue`]'s rings are, for a queue of `size`.
    pub fn layout(size: u16) -> RingLayout {
        RingLayout {
            size,
            descriptors: DESC_TABLE,
            available: AVAIL_RING,
            used: USED_RING,
        }
    }

    /// Puts a chain of (address, length, writable) descriptors at descriptor `first` onwards
    /// of a queue of `size` and makes it available.
    pub fn offer(mem: &GuestMemoryMmap, size: u16, first: u16, chain: &[(u64, u32, bool)]) {
        const F_NEXT: u16 = 1;
        const F_WRITE: u16 = 2;
        for (i, (addr, len, writable)) in chain.iter().enumerate() {
            let index = first + i as u16;
            let mut flags = if *writable { F_WRITE } else { 0 };
            if i + 1 < chain.len() {
                flags |= F_NEXT;
            }
            let descriptor = Descriptor::new(*addr, *len, flags, index + 1);
            mem.write_obj(descriptor, GuestAddress(DESC_TABLE + 16 * u64::from(index)))
                .unwrap();
        }
        let idx: u16 = mem.read_obj(GuestAddress(AVAIL_RING + 2)).unwrap();
        let slot = AVAIL_RING + 4 + 2 * u64::from(idx % size);
        mem.write_obj(first, GuestAddress(slot)).unwrap();
        mem.write_obj(idx.wrapping_add(1), GuestAddress(AVAIL_RING + 2))
            .unwrap();
    }

    /// The used ring's completions so far, of a queue of `size`: (head, bytes written).
    pub fn used(mem: &GuestMemoryMmap, size: u16) -> Vec<(u32, u32)> {
        let idx: u16 = mem.read_obj(GuestAddress(USED_RING + 2)).unwrap();
        (0..idx)
            .map(|i| {
                let at = USED_RING + 4 + 8 * u64::from(i % size);
                let id: u32 = mem.read_obj(GuestAddress(at)).unwrap();
                let len: u32 = mem.read_obj(GuestAddress(at + 4)).unwrap();
                (id, len)
            })
            .collect()
    }

    /// A fuzz input's guest memory: the rings low, then what the input puts there from
    /// [`DATA`] on.
    pub const MEMORY: u64 = 256 * 1024;
    pub const DATA: u64 = 0x4000;

    /// Reads a fuzz input front to back; past its end, zeros.
    pub struct Input<'a>(pub &'a [u8]);

    impl Input<'_> {
        fn take<const N: usize>(&mut self) -> [u8; N] {
            let mut out = [0u8; N];
            let n = N.min(self.0.len());
            out[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            out
        }
        pub fn u8(&mut self) -> u8 {
            self.take::<1>()[0]
        }
        pub fn u16(&mut self) -> u16 {
            u16::from_le_bytes(self.take())
        }
        pub fn u32(&mut self) -> u32 {
            u32::from_le_bytes(self.take())
        }

        /// Puts the rest of the input into guest memory at [`DATA`] (what fits).
        pub fn fill_memory(&mut self, mem: &GuestMemoryMmap) {
            let rest = &self.0[..self.0.len().min((MEMORY - DATA) as usize)];
            mem.write_slice(rest, GuestAddress(DATA))
                .expect("in memory");
            self.0 = &self.0[rest.len()..];
        }
    }

    /// A hostile guest's queue, from a fuzz input: any descriptor table and available ring.
    pub struct HostileQueue {
        pub mem: GuestMemoryMmap,
        pub size: u16,
        /// Entries on the available ring.
        pub offered: u16,
    }

    impl HostileQueue {
        /// Reads the queue's size, its descriptor table and its available ring from `input`:
        /// addresses past the rings (some outside memory: a guest that points a device's
        /// writes at its own rings only corrupts them, which is its own business and would
        /// only blur what a fuzz target checks), lengths up to 128 KiB, any flags and links.
        pub fn from_input(input: &mut Input) -> Self {
            let size = 1u16 << (input.u8() % 6 + 1); // 2 to 64
            let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEMORY as usize)])
                .expect("guest memory");
            for index in 0..u64::from(size) {
                let addr = DATA + u64::from(input.u32()) % (MEMORY - DATA + 0x1000);
                let len = input.u32() % 0x2_0000;
                let flags = input.u16();
                let next = input.u16();
                let mut raw = [0u8; 16];
                raw[..8].copy_from_slice(&addr.to_le_bytes());
                raw[8..12].copy_from_slice(&len.to_le_bytes());
                raw[12..14].copy_from_slice(&flags.to_le_bytes());
                raw[14..16].copy_from_slice(&next.to_le_bytes());
                mem.write_slice(&raw, GuestAddress(DESC_TABLE + 16 * index))
                    .expect("in memory");
            }
            let offered = u16::from(input.u8()) % (size + 1);
            for slot in 0..offered {
                let head = input.u16();
                mem.write_obj(head, GuestAddress(AVAIL_RING + 4 + 2 * u64::from(slot)))
                    .expect("in memory");
            }
            mem.write_obj(offered, GuestAddress(AVAIL_RING + 2))
                .expect("in memory");
            HostileQueue { mem, size, offered }
        }
    }

    /// The completions on a queue of `size` with `offered` entries, as (head, bytes written),
    /// checked: no more than were offered, each naming a descriptor of the queue, none twice
    /// unless the guest offered it twice.
    pub fn check_completions(mem: &GuestMemoryMmap, size: u16, offered: u16) -> Vec<(u32, u32)> {
        let used: u16 = mem
            .read_obj(GuestAddress(USED_RING + 2))
            .expect("in memory");
        assert!(used <= offered, "{used} completions for {offered} chains");
        let mut heads = std::collections::HashSet::new();
        let mut completions = Vec::new();
        for slot in 0..u64::from(used) {
            let at = USED_RING + 4 + 8 * slot;
            let head: u32 = mem.read_obj(GuestAddress(at)).expect("in memory");
            let len: u32 = mem.read_obj(GuestAddress(at + 4)).expect("in memory");
            assert!(
                head < u32::from(size),
                "completed head {head} of a queue of {size}"
            );
            assert!(heads.insert(head) || offered_twice(mem, offered, head));
            completions.push((head, len));
        }
        completions
    }

    /// Whether the guest offered `head` more than once (then it may be completed more than
    /// once).
    fn offered_twice(mem: &GuestMemoryMmap, offered: u16, head: u32) -> bool {
        (0..u64::from(offered))
            .filter(|slot| {
                mem.read_obj::<u16>(GuestAddress(AVAIL_RING + 4 + 2 * slot))
                    .is_ok_and(|h| u32::from(h) == head)
            })
            .count()
            > 1
    }

    /// A fuzz input for [`HostileQueue::from_input`]: a queue of 4 with chains of (address,
    /// length, writable) descriptors, offered in order, then `answers` (the target's own
    /// bytes), then `memory` at [`DATA`].
    pub fn seed(chains: &[&[(u64, u32, bool)]], answers: &[u8], memory: &[u8]) -> Vec<u8> {
        let mut out = vec![1u8]; // a queue of 4
        let mut table = Vec::new();
        let mut heads = Vec::new();
        for chain in chains {
            heads.push(table.len() as u16);
            for (i, (addr, len, writable)) in chain.iter().enumerate() {
                let mut flags = if *writable { 2u16 } else { 0 };
                let next = table.len() as u16 + 1;
                if i + 1 < chain.len() {
                    flags |= 1;
                }
                // Stored as the input holds it: an offset from DATA.
                table.push(((*addr - DATA) as u32, *len, flags, next));
            }
        }
        table.resize(4, (0, 0, 0, 0));
        for (addr, len, flags, next) in table {
            out.extend_from_slice(&addr.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&flags.to_le_bytes());
            out.extend_from_slice(&next.to_le_bytes());
        }
        out.push(heads.len() as u8);
        for head in heads {
            out.extend_from_slice(&head.to_le_bytes());
        }
        out.extend_from_slice(answers);
        out.extend_from_slice(memory);
        out
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;

    use super::*;

    /// Shrinks a socket's send buffer, so that one `writev` moves only part of what it is given.
    fn small_send_buffer(socket: &UnixStream) {
        let size: libc::c_int = 4096;
        // SAFETY: setsockopt with a valid int option on an open socket.
        let done = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                &size as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(done, 0);
    }

    /// A ring whose end lies in guest memory and whose start lies in a hole is refused (libkrun's
    /// own check passes it, and its queue would then panic reading the ring).
    #[test]
    fn a_ring_starting_in_a_hole_of_guest_memory_is_refused() {
        let mem = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x10000),
            (GuestAddress(0x20000), 0x10000),
        ])
        .unwrap();
        let mut layout = RingLayout {
            size: 1024,
            descriptors: 0x20000,
            used: 0x24000,
            available: 0x2a000,
        };
        assert!(
            queue(layout, 1024, &mem).is_some(),
            "a queue wholly in memory"
        );
        // 2054 bytes from 0x20000 - 1024: ends in the second region, starts in the hole.
        layout.available = 0x20000 - 1024;
        let mut unchecked = Queue::new(1024).unwrap();
        unchecked.try_set_size(1024).unwrap();
        unchecked
            .try_set_desc_table_address(GuestAddress(layout.descriptors))
            .unwrap();
        unchecked
            .try_set_avail_ring_address(GuestAddress(layout.available))
            .unwrap();
        unchecked
            .try_set_used_ring_address(GuestAddress(layout.used))
            .unwrap();
        unchecked.set_ready(true);
        assert!(unchecked.is_valid(&mem), "rust-vmm's check passes it");
        assert!(queue(layout, 1024, &mem).is_none());
        layout.available = 0x2a000;
        layout.descriptors = 0x20000 - 0x1000;
        assert!(queue(layout, 1024, &mem).is_none());
        // Of a bad size, misaligned, or never made ready: refused too.
        layout.descriptors = 0x20000;
        assert!(queue(
            RingLayout {
                size: 1000,
                ..layout
            },
            1024,
            &mem
        )
        .is_none());
        assert!(queue(
            RingLayout {
                size: 2048,
                ..layout
            },
            1024,
            &mem
        )
        .is_none());
        assert!(queue(RingLayout { size: 0, ..layout }, 1024, &mem).is_none());
        assert!(queue(
            RingLayout {
                descriptors: 0x20008,
                ..layout
            },
            1024,
            &mem
        )
        .is_none());
        assert!(queue(
            RingLayout {
                available: 0,
                ..layout
            },
            1024,
            &mem
        )
        .is_none());
    }

    /// An honest chain is taken whole. A chain whose link leaves the table, or that loops, is
    /// refused (completed without being forwarded): rust-vmm's chain would end there quietly
    /// and hand over what it had read. An entry naming no descriptor of the queue breaks it.
    #[test]
    fn chains_cut_short_are_refused_and_a_head_past_the_table_breaks_the_ring() {
        use virtio_queue::desc::split::Descriptor;
        const NEXT: u16 = 1;
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x100000)]).unwrap();
        let mut queue = laid_out::laid_out_queue(4, &mem);
        let limits = ChainLimits {
            max_readable: 1 << 20,
            max_writable_descriptors: 8,
        };
        let descriptor = |index: u64, next: u16| {
            mem.write_obj(
                Descriptor::new(0x10000, 100, NEXT, next),
                GuestAddress(laid_out::DESC_TABLE + 16 * index),
            )
            .unwrap();
        };

        laid_out::offer(&mem, 4, 0, &[(0x10000, 100, false), (0x11000, 50, true)]);
        let honest = pop(&mut queue, &mem, limits).expect("an entry");
        assert_eq!(honest.head, 0);
        let chain = honest.chain.expect("an honest chain is forwarded");
        assert_eq!(chain.readable, vec![(GuestAddress(0x10000), 100)]);
        assert_eq!(chain.writable, vec![(GuestAddress(0x11000), 50)]);

        laid_out::offer(&mem, 4, 2, &[(0x10000, 100, false)]);
        descriptor(2, 7); // links past a table of 4
        let cut = pop(&mut queue, &mem, limits).expect("an entry");
        assert_eq!(cut.head, 2);
        assert!(cut.chain.is_none(), "a chain linking out of the table");

        laid_out::offer(&mem, 4, 3, &[(0x10000, 100, false)]);
        descriptor(3, 3); // links to itself
        let looped = pop(&mut queue, &mem, limits).expect("an entry");
        assert_eq!(looped.head, 3);
        assert!(looped.chain.is_none(), "a chain that loops");

        // An indirect table (never offered) of 64 descriptors on a queue of 4: refused past
        // the queue's size; one that cannot be read (length 0) yields nothing: refused too.
        const INDIRECT: u16 = 4;
        let table = 0x20000u64;
        for i in 0..64u64 {
            let (flags, next) = if i < 63 { (NEXT, i as u16 + 1) } else { (0, 0) };
            mem.write_obj(
                Descriptor::new(0x10000, 0, flags, next),
                GuestAddress(table + 16 * i),
            )
            .unwrap();
        }
        laid_out::offer(&mem, 4, 0, &[(table, 64 * 16, false)]);
        mem.write_obj(
            Descriptor::new(table, 64 * 16, INDIRECT, 0),
            GuestAddress(laid_out::DESC_TABLE),
        )
        .unwrap();
        let long = pop(&mut queue, &mem, limits).expect("an entry");
        assert!(
            long.chain.is_none(),
            "an indirect chain past the queue's size"
        );
        laid_out::offer(&mem, 4, 1, &[(table, 0, false)]);
        mem.write_obj(
            Descriptor::new(table, 0, INDIRECT, 0),
            GuestAddress(laid_out::DESC_TABLE + 16),
        )
        .unwrap();
        let empty = pop(&mut queue, &mem, limits).expect("an entry");
        assert!(
            empty.chain.is_none(),
            "an indirect table that cannot be read"
        );

        laid_out::offer(&mem, 4, 9, &[(0x10000, 100, false)]);
        assert!(
            pop(&mut queue, &mem, limits).is_none(),
            "head 9 of a queue of 4"
        );
    }

    #[test]
    fn pieces_cover_exactly_the_range_asked_for() {
        let regions = [
            (GuestAddress(100), 10),
            (GuestAddress(200), 5),
            (GuestAddress(300), 20),
        ];
        let mut pieces = Vec::new();
        for_each_piece(&regions, 12, 10, |address, len| {
            pieces.push((address.0, len));
            Ok(())
        })
        .unwrap();
        assert_eq!(pieces, vec![(202, 3), (300, 7)]);
    }

    /// 1500 regions (more than one `writev` takes), some of them empty, through a socket whose
    /// buffer is far smaller than the data: every byte arrives once, in order, both ways.
    #[test]
    fn moves_across_partial_transfers_many_iovecs_and_empty_regions() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x200000)]).unwrap();
        let regions: Vec<(GuestAddress, u32)> = (0..1500u64)
            .map(|i| (GuestAddress(i * 512), if i % 7 == 3 { 0 } else { 300 }))
            .collect();
        let total: usize = regions.iter().map(|(_, len)| *len as usize).sum();
        let pattern: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
        scatter(&mem, &regions, 0, &pattern).unwrap();

        let (mut sender, mut receiver) = UnixStream::pair().unwrap();
        small_send_buffer(&sender);
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            receiver.read_to_end(&mut got).unwrap();
            got
        });
        send_from_guest(&mem, b"head", &regions, 100, total - 100, &mut sender).unwrap();
        drop(sender);
        let got = reader.join().unwrap();
        assert_eq!(&got[..4], b"head");
        assert_eq!(&got[4..], &pattern[100..]);

        // And back into other memory, the writer dribbling a few bytes at a time.
        let back: Vec<(GuestAddress, u32)> = regions
            .iter()
            .map(|(at, len)| (GuestAddress(at.0 + 0x100000), *len))
            .collect();
        let (mut writer, mut reading) = UnixStream::pair().unwrap();
        let source = pattern.clone();
        let dribbler = std::thread::spawn(move || {
            for chunk in source.chunks(997) {
                writer.write_all(chunk).unwrap();
            }
        });
        receive_into_guest(&mem, &back, 0, total, &mut reading).unwrap();
        dribbler.join().unwrap();
        let mut landed = vec![0u8; total];
        gather(&mem, &back, 0, &mut landed).unwrap();
        assert_eq!(landed, pattern);
        // A socket that ends early is an error, not a short success.
        let (mut writer, mut reading) = UnixStream::pair().unwrap();
        writer.write_all(&pattern[..10]).unwrap();
        drop(writer);
        let err = receive_into_guest(&mem, &back, 0, total, &mut reading).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    /// 1500 regions (more than one `pwritev` takes), some empty, into a file at an offset and
    /// back; a read reaching past the file's end gets zeros there, not the memory's old bytes.
    #[test]
    fn moves_to_and_from_a_file_at_an_offset_with_zeros_past_its_end() {
        use std::os::unix::fs::FileExt;
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x200000)]).unwrap();
        let regions: Vec<(GuestAddress, u32)> = (0..1500u64)
            .map(|i| (GuestAddress(i * 512), if i % 7 == 3 { 0 } else { 300 }))
            .collect();
        let total: usize = regions.iter().map(|(_, len)| *len as usize).sum();
        let pattern: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
        scatter(&mem, &regions, 0, &pattern).unwrap();
        let file = tempfile::tempfile().unwrap();
        write_at_from_guest(&mem, &regions, 100, total - 100, &file, 4096).unwrap();
        assert_eq!(file.metadata().unwrap().len(), 4096 + total as u64 - 100);
        let mut stored = vec![0u8; total - 100];
        file.read_exact_at(&mut stored, 4096).unwrap();
        assert_eq!(stored, pattern[100..]);

        let back: Vec<(GuestAddress, u32)> = regions
            .iter()
            .map(|(at, len)| (GuestAddress(at.0 + 0x100000), *len))
            .collect();
        // Memory full of 0xff, then a read from 1000 bytes before the file's end.
        scatter(&mem, &back, 0, &vec![0xff; total]).unwrap();
        let end = file.metadata().unwrap().len();
        read_at_into_guest(&mem, &back, 0, total, &file, end - 1000).unwrap();
        let mut landed = vec![0u8; total];
        gather(&mem, &back, 0, &mut landed).unwrap();
        assert_eq!(&landed[..1000], &pattern[total - 1000..]);
        assert!(
            landed[1000..].iter().all(|b| *b == 0),
            "past the end is zeros"
        );
        // Wholly inside: exactly the file's bytes.
        read_at_into_guest(&mem, &back, 7, 5000, &file, 4096).unwrap();
        let mut inside = vec![0u8; 5000];
        gather(&mem, &back, 7, &mut inside).unwrap();
        assert_eq!(inside, pattern[100..5100]);
    }
}
