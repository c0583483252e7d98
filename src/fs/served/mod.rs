//! The transport's library side when the helper hands a mount's queues over: the virtqueues
//! served here, in guest memory this process maps, with no helper thread per request.
//!
//! The VM's memory is a file of this process's (`crate::guest_memory`). When the guest's
//! driver activates a mount's device, the helper sends where the rings and memory lie with
//! each queue's notification eventfd and the interrupt eventfd ([`super::handover`]),
//! and does nothing more for the device. Here a task per mount waits on the notifications
//! (KVM signals them when the guest notifies a queue), takes each request off its ring with
//! the same bounded code the helper's device uses (`crate::virtqueue`), copies its bytes out
//! once (a write's data not even that: the filesystem takes it from guest memory, see
//! [`WriteData`]), answers it in place, or in a task of its own when it must wait (at most
//! [`MAX_IN_FLIGHT`] at once, past which the rest wait on the ring), writes the reply into the
//! request's own buffers and interrupts the guest through the irqfd. A request costs the guest's exit, this process's wake-up and the
//! interrupt, as a request to libkrun's own devices does.
//!
//! Everything of the guest is bounded as in the helper's device: a request's bytes (at most
//! `MAX_REQUEST`), its reply's room (at most 300 descriptors), the requests in flight. A
//! malformed request is answered `EIO` or completed empty; a broken ring stops being served.

use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use tokio::io::unix::AsyncFd;
use tokio::net::UnixStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_queue::Queue;
use vm_memory::{GuestMemory, GuestMemoryMmap};

use super::fuse::{
    is_unanswered, Session, IN_HEADER_LEN, MAX_IN_FLIGHT, WRITE_IN_LEN, WRITE_OPCODE,
};
use super::handover::{self, QUEUE_SIZE, RINGS};
use super::WriteData;
use crate::guest_memory::GuestMemoryFile;
use chain::{fail_request, read_in_header, LIMITS};
use krunbox_virtio::queue::{
    self as virtqueue, complete, gather, next_request, scatter, Drained, Next, Popped,
};

mod chain;
pub(crate) mod fuzz;

/// Serves one mount's device once the helper hands it over on `stream`, until the helper
/// closes the socket (the VM stopped).
pub(crate) async fn serve(
    stream: UnixStream,
    session: Arc<Session>,
    memory: Arc<GuestMemoryFile>,
) -> std::io::Result<()> {
    let Some(received) = handover::receive(&stream, QUEUE_SIZE).await? else {
        // The VM stopped before the guest's driver activated the device.
        return Ok(());
    };
    let invalid = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_owned());
    // The device offers VERSION_1 alone; anything else acknowledged is not a driver of ours
    // (or not the helper's honest word).
    if received.hand_over.features & !(1u64 << VIRTIO_F_VERSION_1) != 0 {
        return Err(invalid(
            "a handed-over device with features it never offered",
        ));
    }
    let mem = memory.map(&received.hand_over.regions)?;
    let mut rings = Vec::with_capacity(RINGS);
    for layout in received.hand_over.rings {
        // The same check as the helper's device makes: each ring lies wholly in guest
        // memory, aligned, of a valid size, so reading it never fails.
        let Some(queue) = virtqueue::queue(layout, QUEUE_SIZE, &mem) else {
            return Err(invalid(
                "a handed-over ring outside guest memory or of a bad size",
            ));
        };
        rings.push(Arc::new(Mutex::new(queue)));
    }
    // Nothing here ever blocks on the interrupt's eventfd (its file is the helper's too).
    set_nonblocking(&received.interrupt)?;
    let device = Arc::new(Device {
        mem,
        rings,
        interrupt: received.interrupt,
        session,
        slots: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
    });
    let mut notifications = Vec::with_capacity(RINGS);
    for fd in received.notifications {
        // Never read: each notification of the guest's (KVM's write to the eventfd) wakes
        // the epoll that tokio registers it with, edge-triggered, whatever the count; a read,
        // which could block if the helper cleared the file's O_NONBLOCK and drained it
        // meanwhile, is not needed.
        // SAFETY: `fd` is an open descriptor the AsyncFd takes ownership of, so it stays open
        // and the same for the AsyncFd's whole life.
        notifications
            .push(unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }?);
    }
    tracing::debug!(target: "krunbox::fs", regions = device.mem.num_regions(), "a mount's queues were handed over; serving them here");
    let mut requests = JoinSet::new();
    let mut broken = [false; RINGS];
    // Rings that may hold requests without a notification to come: at first (the guest may
    // have notified before the hand-over), and after a turn that left some.
    let mut more = [true; RINGS];
    loop {
        let index = tokio::select! {
            // The socket first (a stopped VM is seen however busy the guest was), then the
            // high-priority ring (forgets), then requests.
            biased;
            ready = stream.readable() => {
                ready?;
                let mut byte = [0u8; 1];
                match stream.try_read(&mut byte) {
                    Ok(0) => return Ok(()),
                    Ok(_) => return Err(invalid("the helper wrote to a handed-over device's socket")),
                    Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(err) => return Err(err),
                }
            }
            ready = notifications[0].readable() => { ready?.clear_ready(); 0 }
            ready = notifications[1].readable() => { ready?.clear_ready(); 1 }
            _ = tokio::task::yield_now(), if more.iter().any(|m| *m) => {
                more.iter().position(|m| *m).expect("one has more")
            }
        };
        more[index] = false;
        while requests.try_join_next().is_some() {}
        if broken[index] {
            continue;
        }
        match device.serve_ring(index, &mut requests).await {
            Turn::Drained(Drained::Empty) => {}
            Turn::Drained(Drained::Broken) => {
                tracing::warn!(target: "krunbox::fs", ring = index, "the guest broke a ring of a mount's device; it is no longer served");
                broken[index] = true;
            }
            Turn::More => more[index] = true,
        }
    }
}

