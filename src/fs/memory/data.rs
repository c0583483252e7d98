//! A regular file's bytes: 64 KiB chunks, allocated only where something was written.
//!
//! A hole (never written, or past an extension by `truncate`) reads as zeros and costs nothing.
//! A chunk's buffer holds its bytes up to the last one written, so a small file costs its size;
//! buffers grow by doubling up to the chunk size, so appends copy little. What a file costs is
//! the sum of its buffers' capacities plus [`CHUNK_COST`] a chunk ([`FileData::charged`]): the
//! real allocation, which the filesystem counts against its byte limit.

use std::collections::BTreeMap;

use crate::fs::{FsResult, WriteData};

/// The size of one chunk.
pub(super) const CHUNK: u64 = 64 * 1024;

/// What a chunk costs beyond its buffer (its map slot and allocation): so that one-byte
/// writes a chunk apart cannot allocate much more than they are charged.
pub(super) const CHUNK_COST: u64 = 64;

/// A regular file's contents.
#[derive(Debug, Default)]
pub(super) struct FileData {
    size: u64,
    /// Chunk index → the chunk's bytes from its start (shorter than `CHUNK`: zeros follow).
    chunks: BTreeMap<u64, Vec<u8>>,
    /// The sum of the chunks' capacities, plus `CHUNK_COST` each.
    charged: u64,
}

/// The capacity a chunk buffer of capacity `capacity` grows to, to hold `needed` bytes.
fn grown(capacity: usize, needed: usize) -> usize {
    if needed <= capacity {
        capacity
    } else {
        needed.max(capacity.saturating_mul(2)).min(CHUNK as usize)
    }
}

/// The chunks `[offset, end)` touches, each as (chunk index, start and end within the chunk,
/// start within the data written).
fn spans(offset: u64, end: u64) -> impl Iterator<Item = (u64, usize, usize, usize)> {
    let first = offset / CHUNK;
    let last = if end > offset { (end - 1) / CHUNK } else { 0 };
    let count = if end > offset { last - first + 1 } else { 0 };
    (first..).take(count as usize).map(move |index| {
        let base = index * CHUNK;
        let from = base.max(offset);
        let to = (base + CHUNK).min(end);
        (
            index,
            (from - base) as usize,
            (to - base) as usize,
            (from - offset) as usize,
        )
    })
}

impl FileData {
    /// The file's size.
    pub(super) fn size(&self) -> u64 {
        self.size
    }

    /// The bytes its buffers hold (allocated, counted against the filesystem's limit).
    pub(super) fn charged(&self) -> u64 {
        self.charged
    }

    /// Up to `len` bytes at `offset` (fewer only at the end of the file).
    pub(super) fn read(&self, offset: u64, len: u64) -> Vec<u8> {
        // A read of nothing (a guest may ask for 0 bytes) would make the chunk range below
        // end before it starts.
        if offset >= self.size || len == 0 {
            return Vec::new();
        }
        let n = len.min(self.size - offset);
        let end = offset + n;
        let mut out = vec![0u8; n as usize];
        for (&index, chunk) in self.chunks.range(offset / CHUNK..=(end - 1) / CHUNK) {
            let base = index * CHUNK;
            let from = base.max(offset);
            let to = (base + chunk.len() as u64).min(end);
            if from < to {
                out[(from - offset) as usize..(to - offset) as usize]
                    .copy_from_slice(&chunk[(from - base) as usize..(to - base) as usize]);
            }
        }
        out
    }

    /// How many more bytes the buffers would hold after writing `len` bytes at `offset`.
    pub(super) fn write_cost(&self, offset: u64, len: u64) -> u64 {
        spans(offset, offset.saturating_add(len))
            .map(|(index, _, to, _)| match self.chunks.get(&index) {
                None => grown(0, to) as u64 + CHUNK_COST,
                Some(chunk) if chunk.len() >= to => 0,
                Some(chunk) => (grown(chunk.capacity(), to) - chunk.capacity()) as u64,
            })
            .sum()
    }

    /// Chunk `index`, made and given the capacity for at least `length` bytes (its length
    /// unchanged), and how many more bytes that made the buffers hold (not yet added to
    /// `charged`).
    fn chunk_with_room(&mut self, index: u64, length: usize) -> (&mut Vec<u8>, u64) {
        let mut added = 0;
        let chunk = self.chunks.entry(index).or_insert_with(|| {
            added += CHUNK_COST;
            Vec::new()
        });
        let before = chunk.capacity();
        if chunk.len() < length {
            let capacity = grown(before, length);
            chunk.reserve_exact(capacity - chunk.len());
        }
        added += (chunk.capacity() - before) as u64;
        (chunk, added)
    }

    /// Writes `data` at `offset` (the caller checked the size and the cost) and returns how
    /// many more bytes the buffers hold.
    pub(super) fn write(&mut self, offset: u64, data: &[u8]) -> u64 {
        // Bytes in a buffer always copy.
        self.write_data(offset, WriteData::from_bytes(data)).0
    }

