//! One mount's FUSE session: each request decoded, answered by the [`VirtualFs`], encoded.
//!
//! Sans-IO: [`Session::handle`] takes one request's bytes and returns the reply's bytes (or
//! none: forgets and interrupts get no reply), so the transport (`service.rs`), the tests and
//! the fuzz target drive the same code.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use fuse_backend_rs::abi::fuse_abi as abi;
use tracing::Instrument;

use super::reply;
use super::request::{self, Operation, Request, MAX_WRITE};
use crate::fs::types::*;
use crate::fs::{MountOptions, VirtualFs, WriteData};

/// Requests of one mount answered at once, whichever transport brings them: past that, the
/// rest wait (on the socket, or on the ring).
pub(crate) const MAX_IN_FLIGHT: usize = 64;

/// The FUSE protocol minor version the session speaks (7.33: `max_pages`, cached symlinks,
/// parallel directory operations, `HANDLE_KILLPRIV_V2`). A newer kernel speaks it too; an older one is refused.
pub(crate) const PROTOCOL_MINOR: u32 = 33;

/// The oldest kernel protocol served: 7.28 brought `max_pages`, which 1 MiB writes need.
const OLDEST_MINOR: u32 = 28;

/// What the session asks of the guest kernel, each when the kernel offers it.
fn wanted_flags() -> u64 {
    use abi::FsOptions as O;
    // Not WRITEBACK_CACHE: the kernel would then own sizes and times and write back later,
    // after the host may already have read the file; not READDIRPLUS or POSIX locks (locks stay
    // in the guest kernel, which is right for one guest); not DONT_MASK (the kernel applies the
    // umask, so modes arrive final).
    //
    // HANDLE_KILLPRIV_V2: the session clears set-user-ID and set-group-ID itself where the
    // kernel asks (`kill_suid_sgid` below), and the kernel then marks an inode checked once
    // (S_NOSEC) instead of asking for its `security.capability` before every write: a 1 MiB
    // write loop costs one GETXATTR round trip per file rather than one per write.
    (O::ASYNC_READ
        | O::HANDLE_KILLPRIV_V2
        | O::BIG_WRITES
        | O::ATOMIC_O_TRUNC
        | O::AUTO_INVAL_DATA
        | O::PARALLEL_DIROPS
        | O::MAX_PAGES
        | O::CACHE_SYMLINKS)
        .bits()
}

/// A mount's session: one connection's worth of the guest kernel's state.
pub(crate) struct Session {
    fs: Arc<dyn VirtualFs>,
    options: MountOptions,
    initialized: AtomicBool,
    /// The lookups the guest kernel holds through this session (node id → count): what it
    /// would give back with FORGET. When the session ends (the guest went away, or a retried
    /// boot replaced it) the implementation gets them all back, so a filesystem reused across
    /// boots does not keep inodes for kernels that are gone. At most one entry per inode the
    /// implementation handed out.
    held: std::sync::Mutex<HashMap<u64, u64>>,
    /// The handles the guest kernel has open through this session ((node id, handle) →
    /// whether it is a directory's), released with the session the same way.
    open: std::sync::Mutex<HashMap<(u64, u64), bool>>,
    /// The calls running now, by their request's `unique`, so an interrupt can end one: at
    /// most one entry per request in flight, which the transport bounds.
    running: std::sync::Mutex<HashMap<u64, RunningCall>>,
    /// Numbers the calls, so a call's guard removes its own entry and not a later request's
    /// that reused the `unique` (a hostile guest may).
    next_call: std::sync::atomic::AtomicU64,
    /// The instance's share of the process's descriptors and blocking threads, charged by
    /// the implementation's calls (`HostDir` does): each call runs in its scope.
    budget: Option<Arc<crate::budget::Budget>>,
}

/// A call of the implementation that an interrupt can end.
struct RunningCall {
    call: u64,
    interrupt: tokio_util::sync::CancellationToken,
}

