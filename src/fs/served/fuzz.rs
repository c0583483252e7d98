//! The fuzz property of a handed-over mount's queues (`virtio_fs_queue`, its second pass): the
//! same hostile guest's virtqueue as the helper's device gets, served by this process's own
//! code ([`super::Device`]) in a real session over a small `MemoryFs`.
//!
//! Checks: nothing panics (a request's task neither) or hangs; every completion names a chain
//! the guest offered, at most once unless it was offered twice.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::{Device, Turn};
use crate::fs::fuse::fuzz::{check_reply, init_request};
use crate::fs::fuse::Session;
use crate::fs::fuse::MAX_IN_FLIGHT;
use crate::fs::{MemoryFs, MountOptions};
use crate::virtqueue::laid_out::{check_completions, laid_out_queue, HostileQueue, Input};

/// Runs one input (laid out as the forwarding pass reads it); panics where the property does
/// not hold. Returns the completions.
pub(crate) fn run(data: &[u8]) -> usize {
    let mut input = Input(data);
    let HostileQueue { mem, size, offered } = HostileQueue::from_input(&mut input);
    // The forwarding pass's answers: skipped, so that memory holds the same bytes.
    for _ in 0..8 {
        input.u8();
    }
    input.fill_memory(&mem);
    let ring = Arc::new(Mutex::new(laid_out_queue(size, &mem)));
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
        let device = Arc::new(Device {
            mem: mem.clone(),
            rings: vec![ring.clone(), ring],
            interrupt,
            session: Arc::new(session),
            slots: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        });
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
