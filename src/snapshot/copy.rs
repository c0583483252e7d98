//! Copying a byte range of one file into another at the same offset, in the kernel: guest
//! memory is tens to hundreds of megabytes, and reading it into this process to write it out
//! again costs two more copies (under nested emulation, a second of a restore). The standard
//! library's `io::copy` stays in the kernel too, but from each file's position, not at an
//! offset into a file others hold; nix has no `copy_file_range` with offsets on both sides.
//! So this is the two system calls, by hand.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// What one `splice` through the pipe moves at most (the pipe is grown to it if it can be).
const PIPE_BYTES: usize = 1 << 20;

/// The most threads a copy of many extents runs on.
const MAX_COPY_THREADS: usize = 4;

/// Copies all of `from`'s data (its `SEEK_DATA` extents) into `to` (as long, zeros there) at
/// the same offsets: a fork's layer, a merge of guest memory.
pub(crate) fn copy_data(from: &File, to: &File) -> io::Result<()> {
    copy_extents(from, to, &crate::rootfs::layer::data_extents(from)?)
}

/// Copies each `[start, end)` of `extents` from `from` into `to` at the same offsets, split
/// across the host's cores (up to [`MAX_COPY_THREADS`]): the kernel copies a page at a time
/// on the calling thread, and a restore waits for all of it.
pub(crate) fn copy_extents(from: &File, to: &File, extents: &[(u64, u64)]) -> io::Result<()> {
    let total: u64 = extents.iter().map(|(start, end)| end - start).sum();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, MAX_COPY_THREADS);
    if threads == 1 || total < 8 << 20 {
        return KernelCopy::new(from, to).extents(extents);
    }
    // Each thread takes a contiguous run of about total / threads bytes (extents split).
    let share = total.div_ceil(threads as u64);
    let mut runs: Vec<Vec<(u64, u64)>> = vec![Vec::new()];
    let mut in_run = 0u64;
    for &(mut start, end) in extents {
        while start < end {
            let take = (end - start).min(share - in_run);
            runs.last_mut()
                .expect("one run at least")
                .push((start, start + take));
            start += take;
            in_run += take;
            if in_run == share {
                runs.push(Vec::new());
                in_run = 0;
            }
        }
    }
    std::thread::scope(|scope| {
        let copies: Vec<_> = runs
            .iter()
            .map(|run| scope.spawn(move || KernelCopy::new(from, to).extents(run)))
            .collect();
        // Every thread joined before the first error is returned.
        let outcomes: Vec<io::Result<()>> = copies
            .into_iter()
            .map(|copy| {
                copy.join()
                    .unwrap_or_else(|_| Err(io::Error::other("a copy thread panicked")))
            })
            .collect();
        outcomes.into_iter().collect()
    })
}

/// Copies ranges of one file into another at the same offsets, in the kernel: directly
/// (`copy_file_range`), or, once the kernel said it cannot between these two files (two
/// filesystems), through a pipe of its own for every range after.
struct KernelCopy<'a> {
    from: &'a File,
    to: &'a File,
    /// The pipe (read end, write end), once the direct way was refused.
    pipe: Option<(OwnedFd, OwnedFd)>,
}

impl<'a> KernelCopy<'a> {
    fn new(from: &'a File, to: &'a File) -> KernelCopy<'a> {
        KernelCopy {
            from,
            to,
            pipe: None,
        }
    }

    fn extents(mut self, extents: &[(u64, u64)]) -> io::Result<()> {
        extents
            .iter()
            .try_for_each(|&(start, end)| self.range(start, end))
    }

    /// Copies `from[start..end]` into `to` at `start`. `from` must be at least `end` long.
    fn range(&mut self, start: u64, end: u64) -> io::Result<()> {
        let mut at = start;
        while at < end && self.pipe.is_none() {
            let (mut off_in, mut off_out) = (at as i64, at as i64);
            let len = (end - at).min(isize::MAX as u64) as usize;
            // SAFETY: both descriptors are open files of ours; the offsets are ours to move.
            let copied = unsafe {
                libc::copy_file_range(
                    self.from.as_raw_fd(),
                    &mut off_in,
                    self.to.as_raw_fd(),
                    &mut off_out,
                    len,
                    0,
                )
            };
            match copied {
                n if n > 0 => at += n as u64,
                0 => return Err(ended_early()),
                _ => {
                    let e = io::Error::last_os_error();
                    match e.raw_os_error() {
                        Some(libc::EINTR) => {}
                        // Files on two filesystems (a snapshot on disk, guest memory in a
                        // memfd): the kernel only copies between those through a pipe.
                        Some(libc::EXDEV | libc::EINVAL | libc::EOPNOTSUPP | libc::ENOSYS) => {
                            self.pipe = Some(pipe()?);
                        }
                        _ => return Err(e),
                    }
                }
            }
        }
        match &self.pipe {
            Some((pipe_out, pipe_in)) if at < end => {
                splice_range(self.from, self.to, pipe_out, pipe_in, at, end)
            }
            _ => Ok(()),
        }
    }
}

