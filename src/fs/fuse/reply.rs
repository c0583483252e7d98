//! Encoding FUSE replies: each is one message, a header and the opcode's reply structure.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuse_backend_rs::abi::fuse_abi as abi;
use vm_memory::ByteValued;

use crate::fs::types::{Attr, CachePolicy, DirEntry, Entry, StatFs};

const OUT_HEADER_LEN: usize = std::mem::size_of::<abi::OutHeader>();

/// A reply carrying `body` to request `unique`.
pub(crate) fn ok(unique: u64, body: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(OUT_HEADER_LEN + body.len());
    let header = abi::OutHeader {
        len: (OUT_HEADER_LEN + body.len()) as u32,
        error: 0,
        unique,
    };
    message.extend_from_slice(header.as_slice());
    message.extend_from_slice(body);
    message
}

/// A reply carrying one structure.
pub(crate) fn value<T: ByteValued>(unique: u64, value: &T) -> Vec<u8> {
    ok(unique, value.as_slice())
}

/// A failure: `errno` (positive) as the kernel wants it (negated).
pub(crate) fn error(unique: u64, errno: i32) -> Vec<u8> {
    let header = abi::OutHeader {
        len: OUT_HEADER_LEN as u32,
        error: -errno.clamp(1, 4095),
        unique,
    };
    header.as_slice().to_vec()
}

/// Seconds and nanoseconds since the epoch, negative seconds (as two's complement) before it:
/// the kernel reads the seconds as signed.
fn timestamp(time: SystemTime) -> (u64, u32) {
    match time.duration_since(UNIX_EPOCH) {
        Ok(after) => (after.as_secs(), after.subsec_nanos()),
        Err(before) => {
            // In i128: a time the guest set as far back as i64 seconds go must not overflow.
            let before = before.duration();
            let (mut secs, mut nanos) = (-i128::from(before.as_secs()), before.subsec_nanos());
            if nanos > 0 {
                secs -= 1;
                nanos = 1_000_000_000 - nanos;
            }
            if secs < i128::from(i64::MIN) {
                (secs, nanos) = (i128::from(i64::MIN), 0);
            }
            (secs as i64 as u64, nanos)
        }
    }
}

/// The inverse of [`timestamp`], for times the guest sets; out-of-range values saturate.
pub(crate) fn time_from(secs: u64, nanos: u32) -> SystemTime {
    let secs = secs as i64;
    let nanos = Duration::from_nanos(u64::from(nanos.min(999_999_999)));
    if secs >= 0 {
        UNIX_EPOCH
            .checked_add(Duration::from_secs(secs as u64) + nanos)
            .unwrap_or(UNIX_EPOCH)
    } else {
        UNIX_EPOCH
            .checked_sub(Duration::from_secs(secs.unsigned_abs()))
            .and_then(|t| t.checked_add(nanos))
            .unwrap_or(UNIX_EPOCH)
    }
}

pub(crate) fn attr(attr: &Attr) -> abi::Attr {
    let (atime, atimensec) = timestamp(attr.atime);
    let (mtime, mtimensec) = timestamp(attr.mtime);
    let (ctime, ctimensec) = timestamp(attr.ctime);
    abi::Attr {
        ino: attr.ino.0,
        size: attr.size,
        blocks: attr.blocks,
        atime,
        mtime,
        ctime,
        atimensec,
        mtimensec,
        ctimensec,
        mode: attr.kind.mode_bits() | (attr.perm & 0o7777),
        nlink: attr.nlink,
        uid: attr.uid,
        gid: attr.gid,
        rdev: attr.rdev,
        blksize: 4096,
        flags: 0,
    }
}

pub(crate) fn entry(unique: u64, entry: &Entry, cache: CachePolicy) -> Vec<u8> {
    let out = abi::EntryOut {
        nodeid: entry.attr.ino.0,
        generation: entry.generation,
        entry_valid: cache.entry_timeout.as_secs(),
        attr_valid: cache.attr_timeout.as_secs(),
        entry_valid_nsec: cache.entry_timeout.subsec_nanos(),
        attr_valid_nsec: cache.attr_timeout.subsec_nanos(),
        attr: attr(&entry.attr),
    };
    value(unique, &out)
}

/// A negative entry: "no such name", cached for the entry timeout (node id 0).
pub(crate) fn negative_entry(unique: u64, cache: CachePolicy) -> Vec<u8> {
    let out = abi::EntryOut {
        entry_valid: cache.entry_timeout.as_secs(),
        entry_valid_nsec: cache.entry_timeout.subsec_nanos(),
        ..Default::default()
    };
    value(unique, &out)
}

pub(crate) fn attr_out(unique: u64, a: &Attr, cache: CachePolicy) -> Vec<u8> {
    let out = abi::AttrOut {
        attr_valid: cache.attr_timeout.as_secs(),
        attr_valid_nsec: cache.attr_timeout.subsec_nanos(),
        dummy: 0,
        attr: attr(a),
    };
    value(unique, &out)
}