/// Removes its call's entry from [`Session::running`] when the call ends, however it ends.
struct Registered<'a> {
    session: &'a Session,
    unique: u64,
    call: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        let mut running = self
            .session
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if running
            .get(&self.unique)
            .is_some_and(|r| r.call == self.call)
        {
            running.remove(&self.unique);
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let held = std::mem::take(&mut *self.held.lock().unwrap_or_else(|e| e.into_inner()));
        let open = std::mem::take(&mut *self.open.lock().unwrap_or_else(|e| e.into_inner()));
        if held.is_empty() && open.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let fs = self.fs.clone();
        runtime.spawn(
            async move {
                for ((node, handle), directory) in open {
                    let (node, handle) = (InodeId(node), FileHandle(handle));
                    let _ = if directory {
                        fs.releasedir(node, handle).await
                    } else {
                        fs.release(node, handle).await
                    };
                }
                for (node, count) in held {
                    fs.forget(InodeId(node), count).await;
                }
            }
            .in_current_span(),
        );
    }
}

impl Session {
    pub(crate) fn new(fs: Arc<dyn VirtualFs>, options: MountOptions) -> Self {
        Session {
            fs,
            options,
            initialized: AtomicBool::new(false),
            held: std::sync::Mutex::new(HashMap::new()),
            open: std::sync::Mutex::new(HashMap::new()),
            running: std::sync::Mutex::new(HashMap::new()),
            next_call: std::sync::atomic::AtomicU64::new(0),
            budget: None,
        }
    }

    /// The same session, its calls charged to `budget` (the instance's).
    pub(crate) fn with_budget(mut self, budget: Arc<crate::budget::Budget>) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Answers one request (`message` is exactly one request's bytes). `Err` means the
    /// message is not even a framed request: the connection cannot be trusted any more.
    pub(crate) async fn handle(
        &self,
        message: &[u8],
    ) -> Result<Option<Vec<u8>>, request::DecodeError> {
        self.handle_with(message, None).await
    }

    /// Answers one request whose write data, if `data_elsewhere` is given, follows `message`
    /// in guest memory rather than being in it (see [`request::decode_with`]).
    pub(crate) async fn handle_with(
        &self,
        message: &[u8],
        data_elsewhere: Option<WriteData<'_>>,
    ) -> Result<Option<Vec<u8>>, request::DecodeError> {
        let request = match request::decode_with(message, data_elsewhere) {
            Ok(request) => request,
            Err(
                err @ (request::DecodeError::BadLength { .. } | request::DecodeError::Truncated(_)),
            ) => return Err(err),
            Err(err) => {
                // Framed, so the unique id is good: fail this request only. Forgets and
                // interrupts get no reply, and nothing answers id 0: a message with id 0 is a
                // notification to the kernel.
                let unique = u64::from_le_bytes(message[8..16].try_into().expect("8 bytes"));
                let opcode = u32::from_le_bytes(message[4..8].try_into().expect("4 bytes"));
                if unique == 0 || request::is_unanswered(opcode) {
                    return Ok(None);
                }
                tracing::debug!(target: "krunbox::fs", %err, "refused a FUSE request");
                return Ok(Some(reply::error(unique, err.errno())));
            }
        };
        Ok(self.answer(request).await)
    }

    async fn answer(&self, request: Request<'_>) -> Option<Vec<u8>> {
        let unique = request.header.unique;
        tracing::trace!(target: "krunbox::fs", opcode = request.header.opcode, node = request.header.nodeid, "request");
        let operation = request.operation;
        match operation {
            Operation::Init { .. } => return Some(self.init(unique, &operation)),
            Operation::Forget { count } => {
                self.forget(request.header.nodeid, count).await;
                return None;
            }
            Operation::BatchForget { ref forgets } => {
                for &(node, count) in forgets {
                    self.forget(node, count).await;
                }
                return None;
            }
            Operation::Interrupt { unique } => {
                self.interrupt(unique);
                return None;
            }
            _ => {}
        }
        if !self.initialized.load(Ordering::Acquire) {
            return Some(reply::error(unique, libc::EIO));
        }
        if request.header.nodeid == 0 {
            return Some(reply::error(unique, libc::EINVAL));
        }
        if self.options.is_read_only() && mutates(&operation) {
            return Some(reply::error(unique, libc::EROFS));
        }
        let header = request.header;
        let (interrupt, _registered) = self.register(unique);
        // The implementation is the caller's code: a panic answers this request with EIO
        // (the guest's call fails; on 88bb6c9 it was never answered and the guest's process
        // hung for ever), an interrupt drops the call and answers EINTR.
        let call = crate::budget::scope(
            self.budget.clone(),
            crate::callback::guarded(|| self.dispatch(header, operation)),
        );
        let outcome = tokio::select! {
            outcome = call => outcome,
            () = interrupt.cancelled() => {
                tracing::debug!(target: "krunbox::fs", opcode = header.opcode, "a call was interrupted by the guest");
                return Some(reply::error(unique, libc::EINTR));
            }
        };
        Some(match outcome {
            Ok(Ok(message)) => message,
            Ok(Err(err)) => reply::error(unique, err.errno()),
            Err(panicked) => {
                tracing::error!(
                    target: "krunbox::fs",
                    opcode = header.opcode,
                    node = header.nodeid,
                    "the filesystem panicked ({panicked}); the guest's call fails with EIO"
                );
                reply::error(unique, libc::EIO)
            }
        })
    }

    /// Records a call for request `unique`, which [`Session::interrupt`] can then end, until
    /// the returned guard drops.
    fn register(&self, unique: u64) -> (tokio_util::sync::CancellationToken, Registered<'_>) {
        let call = self.next_call.fetch_add(1, Ordering::Relaxed);
        let interrupt = tokio_util::sync::CancellationToken::new();
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        running.insert(
            unique,
            RunningCall {
                call,
                interrupt: interrupt.clone(),
            },
        );
        (
            interrupt,
            Registered {
                session: self,
                unique,
                call,
            },
        )
    }

    /// The guest gives up request `unique`: its call, if it is still running, is dropped and
    /// answered `EINTR`. An interrupt for a request that is not running is ignored (it ended
    /// already, or never came).
    fn interrupt(&self, unique: u64) {
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(call) = running.get(&unique) {
            call.interrupt.cancel();
        }
    }

    /// The kernel gives back `count` lookups of `node`: passed on, at most what it holds.
    async fn forget(&self, node: u64, count: u64) {
        let given_back = {
            let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            let Some(holding) = held.get_mut(&node) else {
                return;
            };
            let given_back = count.min(*holding);
            *holding -= given_back;
            if *holding == 0 {
                held.remove(&node);
            }
            given_back
        };
        if given_back > 0 {
            let forgotten = crate::callback::guarded(|| self.fs.forget(InodeId(node), given_back));
            if let Err(panicked) = forgotten.await {
                tracing::error!(target: "krunbox::fs", node, "the filesystem panicked in forget ({panicked})");
            }
        }
    }

    /// The reply for a new name: it hands the kernel a lookup of `entry`'s inode.
    fn entry_reply(&self, unique: u64, entry: &Entry, cache: CachePolicy) -> Vec<u8> {
        self.hold(entry);
        reply::entry(unique, entry, cache)
    }

    fn opened(&self, node: InodeId, handle: FileHandle, directory: bool) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.insert((node.0, handle.0), directory);
    }

