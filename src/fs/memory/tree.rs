//! The tree behind a [`MemoryFs`](super::MemoryFs): inodes, directories, open handles, and what
//! they cost. Everything here is synchronous and runs under the filesystem's one lock.
//!
//! Accounting: `used` is the sum of every file's buffers ([`FileData::charged`]), every
//! symlink's target, every extended attribute's name and value plus [`XATTR_COST`], and every
//! directory entry's name plus [`ENTRY_COST`] (hard links add entries without inodes, so names
//! are counted as well as inodes). Nothing the guest asks for allocates before its cost is
//! checked against the limit.

#[cfg(test)]
mod check;
mod ops;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::data::FileData;
use super::MemoryFs;
use crate::fs::types::*;

/// The root directory's inode number.
pub(super) const ROOT: u64 = InodeId::ROOT.0;

/// What a directory entry costs beyond its name's bytes (its name's allocation and its slots
/// in two maps).
pub(super) const ENTRY_COST: u64 = 128;

/// What an extended attribute costs beyond its name's and value's bytes (two allocations and
/// a map slot).
pub(super) const XATTR_COST: u64 = 64;

/// The most entries one `readdir` call returns (a guest's listing buffer is a page, at most
/// 128 of the smallest entries; the kernel asks again from the last one it took).
pub(super) const READDIR_BATCH: usize = 256;

/// The longest name.
const NAME_MAX: usize = 255;

/// The longest symlink target (Linux's `PATH_MAX` less its NUL).
const SYMLINK_MAX: usize = 4095;

/// The longest extended attribute name (Linux's `XATTR_NAME_MAX`).
const XATTR_NAME_MAX: usize = 255;

/// The most names one inode that is not a directory can have (ext4's limit).
pub(super) const MAX_LINKS: u32 = 65_000;

/// The first cookie of a directory's entries: 1 resumes after `.`, 2 after `..`.
const FIRST_COOKIE: u64 = 3;

/// The bounds a tree keeps.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub max_bytes: u64,
    pub max_inodes: u64,
}

/// One inode.
#[derive(Debug)]
struct Node {
    kind: FileKind,
    perm: u32,
    uid: u32,
    gid: u32,
    nlink: u32,
    rdev: u32,
    atime: SystemTime,
    mtime: SystemTime,
    ctime: SystemTime,
    /// References the guest holds (lookups not yet forgotten).
    lookups: u64,
    /// Open handles.
    open: u64,
    body: Body,
    xattrs: BTreeMap<Box<[u8]>, Box<[u8]>>,
}

#[derive(Debug)]
enum Body {
    File(FileData),
    Dir(Dir),
    Symlink(Box<[u8]>),
    /// A fifo, socket or device node: nothing but metadata.
    Other,
}

/// A directory's entries, each with a cookie that stays its place in listings: cookies only
/// grow, so a listing resumes after any cookie in `O(log n)` and lists every entry that stayed
/// exactly once, whatever else is added or removed meanwhile.
#[derive(Debug)]
struct Dir {
    parent: u64,
    /// Name → (inode, cookie).
    names: HashMap<Arc<[u8]>, (u64, u64)>,
    /// Cookie → (name, inode).
    order: BTreeMap<u64, (Arc<[u8]>, u64)>,
    next_cookie: u64,
}

impl Dir {
    fn new(parent: u64) -> Self {
        Dir {
            parent,
            names: HashMap::new(),
            order: BTreeMap::new(),
            next_cookie: FIRST_COOKIE,
        }
    }

    fn get(&self, name: &[u8]) -> Option<u64> {
        self.names.get(name).map(|&(ino, _)| ino)
    }

    fn insert(&mut self, name: &[u8], ino: u64) {
        let name: Arc<[u8]> = name.into();
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        self.names.insert(name.clone(), (ino, cookie));
        self.order.insert(cookie, (name, ino));
    }

    fn remove(&mut self, name: &[u8]) -> Option<u64> {
        let (ino, cookie) = self.names.remove(name)?;
        self.order.remove(&cookie);
        Some(ino)
    }

