//! Guest memory mapped copy-on-write from its file, and the pages the guest has made this
//! process's own since.
//!
//! A fork's source maps its memory copy-on-write in place, so that its memory file keeps the
//! moment of the fork (each fork maps the same file copy-on-write too, and every page none of
//! them writes stays shared). The memory of a VM so mapped is then its file overlaid with the
//! pages written since, which `/proc/self/pagemap` tells apart: present and no longer a page
//! of the file, or swapped out (only an anonymous copy is). No crate reads pagemap for another
//! purpose than physical addresses (which need privileges and are not wanted here), hence the
//! few lines below.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};

use vm_memory::{GuestMemory, GuestMemoryMmap, GuestMemoryRegion};

const PAGE: usize = 4096;
/// pagemap's bits (docs.kernel.org/admin-guide/mm/pagemap.html).
const PRESENT: u64 = 1 << 63;
const SWAPPED: u64 = 1 << 62;
const FILE_PAGE_OR_SHARED: u64 = 1 << 61;
/// pagemap entries read at once (64 KiB of them).
const ENTRIES_AT_ONCE: usize = 8192;

/// Set once [`FileRegion::map_privately`] replaced the shared mappings: mapping again would
/// drop every page written since.
static MAPPED_PRIVATELY: AtomicBool = AtomicBool::new(false);

/// A region of guest memory in the guest memory file.
pub(super) struct FileRegion {
    host: *mut u8,
    len: usize,
    fd: std::os::fd::RawFd,
    offset: u64,
    private: bool,
}

/// Guest memory's regions, each of which must lie in a file.
pub(super) fn file_regions(memory: &GuestMemoryMmap) -> Result<Vec<FileRegion>, String> {
    memory
        .iter()
        .map(|region| {
            let file_offset = region
                .file_offset()
                .ok_or("guest memory is not in a file")?;
            Ok(FileRegion {
                host: region.as_ptr(),
                len: region.len() as usize,
                fd: file_offset.file().as_raw_fd(),
                offset: file_offset.start(),
                private: region.flags() & libc::MAP_PRIVATE != 0
                    || MAPPED_PRIVATELY.load(Ordering::SeqCst),
            })
        })
        .collect()
}

impl FileRegion {
    /// Replaces the region's shared mapping with a copy-on-write one of the same file range,
    /// at the same address.
    pub(super) fn map_privately(&self) -> Result<(), String> {
        if self.private {
            return Err("guest memory is mapped copy-on-write already".into());
        }
        // SAFETY: replaces this process's own mapping of guest memory by a mapping of the same
        // file range at the same address and size: every address stays mapped, and reads the
        // same bytes (the shared mapping wrote through to the file). vm-memory and KVM reach
        // guest memory through pointers, never through references this could invalidate.
        let mapped = unsafe {
            libc::mmap(
                self.host.cast(),
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                self.fd,
                self.offset as libc::off_t,
            )
        };
        if mapped == libc::MAP_FAILED {
            return Err(format!(
                "mapping guest memory copy-on-write: {}",
                std::io::Error::last_os_error()
            ));
        }
        MAPPED_PRIVATELY.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Writes the region's pages that are this process's own into `into` at their offsets in
    /// the guest memory file; returns how many.
    pub(super) fn write_private_pages(&self, pagemap: &File, into: &File) -> Result<u64, String> {
        if !self.private {
            return Ok(0);
        }
        let pages = self.len / PAGE;
        let first = self.host as usize / PAGE;
        let mut entries = vec![0u8; ENTRIES_AT_ONCE * 8];
        let mut written = 0u64;
        let mut at = 0;
        while at < pages {
            let n = (pages - at).min(ENTRIES_AT_ONCE);
            pagemap
                .read_exact_at(&mut entries[..n * 8], ((first + at) * 8) as u64)
                .map_err(|e| format!("reading /proc/self/pagemap: {e}"))?;
            let own = |i: usize| {
                let entry = u64::from_le_bytes(entries[i * 8..i * 8 + 8].try_into().unwrap());
                (entry & PRESENT != 0 && entry & FILE_PAGE_OR_SHARED == 0) || entry & SWAPPED != 0
            };
            let mut i = 0;
            while i < n {
                if !own(i) {
                    i += 1;
                    continue;
                }
                let run = i;
                while i < n && own(i) {
                    i += 1;
                }
                self.write_pages(into, at + run, i - run)?;
                written += (i - run) as u64;
            }
            at += n;
        }
        Ok(written)
    }

    /// Reads `pages`' data that falls in the region's range of the guest memory file into the
    /// region (mapped copy-on-write: what is read becomes this process's own).
    pub(super) fn read_pages(&self, pages: &File) -> Result<(), String> {
        let error = |e: std::io::Error| format!("laying the source's pages over guest memory: {e}");
        if !self.private {
            // Read into a shared mapping, they would be written into the file.
            return Err("pages laid over guest memory that is not mapped copy-on-write".into());
        }
        let (start, end) = (self.offset, self.offset + self.len as u64);
        let mut at = start;
        while at < end {
            // The next run of data in the file at or after `at`, cut to the region.
            let data = match lseek(pages, at, libc::SEEK_DATA) {
                Ok(data) if data < end => data,
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::ENXIO) => break,
                Err(e) => return Err(error(e)),
            };
            let hole = lseek(pages, data, libc::SEEK_HOLE).map_err(error)?.min(end);
            let mut done = data;
            while done < hole {
                // SAFETY: [done, hole) lies within the region's range of the file, so within
                // its mapping; the kernel copies into it, so no reference to guest memory is
                // made here.
                let read = unsafe {
                    libc::pread(
                        pages.as_raw_fd(),
                        self.host.add((done - start) as usize).cast(),
                        (hole - done) as usize,
                        done as libc::off_t,
                    )
                };
                match read {
                    n if n > 0 => done += n as u64,
                    0 => return Err(error(std::io::ErrorKind::UnexpectedEof.into())),
                    _ => {
                        let e = std::io::Error::last_os_error();
                        if e.kind() != std::io::ErrorKind::Interrupted {
                            return Err(error(e));
                        }
                    }
                }
            }
            at = hole;
        }
        Ok(())
    }

    /// Writes `count` pages from page `page` of the region into `into`, at their file offset.
    fn write_pages(&self, into: &File, page: usize, count: usize) -> Result<(), String> {
        let mut done = 0;
        let len = count * PAGE;
        while done < len {
            let offset = self.offset + (page * PAGE + done) as u64;
            // SAFETY: within the region's mapping (page + count <= its pages); the kernel
            // copies from it, so no reference to guest memory is made here.
            let wrote = unsafe {
                libc::pwrite(
                    into.as_raw_fd(),
                    self.host.add(page * PAGE + done).cast(),
                    len - done,
                    offset as libc::off_t,
                )
            };
            match wrote {
                n if n > 0 => done += n as usize,
                0 => return Err("writing guest memory's pages: no room".into()),
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(format!("writing guest memory's pages: {e}"));
                    }
                }
            }
        }
        Ok(())
    }
}

/// `lseek(2)` with `whence` (SEEK_DATA, SEEK_HOLE).
fn lseek(file: &File, offset: u64, whence: i32) -> std::io::Result<u64> {
    // SAFETY: a plain syscall on an open descriptor.
    let at = unsafe { libc::lseek(file.as_raw_fd(), offset as libc::off_t, whence) };
    if at < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(at as u64)
}
