//! Searches of the guest's files for the host ([`FsOp::Search`](krunbox_protocol::fs::FsOp)):
//! a walk that honours `.gitignore` (ripgrep's `ignore` crate), file filters by glob
//! (`globset`), and a line search by regex (`grep-searcher`, `grep-regex`), all bounded by the
//! request's hit count and time limit and by the protocol's reply size.

use std::ffi::OsStr;
use std::fs::OpenOptions;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};
use grep_regex::{RegexMatcher, RegexMatcherBuilder};
use grep_searcher::{
    BinaryDetection, Searcher, SearcherBuilder, Sink, SinkContext, SinkContextKind, SinkMatch,
};
use ignore::WalkBuilder;
use krunbox_protocol::fs::{FileType, FsError, FsOk};
use krunbox_protocol::limits::MAX_TEXT;
use krunbox_protocol::search::{
    SearchCut, SearchFound, SearchHit, SearchSpec, MAX_HIT_TEXT, MAX_SEARCH_BYTES,
};
use serde_bytes::ByteBuf;

use crate::files::{error, file_type, invalid, open_regular};

/// Files larger than this are not searched (a content search reads every byte).
const MAX_SEARCHED_FILE: u64 = 64 * 1024 * 1024;
/// Memory the line searcher may use for one line (a minified file is one long line).
const LINE_HEAP: usize = 16 * 1024 * 1024;
/// Compiled regex size: a pathological pattern fails instead of exhausting guest memory.
const REGEX_SIZE: usize = 16 * 1024 * 1024;

/// Runs one search to completion (or to its first bound) on the calling thread.
pub fn search(spec: SearchSpec) -> Result<FsOk, FsError> {
    let root = PathBuf::from(OsStr::from_bytes(&spec.root));
    let meta = std::fs::metadata(&root).map_err(|e| error("search", &root, &e))?;
    if !meta.is_dir() {
        return Err(FsError {
            kind: krunbox_protocol::fs::FsErrorKind::NotADirectory,
            errno: libc::ENOTDIR,
            message: format!("search {}: not a directory", root.display()),
        });
    }
    let filter = Filter::new(&spec.globs).map_err(|detail| invalid("search", &root, &detail))?;
    let matcher = match &spec.pattern {
        Some(pattern) => Some(
            RegexMatcherBuilder::new()
                .case_insensitive(spec.case_insensitive)
                .size_limit(REGEX_SIZE)
                .dfa_size_limit(REGEX_SIZE)
                .build(pattern)
                .map_err(|e| invalid("search", &root, &format!("regex: {e}")))?,
        ),
        None => None,
    };
    let mut found = Found::new(&spec);
    for entry in walker(&root, &spec).build() {
        if found.out_of_time() {
            break;
        }
        // Unreadable directories and vanished entries are skipped, as ripgrep skips them.
        let Ok(entry) = entry else { continue };
        let Some(kind) = entry.file_type() else {
            continue;
        };
        let Ok(relative) = entry.path().strip_prefix(&root) else {
            continue;
        };
        if relative.as_os_str().is_empty() || relative.as_os_str().len() > MAX_TEXT {
            continue;
        }
        if !filter.admits(relative) {
            continue;
        }
        let keep_going = match &matcher {
            None if kind.is_dir() && !spec.directories => true,
            None => {
                let len = entry.metadata().map(|m| m.len()).unwrap_or(0);
                found.files_seen += 1;
                found.push(relative, file_type(kind), len, 0, false, b"")
            }
            Some(_) if !kind.is_file() => true,
            Some(matcher) => found.search_file(matcher, entry.path(), relative, &spec),
        };
        if !keep_going {
            break;
        }
    }
    Ok(FsOk::Found(found.finish()))
}