    fn closed(&self, node: InodeId, handle: u64) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.remove(&(node.0, handle));
    }

    fn hold(&self, entry: &Entry) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        *held.entry(entry.attr.ino.0).or_insert(0) += 1;
    }

    /// Clears `node`'s set-user-ID and set-group-ID bits (see [`without_suid_sgid`]), as the
    /// kernel asks of a filesystem that handles `HANDLE_KILLPRIV_V2`; nothing when neither is
    /// set, which is almost always (one `getattr` of the implementation, no round trip).
    async fn kill_suid_sgid(&self, node: InodeId, caller: Caller) -> FsResult<()> {
        let attr = self.fs.getattr(node).await?;
        if let Some(perm) = without_suid_sgid(attr.perm) {
            let change = SetAttr {
                perm: Some(perm),
                ..SetAttr::default()
            };
            self.fs.setattr(node, change, caller).await?;
        }
        Ok(())
    }

    fn init(&self, unique: u64, operation: &Operation<'_>) -> Vec<u8> {
        let Operation::Init {
            major,
            minor,
            max_readahead,
            flags,
        } = *operation
        else {
            unreachable!("init() is called for Init only");
        };
        if major != abi::KERNEL_VERSION || minor < OLDEST_MINOR {
            tracing::warn!(target: "krunbox::fs", major, minor, "refused a FUSE kernel protocol this session does not speak");
            return reply::error(unique, libc::EPROTO);
        }
        let agreed = flags & wanted_flags();
        let out = abi::InitOut {
            major: abi::KERNEL_VERSION,
            minor: minor.min(PROTOCOL_MINOR),
            max_readahead: max_readahead.min(MAX_WRITE),
            flags: agreed as u32,
            max_background: 64,
            congestion_threshold: 48,
            max_write: MAX_WRITE,
            time_gran: 1,
            max_pages: (MAX_WRITE / 4096) as u16,
            map_alignment: 0,
            flags2: 0,
            unused: [0; 7],
        };
        self.initialized.store(true, Ordering::Release);
        reply::value(unique, &out)
    }

    async fn dispatch(
        &self,
        header: request::Header,
        operation: Operation<'_>,
    ) -> FsResult<Vec<u8>> {
        let fs = &*self.fs;
        let unique = header.unique;
        let node = InodeId(header.nodeid);
        let cache = self.options.cache_policy();
        let caller = Caller {
            uid: header.uid,
            gid: header.gid,
            pid: header.pid,
        };
        Ok(match operation {
            Operation::Lookup { name } => match fs.lookup(node, name).await {
                Ok(entry) => self.entry_reply(unique, &entry, cache),
                Err(FsError::NOT_FOUND) if !cache.entry_timeout.is_zero() => {
                    reply::negative_entry(unique, cache)
                }
                Err(err) => return Err(err),
            },
            Operation::Getattr => reply::attr_out(unique, &fs.getattr(node).await?, cache),
            Operation::Setattr(args) => {
                let mut change = set_attr(&args);
                if args.valid & abi::SetattrValid::KILL_SUIDGID.bits() != 0 {
                    // A truncate by a caller without CAP_FSETID, or a chown: the new mode
                    // (the one given, else the current one) loses the bits.
                    let perm = match change.perm {
                        Some(perm) => perm,
                        None => fs.getattr(node).await?.perm,
                    };
                    if let Some(perm) = without_suid_sgid(perm) {
                        change.perm = Some(perm);
                    }
                }
                reply::attr_out(unique, &fs.setattr(node, change, caller).await?, cache)
            }
            Operation::Readlink => {
                let mut target = fs.readlink(node).await?;
                target.truncate(request::PATH_MAX - 1);
                reply::ok(unique, &target)
            }
            Operation::Symlink { name, target } => self.entry_reply(
                unique,
                &fs.symlink(node, name, target, caller).await?,
                cache,
            ),
            Operation::Mknod { name, mode, rdev } => {
                if matches!(
                    FileKind::from_mode(mode),
                    None | Some(FileKind::Directory | FileKind::Symlink)
                ) {
                    return Err(FsError::INVALID);
                }
                self.entry_reply(
                    unique,
                    &fs.mknod(node, name, mode, rdev, caller).await?,
                    cache,
                )
            }
            Operation::Mkdir { name, mode } => self.entry_reply(
                unique,
                &fs.mkdir(node, name, mode & 0o7777, caller).await?,
                cache,
            ),
            Operation::Unlink { name } => {
                fs.unlink(node, name).await?;
                reply::ok(unique, &[])
            }
            Operation::Rmdir { name } => {
                fs.rmdir(node, name).await?;
                reply::ok(unique, &[])
            }
            Operation::Rename {
                name,
                new_parent,
                new_name,
                flags,
            } => {
                let both = libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE;
                // RENAME_WHITEOUT (overlayfs's) and any future flag: refused, not ignored.
                if flags & !both != 0 || flags == both || new_parent == 0 {
                    return Err(FsError::INVALID);
                }
                let flags = RenameFlags {
                    no_replace: flags & libc::RENAME_NOREPLACE != 0,
                    exchange: flags & libc::RENAME_EXCHANGE != 0,
                };
                fs.rename(node, name, InodeId(new_parent), new_name, flags)
                    .await?;
                reply::ok(unique, &[])
            }
            Operation::Link { target, new_name } => {
                if target == 0 {
                    return Err(FsError::INVALID);
                }
                self.entry_reply(
                    unique,
                    &fs.link(InodeId(target), node, new_name).await?,
                    cache,
                )
            }
            Operation::Open {
                flags,
                kill_suid_sgid,
            } => {
                if kill_suid_sgid {
                    self.kill_suid_sgid(node, caller).await?;
                }
                let handle = fs.open(node, OpenFlags(flags as i32)).await?;
                self.opened(node, handle, false);
                reply::open(unique, handle.0)
            }
            Operation::Create {
                name,
                mode,
                flags,
                kill_suid_sgid,
            } => {
                let mode = libc::S_IFREG | (mode & 0o7777);
                let (mut entry, handle) = fs
                    .create(node, name, mode, OpenFlags(flags as i32), caller)
                    .await?;
                self.hold(&entry);
                self.opened(entry.attr.ino, handle, false);
                // The name existed and was truncated: its bits go now, after the fact (the
                // inode was unknown before). A failure here cannot undo the open the kernel
                // is about to be told of, so it fails nothing and is logged.
                if kill_suid_sgid && without_suid_sgid(entry.attr.perm).is_some() {
                    match self.kill_suid_sgid(entry.attr.ino, caller).await {
                        Ok(()) => {
                            entry.attr = fs.getattr(entry.attr.ino).await.unwrap_or(entry.attr)
                        }
                        Err(err) => {
                            tracing::warn!(target: "krunbox::fs", ?err, "clearing set-user-ID after a truncating create failed")
                        }
                    }
                }
                reply::create(unique, &entry, handle.0, cache)
            }
            Operation::Read {
                handle,
                offset,
                size,
            } => {
                let mut data = fs.read(node, FileHandle(handle), offset, size).await?;
                data.truncate(size as usize);
                reply::ok(unique, &data)
            }
            Operation::Write {
                handle,
                offset,
                data,
                kill_suid_sgid,
            } => {
                if offset
                    .checked_add(data.len() as u64)
                    .is_none_or(|end| end > i64::MAX as u64)
                {
                    return Err(FsError::TOO_BIG);
                }
                // Before the data, as the kernel's own write path does: a write whose
                // clearing fails does not happen.
                if kill_suid_sgid {
                    self.kill_suid_sgid(node, caller).await?;
                }
                let written = fs
                    .write_data(node, FileHandle(handle), offset, data)
                    .await?;
                reply::write(unique, written.min(data.len() as u32))
            }
            Operation::Flush { handle } => {
                fs.flush(node, FileHandle(handle)).await?;
                reply::ok(unique, &[])
            }
            Operation::Release { handle } => {
                self.closed(node, handle);
                fs.release(node, FileHandle(handle)).await?;
                reply::ok(unique, &[])
            }
            Operation::Fsync { handle, data_only } | Operation::Fsyncdir { handle, data_only } => {
                fs.fsync(node, FileHandle(handle), data_only).await?;
                reply::ok(unique, &[])
            }
            Operation::Fallocate {
                handle,
                offset,
                length,
                mode,
            } => {
                if length == 0 {
                    return Err(FsError::INVALID);
                }
                if offset
                    .checked_add(length)
                    .is_none_or(|end| end > i64::MAX as u64)
                {
                    return Err(FsError::TOO_BIG);
                }
                fs.fallocate(node, FileHandle(handle), offset, length, mode as i32)
                    .await?;
                reply::ok(unique, &[])
            }
            Operation::Opendir => {
                let handle = fs.opendir(node).await?;
                self.opened(node, handle, true);
                reply::open(unique, handle.0)
            }
            Operation::Readdir {
                handle,
                offset,
                size,
            } => {
                let call = fs.readdir(node, FileHandle(handle), offset);
                let entries = reply::with_readdir_room(size as usize, call).await?;
                reply::dirents(unique, &entries, size as usize)
            }
            Operation::Releasedir { handle } => {
                self.closed(node, handle);
                fs.releasedir(node, FileHandle(handle)).await?;
                reply::ok(unique, &[])
            }
            Operation::Statfs => reply::statfs(unique, &fs.statfs().await?),
            Operation::Setxattr { name, value, flags } => {
                fs.setxattr(node, name, value, flags as i32).await?;
                reply::ok(unique, &[])
            }
            Operation::Getxattr { name, size } => {
                let value = fs.getxattr(node, name).await?;
                sized(unique, value, size)?
            }
            Operation::Listxattr { size } => {
                let mut list = Vec::new();
                for name in fs.listxattr(node).await? {
                    if !name.is_empty() && !name.contains(&0) {
                        list.extend_from_slice(&name);
                        list.push(0);
                    }
                }
                sized(unique, list, size)?
            }
            Operation::Removexattr { name } => {
                fs.removexattr(node, name).await?;
                reply::ok(unique, &[])
            }
            Operation::Destroy => reply::ok(unique, &[]),
            Operation::Init { .. }
            | Operation::Forget { .. }
            | Operation::BatchForget { .. }
            | Operation::Interrupt { .. }
            | Operation::Unsupported => return Err(FsError::UNSUPPORTED),
        })
    }
}

