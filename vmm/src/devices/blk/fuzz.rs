//! The fuzz property of a copy-on-write root's layer disk device
//! (`fuzz/fuzz_targets/virtio_blk_queue.rs`): a hostile guest's virtqueue (any descriptor
//! table, any available ring, any bytes in memory, any disk size), served by the device's own
//! code over a real socket pair to the library's real service over a real layer, and again
//! (the same guest afresh) served in place from a memfd.
//!
//! Checks: nothing panics or hangs; the service accepts every header the device sends (it
//! ends the connection on one it refuses, which fails the property); once the guest stops, no
//! request is still waiting; every completion names a chain the guest offered, says at most a
//! request's data and status, and nothing is completed twice; in place, the file never grows
//! past the disk; both ways complete the same chains.
#![cfg(any(test, feature = "fuzzing"))]

use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use super::{drain, drain_in_place, serve_replies, Pending, Shared, MAX_DATA, SERIAL_LEN};
use krunbox::fuzzing::MemoryLayerDisk;
use krunbox_virtio::queue::laid_out::{check_completions, laid_out_queue, HostileQueue, Input};
#[cfg(test)]
use krunbox_virtio::queue::laid_out::{seed, DATA};

/// Runs one input; panics where the property does not hold.
pub(crate) fn fuzz_queue(data: &[u8]) {
    run(data);
}

/// Runs one input, forwarded to the library and again served in place: the completions.
fn run(data: &[u8]) -> usize {
    let forwarded = run_forwarded(data);
    let in_place = run_in_place(data);
    // Both pop the same chains (the descriptors and the ring lie where no device writes) and
    // complete every chain they pop, once. What each wrote may differ: a read's data can land
    // on a later request's header sooner or later when forwarded.
    let heads = |completions: &[(u32, u32)]| {
        let mut heads: Vec<u32> = completions.iter().map(|(head, _)| *head).collect();
        heads.sort_unstable();
        heads
    };
    assert_eq!(
        heads(&forwarded),
        heads(&in_place),
        "the two backings completed other chains"
    );
    forwarded.len()
}

/// The hostile guest of one input: its queue and memory, and the disk's size as the device
/// shows it (up to 32 MiB; the layer behind it is larger).
fn guest(data: &[u8]) -> (HostileQueue, Arc<Shared>) {
    let mut input = Input(data);
    let queue = HostileQueue::from_input(&mut input);
    let capacity = u64::from(input.u16()) * 512;
    input.fill_memory(&queue.mem);
    let shared = Arc::new(Shared {
        mem: queue.mem.clone(),
        signal: Box::new(|| {}),
        ring: Mutex::new(laid_out_queue(queue.size, &queue.mem)),
        pending: Mutex::new(Pending::default()),
        capacity,
        serial: [b's'; SERIAL_LEN],
    });
    (queue, shared)
}

/// Served in place from a memfd: no panic, every completion checked, and the file never
/// written past the disk's end.
fn run_in_place(data: &[u8]) -> Vec<(u32, u32)> {
    let (HostileQueue { mem, size, offered }, shared) = guest(data);
    let file = std::fs::File::from(
        nix::sys::memfd::memfd_create(c"fuzz-disk", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .expect("a memfd"),
    );
    let failures = failure_count();
    drain_in_place(&shared, &file, &failures).expect("the file is served");
    // A memfd within the disk takes every read, write and flush.
    assert_eq!(counted(&failures), 0, "an in-place request failed");
    let length = file.metadata().expect("the memfd's size").len();
    assert!(
        length <= shared.capacity,
        "the file grew to {length} bytes past a disk of {}",
        shared.capacity
    );
    let completions = check_completions(&mem, size, offered);
    for (head, len) in &completions {
        assert!(
            *len <= MAX_DATA + 1,
            "head {head} completed with {len} bytes written"
        );
    }
    completions
}

/// A failure count as the library gives the device one: an eventfd (non-blocking).
pub(super) fn failure_count() -> std::fs::File {
    use nix::sys::eventfd::{EfdFlags, EventFd};
    let count =
        EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK).expect("an eventfd");
    std::fs::File::from(std::os::fd::OwnedFd::from(count))
}