    /// Points an existing name at another inode, in place.
    fn set(&mut self, name: &[u8], ino: u64) {
        if let Some((slot, cookie)) = self.names.get_mut(name) {
            *slot = ino;
            if let Some(entry) = self.order.get_mut(cookie) {
                entry.1 = ino;
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

/// An open file or directory.
#[derive(Debug, Clone, Copy)]
enum Handle {
    File { ino: u64, write: bool, append: bool },
    Dir { ino: u64 },
}

impl Handle {
    fn ino(self) -> u64 {
        match self {
            Handle::File { ino, .. } | Handle::Dir { ino } => ino,
        }
    }
}

/// What a new inode is.
pub(super) enum NewNode {
    File(FileData),
    Dir,
    Symlink(Box<[u8]>),
    Other(FileKind, u32),
}

/// The filesystem.
#[derive(Debug)]
pub(super) struct Tree {
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    handles: HashMap<u64, Handle>,
    next_handle: u64,
    used: u64,
    limits: Limits,
}

fn entry_cost(name: &[u8]) -> u64 {
    name.len() as u64 + ENTRY_COST
}

fn xattr_cost(name: &[u8], value: &[u8]) -> u64 {
    (name.len() + value.len()) as u64 + XATTR_COST
}

/// Checks one name (the FUSE layer did already; this never trusts it).
pub(super) fn check_name(name: &[u8]) -> FsResult<()> {
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0)
    {
        Err(FsError::INVALID)
    } else if name.len() > NAME_MAX {
        Err(FsError::NAME_TOO_LONG)
    } else {
        Ok(())
    }
}

fn check_xattr_name(name: &[u8]) -> FsResult<()> {
    if name.contains(&0) {
        Err(FsError::INVALID)
    } else if name.is_empty() || name.len() > XATTR_NAME_MAX {
        Err(FsError::RANGE)
    } else {
        Ok(())
    }
}

impl Node {
    fn new(kind: FileKind, perm: u32, uid: u32, gid: u32, body: Body, now: SystemTime) -> Self {
        Node {
            kind,
            perm: perm & 0o7777,
            uid,
            gid,
            nlink: if kind == FileKind::Directory { 2 } else { 1 },
            rdev: 0,
            atime: now,
            mtime: now,
            ctime: now,
            lookups: 0,
            open: 0,
            body,
            xattrs: BTreeMap::new(),
        }
    }

    /// What this inode costs apart from its directory entries.
    fn cost(&self) -> u64 {
        let body = match &self.body {
            Body::File(data) => data.charged(),
            Body::Symlink(target) => target.len() as u64,
            Body::Dir(_) | Body::Other => 0,
        };
        body + self
            .xattrs
            .iter()
            .map(|(name, value)| xattr_cost(name, value))
            .sum::<u64>()
    }

    fn attr(&self, ino: u64) -> Attr {
        let (size, blocks) = match &self.body {
            Body::File(data) => (data.size(), data.charged().div_ceil(512)),
            Body::Dir(dir) => ((dir.names.len() as u64 + 2) * 32, 0),
            Body::Symlink(target) => (target.len() as u64, 0),
            Body::Other => (0, 0),
        };
        Attr {
            ino: InodeId(ino),
            kind: self.kind,
            perm: self.perm,
            nlink: self.nlink,
            uid: self.uid,
            gid: self.gid,
            size,
            blocks,
            atime: self.atime,
            mtime: self.mtime,
            ctime: self.ctime,
            rdev: self.rdev,
        }
    }

    /// relatime: a read updates the access time when it is older than the last change or
    /// than a day.
    fn accessed(&mut self, now: SystemTime) {
        let stale = now
            .duration_since(self.atime)
            .is_ok_and(|age| age >= Duration::from_secs(24 * 3600));
        if self.atime <= self.mtime || self.atime <= self.ctime || stale {
            self.atime = now;
        }
    }
}

impl Tree {
    pub(super) fn new(limits: Limits) -> Self {
        let now = SystemTime::now();
        let root = Node::new(
            FileKind::Directory,
            0o755,
            0,
            0,
            Body::Dir(Dir::new(ROOT)),
            now,
        );
        Tree {
            nodes: HashMap::from([(ROOT, root)]),
            next_ino: ROOT + 1,
            handles: HashMap::new(),
            next_handle: 1,
            used: 0,
            limits,
        }
    }

    pub(super) fn limits(&self) -> Limits {
        self.limits
    }

    pub(super) fn used_bytes(&self) -> u64 {
        self.used
    }

    pub(super) fn inode_count(&self) -> u64 {
        self.nodes.len() as u64
    }

    // --- helpers -------------------------------------------------------------------------

    fn node(&self, ino: u64) -> FsResult<&Node> {
        self.nodes.get(&ino).ok_or(FsError::NOT_FOUND)
    }

    fn node_mut(&mut self, ino: u64) -> FsResult<&mut Node> {
        self.nodes.get_mut(&ino).ok_or(FsError::NOT_FOUND)
    }

    fn dir(&self, ino: u64) -> FsResult<&Dir> {
        match &self.node(ino)?.body {
            Body::Dir(dir) => Ok(dir),
            _ => Err(FsError::NOT_DIRECTORY),
        }
    }

    fn dir_mut(&mut self, ino: u64) -> FsResult<&mut Dir> {
        match &mut self.node_mut(ino)?.body {
            Body::Dir(dir) => Ok(dir),
            _ => Err(FsError::NOT_DIRECTORY),
        }
    }

    /// A directory that can get new entries: not removed.
    fn live_dir(&self, ino: u64) -> FsResult<&Dir> {
        let dir = self.dir(ino)?;
        if self.node(ino)?.nlink == 0 {
            return Err(FsError::NOT_FOUND);
        }
        Ok(dir)
    }

    fn kind(&self, ino: u64) -> FsResult<FileKind> {
        Ok(self.node(ino)?.kind)
    }

    /// Takes `bytes` from what is left, or fails with `ENOSPC` taking nothing.
    fn charge(&mut self, bytes: u64) -> FsResult<()> {
        match self.used.checked_add(bytes) {
            Some(used) if used <= self.limits.max_bytes => {
                self.used = used;
                Ok(())
            }
            _ => Err(FsError::NO_SPACE),
        }
    }

    fn refund(&mut self, bytes: u64) {
        self.used = self.used.saturating_sub(bytes);
    }

    /// Changes a directory's times after its entries changed.
    fn touch_dir(&mut self, ino: u64, now: SystemTime) {
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.mtime = now;
            node.ctime = now;
        }
    }

    fn add_nlink(&mut self, ino: u64, delta: i64) {
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.nlink = (i64::from(node.nlink) + delta).clamp(0, i64::from(u32::MAX)) as u32;
        }
    }

    /// Frees an inode nothing refers to any more: no name, no guest reference, no handle.
    fn free_if_unused(&mut self, ino: u64) {
        if ino == ROOT {
            return;
        }
        let unused = self
            .nodes
            .get(&ino)
            .is_some_and(|node| node.nlink == 0 && node.lookups == 0 && node.open == 0);
        if unused {
            if let Some(node) = self.nodes.remove(&ino) {
                self.refund(node.cost());
            }
        }
    }

    /// Whether `ino` is `ancestor` or lies beneath it.
    fn is_within(&self, ancestor: u64, mut ino: u64) -> bool {
        for _ in 0..=self.nodes.len() {
            if ino == ancestor {
                return true;
            }
            if ino == ROOT {
                return false;
            }
            match self.dir(ino) {
                Ok(dir) => ino = dir.parent,
                Err(_) => return false,
            }
        }
        false
    }

    fn add_handle(&mut self, handle: Handle) -> FsResult<u64> {
        if self.handles.len() >= MemoryFs::MAX_OPEN_HANDLES {
            return Err(FsError::from_errno(libc::ENFILE));
        }
        let id = self.next_handle;
        self.next_handle += 1;
        self.handles.insert(id, handle);
        if let Some(node) = self.nodes.get_mut(&handle.ino()) {
            node.open += 1;
        }
        Ok(id)
    }

    fn room_for_handle(&self) -> FsResult<()> {
        if self.handles.len() >= MemoryFs::MAX_OPEN_HANDLES {
            return Err(FsError::from_errno(libc::ENFILE));
        }
        Ok(())
    }

    fn file_handle(&self, ino: u64, fh: u64) -> FsResult<Handle> {
        match self.handles.get(&fh) {
            Some(&handle @ Handle::File { ino: of, .. }) if of == ino => Ok(handle),
            _ => Err(FsError::BAD_HANDLE),
        }
    }

    // --- names ---------------------------------------------------------------------------

    /// The inode `name` names in `parent` (no reference counted).
    pub(super) fn child(&self, parent: u64, name: &[u8]) -> FsResult<u64> {
        check_name(name)?;
        self.dir(parent)?.get(name).ok_or(FsError::NOT_FOUND)
    }

    /// The entry for `ino`, counting one more guest reference.
    fn referenced(&mut self, ino: u64) -> FsResult<Entry> {
        let node = self.node_mut(ino)?;
        node.lookups = node.lookups.saturating_add(1);
        Ok(Entry {
            attr: node.attr(ino),
            generation: 0,
        })
    }

    pub(super) fn lookup(&mut self, parent: u64, name: &[u8]) -> FsResult<Entry> {
        let ino = self.child(parent, name)?;
        self.referenced(ino)
    }

    pub(super) fn forget(&mut self, ino: u64, count: u64) {
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.lookups = node.lookups.saturating_sub(count);
            self.free_if_unused(ino);
        }
    }

