//! The fuzz property of a mount's connection (`fuzz/fuzz_targets/fs_request.rs`): a hostile
//! guest's bytes, read as the service reads them, answered by a [`MemoryFs`]. Every other
//! write (by its request id) has its data in guest memory, spread over buffers of the id's
//! choosing, as the library's serving of a mount's queues hands writes over.
#![cfg(any(test, feature = "fuzzing"))]

use std::sync::Arc;

use fuse_backend_rs::abi::fuse_abi as abi;
use vm_memory::ByteValued;

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::request::{IN_HEADER_LEN, MAX_REQUEST, WRITE_IN_LEN, WRITE_OPCODE};
use super::Session;
use crate::fs::{MemoryFs, MountOptions, WriteData};

const OUT_HEADER_LEN: usize = std::mem::size_of::<abi::OutHeader>();

/// `data` is what the guest sends on a mount's connection after its index: FUSE requests, each
/// framed by its header's length. The session has been initialised (as by the guest kernel's
/// INIT) and is backed by a small [`MemoryFs`]; messages are read as `service.rs` reads them
/// (a length out of bounds ends the connection) and answered one after another. Panics if
/// anything panics, or if a reply is not one well-formed FUSE reply to its request: its length
/// field is its length, its unique id the request's, its error 0 or a negated errno.
pub(crate) fn fuzz_session(data: &[u8]) {
    converse(data);
}

/// `data` in guest memory as a driver might lay it out: pieces of a size `unique` chooses (at
/// most 256 of them), apart from each other, the first after `skip` bytes of something else.
fn in_guest_memory(data: &[u8], unique: u64) -> (GuestMemoryMmap, Vec<(GuestAddress, u32)>, usize) {
    let piece = (1 + (unique >> 1) as usize % 4093).max(data.len() / 256 + 1);
    let skip = (unique >> 13) as usize % 3;
    let stride = skip + piece + 8;
    let count = data.len().div_ceil(piece);
    let size = (count * stride).next_multiple_of(4096);
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size)]).expect("guest memory");
    let mut regions = Vec::with_capacity(count);
    for (i, chunk) in data.chunks(piece).enumerate() {
        let at = (i * stride) as u64;
        let lead = if i == 0 { skip } else { 0 };
        mem.write_slice(&vec![0xee; lead], GuestAddress(at))
            .expect("in memory");
        mem.write_slice(chunk, GuestAddress(at + lead as u64))
            .expect("in memory");
        regions.push((GuestAddress(at), (lead + chunk.len()) as u32));
    }
    (mem, regions, skip)
}

/// Answers `data` as [`fuzz_session`] does and returns each reply's request id and error.
fn converse(data: &[u8]) -> Vec<(u64, i32)> {
    let mut replies = Vec::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let fs = MemoryFs::with_limits(1 << 20, 256);
        let session = Session::new(Arc::new(fs), MountOptions::new());
        let init = init_request(1);
        let reply = session
            .handle(&init)
            .await
            .unwrap()
            .expect("INIT is answered");
        check_reply(&reply, 1);
        let mut rest = data;
        while rest.len() >= 4 {
            let length = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
            if !(IN_HEADER_LEN..=MAX_REQUEST).contains(&length) || length > rest.len() {
                return;
            }
            let (message, after) = rest.split_at(length);
            rest = after;
            let unique = u64::from_le_bytes(message[8..16].try_into().unwrap());
            let opcode = u32::from_le_bytes(message[4..8].try_into().unwrap());
            let head_len = IN_HEADER_LEN + WRITE_IN_LEN;
            let handled = if opcode == WRITE_OPCODE && message.len() > head_len && unique % 2 == 0 {
                let (head, data) = message.split_at(head_len);
                let (mem, regions, skip) = in_guest_memory(data, unique);
                let data = WriteData::in_guest(&mem, &regions, skip, data.len());
                session.handle_with(head, Some(data)).await
            } else {
                session.handle(message).await
            };
            match handled {
                Ok(Some(reply)) => {
                    check_reply(&reply, unique);
                    let error = i32::from_le_bytes(reply[4..8].try_into().unwrap());
                    replies.push((unique, error));
                }
                Ok(None) => {}
                Err(_) => return,
            }
        }
    });
    replies
}

