//! The tree's operations on what inodes hold: attributes, open files and their bytes,
//! directory listings, extended attributes, and the host's reads and rewrites.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

use super::*;
use crate::fs::WriteData;

impl Tree {
    // --- attributes ----------------------------------------------------------------------

    pub(in crate::fs::memory) fn setattr(&mut self, ino: u64, change: &SetAttr) -> FsResult<Attr> {
        let node = self.node(ino)?;
        if let Some(size) = change.size {
            match node.body {
                Body::File(_) if size > MemoryFs::MAX_FILE_SIZE => return Err(FsError::TOO_BIG),
                Body::File(_) => {}
                Body::Dir(_) => return Err(FsError::IS_DIRECTORY),
                _ => return Err(FsError::INVALID),
            }
        }
        let now = SystemTime::now();
        let node = self.node_mut(ino)?;
        let mut freed = 0;
        if let Some(perm) = change.perm {
            node.perm = perm & 0o7777;
        }
        if let Some(uid) = change.uid {
            node.uid = uid;
        }
        if let Some(gid) = change.gid {
            node.gid = gid;
        }
        if let (Some(size), Body::File(data)) = (change.size, &mut node.body) {
            if size != data.size() {
                freed = data.truncate(size);
                node.mtime = now;
            }
        }
        if let Some(atime) = change.atime {
            node.atime = resolve(atime, now);
        }
        if let Some(mtime) = change.mtime {
            node.mtime = resolve(mtime, now);
        }
        let changed = change.perm.is_some()
            || change.uid.is_some()
            || change.gid.is_some()
            || change.size.is_some()
            || change.atime.is_some()
            || change.mtime.is_some();
        if changed {
            node.ctime = now;
        }
        let attr = node.attr(ino);
        self.refund(freed);
        Ok(attr)
    }

    // --- files ---------------------------------------------------------------------------

    pub(in crate::fs::memory) fn open(&mut self, ino: u64, flags: OpenFlags) -> FsResult<u64> {
        match self.node(ino)?.kind {
            FileKind::Directory => return Err(FsError::IS_DIRECTORY),
            FileKind::Symlink => return Err(FsError::LOOP),
            _ => {}
        }
        self.room_for_handle()?;
        if flags.truncate() {
            self.truncate_to_zero(ino)?;
        }
        self.add_handle(Handle::File {
            ino,
            write: flags.write(),
            append: flags.append(),
        })
    }

    fn truncate_to_zero(&mut self, ino: u64) -> FsResult<()> {
        let now = SystemTime::now();
        let node = self.node_mut(ino)?;
        if let Body::File(data) = &mut node.body {
            let freed = data.truncate(0);
            node.mtime = now;
            node.ctime = now;
            self.refund(freed);
        }
        Ok(())
    }

    /// Creates and opens a regular file. An existing name fails with `EEXIST` under
    /// `O_EXCL`; without it an existing regular file is opened (the guest's cached "no such
    /// name" may be older than a file the host made), anything else fails.
    pub(in crate::fs::memory) fn create(
        &mut self,
        parent: u64,
        name: &[u8],
        mode: u32,
        flags: OpenFlags,
        caller: Caller,
    ) -> FsResult<(Entry, u64)> {
        check_name(name)?;
        self.room_for_handle()?;
        if let Some(ino) = self.live_dir(parent)?.get(name) {
            if flags.exclusive() {
                return Err(FsError::EXISTS);
            }
            let handle = match self.kind(ino)? {
                FileKind::File => self.open(ino, flags)?,
                FileKind::Directory => return Err(FsError::IS_DIRECTORY),
                _ => return Err(FsError::EXISTS),
            };
            return Ok((self.referenced(ino)?, handle));
        }
        let ino = self.make(
            parent,
            name,
            NewNode::File(FileData::default()),
            mode,
            caller,
        )?;
        let handle = self.add_handle(Handle::File {
            ino,
            write: flags.write(),
            append: flags.append(),
        })?;
        Ok((self.referenced(ino)?, handle))
    }