pub(crate) fn open(unique: u64, handle: u64) -> Vec<u8> {
    value(
        unique,
        &abi::OpenOut {
            fh: handle,
            open_flags: 0,
            passthrough: 0,
        },
    )
}

pub(crate) fn create(unique: u64, e: &Entry, handle: u64, cache: CachePolicy) -> Vec<u8> {
    let entry = entry(unique, e, cache);
    let open = abi::OpenOut {
        fh: handle,
        open_flags: 0,
        passthrough: 0,
    };
    let mut body = entry[OUT_HEADER_LEN..].to_vec();
    body.extend_from_slice(open.as_slice());
    ok(unique, &body)
}

pub(crate) fn write(unique: u64, written: u32) -> Vec<u8> {
    value(
        unique,
        &abi::WriteOut {
            size: written,
            padding: 0,
        },
    )
}

pub(crate) fn statfs(unique: u64, s: &StatFs) -> Vec<u8> {
    let out = abi::StatfsOut {
        st: abi::Kstatfs {
            blocks: s.blocks,
            bfree: s.blocks_free,
            bavail: s.blocks_available,
            files: s.files,
            ffree: s.files_free,
            bsize: s.block_size,
            namelen: s.name_max,
            frsize: s.block_size,
            padding: 0,
            spare: [0; 6],
        },
    };
    value(unique, &out)
}

/// The size of an extended attribute reply when the caller asked only for the size.
pub(crate) fn xattr_size(unique: u64, size: usize) -> Vec<u8> {
    value(
        unique,
        &abi::GetxattrOut {
            size: size as u32,
            padding: 0,
        },
    )
}

/// Packs directory entries into at most `size` bytes (each a `fuse_dirent` and its name,
/// padded to 8 bytes); entries that do not fit are left for the next call, which resumes
/// from the last packed entry's offset.
/// The bytes a directory entry named `name_len` bytes takes in a `READDIR` reply.
pub(crate) fn dirent_size(name_len: usize) -> usize {
    (std::mem::size_of::<abi::Dirent>() + name_len).next_multiple_of(8)
}

tokio::task_local! {
    /// While a `readdir` call runs: the reply's room, in bytes, so an implementation can read
    /// no more entries than the guest will take (`HostDir` reads by its host cursor, which a
    /// seek back costs on some filesystems).
    static READDIR_ROOM: usize;
}

/// Runs a `readdir` call knowing its reply's room ([`readdir_room`]).
pub(crate) async fn with_readdir_room<F: std::future::Future>(room: usize, call: F) -> F::Output {
    READDIR_ROOM.scope(room, call).await
}

/// The room, in bytes, of the `READDIR` reply the running `readdir` call is for, if it is one.
pub(crate) fn readdir_room() -> Option<usize> {
    READDIR_ROOM.try_with(|room| *room).ok()
}

pub(crate) fn dirents(unique: u64, entries: &[DirEntry], size: usize) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    let mut body = Vec::with_capacity(size.min(64 * 1024));
    for item in entries {
        let name = item.name.as_bytes();
        // The implementation's names are checked like the guest's: one component.
        if name.is_empty() || name.len() > 255 || name.contains(&b'/') || name.contains(&0) {
            continue;
        }
        let dirent = abi::Dirent {
            ino: item.ino.0,
            off: item.offset,
            namelen: name.len() as u32,
            type_: item.kind.dirent_type(),
        };
        let unpadded = std::mem::size_of::<abi::Dirent>() + name.len();
        let padded = dirent_size(name.len());
        if body.len() + padded > size {
            break;
        }
        body.extend_from_slice(dirent.as_slice());
        body.extend_from_slice(name);
        body.resize(body.len() + padded - unpadded, 0);
    }
    ok(unique, &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_before_the_epoch_round_trip() {
        // The earliest time there is (found by the fs_request fuzz target: it overflowed).
        let earliest = time_from(i64::MIN as u64, 0);
        assert_eq!(timestamp(earliest), (i64::MIN as u64, 0));
        for time in [
            UNIX_EPOCH - Duration::from_millis(1500),
            UNIX_EPOCH - Duration::from_secs(7),
            UNIX_EPOCH + Duration::new(1_700_000_000, 5),
            UNIX_EPOCH,
        ] {
            let (secs, nanos) = timestamp(time);
            assert!(nanos < 1_000_000_000);
            assert_eq!(time_from(secs, nanos), time);
        }
    }

    #[test]
    fn errors_are_negated_and_clamped() {
        let message = error(9, libc::ENOENT);
        assert_eq!(message.len(), OUT_HEADER_LEN);
        assert_eq!(i32::from_le_bytes(message[4..8].try_into().unwrap()), -2);
        let bad = error(9, -5);
        assert_eq!(i32::from_le_bytes(bad[4..8].try_into().unwrap()), -1);
    }
}
