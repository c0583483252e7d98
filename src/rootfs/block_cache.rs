//! What a copy-on-write layer holds in host memory, within one bound: the pages the guest wrote
//! that are not stored yet (dirty), and copies of stored blocks (clean: what the store holds,
//! except where a dirty page, which always wins, covers them).
//!
//! Sans-IO: [`CowLayer`](super::cow::CowLayer) asks which blocks an operation needs from the
//! store, reads them, and hands them in; nothing here waits.
//!
//! Why pages and not the store's blocks: the guest writes the disk in 4 KiB blocks, and a
//! store's block may be larger (a store's own choice; 64 KiB for a `DirectoryStore` made
//! before its default became 4 KiB). Kept as whole blocks, a page
//! written into a stored block would first need that block from the store, one store read per
//! guest write, and 64 KiB of copying for 4 KiB of data. Kept as pages, a write only copies
//! its bytes; the store's version of a block is needed once, when its dirty pages are stored,
//! and only if they do not cover it. Why clean copies: a block read from the store (or just
//! stored) is likely read again soon (a 4 KiB read needs the whole block from the store), and
//! the host's page cache keeps a raw disk's data in the same way. They count against the same
//! bound as the dirty pages, take at most half of it (a bound chosen as a ceiling on unsynced
//! writes should not fill up with reads alone), and are dropped first, oldest first.

use std::collections::{BTreeMap, HashMap};

/// The unit of dirty data: the layer disk's logical block (its device offers 4 KiB)
/// and the smallest block a store may have.
pub(crate) const PAGE: u64 = 4096;

/// A bit per block: the store holds it.
#[derive(Debug)]
struct Written(Vec<u64>);

impl Written {
    fn new(blocks: u64) -> Self {
        Written(vec![0; blocks.div_ceil(64) as usize])
    }
    fn get(&self, index: u64) -> bool {
        self.0[(index / 64) as usize] & (1 << (index % 64)) != 0
    }
    fn set(&mut self, index: u64) {
        self.0[(index / 64) as usize] |= 1 << (index % 64);
    }
}

/// Consecutive blocks whose dirty pages go to the store in one write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) first: u64,
    pub(crate) blocks: u64,
}

/// Blocks read from the store for one operation, by index.
pub(crate) type Fetched = BTreeMap<u64, Box<[u8]>>;

/// A layer's blocks in host memory (see the module's documentation).
#[derive(Debug)]
pub(crate) struct BlockCache {
    block_size: u64,
    max_bytes: u64,
    written: Written,
    /// Page index to its `PAGE` bytes.
    dirty: BTreeMap<u64, Box<[u8]>>,
    /// Block index to (its age stamp, its bytes as the store holds them).
    clean: HashMap<u64, (u64, Box<[u8]>)>,
    /// Age stamp to block index: the oldest clean copy first.
    clean_order: BTreeMap<u64, u64>,
    next_stamp: u64,
}

impl BlockCache {
    /// An empty cache for a disk of `blocks` blocks of `block_size` bytes (a power of two of at
    /// least [`PAGE`]), holding at most `max_bytes`.
    pub(crate) fn new(block_size: u64, blocks: u64, max_bytes: u64) -> Self {
        debug_assert!(block_size.is_power_of_two() && block_size >= PAGE);
        BlockCache {
            block_size,
            max_bytes,
            written: Written::new(blocks),
            dirty: BTreeMap::new(),
            clean: HashMap::new(),
            clean_order: BTreeMap::new(),
            next_stamp: 0,
        }
    }

    fn pages_per_block(&self) -> u64 {
        self.block_size / PAGE
    }

    /// The store holds block `index`.
    pub(crate) fn set_written(&mut self, index: u64) {
        self.written.set(index);
    }

    /// Whether the store holds block `index`.
    pub(crate) fn is_written(&self, index: u64) -> bool {
        self.written.get(index)
    }

    /// Bytes of dirty pages.
    pub(crate) fn dirty_bytes(&self) -> u64 {
        self.dirty.len() as u64 * PAGE
    }

    /// Bytes held: dirty pages and clean copies.
    pub(crate) fn held_bytes(&self) -> u64 {
        self.dirty_bytes() + self.clean.len() as u64 * self.block_size
    }

    /// Pages of `[offset, end)` (`offset < end`) not dirty yet: what a write there adds.
    pub(crate) fn new_dirty_bytes(&self, offset: u64, end: u64) -> u64 {
        let pages = (offset / PAGE)..end.div_ceil(PAGE);
        pages.filter(|p| !self.dirty.contains_key(p)).count() as u64 * PAGE
    }

    /// Whether the store's version of block `index` is needed and not at hand.
    fn must_fetch(&self, index: u64) -> bool {
        self.written.get(index) && !self.clean.contains_key(&index)
    }

