//! Searching guest directory trees ([`Instance::search`]): one request, walked and searched by
//! guest-init with ripgrep's crates (`.gitignore`-aware), bounded by the protocol.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::request::Target;
use crate::error::Result;
use crate::instance::Instance;
use crate::protocol::fs::{FileType, FsOk, FsOp};
use crate::protocol::search::{SearchFound, SearchSpec, MAX_CONTEXT, MAX_SEARCH_HITS};

pub use crate::protocol::search::SearchCut;

/// What [`Instance::search`] looks for: files by glob ([`Search::files`]) or lines by regex
/// ([`Search::lines`]), honouring `.gitignore` unless told otherwise.
///
/// ```no_run
/// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
/// use krunbox::Search;
/// let found = vm
///     .search("/workspace", &Search::lines(r"fn \w+").glob("*.rs").context(1))
///     .await?;
/// for hit in &found.hits {
///     println!("{}:{}: {}", hit.path.display(), hit.line, hit.text);
/// }
/// if let Some(cut) = found.cut {
///     println!("(stopped early: {cut:?})");
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Search {
    spec: SearchSpec,
    time_limit: Duration,
}

/// One file (a listing) or one line (a content search).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SearchHit {
    /// Relative to the searched directory.
    pub path: PathBuf,
    /// The entry's kind (never followed: a symlink is a symlink).
    pub file_type: FileType,
    /// Size in bytes (a listing); 0 in a content search.
    pub len: u64,
    /// 1-based line number (a content search); 0 in a listing.
    pub line: u64,
    /// A context line around a match rather than a match.
    pub context: bool,
    /// The line (lossy UTF-8, without its line ending), at most 512 bytes of it.
    pub text: String,
    /// The line was longer and `text` holds its start.
    pub text_cut: bool,
}

/// What [`Instance::search`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SearchResults {
    /// In walk order: sorted by name, directory by directory.
    pub hits: Vec<SearchHit>,
    /// Files searched (a content search) or entries seen (a listing).
    pub files_seen: u64,
    /// Files skipped because they hold binary data (a NUL byte).
    pub binary_skipped: u64,
    /// Why the search stopped early, if it did: more hits, more bytes or more time than allowed.
    pub cut: Option<SearchCut>,
}

impl Search {
    fn new(pattern: Option<String>) -> Search {
        Search {
            spec: SearchSpec {
                root: Default::default(),
                globs: Vec::new(),
                pattern,
                case_insensitive: false,
                context: 0,
                files_with_matches: false,
                hidden: false,
                ignore_files: true,
                max_depth: None,
                directories: false,
                max_hits: 1000,
                time_limit_ms: 0,
            },
            time_limit: Duration::from_secs(30),
        }
    }

    /// Lists files (not directories, unless [`Search::directories`]).
    pub fn files() -> Search {
        Search::new(None)
    }

    /// Finds lines matching `regex` (Rust `regex` syntax, as ripgrep's).
    pub fn lines(regex: impl Into<String>) -> Search {
        Search::new(Some(regex.into()))
    }

    /// Only files matching `glob`; may be given several times (a file matching any is taken).
    /// A glob without `/` matches the file name at any depth (`*.rs`); one with `/` matches
    /// the path from the searched directory (`src/**/*.rs`); `*` never crosses a `/`.
    pub fn glob(mut self, glob: impl Into<String>) -> Search {
        self.spec.globs.push(glob.into());
        self
    }

    /// Matches ignoring case.
    pub fn case_insensitive(mut self, yes: bool) -> Search {
        self.spec.case_insensitive = yes;
        self
    }

    /// Lines of context before and after each match (at most 20).
    pub fn context(mut self, lines: u32) -> Search {
        self.spec.context = lines.min(MAX_CONTEXT);
        self
    }

    /// One hit per matching file (its first matching line) instead of every line.
    pub fn files_with_matches(mut self, yes: bool) -> Search {
        self.spec.files_with_matches = yes;
        self
    }

    /// Also walks hidden entries (`.name`); `.git` is never walked.
    pub fn hidden(mut self, yes: bool) -> Search {
        self.spec.hidden = yes;
        self
    }

    /// Honours `.gitignore`, `.ignore` and `.git/info/exclude` (the default: yes).
    pub fn ignore_files(mut self, yes: bool) -> Search {
        self.spec.ignore_files = yes;
        self
    }

    /// Walks at most `depth` levels: 1 lists the directory's own entries.
    pub fn max_depth(mut self, depth: u32) -> Search {
        self.spec.max_depth = Some(depth);
        self
    }

    /// Lists directories too (a listing only).
    pub fn directories(mut self, yes: bool) -> Search {
        self.spec.directories = yes;
        self
    }

    /// Stops after `hits` hits (default 1,000; at most 2,000).
    pub fn max_hits(mut self, hits: u32) -> Search {
        self.spec.max_hits = hits.clamp(1, MAX_SEARCH_HITS as u32);
        self
    }

    /// Stops after this long in the guest (default 30 s; at most 120 s and never past the
    /// instance's [`Limits::request_timeout`](crate::Limits::request_timeout)).
    pub fn time_limit(mut self, limit: Duration) -> Search {
        self.time_limit = limit;
        self
    }
}

impl Instance {
    /// Walks the guest directory `root` and lists its files or searches their lines, as
    /// described by `search`; the walk runs in the guest, in one request. Results are bounded
    /// (hits, 512 bytes a line, 512 KiB in all, time) and [`SearchResults::cut`] says when a
    /// bound stopped the search. Files over 64 MiB and binary files are not searched.
    ///
    /// Fails with [`FsErrorKind::NotADirectory`](crate::FsErrorKind::NotADirectory) if
    /// `root` is not a directory and [`FsErrorKind::InvalidInput`](crate::FsErrorKind) for a
    /// bad glob or regex (the message says which). See [`Search`] for an example.
    pub async fn search(&self, root: impl AsRef<Path>, search: &Search) -> Result<SearchResults> {
        let target = Target::new(self, "search", root.as_ref())?;
        // The guest stops a little before the host would give up on the reply.
        let ceiling = target
            .control
            .limits
            .request_timeout
            .saturating_sub(Duration::from_millis(500))
            .max(Duration::from_millis(1));
        let millis = search.time_limit.min(ceiling).as_millis();
        let mut spec = search.spec.clone();
        spec.root = target.wire_path();
        spec.time_limit_ms =
            millis.clamp(1, u128::from(crate::protocol::search::MAX_SEARCH_MILLIS)) as u32;
        match target.call(FsOp::Search(spec)).await? {
            FsOk::Found(found) => Ok(SearchResults::from_wire(found)),
            other => Err(target.unexpected("Found", &other)),
        }
    }
}

impl SearchResults {
    fn from_wire(found: SearchFound) -> SearchResults {
        let hits = found
            .hits
            .into_iter()
            .map(|hit| SearchHit {
                path: PathBuf::from(OsString::from_vec(hit.path.into_vec())),
                file_type: hit.file_type,
                len: hit.len,
                line: hit.line,
                context: hit.context,
                text: String::from_utf8_lossy(&hit.text).into_owned(),
                text_cut: hit.text_cut,
            })
            .collect();
        SearchResults {
            hits,
            files_seen: found.files_seen,
            binary_skipped: found.binary_skipped,
            cut: found.cut,
        }
    }
}
