//! The inode table of a [`PathFs`](super::PathFs): the guest's kernel speaks inode numbers,
//! the filesystem paths. Each inode the kernel holds maps to the path it was found at, with
//! the count of lookups the kernel has not yet given back (`forget`); renames move the paths
//! of an inode and everything under it. Sans-IO.

use std::collections::HashMap;

use crate::fs::InodeId;

struct Node {
    /// Where it is; `None` once it was removed or replaced (the kernel may still hold it: an
    /// open file, which then has no path to be asked about).
    path: Option<String>,
    lookups: u64,
}

/// Inode numbers and the paths they stand for. The root is inode 1, `/`, never forgotten.
/// The table holds only what the guest's kernel holds (each entry a lookup it has not
/// forgotten), at most `max` of them: a guest cannot grow it past that by looking up more
/// (the kernel forgets inodes under memory pressure, and a lookup past the bound fails).
pub(crate) struct Inodes {
    by_ino: HashMap<u64, Node>,
    by_path: HashMap<String, u64>,
    next: u64,
    max: usize,
}

/// The path of `name` in the directory `parent`.
pub(crate) fn join(parent: &str, name: &str) -> String {
    if parent == "/" {
        format!("/{name}")
    } else {
        format!("{parent}/{name}")
    }
}

/// Inode numbers of entries listed but not looked up: derived from their path, with the top
/// bit set so they never collide with the table's (counted from 2).
pub(crate) fn listed_ino(path: &str) -> InodeId {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    path.hash(&mut hasher);
    InodeId(hasher.finish() | 1 << 63)
}

impl Inodes {
    pub(crate) fn new(max: usize) -> Self {
        let root = Node {
            path: Some("/".into()),
            lookups: 1,
        };
        Inodes {
            by_ino: HashMap::from([(InodeId::ROOT.0, root)]),
            by_path: HashMap::from([("/".to_owned(), InodeId::ROOT.0)]),
            next: 2,
            max,
        }
    }

    /// The path of `ino`, if the kernel still holds it and it was not removed since.
    pub(crate) fn path(&self, ino: InodeId) -> Option<String> {
        self.by_ino.get(&ino.0).and_then(|n| n.path.clone())
    }

    /// The inode of `path` if it has one.
    pub(crate) fn existing(&self, path: &str) -> Option<InodeId> {
        self.by_path.get(path).map(|&ino| InodeId(ino))
    }

    /// The inode for `path`, counting one more lookup of it; `None` when the table is full.
    pub(crate) fn remember(&mut self, path: &str) -> Option<InodeId> {
        if let Some(&ino) = self.by_path.get(path) {
            if let Some(node) = self.by_ino.get_mut(&ino) {
                node.lookups += 1;
            }
            return Some(InodeId(ino));
        }
        if self.by_ino.len() >= self.max {
            return None;
        }
        let ino = self.next;
        self.next += 1;
        let node = Node {
            path: Some(path.to_owned()),
            lookups: 1,
        };
        self.by_ino.insert(ino, node);
        self.by_path.insert(path.to_owned(), ino);
        Some(InodeId(ino))
    }

    /// The kernel gives back `count` lookups of `ino`; at none left it is dropped.
    pub(crate) fn forget(&mut self, ino: InodeId, count: u64) {
        if ino == InodeId::ROOT {
            return;
        }
        let Some(node) = self.by_ino.get_mut(&ino.0) else {
            return;
        };
        node.lookups = node.lookups.saturating_sub(count);
        if node.lookups == 0 {
            let path = self.by_ino.remove(&ino.0).and_then(|n| n.path);
            if let Some(path) = path {
                if self.by_path.get(&path) == Some(&ino.0) {
                    self.by_path.remove(&path);
                }
            }
        }
    }

    /// `path` was removed: its inode (if the kernel holds it) keeps no path, and a file made
    /// there later gets an inode of its own.
    pub(crate) fn removed(&mut self, path: &str) {
        if let Some(ino) = self.by_path.remove(path) {
            if let Some(node) = self.by_ino.get_mut(&ino) {
                node.path = None;
            }
        }
    }

    /// `from` was renamed to `to`: it and everything under it now live there. What was at
    /// `to` is gone (its inode, if the kernel holds it, keeps no path).
    pub(crate) fn rename(&mut self, from: &str, to: &str) {
        self.removed(to);
        let prefix = format!("{from}/");
        let moved: Vec<(String, u64)> = self
            .by_path
            .iter()
            .filter(|(path, _)| path.as_str() == from || path.starts_with(&prefix))
            .map(|(path, &ino)| (path.clone(), ino))
            .collect();
        for (old, ino) in moved {
            let new = format!("{to}{}", &old[from.len()..]);
            self.by_path.remove(&old);
            self.by_path.insert(new.clone(), ino);
            if let Some(node) = self.by_ino.get_mut(&ino) {
                node.path = Some(new);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_are_counted_and_forgotten_and_the_table_is_bounded() {
        let mut inodes = Inodes::new(3);
        let a = inodes.remember("/a").unwrap();
        assert_eq!(inodes.remember("/a"), Some(a));
        let b = inodes.remember("/b").unwrap();
        assert_eq!(
            inodes.remember("/c"),
            None,
            "root, /a and /b fill a table of 3"
        );
        inodes.forget(a, 1);
        assert_eq!(
            inodes.path(a).as_deref(),
            Some("/a"),
            "one lookup is still held"
        );
        inodes.forget(a, 1);
        assert_eq!(inodes.path(a), None);
        assert!(
            inodes.remember("/c").is_some(),
            "a forgotten inode makes room"
        );
        inodes.forget(InodeId::ROOT, 10);
        assert_eq!(inodes.path(InodeId::ROOT).as_deref(), Some("/"));
        assert_ne!(b, a);
    }

    #[test]
    fn renames_move_a_subtree_and_removal_leaves_open_inodes_pathless() {
        let mut inodes = Inodes::new(16);
        let dir = inodes.remember("/d").unwrap();
        let file = inodes.remember("/d/f").unwrap();
        let other = inodes.remember("/dx").unwrap();
        let target = inodes.remember("/e").unwrap();
        inodes.rename("/d", "/e");
        assert_eq!(inodes.path(dir).as_deref(), Some("/e"));
        assert_eq!(inodes.path(file).as_deref(), Some("/e/f"));
        assert_eq!(
            inodes.path(other).as_deref(),
            Some("/dx"),
            "a sibling sharing a prefix stays"
        );
        assert_eq!(inodes.path(target), None, "what was at /e is replaced");
        inodes.removed("/e/f");
        assert_eq!(inodes.path(file), None);
        assert_ne!(
            inodes.remember("/e/f"),
            Some(file),
            "a file made there later is new"
        );
    }
}