pub(crate) fn check_reply(reply: &[u8], unique: u64) {
    assert!(
        reply.len() >= OUT_HEADER_LEN,
        "a reply shorter than its header"
    );
    let mut header = abi::OutHeader::default();
    header
        .as_mut_slice()
        .copy_from_slice(&reply[..OUT_HEADER_LEN]);
    assert_eq!(header.len as usize, reply.len(), "a reply's length field");
    assert_eq!(header.unique, unique, "a reply to another request");
    assert!(
        (-4095..=0).contains(&header.error),
        "error {}",
        header.error
    );
    if header.error != 0 {
        assert_eq!(reply.len(), OUT_HEADER_LEN, "an error reply with a body");
    }
}

/// The guest kernel's INIT (protocol 7.41, as Linux 6.12 sends it).
pub(crate) fn init_request(unique: u64) -> Vec<u8> {
    let init = abi::InitIn {
        major: 7,
        minor: 41,
        max_readahead: 128 * 1024,
        flags: u32::MAX,
    };
    let mut body = init.as_slice().to_vec();
    body.extend_from_slice(&[0u8; 48]);
    request(26, unique, 0, &body)
}

/// One request as the guest kernel frames it.
pub(crate) fn request(opcode: u32, unique: u64, nodeid: u64, body: &[u8]) -> Vec<u8> {
    let header = abi::InHeader {
        len: (IN_HEADER_LEN + body.len()) as u32,
        opcode,
        unique,
        nodeid,
        uid: 0,
        gid: 0,
        pid: 1,
        padding: 0,
    };
    let mut bytes = header.as_slice().to_vec();
    bytes.extend_from_slice(body);
    bytes
}