    pub(in crate::fs::memory) fn read(
        &mut self,
        ino: u64,
        fh: u64,
        offset: u64,
        size: u32,
    ) -> FsResult<Vec<u8>> {
        self.file_handle(ino, fh)?;
        let now = SystemTime::now();
        let node = self.node_mut(ino)?;
        let Body::File(data) = &node.body else {
            return Err(FsError::INVALID);
        };
        let bytes = data.read(offset, u64::from(size));
        node.accessed(now);
        Ok(bytes)
    }

    pub(in crate::fs::memory) fn write(
        &mut self,
        ino: u64,
        fh: u64,
        offset: u64,
        bytes: WriteData<'_>,
    ) -> FsResult<u32> {
        let Handle::File { write, append, .. } = self.file_handle(ino, fh)? else {
            return Err(FsError::BAD_HANDLE);
        };
        if !write {
            return Err(FsError::BAD_HANDLE);
        }
        let len = u32::try_from(bytes.len()).map_err(|_| FsError::INVALID)?;
        let used = self.used;
        let max = self.limits.max_bytes;
        let node = self.node_mut(ino)?;
        let Body::File(data) = &mut node.body else {
            return Err(FsError::INVALID);
        };
        // O_APPEND writes at the end the filesystem knows, whatever the guest thought it was.
        let offset = if append { data.size() } else { offset };
        let end = offset.checked_add(u64::from(len)).ok_or(FsError::TOO_BIG)?;
        if end > MemoryFs::MAX_FILE_SIZE {
            return Err(FsError::TOO_BIG);
        }
        if len == 0 {
            return Ok(0);
        }
        let cost = data.write_cost(offset, u64::from(len));
        if used.checked_add(cost).is_none_or(|total| total > max) {
            return Err(FsError::NO_SPACE);
        }
        let (added, copied) = data.write_data(offset, bytes);
        let now = SystemTime::now();
        node.mtime = now;
        node.ctime = now;
        self.used += added;
        copied?;
        Ok(len)
    }

    /// Allocates `[offset, offset + length)` of an open file: mode 0 (the size grows to cover
    /// it) or `FALLOC_FL_KEEP_SIZE` (only the part within the size); the space is counted
    /// against the limit like written bytes, so later writes there cannot fail with ENOSPC.
    pub(in crate::fs::memory) fn fallocate(
        &mut self,
        ino: u64,
        fh: u64,
        offset: u64,
        length: u64,
        mode: i32,
    ) -> FsResult<()> {
        let Handle::File { write, .. } = self.file_handle(ino, fh)? else {
            return Err(FsError::BAD_HANDLE);
        };
        if !write {
            return Err(FsError::BAD_HANDLE);
        }
        let grow = match mode {
            0 => true,
            libc::FALLOC_FL_KEEP_SIZE => false,
            _ => return Err(FsError::NOT_SUPPORTED),
        };
        let end = offset.checked_add(length).ok_or(FsError::TOO_BIG)?;
        if length == 0 {
            return Err(FsError::INVALID);
        }
        if grow && end > MemoryFs::MAX_FILE_SIZE {
            return Err(FsError::TOO_BIG);
        }
        let used = self.used;
        let max = self.limits.max_bytes;
        let node = self.node_mut(ino)?;
        let Body::File(data) = &mut node.body else {
            return Err(FsError::INVALID);
        };
        let covered = if grow { end } else { end.min(data.size()) };
        let cost = data.write_cost(offset, covered.saturating_sub(offset));
        if used.checked_add(cost).is_none_or(|total| total > max) {
            return Err(FsError::NO_SPACE);
        }
        let size = data.size();
        let added = data.allocate(offset, end, grow);
        if data.size() != size {
            let now = SystemTime::now();
            node.mtime = now;
            node.ctime = now;
        }
        self.used += added;
        Ok(())
    }

