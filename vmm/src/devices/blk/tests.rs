//! The layer disk's device driven over real guest memory and a real socket pair, served by the
//! library's real service over a real copy-on-write layer (in a `MemoryStore`).

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use vm_memory::Bytes;

use super::fuzz::{counted, failure_count};
use super::*;
use krunbox::fuzzing::MemoryLayerDisk;
use krunbox_virtio::disk_wire as wire;
use krunbox_virtio::queue::laid_out::{self, laid_out_queue};

const SIZE: u16 = 16;
const DISK: u64 = 64 << 20;
const SERIAL: &str = "a-test-disk";

/// Guest memory and the device's shared state over it, with a queue of [`SIZE`] laid out;
/// the count of interrupts.
fn device(capacity: u64) -> (Arc<Shared>, Arc<AtomicUsize>) {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x100000)]).unwrap();
    let queue = laid_out_queue(SIZE, &mem);
    let signals = Arc::new(AtomicUsize::new(0));
    let counter = signals.clone();
    let mut serial = [0u8; SERIAL_LEN];
    serial[..SERIAL.len()].copy_from_slice(SERIAL.as_bytes());
    let shared = Arc::new(Shared {
        mem,
        signal: Box::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        }),
        ring: Mutex::new(queue),
        pending: Mutex::new(Pending::default()),
        capacity,
        serial,
    });
    (shared, signals)
}

fn offer(shared: &Shared, first: u16, chain: &[(u64, u32, bool)]) {
    laid_out::offer(&shared.mem, SIZE, first, chain);
}

fn used(shared: &Shared) -> Vec<(u32, u32)> {
    laid_out::used(&shared.mem, SIZE)
}

/// A guest driver's request header at `at`: `kind`, `sector`.
fn header(shared: &Shared, at: u64, kind: u32, sector: u64) {
    let mut bytes = [0u8; BLK_HEADER_LEN];
    bytes[0..4].copy_from_slice(&kind.to_le_bytes());
    bytes[8..16].copy_from_slice(&sector.to_le_bytes());
    shared.mem.write_slice(&bytes, GuestAddress(at)).unwrap();
}

fn status(shared: &Shared, at: u64) -> u8 {
    shared.mem.read_obj(GuestAddress(at)).unwrap()
}