    pub(super) fn getattr(&self, ino: u64) -> FsResult<Attr> {
        Ok(self.node(ino)?.attr(ino))
    }

    /// Makes a new inode named `name` in `parent`, owned by `caller` (a setgid directory
    /// gives its group, and its setgid bit to subdirectories). Counts no guest reference.
    pub(super) fn make(
        &mut self,
        parent: u64,
        name: &[u8],
        new: NewNode,
        perm: u32,
        caller: Caller,
    ) -> FsResult<u64> {
        check_name(name)?;
        let dir = self.live_dir(parent)?;
        if dir.get(name).is_some() {
            return Err(FsError::EXISTS);
        }
        let parent_node = self.node(parent)?;
        let (kind, rdev, body) = match new {
            NewNode::File(data) => (FileKind::File, 0, Body::File(data)),
            NewNode::Dir => (FileKind::Directory, 0, Body::Dir(Dir::new(parent))),
            NewNode::Symlink(target) => (FileKind::Symlink, 0, Body::Symlink(target)),
            NewNode::Other(kind, rdev) => (kind, rdev, Body::Other),
        };
        if kind == FileKind::Directory && parent_node.nlink == u32::MAX {
            return Err(FsError::TOO_MANY_LINKS);
        }
        let mut perm = if kind == FileKind::Symlink {
            0o777
        } else {
            perm & 0o7777
        };
        let setgid = libc::S_ISGID;
        let gid = if parent_node.perm & setgid != 0 {
            if kind == FileKind::Directory {
                perm |= setgid;
            }
            parent_node.gid
        } else {
            caller.gid
        };
        if kind != FileKind::Directory && perm & setgid != 0 && gid != caller.gid && caller.uid != 0
        {
            perm &= !setgid;
        }
        if self.nodes.len() as u64 >= self.limits.max_inodes {
            return Err(FsError::NO_SPACE);
        }
        let now = SystemTime::now();
        let mut node = Node::new(kind, perm, caller.uid, gid, body, now);
        node.rdev = rdev;
        self.charge(entry_cost(name) + node.cost())?;
        let ino = self.next_ino;
        self.next_ino += 1;
        self.nodes.insert(ino, node);
        self.dir_mut(parent)?.insert(name, ino);
        if kind == FileKind::Directory {
            self.add_nlink(parent, 1);
        }
        self.touch_dir(parent, now);
        Ok(ino)
    }

