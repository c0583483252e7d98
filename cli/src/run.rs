//! `krunbox run`: boot a microVM, run one command in it with this process's stdio, and exit with
//! the command's exit code.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use krunbox::Stdio;
use tokio::io::AsyncWriteExt;

use crate::definition::{sandbox_with, DefinitionArgs};

use crate::stats::{stats_text, StatsFormat};
use crate::terminal::{terminal_size, RawTerminal};
use crate::KRUNBOX_FAILED;

#[derive(clap::Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) sandbox: DefinitionArgs,
    /// Environment variable for the command (repeatable). The host environment is never passed.
    #[arg(long = "env", short = 'e', value_name = "K=V")]
    env: Vec<String>,
    /// Working directory in the guest.
    #[arg(long, short = 'w')]
    workdir: Option<PathBuf>,
    /// Kill the command (and everything it started) after this many seconds; exit 124.
    #[arg(long)]
    timeout: Option<f64>,
    /// Keep stdin open: this terminal's (or pipe's) input goes to the command.
    #[arg(short = 'i', long)]
    interactive: bool,
    /// Run the command on a pseudo-terminal sized like this one (with -i: an interactive
    /// shell; window resizes follow).
    #[arg(short = 't', long)]
    tty: bool,
    /// When the command ends, print on stderr what the VM cost the host: CPU time, memory
    /// (now and at most), block I/O, network totals. `--stats=json` prints one JSON object
    /// instead, for machines.
    #[arg(long, value_enum, value_name = "FORMAT", num_args = 0..=1, default_missing_value = "text")]
    stats: Option<StatsFormat>,
    /// When the command ends, snapshot the VM (memory, processes, files in memory) into this
    /// new directory; `--from` starts from it later (an image root without mounts or network).
    #[arg(long, value_name = "DIR")]
    snapshot_to: Option<PathBuf>,
    /// Start from this snapshot (taken by `--snapshot-to` with the same image, `--cpus` and
    /// `--memory`) instead of booting.
    #[arg(long, value_name = "SNAPSHOT_DIR")]
    from: Option<PathBuf>,
    /// Where the key that authenticates snapshots lives (default: the cache directory).
    #[arg(long, value_name = "DIR")]
    snapshot_key_dir: Option<PathBuf>,
    /// The command and its arguments (optional with an imported image that has an
    /// entrypoint or command).
    #[arg(last = true)]
    command: Vec<String>,
}

