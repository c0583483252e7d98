//! Running a command to completion and collecting its output: [`Command::output`] and
//! [`Command::status`].

use tokio::io::{AsyncRead, AsyncReadExt};

use super::{Command, ExitStatus};
use crate::error::{Error, Result};

/// The default [`Command::max_output`]: what [`Command::output`] collects of each stream
/// before it fails with [`Error::OutputLimitExceeded`]. 64 MiB per stream, so at most 128 MiB
/// for one call.
pub const DEFAULT_MAX_OUTPUT: usize = 64 * 1024 * 1024;

/// What to do with output past a bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cap {
    /// Keep this many bytes, read and drop the rest ([`Command::output_limit`], `status()`).
    Truncate(usize),
    /// Fail past this many bytes ([`Command::max_output`]).
    Fail(usize),
}

impl Command {
    /// Runs the command to completion and collects its status and all of its output.
    ///
    /// Each stream is collected up to [`Command::max_output`] bytes (default
    /// [`DEFAULT_MAX_OUTPUT`], 64 MiB): past it the command is killed and this fails with
    /// [`Error::OutputLimitExceeded`], so a command that writes without end cannot exhaust the
    /// host's memory. With [`Command::output_limit`] the output is cut there instead, and the
    /// command runs to its end. Stream larger outputs with [`Command::spawn`].
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let out = vm.command("sh").args(["-c", "echo out; echo err >&2; exit 3"]).output().await?;
    /// assert_eq!(out.status.code(), Some(3));
    /// assert_eq!(out.stdout, b"out\n");
    /// assert_eq!(out.stderr, b"err\n");
    /// # Ok(()) }
    /// ```
    pub async fn output(&mut self) -> Result<Output> {
        let cap = match self.output_limit {
            Some(limit) => Cap::Truncate(limit),
            None => Cap::Fail(self.max_output),
        };
        self.run_collecting(cap).await
    }

    /// Runs the command to completion, collecting each output stream within `cap`.
    async fn run_collecting(&mut self, cap: Cap) -> Result<Output> {
        let cancel = self.cancel.clone().unwrap_or_default();
        // Dropping this future drops the child, which kills its process group.
        let mut child = tokio::select! {
            child = self.spawn() => child?,
            _ = cancel.cancelled() => return Err(Error::Cancelled),
        };
        let stdout = child.stdout.take().expect("fresh child has stdout");
        let stderr = child.stderr.take();
        let collect = async {
            // The first failure (a stream past its cap) ends both reads at once: the other
            // stream may never end while the command runs.
            let streams = async {
                tokio::try_join!(read_capped(stdout, cap, "stdout"), async {
                    match stderr {
                        Some(s) => read_capped(s, cap, "stderr").await,
                        None => Ok((Vec::new(), false)),
                    }
                })
            };
            // guest-init ends a timed-out command's streams too; should it not, the host kills
            // the process group itself. On an error the child is dropped, which kills it.
            let ((stdout, stdout_truncated), (stderr, stderr_truncated)) =
                child.backstop.run(streams).await??;
            let status = child.wait().await?;
            Ok(Output {
                status,
                stdout,
                stderr,
                stdout_truncated,
                stderr_truncated,
            })
        };
        tokio::select! {
            output = collect => output,
            _ = cancel.cancelled() => Err(Error::Cancelled),
        }
    }

    /// Runs the command to completion, discarding its output (read and dropped as it comes,
    /// so a command that writes without end costs no host memory).
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let status = vm.command("sh").args(["-c", "yes | head -c 100000000; exit 2"]).status().await?;
    /// assert_eq!(status.code(), Some(2));
    /// # Ok(()) }
    /// ```
    pub async fn status(&mut self) -> Result<ExitStatus> {
        Ok(self.run_collecting(Cap::Truncate(0)).await?.status)
    }
}

/// Reads a stream to its end within `cap`: the bytes kept, and whether some were dropped.
async fn read_capped<R: AsyncRead + Unpin>(
    mut reader: R,
    cap: Cap,
    stream: &'static str,
) -> Result<(Vec<u8>, bool)> {
    let mut kept = Vec::new();
    let mut truncated = false;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = reader
            .read(&mut buf)
            .await
            .map_err(Error::io("reading command output"))?;
        if n == 0 {
            return Ok((kept, truncated));
        }
        let limit = match cap {
            Cap::Truncate(limit) => limit,
            Cap::Fail(limit) if kept.len() + n > limit => {
                return Err(Error::OutputLimitExceeded { stream, limit })
            }
            Cap::Fail(limit) => limit,
        };
        let room = limit.saturating_sub(kept.len());
        kept.extend_from_slice(&buf[..n.min(room)]);
        truncated |= n > room;
    }
}

/// The result of [`Command::output`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// How it ended.
    pub status: ExitStatus,
    /// Everything written to stdout (up to [`Command::output_limit`]).
    pub stdout: Vec<u8>,
    /// Everything written to stderr (up to [`Command::output_limit`]).
    pub stderr: Vec<u8>,
    /// Whether stdout was cut at the output limit.
    pub stdout_truncated: bool,
    /// Whether stderr was cut at the output limit.
    pub stderr_truncated: bool,
}

impl Output {
    /// Stdout as text (lossy UTF-8).
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// Stderr as text (lossy UTF-8).
    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_output_cap_is_64_mib_per_stream() {
        assert_eq!(DEFAULT_MAX_OUTPUT, 64 << 20);
    }

    /// Past its cap a stream fails (never more than the cap is kept); `output_limit` cuts
    /// instead; `status()` keeps nothing. Bytes exactly at the cap are fine.
    #[tokio::test]
    async fn collecting_stops_at_the_cap() {
        let data = vec![b'y'; 300_000];
        let read = |cap| read_capped(&data[..], cap, "stdout");
        let (kept, truncated) = read(Cap::Fail(300_000)).await.unwrap();
        assert_eq!((kept.len(), truncated), (300_000, false));
        assert!(matches!(
            read(Cap::Fail(299_999)).await,
            Err(Error::OutputLimitExceeded {
                stream: "stdout",
                limit: 299_999
            })
        ));
        let (kept, truncated) = read(Cap::Truncate(1000)).await.unwrap();
        assert_eq!((kept.len(), truncated), (1000, true));
        let (kept, truncated) = read(Cap::Truncate(0)).await.unwrap();
        assert_eq!((kept.len(), truncated), (0, true));
    }
}
