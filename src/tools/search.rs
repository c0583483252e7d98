//! `ls`, `glob` and `grep`: one guest-side search each ([`Instance::search`]), rendered as
//! lines a model reads, bounded, with a note when cut.

use std::path::Path;

use super::call::{Glob, Grep, GrepOutput, Ls};
use super::spec::ToolResult;
use super::text::count;
use crate::{FileType, Instance, Search, SearchCut, SearchResults};

/// Entries `ls` and files `glob` return at most.
const MAX_LISTED: u32 = 1000;
/// Lines `grep` returns at most (matches and context).
const MAX_GREP_LINES: u32 = 500;
/// Deepest `ls`.
const MAX_LS_DEPTH: u32 = 5;

/// Drops the hits under `dir` that a permission rule keeps from the model; says how many.
fn withhold(
    found: &mut SearchResults,
    dir: &Path,
    hidden: &(dyn Fn(&Path) -> bool + Sync),
) -> String {
    let before = found.hits.len();
    found.hits.retain(|hit| !hidden(&dir.join(&hit.path)));
    match before - found.hits.len() {
        0 => String::new(),
        n => format!("[{n} results withheld by permission rules]\n"),
    }
}

pub(crate) async fn ls(
    vm: &Instance,
    dir: &Path,
    args: &Ls,
    cap: usize,
    hidden: &(dyn Fn(&Path) -> bool + Sync),
) -> ToolResult {
    let depth = args.depth.unwrap_or(1).clamp(1, MAX_LS_DEPTH);
    let search = Search::files()
        .directories(true)
        .max_depth(depth)
        .hidden(args.hidden)
        .max_hits(MAX_LISTED);
    let mut found = match vm.search(dir, &search).await {
        Ok(found) => found,
        Err(err) => return ToolResult::error(err.to_string()),
    };
    let withheld = withhold(&mut found, dir, hidden);
    if found.hits.is_empty() && found.cut.is_none() {
        return ToolResult::ok(format!(
            "{} is empty (or all its entries are ignored)\n{withheld}",
            dir.display()
        ));
    }
    let lines = found.hits.iter().map(|hit| {
        let path = hit.path.display();
        match hit.file_type {
            FileType::Dir => format!("{path}/"),
            FileType::Symlink => format!("{path}@"),
            FileType::File => format!("{path} ({} bytes)", count(hit.len)),
            FileType::Other => format!("{path} (not a regular file)"),
        }
    });
    let narrow = "list a subdirectory or a smaller depth";
    ToolResult::ok(bounded(lines, cap, &found, "entries", narrow) + &withheld)
}

pub(crate) async fn glob(
    vm: &Instance,
    dir: &Path,
    args: &Glob,
    cap: usize,
    hidden: &(dyn Fn(&Path) -> bool + Sync),
) -> ToolResult {
    // An absolute pattern under the directory searched is the same pattern relative to it.
    let pattern = match args.pattern.strip_prefix('/') {
        None => args.pattern.as_str(),
        Some(_) => match Path::new(&args.pattern).strip_prefix(dir) {
            Ok(relative) => relative.to_str().unwrap_or(&args.pattern),
            Err(_) => {
                return ToolResult::error(format!(
                    "the pattern {:?} is absolute and not under {}: give a pattern relative to \
                     `path` (and set `path` to the directory to search)",
                    args.pattern,
                    dir.display()
                ))
            }
        },
    };
    let search = Search::files().glob(pattern).max_hits(MAX_LISTED);
    let mut found = match vm.search(dir, &search).await {
        Ok(found) => found,
        Err(err) => return ToolResult::error(err.to_string()),
    };
    let withheld = withhold(&mut found, dir, hidden);
    if found.hits.is_empty() && found.cut.is_none() {
        return ToolResult::ok(format!(
            "no files under {} match {:?}\n{withheld}",
            dir.display(),
            args.pattern
        ));
    }
    let lines = found
        .hits
        .iter()
        .map(|hit| dir.join(&hit.path).display().to_string());
    let narrow = "use a narrower pattern or path";
    ToolResult::ok(bounded(lines, cap, &found, "files", narrow) + &withheld)
}

pub(crate) async fn grep(
    vm: &Instance,
    dir: &Path,
    args: &Grep,
    cap: usize,
    hidden: &(dyn Fn(&Path) -> bool + Sync),
) -> ToolResult {
    let mut search = Search::lines(&args.pattern)
        .case_insensitive(args.case_insensitive)
        .context(args.context.unwrap_or(0))
        .files_with_matches(args.output == GrepOutput::Files)
        .max_hits(MAX_GREP_LINES);
    if let Some(glob) = &args.glob {
        search = search.glob(glob);
    }
    let mut found = match vm.search(dir, &search).await {
        Ok(found) => found,
        Err(err) => return ToolResult::error(err.to_string()),
    };
    let withheld = withhold(&mut found, dir, hidden);
    if found.hits.is_empty() && found.cut.is_none() {
        return ToolResult::ok(format!(
            "no matches for {:?} under {} ({} files searched{})\n{withheld}",
            args.pattern,
            dir.display(),
            found.files_seen,
            binary_note(&found)
        ));
    }
    let lines = found.hits.iter().map(|hit| {
        let path = dir.join(&hit.path);
        if args.output == GrepOutput::Files {
            return path.display().to_string();
        }
        let sep = if hit.context { '-' } else { ':' };
        let cut = if hit.text_cut { " […]" } else { "" };
        format!("{}{sep}{}{sep}{}{cut}", path.display(), hit.line, hit.text)
    });
    let mut text = bounded(
        lines,
        cap,
        &found,
        "lines",
        "narrow the pattern, path or glob",
    );
    if found.binary_skipped > 0 {
        text += &format!("[{}]\n", binary_note(&found).trim_start_matches(", "));
    }
    ToolResult::ok(text + &withheld)
}

fn binary_note(found: &SearchResults) -> String {
    match found.binary_skipped {
        0 => String::new(),
        n => format!(", {n} binary files skipped"),
    }
}

/// The lines, one per hit, cut at `cap` bytes at a line's end, with a note saying what was
/// cut and how to narrow the request.
fn bounded(
    lines: impl Iterator<Item = String>,
    cap: usize,
    found: &SearchResults,
    what: &str,
    narrow: &str,
) -> String {
    let mut out = String::new();
    let mut shown = 0usize;
    for line in lines {
        if out.len() + line.len() + 1 > cap && shown > 0 {
            out += &format!(
                "[cut at {} bytes: {} of {}{} {what} shown; {narrow}]\n",
                count(out.len() as u64),
                shown,
                found.hits.len(),
                if found.cut.is_some() { "+" } else { "" }
            );
            return out;
        }
        out += &line;
        out.push('\n');
        shown += 1;
    }
    match found.cut {
        Some(SearchCut::Hits) | Some(SearchCut::Bytes) => {
            out += &format!("[stopped after {shown} {what}: there are more; {narrow}]\n")
        }
        Some(SearchCut::Time) => {
            out += &format!("[stopped after the time limit with {shown} {what}; {narrow}]\n")
        }
        None => {}
    }
    out
}
