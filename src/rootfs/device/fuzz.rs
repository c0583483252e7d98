//! The fuzz property of a copy-on-write root's layer disk device
//! (`fuzz/fuzz_targets/virtio_blk_queue.rs`): a hostile guest's virtqueue (any descriptor
//! table, any available ring, any bytes in memory, any disk size), served by the device's own
//! code over a real socket pair to the library's real service over a real layer.
//!
//! Checks: nothing panics or hangs; the service accepts every header the device sends (it
//! ends the connection on one it refuses, which fails the property); once the guest stops, no
//! request is still waiting; every completion names a chain the guest offered, says at most a
//! request's data and status, and nothing is completed twice.

use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use super::{drain, serve_replies, service, Pending, Shared, MAX_DATA, SERIAL_LEN};
use crate::rootfs::cow::CowLayer;
use crate::rootfs::MemoryStore;
use crate::virtqueue::laid_out::{check_completions, laid_out_queue, HostileQueue, Input};
#[cfg(test)]
use crate::virtqueue::laid_out::{seed, DATA};

/// Runs one input; panics where the property does not hold.
pub(crate) fn fuzz_queue(data: &[u8]) {
    run(data);
}

/// Runs one input: the completions.
fn run(data: &[u8]) -> usize {
    let mut input = Input(data);
    let HostileQueue { mem, size, offered } = HostileQueue::from_input(&mut input);
    // The disk as the device shows it: up to 32 MiB (the layer behind it is larger).
    let capacity = u64::from(input.u16()) * 512;
    input.fill_memory(&mem);
    let shared = Arc::new(Shared {
        mem: mem.clone(),
        signal: Box::new(|| {}),
        ring: Mutex::new(laid_out_queue(size)),
        pending: Mutex::new(Pending::default()),
        capacity,
        serial: [b's'; SERIAL_LEN],
    });

    let (mut helper, library) = UnixStream::pair().expect("a socket pair");
    let replies = helper.try_clone().expect("a second handle");
    let served = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let layer = Arc::new(CowLayer::unformatted(
            Arc::new(MemoryStore::with_block_size(16384).expect("a block size")),
            1 << 20,
        ));
        library.set_nonblocking(true).expect("non-blocking");
        runtime.block_on(async move {
            let stream = tokio::net::UnixStream::from_std(library).expect("a tokio socket");
            service::serve(stream, layer).await
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
    completions.len()
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
        crate::fuzzing::assert_committed_seeds("virtio_blk_queue", &seeds());
    }

    #[test]
    fn corpus_holds_the_property() {
        crate::fuzzing::replay_corpus("virtio_blk_queue", fuzz_queue);
    }
}