/// What a failure count holds (taking it).
pub(super) fn counted(count: &std::fs::File) -> u64 {
    let mut bytes = [0u8; 8];
    match std::io::Read::read(&mut &*count, &mut bytes) {
        Ok(8) => u64::from_ne_bytes(bytes),
        _ => 0,
    }
}

/// Forwarded over a real socket pair to the library's real service over a real layer.
fn run_forwarded(data: &[u8]) -> Vec<(u32, u32)> {
    let (HostileQueue { mem, size, offered }, shared) = guest(data);

    let (mut helper, library) = UnixStream::pair().expect("a socket pair");
    let replies = helper.try_clone().expect("a second handle");
    let served = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let disk = MemoryLayerDisk::new();
        library.set_nonblocking(true).expect("non-blocking");
        runtime.block_on(async move {
            let stream = tokio::net::UnixStream::from_std(library).expect("a tokio socket");
            disk.serve(stream).await
        })
    });
    let completer = {
        let shared = shared.clone();
        std::thread::spawn(move || {
            let _ = serve_replies(&shared, replies);
        })
    };
    // A broken ring is only a reason to stop; either way nothing more is popped.
    drain(&shared, &mut helper).expect("the library reads");
    // No more requests: the service answers what it has and sees the end of them.
    helper
        .shutdown(std::net::Shutdown::Write)
        .expect("shutting down");
    let served = served.join().expect("the service");
    assert!(
        served.is_ok(),
        "the service refused what the device sent: {served:?}"
    );
    drop(helper);
    completer.join().expect("the completer");

    assert!(
        shared.pending.lock().unwrap().waiting.is_empty(),
        "a request still waits after the service answered everything"
    );
    let completions = check_completions(&mem, size, offered);
    for (head, len) in &completions {
        assert!(
            *len <= MAX_DATA + 1,
            "head {head} completed with {len} bytes written"
        );
    }
    completions
}

/// Inputs that reach each path: a write, a flush and a read of the same sectors; the serial;
/// a read past the disk's end.
#[cfg(test)]
fn seeds() -> Vec<Vec<u8>> {
    /// A guest driver's request header.
    fn header(kind: u32, sector: u64) -> Vec<u8> {
        let mut bytes = vec![0u8; 16];
        bytes[0..4].copy_from_slice(&kind.to_le_bytes());
        bytes[8..16].copy_from_slice(&sector.to_le_bytes());
        bytes
    }
    // A disk of 1 MiB: 2048 sectors.
    let disk = 2048u16.to_le_bytes();
    let mut write = header(super::T_OUT, 8);
    write.resize(0x1000, 0);
    write.extend_from_slice(&[0x5a; 8192]);
    vec![
        seed(
            &[&[
                (DATA, 16, false),
                (DATA + 0x1000, 8192, false),
                (DATA + 0x8000, 1, true),
            ]],
            &disk,
            &write,
        ),
        seed(
            &[&[(DATA, 16, false), (DATA + 0x8000, 1, true)]],
            &disk,
            &header(super::T_FLUSH, 0),
        ),
        seed(
            &[&[
                (DATA, 16, false),
                (DATA + 0x1000, 8192, true),
                (DATA + 0x8000, 1, true),
            ]],
            &disk,
            &header(super::T_IN, 8),
        ),
        seed(
            &[&[
                (DATA, 16, false),
                (DATA + 0x1000, 20, true),
                (DATA + 0x8000, 1, true),
            ]],
            &disk,
            &header(super::T_GET_ID, 0),
        ),
        seed(
            &[&[
                (DATA, 16, false),
                (DATA + 0x1000, 4096, true),
                (DATA + 0x8000, 1, true),
            ]],
            &disk,
            &header(super::T_IN, 2047),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_seed_is_completed() {
        for seed in seeds() {
            assert_eq!(run(&seed), 1);
        }
    }

    /// The committed seeds are these (regenerate with
    /// `KRUNBOX_WRITE_FUZZ_SEEDS=1 cargo test --lib committed_virtio_blk_queue_seeds`).
    #[test]
    fn committed_virtio_blk_queue_seeds_are_the_generated_ones() {
        krunbox::fuzzing::assert_committed_seeds("virtio_blk_queue", &seeds());
    }

    #[test]
    fn corpus_holds_the_property() {
        krunbox::fuzzing::replay_corpus("virtio_blk_queue", fuzz_queue);
    }
}