    /// The blocks a read of `[offset, end)` needs from the store: stored, with no clean copy,
    /// holding a page of the range that is not dirty.
    pub(crate) fn blocks_to_read(&self, offset: u64, end: u64) -> Vec<u64> {
        let ppb = self.pages_per_block();
        let mut blocks: Vec<u64> = ((offset / PAGE)..end.div_ceil(PAGE))
            .filter(|p| !self.dirty.contains_key(p))
            .map(|p| p / ppb)
            .filter(|&b| self.must_fetch(b))
            .collect();
        blocks.dedup();
        blocks
    }

    /// The blocks a write of `[offset, end)` needs from the store: those of the (at most two)
    /// pages it covers in part that are not dirty.
    pub(crate) fn blocks_to_write(&self, offset: u64, end: u64) -> Vec<u64> {
        let (first, last) = (offset / PAGE, (end - 1) / PAGE);
        let mut blocks = Vec::new();
        for page in [first, last] {
            let whole = offset <= page * PAGE && end >= (page + 1) * PAGE;
            let block = page / self.pages_per_block();
            if !whole
                && !self.dirty.contains_key(&page)
                && self.must_fetch(block)
                && !blocks.contains(&block)
            {
                blocks.push(block);
            }
        }
        blocks
    }

    /// Page `page` as the store holds it, into `out`: from a clean copy, a fetched block, or
    /// zeros (a block never written).
    fn stored_page(&self, page: u64, fetched: &Fetched, out: &mut [u8]) {
        let block = page / self.pages_per_block();
        let at = ((page % self.pages_per_block()) * PAGE) as usize;
        let source = self
            .clean
            .get(&block)
            .map(|(_, data)| data)
            .or_else(|| fetched.get(&block));
        match source {
            Some(data) => out.copy_from_slice(&data[at..at + out.len()]),
            None => {
                debug_assert!(!self.written.get(block), "block {block} was not fetched");
                out.fill(0);
            }
        }
    }

    /// The bytes of `[offset, end)` (`offset < end`), with the blocks
    /// [`blocks_to_read`](Self::blocks_to_read) named in `fetched`.
    pub(crate) fn read(&self, offset: u64, end: u64, fetched: &Fetched) -> Vec<u8> {
        let mut out = vec![0u8; (end - offset) as usize];
        let mut page_buf = [0u8; PAGE as usize];
        for page in (offset / PAGE)..end.div_ceil(PAGE) {
            let (from, to) = ((page * PAGE).max(offset), ((page + 1) * PAGE).min(end));
            let within = ((from - page * PAGE) as usize)..((to - page * PAGE) as usize);
            let dest = &mut out[(from - offset) as usize..(to - offset) as usize];
            match self.dirty.get(&page) {
                Some(data) => dest.copy_from_slice(&data[within]),
                None if within.len() == PAGE as usize => self.stored_page(page, fetched, dest),
                None => {
                    self.stored_page(page, fetched, &mut page_buf);
                    dest.copy_from_slice(&page_buf[within]);
                }
            }
        }
        out
    }

    /// Writes `data` at `offset` into dirty pages, with the blocks
    /// [`blocks_to_write`](Self::blocks_to_write) named in `fetched`. The caller made room for
    /// [`new_dirty_bytes`](Self::new_dirty_bytes) first; clean copies give way to the pages.
    pub(crate) fn write(&mut self, offset: u64, data: &[u8], fetched: &Fetched) {
        let end = offset + data.len() as u64;
        for page in (offset / PAGE)..end.div_ceil(PAGE) {
            let (from, to) = ((page * PAGE).max(offset), ((page + 1) * PAGE).min(end));
            let source = &data[(from - offset) as usize..(to - offset) as usize];
            let at = (from - page * PAGE) as usize;
            if let Some(dirty) = self.dirty.get_mut(&page) {
                dirty[at..at + source.len()].copy_from_slice(source);
                continue;
            }
            let fresh: Box<[u8]> = if source.len() == PAGE as usize {
                source.into()
            } else {
                let mut fresh = vec![0u8; PAGE as usize].into_boxed_slice();
                self.stored_page(page, fetched, &mut fresh);
                fresh[at..at + source.len()].copy_from_slice(source);
                fresh
            };
            self.dirty.insert(page, fresh);
        }
        self.evict_for(0);
    }

    /// The most bytes clean copies may take: half the bound.
    fn clean_cap(&self) -> u64 {
        self.max_bytes / 2
    }