    /// Writes `data` at `offset` (the caller checked the size and the cost), copying it
    /// straight from where it is (guest memory, or a buffer). Returns how many more bytes the
    /// buffers hold, and whether every byte copied: guest memory that could not be read
    /// (never expected: its ranges were checked) leaves zeros, and `EIO` for the guest.
    pub(super) fn write_data(&mut self, offset: u64, data: WriteData<'_>) -> (u64, FsResult<()>) {
        let end = offset + data.len() as u64;
        let mut added = 0;
        let mut copied = Ok(());
        for (index, from, to, at) in spans(offset, end) {
            let (chunk, grew) = self.chunk_with_room(index, to);
            added += grew;
            let n = to - from;
            // Bytes past the chunk's end are appended rather than zeroed and then
            // overwritten: a file written from start to end is copied once, not twice.
            // (Guest memory is copied into zeros: it is never seen as a slice.)
            let len = chunk.len();
            let (inside, past) = if to <= len {
                (n, 0)
            } else if from >= len {
                chunk.resize(from, 0);
                (0, n)
            } else {
                (len - from, to - len)
            };
            if inside > 0 {
                copied = copied.and(data.copy_to(at, &mut chunk[from..from + inside]));
            }
            if past > 0 {
                match data.as_bytes() {
                    Some(bytes) => chunk.extend_from_slice(&bytes[at + inside..at + n]),
                    None => {
                        let start = chunk.len();
                        chunk.resize(start + past, 0);
                        copied = copied.and(data.copy_to(at + inside, &mut chunk[start..]));
                    }
                }
            }
        }
        self.charged += added;
        self.size = self.size.max(end);
        (added, copied)
    }

    /// Gives `[offset, end)` buffers (zeros where nothing was written; written bytes stay) and
    /// grows the size to `end` when `grow` (the caller checked the size and the cost, which is
    /// [`FileData::write_cost`] of the range). Returns how many more bytes the buffers hold.
    pub(super) fn allocate(&mut self, offset: u64, end: u64, grow: bool) -> u64 {
        // Never past the size unless it grows to cover them: no bytes live past the size.
        let end = if grow { end } else { end.min(self.size) };
        let mut added = 0;
        for (index, _, to, _) in spans(offset, end) {
            let (chunk, grew) = self.chunk_with_room(index, to);
            if chunk.len() < to {
                chunk.resize(to, 0);
            }
            added += grew;
        }
        self.charged += added;
        if grow {
            self.size = self.size.max(end);
        }
        added
    }

    /// Sets the size: shorter drops the bytes past it, longer adds a hole (zeros, free).
    /// Returns how many fewer bytes the buffers hold.
    pub(super) fn truncate(&mut self, size: u64) -> u64 {
        if size >= self.size {
            self.size = size;
            return 0;
        }
        let boundary = size / CHUNK;
        let mut tail = self.chunks.split_off(&boundary);
        let mut freed: u64 = tail
            .values()
            .map(|chunk| chunk.capacity() as u64 + CHUNK_COST)
            .sum();
        let within = (size % CHUNK) as usize;
        if within > 0 {
            if let Some(mut chunk) = tail.remove(&boundary) {
                if chunk.len() > within {
                    chunk.truncate(within);
                    chunk.shrink_to_fit();
                }
                freed -= chunk.capacity() as u64 + CHUNK_COST;
                self.chunks.insert(boundary, chunk);
            }
        }
        self.charged -= freed;
        self.size = size;
        freed
    }

    /// Recounts what the buffers hold (tests check it against `charged`).
    #[cfg(test)]
    pub(super) fn recount(&self) -> u64 {
        self.chunks
            .values()
            .map(|c| c.capacity() as u64 + CHUNK_COST)
            .sum()
    }