/// How a turn at a ring ended.
enum Turn {
    Drained(Drained),
    /// [`TURN`] requests taken and more may wait: the other ring and the socket get a look
    /// before the next turn.
    More,
}

/// The most requests taken off one ring in one turn.
const TURN: usize = MAX_IN_FLIGHT;

fn set_nonblocking(fd: &OwnedFd) -> std::io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = OFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
    Ok(())
}

/// One handed-over device, shared by its requests' tasks.
struct Device {
    mem: GuestMemoryMmap,
    rings: Vec<Arc<Mutex<Queue>>>,
    /// The device's irqfd: writing it interrupts the guest.
    interrupt: OwnedFd,
    session: Arc<Session>,
    /// Requests answered at once.
    slots: Arc<Semaphore>,
}

impl Device {
    /// A device whose two rings are one queue of `size` laid out as the tests' and the fuzz
    /// target's driver lays it (`virtqueue::laid_out`), answered by `session`.
    #[cfg(any(test, feature = "fuzzing"))]
    fn laid_out(
        mem: &GuestMemoryMmap,
        size: u16,
        interrupt: OwnedFd,
        session: Session,
    ) -> Arc<Self> {
        let ring = Arc::new(Mutex::new(krunbox_virtio::queue::laid_out::laid_out_queue(
            size, mem,
        )));
        Arc::new(Device {
            mem: mem.clone(),
            rings: vec![ring.clone(), ring],
            interrupt,
            session: Arc::new(session),
            slots: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        })
    }

    /// Takes up to [`TURN`] requests off ring `index` and starts answering each, waiting for
    /// a slot before taking the next.
    async fn serve_ring(self: &Arc<Self>, index: usize, requests: &mut JoinSet<()>) -> Turn {
        for _ in 0..TURN {
            let permit = self
                .slots
                .clone()
                .acquire_owned()
                .await
                .expect("never closed");
            match next_request(&self.mem, &self.rings[index], LIMITS) {
                Next::Drained(drained) => return Turn::Drained(drained),
                Next::Request(request) => self.take(index, request, permit, requests),
            }
            // Answered requests' tasks are let go as they finish, not only between turns.
            while requests.try_join_next().is_some() {}
        }
        Turn::More
    }

    /// Interrupts the guest: some request is complete.
    fn signal(&self) {
        // KVM drains an irqfd's count as it injects, so it is always writable; one that is
        // not was handed over by a helper that is no longer honest (KVM does not drain it,
        // the helper filled it), and writing it could block were the helper to clear the
        // file's O_NONBLOCK too (the file is shared): skipped. (A helper that does both
        // between this look and the write still blocks this thread: docs/security.md, Known
        // gaps.)
        let mut writable = [libc::pollfd {
            fd: self.interrupt.as_raw_fd(),
            events: libc::POLLOUT,
            revents: 0,
        }];
        // SAFETY: poll on one live pollfd, without waiting.
        let ready = unsafe { libc::poll(writable.as_mut_ptr(), 1, 0) };
        if ready == 1 && writable[0].revents & libc::POLLOUT != 0 {
            let _ = nix::unistd::write(&self.interrupt, &1u64.to_ne_bytes());
        }
    }

