//! The fuzz property of a mount's device (`fuzz/fuzz_targets/virtio_fs_queue.rs`): a hostile
//! guest's virtqueue (any descriptor table, any available ring, any bytes in memory), served
//! by the device's own code over a real socket pair, with a library that answers every request
//! it gets.
//!
//! Checks: nothing panics or hangs; what reaches the library is a sequence of requests, each
//! framed by its header's length, within [`MAX_REQUEST`]; once every request is answered no
//! request is still waiting; every completion names a chain the guest offered and says at most
//! as many bytes as the chain had room for; and nothing is completed twice.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use krun_sys::device::{Bytes, GuestAddress, GuestMemoryMmap, Queue};

#[cfg(test)]
use super::FUSE_FORGET;
use super::{drain, serve_replies, Shared, OUT_HEADER_LEN};
use crate::fs::fuse::{is_unanswered, IN_HEADER_LEN, MAX_REQUEST};

/// Guest memory: the rings low, then what the input puts in memory.
const MEMORY: u64 = 256 * 1024;
pub(super) const DESC_TABLE: u64 = 0;
pub(super) const AVAIL_RING: u64 = 0x1000;
pub(super) const USED_RING: u64 = 0x2000;
const DATA: u64 = 0x4000;

/// Reads the input front to back; past its end, zeros.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = N.min(self.0.len());
        out[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        out
    }
    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
}

/// Runs one input; panics where the property does not hold.
pub(crate) fn fuzz_queue(data: &[u8]) {
    run(data);
}

/// Runs one input: the requests that reached the library, and the completions.
fn run(data: &[u8]) -> (usize, u16) {
    let mut input = Input(data);
    let size = 1u16 << (input.u8() % 6 + 1); // 2 to 64
    let mem =
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEMORY as usize)]).expect("guest memory");
    // The descriptor table, from the input: addresses past the rings (some outside memory:
    // a guest that points replies at its own rings only corrupts them, which is its own
    // business and would only blur what is checked here), lengths up to 128 KiB, any flags
    // and links.
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
    // How the library answers: a body length (in KiB) per request, in turn.
    let answers: Vec<u8> = (0..8).map(|_| input.u8()).collect();
    let rest = &input.0[..input.0.len().min((MEMORY - DATA) as usize)];
    mem.write_slice(rest, GuestAddress(DATA))
        .expect("in memory");

    let ring = Arc::new(Mutex::new(laid_out_queue(size)));
    let shared = Arc::new(Shared::new(mem.clone(), || {}));

    let (mut helper, library) = UnixStream::pair().expect("a socket pair");
    let replies_in = helper.try_clone().expect("a second handle");
    let mut library_out = library.try_clone().expect("a second handle");
    // The library: reads every request, and answers each that gets an answer.
    let reader = std::thread::spawn(move || {
        let mut library = library;
        let mut forwarded = Vec::new();
        library
            .read_to_end(&mut forwarded)
            .expect("reading requests");
        forwarded
    });
    let completer = {
        let shared = shared.clone();
        std::thread::spawn(move || {
            let _ = serve_replies(&shared, replies_in);
        })
    };
    // A broken ring is only a reason to stop; either way nothing more is popped.
    drain(&shared, &ring, &mut helper, &mut Vec::new()).expect("the library reads");
    // No more requests: the library sees the end of them.
    helper
        .shutdown(std::net::Shutdown::Write)
        .expect("shutting down");
    let forwarded = reader.join().expect("the reader");

    let mut at = 0;
    let mut answered = 0;
    let mut requests = 0;
    while at < forwarded.len() {
        let rest = &forwarded[at..];
        assert!(
            rest.len() >= IN_HEADER_LEN,
            "a request shorter than its header"
        );
        let length = u32::from_le_bytes(rest[0..4].try_into().unwrap()) as usize;
        assert!(
            (IN_HEADER_LEN..=MAX_REQUEST).contains(&length) && length <= rest.len(),
            "a request of {length} bytes, {} left",
            rest.len()
        );
        let opcode = u32::from_le_bytes(rest[4..8].try_into().unwrap());
        let unique = u64::from_le_bytes(rest[8..16].try_into().unwrap());
        at += length;
        requests += 1;
        if is_unanswered(opcode) {
            continue;
        }
        let body = usize::from(answers[answered % answers.len()]) * 1024;
        answered += 1;
        let mut reply = vec![0u8; OUT_HEADER_LEN + body];
        let length = reply.len() as u32;
        reply[0..4].copy_from_slice(&length.to_le_bytes());
        reply[8..16].copy_from_slice(&unique.to_le_bytes());
        library_out.write_all(&reply).expect("writing a reply");
    }
    drop(library_out);
    drop(helper);
    completer.join().expect("the completer");

    assert!(
        shared.pending.lock().unwrap().is_empty(),
        "a request still waits after every request was answered"
    );
    let used: u16 = mem
        .read_obj(GuestAddress(USED_RING + 2))
        .expect("in memory");
    assert!(used <= offered, "{used} completions for {offered} chains");
    let mut heads = std::collections::HashSet::new();
    for slot in 0..u64::from(used) {
        let at = USED_RING + 4 + 8 * slot;
        let head: u32 = mem.read_obj(GuestAddress(at)).expect("in memory");
        assert!(
            head < u32::from(size),
            "completed head {head} of a queue of {size}"
        );
        assert!(heads.insert(head) || has_duplicate_offer(&mem, offered, head));
    }
    (requests, used)
}

