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

#[cfg(test)]
use super::FUSE_FORGET;
use super::{drain, serve_replies, Shared, OUT_HEADER_LEN};
use crate::fs::fuse::{is_unanswered, IN_HEADER_LEN, MAX_REQUEST};
use crate::virtqueue::laid_out::{check_completions, laid_out_queue, HostileQueue, Input};
#[cfg(test)]
use crate::virtqueue::laid_out::{seed, DATA};

/// Runs one input; panics where the property does not hold.
pub(crate) fn fuzz_queue(data: &[u8]) {
    run(data);
    // The same guest with the queue handed over to the library.
    crate::fs::served::fuzz::run(data);
}

/// Runs one input: the requests that reached the library, and the completions.
fn run(data: &[u8]) -> (usize, u16) {
    let mut input = Input(data);
    let HostileQueue { mem, size, offered } = HostileQueue::from_input(&mut input);
    // How the library answers: a body length (in KiB) per request, in turn.
    let answers: Vec<u8> = (0..8).map(|_| input.u8()).collect();
    input.fill_memory(&mem);

    let ring = Arc::new(Mutex::new(laid_out_queue(size, &mem)));
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
    let used = check_completions(&mem, size, offered).len() as u16;
    (requests, used)
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
    fn each_seed_reaches_the_library_and_is_completed() {
        for seed in seeds() {
            assert_eq!(run(&seed), (1, 1));
            assert_eq!(crate::fs::served::fuzz::run(&seed), 1);
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
