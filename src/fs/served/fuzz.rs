//! The fuzz property of a mount's queues (`fuzz/fuzz_targets/virtio_fs_queue.rs`): a hostile
//! guest's virtqueue (any descriptor table, any available ring, any bytes in memory), handed
//! over and served by this process's own code ([`super::Device`]) in a real session over a
//! small `MemoryFs`.
//!
//! Checks: nothing panics (a request's task neither) or hangs; every completion names a chain
//! the guest offered, at most once unless it was offered twice.
#![cfg(any(test, feature = "fuzzing"))]

use std::os::fd::OwnedFd;
use std::sync::Arc;

use tokio::task::JoinSet;

use super::{Device, Turn};
use crate::fs::fuse::fuzz::{check_reply, init_request};
use crate::fs::fuse::Session;
use crate::fs::{MemoryFs, MountOptions};
use krunbox_virtio::queue::laid_out::{check_completions, HostileQueue, Input};
#[cfg(test)]
use krunbox_virtio::queue::laid_out::{seed, DATA};

/// Runs one input; panics where the property does not hold.
pub(crate) fn fuzz_queue(data: &[u8]) {
    run(data);
}

/// Runs one input; panics where the property does not hold. Returns the completions.
fn run(data: &[u8]) -> usize {
    let mut input = Input(data);
    let HostileQueue { mem, size, offered } = HostileQueue::from_input(&mut input);
    // Eight bytes the helper's forwarding transport (removed) read as its library's answers:
    // still skipped, so that the corpus and the seeds keep their meaning.
    for _ in 0..8 {
        input.u8();
    }
    input.fill_memory(&mem);
    let interrupt = OwnedFd::from(nix::sys::eventfd::EventFd::new().expect("an eventfd"));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let session = Session::new(
            Arc::new(MemoryFs::with_limits(1 << 20, 256)),
            MountOptions::new(),
        );
        let reply = session
            .handle(&init_request(1))
            .await
            .expect("INIT decodes")
            .expect("INIT is answered");
        check_reply(&reply, 1);
        let device = Device::laid_out(&mem, size, interrupt, session);
        let mut requests = JoinSet::new();
        // Turns until the ring is drained (a broken ring is only a reason to stop): a ring
        // holds at most its size of requests, so a few turns end it.
        let mut turns = 0;
        while let Turn::More = device.serve_ring(1, &mut requests).await {
            turns += 1;
            assert!(turns <= 64, "a ring of {size} served for {turns} turns");
        }
        while let Some(done) = requests.join_next().await {
            done.expect("a request's task panicked");
        }
    });
    check_completions(&mem, size, offered).len()
}

/// A FUSE request: a header whose length covers `body`, then `body`; the header's other
/// fields zero, as the committed seeds hold them.
#[cfg(test)]
fn request(opcode: u32, unique: u64, body: &[u8]) -> Vec<u8> {
    use crate::fs::fuse::IN_HEADER_LEN;
    let mut bytes = vec![0u8; IN_HEADER_LEN];
    bytes[0..4].copy_from_slice(&((IN_HEADER_LEN + body.len()) as u32).to_le_bytes());
    bytes[4..8].copy_from_slice(&opcode.to_le_bytes());
    bytes[8..16].copy_from_slice(&unique.to_le_bytes());
    bytes.extend_from_slice(body);
    bytes
}

/// Inputs that reach each path: a LOOKUP answered, a FORGET, a write of 100 KiB (the direct
/// path) and a read whose reply is larger than its room.
#[cfg(test)]
fn seeds() -> Vec<Vec<u8>> {
    let lookup = request(1, 7, b"a\0");
    let forget = request(2, 8, &[0u8; 8]);
    let write = request(16, 9, &vec![0x5a; 100 * 1024]);
    let read = request(15, 10, &[]);
    vec![
        seed(
            &[&[
                (DATA, lookup.len() as u32, false),
                (DATA + 0x1000, 128, true),
            ]],
            &[0; 8],
            &lookup,
        ),
        seed(&[&[(DATA, forget.len() as u32, false)]], &[0; 8], &forget),
        seed(
            &[&[
                (DATA, 64, false),
                (DATA + 64, write.len() as u32 - 64, false),
                (DATA + 0x1_a000, 32, true),
            ]],
            &[0; 8],
            &write,
        ),
        seed(
            &[&[
                (DATA, read.len() as u32, false),
                (DATA + 0x1000, 16 + 4096, true),
                (DATA + 0x3000, 60 * 1024, true),
            ]],
            &[100; 8],
            &read,
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
    /// `KRUNBOX_WRITE_FUZZ_SEEDS=1 cargo test --lib committed_virtio_fs_queue_seeds`).
    #[test]
    fn committed_virtio_fs_queue_seeds_are_the_generated_ones() {
        crate::fuzzing::assert_committed_seeds("virtio_fs_queue", &seeds());
    }

    #[test]
    fn corpus_holds_the_property() {
        crate::fuzzing::replay_corpus("virtio_fs_queue", fuzz_queue);
    }
}