    /// Whether any chunk holds bytes at or past the size (never should).
    #[cfg(test)]
    pub(super) fn has_bytes_past_size(&self) -> bool {
        self.chunks
            .iter()
            .any(|(&index, chunk)| index * CHUNK + chunk.len() as u64 > self.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the fs_request fuzz target: a read of 0 bytes (at the start, or inside a
    /// file) panicked on the chunk range.
    #[test]
    fn reads_of_nothing_return_nothing() {
        let mut data = FileData::default();
        data.write(0, &[7; 100]);
        assert!(data.read(0, 0).is_empty());
        assert!(data.read(50, 0).is_empty());
        assert!(data.read(CHUNK + 1, 0).is_empty());
    }

    #[test]
    fn sparse_writes_read_back_with_zeros_between() {
        let mut data = FileData::default();
        assert_eq!(data.write_cost(3 * CHUNK + 10, 5), 15 + CHUNK_COST);
        assert_eq!(data.write(3 * CHUNK + 10, b"hello"), 15 + CHUNK_COST);
        assert_eq!(data.size(), 3 * CHUNK + 15);
        assert_eq!(data.charged(), 15 + CHUNK_COST);
        // Growing the chunk's buffer: doubled (to 30), no new chunk.
        assert_eq!(data.write_cost(3 * CHUNK + 15, 1), 15);
        let all = data.read(0, u64::MAX);
        assert_eq!(all.len() as u64, 3 * CHUNK + 15);
        assert!(all[..(3 * CHUNK + 10) as usize].iter().all(|&b| b == 0));
        assert_eq!(&all[(3 * CHUNK + 10) as usize..], b"hello");
        assert_eq!(data.read(3 * CHUNK + 12, 100), b"llo");
        assert!(data.read(3 * CHUNK + 15, 100).is_empty());
    }

    #[test]
    fn writes_spanning_chunks_and_truncation_keep_the_accounting() {
        let mut data = FileData::default();
        let bytes: Vec<u8> = (0..(2 * CHUNK + 100)).map(|i| (i % 251) as u8).collect();
        let cost = data.write_cost(CHUNK - 50, bytes.len() as u64);
        assert_eq!(data.write(CHUNK - 50, &bytes), cost);
        assert_eq!(data.charged(), data.recount());
        assert_eq!(data.read(CHUNK - 50, bytes.len() as u64), bytes);
        // Shorter: the cut chunk keeps its head only, later chunks go.
        let freed = data.truncate(CHUNK + 10);
        assert!(freed > 0);
        assert_eq!(data.charged(), data.recount());
        assert!(!data.has_bytes_past_size());
        // Longer again: the bytes past the cut read as zeros, and nothing is allocated.
        assert_eq!(data.truncate(4 * CHUNK), 0);
        let back = data.read(CHUNK, 100);
        assert_eq!(&back[..10], &bytes[50..60]);
        assert!(back[10..].iter().all(|&b| b == 0));
        let before = data.charged();
        assert_eq!(data.truncate(0), before);
        assert_eq!(data.charged(), 0);
        assert!(data.read(0, 10).is_empty());
    }

    #[test]
    fn appends_grow_buffers_by_doubling() {
        let mut data = FileData::default();
        for i in 0..1000u64 {
            data.write(i * 100, &[7u8; 100]);
        }
        assert_eq!(data.size(), 100_000);
        assert_eq!(data.charged(), data.recount());
        // The full chunks exactly, the last one's buffer at most half empty.
        assert!(data.charged() <= 65536 + 2 * (100_000 - 65536) + 2 * CHUNK_COST);
        assert!(data.read(0, 100_000).iter().all(|&b| b == 7));
    }

    #[test]
    fn writes_inside_across_and_past_a_chunks_end_keep_its_bytes_and_zeros() {
        let mut data = FileData::default();
        data.write(0, b"hello");
        // Across the end: the first bytes overwrite, the rest append.
        data.write(3, b"world");
        // Past the end with a gap: zeros between.
        data.write(12, b"!");
        // Inside.
        data.write(1, b"E");
        assert_eq!(data.read(0, 100), b"hElworld\0\0\0\0!");
        assert_eq!(data.size(), 13);
        assert_eq!(data.charged(), data.recount());
        // A sparse chunk made by `allocate` (zeros) and then written across its end.
        data.allocate(CHUNK, CHUNK + 4, true);
        data.write(CHUNK + 2, b"abcd");
        assert_eq!(data.read(CHUNK, 10), b"\0\0abcd");
        assert_eq!(data.charged(), data.recount());
    }

    /// The same writes with their bytes in guest memory (pieces of 3 bytes, apart) leave the
    /// same file and the same accounting as from a buffer: inside, across and past a
    /// chunk's end, over a chunk boundary.
    #[test]
    fn writes_from_guest_memory_leave_what_writes_from_a_buffer_leave() {
        use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 16)]).unwrap();
        let in_guest = |bytes: &[u8]| {
            let regions: Vec<(GuestAddress, u32)> = bytes
                .chunks(3)
                .enumerate()
                .map(|(i, piece)| {
                    let at = GuestAddress(i as u64 * 16);
                    mem.write_slice(piece, at).unwrap();
                    (at, piece.len() as u32)
                })
                .collect();
            regions
        };
        let writes: [(u64, &[u8]); 6] = [
            (0, b"hello"),
            (3, b"world"),
            (12, b"!"),
            (1, b"E"),
            (CHUNK - 4, b"across the boundary"),
            (2 * CHUNK + 100, b"far past the end"),
        ];
        let mut from_guest = FileData::default();
        let mut from_buffer = FileData::default();
        for (offset, bytes) in writes {
            let regions = in_guest(bytes);
            let (added, copied) =
                from_guest.write_data(offset, WriteData::in_guest(&mem, &regions, 0, bytes.len()));
            copied.unwrap();
            assert_eq!(added, from_buffer.write(offset, bytes));
            assert_eq!(from_guest.charged(), from_guest.recount());
        }
        assert_eq!(from_guest.size(), from_buffer.size());
        let size = from_guest.size();
        assert_eq!(from_guest.read(0, size), from_buffer.read(0, size));
        assert_eq!(from_guest.read(CHUNK - 4, 19), b"across the boundary");
    }
}