/// An extended attribute reply: its size when the caller asked for the size (0), the bytes
/// when they fit, `ERANGE` when they do not.
fn sized(unique: u64, bytes: Vec<u8>, size: u32) -> FsResult<Vec<u8>> {
    if bytes.len() > request::XATTR_SIZE_MAX {
        return Err(FsError::TOO_BIG);
    }
    if size == 0 {
        Ok(reply::xattr_size(unique, bytes.len()))
    } else if bytes.len() > size as usize {
        Err(FsError::RANGE)
    } else {
        Ok(reply::ok(unique, &bytes))
    }
}

/// Whether an operation changes the filesystem (refused on a read-only mount).
fn mutates(operation: &Operation<'_>) -> bool {
    match operation {
        Operation::Setattr(_)
        | Operation::Symlink { .. }
        | Operation::Mknod { .. }
        | Operation::Mkdir { .. }
        | Operation::Unlink { .. }
        | Operation::Rmdir { .. }
        | Operation::Rename { .. }
        | Operation::Link { .. }
        | Operation::Create { .. }
        | Operation::Write { .. }
        | Operation::Fallocate { .. }
        | Operation::Setxattr { .. }
        | Operation::Removexattr { .. } => true,
        Operation::Open { flags, .. } => {
            let flags = *flags as i32;
            flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0
        }
        _ => false,
    }
}

