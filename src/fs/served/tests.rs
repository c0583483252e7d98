//! A handed-over mount's queues served by the library's own code over real guest memory, in a
//! real session over a `MemoryFs`.

use fuse_backend_rs::abi::fuse_abi as abi;
use vm_memory::{ByteValued, Bytes, GuestAddress};

use super::*;
use crate::fs::fuse::fuzz::{init_request, request};
use crate::fs::{MemoryFs, MountOptions};
use krunbox_virtio::queue::laid_out::{self, offer, AVAIL_RING, DESC_TABLE, USED_RING};

const SIZE: u16 = 16;

/// A device over fresh guest memory, its two rings one queue of [`SIZE`] laid out as a driver
/// would, served in a session over an empty `MemoryFs`; and the interrupt's eventfd, to count
/// the interrupts by.
async fn fresh_device() -> (GuestMemoryMmap, Arc<Device>, OwnedFd) {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
    let session = Session::new(Arc::new(MemoryFs::new()), MountOptions::new());
    session.handle(&init_request(1)).await.unwrap().unwrap();
    let interrupt = OwnedFd::from(
        nix::sys::eventfd::EventFd::from_flags(nix::sys::eventfd::EfdFlags::EFD_NONBLOCK).unwrap(),
    );
    let counted = interrupt.try_clone().unwrap();
    let device = Device::laid_out(&mem, SIZE, interrupt, session);
    (mem, device, counted)
}

/// Serves ring 1 until it is drained, and waits for every request's answer.
async fn serve(device: &Arc<Device>) -> Drained {
    let mut requests = JoinSet::new();
    let drained = loop {
        if let Turn::Drained(drained) = device.serve_ring(1, &mut requests).await {
            break drained;
        }
    };
    while let Some(done) = requests.join_next().await {
        done.unwrap();
    }
    drained
}

/// The interrupts signalled since the last look.
fn interrupts(counted: &OwnedFd) -> u64 {
    let mut count = [0u8; 8];
    match nix::unistd::read(counted, &mut count) {
        Ok(8) => u64::from_ne_bytes(count),
        _ => 0,
    }
}

/// A reply header's (length, error, unique) at `at`.
fn reply_header(mem: &GuestMemoryMmap, at: u64) -> (u32, i32, u64) {
    let mut header = [0u8; 16];
    mem.read_slice(&mut header, GuestAddress(at)).unwrap();
    (
        u32::from_le_bytes(header[0..4].try_into().unwrap()),
        i32::from_le_bytes(header[4..8].try_into().unwrap()),
        u64::from_le_bytes(header[8..16].try_into().unwrap()),
    )
}

/// A LOOKUP split over two readable descriptors is answered whole, its reply in its own
/// writable descriptor, and the guest interrupted.
#[tokio::test]
async fn a_request_split_over_descriptors_is_answered_in_its_own() {
    let (mem, device, counted) = fresh_device().await;
    let bytes = request(1, 7, 1, b"name\0");
    mem.write_slice(&bytes, GuestAddress(0x10000)).unwrap();
    offer(
        &mem,
        SIZE,
        0,
        &[
            (0x10000, 20, false),
            (0x10014, bytes.len() as u32 - 20, false),
            (0x20000, 64, true),
        ],
    );
    assert_eq!(serve(&device).await, Drained::Empty);
    // What the session answers the same request with, as far as the room holds it.
    let answer = device.session.handle(&bytes).await.unwrap().unwrap();
    let fits = answer.len().min(64);
    assert_eq!(laid_out::used(&mem, SIZE), vec![(0, fits as u32)]);
    let mut landed = vec![0u8; fits];
    mem.read_slice(&mut landed, GuestAddress(0x20000)).unwrap();
    assert_eq!(landed, answer[..fits]);
    assert_eq!(reply_header(&mem, 0x20000).2, 7, "the request's unique");
    assert!(interrupts(&counted) >= 1, "the guest was not interrupted");
}

