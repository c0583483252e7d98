//! The tree's invariants, checked by the tests after what they do.

use super::*;

impl Tree {
    /// Checks every invariant the tree keeps; panics with the first one broken.
    pub(in crate::fs::memory) fn check(&self) {
        let mut names: HashMap<u64, u32> = HashMap::new();
        let mut subdirs: HashMap<u64, u32> = HashMap::new();
        let mut used = 0;
        for (&ino, node) in &self.nodes {
            used += node.cost();
            if let Body::File(data) = &node.body {
                assert_eq!(data.charged(), data.recount(), "inode {ino}'s buffers");
                assert!(
                    !data.has_bytes_past_size(),
                    "inode {ino} has bytes past its size"
                );
            }
            if let Body::Dir(dir) = &node.body {
                assert_eq!(dir.names.len(), dir.order.len(), "inode {ino}'s maps");
                for (name, &(child, cookie)) in &dir.names {
                    assert_eq!(dir.order.get(&cookie), Some(&(name.clone(), child)));
                    assert!(cookie < dir.next_cookie && cookie >= FIRST_COOKIE);
                    used += entry_cost(name);
                    *names.entry(child).or_default() += 1;
                    let child_node = self.nodes.get(&child).expect("an entry's inode exists");
                    if let Body::Dir(child_dir) = &child_node.body {
                        assert_eq!(child_dir.parent, ino, "inode {child}'s parent");
                        *subdirs.entry(ino).or_default() += 1;
                    }
                }
            }
        }
        assert_eq!(used, self.used, "bytes used");
        assert!(self.used <= self.limits.max_bytes);
        let mut open: HashMap<u64, u64> = HashMap::new();
        for handle in self.handles.values() {
            *open.entry(handle.ino()).or_default() += 1;
        }
        for (&ino, node) in &self.nodes {
            let named = names.get(&ino).copied().unwrap_or(0);
            assert_eq!(
                node.open,
                open.get(&ino).copied().unwrap_or(0),
                "inode {ino}'s handles"
            );
            if node.kind == FileKind::Directory {
                if ino == ROOT || named > 0 {
                    assert_eq!(named.max(1), 1, "directory {ino} has one name");
                    let expected = 2 + subdirs.get(&ino).copied().unwrap_or(0);
                    assert_eq!(node.nlink, expected, "directory {ino}'s link count");
                } else {
                    assert_eq!(node.nlink, 0, "removed directory {ino}");
                }
            } else {
                assert_eq!(node.nlink, named, "inode {ino}'s link count");
            }
            if ino != ROOT && named == 0 {
                assert!(
                    node.lookups > 0 || node.open > 0,
                    "inode {ino} is unreachable yet kept"
                );
            }
        }
    }
}