fn walker(root: &Path, spec: &SearchSpec) -> WalkBuilder {
    let mut walk = WalkBuilder::new(root);
    walk.hidden(!spec.hidden)
        .ignore(spec.ignore_files)
        .git_ignore(spec.ignore_files)
        .git_exclude(spec.ignore_files)
        .parents(spec.ignore_files)
        // The user's global gitignore is the guest's, not the project's: leave it out.
        .git_global(false)
        // A checkout copied without its `.git` still means its `.gitignore`.
        .require_git(false)
        .follow_links(false)
        .max_depth(spec.max_depth.map(|d| d as usize))
        .max_filesize(spec.pattern.as_ref().map(|_| MAX_SEARCHED_FILE))
        .sort_by_file_name(|a, b| a.cmp(b))
        // `.git` is git's, not the project's; the kernel's own trees (a walk from `/`) hold
        // no files to search and endless ones to read.
        .filter_entry(|entry| {
            entry.file_name() != ".git"
                && !matches!(entry.path().to_str(), Some("/proc" | "/sys" | "/dev"))
        });
    walk
}

/// Which files a search looks at: globs without `/` match the name, with `/` the relative path.
struct Filter {
    names: GlobSet,
    paths: GlobSet,
    any: bool,
}

impl Filter {
    fn new(globs: &[String]) -> Result<Filter, String> {
        let mut names = GlobSetBuilder::new();
        let mut paths = GlobSetBuilder::new();
        for glob in globs {
            let trimmed = glob.trim_start_matches("./");
            let compiled = GlobBuilder::new(trimmed)
                .literal_separator(true)
                .build()
                .map_err(|e| format!("glob {glob:?}: {e}"))?;
            if trimmed.contains('/') {
                paths.add(compiled);
            } else {
                names.add(compiled);
            }
        }
        let build = |set: GlobSetBuilder| set.build().map_err(|e| format!("globs: {e}"));
        Ok(Filter {
            names: build(names)?,
            paths: build(paths)?,
            any: globs.is_empty(),
        })
    }

    fn admits(&self, relative: &Path) -> bool {
        self.any
            || relative
                .file_name()
                .is_some_and(|name| self.names.is_match(name))
            || self.paths.is_match(relative)
    }
}

/// The hits so far and the bounds they count against.
struct Found {
    hits: Vec<SearchHit>,
    bytes: usize,
    max_hits: usize,
    deadline: Instant,
    files_seen: u64,
    binary_skipped: u64,
    cut: Option<SearchCut>,
}

impl Found {
    fn new(spec: &SearchSpec) -> Found {
        Found {
            hits: Vec::new(),
            bytes: 0,
            max_hits: spec.max_hits as usize,
            deadline: Instant::now() + Duration::from_millis(spec.time_limit_ms.into()),
            files_seen: 0,
            binary_skipped: 0,
            cut: None,
        }
    }

    fn out_of_time(&mut self) -> bool {
        if Instant::now() >= self.deadline {
            self.cut = Some(SearchCut::Time);
        }
        self.cut.is_some()
    }

    /// Records one hit; false once a bound is reached (the hit is then not recorded).
    fn push(
        &mut self,
        path: &Path,
        file_type: FileType,
        len: u64,
        line: u64,
        context: bool,
        text: &[u8],
    ) -> bool {
        let text = strip_line_ending(text);
        let kept = cut_text(text);
        let path = path.as_os_str().as_bytes();
        if self.hits.len() >= self.max_hits {
            self.cut = Some(SearchCut::Hits);
            return false;
        }
        if self.bytes + path.len() + kept.len() > MAX_SEARCH_BYTES {
            self.cut = Some(SearchCut::Bytes);
            return false;
        }
        self.bytes += path.len() + kept.len();
        self.hits.push(SearchHit {
            path: ByteBuf::from(path.to_vec()),
            file_type,
            len,
            line,
            context,
            text: ByteBuf::from(kept.to_vec()),
            text_cut: kept.len() < text.len(),
        });
        true
    }