    /// Closes a handle; its inode goes if nothing else holds it.
    pub(in crate::fs::memory) fn release(
        &mut self,
        ino: u64,
        fh: u64,
        directory: bool,
    ) -> FsResult<()> {
        match self.handles.get(&fh) {
            Some(handle)
                if handle.ino() == ino && matches!(handle, Handle::Dir { .. }) == directory => {}
            _ => return Err(FsError::BAD_HANDLE),
        }
        self.handles.remove(&fh);
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.open = node.open.saturating_sub(1);
        }
        self.free_if_unused(ino);
        Ok(())
    }

    // --- directories ---------------------------------------------------------------------

    pub(in crate::fs::memory) fn opendir(&mut self, ino: u64) -> FsResult<u64> {
        self.dir(ino)?;
        self.add_handle(Handle::Dir { ino })
    }

    /// Up to [`READDIR_BATCH`] entries after the cookie `offset`: `.` (cookie 1), `..`
    /// (cookie 2), then the entries in the order they were made.
    pub(in crate::fs::memory) fn readdir(
        &self,
        ino: u64,
        fh: u64,
        offset: u64,
    ) -> FsResult<Vec<DirEntry>> {
        if !matches!(self.handles.get(&fh), Some(&Handle::Dir { ino: of }) if of == ino) {
            return Err(FsError::BAD_HANDLE);
        }
        let dir = self.dir(ino)?;
        let mut entries = Vec::new();
        if offset == 0 {
            entries.push(DirEntry {
                ino: InodeId(ino),
                offset: 1,
                kind: FileKind::Directory,
                name: ".".into(),
            });
        }
        if offset <= 1 {
            entries.push(DirEntry {
                ino: InodeId(dir.parent),
                offset: 2,
                kind: FileKind::Directory,
                name: "..".into(),
            });
        }
        let start = offset.saturating_add(1).max(FIRST_COOKIE);
        for (&cookie, (name, child)) in dir.order.range(start..) {
            if entries.len() >= READDIR_BATCH {
                break;
            }
            let Some(node) = self.nodes.get(child) else {
                continue;
            };
            entries.push(DirEntry {
                ino: InodeId(*child),
                offset: cookie,
                kind: node.kind,
                name: OsString::from_vec(name.to_vec()),
            });
        }
        Ok(entries)
    }

    /// The names in a directory.
    pub(in crate::fs::memory) fn names(&self, ino: u64) -> FsResult<Vec<Vec<u8>>> {
        Ok(self
            .dir(ino)?
            .order
            .values()
            .map(|(name, _)| name.to_vec())
            .collect())
    }

    pub(in crate::fs::memory) fn statfs(&self) -> StatFs {
        const BLOCK: u64 = 4096;
        let limits = self.limits;
        let free = limits.max_bytes.saturating_sub(self.used) / BLOCK;
        StatFs {
            blocks: limits.max_bytes / BLOCK,
            blocks_free: free,
            blocks_available: free,
            files: limits.max_inodes,
            files_free: limits.max_inodes.saturating_sub(self.nodes.len() as u64),
            block_size: BLOCK as u32,
            name_max: NAME_MAX as u32,
        }
    }

    // --- extended attributes -------------------------------------------------------------

    pub(in crate::fs::memory) fn getxattr(&self, ino: u64, name: &[u8]) -> FsResult<Vec<u8>> {
        check_xattr_name(name)?;
        self.node(ino)?
            .xattrs
            .get(name)
            .map(|value| value.to_vec())
            .ok_or(FsError::NO_DATA)
    }

    pub(in crate::fs::memory) fn setxattr(
        &mut self,
        ino: u64,
        name: &[u8],
        value: &[u8],
        flags: i32,
    ) -> FsResult<()> {
        check_xattr_name(name)?;
        if flags & !(libc::XATTR_CREATE | libc::XATTR_REPLACE) != 0 {
            return Err(FsError::INVALID);
        }
        if value.len() > MemoryFs::MAX_XATTR_VALUE {
            return Err(FsError::from_errno(libc::E2BIG));
        }
        let node = self.node(ino)?;
        let old = node.xattrs.get(name);
        match old {
            Some(_) if flags & libc::XATTR_CREATE != 0 => return Err(FsError::EXISTS),
            None if flags & libc::XATTR_REPLACE != 0 => return Err(FsError::NO_DATA),
            None if node.xattrs.len() >= MemoryFs::MAX_XATTRS => return Err(FsError::NO_SPACE),
            _ => {}
        }
        let freed = old.map_or(0, |old| xattr_cost(name, old));
        let needed = xattr_cost(name, value);
        if needed > freed {
            self.charge(needed - freed)?;
        } else {
            self.refund(freed - needed);
        }
        let node = self.node_mut(ino)?;
        node.xattrs.insert(name.into(), value.into());
        node.ctime = SystemTime::now();
        Ok(())
    }

    pub(in crate::fs::memory) fn listxattr(&self, ino: u64) -> FsResult<Vec<Vec<u8>>> {
        Ok(self
            .node(ino)?
            .xattrs
            .keys()
            .map(|name| name.to_vec())
            .collect())
    }

    pub(in crate::fs::memory) fn removexattr(&mut self, ino: u64, name: &[u8]) -> FsResult<()> {
        check_xattr_name(name)?;
        let node = self.node_mut(ino)?;
        let value = node.xattrs.remove(name).ok_or(FsError::NO_DATA)?;
        node.ctime = SystemTime::now();
        self.refund(xattr_cost(name, &value));
        Ok(())
    }

    // --- the host's side -----------------------------------------------------------------

    /// The inode at `path` (components), never following a symlink.
    pub(in crate::fs::memory) fn resolve(&self, path: &[&[u8]]) -> FsResult<u64> {
        path.iter().try_fold(ROOT, |ino, name| {
            self.dir(ino)?.get(name).ok_or(FsError::NOT_FOUND)
        })
    }

    /// The directory at `path`, made (with its parents: 0o755, owned by 0:0) if missing.
    pub(in crate::fs::memory) fn make_dirs(&mut self, path: &[&[u8]]) -> FsResult<u64> {
        let mut ino = ROOT;
        for name in path {
            ino = match self.dir(ino)?.get(name) {
                Some(child) => {
                    self.dir(child)?;
                    child
                }
                None => self.make(ino, name, NewNode::Dir, 0o755, Caller::default())?,
            };
        }
        Ok(ino)
    }

    /// Gives a regular file new contents in place (its open handles see them).
    pub(in crate::fs::memory) fn replace_data(&mut self, ino: u64, data: FileData) -> FsResult<()> {
        let old = match &self.node(ino)?.body {
            Body::File(old) => old.charged(),
            Body::Dir(_) => return Err(FsError::IS_DIRECTORY),
            Body::Symlink(_) => return Err(FsError::LOOP),
            Body::Other => return Err(FsError::INVALID),
        };
        let new = data.charged();
        if new > old {
            self.charge(new - old)?;
        } else {
            self.refund(old - new);
        }
        let now = SystemTime::now();
        let node = self.node_mut(ino)?;
        node.body = Body::File(data);
        node.mtime = now;
        node.ctime = now;
        Ok(())
    }

    /// A regular file's whole contents.
    pub(in crate::fs::memory) fn contents(&self, ino: u64) -> FsResult<Vec<u8>> {
        match &self.node(ino)?.body {
            Body::File(data) => Ok(data.read(0, data.size())),
            Body::Dir(_) => Err(FsError::IS_DIRECTORY),
            Body::Symlink(_) => Err(FsError::LOOP),
            Body::Other => Err(FsError::INVALID),
        }
    }
}

fn resolve(time: TimeOrNow, now: SystemTime) -> SystemTime {
    match time {
        TimeOrNow::At(at) => at,
        TimeOrNow::Now => now,
    }
}
