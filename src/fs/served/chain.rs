//! A request chain's FUSE framing, read out of guest memory: its header checked against the
//! chain, and the `EIO` a request gets when it never reaches the session.

use vm_memory::{GuestAddress, GuestMemoryMmap};

use crate::fs::fuse::{IN_HEADER_LEN, MAX_REQUEST};
use krunbox_virtio::queue::{gather, scatter, Chain, ChainLimits};

/// The most descriptors a request's reply may be spread over: a 1 MiB read is 256 pages and a
/// header. More is no request of the guest's driver, and each is remembered until the reply.
const MAX_REPLY_DESCRIPTORS: usize = 300;

/// The bounds of a request chain: a request's bytes within [`MAX_REQUEST`], its reply's room in
/// at most [`MAX_REPLY_DESCRIPTORS`] descriptors.
pub(crate) const LIMITS: ChainLimits = ChainLimits {
    max_readable: MAX_REQUEST,
    max_writable_descriptors: MAX_REPLY_DESCRIPTORS,
};

/// A FUSE reply header: `len: u32, error: i32, unique: u64`.
pub(crate) const OUT_HEADER_LEN: usize = 16;

/// Answers a request the session never sees with `EIO` (the guest kernel reads the reply
/// header whatever the used length says, so a request completed with no header would
/// "succeed" with whatever its buffers held). Returns the bytes written: 16, or 0 when the
/// chain has no room for a header.
pub(crate) fn fail_request(
    mem: &GuestMemoryMmap,
    reply_to: &[(GuestAddress, u32)],
    unique: u64,
) -> u32 {
    let room: usize = reply_to.iter().map(|(_, l)| *l as usize).sum();
    if room < OUT_HEADER_LEN {
        return 0;
    }
    let mut header = [0u8; OUT_HEADER_LEN];
    header[0..4].copy_from_slice(&(OUT_HEADER_LEN as u32).to_le_bytes());
    header[4..8].copy_from_slice(&(-libc::EIO).to_le_bytes());
    header[8..16].copy_from_slice(&unique.to_le_bytes());
    match scatter(mem, reply_to, 0, &header) {
        Ok(()) => OUT_HEADER_LEN as u32,
        Err(_) => 0,
    }
}

/// A request chain's FUSE header, copied out of guest memory once, with its opcode and
/// `unique`; `None` when the chain is shorter than a header or the header's length is not
/// the chain's.
pub(crate) fn read_in_header(
    mem: &GuestMemoryMmap,
    chain: &Chain,
) -> Option<([u8; IN_HEADER_LEN], u32, u64)> {
    if chain.readable_len < IN_HEADER_LEN {
        return None;
    }
    let mut header = [0u8; IN_HEADER_LEN];
    gather(mem, &chain.readable, 0, &mut header).ok();
    let (opcode, unique) = parse_in_header(&header, chain.readable_len)?;
    Some((header, opcode, unique))
}

/// The opcode and `unique` of a request header whose length field is `total`.
fn parse_in_header(header: &[u8; IN_HEADER_LEN], total: usize) -> Option<(u32, u64)> {
    let length = u32::from_le_bytes(header[0..4].try_into().ok()?) as usize;
    if length != total {
        return None;
    }
    let opcode = u32::from_le_bytes(header[4..8].try_into().ok()?);
    let unique = u64::from_le_bytes(header[8..16].try_into().ok()?);
    Some((opcode, unique))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::fuse::fuzz::request;

    #[test]
    fn in_header_is_checked_against_the_request_length() {
        let bytes = request(15, 77, 1, &[0u8; 8]);
        let header: [u8; IN_HEADER_LEN] = bytes[..IN_HEADER_LEN].try_into().unwrap();
        assert_eq!(parse_in_header(&header, bytes.len()), Some((15, 77)));
        // A length that is not the request's own.
        assert_eq!(parse_in_header(&header, bytes.len() + 1), None);
    }
}
