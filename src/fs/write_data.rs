//! The bytes of one write, where the guest put them.
//!
//! When the library serves a mount's queues itself (the VM's memory is a file this process
//! maps), a write's data is still in guest memory when the filesystem is called. Copying it
//! into a buffer first and then into the file is a second pass over every byte, where
//! libkrun's passthrough makes one (`pwritev` from guest memory). [`WriteData`] lets the
//! filesystem take the bytes straight from where they are: [`HostDir`](super::HostDir) hands
//! the guest's buffers to `pwritev`, [`MemoryFs`](super::MemoryFs) copies them into its chunks
//! (bytes past a chunk's end into zeros it adds first: guest memory is never a slice).
//!
//! Guest memory is never seen as a Rust slice: the guest may change it while it is read (its
//! own business: the write then holds some mix of its bytes), so it is read with volatile
//! copies or by the kernel.

use std::os::fd::{AsRawFd, BorrowedFd};

use vm_memory::{GuestAddress, GuestMemoryMmap};

use super::types::{FsError, FsResult};
use krunbox_virtio::queue::{gather, write_some_at_from_guest};

/// The data of one write request: [`len`](WriteData::len) bytes, read with
/// [`copy_to`](WriteData::copy_to) or [`to_vec`](WriteData::to_vec).
///
/// [`VirtualFs::write_data`](super::VirtualFs::write_data) receives it; its default copies
/// the bytes out and calls [`VirtualFs::write`](super::VirtualFs::write).
///
/// ```
/// use krunbox::fs::WriteData;
///
/// let data = WriteData::from_bytes(b"hello, world");
/// assert_eq!(data.len(), 12);
/// let mut first = [0u8; 5];
/// data.copy_to(0, &mut first).unwrap();
/// assert_eq!(&first, b"hello");
/// assert_eq!(data.to_vec().unwrap(), b"hello, world");
/// assert_eq!(data.as_bytes(), Some(&b"hello, world"[..]));
/// ```
#[derive(Clone, Copy)]
pub struct WriteData<'a>(Source<'a>);

#[derive(Clone, Copy)]
enum Source<'a> {
    Bytes(&'a [u8]),
    /// Bytes `skip..skip + len` of `regions`, which the queue's code checked lie in `mem`.
    Guest {
        mem: &'a GuestMemoryMmap,
        regions: &'a [(GuestAddress, u32)],
        skip: usize,
        len: usize,
    },
}

impl<'a> WriteData<'a> {
    /// Data held in a buffer (as tests and other transports have it).
    pub fn from_bytes(bytes: &'a [u8]) -> WriteData<'a> {
        WriteData(Source::Bytes(bytes))
    }

    /// Bytes `skip..skip + len` of a request's readable descriptors, in guest memory. The
    /// caller checked that `regions` lie in `mem` and hold at least `skip + len` bytes.
    pub(crate) fn in_guest(
        mem: &'a GuestMemoryMmap,
        regions: &'a [(GuestAddress, u32)],
        skip: usize,
        len: usize,
    ) -> WriteData<'a> {
        debug_assert!(
            regions.iter().map(|(_, len)| *len as usize).sum::<usize>() >= skip + len,
            "the regions hold the data"
        );
        WriteData(Source::Guest {
            mem,
            regions,
            skip,
            len,
        })
    }

    /// How many bytes the write carries.
    pub fn len(&self) -> usize {
        match self.0 {
            Source::Bytes(bytes) => bytes.len(),
            Source::Guest { len, .. } => len,
        }
    }

