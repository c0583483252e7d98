//! Searching a guest directory tree: file names by glob, file contents by regex.
//!
//! The walk and the search run in the guest (guest-init, with ripgrep's own crates), so a
//! search of a large tree costs one request, not one per directory and file. The guest is
//! hostile: a [`SearchFound`] is bounded in hits, bytes per line and bytes overall, and says
//! where it was cut.

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::fs::FileType;
use crate::limits::MAX_TEXT;
use crate::ProtocolError;

/// Hits in one reply.
pub const MAX_SEARCH_HITS: usize = 2000;
/// Bytes of a hit's line that travel; a longer line is cut (and flagged).
pub const MAX_HIT_TEXT: usize = 512;
/// Bytes of paths and lines in one reply: well inside one frame.
pub const MAX_SEARCH_BYTES: usize = 512 * 1024;
/// Globs in one request.
pub const MAX_GLOBS: usize = 32;
/// Context lines before and after a match.
pub const MAX_CONTEXT: u32 = 20;
/// The longest a search may run in the guest.
pub const MAX_SEARCH_MILLIS: u32 = 120_000;

/// What to search for, under which directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SearchSpec {
    /// The directory walked (absolute).
    pub root: ByteBuf,
    /// Only files matching one of these globs (empty: every file). A glob without `/` is
    /// matched against the file name at any depth (`*.rs`), one with `/` against the path
    /// relative to `root` (`src/**/*.rs`); `*` never crosses a `/`.
    pub globs: Vec<String>,
    /// A regex (Rust `regex` syntax) searched for in file contents; `None` lists the files.
    pub pattern: Option<String>,
    /// Match the regex ignoring case.
    pub case_insensitive: bool,
    /// Lines of context before and after each match, at most [`MAX_CONTEXT`].
    pub context: u32,
    /// Only one hit per matching file (its first match), not every matching line.
    pub files_with_matches: bool,
    /// Also walk hidden files and directories (names starting with `.`); `.git` never.
    pub hidden: bool,
    /// Honour `.gitignore`, `.ignore` and `.git/info/exclude`, as git and ripgrep do.
    pub ignore_files: bool,
    /// How deep to walk: 1 lists `root`'s entries only; `None` is unlimited.
    pub max_depth: Option<u32>,
    /// Also report directories (when listing; a content search reports files only).
    pub directories: bool,
    /// Stop after this many hits, at most [`MAX_SEARCH_HITS`].
    pub max_hits: u32,
    /// Stop after this many milliseconds, at most [`MAX_SEARCH_MILLIS`].
    pub time_limit_ms: u32,
}

/// One file (a listing) or one line (a content search).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SearchHit {
    /// Relative to the searched root; never empty.
    pub path: ByteBuf,
    /// The entry's kind.
    pub file_type: FileType,
    /// Size in bytes (a listing); 0 in a content search.
    pub len: u64,
    /// The 1-based line number (a content search); 0 in a listing.
    pub line: u64,
    /// A context line around a match, not a match.
    pub context: bool,
    /// The line without its line ending, at most [`MAX_HIT_TEXT`] bytes; empty in a listing.
    pub text: ByteBuf,
    /// The line was longer than [`MAX_HIT_TEXT`] and was cut.
    pub text_cut: bool,
}

/// Why a search stopped before its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SearchCut {
    /// It reached `max_hits`.
    Hits,
    /// It reached [`MAX_SEARCH_BYTES`].
    Bytes,
    /// It ran out of `time_limit_ms`.
    Time,
}

/// A search's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SearchFound {
    /// In walk order (sorted by name, directory by directory).
    pub hits: Vec<SearchHit>,
    /// Files whose contents were searched (a content search) or entries seen (a listing).
    pub files_seen: u64,
    /// Files skipped as binary (a content search).
    pub binary_skipped: u64,
    /// Set when the search stopped early.
    pub cut: Option<SearchCut>,
}

fn out_of_bounds(field: &'static str, detail: String) -> ProtocolError {
    ProtocolError::OutOfBounds { field, detail }
}

impl SearchSpec {
    /// Checks bounds (both ends call it).
    pub fn validate(&self) -> Result<(), ProtocolError> {
        if self.root.is_empty() || self.root.len() > MAX_TEXT || self.root.contains(&0) {
            return Err(out_of_bounds(
                "search root",
                format!(
                    "{} bytes, must be 1..={MAX_TEXT} without NUL",
                    self.root.len()
                ),
            ));
        }
        if self.globs.len() > MAX_GLOBS {
            return Err(out_of_bounds(
                "search globs",
                format!("{} > {MAX_GLOBS}", self.globs.len()),
            ));
        }
        let texts = self.globs.iter().chain(self.pattern.as_ref());
        if let Some(long) = texts.map(String::len).find(|len| *len > MAX_TEXT) {
            return Err(out_of_bounds(
                "search glob or pattern",
                format!("{long} > {MAX_TEXT} bytes"),
            ));
        }
        if self.context > MAX_CONTEXT {
            return Err(out_of_bounds(
                "search context",
                format!("{} > {MAX_CONTEXT}", self.context),
            ));
        }
        if self.max_hits == 0 || self.max_hits as usize > MAX_SEARCH_HITS {
            return Err(out_of_bounds(
                "search max_hits",
                format!("{}, must be 1..={MAX_SEARCH_HITS}", self.max_hits),
            ));
        }
        if self.time_limit_ms == 0 || self.time_limit_ms > MAX_SEARCH_MILLIS {
            return Err(out_of_bounds(
                "search time limit",
                format!("{} ms, must be 1..={MAX_SEARCH_MILLIS}", self.time_limit_ms),
            ));
        }
        Ok(())
    }
}