    fn complete(&self, index: usize, head: u16, written: u32) {
        complete(&self.mem, &self.rings[index], head, written, &|| {
            self.signal()
        });
    }

    /// Copies one request's headers out of guest memory (the rest too unless it is a write's
    /// data) and answers it ([`answer`]).
    fn take(
        self: &Arc<Self>,
        index: usize,
        request: Popped,
        permit: OwnedSemaphorePermit,
        requests: &mut JoinSet<()>,
    ) {
        let Some(chain) = request.chain else {
            self.complete(index, request.head, 0);
            return;
        };
        let fail = |unique: u64| {
            let written = fail_request(&self.mem, &chain.writable, unique);
            self.complete(index, request.head, written);
        };
        let Some((header, opcode, unique)) = read_in_header(&self.mem, &chain) else {
            return fail(0);
        };
        // A write's data stays in guest memory: the filesystem takes it from there
        // (`VirtualFs::write_data`), one pass over its bytes rather than two.
        let head_len =
            if opcode == WRITE_OPCODE && chain.readable_len > IN_HEADER_LEN + WRITE_IN_LEN {
                IN_HEADER_LEN + WRITE_IN_LEN
            } else {
                chain.readable_len
            };
        // The header as checked, then the rest: a guest changing its memory meanwhile
        // changes only the bytes after it.
        let mut message = vec![0u8; head_len];
        message[..IN_HEADER_LEN].copy_from_slice(&header);
        if gather(
            &self.mem,
            &chain.readable,
            IN_HEADER_LEN,
            &mut message[IN_HEADER_LEN..],
        )
        .is_err()
        {
            return fail(unique);
        }
        let device = self.clone();
        if is_unanswered(opcode) {
            // Nothing to write back: the chain is done now, the request is handled after.
            self.complete(index, request.head, 0);
            answer(
                async move {
                    let _permit = permit;
                    let _ = device.session.handle(&message).await;
                },
                requests,
            );
            return;
        }
        let answering = async move {
            let _permit = permit;
            let handled = if head_len < chain.readable_len {
                let data = WriteData::in_guest(
                    &device.mem,
                    &chain.readable,
                    head_len,
                    chain.readable_len - head_len,
                );
                device.session.handle_with(&message, Some(data)).await
            } else {
                device.session.handle(&message).await
            };
            let written = match handled {
                Ok(Some(reply)) => {
                    let fits = reply.len().min(chain.writable_len());
                    match scatter(&device.mem, &chain.writable, 0, &reply[..fits]) {
                        Ok(()) => fits as u32,
                        Err(_) => 0,
                    }
                }
                // The session answers every request it decoded; one it could not decode (or
                // did not answer) fails, so the guest's call does not wait forever.
                Ok(None) | Err(_) => fail_request(&device.mem, &chain.writable, unique),
            };
            device.complete(index, request.head, written);
        };
        answer(answering, requests);
    }
}

/// Runs `answering` as far as it goes now, and as a task of its own only if it has to wait:
/// most requests (all of `MemoryFs`'s, `HostDir`'s metadata) are answered without waiting,
/// and a task each cost them a spawn and a scheduling that were a tenth of a request's time
/// under nested emulation. Polled here first with a waker that does nothing: a future that
/// waits registers the task's waker when the task polls it again.
fn answer(answering: impl Future<Output = ()> + Send + 'static, requests: &mut JoinSet<()>) {
    let mut answering = Box::pin(answering);
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    // A panic in the implementation ends that request (as it ended its task before), not the
    // mount's task.
    let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        answering.as_mut().poll(&mut context)
    }));
    match polled {
        Ok(std::task::Poll::Pending) => {
            requests.spawn(answering);
        }
        Ok(std::task::Poll::Ready(())) => {}
        Err(_) => {
            tracing::error!(target: "krunbox::fs", "a filesystem call panicked; its request is not answered");
        }
    }
}

#[cfg(test)]
mod tests;
