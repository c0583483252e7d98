//! `bash` and `process`: shell commands in the foreground (bounded output, a timeout) or in
//! the background (an id, a bounded log, stdin, kill).

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use super::call::{Bash, Process, ProcessAction};
use super::spec::ToolResult;
use super::text::{count, HeadTail};
use crate::{ChildControl, ChildStdin, ExitStatus, Instance};

/// A foreground command's timeout unless the call sets one.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
/// The longest timeout a call may set.
pub(crate) const MAX_TIMEOUT: Duration = Duration::from_secs(600);
/// Background processes running at once.
const MAX_RUNNING: usize = 16;
/// Background processes remembered (running or ended); the oldest ended ones are forgotten.
const MAX_REMEMBERED: usize = 64;
/// Output a background process keeps for polls: its last bytes.
const LOG_KEEP: usize = 64 * 1024;
/// How long a write to a background process's stdin may wait for it to read.
const STDIN_WAIT: Duration = Duration::from_secs(10);
/// How long `kill` waits for the process to be reported gone.
const KILL_WAIT: Duration = Duration::from_secs(10);
/// How long past its timeout a foreground command may take to be reported ended (its output
/// closed, its status sent) before the host gives up on it and kills it: guest-init kills it at
/// the timeout, so only a guest that stopped answering takes longer.
const END_GRACE: Duration = Duration::from_secs(30);

/// Runs `bash` in the foreground: output of both streams, interleaved as a terminal shows
/// them, kept head and tail within `cap` bytes.
pub(crate) async fn foreground(vm: &Instance, args: &Bash, cwd: &Path, cap: usize) -> ToolResult {
    let timeout = timeout_of(args);
    let mut child = match shell(vm, &args.command, cwd).timeout(timeout).spawn().await {
        Ok(child) => child,
        Err(err) => return ToolResult::error(format!("could not start the command: {err}")),
    };
    let output = Arc::new(Mutex::new(HeadTail::new(cap)));
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let ended = async {
        let keep = |bytes: &[u8]| output.lock().unwrap_or_else(|p| p.into_inner()).push(bytes);
        tokio::join!(pump(stdout, keep), pump(stderr, keep));
        child.wait().await
    };
    let status = tokio::time::timeout(timeout + END_GRACE, ended).await;
    let text = output.lock().unwrap_or_else(|p| p.into_inner()).render();
    let Ok(status) = status else {
        // `child` is dropped on return: its process group is killed.
        return ToolResult::error(format!(
            "the sandbox did not report the command's end within {}s of its timeout; it was \
             killed\n{text}",
            END_GRACE.as_secs()
        ));
    };
    match status {
        Ok(status) if status.timed_out() => ToolResult::error(format!(
            "timed out after {}s and was killed (raise timeout_secs, up to {}, or run it with \
             background: true)\n{text}",
            timeout.as_secs(),
            MAX_TIMEOUT.as_secs()
        )),
        Ok(status) => {
            let result = format!("{}\n{text}", describe(status));
            if status.success() {
                ToolResult::ok(result)
            } else {
                ToolResult::error(result)
            }
        }
        Err(err) => ToolResult::error(format!("the command was lost: {err}\n{text}")),
    }
}

fn timeout_of(args: &Bash) -> Duration {
    args.timeout_secs
        .map(|s| Duration::from_secs(s.into()).clamp(Duration::from_secs(1), MAX_TIMEOUT))
        .unwrap_or(DEFAULT_TIMEOUT)
}

fn shell(vm: &Instance, command: &str, cwd: &Path) -> crate::Command {
    let mut shell = vm.command("sh");
    shell.args(["-lc", command]).current_dir(cwd);
    shell
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => status.to_string(),
    }
}

/// Reads `stream` to its end, giving each chunk to `keep` (a foreground command's head and
/// tail, a background process's log): one reader for both.
async fn pump(stream: Option<impl AsyncRead + Unpin>, mut keep: impl FnMut(&[u8])) {
    let Some(mut stream) = stream else { return };
    let mut buf = vec![0u8; 16 * 1024];
    while let Ok(n) = stream.read(&mut buf).await {
        if n == 0 {
            break;
        }
        keep(&buf[..n]);
    }
}

/// The background processes of one toolbox. Dropping it kills those still running (their
/// `Child` handles go with their tasks).
pub(crate) struct Jobs {
    next_id: u32,
    table: BTreeMap<u32, Job>,
    /// One permit a running process: taken before it starts, given back when its task ends.
    running: Arc<tokio::sync::Semaphore>,
}

impl Default for Jobs {
    fn default() -> Jobs {
        Jobs {
            next_id: 0,
            table: BTreeMap::new(),
            running: Arc::new(tokio::sync::Semaphore::new(MAX_RUNNING)),
        }
    }
}

