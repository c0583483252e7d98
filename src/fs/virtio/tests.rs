//! The device driven over real guest memory and a real socket pair.

use std::sync::atomic::{AtomicUsize, Ordering};

use virtio_queue::desc::split::Descriptor;
use vm_memory::Bytes;

use super::fuzz::request;
use super::*;
use crate::virtqueue::laid_out::{self, laid_out_queue, AVAIL_RING, DESC_TABLE, USED_RING};

const SIZE: u16 = 16;

/// Guest memory with one queue of 16 laid out in it, as a driver would.
fn guest() -> (GuestMemoryMmap, Arc<Mutex<Queue>>) {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x100000)]).unwrap();
    let queue = laid_out_queue(SIZE, &mem);
    (mem, Arc::new(Mutex::new(queue)))
}

/// Offers a chain on the tests' queue of [`SIZE`].
fn offer(mem: &GuestMemoryMmap, first: u16, chain: &[(u64, u32, bool)]) {
    laid_out::offer(mem, SIZE, first, chain);
}

/// The completions on the tests' queue of [`SIZE`].
fn used(mem: &GuestMemoryMmap) -> Vec<(u32, u32)> {
    laid_out::used(mem, SIZE)
}

fn counting_shared(mem: &GuestMemoryMmap) -> (Arc<Shared>, Arc<AtomicUsize>) {
    let signals = Arc::new(AtomicUsize::new(0));
    let counter = signals.clone();
    let shared = Arc::new(Shared::new(mem.clone(), move || {
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    (shared, signals)
}

#[test]
fn a_request_goes_out_whole_and_its_reply_lands_in_its_descriptors() {
    let (mem, ring) = guest();
    let (shared, signals) = counting_shared(&mem);
    // A LOOKUP split over two readable descriptors, with 64 bytes of room for the reply.
    let bytes = request(1, 7, b"name\0");
    mem.write_slice(&bytes, GuestAddress(0x10000)).unwrap();
    offer(
        &mem,
        0,
        &[
            (0x10000, 20, false),
            (0x10014, bytes.len() as u32 - 20, false),
            (0x20000, 64, true),
        ],
    );
    let (mut helper, mut library) = UnixStream::pair().unwrap();
    drain(&shared, &ring, &mut helper, &mut Vec::new()).unwrap();
    let mut forwarded = vec![0u8; bytes.len()];
    library.read_exact(&mut forwarded).unwrap();
    assert_eq!(forwarded, bytes);
    assert!(used(&mem).is_empty(), "completed before its reply");

    let mut reply = vec![0u8; OUT_HEADER_LEN];
    reply[0..4].copy_from_slice(&24u32.to_le_bytes());
    reply[8..16].copy_from_slice(&7u64.to_le_bytes());
    reply.extend_from_slice(b"attr....");
    library.write_all(&reply).unwrap();
    drop(library);
    let completing = shared.clone();
    std::thread::spawn(move || complete_replies(&completing, helper))
        .join()
        .unwrap();
    assert_eq!(used(&mem), vec![(0, 24)]);
    let mut landed = vec![0u8; 24];
    mem.read_slice(&mut landed, GuestAddress(0x20000)).unwrap();
    assert_eq!(landed, reply);
    assert_eq!(signals.load(Ordering::SeqCst), 1);
}

#[test]
fn large_messages_move_directly_and_a_reply_past_its_room_keeps_the_framing() {
    let (mem, ring) = guest();
    let (shared, _signals) = counting_shared(&mem);
    // A 200 KiB write request over three readable descriptors.
    let data: Vec<u8> = (0..200 * 1024).map(|i| (i % 251) as u8).collect();
    let bytes = request(16, 9, &data);
    mem.write_slice(&bytes, GuestAddress(0x10000)).unwrap();
    let total = bytes.len() as u32;
    offer(
        &mem,
        0,
        &[
            (0x10000, 100, false),
            (0x10064, 70_000, false),
            (0x10064 + 70_000, total - 70_100, false),
            (0x60000, 32, true),
        ],
    );
    // A read whose 150 KiB reply gets 100 KiB + 16 of room.
    let read = request(15, 10, &[0u8; 24]);
    mem.write_slice(&read, GuestAddress(0x50000)).unwrap();
    offer(
        &mem,
        4,
        &[
            (0x50000, read.len() as u32, false),
            (0x70000, 16 + 60 * 1024, true),
            (0x90000, 40 * 1024, true),
        ],
    );
    // A small one after it.
    let lookup = request(1, 11, b"n\0");
    mem.write_slice(&lookup, GuestAddress(0x51000)).unwrap();
    offer(
        &mem,
        7,
        &[(0x51000, lookup.len() as u32, false), (0x52000, 64, true)],
    );
    let (mut helper, mut library) = UnixStream::pair().unwrap();
    let replies = helper.try_clone().unwrap();
    let completing = shared.clone();
    let completer = std::thread::spawn(move || complete_replies(&completing, replies));
    let reader = std::thread::spawn(move || {
        let mut forwarded = vec![0u8; bytes.len() + read.len() + lookup.len()];
        library.read_exact(&mut forwarded).unwrap();
        assert_eq!(forwarded, [bytes, read, lookup].concat());
        let reply = |unique: u64, body: &[u8]| {
            let mut out = vec![0u8; OUT_HEADER_LEN];
            out[0..4].copy_from_slice(&((OUT_HEADER_LEN + body.len()) as u32).to_le_bytes());
            out[8..16].copy_from_slice(&unique.to_le_bytes());
            out.extend_from_slice(body);
            out
        };
        let contents: Vec<u8> = (0..150 * 1024).map(|i| (i % 253) as u8).collect();
        let long = reply(10, &contents);
        library.write_all(&long).unwrap();
        library.write_all(&reply(9, &[7u8; 16])).unwrap();
        library.write_all(&reply(11, b"entry")).unwrap();
        long
    });
    drain(&shared, &ring, &mut helper, &mut Vec::new()).unwrap();
    let long = reader.join().unwrap();
    drop(helper);
    completer.join().unwrap();
    let room = 16 + 100 * 1024;
    let mut used = used(&mem);
    used.sort();
    assert_eq!(used, vec![(0, 32), (4, room as u32), (7, 21)]);
    let mut landed = vec![0u8; room];
    mem.read_slice(&mut landed[..16 + 60 * 1024], GuestAddress(0x70000))
        .unwrap();
    mem.read_slice(&mut landed[16 + 60 * 1024..], GuestAddress(0x90000))
        .unwrap();
    assert_eq!(landed, long[..room]);
    let mut small = [0u8; 21];
    mem.read_slice(&mut small, GuestAddress(0x52000)).unwrap();
    assert_eq!(&small[16..], b"entry");
}

#[test]
fn forgets_are_completed_at_once_and_malformed_or_reused_uniques_fail_with_eio() {
    let (mem, ring) = guest();
    let (shared, _signals) = counting_shared(&mem);
    let forget = request(FUSE_FORGET, 1, &[0u8; 8]);
    let mut bad = request(1, 2, b"x\0");
    bad[0..4].copy_from_slice(&999u32.to_le_bytes());
    let first = request(1, 3, b"a\0");
    let again = request(1, 3, b"b\0");
    for (i, (bytes, at)) in [
        (&forget, 0x10000u64),
        (&bad, 0x11000),
        (&first, 0x12000),
        (&again, 0x13000),
    ]
    .into_iter()
    .enumerate()
    {
        mem.write_slice(bytes, GuestAddress(at)).unwrap();
        let chain = [(at, bytes.len() as u32, false), (at + 0x800, 64, true)];
        offer(&mem, 2 * i as u16, &chain);
    }
    let (mut helper, mut library) = UnixStream::pair().unwrap();
    drain(&shared, &ring, &mut helper, &mut Vec::new()).unwrap();
    drop(helper);
    let mut forwarded = Vec::new();
    library.read_to_end(&mut forwarded).unwrap();
    // The FORGET and the first of the two with unique 3 went to the library.
    assert_eq!(forwarded, [forget.clone(), first.clone()].concat());
    // Completed at once: the FORGET (head 0) with nothing, the malformed one (2) and the
    // reused unique (6) with an EIO reply header; the first with unique 3 (head 4) waits for
    // its reply.
    assert_eq!(used(&mem), vec![(0, 0), (2, 16), (6, 16)]);
    assert!(shared.pending.lock().unwrap().contains_key(&3));
    for (at, unique) in [(0x11800u64, 0u64), (0x13800, 3)] {
        let mut header = [0u8; 16];
        mem.read_slice(&mut header, GuestAddress(at)).unwrap();
        assert_eq!(header[0..4], 16u32.to_le_bytes());
        assert_eq!(header[4..8], (-libc::EIO).to_le_bytes());
        assert_eq!(header[8..16], unique.to_le_bytes());
    }
}

#[test]
fn interrupts_and_unique_zero_never_wait_for_the_library() {
    let (mem, ring) = guest();
    let (shared, _signals) = counting_shared(&mem);
    const FUSE_INTERRUPT: u32 = 36;
    let interrupt = request(FUSE_INTERRUPT, 5, &[0u8; 8]);
    let zero = request(1, 0, b"a\0");
    for (i, (bytes, at)) in [(&interrupt, 0x10000u64), (&zero, 0x11000)]
        .into_iter()
        .enumerate()
    {
        mem.write_slice(bytes, GuestAddress(at)).unwrap();
        offer(
            &mem,
            2 * i as u16,
            &[(at, bytes.len() as u32, false), (at + 0x800, 64, true)],
        );
    }
    let (mut helper, _library) = UnixStream::pair().unwrap();
    drain(&shared, &ring, &mut helper, &mut Vec::new()).unwrap();
    assert_eq!(used(&mem), vec![(0, 0), (2, 16)]);
    assert!(shared.pending.lock().unwrap().is_empty());
}

#[test]
fn a_ring_that_names_no_chain_is_broken_and_not_spun_on() {
    let (mem, ring) = guest();
    let (shared, _signals) = counting_shared(&mem);
    // An available entry naming descriptor 0xffff, past the queue.
    mem.write_obj(0xffffu16, GuestAddress(AVAIL_RING + 4))
        .unwrap();
    mem.write_obj(1u16, GuestAddress(AVAIL_RING + 2)).unwrap();
    let (mut helper, _library) = UnixStream::pair().unwrap();
    let drained = drain(&shared, &ring, &mut helper, &mut Vec::new()).unwrap();
    assert_eq!(drained, Drained::Broken);
    // An index claiming more entries than the queue holds.
    let (mem, ring) = guest();
    let (shared, _signals) = counting_shared(&mem);
    mem.write_obj(SIZE + 1, GuestAddress(AVAIL_RING + 2))
        .unwrap();
    let drained = drain(&shared, &ring, &mut helper, &mut Vec::new()).unwrap();
    assert_eq!(drained, Drained::Broken);
}

#[test]
fn a_request_past_the_bounds_is_completed_unanswered() {
    let (mem, ring) = guest();
    let (shared, _signals) = counting_shared(&mem);
    // Readable bytes past MAX_REQUEST (two descriptors of a little over half each), with a
    // header whose length says so.
    let half = (MAX_REQUEST / 2 + 1) as u32;
    let long = request(16, 1, &vec![0u8; 2 * half as usize - IN_HEADER_LEN]);
    mem.write_slice(&long[..half as usize], GuestAddress(0x1_0000))
        .unwrap();
    offer(&mem, 0, &[(0x1_0000, half, false), (0x1_0000, half, false)]);
    // Readable after writable (a header saying 72 bytes, which the readable parts hold).
    mem.write_slice(&request(1, 2, &[0u8; 32]), GuestAddress(0xa_0000))
        .unwrap();
    offer(
        &mem,
        2,
        &[
            (0xa_0000, 64, false),
            (0xa_1000, 64, true),
            (0xa_0000, 8, false),
        ],
    );
    let (mut helper, library) = UnixStream::pair().unwrap();
    library.set_nonblocking(true).unwrap();
    drain(&shared, &ring, &mut helper, &mut Vec::new()).unwrap();
    assert_eq!(used(&mem), vec![(0, 0), (2, 0)]);
    let mut nothing = [0u8; 1];
    assert!(
        (&library).read(&mut nothing).is_err(),
        "something was forwarded"
    );
}

#[test]
fn in_header_is_checked_against_the_request_length() {
    let bytes = request(15, 77, &[0u8; 8]);
    let header: [u8; IN_HEADER_LEN] = bytes[..IN_HEADER_LEN].try_into().unwrap();
    assert_eq!(parse_in_header(&header, bytes.len()), Some((15, 77)));
    // A length that is not the request's own.
    assert_eq!(parse_in_header(&header, bytes.len() + 1), None);
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

/// The guest adds requests while the device drains them: an entry that appears just after the
/// device found the ring empty is served like any other. (It was once taken for a ring naming
/// no chain, which stopped the queue for good: the guest's next requests waited forever.)
#[test]
fn requests_the_guest_adds_while_the_device_drains_are_all_served() {
    const TOTAL: u32 = 20_000;
    let (mem, ring) = guest();
    let (shared, _signals) = counting_shared(&mem);
    // One FORGET, which the device completes itself, named by every entry.
    let bytes = request(FUSE_FORGET, 7, &1u64.to_le_bytes());
    mem.write_slice(&bytes, GuestAddress(0x10000)).unwrap();
    let descriptor = Descriptor::new(0x10000, bytes.len() as u32, 0, 0);
    mem.write_obj(descriptor, GuestAddress(DESC_TABLE)).unwrap();
    let used_idx = |mem: &GuestMemoryMmap| -> u16 {
        std::sync::atomic::fence(Ordering::Acquire);
        mem.read_obj(GuestAddress(USED_RING + 2)).unwrap()
    };
    let guest_mem = mem.clone();
    let driver = std::thread::spawn(move || {
        let mut idx = 0u16;
        for _ in 0..TOTAL {
            // Never more outstanding than the queue holds, as a driver would.
            while idx.wrapping_sub(used_idx(&guest_mem)) >= SIZE {
                std::thread::yield_now();
            }
            let slot = AVAIL_RING + 4 + 2 * u64::from(idx % SIZE);
            guest_mem.write_obj(0u16, GuestAddress(slot)).unwrap();
            std::sync::atomic::fence(Ordering::Release);
            idx = idx.wrapping_add(1);
            guest_mem
                .write_obj(idx, GuestAddress(AVAIL_RING + 2))
                .unwrap();
        }
    });
    let (mut helper, library) = UnixStream::pair().unwrap();
    let reader = std::thread::spawn(move || {
        let _ = std::io::copy(&mut &library, &mut std::io::sink());
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut served = 0u32;
    let mut last = 0u16;
    while served < TOTAL {
        let drained = drain(&shared, &ring, &mut helper, &mut Vec::new()).unwrap();
        assert_eq!(
            drained,
            Drained::Empty,
            "after {served} of {TOTAL} requests"
        );
        let now = used_idx(&mem);
        served += u32::from(now.wrapping_sub(last));
        last = now;
        assert!(
            std::time::Instant::now() < deadline,
            "{served} of {TOTAL} served"
        );
    }
    driver.join().unwrap();
    drop(helper);
    reader.join().unwrap();
    assert_eq!(served, TOTAL);
}