    /// Whether the write carries no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes as a slice, when they are in a buffer already (not in guest memory).
    pub fn as_bytes(&self) -> Option<&'a [u8]> {
        match self.0 {
            Source::Bytes(bytes) => Some(bytes),
            Source::Guest { .. } => None,
        }
    }

    /// Copies bytes `at..at + out.len()` of the data into `out`. Fails with `EINVAL` when
    /// that range is not within the data, and with `EIO` if guest memory could not be read
    /// (never expected: the ranges were checked when the request arrived).
    pub fn copy_to(&self, at: usize, out: &mut [u8]) -> FsResult<()> {
        if at.checked_add(out.len()).is_none_or(|end| end > self.len()) {
            return Err(FsError::INVALID);
        }
        match self.0 {
            Source::Bytes(bytes) => {
                out.copy_from_slice(&bytes[at..at + out.len()]);
                Ok(())
            }
            Source::Guest {
                mem, regions, skip, ..
            } => gather(mem, regions, skip + at, out).map_err(|_| FsError::IO),
        }
    }

    /// The bytes, copied into a new buffer.
    pub fn to_vec(&self) -> FsResult<Vec<u8>> {
        if let Some(bytes) = self.as_bytes() {
            return Ok(bytes.to_vec());
        }
        let mut out = vec![0u8; self.len()];
        self.copy_to(0, &mut out)?;
        Ok(out)
    }

    /// Writes the data into `file` at `offset` (`pwritev` straight from guest memory), again
    /// until every byte is written; a failure after some bytes were is a short write, as
    /// `pwrite`'s (a write that fills the disk), and returns how many.
    pub(crate) fn write_at(&self, file: BorrowedFd<'_>, offset: u64) -> std::io::Result<usize> {
        match self.0 {
            Source::Bytes(bytes) => pwrite_full(file, offset, bytes),
            Source::Guest {
                mem,
                regions,
                skip,
                len,
            } => write_some_at_from_guest(mem, regions, skip, len, &file, offset),
        }
    }
}

/// Writes all of `data` at `offset`, or as much as fits (a partial count, if the filesystem
/// fills after some was written).
fn pwrite_full(fd: BorrowedFd<'_>, offset: u64, data: &[u8]) -> std::io::Result<usize> {
    let mut done = 0;
    while done < data.len() {
        let at = offset
            .checked_add(done as u64)
            .and_then(|at| i64::try_from(at).ok())
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EFBIG))?;
        // SAFETY: the slice from `done` is in bounds.
        let n = unsafe {
            libc::pwrite(
                fd.as_raw_fd(),
                data[done..].as_ptr().cast(),
                data.len() - done,
                at,
            )
        };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            if done > 0 {
                return Ok(done);
            }
            return Err(err);
        }
        if n == 0 {
            break;
        }
        done += n as usize;
    }
    Ok(done)
}

impl std::fmt::Debug for WriteData<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let place = match self.0 {
            Source::Bytes(_) => "buffer",
            Source::Guest { .. } => "guest memory",
        };
        f.debug_struct("WriteData")
            .field("len", &self.len())
            .field("in", &place)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 16)]).unwrap()
    }

    /// Data spread over three descriptors, the first partly a header, reads back whole and in
    /// any piece, in guest memory as in a buffer.
    #[test]
    fn data_in_guest_memory_reads_as_the_same_bytes_as_in_a_buffer() {
        let mem = memory();
        let bytes: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
        // A 16-byte header, then the data in pieces of 1000, 1500 and 500 bytes.
        let regions = [
            (GuestAddress(0x1000), 1016),
            (GuestAddress(0x3000), 1500),
            (GuestAddress(0x8000), 500),
        ];
        mem.write_slice(&bytes[..1000], GuestAddress(0x1010))
            .unwrap();
        mem.write_slice(&bytes[1000..2500], GuestAddress(0x3000))
            .unwrap();
        mem.write_slice(&bytes[2500..], GuestAddress(0x8000))
            .unwrap();
        let guest = WriteData::in_guest(&mem, &regions, 16, 3000);
        let buffer = WriteData::from_bytes(&bytes);
        for data in [guest, buffer] {
            assert_eq!(data.len(), 3000);
            assert_eq!(data.to_vec().unwrap(), bytes);
            let mut piece = [0u8; 700];
            data.copy_to(900, &mut piece).unwrap();
            assert_eq!(&piece[..], &bytes[900..1600]);
            assert_eq!(data.copy_to(2500, &mut piece), Err(FsError::INVALID));
            assert_eq!(data.copy_to(usize::MAX, &mut piece), Err(FsError::INVALID));
        }
        assert!(guest.as_bytes().is_none());

        let dir = tempfile::tempdir().unwrap();
        for (name, data) in [("guest", guest), ("buffer", buffer)] {
            let file = std::fs::File::create(dir.path().join(name)).unwrap();
            use std::os::fd::AsFd;
            assert_eq!(data.write_at(file.as_fd(), 10).unwrap(), 3000);
            let written = std::fs::read(dir.path().join(name)).unwrap();
            assert_eq!(&written[10..], &bytes[..], "{name}");
            assert!(written[..10].iter().all(|&b| b == 0));
        }
    }
}