struct Job {
    command: String,
    /// What was written to its stdin since the last newline: the start of a line the next
    /// write may finish, which permission rules must see whole.
    unfinished_line: Arc<Mutex<String>>,
    pid: u32,
    control: ChildControl,
    stdin: Arc<tokio::sync::Mutex<Option<ChildStdin>>>,
    log: Arc<Mutex<Log>>,
    task: tokio::task::JoinHandle<()>,
}

/// The last [`LOG_KEEP`] bytes of a background process's output, and how far polls have read.
#[derive(Default)]
struct Log {
    kept: VecDeque<u8>,
    total: u64,
    shown: u64,
    end: Option<String>,
}

impl Log {
    fn push(&mut self, bytes: &[u8]) {
        self.total += bytes.len() as u64;
        self.kept.extend(bytes);
        let excess = self.kept.len().saturating_sub(LOG_KEEP);
        self.kept.drain(..excess);
    }

    /// What was printed since the last poll, at most `cap` bytes (its end), with notes.
    fn unread(&mut self, cap: usize) -> String {
        let first_kept = self.total - self.kept.len() as u64;
        let mut notes = String::new();
        if self.shown < first_kept {
            notes += &format!(
                "[{} bytes printed since the last poll were not kept: only the last {} are]\n",
                count(first_kept - self.shown),
                count(LOG_KEEP as u64)
            );
            self.shown = first_kept;
        }
        let start = (self.shown - first_kept) as usize;
        let mut unread: Vec<u8> = self.kept.iter().skip(start).copied().collect();
        if unread.len() > cap {
            notes += &format!(
                "[{} bytes cut: showing the last {}]\n",
                count((unread.len() - cap) as u64),
                count(cap as u64)
            );
            unread.drain(..unread.len() - cap);
        }
        self.shown = self.total;
        format!("{notes}{}", String::from_utf8_lossy(&unread))
    }

    fn status(&self) -> String {
        self.end.clone().unwrap_or_else(|| "running".into())
    }
}

impl Drop for Jobs {
    fn drop(&mut self) {
        for job in self.table.values() {
            job.task.abort();
        }
    }
}

impl Jobs {
    /// Starts `bash` in the background and remembers it.
    pub(crate) async fn start(
        jobs: &Mutex<Jobs>,
        vm: &Instance,
        args: &Bash,
        cwd: &Path,
    ) -> ToolResult {
        let running = jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .running
            .clone();
        let Ok(permit) = running.try_acquire_owned() else {
            return ToolResult::error(format!(
                "{MAX_RUNNING} background processes are running already: kill one with the \
                 process tool first"
            ));
        };
        let mut command = shell(vm, &args.command, cwd);
        command.stdin(crate::Stdio::piped());
        let mut child = match command.spawn().await {
            Ok(child) => child,
            Err(err) => return ToolResult::error(format!("could not start the command: {err}")),
        };
        let log = Arc::new(Mutex::new(Log::default()));
        let stdin = Arc::new(tokio::sync::Mutex::new(child.stdin.take()));
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        let pid = child.id();
        let control = child.control();
        let task_log = log.clone();
        let task = tokio::spawn(async move {
            let _permit = permit;
            let keep = |bytes: &[u8]| {
                task_log
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(bytes)
            };
            tokio::join!(pump(stdout, keep), pump(stderr, keep));
            let end = match child.wait().await {
                Ok(status) => describe(status),
                Err(err) => format!("lost: {err}"),
            };
            task_log.lock().unwrap_or_else(|p| p.into_inner()).end = Some(end);
        });
        let mut jobs = jobs.lock().unwrap_or_else(|p| p.into_inner());
        jobs.next_id += 1;
        let id = jobs.next_id;
        jobs.table.insert(
            id,
            Job {
                command: args.command.clone(),
                unfinished_line: Arc::default(),
                pid,
                control,
                stdin,
                log,
                task,
            },
        );
        jobs.forget_oldest_ended();
        ToolResult::ok(format!(
            "started background process {id} (pid {pid}); follow it with the process tool: \
             {{\"action\": \"poll\", \"id\": {id}}}"
        ))
    }

    fn forget_oldest_ended(&mut self) {
        while self.table.len() > MAX_REMEMBERED {
            let oldest_ended = self
                .table
                .iter()
                .find(|(_, job)| job.task.is_finished())
                .map(|(id, _)| *id);
            match oldest_ended {
                Some(id) => self.table.remove(&id),
                None => break,
            };
        }
    }