/// Whether the guest offered `head` more than once (then it may be completed more than once).
fn has_duplicate_offer(mem: &GuestMemoryMmap, offered: u16, head: u32) -> bool {
    (0..u64::from(offered))
        .filter(|slot| {
            mem.read_obj::<u16>(GuestAddress(AVAIL_RING + 4 + 2 * slot))
                .is_ok_and(|h| u32::from(h) == head)
        })
        .count()
        > 1
}

/// A queue of `size` whose rings are at [`DESC_TABLE`], [`AVAIL_RING`] and [`USED_RING`],
/// ready, as a driver leaves it (the unit tests' queues too).
pub(super) fn laid_out_queue(size: u16) -> Queue {
    let mut queue = Queue::new(size);
    queue.size = size;
    queue.ready = true;
    queue.desc_table = GuestAddress(DESC_TABLE);
    queue.avail_ring = GuestAddress(AVAIL_RING);
    queue.used_ring = GuestAddress(USED_RING);
    queue
}

/// A FUSE request: a header whose length covers `body`, then `body`.
#[cfg(test)]
pub(super) fn request(opcode: u32, unique: u64, body: &[u8]) -> Vec<u8> {
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
    /// A seed: a queue of 4 with chains of (address, length, writable) descriptors, offered in
    /// order, answered with bodies of `answers` KiB, and `memory` at DATA.
    fn seed(chains: &[&[(u64, u32, bool)]], answers: [u8; 8], memory: &[u8]) -> Vec<u8> {
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
        out.extend_from_slice(&answers);
        out.extend_from_slice(memory);
        out
    }
    let lookup = request(1, 7, b"a\0");
    let forget = request(FUSE_FORGET, 8, &[0u8; 8]);
    let write = request(16, 9, &vec![0x5a; 100 * 1024]);
    let read = request(15, 10, &[]);
    vec![
        seed(
            &[&[
                (DATA, lookup.len() as u32, false),
                (DATA + 0x1000, 128, true),
            ]],
            [0; 8],
            &lookup,
        ),
        seed(&[&[(DATA, forget.len() as u32, false)]], [0; 8], &forget),
        seed(
            &[&[
                (DATA, 64, false),
                (DATA + 64, write.len() as u32 - 64, false),
                (DATA + 0x1_a000, 32, true),
            ]],
            [0; 8],
            &write,
        ),
        seed(
            &[&[
                (DATA, read.len() as u32, false),
                (DATA + 0x1000, 16 + 4096, true),
                (DATA + 0x3000, 60 * 1024, true),
            ]],
            [100; 8],
            &read,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_seed_reaches_the_library_and_is_completed() {
        for seed in seeds() {
            assert_eq!(run(&seed), (1, 1));
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