/// A FORGET and an INTERRUPT are completed at once with nothing written; a request whose
/// header's length is not its chain's fails with `EIO` (unique 0: its header is not
/// believed), never reaching the session.
#[tokio::test]
async fn unanswered_requests_complete_at_once_and_malformed_ones_fail_with_eio() {
    const FUSE_FORGET: u32 = 2;
    const FUSE_INTERRUPT: u32 = 36;
    let (mem, device, _counted) = fresh_device().await;
    let forget = request(FUSE_FORGET, 1, 1, &[0u8; 8]);
    let interrupt = request(FUSE_INTERRUPT, 5, 0, &[0u8; 8]);
    let mut bad = request(1, 2, 1, b"x\0");
    bad[0..4].copy_from_slice(&999u32.to_le_bytes());
    for (i, (bytes, at)) in [
        (&forget, 0x10000u64),
        (&interrupt, 0x11000),
        (&bad, 0x12000),
    ]
    .into_iter()
    .enumerate()
    {
        mem.write_slice(bytes, GuestAddress(at)).unwrap();
        let chain = [(at, bytes.len() as u32, false), (at + 0x800, 64, true)];
        offer(&mem, SIZE, 2 * i as u16, &chain);
    }
    assert_eq!(serve(&device).await, Drained::Empty);
    assert_eq!(laid_out::used(&mem, SIZE), vec![(0, 0), (2, 0), (4, 16)]);
    assert_eq!(reply_header(&mem, 0x12800), (16, -libc::EIO, 0));
}

/// A ring whose entry names no descriptor, or whose index claims more entries than the
/// queue holds, is broken: served no more, and not spun on.
#[tokio::test]
async fn a_ring_that_names_no_chain_is_broken_and_not_spun_on() {
    let (mem, device, _counted) = fresh_device().await;
    mem.write_obj(0xffffu16, GuestAddress(AVAIL_RING + 4))
        .unwrap();
    mem.write_obj(1u16, GuestAddress(AVAIL_RING + 2)).unwrap();
    assert_eq!(serve(&device).await, Drained::Broken);

    let (mem, device, _counted) = fresh_device().await;
    mem.write_obj(SIZE + 1, GuestAddress(AVAIL_RING + 2))
        .unwrap();
    assert_eq!(serve(&device).await, Drained::Broken);
}

/// A chain past the bounds (more readable bytes than any request, or readable after
/// writable) is completed with nothing written, never reaching the session.
#[tokio::test]
async fn a_request_past_the_bounds_is_completed_unanswered() {
    let (mem, device, _counted) = fresh_device().await;
    let half = (crate::fs::fuse::MAX_REQUEST / 2 + 1) as u32;
    let long = request(16, 1, 1, &vec![0u8; 2 * half as usize - IN_HEADER_LEN]);
    mem.write_slice(&long[..half as usize], GuestAddress(0x1_0000))
        .unwrap();
    offer(
        &mem,
        SIZE,
        0,
        &[(0x1_0000, half, false), (0x1_0000, half, false)],
    );
    mem.write_slice(&request(1, 2, 1, &[0u8; 32]), GuestAddress(0xa_0000))
        .unwrap();
    offer(
        &mem,
        SIZE,
        2,
        &[
            (0xa_0000, 64, false),
            (0xa_1000, 64, true),
            (0xa_0000, 8, false),
        ],
    );
    assert_eq!(serve(&device).await, Drained::Empty);
    assert_eq!(laid_out::used(&mem, SIZE), vec![(0, 0), (2, 0)]);
    assert_eq!(reply_header(&mem, 0xa_1000), (0, 0, 0), "nothing written");
}

/// The guest adds requests while the library drains them: an entry that appears just after
/// the ring was found empty is served like any other. (It was once taken for a ring naming no
/// chain, which stopped the queue for good: the guest's next requests waited forever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_the_guest_adds_while_the_library_drains_are_all_served() {
    use std::sync::atomic::{fence, Ordering};
    use virtio_queue::desc::split::Descriptor;
    const TOTAL: u32 = 20_000;
    const FUSE_FORGET: u32 = 2;
    let (mem, device, _counted) = fresh_device().await;
    // One FORGET, completed at once, named by every entry.
    let bytes = request(FUSE_FORGET, 7, 1, &1u64.to_le_bytes());
    mem.write_slice(&bytes, GuestAddress(0x10000)).unwrap();
    mem.write_obj(
        Descriptor::new(0x10000, bytes.len() as u32, 0, 0),
        GuestAddress(DESC_TABLE),
    )
    .unwrap();
    let used_idx = |mem: &GuestMemoryMmap| -> u16 {
        fence(Ordering::Acquire);
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
            fence(Ordering::Release);
            idx = idx.wrapping_add(1);
            guest_mem
                .write_obj(idx, GuestAddress(AVAIL_RING + 2))
                .unwrap();
        }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut served = 0u32;
    let mut last = 0u16;
    while served < TOTAL {
        assert_eq!(
            serve(&device).await,
            Drained::Empty,
            "after {served} of {TOTAL}"
        );
        let now = used_idx(&mem);
        served += u32::from(now.wrapping_sub(last));
        last = now;
        assert!(
            std::time::Instant::now() < deadline,
            "{served} of {TOTAL} served"
        );
        tokio::task::yield_now().await;
    }
    driver.join().unwrap();
    assert_eq!(served, TOTAL);
}