impl SearchFound {
    /// Checks bounds (both ends call it): hits, line lengths, total bytes, well-formed paths.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        if self.hits.len() > MAX_SEARCH_HITS {
            return Err(out_of_bounds(
                "search hits",
                format!("{} > {MAX_SEARCH_HITS}", self.hits.len()),
            ));
        }
        let mut bytes = 0usize;
        for hit in &self.hits {
            if hit.path.is_empty() || hit.path.len() > MAX_TEXT || hit.path.contains(&0) {
                return Err(out_of_bounds(
                    "search hit path",
                    format!(
                        "{} bytes, must be 1..={MAX_TEXT} without NUL",
                        hit.path.len()
                    ),
                ));
            }
            // Relative, each component a name: `/x`, `a//b`, `.` and `..` would make the path
            // the host shows point somewhere other than under the searched root.
            if hit
                .path
                .split(|b| *b == b'/')
                .any(|part| part.is_empty() || part == b"." || part == b"..")
            {
                return Err(out_of_bounds(
                    "search hit path",
                    "must be relative to the root, each component a name".into(),
                ));
            }
            if hit.text.len() > MAX_HIT_TEXT {
                return Err(out_of_bounds(
                    "search hit text",
                    format!("{} > {MAX_HIT_TEXT}", hit.text.len()),
                ));
            }
            bytes += hit.path.len() + hit.text.len();
        }
        if bytes > MAX_SEARCH_BYTES {
            return Err(out_of_bounds(
                "search reply",
                format!("{bytes} > {MAX_SEARCH_BYTES} bytes"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> SearchSpec {
        SearchSpec {
            root: ByteBuf::from(b"/work".to_vec()),
            globs: vec!["*.rs".into()],
            pattern: Some("fn main".into()),
            case_insensitive: false,
            context: 2,
            files_with_matches: false,
            hidden: false,
            ignore_files: true,
            max_depth: None,
            directories: false,
            max_hits: 100,
            time_limit_ms: 10_000,
        }
    }

    fn hit(path: &[u8], text_len: usize) -> SearchHit {
        SearchHit {
            path: ByteBuf::from(path.to_vec()),
            file_type: FileType::File,
            len: 0,
            line: 1,
            context: false,
            text: ByteBuf::from(vec![b'x'; text_len]),
            text_cut: false,
        }
    }

    fn found(hits: Vec<SearchHit>) -> SearchFound {
        SearchFound {
            hits,
            files_seen: 1,
            binary_skipped: 0,
            cut: None,
        }
    }

    #[test]
    fn a_spec_is_bounded() {
        assert!(spec().validate().is_ok());
        let broken: [fn(&mut SearchSpec); 6] = [
            |s| s.root = ByteBuf::new(),
            |s| s.globs = vec!["*".into(); MAX_GLOBS + 1],
            |s| s.pattern = Some("a".repeat(MAX_TEXT + 1)),
            |s| s.context = MAX_CONTEXT + 1,
            |s| s.max_hits = 0,
            |s| s.time_limit_ms = MAX_SEARCH_MILLIS + 1,
        ];
        for breaks in broken {
            let mut s = spec();
            breaks(&mut s);
            assert!(s.validate().is_err(), "{s:?}");
        }
    }

    /// A forged reply cannot grow past its bounds: long lines, absolute or empty paths, too
    /// many hits, too many bytes in all.
    #[test]
    fn a_reply_is_bounded() {
        assert!(found(vec![hit(b"src/main.rs", MAX_HIT_TEXT)])
            .validate()
            .is_ok());
        assert!(found(vec![hit(b"a", MAX_HIT_TEXT + 1)]).validate().is_err());
        assert!(found(vec![hit(b"/etc/passwd", 1)]).validate().is_err());
        for forged in [&b"../etc/shadow"[..], b"a/../../b", b"a//b", b"./a", b"a/"] {
            assert!(
                found(vec![hit(forged, 1)]).validate().is_err(),
                "{forged:?}"
            );
        }
        assert!(found(vec![hit(b"a/.b/..c", 1)]).validate().is_ok());
        assert!(found(vec![hit(b"", 1)]).validate().is_err());
        assert!(found(vec![hit(b"a", 0); MAX_SEARCH_HITS + 1])
            .validate()
            .is_err());
        let long_path = vec![b'p'; MAX_TEXT];
        let heavy = vec![hit(&long_path, MAX_HIT_TEXT); MAX_SEARCH_BYTES / MAX_TEXT];
        assert!(found(heavy).validate().is_err());
    }
}