    /// The line a background process's stdin has begun and not ended, with `input` after it:
    /// what the permission rules decide a `write` on (so `cu` then `rl x` is seen as `curl x`).
    pub(crate) fn line_with(jobs: &Mutex<Jobs>, id: u32, input: &str) -> String {
        let jobs = jobs.lock().unwrap_or_else(|p| p.into_inner());
        let begun = jobs
            .table
            .get(&id)
            .map(|job| {
                job.unfinished_line
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone()
            })
            .unwrap_or_default();
        begun + input
    }

    /// Runs the `process` tool.
    pub(crate) async fn act(jobs: &Mutex<Jobs>, args: &Process, cap: usize) -> ToolResult {
        if args.action == ProcessAction::List {
            return ToolResult::ok(jobs.lock().unwrap_or_else(|p| p.into_inner()).list());
        }
        let Some(id) = args.id else {
            return ToolResult::error("`id` is required: the id bash returned");
        };
        let found = {
            let jobs = jobs.lock().unwrap_or_else(|p| p.into_inner());
            jobs.table.get(&id).map(|job| {
                (
                    job.log.clone(),
                    (job.stdin.clone(), job.unfinished_line.clone()),
                    job.control.clone(),
                    job.pid,
                )
            })
        };
        let Some((log, (stdin, unfinished_line), control, pid)) = found else {
            return ToolResult::error(format!(
                "there is no background process {id}; the list action shows them"
            ));
        };
        match args.action {
            ProcessAction::Poll => {
                let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
                let output = log.unread(cap);
                ToolResult::ok(format!(
                    "process {id} (pid {pid}): {}\n{output}",
                    log.status()
                ))
            }
            ProcessAction::Write => write_stdin(id, &stdin, &unfinished_line, args).await,
            ProcessAction::Kill => {
                let _ = control.signal(libc::SIGKILL);
                let deadline = tokio::time::Instant::now() + KILL_WAIT;
                loop {
                    let status = log.lock().unwrap_or_else(|p| p.into_inner()).end.clone();
                    if let Some(status) = status {
                        return ToolResult::ok(format!("process {id} ended: {status}"));
                    }
                    if tokio::time::Instant::now() >= deadline {
                        return ToolResult::error(format!(
                            "process {id} was sent SIGKILL but has not ended yet"
                        ));
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            ProcessAction::List => unreachable!("handled above"),
        }
    }

    fn list(&self) -> String {
        if self.table.is_empty() {
            return "no background processes".into();
        }
        let mut out = String::new();
        for (id, job) in &self.table {
            let status = job.log.lock().unwrap_or_else(|p| p.into_inner()).status();
            let mut command = job.command.clone();
            super::text::truncate_at_char(&mut command, 200);
            out += &format!("{id}\tpid {}\t{status}\t{command}\n", job.pid);
        }
        out
    }
}

/// The longest line written to a background process in pieces: past it, a write must end the
/// line (the rules decide on the whole line, which must stay bounded).
const MAX_UNFINISHED_LINE: usize = 64 * 1024;

async fn write_stdin(
    id: u32,
    stdin: &tokio::sync::Mutex<Option<ChildStdin>>,
    unfinished_line: &Mutex<String>,
    args: &Process,
) -> ToolResult {
    let mut stdin = stdin.lock().await;
    let Some(pipe) = stdin.as_mut() else {
        return ToolResult::error(format!("process {id}'s stdin is closed"));
    };
    let input = args.input.as_deref().unwrap_or("");
    if input.is_empty() && !args.close_stdin {
        return ToolResult::error("`input` is required (or set close_stdin)");
    }
    let line = {
        let begun = unfinished_line.lock().unwrap_or_else(|p| p.into_inner());
        let joined = format!("{begun}{input}");
        match joined.rfind('\n') {
            Some(end) => joined[end + 1..].to_owned(),
            None => joined,
        }
    };
    if line.len() > MAX_UNFINISHED_LINE {
        return ToolResult::error(format!(
            "a line written to process {id} in pieces may be at most {} bytes: end it with a \
             newline",
            count(MAX_UNFINISHED_LINE as u64)
        ));
    }
    let wrote = tokio::time::timeout(STDIN_WAIT, pipe.write_all(input.as_bytes())).await;
    match wrote {
        Ok(Ok(())) => {}
        Ok(Err(err)) => return ToolResult::error(format!("writing to process {id}: {err}")),
        Err(_) => {
            return ToolResult::error(format!(
                "process {id} did not read its input within {}s",
                STDIN_WAIT.as_secs()
            ))
        }
    }
    *unfinished_line.lock().unwrap_or_else(|p| p.into_inner()) = line;
    if args.close_stdin {
        let _ = pipe.shutdown().await;
        *stdin = None;
    }
    ToolResult::ok(format!(
        "wrote {} bytes to process {id}{}",
        input.len(),
        if args.close_stdin {
            " and closed its stdin"
        } else {
            ""
        }
    ))
}