/// Copies `from[at..end]` into `to` at `at` through the pipe (`pipe_out` its read end,
/// `pipe_in` its write end): `from` into it, it into `to`, in the kernel.
fn splice_range(
    from: &File,
    to: &File,
    pipe_out: &OwnedFd,
    pipe_in: &OwnedFd,
    mut at: u64,
    end: u64,
) -> io::Result<()> {
    while at < end {
        let len = ((end - at) as usize).min(PIPE_BYTES);
        let mut off_in = at as i64;
        let filled = retry(|| {
            // SAFETY: open descriptors of ours; the offset is ours to move.
            unsafe {
                libc::splice(
                    from.as_raw_fd(),
                    &mut off_in,
                    pipe_in.as_raw_fd(),
                    std::ptr::null_mut(),
                    len,
                    libc::SPLICE_F_MOVE,
                )
            }
        })?;
        if filled == 0 {
            return Err(ended_early());
        }
        let mut off_out = at as i64;
        let mut left = filled;
        while left > 0 {
            let drained = retry(|| {
                // SAFETY: as above.
                unsafe {
                    libc::splice(
                        pipe_out.as_raw_fd(),
                        std::ptr::null_mut(),
                        to.as_raw_fd(),
                        &mut off_out,
                        left,
                        libc::SPLICE_F_MOVE,
                    )
                }
            })?;
            if drained == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "the copy's target took nothing",
                ));
            }
            left -= drained;
        }
        at += filled as u64;
    }
    Ok(())
}

/// A pipe's (read end, write end), close-on-exec, grown to [`PIPE_BYTES`] if it can be.
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds: [RawFd; 2] = [-1; 2];
    // SAFETY: pipe2 fills two descriptors or fails.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both are new descriptors nothing else owns.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // Best effort: a bigger pipe means fewer calls, the default (64 KiB) works too.
    // SAFETY: F_SETPIPE_SZ on a pipe of ours; failure leaves it as it was.
    unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_BYTES as i32) };
    Ok((read, write))
}

/// `call`'s count, again while it is interrupted by a signal.
fn retry(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn ended_early() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "the source ended early")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    fn copy_range(from: &File, to: &File, start: u64, end: u64) -> io::Result<()> {
        KernelCopy::new(from, to).range(start, end)
    }

    fn check_copy(from: &File, to: &File) {
        let data: Vec<u8> = (0..3 * PIPE_BYTES + 17).map(|i| (i % 251) as u8).collect();
        from.write_all_at(&data, 4096).unwrap();
        let needed = 4096 + data.len() as u64 + 4096;
        if to.metadata().unwrap().len() < needed {
            to.set_len(needed).unwrap();
        }
        copy_range(from, to, 4096 + 5, 4096 + data.len() as u64).unwrap();
        let mut back = vec![0u8; data.len()];
        to.read_exact_at(&mut back, 4096).unwrap();
        assert_eq!(&back[..5], &[0; 5], "before the range: untouched");
        assert_eq!(&back[5..], &data[5..]);
        let err = copy_range(from, to, 0, 4096 + data.len() as u64 + 1).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn many_extents_are_copied_across_threads_each_byte_once_at_its_offset() {
        let from = tempfile::tempfile().unwrap();
        let extents = [
            (4096u64, 5 << 20),
            (6 << 20, (13 << 20) + 7),
            (20 << 20, 21 << 20),
        ];
        let byte = |at: u64| (at % 253) as u8;
        for &(start, end) in &extents {
            let data: Vec<u8> = (start..end).map(byte).collect();
            from.write_all_at(&data, start).unwrap();
        }
        let to =
            crate::guest_memory::GuestMemoryFile::create(32, crate::guest_memory::LaterSeals::None)
                .unwrap()
                .shared_file();
        copy_extents(&from, &to, &extents).unwrap();
        let mut back = vec![0u8; 32 << 20];
        to.read_exact_at(&mut back, 0).unwrap();
        for (at, got) in back.iter().enumerate() {
            let at = at as u64;
            let inside = extents
                .iter()
                .any(|&(start, end)| (start..end).contains(&at));
            assert_eq!(*got, if inside { byte(at) } else { 0 }, "byte {at}");
        }
    }

    #[test]
    fn a_range_is_copied_at_its_offset_on_one_filesystem_and_across_two() {
        // The same filesystem: copy_file_range.
        let dir = tempfile::tempdir().unwrap();
        check_copy(
            &tempfile::tempfile_in(dir.path()).unwrap(),
            &tempfile::tempfile_in(dir.path()).unwrap(),
        );
        // A file into a memfd (another filesystem): through a pipe, as a restore does.
        let memfd =
            crate::guest_memory::GuestMemoryFile::create(16, crate::guest_memory::LaterSeals::None)
                .unwrap()
                .shared_file();
        check_copy(&tempfile::tempfile_in(dir.path()).unwrap(), &memfd);
        // And the pipe's path itself, whatever the kernel would pick.
        let (from, to) = (tempfile::tempfile().unwrap(), tempfile::tempfile().unwrap());
        from.write_all_at(b"0123456789", 0).unwrap();
        to.set_len(10).unwrap();
        let (pipe_out, pipe_in) = pipe().unwrap();
        splice_range(&from, &to, &pipe_out, &pipe_in, 2, 9).unwrap();
        let mut back = [0u8; 10];
        to.read_exact_at(&mut back, 0).unwrap();
        assert_eq!(&back, b"\0\x002345678\0");
    }
}
