//! The `krunbox` command line: run an isolated command in a microVM, or check the host.
//!
//! One module per concern: `run` (`krunbox run`), `image` (`krunbox image ...`), `network` (the
//! network flags both take), `stats` (`run --stats`), `terminal` (the host terminal for `-t`).

mod definition;
mod image;
mod mcp;
mod network;
mod run;
mod stats;
mod terminal;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use krunbox::HostCapabilities;

use image::{image, ImageCmd};
use run::{run, RunArgs};

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
    ///
    /// Network: without --dns-static, --allow-domain, --allow-tcp, --rules, --inject-header or
    /// --publish the guest has no network device at all. With any of them it gets one on which every DNS query and TCP
    /// connection is denied unless a rule allows it (other UDP, ICMP and IPv6 are always
    /// dropped). The first rule that matches a flow decides it; the rules are read in this
    /// order: --dns-static, --rules files, --allow-domain, --allow-tcp. A connection to a name
    /// is matched by the name whose DNS answer the guest dialled, a connection to an address
    /// the guest had otherwise by --allow-tcp's address. Every decision is logged on stderr
    /// (RUST_LOG=krunbox=warn silences it).
    ///
    /// Example: krunbox run --dns-static api.test=127.0.0.1 --allow-domain api.test:8080
    /// --allow-domain '*.pythonhosted.org:443' -- curl http://api.test:8080/
    Run(Box<RunArgs>),
    /// Pull, import, list and remove images (kept by name in $KRUNBOX_IMAGE_DIR, or in oci/
    /// of krunbox's cache directory; pulled layers in its blobs/).
    Image {
        #[command(subcommand)]
        action: ImageCmd,
    },
    /// Install the run-time files this build found (the krunbox-vmm helper, guest-init and
    /// libkrunfw) into krunbox's data directory, where any program using krunbox finds them
    /// ($KRUNBOX_DATA_DIR, else $XDG_DATA_HOME/krunbox, else ~/.local/share/krunbox).
    ///
    /// Run it from a build of the repository (scripts/setup.sh makes one); then an installed
    /// `krunbox` (cargo install --path cli) or a program of yours that depends on the krunbox
    /// crate boots VMs with them.
    Setup {
        /// Install into this directory instead.
        #[arg(long, value_name = "DIR")]
        data_dir: Option<std::path::PathBuf>,
    },
    /// Serve MCP (stdio, or streamable HTTP with --http): each session gets a sandbox of its
    /// own, defined by these flags (or --config), with the agent tools (bash, process, read,
    /// write, edit, ls, glob, grep) under permission rules; the sandbox stops when the session
    /// ends.
    ///
    /// Example: krunbox mcp --mount ./project:/workspace --rule 'ask bash(curl:*)'
    // A flag the config file sets may be set again on the command line: the last one counts.
    #[command(args_override_self = true)]
    Mcp(Box<mcp::McpArgs>),
    /// Print the agent tools' definitions (what `krunbox mcp` serves) as a JSON array, in the
    /// shape a model API takes: mcp (`tools/list`), openai (function tools) or anthropic.
    Tools {
        /// mcp, openai or anthropic.
        #[arg(long, default_value = "mcp")]
        format: mcp::ToolFormat,
    },
    /// Report what this host can do: KVM (by a real probe), run-time files, images.
    Doctor {
        /// Exit 0 only if microVMs boot natively on this host (3 otherwise).
        #[arg(long)]
        exit_code: bool,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "krunbox=info".into()),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal: the network's decisions are logged here, and a log file
        // or a pipe to grep should get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .with_target(false)
        .init();
    let argv = match mcp::expand_config(std::env::args_os().collect()) {
        Ok(argv) => argv,
        Err(e) => {
            eprintln!("krunbox: {e}");
            return ExitCode::from(2);
        }
    };
    let cli = Cli::parse_from(argv);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("krunbox: cannot start the async runtime: {e}");
            return ExitCode::from(KRUNBOX_FAILED);
        }
    };
    let code = runtime.block_on(async {
        match cli.command {
            Cmd::Run(args) => match run(*args).await {
                Ok(code) => code,
                Err(e) => {
                    eprintln!("krunbox: {e}");
                    ExitCode::from(KRUNBOX_FAILED)
                }
            },
            Cmd::Mcp(args) => match mcp::mcp(*args).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("krunbox: {e}");
                    ExitCode::from(KRUNBOX_FAILED)
                }
            },
            Cmd::Tools { format } => {
                println!("{}", mcp::tool_definitions(format));
                ExitCode::SUCCESS
            }
            Cmd::Image { action } => match image(action).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("krunbox: {e}");
                    ExitCode::from(KRUNBOX_FAILED)
                }
            },
            Cmd::Setup { data_dir } => match setup(data_dir) {
                Ok(()) => ExitCode::SUCCESS,
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

/// `krunbox setup`: installs the artifacts this build finds into the data directory.
fn setup(data_dir: Option<std::path::PathBuf>) -> krunbox::Result<()> {
    let data_dir = data_dir.unwrap_or_else(krunbox::data_dir);
    let installed = krunbox::Artifacts::locate()?.install(&data_dir)?;
    println!("installed into {}:", data_dir.display());
    println!("  helper      {}", installed.vmm_helper.display());
    println!("  guest-init  {}", installed.guest_init.display());
    println!("  libkrunfw   {}", installed.libkrunfw_dir.display());
    Ok(())
}

/// The command lines of the unit tests: `krunbox run FLAGS -- true`, parsed or refused.
#[cfg(test)]
mod testing {
    use super::*;

    pub(crate) fn args(flags: &[&str]) -> Result<RunArgs, clap::Error> {
        let argv = ["krunbox", "run"]
            .iter()
            .chain(flags)
            .chain(&["--", "true"])
            .copied();
        match Cli::try_parse_from(argv)?.command {
            Cmd::Run(args) => Ok(*args),
            Cmd::Doctor { .. }
            | Cmd::Image { .. }
            | Cmd::Setup { .. }
            | Cmd::Mcp(_)
            | Cmd::Tools { .. } => unreachable!(),
        }
    }

    /// clap checks a command line's shape (unique names, …) only when it is parsed: every
    /// subcommand's, here.
    #[test]
    fn every_subcommand_is_well_formed() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    pub(crate) fn refused(flags: &[&str]) -> String {
        match args(flags) {
            Ok(_) => panic!("accepted {flags:?}"),
            Err(e) => {
                assert_eq!(e.exit_code(), 2, "a usage error: {e}");
                e.to_string()
            }
        }
    }
}