    /// Searches one file's lines; false once a bound is reached.
    fn search_file(
        &mut self,
        matcher: &RegexMatcher,
        path: &Path,
        relative: &Path,
        spec: &SearchSpec,
    ) -> bool {
        // Opened as file reads are: without blocking, and only if it is still a regular file
        // (the walk's type is from before; a FIFO swapped in would hang the search).
        let Ok(file) = open_regular(path, OpenOptions::new().read(true)) else {
            return true;
        };
        self.files_seen += 1;
        let mut searcher = searcher(spec.context as usize);
        let mut sink = Lines {
            found: self,
            relative,
            first_only: spec.files_with_matches,
            stopped: false,
        };
        // An unreadable file or an overlong line ends this file's search, not the whole one.
        let _ = searcher.search_file(matcher, &file, &mut sink);
        !sink.stopped
    }

    fn finish(self) -> SearchFound {
        SearchFound {
            hits: self.hits,
            files_seen: self.files_seen,
            binary_skipped: self.binary_skipped,
            cut: self.cut,
        }
    }
}

fn searcher(context: usize) -> Searcher {
    SearcherBuilder::new()
        .line_number(true)
        .before_context(context)
        .after_context(context)
        // A NUL byte means binary: the file is skipped (and counted), as ripgrep does.
        .binary_detection(BinaryDetection::quit(0))
        .heap_limit(Some(LINE_HEAP))
        .build()
}

/// The searcher's callbacks for one file: matches and context lines become hits.
struct Lines<'a> {
    found: &'a mut Found,
    relative: &'a Path,
    first_only: bool,
    /// A bound was reached: the whole search stops.
    stopped: bool,
}

impl Lines<'_> {
    fn record(&mut self, line: Option<u64>, context: bool, text: &[u8]) -> bool {
        if self.found.out_of_time() {
            self.stopped = true;
            return false;
        }
        let line = line.unwrap_or(0);
        if !self
            .found
            .push(self.relative, FileType::File, 0, line, context, text)
        {
            self.stopped = true;
            return false;
        }
        true
    }
}

impl Sink for Lines<'_> {
    type Error = std::io::Error;

    fn matched(&mut self, _: &Searcher, found: &SinkMatch<'_>) -> Result<bool, std::io::Error> {
        let first_line = found.lines().next().unwrap_or(b"");
        let more = self.record(found.line_number(), false, first_line);
        Ok(more && !self.first_only)
    }

    fn context(&mut self, _: &Searcher, line: &SinkContext<'_>) -> Result<bool, std::io::Error> {
        if self.first_only || matches!(line.kind(), SinkContextKind::Other) {
            return Ok(true);
        }
        Ok(self.record(line.line_number(), true, line.bytes()))
    }

    fn binary_data(&mut self, _: &Searcher, _offset: u64) -> Result<bool, std::io::Error> {
        self.found.binary_skipped += 1;
        Ok(false)
    }
}

fn strip_line_ending(text: &[u8]) -> &[u8] {
    let text = text.strip_suffix(b"\n").unwrap_or(text);
    text.strip_suffix(b"\r").unwrap_or(text)
}

