//! `read`, `write` and `edit` on guest files.

use std::path::Path;

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, BufReader};

use super::call::{Edit, Read, Write};
use super::spec::ToolResult;
use super::text::count;
use crate::{FsErrorKind, Instance, WriteOptions};

/// Lines `read` shows unless the call says.
const DEFAULT_LINES: u64 = 2000;
/// Bytes of one line `read` shows; the rest of a longer line is cut.
const MAX_LINE: usize = 2000;
/// Bytes at the start of a file that decide whether it is binary (a NUL byte), as git does.
const BINARY_SNIFF: usize = 8000;
/// The largest file `edit` rewrites (it holds the file in memory), before and after.
const MAX_EDITED: u64 = 16 * 1024 * 1024;
/// Bytes `read` scans past the size the file had when it was opened: a file that keeps
/// growing (a log, or a guest that serves an endless file) is read only this far.
const GROWTH_READ: u64 = 1024 * 1024;
/// Bytes `read` scans at most, whatever size the guest reports (a sparse file of an exabyte
/// has no newline to find): lines past it are not reached.
const MAX_SCANNED: u64 = 64 * 1024 * 1024;
/// How long `read` may take in all (each chunk has the request timeout; this bounds the sum).
const READ_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

/// Runs `read`: numbered lines from `offset`, at most `limit` of them and `cap` bytes.
pub(crate) async fn read(vm: &Instance, path: &Path, args: &Read, cap: usize) -> ToolResult {
    let meta = match vm.metadata(path).await {
        Ok(meta) => meta,
        Err(err) => return ToolResult::error(err.to_string()),
    };
    if meta.is_dir() {
        return ToolResult::error(format!(
            "{} is a directory: list it with ls",
            path.display()
        ));
    }
    let file = match vm.open_file(path).await {
        Ok(file) => file,
        Err(err) => return ToolResult::error(err.to_string()),
    };
    let scanned = meta.len.saturating_add(GROWTH_READ).min(MAX_SCANNED);
    let mut reader = BufReader::with_capacity(64 * 1024, file.take(scanned));
    match reader.fill_buf().await {
        Ok([]) => return ToolResult::ok(format!("{} is empty", path.display())),
        Ok(start) if start[..start.len().min(BINARY_SNIFF)].contains(&0) => {
            return ToolResult::ok(format!(
                "{} is a binary file ({} bytes): not shown; inspect it with bash (`file`, `xxd \
                 | head`)",
                path.display(),
                count(meta.len)
            ))
        }
        Ok(_) => {}
        Err(err) => return ToolResult::error(format!("reading {}: {err}", path.display())),
    }
    let first = args.offset.unwrap_or(1).max(1);
    let limit = args.limit.unwrap_or(DEFAULT_LINES).max(1);
    let read = tokio::time::timeout(
        READ_DEADLINE,
        numbered_lines(&mut reader, first, limit, cap),
    );
    match read.await {
        Ok(Ok(shown)) => ToolResult::ok(shown.render(path, first)),
        Ok(Err(err)) => ToolResult::error(format!("reading {}: {err}", path.display())),
        Err(_) => ToolResult::error(format!(
            "reading {} took more than {}s (at most {} bytes of it are read): read a smaller \
             range, or use bash (`sed -n`, `tail`)",
            path.display(),
            READ_DEADLINE.as_secs(),
            count(MAX_SCANNED)
        )),
    }
}

/// What `read` collected.
struct Shown {
    text: String,
    /// Lines read from the file (up to the last shown).
    lines_read: u64,
    /// Lines shown.
    shown: u64,
    /// Stopped at the byte cap.
    capped: bool,
    /// More of the file follows the last shown line.
    more: bool,
    /// Lines whose end was cut.
    long_lines: u64,
}

impl Shown {
    fn render(mut self, path: &Path, first: u64) -> String {
        if self.shown == 0 {
            return format!(
                "{} has {} lines: there is no line {first}",
                path.display(),
                self.lines_read
            );
        }
        let last = first + self.shown - 1;
        let shown_bytes = self.text.len() as u64;
        if self.long_lines > 0 {
            self.text += &format!(
                "[{} lines longer than {} bytes were cut, marked […]]\n",
                self.long_lines,
                count(MAX_LINE as u64)
            );
        }
        if self.capped {
            self.text += &format!(
                "[cut at {} bytes of output: showing lines {first}-{last}; read on with offset={}]\n",
                count(shown_bytes),
                last + 1
            );
        } else if self.more {
            self.text += &format!(
                "[showing lines {first}-{last}; the file goes on: read on with offset={}]\n",
                last + 1
            );
        }
        self.text
    }
}