/// A write whose data lies over several of the guest's buffers, the first shared with its
/// headers, is taken from guest memory (not copied with the request) and lands whole in
/// the file; its reply says how much was written.
#[tokio::test]
async fn a_write_spread_over_guest_buffers_lands_whole_in_the_file() {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
    let session = Session::new(Arc::new(MemoryFs::new()), MountOptions::new());
    session.handle(&init_request(1)).await.unwrap().unwrap();
    let create = abi::CreateIn {
        flags: (libc::O_RDWR | libc::O_CREAT) as u32,
        mode: libc::S_IFREG | 0o644,
        umask: 0o022,
        fuse_flags: 0,
    };
    // The root is node 1; the new file node 2, its handle 1 (MemoryFs counts from there).
    let created = session
        .handle(&request(35, 2, 1, &[create.as_slice(), b"f\0"].concat()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(i32::from_le_bytes(created[4..8].try_into().unwrap()), 0);

    let data: Vec<u8> = (0..3100u32).map(|i| (i % 253) as u8).collect();
    let args = abi::WriteIn {
        fh: 1,
        offset: 10,
        size: data.len() as u32,
        ..Default::default()
    };
    let mut head = request(16, 3, 2, args.as_slice());
    let said = (head.len() + data.len()) as u32;
    head[..4].copy_from_slice(&said.to_le_bytes());
    // The headers and the first 100 bytes of data in one buffer, the rest in three.
    let first = [&head[..], &data[..100]].concat();
    mem.write_slice(&first, GuestAddress(0x10000)).unwrap();
    mem.write_slice(&data[100..1100], GuestAddress(0x20000))
        .unwrap();
    mem.write_slice(&data[1100..2600], GuestAddress(0x30000))
        .unwrap();
    mem.write_slice(&data[2600..], GuestAddress(0x40000))
        .unwrap();
    offer(
        &mem,
        16,
        0,
        &[
            (0x10000, first.len() as u32, false),
            (0x20000, 1000, false),
            (0x30000, 1500, false),
            (0x40000, 500, false),
            (0x50000, 4096, true),
        ],
    );
    let interrupt = OwnedFd::from(nix::sys::eventfd::EventFd::new().unwrap());
    let device = Device::laid_out(&mem, 16, interrupt, session);
    let mut requests = JoinSet::new();
    assert!(matches!(
        device.serve_ring(1, &mut requests).await,
        Turn::Drained(Drained::Empty)
    ));
    while let Some(done) = requests.join_next().await {
        done.unwrap();
    }

    // The used ring: one completion of the chain at descriptor 0, a write's reply long.
    let used_idx: u16 = mem.read_obj(GuestAddress(USED_RING + 2)).unwrap();
    assert_eq!(used_idx, 1);
    let written_len: u32 = mem.read_obj(GuestAddress(USED_RING + 8)).unwrap();
    let mut reply = vec![0u8; written_len as usize];
    mem.read_slice(&mut reply, GuestAddress(0x50000)).unwrap();
    assert_eq!(
        i32::from_le_bytes(reply[4..8].try_into().unwrap()),
        0,
        "no error"
    );
    assert_eq!(u32::from_le_bytes(reply[16..20].try_into().unwrap()), 3100);

    // What the file holds, read back through the session.
    let read = abi::ReadIn {
        fh: 1,
        offset: 0,
        size: 8192,
        ..Default::default()
    };
    let back = device
        .session
        .handle(&request(15, 4, 2, read.as_slice()))
        .await
        .unwrap()
        .unwrap();
    let content = &back[16..];
    assert_eq!(content.len(), 3110);
    assert!(content[..10].iter().all(|&b| b == 0));
    assert_eq!(&content[10..], &data[..]);
}