/// At most [`MAX_HIT_TEXT`] bytes, not ending inside a UTF-8 character.
fn cut_text(text: &[u8]) -> &[u8] {
    if text.len() <= MAX_HIT_TEXT {
        return text;
    }
    let mut end = MAX_HIT_TEXT;
    // Back off continuation bytes (0b10xxxxxx) so a multi-byte character is not split.
    while end > MAX_HIT_TEXT - 4 && text[end] & 0xC0 == 0x80 {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(root: &Path) -> SearchSpec {
        SearchSpec {
            root: ByteBuf::from(root.as_os_str().as_bytes().to_vec()),
            globs: Vec::new(),
            pattern: None,
            case_insensitive: false,
            context: 0,
            files_with_matches: false,
            hidden: false,
            ignore_files: true,
            max_depth: None,
            directories: false,
            max_hits: 100,
            time_limit_ms: 10_000,
        }
    }

    fn found(spec: SearchSpec) -> SearchFound {
        match search(spec) {
            Ok(FsOk::Found(found)) => {
                found
                    .validate()
                    .expect("a reply inside the protocol's bounds");
                found
            }
            other => panic!("{other:?}"),
        }
    }

    fn paths(found: &SearchFound) -> Vec<String> {
        found
            .hits
            .iter()
            .map(|hit| String::from_utf8_lossy(&hit.path).into_owned())
            .collect()
    }

    fn tree() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let write = |path: &str, text: &str| {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        write(".gitignore", "target/\n*.log\n");
        write("src/main.rs", "fn main() {\n    println!(\"hi\");\n}\n");
        write("src/lib.rs", "pub fn answer() -> u32 {\n    42\n}\n");
        write("target/debug/out.rs", "fn main() {}\n");
        write("notes.log", "fn main in a log\n");
        write(".hidden/x.rs", "fn main() {}\n");
        std::fs::write(dir.path().join("blob.bin"), b"fn main\0\x01\x02").unwrap();
        dir
    }

    #[test]
    fn a_listing_honours_gitignore_and_hidden_files() {
        let dir = tree();
        let all = found(spec(dir.path()));
        assert_eq!(paths(&all), ["blob.bin", "src/lib.rs", "src/main.rs"]);
        let mut everything = spec(dir.path());
        everything.ignore_files = false;
        everything.hidden = true;
        let listed = paths(&found(everything));
        assert!(
            listed.contains(&"target/debug/out.rs".to_string()),
            "{listed:?}"
        );
        assert!(listed.contains(&".hidden/x.rs".to_string()), "{listed:?}");
    }

    #[test]
    fn globs_match_names_anywhere_and_paths_from_the_root() {
        let dir = tree();
        let mut by_name = spec(dir.path());
        by_name.globs = vec!["*.rs".into()];
        assert_eq!(paths(&found(by_name)), ["src/lib.rs", "src/main.rs"]);
        let mut by_path = spec(dir.path());
        by_path.globs = vec!["src/m*.rs".into()];
        assert_eq!(paths(&found(by_path)), ["src/main.rs"]);
        let mut bad = spec(dir.path());
        bad.globs = vec!["[".into()];
        assert!(search(bad).is_err());
    }

    #[test]
    fn a_content_search_reports_lines_with_context_and_skips_binary_files() {
        let dir = tree();
        let mut grep = spec(dir.path());
        grep.pattern = Some("FN MAIN".into());
        grep.case_insensitive = true;
        grep.context = 1;
        let result = found(grep);
        let lines: Vec<(String, u64, bool)> = result
            .hits
            .iter()
            .map(|h| {
                (
                    String::from_utf8_lossy(&h.path).into_owned(),
                    h.line,
                    h.context,
                )
            })
            .collect();
        assert_eq!(
            lines,
            [
                ("src/main.rs".into(), 1, false),
                ("src/main.rs".into(), 2, true)
            ]
        );
        assert_eq!(result.binary_skipped, 1);
    }

    #[test]
    fn bounds_cut_the_search_and_say_so() {
        let dir = tempfile::tempdir().unwrap();
        let many: String = (0..50).map(|i| format!("match {i}\n")).collect();
        std::fs::write(dir.path().join("a.txt"), many).unwrap();
        std::fs::write(dir.path().join("long.txt"), "x".repeat(10_000) + "match").unwrap();
        let mut grep = spec(dir.path());
        grep.pattern = Some("match".into());
        grep.max_hits = 10;
        let result = found(grep.clone());
        assert_eq!(result.hits.len(), 10);
        assert_eq!(result.cut, Some(SearchCut::Hits));
        grep.globs = vec!["long.txt".into()];
        let long = found(grep);
        assert!(long.hits[0].text_cut && long.hits[0].text.len() == MAX_HIT_TEXT);
    }

    #[test]
    fn a_bad_regex_is_invalid_input() {
        let dir = tree();
        let mut grep = spec(dir.path());
        grep.pattern = Some("(".into());
        let err = search(grep).unwrap_err();
        assert_eq!(err.kind, krunbox_protocol::fs::FsErrorKind::InvalidInput);
        assert!(err.message.contains("regex"), "{}", err.message);
    }
}