async fn numbered_lines(
    reader: &mut (impl AsyncBufRead + Unpin),
    first: u64,
    limit: u64,
    cap: usize,
) -> std::io::Result<Shown> {
    let mut shown = Shown {
        text: String::new(),
        lines_read: 0,
        shown: 0,
        capped: false,
        more: false,
        long_lines: 0,
    };
    let mut line = Vec::new();
    loop {
        if shown.shown == limit {
            shown.more = !reader.fill_buf().await?.is_empty();
            return Ok(shown);
        }
        let Some(cut) = bounded_line(reader, &mut line).await? else {
            return Ok(shown);
        };
        shown.lines_read += 1;
        if shown.lines_read < first {
            continue;
        }
        let mut numbered = format!(
            "{:>6}\t{}",
            shown.lines_read,
            String::from_utf8_lossy(&line)
        );
        if cut {
            numbered += " […]";
        }
        numbered.push('\n');
        if shown.text.len() + numbered.len() > cap && shown.shown > 0 {
            shown.capped = true;
            return Ok(shown);
        }
        shown.long_lines += u64::from(cut);
        shown.text += &numbered;
        shown.shown += 1;
    }
}

/// Reads one line into `line` (without its ending), keeping at most [`MAX_LINE`] bytes of it
/// and skipping the rest; `None` at end of file, `Some(true)` when the line was cut. Never holds
/// more than one buffer of a long line.
async fn bounded_line(
    reader: &mut (impl AsyncBufRead + Unpin),
    line: &mut Vec<u8>,
) -> std::io::Result<Option<bool>> {
    line.clear();
    let mut cut = false;
    let mut any = false;
    loop {
        let buf = reader.fill_buf().await?;
        if buf.is_empty() {
            return Ok(any.then_some(cut));
        }
        any = true;
        let (part, used, done) = match memchr(buf) {
            Some(i) => (&buf[..i], i + 1, true),
            None => (buf, buf.len(), false),
        };
        let room = MAX_LINE - line.len();
        line.extend_from_slice(&part[..part.len().min(room)]);
        cut |= part.len() > room;
        reader.consume(used);
        if done {
            if line.last() == Some(&b'\r') && !cut {
                line.pop();
            }
            return Ok(Some(cut));
        }
    }
}

fn memchr(buf: &[u8]) -> Option<usize> {
    buf.iter().position(|b| *b == b'\n')
}

/// Runs `write`: the whole file, parents created.
pub(crate) async fn write(vm: &Instance, path: &Path, args: &Write) -> ToolResult {
    let existed = vm.metadata(path).await.is_ok();
    let options = WriteOptions::new().create_parents(true);
    match vm
        .write_file_with(path, args.content.as_bytes(), options)
        .await
    {
        Ok(()) => ToolResult::ok(format!(
            "{} {} ({} bytes)",
            if existed { "replaced" } else { "created" },
            path.display(),
            count(args.content.len() as u64)
        )),
        Err(err) => ToolResult::error(err.to_string()),
    }
}

/// Runs `edit`: every replacement is made in memory first, and the file is written once, only
/// if all of them apply.
pub(crate) async fn edit(vm: &Instance, path: &Path, args: &Edit) -> ToolResult {
    let meta = match vm.metadata(path).await {
        Ok(meta) if meta.is_dir() => {
            return ToolResult::error(format!("{} is a directory", path.display()))
        }
        Ok(meta) => meta,
        Err(err) if err.fs_kind() == Some(FsErrorKind::NotFound) => {
            return ToolResult::error(format!(
                "{} does not exist: create it with write",
                path.display()
            ))
        }
        Err(err) => return ToolResult::error(err.to_string()),
    };
    if meta.len > MAX_EDITED {
        return ToolResult::error(format!(
            "{} is {} bytes; edit rewrites files up to {} bytes (use bash for larger ones)",
            path.display(),
            count(meta.len),
            count(MAX_EDITED)
        ));
    }
    let bytes = match vm.read_file(path).await {
        Ok(bytes) => bytes,
        Err(err) => return ToolResult::error(err.to_string()),
    };
    let Ok(text) = String::from_utf8(bytes) else {
        return ToolResult::error(format!(
            "{} is not UTF-8 text; edit changes text files only",
            path.display()
        ));
    };
    let (edited, replacements) = match apply(text, args) {
        Ok(done) => done,
        Err(why) => return ToolResult::error(format!("{why}; {} was not changed", path.display())),
    };
    match vm.write_file(path, edited.as_bytes()).await {
        Ok(()) => ToolResult::ok(format!(
            "edited {}: {} edit{}, {replacements} replacement{}",
            path.display(),
            args.edits.len(),
            if args.edits.len() == 1 { "" } else { "s" },
            if replacements == 1 { "" } else { "s" },
        )),
        Err(err) => ToolResult::error(err.to_string()),
    }
}