    /// Drops the oldest clean copies until `room` more bytes fit, both within the bound and
    /// within the copies' share of it (or none is left).
    fn evict_for(&mut self, room: u64) {
        let clean_bytes = |c: &Self| c.clean.len() as u64 * c.block_size;
        while self.held_bytes() + room > self.max_bytes
            || clean_bytes(self) + room > self.clean_cap()
        {
            let Some((_, block)) = self.clean_order.pop_first() else {
                return;
            };
            self.clean.remove(&block);
        }
    }

    /// Keeps `data` as the clean copy of block `index` (what the store holds now), if the bound
    /// leaves room once older copies are dropped.
    pub(crate) fn keep_clean(&mut self, index: u64, data: Box<[u8]>) {
        if let Some((stamp, _)) = self.clean.remove(&index) {
            self.clean_order.remove(&stamp);
        }
        if self.dirty_bytes() + self.block_size > self.max_bytes
            || self.block_size > self.clean_cap()
        {
            return;
        }
        self.evict_for(self.block_size);
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.clean.insert(index, (stamp, data));
        self.clean_order.insert(stamp, index);
    }

    /// The next run of blocks with dirty pages, from the lowest: consecutive blocks, at most
    /// `max_bytes` of them (at least one block).
    pub(crate) fn next_run(&self, max_bytes: u64) -> Option<Run> {
        let ppb = self.pages_per_block();
        let (&page, _) = self.dirty.first_key_value()?;
        let first = page / ppb;
        let mut blocks = 1;
        while (blocks + 1) * self.block_size <= max_bytes {
            let next = first + blocks;
            let has_dirty = self
                .dirty
                .range(next * ppb..(next + 1) * ppb)
                .next()
                .is_some();
            if !has_dirty {
                break;
            }
            blocks += 1;
        }
        Some(Run { first, blocks })
    }

    /// The blocks storing `run` needs from the store: stored, no clean copy, and not wholly
    /// covered by dirty pages.
    pub(crate) fn blocks_to_store(&self, run: Run) -> Vec<u64> {
        let ppb = self.pages_per_block();
        (run.first..run.first + run.blocks)
            .filter(|&b| self.must_fetch(b))
            .filter(|&b| (b * ppb..(b + 1) * ppb).any(|p| !self.dirty.contains_key(&p)))
            .collect()
    }

    /// `run`'s blocks as they are now: the store's version with the dirty pages over it.
    pub(crate) fn assemble(&self, run: Run, fetched: &Fetched) -> Vec<u8> {
        let ppb = self.pages_per_block();
        let mut out = vec![0u8; (run.blocks * self.block_size) as usize];
        for (i, page) in (run.first * ppb..(run.first + run.blocks) * ppb).enumerate() {
            let dest = &mut out[i * PAGE as usize..(i + 1) * PAGE as usize];
            match self.dirty.get(&page) {
                Some(data) => dest.copy_from_slice(data),
                None => self.stored_page(page, fetched, dest),
            }
        }
        out
    }

    /// The store took `data` (from [`assemble`](Self::assemble)) as `run`'s blocks: their
    /// pages are clean now, and their bytes the clean copies, bound permitting.
    pub(crate) fn stored(&mut self, run: Run, data: &[u8]) {
        let ppb = self.pages_per_block();
        for index in run.first..run.first + run.blocks {
            for page in index * ppb..(index + 1) * ppb {
                self.dirty.remove(&page);
            }
            self.written.set(index);
        }
        for (i, index) in (run.first..run.first + run.blocks).enumerate() {
            let bytes = &data[i * self.block_size as usize..(i + 1) * self.block_size as usize];
            self.keep_clean(index, bytes.into());
        }
    }