    /// [`make`](Self::make), counting one guest reference.
    pub(super) fn make_entry(
        &mut self,
        parent: u64,
        name: &[u8],
        new: NewNode,
        perm: u32,
        caller: Caller,
    ) -> FsResult<Entry> {
        let ino = self.make(parent, name, new, perm, caller)?;
        self.referenced(ino)
    }

    pub(super) fn mknod(
        &mut self,
        parent: u64,
        name: &[u8],
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> FsResult<Entry> {
        let new = match FileKind::from_mode(mode) {
            Some(FileKind::File) => NewNode::File(FileData::default()),
            Some(kind @ (FileKind::Fifo | FileKind::Socket)) => NewNode::Other(kind, 0),
            Some(kind @ (FileKind::CharDevice | FileKind::BlockDevice)) => {
                NewNode::Other(kind, rdev)
            }
            Some(FileKind::Directory | FileKind::Symlink) | None => {
                return Err(FsError::INVALID);
            }
        };
        self.make_entry(parent, name, new, mode, caller)
    }

    pub(super) fn symlink(
        &mut self,
        parent: u64,
        name: &[u8],
        target: &[u8],
        caller: Caller,
    ) -> FsResult<Entry> {
        check_target(target)?;
        self.make_entry(parent, name, NewNode::Symlink(target.into()), 0o777, caller)
    }

    pub(super) fn readlink(&self, ino: u64) -> FsResult<Vec<u8>> {
        match &self.node(ino)?.body {
            Body::Symlink(target) => Ok(target.to_vec()),
            _ => Err(FsError::INVALID),
        }
    }

    /// Removes `name` from `parent`: a directory only when `directory` (and empty), anything
    /// else only when not.
    pub(super) fn remove(&mut self, parent: u64, name: &[u8], directory: bool) -> FsResult<()> {
        let ino = self.child(parent, name)?;
        let is_dir = self.kind(ino)? == FileKind::Directory;
        match (directory, is_dir) {
            (false, true) => return Err(FsError::IS_DIRECTORY),
            (true, false) => return Err(FsError::NOT_DIRECTORY),
            (true, true) if !self.dir(ino)?.is_empty() => return Err(FsError::NOT_EMPTY),
            _ => {}
        }
        let now = SystemTime::now();
        self.dir_mut(parent)?.remove(name);
        self.refund(entry_cost(name));
        self.unlinked(ino, parent, now);
        self.touch_dir(parent, now);
        self.free_if_unused(ino);
        Ok(())
    }

    /// `ino` lost a name in `parent`: its link count drops (a directory's to 0, and its
    /// parent's by one).
    fn unlinked(&mut self, ino: u64, parent: u64, now: SystemTime) {
        let Some(node) = self.nodes.get_mut(&ino) else {
            return;
        };
        node.ctime = now;
        if node.kind == FileKind::Directory {
            node.nlink = 0;
            self.add_nlink(parent, -1);
        } else {
            node.nlink = node.nlink.saturating_sub(1);
        }
    }

    pub(super) fn link(&mut self, ino: u64, parent: u64, name: &[u8]) -> FsResult<Entry> {
        check_name(name)?;
        let node = self.node(ino)?;
        if node.kind == FileKind::Directory {
            return Err(FsError::NOT_PERMITTED);
        }
        if node.nlink == 0 {
            return Err(FsError::NOT_FOUND);
        }
        if node.nlink >= MAX_LINKS {
            return Err(FsError::TOO_MANY_LINKS);
        }
        if self.live_dir(parent)?.get(name).is_some() {
            return Err(FsError::EXISTS);
        }
        self.charge(entry_cost(name))?;
        let now = SystemTime::now();
        self.dir_mut(parent)?.insert(name, ino);
        let node = self.node_mut(ino)?;
        node.nlink += 1;
        node.ctime = now;
        self.touch_dir(parent, now);
        self.referenced(ino)
    }

    pub(super) fn rename(
        &mut self,
        parent: u64,
        name: &[u8],
        new_parent: u64,
        new_name: &[u8],
        flags: RenameFlags,
    ) -> FsResult<()> {
        check_name(new_name)?;
        if flags.exchange && flags.no_replace {
            return Err(FsError::INVALID);
        }
        let src = self.child(parent, name)?;
        let dst = self.live_dir(new_parent)?.get(new_name);
        // Linux's order: a taken name under NOREPLACE, a missing one under EXCHANGE, then a
        // directory moving beneath itself.
        if flags.no_replace && dst.is_some() {
            return Err(FsError::EXISTS);
        }
        if flags.exchange && dst.is_none() {
            return Err(FsError::NOT_FOUND);
        }
        let src_is_dir = self.kind(src)? == FileKind::Directory;
        if src_is_dir && self.is_within(src, new_parent) {
            return Err(FsError::INVALID);
        }
        let now = SystemTime::now();
        if let (true, Some(dst)) = (flags.exchange, dst) {
            let dst_is_dir = self.kind(dst)? == FileKind::Directory;
            if dst_is_dir && self.is_within(dst, parent) {
                return Err(FsError::INVALID);
            }
            if src == dst {
                return Ok(());
            }
            if parent != new_parent {
                let delta = i64::from(dst_is_dir) - i64::from(src_is_dir);
                let full =
                    |tree: &Tree, ino: u64| tree.node(ino).is_ok_and(|node| node.nlink == u32::MAX);
                if (delta > 0 && full(self, parent)) || (delta < 0 && full(self, new_parent)) {
                    return Err(FsError::TOO_MANY_LINKS);
                }
                self.add_nlink(parent, delta);
                self.add_nlink(new_parent, -delta);
                if src_is_dir {
                    self.dir_mut(src)?.parent = new_parent;
                }
                if dst_is_dir {
                    self.dir_mut(dst)?.parent = parent;
                }
            }
            self.dir_mut(parent)?.set(name, dst);
            self.dir_mut(new_parent)?.set(new_name, src);
            for ino in [src, dst] {
                self.node_mut(ino)?.ctime = now;
            }
            self.touch_dir(parent, now);
            self.touch_dir(new_parent, now);
            return Ok(());
        }
        if let Some(dst) = dst {
            if dst == src {
                return Ok(());
            }
            match (src_is_dir, self.kind(dst)? == FileKind::Directory) {
                (true, false) => return Err(FsError::NOT_DIRECTORY),
                (false, true) => return Err(FsError::IS_DIRECTORY),
                (true, true) if !self.dir(dst)?.is_empty() => return Err(FsError::NOT_EMPTY),
                _ => {}
            }
        } else if src_is_dir && parent != new_parent && self.node(new_parent)?.nlink == u32::MAX {
            return Err(FsError::TOO_MANY_LINKS);
        }
        // The new entry is paid from what the old one (and the replaced one) give back.
        let needed = entry_cost(new_name);
        let freed = entry_cost(name) + dst.map_or(0, |_| entry_cost(new_name));
        if needed > freed {
            self.charge(needed - freed)?;
        } else {
            self.refund(freed - needed);
        }
        if let Some(dst) = dst {
            self.dir_mut(new_parent)?.remove(new_name);
            self.unlinked(dst, new_parent, now);
        }
        self.dir_mut(parent)?.remove(name);
        self.dir_mut(new_parent)?.insert(new_name, src);
        if src_is_dir && parent != new_parent {
            self.add_nlink(parent, -1);
            self.add_nlink(new_parent, 1);
            self.dir_mut(src)?.parent = new_parent;
        }
        self.node_mut(src)?.ctime = now;
        self.touch_dir(parent, now);
        self.touch_dir(new_parent, now);
        if let Some(dst) = dst {
            self.free_if_unused(dst);
        }
        Ok(())
    }
}

/// Checks a symlink target.
pub(super) fn check_target(target: &[u8]) -> FsResult<()> {
    if target.is_empty() {
        Err(FsError::NOT_FOUND)
    } else if target.contains(&0) {
        Err(FsError::INVALID)
    } else if target.len() > SYMLINK_MAX {
        Err(FsError::NAME_TOO_LONG)
    } else {
        Ok(())
    }
}