/// The replacements applied in order to `text`, or why one cannot be.
pub(crate) fn apply(mut text: String, args: &Edit) -> Result<(String, usize), String> {
    if args.edits.is_empty() {
        return Err("`edits` is empty: give at least one {old_string, new_string}".into());
    }
    let mut replacements = 0;
    for (i, edit) in args.edits.iter().enumerate() {
        let n = i + 1;
        if edit.old_string.is_empty() {
            return Err(format!("edit {n}: old_string is empty"));
        }
        if edit.old_string == edit.new_string {
            return Err(format!("edit {n}: old_string and new_string are the same"));
        }
        let found = text.matches(edit.old_string.as_str()).count() as u64;
        let removed = found.saturating_mul(edit.old_string.len() as u64);
        let added = found.saturating_mul(edit.new_string.len() as u64);
        let after = (text.len() as u64)
            .saturating_sub(removed)
            .saturating_add(added);
        if after > MAX_EDITED {
            return Err(format!(
                "edit {n}: the file would grow past {} bytes",
                count(MAX_EDITED)
            ));
        }
        match (found as usize, edit.replace_all) {
            (0, _) => {
                return Err(format!(
                    "edit {n}: old_string was not found (it must match exactly, whitespace and \
                     indentation included; read the file again{})",
                    if i > 0 {
                        ", and mind the edits before this one"
                    } else {
                        ""
                    }
                ))
            }
            (1, _) | (_, true) => {
                text = text.replace(edit.old_string.as_str(), &edit.new_string);
                replacements += found as usize;
            }
            (many, false) => {
                return Err(format!(
                    "edit {n}: old_string occurs {many} times; include more surrounding lines \
                     to make it unique, or set replace_all"
                ))
            }
        }
    }
    Ok((text, replacements))
}

#[cfg(test)]
mod tests {
    use super::super::call::Replacement;
    use super::*;

    fn edit(edits: &[(&str, &str, bool)]) -> Edit {
        Edit {
            path: "f".into(),
            edits: edits
                .iter()
                .map(|(old, new, all)| Replacement {
                    old_string: (*old).into(),
                    new_string: (*new).into(),
                    replace_all: *all,
                })
                .collect(),
        }
    }

    #[test]
    fn edits_apply_in_order_or_not_at_all() {
        let text = "let a = 1;\nlet b = 1;\n".to_string();
        let both = edit(&[
            ("a = 1", "a = 2", false),
            ("a = 2;\nlet b", "a = 3;\nlet c", false),
        ]);
        assert_eq!(
            apply(text.clone(), &both).unwrap(),
            ("let a = 3;\nlet c = 1;\n".into(), 2)
        );
        let ambiguous = edit(&[("a = 1", "a = 2", false), ("= 1", "= 9", false)]);
        assert_eq!(
            apply(text.clone(), &ambiguous).unwrap().0,
            "let a = 2;\nlet b = 9;\n"
        );
        let twice = edit(&[("= 1", "= 9", false)]);
        assert!(apply(text.clone(), &twice)
            .unwrap_err()
            .contains("occurs 2 times"));
        let all = edit(&[("= 1", "= 9", true)]);
        assert_eq!(
            apply(text.clone(), &all).unwrap(),
            ("let a = 9;\nlet b = 9;\n".into(), 2)
        );
        let missing = edit(&[("a = 1", "a = 2", false), ("zzz", "y", false)]);
        assert!(apply(text.clone(), &missing)
            .unwrap_err()
            .starts_with("edit 2: old_string was not found"));
        assert!(apply(text, &edit(&[("", "x", false)])).is_err());
    }

    #[tokio::test]
    async fn lines_are_numbered_bounded_and_say_how_to_read_on() {
        let long = "x".repeat(5000);
        let file = format!("one\r\ntwo\n{long}\nfour\nfive");
        let mut reader = BufReader::with_capacity(64, file.as_bytes());
        let shown = numbered_lines(&mut reader, 2, 2, 100_000).await.unwrap();
        let text = shown.render(Path::new("/f"), 2);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "     2\ttwo");
        assert!(lines[1].starts_with("     3\txxx") && lines[1].ends_with(" […]"));
        assert_eq!(lines[1].len(), 7 + MAX_LINE + " […]".len());
        assert!(text.contains("read on with offset=4"), "{text}");

        let mut reader = BufReader::new(file.as_bytes());
        let all = numbered_lines(&mut reader, 1, 100, 100_000).await.unwrap();
        assert!(!all.more && all.shown == 5);
        assert!(all.render(Path::new("/f"), 1).contains("     5\tfive\n"));

        let mut reader = BufReader::new(file.as_bytes());
        let capped = numbered_lines(&mut reader, 1, 100, 30).await.unwrap();
        assert!(capped
            .render(Path::new("/f"), 1)
            .contains("cut at 22 bytes of output: showing lines 1-2; read on with offset=3"));

        let mut reader = BufReader::new(file.as_bytes());
        let past = numbered_lines(&mut reader, 9, 1, 100).await.unwrap();
        assert_eq!(
            past.render(Path::new("/f"), 9),
            "/f has 5 lines: there is no line 9"
        );
    }
}
