//! Bounded text for models: output kept head and tail with a note where it was cut, and guest
//! paths resolved against the workspace.

use std::path::{Component, Path, PathBuf};

/// Cuts `text` to at most `max` bytes without splitting a character.
pub(crate) fn truncate_at_char(text: &mut String, max: usize) {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

/// Output kept as its first quarter and last three quarters of `cap` bytes, with the number
/// of bytes dropped between: the start of a build log says what ran, its end what failed.
#[derive(Debug)]
pub(crate) struct HeadTail {
    cap: usize,
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
    total: u64,
}

impl HeadTail {
    pub(crate) fn new(cap: usize) -> HeadTail {
        HeadTail {
            cap,
            head: Vec::new(),
            tail: Default::default(),
            total: 0,
        }
    }

    pub(crate) fn push(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        let head_cap = self.cap / 4;
        if self.head.len() < head_cap {
            let take = bytes.len().min(head_cap - self.head.len());
            self.head.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
        }
        let tail_cap = self.cap - head_cap;
        if bytes.len() >= tail_cap {
            self.tail.clear();
            self.tail.extend(&bytes[bytes.len() - tail_cap..]);
        } else {
            let overflow = (self.tail.len() + bytes.len()).saturating_sub(tail_cap);
            self.tail.drain(..overflow);
            self.tail.extend(bytes);
        }
    }

    /// The kept text (lossy UTF-8), with a note in the middle if bytes were dropped.
    pub(crate) fn render(&self) -> String {
        let kept = self.head.len() + self.tail.len();
        let dropped = self.total - kept as u64;
        let tail: Vec<u8> = self.tail.iter().copied().collect();
        if dropped == 0 {
            let mut all = self.head.clone();
            all.extend_from_slice(&tail);
            return String::from_utf8_lossy(&all).into_owned();
        }
        format!(
            "{}\n[… {} bytes of output cut here; {} bytes in all …]\n{}",
            String::from_utf8_lossy(&self.head),
            count(dropped),
            count(self.total),
            String::from_utf8_lossy(&tail)
        )
    }
}

/// A guest path from a model: absolute, or relative to `workspace`; `.` and `..` resolved
/// lexically (the guest's symlinks are the guest's business: rules guard intent, not escape).
pub(crate) fn resolve(workspace: &Path, path: &str) -> Result<PathBuf, String> {
    if path.is_empty() {
        return Err("the path is empty".into());
    }
    if path.contains('\0') {
        return Err("the path contains a NUL byte".into());
    }
    let joined = workspace.join(path);
    let mut out = PathBuf::from("/");
    for component in joined.components() {
        match component {
            Component::Normal(part) => out.push(part),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(out)
}

/// `n` with thousands separators, for notes (`12,345 bytes`).
pub(crate) fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_and_tail_are_kept_and_the_cut_is_said() {
        let mut out = HeadTail::new(40);
        out.push(b"0123456789");
        assert_eq!(out.render(), "0123456789");
        for _ in 0..100 {
            out.push(b"abcdefghij");
        }
        out.push(b"THE END");
        let text = out.render();
        assert!(
            text.starts_with("0123456789\n[… 977 bytes of output cut here; 1,017 bytes"),
            "{text}"
        );
        assert!(text.ends_with("ghijTHE END"), "{text}");
        assert_eq!(text.lines().last().unwrap().len(), 30);
    }

    #[test]
    fn paths_resolve_against_the_workspace_without_leaving_root() {
        let ws = Path::new("/workspace");
        assert_eq!(
            resolve(ws, "src/a.rs").unwrap(),
            Path::new("/workspace/src/a.rs")
        );
        assert_eq!(resolve(ws, "/etc/../tmp/./x").unwrap(), Path::new("/tmp/x"));
        assert_eq!(resolve(ws, "../../../..").unwrap(), Path::new("/"));
        assert!(resolve(ws, "").is_err());
        assert!(resolve(ws, "a\0b").is_err());
        assert_eq!(count(1234567), "1,234,567");
    }
}