/// `perm` without set-user-ID, and without set-group-ID when group-executable (without that
/// bit, set-group-ID means mandatory locking, not privilege): what Linux clears on a write, a
/// truncate or a chown. `None` when nothing changes.
fn without_suid_sgid(perm: u32) -> Option<u32> {
    let mut kill = libc::S_ISUID;
    if perm & libc::S_IXGRP != 0 {
        kill |= libc::S_ISGID;
    }
    (perm & kill != 0).then_some(perm & !kill)
}

fn set_attr(args: &abi::SetattrIn) -> SetAttr {
    use abi::SetattrValid as V;
    let valid = V::from_bits_truncate(args.valid);
    let time = |set: V, now: V, secs: u64, nanos: u32| {
        if valid.contains(now) {
            Some(TimeOrNow::Now)
        } else if valid.contains(set) {
            Some(TimeOrNow::At(reply::time_from(secs, nanos)))
        } else {
            None
        }
    };
    SetAttr {
        perm: valid.contains(V::MODE).then_some(args.mode & 0o7777),
        uid: valid.contains(V::UID).then_some(args.uid),
        gid: valid.contains(V::GID).then_some(args.gid),
        size: valid.contains(V::SIZE).then_some(args.size),
        atime: time(V::ATIME, V::ATIME_NOW, args.atime, args.atimensec),
        mtime: time(V::MTIME, V::MTIME_NOW, args.mtime, args.mtimensec),
        handle: (args.valid & abi::FATTR_FH != 0).then_some(FileHandle(args.fh)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::fuse::fuzz::{init_request, request};
    use crate::fs::MemoryFs;
    use vm_memory::ByteValued;

    async fn used_inodes(fs: &MemoryFs) -> u64 {
        let stat = fs.statfs().await.unwrap();
        stat.files - stat.files_free
    }

    /// A `MemoryFs` whose lookups panic on `boom` and wait until dropped on `slow`.
    struct Misbehaving(MemoryFs);

    #[async_trait::async_trait]
    impl VirtualFs for Misbehaving {
        async fn lookup(&self, parent: InodeId, name: &std::ffi::OsStr) -> FsResult<Entry> {
            match name.to_str() {
                Some("boom") => panic!("a bug of the implementation's"),
                Some("slow") => std::future::pending().await,
                _ => self.0.lookup(parent, name).await,
            }
        }
        async fn getattr(&self, ino: InodeId) -> FsResult<Attr> {
            self.0.getattr(ino).await
        }
        async fn readdir(
            &self,
            ino: InodeId,
            handle: FileHandle,
            offset: u64,
        ) -> FsResult<Vec<DirEntry>> {
            self.0.readdir(ino, handle, offset).await
        }
    }

    fn error_of(reply: &[u8]) -> i32 {
        -i32::from_le_bytes(reply[4..8].try_into().unwrap())
    }

    /// Issue 33: a panic in the implementation answered nothing, and the guest's call waited
    /// for ever. Now the call fails with EIO and the session goes on.
    #[tokio::test]
    async fn a_panicking_call_fails_with_eio_and_the_session_goes_on() {
        let session = Session::new(Arc::new(Misbehaving(MemoryFs::new())), MountOptions::new());
        session.handle(&init_request(1)).await.unwrap().unwrap();
        const LOOKUP: u32 = 1;
        let reply = session
            .handle(&request(LOOKUP, 2, 1, b"boom\0"))
            .await
            .unwrap();
        assert_eq!(error_of(&reply.unwrap()), libc::EIO);
        // The next call is answered as ever: a name not there, as a cached negative entry.
        let reply = session
            .handle(&request(LOOKUP, 3, 1, b"other\0"))
            .await
            .unwrap();
        assert_eq!(error_of(&reply.unwrap()), 0);
        assert!(session.running.lock().unwrap().is_empty());
    }

    /// An interrupt for a running call drops it and answers it EINTR; one for a request that
    /// is not running changes nothing. (Linux's virtio-fs sends none today: docs/security.md.)
    #[tokio::test]
    async fn an_interrupt_ends_a_running_call_with_eintr() {
        const LOOKUP: u32 = 1;
        const INTERRUPT: u32 = 36;
        let session = Arc::new(Session::new(
            Arc::new(Misbehaving(MemoryFs::new())),
            MountOptions::new(),
        ));
        session.handle(&init_request(1)).await.unwrap().unwrap();
        let waiting = tokio::spawn({
            let session = session.clone();
            async move { session.handle(&request(LOOKUP, 7, 1, b"slow\0")).await }
        });
        while !session.running.lock().unwrap().contains_key(&7) {
            tokio::task::yield_now().await;
        }
        let stray = abi::InterruptIn { unique: 99 };
        assert_eq!(
            session
                .handle(&request(INTERRUPT, 8, 0, stray.as_slice()))
                .await
                .unwrap(),
            None
        );
        let interrupt = abi::InterruptIn { unique: 7 };
        assert_eq!(
            session
                .handle(&request(INTERRUPT, 9, 0, interrupt.as_slice()))
                .await
                .unwrap(),
            None,
            "an interrupt gets no reply of its own"
        );
        let reply = waiting.await.unwrap().unwrap().unwrap();
        assert_eq!(u64::from_le_bytes(reply[8..16].try_into().unwrap()), 7);
        assert_eq!(error_of(&reply), libc::EINTR);
        assert!(session.running.lock().unwrap().is_empty());
    }

    /// A session that ends (its guest kernel gone: a retried boot, a VM that stopped) gives
    /// back every handle and lookup that kernel still held, so a filesystem reused by the next
    /// boot frees what nobody can name any more.
    #[tokio::test]
    async fn an_ended_session_gives_back_the_lookups_its_kernel_held() {
        let fs = MemoryFs::new();
        let before = used_inodes(&fs).await;
        let session = Session::new(Arc::new(fs.clone()), MountOptions::new());
        session.handle(&init_request(1)).await.unwrap().unwrap();
        let create = abi::CreateIn {
            flags: libc::O_RDWR as u32,
            mode: libc::S_IFREG | 0o644,
            umask: 0,
            fuse_flags: 0,
        };
        let body = [create.as_slice(), b"held\0"].concat();
        let reply = session
            .handle(&request(35, 2, 1, &body))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(i32::from_le_bytes(reply[4..8].try_into().unwrap()), 0);
        // Unlinked while the kernel holds it (as an open-but-unlinked file would be).
        let reply = session
            .handle(&request(10, 3, 1, b"held\0"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(i32::from_le_bytes(reply[4..8].try_into().unwrap()), 0);
        assert_eq!(used_inodes(&fs).await, before + 1, "held by the kernel");
        // A FORGET of more than the kernel holds gives back only what it holds.
        let forget = abi::ForgetIn { nlookup: 0 };
        assert!(session
            .handle(&request(2, 0, 2, forget.as_slice()))
            .await
            .unwrap()
            .is_none());
        assert_eq!(used_inodes(&fs).await, before + 1);
        drop(session);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            used_inodes(&fs).await,
            before,
            "given back when the session ended"
        );
    }

    fn errno(reply: &[u8]) -> i32 {
        i32::from_le_bytes(reply[4..8].try_into().unwrap())
    }

    /// Under HANDLE_KILLPRIV_V2 the filesystem, not the kernel, clears set-user-ID and
    /// set-group-ID (the latter only when group-executable) on a write, truncate or truncating
    /// open of a caller without CAP_FSETID (the kernel flags those), and never otherwise.
    #[tokio::test]
    async fn the_session_clears_set_id_bits_where_the_kernel_asks() {
        let fs = MemoryFs::new();
        let session = Session::new(Arc::new(fs.clone()), MountOptions::new());
        let init = session.handle(&init_request(1)).await.unwrap().unwrap();
        let agreed = u32::from_le_bytes(init[28..32].try_into().unwrap()) as u64;
        assert_ne!(agreed & abi::FsOptions::HANDLE_KILLPRIV_V2.bits(), 0);
        let mut unique = 1;
        let mut send = |opcode: u32, node: u64, body: Vec<u8>| {
            unique += 1;
            request(opcode, unique, node, &body)
        };
        // Creates `name` with `perm`; returns its node id and handle.
        let mut files = Vec::new();
        for (name, perm) in [("a", 0o6755), ("b", 0o2644), ("c", 0o6755), ("d", 0o6755)] {
            let create = abi::CreateIn {
                flags: libc::O_RDWR as u32,
                mode: libc::S_IFREG | perm,
                umask: 0,
                fuse_flags: 0,
            };
            let body = [create.as_slice(), name.as_bytes(), b"\0"].concat();
            let reply = session.handle(&send(35, 1, body)).await.unwrap().unwrap();
            assert_eq!(errno(&reply), 0);
            let node = u64::from_le_bytes(reply[16..24].try_into().unwrap());
            let handle = u64::from_le_bytes(reply[144..152].try_into().unwrap());
            assert_eq!(fs.metadata(&format!("/{name}")).unwrap().perm, perm);
            files.push((node, handle));
        }
        let perm = |name: &str| fs.metadata(&format!("/{name}")).unwrap().perm;
        let write = |handle: u64, fuse_flags: u32| {
            let args = abi::WriteIn {
                fh: handle,
                size: 1,
                fuse_flags,
                ..Default::default()
            };
            [args.as_slice(), b"x"].concat()
        };
        // A write by a capable caller (no flag) keeps the bits; one flagged clears them.
        let (a, a_handle) = files[0];
        let reply = session
            .handle(&send(16, a, write(a_handle, 0)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(errno(&reply), 0);
        assert_eq!(perm("a"), 0o6755);
        let flagged = write(a_handle, abi::WRITE_KILL_PRIV);
        let reply = session
            .handle(&send(16, a, flagged))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(errno(&reply), 0);
        assert_eq!(perm("a"), 0o755);
        assert_eq!(fs.read_file("/a").unwrap(), b"x", "the write happened too");
        // Set-group-ID without group-execute is not a privilege: it stays.
        let (b, b_handle) = files[1];
        let flagged = write(b_handle, abi::WRITE_KILL_PRIV);
        session
            .handle(&send(16, b, flagged))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(perm("b"), 0o2644);
        // A flagged truncate.
        let (c, _) = files[2];
        let truncate = abi::SetattrIn {
            valid: (abi::SetattrValid::SIZE | abi::SetattrValid::KILL_SUIDGID).bits(),
            size: 0,
            ..Default::default()
        };
        let reply = session
            .handle(&send(4, c, truncate.as_slice().to_vec()))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(errno(&reply), 0);
        assert_eq!(perm("c"), 0o755);
        // An open without O_TRUNC keeps them whatever the flag; a flagged truncating one clears.
        let (d, _) = files[3];
        let open = |flags: i32| {
            let args = abi::OpenIn {
                flags: flags as u32,
                fuse_flags: abi::FOPEN_IN_KILL_SUIDGID,
            };
            args.as_slice().to_vec()
        };
        let reply = session
            .handle(&send(14, d, open(libc::O_WRONLY)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(errno(&reply), 0);
        assert_eq!(perm("d"), 0o6755);
        let reply = session
            .handle(&send(14, d, open(libc::O_WRONLY | libc::O_TRUNC)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(errno(&reply), 0);
        assert_eq!(perm("d"), 0o755);
    }
}