pub(crate) async fn run(args: RunArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let snapshots = args.snapshot_to.is_some() || args.from.is_some();
    let key_dir = args
        .snapshot_key_dir
        .clone()
        .unwrap_or_else(krunbox::cache_dir);
    let sandbox = sandbox_with(&args.sandbox, snapshots.then_some(key_dir.as_path())).await?;
    let vm = match &args.from {
        Some(dir) => {
            let snapshot = krunbox::Snapshot::open(dir, &key_dir)?;
            sandbox.restore(&snapshot).await?
        }
        None => sandbox.boot().await?,
    };
    for (guest, _) in &args.sandbox.net.publish {
        if let Some(address) = vm.published_address(*guest) {
            eprintln!("krunbox: the guest's port {guest} is published at {address}");
        }
    }

    let mut cmd = match args.command.split_first() {
        Some((program, rest)) => {
            let mut cmd = vm.command(program);
            cmd.args(rest);
            cmd
        }
        None => vm.entrypoint().map_err(|_| {
            "no command given (after --), and the image names no entrypoint or command".to_string()
        })?,
    };
    for kv in &args.env {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("--env {kv:?} must look like KEY=VALUE"))?;
        cmd.env(k, v);
    }
    if let Some(dir) = &args.workdir {
        cmd.current_dir(dir);
    }
    if let Some(secs) = args.timeout {
        let timeout = Duration::try_from_secs_f64(secs)
            .map_err(|_| format!("--timeout {secs} is not a valid number of seconds"))?;
        cmd.timeout(timeout);
    }

    if args.tty {
        let (rows, cols) = terminal_size().unwrap_or((24, 80));
        cmd.pty(rows, cols);
    } else if args.interactive {
        cmd.stdin(Stdio::piped());
    }
    let raw = (args.tty && args.interactive).then(RawTerminal::enter);

    let mut child = cmd.spawn().await?;
    let mut stdout = child.stdout.take().expect("fresh child has stdout");
    let stderr = child.stderr.take();
    let stdin = if args.interactive {
        child.stdin.take()
    } else {
        None
    };
    let copy_out = async {
        let mut out = tokio::io::stdout();
        tokio::io::copy(&mut stdout, &mut out).await?;
        out.flush().await
    };
    let copy_err = async {
        if let Some(mut stderr) = stderr {
            let mut err = tokio::io::stderr();
            tokio::io::copy(&mut stderr, &mut err).await?;
            err.flush().await?;
        }
        Ok::<_, std::io::Error>(())
    };
    // Input runs beside the output copies but does not hold the command's end up: the
    // command ends when its output ends, whatever is still unread on our stdin.
    let input = tokio::spawn(async move {
        if let Some(mut stdin) = stdin {
            let _ = tokio::io::copy(&mut tokio::io::stdin(), &mut stdin).await;
            let _ = stdin.shutdown().await;
        }
    });
    let resizes = async {
        if !args.tty {
            return std::future::pending::<()>().await;
        }
        let Ok(mut winch) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())
        else {
            return std::future::pending::<()>().await;
        };
        while winch.recv().await.is_some() {
            if let Some((rows, cols)) = terminal_size() {
                let _ = child.resize(rows, cols);
            }
        }
        std::future::pending::<()>().await
    };
    let copies = async { tokio::join!(copy_out, copy_err) };
    let (r1, r2) = tokio::select! {
        r = copies => r,
        _ = resizes => unreachable!("resizes never finishes"),
    };
    input.abort();
    r1?;
    r2?;
    let status = child.wait().await?;
    drop(raw);
    if let Some(format) = args.stats {
        // Read before the VM stops: its processes are what is measured.
        match vm.metrics() {
            Ok(metrics) => eprintln!("{}", stats_text(&metrics, format)),
            Err(e) => eprintln!("krunbox: no stats: {e}"),
        }
    }
    if let Some(dir) = &args.snapshot_to {
        let snapshot = vm.snapshot(dir).await?;
        eprintln!(
            "krunbox: snapshot in {} (sha256 {}); start from it with --from",
            snapshot.dir().display(),
            snapshot.digest()
        );
    }
    vm.shutdown().await?;
    Ok(ExitCode::from(exit_code(status.code(), status.signal())))
}

/// The CLI's exit code for a command that exited with `code` or was killed by `signal`, as a
/// shell reports it (128+N for signal N). Both numbers come from the guest, which may forge
/// them: a number no real process can have becomes 255, never a panic and never a success.
fn exit_code(code: Option<i32>, signal: Option<i32>) -> u8 {
    match (code, signal) {
        (Some(code), _) => u8::try_from(code).unwrap_or(u8::MAX),
        (None, Some(signal)) if (1..=127).contains(&signal) => 128 + signal as u8,
        (None, Some(_)) => u8::MAX,
        (None, None) => KRUNBOX_FAILED,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell_and_forged_numbers_are_failures() {
        assert_eq!(exit_code(Some(0), None), 0);
        assert_eq!(exit_code(Some(3), None), 3);
        assert_eq!(exit_code(Some(255), None), 255);
        assert_eq!(exit_code(None, Some(9)), 137);
        assert_eq!(exit_code(None, Some(15)), 143);
        assert_eq!(exit_code(None, None), super::KRUNBOX_FAILED);
        // What a hostile guest-init could send: no panic, no success.
        for code in [-1, 256, i32::MIN, i32::MAX] {
            assert_eq!(exit_code(Some(code), None), 255, "code {code}");
        }
        for signal in [0, -9, 128, i32::MAX, i32::MIN] {
            assert_eq!(exit_code(None, Some(signal)), 255, "signal {signal}");
        }
    }
}