/// Waits until `count` requests are complete.
fn wait_for_completions(shared: &Shared, count: usize) -> Vec<(u32, u32)> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let done = used(shared);
        if done.len() >= count || Instant::now() > deadline {
            return done;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Offers a write of 8 KiB (returned) at sector 16 over two data descriptors (heads 0..4,
/// status at 0x9000), then a flush (heads 4..6, status at 0x9100).
fn offer_write_and_flush(shared: &Shared) -> Vec<u8> {
    let data: Vec<u8> = (0..8192).map(|i| (i % 253) as u8).collect();
    shared
        .mem
        .write_slice(&data, GuestAddress(0x10000))
        .unwrap();
    header(shared, 0x8000, T_OUT, 16);
    offer(
        shared,
        0,
        &[
            (0x8000, 16, false),
            (0x10000, 4096, false),
            (0x11000, 4096, false),
            (0x9000, 1, true),
        ],
    );
    header(shared, 0x8100, T_FLUSH, 0);
    offer(shared, 4, &[(0x8100, 16, false), (0x9100, 1, true)]);
    data
}

/// The library's side: the real service over a fresh layer, on a runtime of its own.
fn library(socket: UnixStream) -> (MemoryLayerDisk, tokio::runtime::Runtime) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let layer = MemoryLayerDisk::new();
    let disk = layer.clone();
    socket.set_nonblocking(true).unwrap();
    runtime.spawn(async move {
        let stream = tokio::net::UnixStream::from_std(socket).unwrap();
        disk.serve(stream).await
    });
    (layer, runtime)
}

#[test]
fn writes_reach_the_layer_a_flush_follows_and_reads_come_back_into_the_guest() {
    let (shared, signals) = device(DISK);
    // A write of 8 KiB at sector 16 over two data descriptors; a flush; a read of the same
    // 8 KiB into two other descriptors. Each with its own status byte.
    let data = offer_write_and_flush(&shared);
    header(&shared, 0x8200, T_IN, 16);
    offer(
        &shared,
        6,
        &[
            (0x8200, 16, false),
            (0x20000, 4096, true),
            (0x21000, 4096, true),
            (0x9200, 1, true),
        ],
    );
    for at in [0x9000, 0x9100, 0x9200] {
        shared.mem.write_obj(0xffu8, GuestAddress(at)).unwrap();
    }
    let (mut helper, ours) = UnixStream::pair().unwrap();
    let (layer, runtime) = library(ours);
    let completing = shared.clone();
    let replies = helper.try_clone().unwrap();
    let completer = std::thread::spawn(move || serve_replies(&completing, replies));

    assert_eq!(drain(&shared, &mut helper).unwrap(), Drained::Empty);
    let done = wait_for_completions(&shared, 3);
    assert_eq!(done, vec![(0, 1), (4, 1), (6, 8193)]);
    assert_eq!(
        [
            status(&shared, 0x9000),
            status(&shared, 0x9100),
            status(&shared, 0x9200)
        ],
        [0, 0, 0]
    );
    let mut landed = vec![0u8; 8192];
    shared
        .mem
        .read_slice(&mut landed, GuestAddress(0x20000))
        .unwrap();
    assert_eq!(landed, data);
    assert!(signals.load(Ordering::SeqCst) >= 1);
    // The layer holds it where the sector said, and the flush left nothing dirty.
    let stored = runtime.block_on(layer.read(16 * 512, 8192)).unwrap();
    assert_eq!(stored, data);
    assert_eq!(layer.dirty_bytes(), 0);
    drop(helper);
    drop(runtime);
    let _ = completer.join().unwrap();
}

#[test]
fn the_device_answers_what_it_does_not_forward_and_the_library_never_sees_it() {
    let (shared, _signals) = device(DISK);
    let mut requests = Vec::new();
    let mut offer_one = |first: u16, kind: u32, sector: u64, room: u32| {
        let at = 0x8000 + 0x100 * u64::from(first);
        header(&shared, at, kind, sector);
        let status_at = 0x9000 + 0x10 * u64::from(first);
        let mut chain = vec![(at, 16, false)];
        if room > 0 {
            chain.push((0x20000 + 0x2000 * u64::from(first), room, true));
        }
        chain.push((status_at, 1, true));
        offer(&shared, first, &chain);
        requests.push(status_at);
    };
    offer_one(0, T_GET_ID, 0, 20); // the serial
    offer_one(3, 11, 0, 0); // discard: not served
    offer_one(5, T_IN, DISK / 512, 4096); // a read past the disk's end
    offer_one(8, T_IN, 0, 100); // a read of no whole sector
    let (mut helper, mut library) = UnixStream::pair().unwrap();
    assert_eq!(drain(&shared, &mut helper).unwrap(), Drained::Empty);
    assert_eq!(used(&shared), vec![(0, 21), (3, 1), (5, 1), (8, 1)]);
    let statuses: Vec<u8> = requests.iter().map(|at| status(&shared, *at)).collect();
    assert_eq!(statuses, [0, 2, 1, 1]);
    let mut serial = [0u8; 20];
    shared
        .mem
        .read_slice(&mut serial, GuestAddress(0x20000))
        .unwrap();
    assert_eq!(&serial[..SERIAL.len()], SERIAL.as_bytes());
    assert!(serial[SERIAL.len()..].iter().all(|b| *b == 0));

    // A chain with no writable byte (nowhere to put a status), and one whose header is short.
    header(&shared, 0x8b00, T_IN, 0);
    offer(&shared, 11, &[(0x8b00, 16, false)]);
    offer(&shared, 12, &[(0x8c00, 8, false), (0x9c00, 1, true)]);
    assert_eq!(drain(&shared, &mut helper).unwrap(), Drained::Empty);
    assert_eq!(used(&shared)[4..], [(11, 0), (12, 1)]);
    assert_eq!(status(&shared, 0x9c00), 1);

    library.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    assert_eq!(
        library.read(&mut byte).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock,
        "nothing reached the library"
    );
}

#[test]
fn a_reply_nobody_waits_for_is_skipped_and_one_of_the_wrong_length_stops_the_device() {
    let (shared, _signals) = device(DISK);
    // Two reads of 4 KiB, at sectors 8 and 16.
    for (first, sector) in [(0u16, 8u64), (3, 16)] {
        let at = 0x8000 + 0x100 * u64::from(first);
        header(&shared, at, T_IN, sector);
        offer(
            &shared,
            first,
            &[
                (at, 16, false),
                (0x20000 + 0x2000 * u64::from(first), 4096, true),
                (0x9000 + u64::from(first), 1, true),
            ],
        );
    }
    let (mut helper, mut library) = UnixStream::pair().unwrap();
    assert_eq!(drain(&shared, &mut helper).unwrap(), Drained::Empty);
    let mut requests = Vec::new();
    for _ in 0..2 {
        let mut forwarded = [0u8; wire::REQUEST_HEADER_LEN];
        library.read_exact(&mut forwarded).unwrap();
        requests.push(RequestHeader::decode(&forwarded).unwrap());
    }
    assert_eq!(
        requests
            .iter()
            .map(|r| (r.operation, r.offset, r.length))
            .collect::<Vec<_>>(),
        [
            (Operation::Read, 8 * 512, 4096),
            (Operation::Read, 16 * 512, 4096)
        ]
    );
    // A reply to an id never sent, with data (bytes that do not decode as a header): skipped
    // whole, and the first request's reply after it lands.
    let stray = ReplyHeader {
        id: requests[0].id.wrapping_add(7),
        status: Status::Ok,
        length: 512,
    };
    library.write_all(&stray.encode()).unwrap();
    library.write_all(&[7u8; 512]).unwrap();
    let first = ReplyHeader {
        id: requests[0].id,
        status: Status::Ok,
        length: 4096,
    };
    library.write_all(&first.encode()).unwrap();
    library.write_all(&[5u8; 4096]).unwrap();
    // The second request's reply, with less data than it asked for: the framing is lost.
    let short = ReplyHeader {
        id: requests[1].id,
        status: Status::Ok,
        length: 512,
    };
    library.write_all(&short.encode()).unwrap();
    library.write_all(&[9u8; 512]).unwrap();
    let err = serve_replies(&shared, helper).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
    assert_eq!(used(&shared), [(0, 4097)], "only the first read completed");
    assert_eq!(status(&shared, 0x9000), 0);
    let mut landed = vec![0u8; 4096];
    shared
        .mem
        .read_slice(&mut landed, GuestAddress(0x20000))
        .unwrap();
    assert!(landed.iter().all(|b| *b == 5));
}

#[test]
fn the_service_fails_a_request_outside_the_disk_and_stops_at_a_header_no_device_sends() {
    let (helper, ours) = UnixStream::pair().unwrap();
    let (layer, runtime) = library(ours);
    let size = layer.size();
    let mut helper = helper;
    let outside = RequestHeader {
        id: 5,
        operation: Operation::Read,
        offset: size - 512,
        length: 4096,
    };
    helper.write_all(&outside.encode()).unwrap();
    let mut reply = [0u8; REPLY_HEADER_LEN];
    helper.read_exact(&mut reply).unwrap();
    assert_eq!(
        ReplyHeader::decode(&reply),
        Some(ReplyHeader {
            id: 5,
            status: Status::IoError,
            length: 0
        })
    );
    // An unknown operation: the service ends the connection.
    let mut unknown = outside.encode();
    unknown[4] = 77;
    helper.write_all(&unknown).unwrap();
    let mut rest = Vec::new();
    helper.read_to_end(&mut rest).unwrap();
    assert!(
        rest.is_empty(),
        "{} bytes after a broken header",
        rest.len()
    );
    drop(runtime);
}

/// In place: a write lands in the file at its sector, a flush succeeds, a read of it and of a
/// hole past the file's end comes back (zeros there, whatever the guest's buffer held); what
/// the device answers itself and a request outside the disk never touch the file; one
/// interrupt for the batch.
#[test]
fn in_place_writes_land_in_the_file_and_reads_past_its_end_are_zeros() {
    use std::os::unix::fs::FileExt;
    let (shared, signals) = device(DISK);
    let data = offer_write_and_flush(&shared);
    // The 8 KiB just written and 8 KiB past it (past the file's end: never written).
    header(&shared, 0x8200, T_IN, 16);
    offer(
        &shared,
        6,
        &[
            (0x8200, 16, false),
            (0x20000, 16384, true),
            (0x9200, 1, true),
        ],
    );
    shared
        .mem
        .write_slice(&[0xee; 16384], GuestAddress(0x20000))
        .unwrap();
    // A write past the disk's end, and a serial request: answered, the file untouched.
    header(&shared, 0x8300, T_OUT, DISK / 512 - 1);
    offer(
        &shared,
        9,
        &[
            (0x8300, 16, false),
            (0x10000, 4096, false),
            (0x9300, 1, true),
        ],
    );
    header(&shared, 0x8400, T_GET_ID, 0);
    offer(
        &shared,
        12,
        &[(0x8400, 16, false), (0x30000, 20, true), (0x9400, 1, true)],
    );
    for at in [0x9000, 0x9100, 0x9200, 0x9300, 0x9400] {
        shared.mem.write_obj(0xffu8, GuestAddress(at)).unwrap();
    }
    let file = tempfile::tempfile().unwrap();
    let failures = failure_count();
    assert_eq!(
        drain_in_place(&shared, &file, &failures).unwrap(),
        Drained::Empty
    );
    assert_eq!(counted(&failures), 0);
    assert_eq!(
        used(&shared),
        vec![(0, 1), (4, 1), (6, 16385), (9, 1), (12, 21)]
    );
    let statuses: Vec<u8> = [0x9000, 0x9100, 0x9200, 0x9300, 0x9400]
        .iter()
        .map(|at| status(&shared, *at))
        .collect();
    assert_eq!(statuses, [0, 0, 0, 1, 0]);
    assert_eq!(
        signals.load(Ordering::SeqCst),
        1,
        "one interrupt for the batch"
    );
    let mut stored = vec![0u8; 8192];
    file.read_exact_at(&mut stored, 16 * 512).unwrap();
    assert_eq!(stored, data);
    assert_eq!(
        file.metadata().unwrap().len(),
        16 * 512 + 8192,
        "nothing written past the disk's end"
    );
    let mut landed = vec![0u8; 16384];
    shared
        .mem
        .read_slice(&mut landed, GuestAddress(0x20000))
        .unwrap();
    assert_eq!(&landed[..8192], &data[..]);
    assert!(
        landed[8192..].iter().all(|b| *b == 0),
        "a hole reads as zeros"
    );
}

/// A file the device cannot write (opened read-only): the guest's write fails with an I/O
/// error and is counted for the library, its read of the same place still works. And a socket
/// is not a file to serve.
#[test]
fn in_place_failures_are_io_errors_for_the_guest() {
    let (shared, _signals) = device(DISK);
    let written = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(written.path(), [7u8; 4096]).unwrap();
    let read_only = std::fs::File::open(written.path()).unwrap();
    header(&shared, 0x8000, T_OUT, 0);
    offer(
        &shared,
        0,
        &[
            (0x8000, 16, false),
            (0x10000, 4096, false),
            (0x9000, 1, true),
        ],
    );
    header(&shared, 0x8100, T_IN, 0);
    offer(
        &shared,
        3,
        &[
            (0x8100, 16, false),
            (0x20000, 4096, true),
            (0x9100, 1, true),
        ],
    );
    let failures = failure_count();
    assert_eq!(
        drain_in_place(&shared, &read_only, &failures).unwrap(),
        Drained::Empty
    );
    assert_eq!(used(&shared), vec![(0, 1), (3, 4097)]);
    assert_eq!([status(&shared, 0x9000), status(&shared, 0x9100)], [1, 0]);
    assert_eq!(
        counted(&failures),
        1,
        "the failed write is counted for the library"
    );
    let mut read = [0u8; 4096];
    shared
        .mem
        .read_slice(&mut read, GuestAddress(0x20000))
        .unwrap();
    assert_eq!(read, [7u8; 4096]);

    let (socket, _other) = UnixStream::pair().unwrap();
    let not_a_file = std::fs::File::from(std::os::fd::OwnedFd::from(socket));
    let backing = Backing::File(not_a_file, failure_count());
    assert!(ServedBlock::new(DISK, SERIAL, backing).is_err());
}