/// Conversations a guest has with a mount, each a seed: the operations of a build (make a
/// directory, create, write, read, list, rename, link, set attributes and xattrs, unlink), and
/// a few requests the guest should not send.
#[cfg(test)]
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    let cat = |name: &str| [name.as_bytes(), b"\0"].concat();
    let with = |args: &[u8], tail: &[u8]| [args, tail].concat();
    let mkdir = abi::MkdirIn {
        mode: 0o755,
        umask: 0o022,
    };
    let create = abi::CreateIn {
        flags: (libc::O_RDWR | libc::O_CREAT) as u32,
        mode: libc::S_IFREG | 0o644,
        umask: 0o022,
        fuse_flags: 0,
    };
    // Node ids MemoryFs hands out in order: the root is 1, then 2, 3, ...
    // Handles too: the file created is handle 1, the directory opened handle 2.
    let write = abi::WriteIn {
        fh: 1,
        offset: 0,
        size: 11,
        ..Default::default()
    };
    let read = abi::ReadIn {
        fh: 1,
        offset: 0,
        size: 4096,
        ..Default::default()
    };
    let readdir = abi::ReadIn { fh: 2, ..read };
    let setattr = abi::SetattrIn {
        valid: 0x1 | 0x8, // mode, size
        mode: 0o600,
        size: 3,
        ..Default::default()
    };
    let rename = abi::Rename2In {
        newdir: 2,
        flags: libc::RENAME_NOREPLACE,
        padding: 0,
    };
    let xattr = abi::SetxattrIn { size: 5, flags: 0 };
    let getxattr = abi::GetxattrIn {
        size: 64,
        padding: 0,
    };
    let fallocate = abi::FallocateIn {
        fh: 1,
        offset: 4,
        length: 70_000,
        mode: 0,
        padding: 0,
    };
    let killing_write = abi::WriteIn {
        fuse_flags: abi::WRITE_KILL_PRIV,
        size: 2,
        ..write
    };
    let link = abi::LinkIn { oldnodeid: 3 };
    let forget = abi::ForgetIn { nlookup: 1 };
    let build = [
        request(9, 2, 1, &with(mkdir.as_slice(), &cat("src"))),
        request(35, 3, 2, &with(create.as_slice(), &cat("main.rs"))),
        request(16, 4, 3, &with(write.as_slice(), b"fn main(){}")),
        request(15, 5, 3, read.as_slice()),
        request(4, 6, 3, setattr.as_slice()),
        request(43, 30, 3, fallocate.as_slice()),
        request(16, 31, 3, &with(killing_write.as_slice(), b"//")),
        request(
            21,
            7,
            3,
            &with(
                xattr.as_slice(),
                &[cat("user.k"), b"value".to_vec()].concat(),
            ),
        ),
        request(22, 8, 3, &with(getxattr.as_slice(), &cat("user.k"))),
        request(13, 9, 1, &with(link.as_slice(), &cat("hard"))),
        request(
            45,
            10,
            1,
            &with(rename.as_slice(), &[cat("hard"), cat("moved")].concat()),
        ),
        request(27, 11, 2, &[0u8; 8]),
        request(28, 12, 2, readdir.as_slice()),
        request(6, 13, 1, &[cat("link"), cat("../../etc/passwd")].concat()),
        request(1, 14, 1, &cat("link")),
        request(5, 15, 4, &[]),
        request(10, 16, 2, &cat("main.rs")),
        request(2, 0, 3, forget.as_slice()),
        request(17, 17, 1, &[]),
    ]
    .concat();
    let hostile = [
        request(1, 20, 1, b"..\0"),
        request(1, 21, 1, b"a/b\0"),
        request(1, 22, 0, b"x\0"),
        request(7, 23, 1, b"getdir"),
        request(16, 24, 99, &with(write.as_slice(), b"short")),
        request(42, 0, 0, &[255, 255, 255, 255, 0, 0, 0, 0]),
        request(26, 25, 0, &[0u8; 8]),
    ]
    .concat();
    let mut truncated = build.clone();
    truncated.truncate(build.len() - 7);
    vec![
        build,
        hostile,
        truncated,
        vec![0; 64],
        request(0, 1, 1, &[]),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_seeds_hold_the_fuzz_property_and_reach_the_filesystem() {
        for seed in seeds() {
            fuzz_session(&seed);
        }
        // The build conversation succeeds step by step (so mutations of it start deep inside
        // the filesystem), and the hostile one is refused request by request.
        let seeds = seeds();
        let build = converse(&seeds[0]);
        assert_eq!(
            build.len(),
            18,
            "every request but the forget answered: {build:?}"
        );
        assert!(build.iter().all(|&(_, error)| error == 0), "{build:?}");
        let hostile: Vec<i32> = converse(&seeds[1]).iter().map(|&(_, e)| -e).collect();
        assert_eq!(
            hostile,
            [libc::EINVAL, libc::EINVAL, libc::EINVAL, libc::ENOSYS, libc::EINVAL, libc::EINVAL],
            "`..`, `a/b`, node 0, opcode 7, a short write, (no reply to a bad batch forget), a short INIT"
        );
    }

    /// The fuzz property on a replayable sample: the seeds with bytes overwritten, cut short
    /// and repeated.
    #[test]
    fn the_session_fuzz_property_holds_on_mutated_seeds() {
        crate::fuzzing::mutate_seeds(&seeds(), 3_000, 0x2545_f491_4f6c_dd1d, fuzz_session);
    }

    /// The committed corpus, replayed on every test run.
    #[test]
    fn the_fs_fuzz_corpus_holds_the_property() {
        crate::fuzzing::replay_corpus("fs_request", fuzz_session);
    }

    /// The corpus holds the seeds as they are generated now (`seed-NN`). After changing them,
    /// write them with `KRUNBOX_WRITE_FUZZ_SEEDS=1 cargo test --lib committed_fs_request_seeds`.
    #[test]
    fn committed_fs_request_seeds_are_the_generated_ones() {
        crate::fuzzing::assert_committed_seeds("fs_request", &seeds());
    }
}
