//! The `krunbox` command line: run an isolated command in a microVM, or check the host.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use krunbox::{BuiltinImage, HostCapabilities, Rootfs, Sandbox, Stdio};
use tokio::io::AsyncWriteExt;

/// Exit code for krunbox's own failures (as opposed to the command's), following `docker run`.
const KRUNBOX_FAILED: u8 = 125;

#[derive(Parser)]
#[command(
    name = "krunbox",
    version,
    about = "Run commands inside libkrun microVMs"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Boot a microVM, run one command in it, and exit with the command's exit code
    /// (124 on timeout, 128+N when killed by signal N, 125 when krunbox itself failed).
    Run(RunArgs),
    /// Report what this host can do: KVM (by a real probe), run-time files, images.
    Doctor {
        /// Exit 0 only if microVMs boot natively on this host (3 otherwise).
        #[arg(long)]
        exit_code: bool,
    },
}

#[derive(clap::Args)]
struct RunArgs {
    /// Built-in image (`busybox`, `agent`) or a path to an image file.
    #[arg(long, default_value = "agent")]
    image: String,
    /// SHA-256 the image file must have (required with an image path).
    #[arg(long)]
    image_sha256: Option<String>,
    /// Filesystem type of an image file.
    #[arg(long, default_value = "erofs")]
    image_fstype: String,
    /// vCPUs.
    #[arg(long, default_value_t = 1)]
    cpus: u8,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 512)]
    memory: u32,
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
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "krunbox=info".into()),
        )
        .with_writer(std::io::stderr)
        .without_time()
        .with_target(false)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("krunbox: cannot start the async runtime: {e}");
            return ExitCode::from(KRUNBOX_FAILED);
        }
    };
    let code = runtime.block_on(async {
        match cli.command {
            Cmd::Run(args) => match run(args).await {
                Ok(code) => code,
                Err(e) => {
                    eprintln!("krunbox: {e}");
                    ExitCode::from(KRUNBOX_FAILED)
                }
            },
            Cmd::Doctor { exit_code } => {
                let caps = HostCapabilities::probe().await;
                print!("{}", caps.report());
                if exit_code && !caps.can_boot_guests() {
                    ExitCode::from(3)
                } else {
                    ExitCode::SUCCESS
                }
            }
        }
    });
    // Reading this process's stdin blocks a runtime thread that would otherwise keep the
    // runtime (and the exit) waiting for one more line of input.
    runtime.shutdown_background();
    code
}

/// Puts the host terminal in raw mode for the life of the guard (keystrokes such as Ctrl-C go
/// to the guest's terminal, not to krunbox), restoring it on drop.
struct RawTerminal {
    saved: Option<nix::sys::termios::Termios>,
}

impl RawTerminal {
    fn enter() -> RawTerminal {
        use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
        let stdin = std::io::stdin();
        let Ok(saved) = tcgetattr(&stdin) else {
            return RawTerminal { saved: None };
        };
        let mut raw = saved.clone();
        cfmakeraw(&mut raw);
        let _ = tcsetattr(&stdin, SetArg::TCSANOW, &raw);
        RawTerminal { saved: Some(saved) }
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        if let Some(saved) = &self.saved {
            let _ = nix::sys::termios::tcsetattr(
                std::io::stdin(),
                nix::sys::termios::SetArg::TCSANOW,
                saved,
            );
        }
    }
}

/// This terminal's size (rows, columns), if stdin or stdout is a terminal.
fn terminal_size() -> Option<(u16, u16)> {
    for fd in [libc::STDIN_FILENO, libc::STDOUT_FILENO] {
        // SAFETY: TIOCGWINSZ writes a winsize into a valid, zeroed struct.
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        if unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) } == 0 && ws.ws_row > 0 {
            return Some((ws.ws_row, ws.ws_col));
        }
    }
    None
}

fn rootfs(args: &RunArgs) -> Result<Rootfs, String> {
    if let Ok(image) = args.image.parse::<BuiltinImage>() {
        return Ok(Rootfs::builtin(image));
    }
    let sha = args.image_sha256.as_deref().ok_or_else(|| {
        format!(
            "`{}` is not a built-in image (busybox, agent); an image file needs --image-sha256",
            args.image
        )
    })?;
    Ok(Rootfs::image(&args.image, &args.image_fstype, sha))
}

async fn run(args: RunArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let sandbox = Sandbox::builder()
        .rootfs(rootfs(&args)?)
        .cpus(args.cpus)
        .memory_mib(args.memory)
        .build()?;
    let vm = sandbox.boot().await?;

    let mut cmd = vm.command(&args.command[0]);
    cmd.args(&args.command[1..]);
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
    use super::exit_code;

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
