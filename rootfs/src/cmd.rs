//! Running the external tools: capture their output, keep the tail for errors.

use crate::BuildError;
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};

/// How many trailing output lines a [`BuildError::Command`] carries.
const TAIL_LINES: usize = 25;

/// Whether an executable named `tool` is in `PATH`.
pub(crate) fn in_path(tool: &str) -> bool {
    let Some(path) = std::env::var_os("PATH") else {
        return false;
    };
    std::env::split_paths(&path).any(|dir| {
        std::fs::metadata(dir.join(tool))
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    })
}

/// The command line as a human would type it (for messages only).
pub(crate) fn describe(cmd: &Command) -> String {
    let mut words = vec![cmd.get_program().to_string_lossy().into_owned()];
    for arg in cmd.get_args() {
        let arg = arg.to_string_lossy();
        if arg.is_empty() || arg.contains(|c: char| c.is_whitespace() || "'\"$*\\".contains(c)) {
            words.push(format!("'{}'", arg.replace('\'', r"'\''")));
        } else {
            words.push(arg.into_owned());
        }
    }
    words.join(" ")
}

/// Runs `cmd` to completion and returns its stdout.
///
/// Each stderr line is passed to `on_stderr` as it arrives. If the command
/// fails, the error carries its last stderr lines (or stdout lines if it wrote
/// nothing to stderr).
pub(crate) fn run(
    cmd: &mut Command,
    on_stderr: &mut dyn FnMut(&str),
) -> Result<Vec<u8>, BuildError> {
    let desc = describe(cmd);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| BuildError::Command {
            cmd: desc.clone(),
            status: "could not start".into(),
            stderr_tail: e.to_string(),
        })?;

    // stdout is drained on a thread so neither pipe can fill up and block the child.
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        stdout.read_to_end(&mut buf).map(|_| buf)
    });

    let mut tail = VecDeque::with_capacity(TAIL_LINES);
    let stderr = BufReader::new(child.stderr.take().expect("stderr is piped"));
    for line in stderr.split(b'\n') {
        let Ok(line) = line else { break };
        let line = String::from_utf8_lossy(&line);
        let line = line.trim_end();
        on_stderr(line);
        push_tail(&mut tail, line);
    }

    let status = child.wait().map_err(|e| BuildError::Command {
        cmd: desc.clone(),
        status: "could not wait".into(),
        stderr_tail: e.to_string(),
    })?;
    let stdout = reader
        .join()
        .expect("stdout reader does not panic")
        .unwrap_or_default();
    if status.success() {
        return Ok(stdout);
    }
    if tail.is_empty() {
        // Tools like mkfs.erofs report on stdout, with \r progress updates.
        for line in String::from_utf8_lossy(&stdout).split(['\n', '\r']) {
            push_tail(&mut tail, line.trim_end());
        }
    }
    Err(BuildError::Command {
        cmd: desc,
        status: status.to_string(),
        stderr_tail: Vec::from(tail).join("\n"),
    })
}

fn push_tail(tail: &mut VecDeque<String>, line: &str) {
    if line.is_empty() {
        return;
    }
    if tail.len() == TAIL_LINES {
        tail.pop_front();
    }
    tail.push_back(line.to_string());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failing_command_reports_tail() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo out; echo one >&2; echo two >&2; exit 3"]);
        let mut seen = Vec::new();
        let err = run(&mut cmd, &mut |l| seen.push(l.to_string())).unwrap_err();
        assert_eq!(seen, ["one", "two"]);
        match err {
            BuildError::Command {
                cmd,
                status,
                stderr_tail,
            } => {
                assert!(cmd.starts_with("sh -c 'echo out;"), "{cmd}");
                assert!(status.contains('3'), "{status}");
                assert_eq!(stderr_tail, "one\ntwo");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn stdout_is_returned() {
        let out = run(Command::new("echo").arg("hi"), &mut |_| {}).unwrap();
        assert_eq!(out, b"hi\n");
        assert!(in_path("sh"));
        assert!(!in_path("definitely-not-a-krunbox-tool"));
    }
}