    /// Forgets every page and copy (the VM stopped).
    pub(crate) fn clear(&mut self) {
        self.dirty.clear();
        self.clean.clear();
        self.clean_order.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK: u64 = 4 * PAGE;

    /// Stores `run` the way the layer does, into `store` (block index to bytes).
    fn store_all(cache: &mut BlockCache, store: &mut BTreeMap<u64, Vec<u8>>) {
        while let Some(run) = cache.next_run(1 << 20) {
            let fetched: Fetched = cache
                .blocks_to_store(run)
                .into_iter()
                .map(|b| (b, store[&b].clone().into_boxed_slice()))
                .collect();
            let data = cache.assemble(run, &fetched);
            for (i, chunk) in data.chunks(BLOCK as usize).enumerate() {
                store.insert(run.first + i as u64, chunk.to_vec());
            }
            cache.stored(run, &data);
        }
    }

    /// A page written into a stored block needs nothing from the store; storing it needs the
    /// block once; a read after that needs nothing (the clean copy).
    #[test]
    fn a_page_into_a_stored_block_is_fetched_only_when_stored() {
        let mut store = BTreeMap::from([(3u64, vec![5u8; BLOCK as usize])]);
        let mut cache = BlockCache::new(BLOCK, 16, 1 << 20);
        cache.set_written(3);
        let at = 3 * BLOCK + PAGE;
        assert!(cache.blocks_to_write(at, at + PAGE).is_empty());
        cache.write(at, &[9; PAGE as usize], &Fetched::new());
        assert_eq!(cache.dirty_bytes(), PAGE);
        let run = cache.next_run(1 << 20).unwrap();
        assert_eq!(
            run,
            Run {
                first: 3,
                blocks: 1
            }
        );
        assert_eq!(cache.blocks_to_store(run), vec![3]);
        store_all(&mut cache, &mut store);
        assert_eq!(cache.dirty_bytes(), 0);
        let block = &store[&3];
        assert_eq!(&block[..PAGE as usize], &[5; PAGE as usize][..]);
        assert_eq!(
            &block[PAGE as usize..2 * PAGE as usize],
            &[9; PAGE as usize][..]
        );
        assert!(cache.blocks_to_read(3 * BLOCK, 4 * BLOCK).is_empty());
        assert_eq!(cache.read(at - 2, at + 2, &Fetched::new()), [5, 5, 9, 9]);
    }

    /// A write covering part of a page keeps the rest of the page as stored; a read of a
    /// stored block without a copy asks for it.
    #[test]
    fn partial_pages_keep_the_stored_bytes_around_them() {
        let stored = vec![5u8; BLOCK as usize].into_boxed_slice();
        let mut cache = BlockCache::new(BLOCK, 16, 1 << 20);
        cache.set_written(1);
        let at = BLOCK + 10;
        assert_eq!(cache.blocks_to_write(at, at + 3), vec![1]);
        assert_eq!(cache.blocks_to_read(at, at + 3), vec![1]);
        let fetched = Fetched::from([(1, stored)]);
        cache.write(at, &[7, 7, 7], &fetched);
        assert_eq!(
            cache.read(BLOCK + 8, BLOCK + 15, &fetched),
            [5, 5, 7, 7, 7, 5, 5]
        );
        // Never written: zeros, nothing fetched.
        assert!(cache.blocks_to_read(0, 10).is_empty());
        assert_eq!(cache.read(0, 3, &Fetched::new()), [0, 0, 0]);
    }

    /// Dirty pages and clean copies together never pass the bound, copies never take more
    /// than half of it, and they give way to dirty pages, oldest first.
    #[test]
    fn clean_copies_give_way_to_dirty_pages_within_the_bound() {
        let bound = 4 * BLOCK + 2 * PAGE;
        let mut cache = BlockCache::new(BLOCK, 64, bound);
        for index in 0..4 {
            cache.set_written(index);
            cache.keep_clean(index, vec![index as u8; BLOCK as usize].into());
            assert!(cache.held_bytes() <= bound);
        }
        assert_eq!(
            cache.held_bytes(),
            2 * BLOCK,
            "the two newest copies, half the bound"
        );
        assert_eq!(
            cache.blocks_to_read(0, 4 * BLOCK),
            [0, 1],
            "the oldest went"
        );
        for page in 0..12 {
            let at = 8 * BLOCK + page * PAGE;
            cache.write(at, &[1; PAGE as usize], &Fetched::new());
            assert!(cache.held_bytes() <= bound, "{}", cache.held_bytes());
        }
        assert_eq!(cache.dirty_bytes(), 12 * PAGE);
        assert_eq!(cache.held_bytes(), 12 * PAGE + BLOCK, "one copy gave way");
        assert_eq!(
            cache.blocks_to_read(0, 4 * BLOCK),
            [0, 1, 2],
            "the newer one stays"
        );
    }

    /// Runs are consecutive blocks with dirty pages, up to the size asked for.
    #[test]
    fn runs_are_consecutive_dirty_blocks() {
        let mut cache = BlockCache::new(BLOCK, 64, 1 << 20);
        for block in [2u64, 3, 4, 6] {
            cache.write(block * BLOCK + PAGE, &[1; 10], &Fetched::new());
        }
        assert_eq!(
            cache.next_run(1 << 20),
            Some(Run {
                first: 2,
                blocks: 3
            })
        );
        assert_eq!(
            cache.next_run(2 * BLOCK),
            Some(Run {
                first: 2,
                blocks: 2
            })
        );
        assert_eq!(
            cache.next_run(1),
            Some(Run {
                first: 2,
                blocks: 1
            })
        );
        let mut store = BTreeMap::new();
        store_all(&mut cache, &mut store);
        assert_eq!(store.keys().copied().collect::<Vec<_>>(), [2, 3, 4, 6]);
        assert_eq!(cache.next_run(1 << 20), None);
    }
}
