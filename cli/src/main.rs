//! The `krunbox` command line: run an isolated command in a microVM, or check the host.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use krunbox::fs::{HostDir, MemoryFs, MountOptions};
use krunbox::net::{
    DomainPattern, Flow, HeaderName, HeaderValue, Network, Ports, Protocol, Rule, RuleError, Rules,
    UpstreamTrust, Verdict,
};
use krunbox::rootfs::oci::{Credentials, ImageConfig, LocalImages, PullOptions};
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
    /// Report what this host can do: KVM (by a real probe), run-time files, images.
    Doctor {
        /// Exit 0 only if microVMs boot natively on this host (3 otherwise).
        #[arg(long)]
        exit_code: bool,
    },
}

#[derive(Subcommand)]
enum ImageCmd {
    /// Make a `docker save` tarball or an OCI image layout (a directory or a tar) into an
    /// image called NAME, for `krunbox run --image NAME` (which runs the image's entrypoint
    /// when no command is given, with its environment, working directory and user).
    Import {
        /// The archive.
        archive: PathBuf,
        /// The name to keep it under (like `myapp:latest`).
        #[arg(long)]
        name: String,
    },
    /// Pull an image from a registry (REF like `registry.example.com/team/app:1`, or
    /// `name@sha256:…`; a bare `alpine` means Docker Hub's `library/alpine`) and keep it as
    /// NAME. Layers are checked against their digests and kept in a cache beside the images,
    /// so another image sharing them does not download them again.
    Pull {
        /// The image reference.
        reference: String,
        /// The name to keep it under (default: the reference's last path part and tag, like
        /// `app:1`).
        #[arg(long)]
        name: Option<String>,
        /// Log in as USER (with --password-stdin, or $KRUNBOX_REGISTRY_PASSWORD).
        #[arg(long, value_name = "USER")]
        username: Option<String>,
        /// Read the password (or access token) from the first line of stdin.
        #[arg(long, requires = "username")]
        password_stdin: bool,
        /// Talk to the registry over plain HTTP (a registry on loopback or a private network).
        #[arg(long)]
        plain_http: bool,
        /// Also trust the PEM certificates in FILE for the registry's HTTPS (a private CA).
        #[arg(long, value_name = "FILE")]
        ca_file: Option<PathBuf>,
    },
    /// Build an image called NAME from the image --from (built-in, or one of `image ls`) by
    /// running each --run step in it with `sh -c`, in order, in one VM (as a Dockerfile's RUN
    /// lines: as the image's user, in its directory). The result keeps --from's entrypoint
    /// and configuration. Network flags as for `run` (none: no network).
    ///
    /// Example: krunbox image build tools --from agent --allow-domain deb.debian.org
    /// --run 'apt-get update' --run 'apt-get install -y ripgrep'
    Build {
        /// The name to keep it under.
        name: String,
        /// The image to start from.
        #[arg(long, default_value = "agent")]
        from: String,
        /// A step (repeatable, at least one).
        #[arg(long = "run", value_name = "STEP", required = true)]
        steps: Vec<String>,
        /// Guest memory in MiB while building.
        #[arg(long, default_value_t = 1024)]
        memory: u32,
        #[command(flatten)]
        net: Box<NetworkArgs>,
    },
    /// List the built-in images, and the images kept by name (pulled ones with their
    /// reference).
    Ls,
    /// Remove an imported image.
    Rm {
        /// Its name.
        name: String,
    },
}

#[derive(clap::Args)]
struct RunArgs {
    /// Built-in image (`busybox`, `agent`), an image's name (`krunbox image ls`), a path to an
    /// image file (with --image-sha256), or a registry reference starting with its host
    /// (`registry.example.com/team/app:1`), pulled on first use (as `image pull` would name it;
    /// with $KRUNBOX_REGISTRY_USERNAME and $KRUNBOX_REGISTRY_PASSWORD if set).
    #[arg(long, default_value = "agent")]
    image: String,
    /// Pull --image's registry reference over plain HTTP (a registry on loopback or a private
    /// network).
    #[arg(long)]
    plain_http: bool,
    /// SHA-256 the image file must have (required with an image path).
    #[arg(long)]
    image_sha256: Option<String>,
    /// Filesystem type of an image file.
    #[arg(long, default_value = "erofs")]
    image_fstype: String,
    /// Make the root writable for this run: changes live in at most SIZE of host memory
    /// (`512M`, `2G`; at least 16M) and are gone when the command ends. A guest that fills it
    /// gets "no space left on device". Without it the root is read-only.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, conflicts_with_all = ["persist", "store"])]
    ephemeral: Option<u64>,
    /// Make the root writable and keep its changes in the qcow2 file PATH between runs (made
    /// on first use, bound to the image it was made over; one run at a time).
    #[arg(long, value_name = "PATH", conflicts_with = "store")]
    persist: Option<PathBuf>,
    /// Make the root writable and keep its changes, block by block, in a block store in the
    /// directory DIR between runs (made on first use, bound to the image it was made over; one
    /// run at a time). What the command syncs is in DIR when its sync returns; everything is
    /// when the run ends.
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
    /// With --store: the most changes held in host memory before they go to the store.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "64M", requires = "store")]
    max_dirty: u64,
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
    #[command(flatten)]
    net: NetworkArgs,
    /// Mount the host directory HOST_DIR at GUEST_PATH in the guest (created if missing),
    /// read-write, or read-only with `:ro`. The guest cannot reach anything outside HOST_DIR,
    /// through `..`, symlinks or hard links. Example: --mount ./project:/workspace. Repeatable.
    #[arg(long, value_name = "HOST_DIR:GUEST_PATH[:ro]", value_parser = parse_mount)]
    mount: Vec<HostMount>,
    /// Mount an empty in-memory filesystem at GUEST_PATH (gone when the command ends).
    /// Repeatable.
    #[arg(long, value_name = "GUEST_PATH")]
    memfs: Vec<String>,
    /// When the command ends, print on stderr what the VM cost the host: CPU time, memory
    /// (now and at most), block I/O, network totals. `--stats=json` prints one JSON object
    /// instead, for machines.
    #[arg(long, value_enum, value_name = "FORMAT", num_args = 0..=1, default_missing_value = "text")]
    stats: Option<StatsFormat>,
    /// The command and its arguments (optional with an imported image that has an
    /// entrypoint or command).
    #[arg(last = true)]
    command: Vec<String>,
}

/// The network flags (`run`, `image build`).
#[derive(clap::Args)]
struct NetworkArgs {
    /// Allow DNS for, and connections to, the names PATTERN matches, on PORT (or a range
    /// FIRST-LAST; without it, any port).
    ///
    /// PATTERN is a name (`example.com`: that name only) or a wildcard (`*.example.com`: the
    /// names under example.com, not example.com itself). Their DNS queries are answered by the
    /// host's resolver, unless --dns-static names them. Repeatable.
    #[arg(long, value_name = "PATTERN[:PORT]", value_parser = parse_allow_domain)]
    allow_domain: Vec<Rule>,
    /// Allow connections to an IP address or CIDR block, on PORT (or a range FIRST-LAST).
    ///
    /// For a guest that dials the address itself rather than a name: 192.0.2.7:22,
    /// 10.0.0.0/8:8000-8100, IPv6 in brackets ([2001:db8::/32]:443). Repeatable.
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_allow_tcp)]
    allow_tcp: Vec<Rule>,
    /// Answer DNS for NAME with IP (connections to it still need --allow-domain).
    ///
    /// Like a hosts file: no DNS server is asked. Repeatable; a NAME given twice gets both
    /// addresses.
    #[arg(long, value_name = "NAME=IP", value_parser = parse_dns_static)]
    dns_static: Vec<(DomainPattern, IpAddr)>,
    /// Network rules from a JSON file.
    ///
    /// The file holds {"rules": [RULE, ...]}; each RULE is {"action": "allow" or "deny",
    /// "domain": PATTERN or "address": IP-or-CIDR, and optionally "ports": 443 or
    /// "8000-8100", "protocol": "dns", "tcp" or "udp", on a rule for names "methods": ["GET",
    /// ...] (the HTTP requests it decides: such connections are intercepted, and a request
    /// the rules refuse is answered 403), and on an allow rule for names "resolver":
    /// "system", {"static": ["IP", ...]} or {"upstream": ["IP:PORT", ...]}}. Unknown fields
    /// are refused. Repeatable.
    #[arg(long, value_name = "FILE", value_parser = parse_rules_file)]
    rules: Vec<Rules>,
    /// Set HEADER to the value of the host's environment variable ENVVAR on every HTTP(S)
    /// request to DOMAIN (a name or *.wildcard).
    ///
    /// The connection must still be allowed (--allow-domain); it is then intercepted: the host
    /// terminates the guest's TLS with the sandbox's own CA (which the guest trusts), adds the
    /// header, and sends the request on over verified TLS. The value never enters the guest,
    /// and never leaves the host in clear: a plain http:// request to DOMAIN is answered 403.
    /// Example: --inject-header 'api.github.com:Authorization=GITHUB_AUTH'. Repeatable.
    #[arg(long, value_name = "DOMAIN:HEADER=ENVVAR", value_parser = parse_inject_header)]
    inject_header: Vec<HeaderInjection>,
    /// Verify the upstreams of intercepted HTTPS (--inject-header, method rules) against the
    /// PEM certificates in FILE only, instead of the host's trust store: for origins with a
    /// private CA.
    #[arg(long, value_name = "FILE", value_parser = parse_upstream_ca)]
    upstream_ca: Option<UpstreamTrust>,
    /// Make the guest's TCP port GUEST reachable on the host at 127.0.0.1:HOST (a free port
    /// if HOST is left out; the address is printed on stderr). Repeatable.
    #[arg(long, value_name = "GUEST[:HOST]", value_parser = parse_publish)]
    publish: Vec<(u16, u16)>,
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
            Cmd::Run(args) => match run(*args).await {
                Ok(code) => code,
                Err(e) => {
                    eprintln!("krunbox: {e}");
                    ExitCode::from(KRUNBOX_FAILED)
                }
            },
            Cmd::Image { action } => match image(action).await {
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

/// `krunbox image ...`.
async fn image(action: ImageCmd) -> Result<(), Box<dyn std::error::Error>> {
    let images = krunbox::rootfs::oci::LocalImages::default_location();
    match action {
        ImageCmd::Import { archive, name } => {
            let spinner = indicatif::ProgressBar::new_spinner().with_message(format!(
                "importing {} as {name} (checking digests, merging layers, building the image in a VM)",
                archive.display()
            ));
            spinner.enable_steady_tick(std::time::Duration::from_millis(120));
            let imported = images.import(&name, &archive).await;
            spinner.finish_and_clear();
            let image = imported?;
            println!(
                "{name}: {} (sha256 {}, config {})",
                image.image.path.display(),
                image.image.sha256,
                image.config_digest
            );
        }
        ImageCmd::Pull {
            reference,
            name,
            username,
            password_stdin,
            plain_http,
            ca_file,
        } => {
            let name = match name {
                Some(name) => name,
                None => default_image_name(&reference)?,
            };
            let mut options = PullOptions::new().plain_http(plain_http);
            if let Some(username) = username {
                let password = if password_stdin {
                    let mut line = String::new();
                    std::io::stdin().read_line(&mut line)?;
                    let password = line.trim_end_matches(['\r', '\n']).to_string();
                    if password.is_empty() {
                        return Err("--password-stdin read no password".into());
                    }
                    password
                } else {
                    std::env::var("KRUNBOX_REGISTRY_PASSWORD").map_err(|_| {
                        "--username needs --password-stdin or $KRUNBOX_REGISTRY_PASSWORD"
                    })?
                };
                options = options.credentials(Credentials::Basic { username, password });
            }
            if let Some(file) = ca_file {
                let pem = std::fs::read(&file)
                    .map_err(|e| format!("reading --ca-file {}: {e}", file.display()))?;
                options = options.root_certificate_pem(pem);
            }
            // One pull (one manifest: what is downloaded is what is kept), a bar per layer as it
            // downloads, and a spinner line for the whole, which goes on while a VM builds.
            let bars = indicatif::MultiProgress::new();
            let spinner = bars.add(indicatif::ProgressBar::new_spinner().with_message(format!(
                "pulling {reference} as {name} (downloading layers, then building in a VM)"
            )));
            spinner.enable_steady_tick(std::time::Duration::from_millis(120));
            let style = indicatif::ProgressStyle::with_template(
                "{msg:19} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
            )
            .expect("a valid template")
            .progress_chars("=> ");
            let by_layer = std::sync::Mutex::new(std::collections::HashMap::new());
            let options = options.on_progress({
                let bars = bars.clone();
                move |p| {
                    let mut by_layer = by_layer.lock().expect("not poisoned");
                    let bar = by_layer.entry(p.digest.clone()).or_insert_with(|| {
                        let bar = bars.add(indicatif::ProgressBar::new(p.size));
                        bar.set_style(style.clone());
                        bar.set_message(p.digest.chars().take(19).collect::<String>());
                        bar
                    });
                    bar.set_position(p.received);
                }
            });
            let pulled = images.pull(&name, &reference, &options).await;
            spinner.finish_and_clear();
            bars.clear()?;
            let pulled = pulled?;
            let fetched = &pulled.fetched;
            eprintln!(
                "{reference}: {} layers, {} downloaded ({} MiB), {} cached",
                fetched.layers.len(),
                fetched.layers_fetched,
                fetched.bytes_fetched >> 20,
                fetched.layers_cached
            );
            let image = pulled.image;
            println!(
                "{name}: {} (sha256 {}, config {})",
                image.image.path.display(),
                image.image.sha256,
                image.config_digest
            );
        }
        ImageCmd::Build {
            name,
            from,
            steps,
            memory,
            net,
        } => {
            let mut sandbox = Sandbox::builder().memory_mib(memory);
            if let Ok(builtin) = from.parse::<BuiltinImage>() {
                sandbox = sandbox.rootfs(Rootfs::builtin(builtin));
            } else {
                let base = images.get(&from)?.ok_or_else(|| {
                    format!("--from {from}: neither a built-in image nor one of `image ls`")
                })?;
                sandbox = sandbox.rootfs(base.rootfs()).image_config(base.config);
            }
            if let Some(network) = network(&net)? {
                sandbox = sandbox.network(network);
            }
            let spinner = indicatif::ProgressBar::new_spinner().with_message(format!(
                "building {name} from {from}: {} step(s) in a VM, then flattening",
                steps.len()
            ));
            spinner.enable_steady_tick(std::time::Duration::from_millis(120));
            let built = images.build(&name, &sandbox.build()?, &steps).await;
            spinner.finish_and_clear();
            let image = built?;
            println!(
                "{name}: {} (sha256 {})",
                image.image.path.display(),
                image.image.sha256
            );
        }
        ImageCmd::Ls => {
            let cache = krunbox::cache_dir();
            for builtin in [BuiltinImage::Busybox, BuiltinImage::Agent] {
                let state = match krunbox_rootfs::load(&cache, builtin) {
                    Ok(Some(manifest)) => format!("built, sha256 {}", manifest.sha256),
                    Ok(None) => "not built yet (built on first use)".to_string(),
                    Err(e) => format!("unreadable: {e}"),
                };
                println!("{:<24} built-in  {state}", builtin.name());
            }
            for (name, image) in images.list()? {
                let size = std::fs::metadata(&image.image.path)
                    .map(|m| format!("{} MiB", m.len() >> 20))
                    .unwrap_or_else(|_| "missing".into());
                let origin = match images.pulled_reference(&name)? {
                    Some(reference) => format!("pulled    from {reference}, "),
                    None => "local     ".to_string(),
                };
                println!(
                    "{name:<24} {origin}sha256 {}, {size}, config {}",
                    image.image.sha256, image.config_digest
                );
            }
        }
        ImageCmd::Rm { name } => {
            if !images.remove(&name)? {
                return Err(format!("there is no imported image called {name}").into());
            }
        }
    }
    Ok(())
}

/// The name `image pull` keeps REF under by default: its last path part and its tag (`app:1`
/// for `registry.example.com/team/app:1`), `latest` without one.
fn default_image_name(reference: &str) -> Result<String, String> {
    let without_digest = reference.split('@').next().unwrap_or(reference);
    let last = without_digest.rsplit('/').next().unwrap_or(without_digest);
    let name = if last.contains(':') {
        last.to_string()
    } else {
        format!("{last}:latest")
    };
    if name.starts_with(':') || name.starts_with('.') {
        return Err(format!(
            "cannot name an image after `{reference}`: give --name"
        ));
    }
    Ok(name)
}

/// The image `--image` names, and its configuration if it has one: a built-in image, an image
/// of `image ls` by name, an image file (with --image-sha256), or a registry reference (its
/// first part a host: `registry.example.com/team/app:1`, `localhost:5000/app`), pulled the
/// first time and run from the local copy after.
async fn image_of(args: &RunArgs) -> Result<(Rootfs, Option<ImageConfig>), String> {
    if let Ok(image) = args.image.parse::<BuiltinImage>() {
        return Ok((Rootfs::builtin(image), None));
    }
    if let Some(sha) = &args.image_sha256 {
        return Ok((Rootfs::image(&args.image, &args.image_fstype, sha), None));
    }
    let images = LocalImages::default_location();
    let found = if args.image.contains('/') {
        images
            .pulled_from(&args.image)
            .map(|f| f.map(|(_, image)| image))
    } else {
        images.get(&args.image)
    };
    match found {
        Ok(Some(image)) => return Ok((image.rootfs(), Some(image.config))),
        Ok(None) | Err(krunbox::Error::InvalidConfig(_)) => {}
        Err(e) => return Err(e.to_string()),
    }
    if !names_a_registry(&args.image) {
        return Err(format!(
            "`{}` is not a built-in image (busybox, agent), an image of `krunbox image ls`, or \
             a registry reference (like registry.example.com/team/app:1); an image file needs \
             --image-sha256",
            args.image
        ));
    }
    let name = default_image_name(&args.image)?;
    let mut options = PullOptions::new().plain_http(args.plain_http);
    if let (Ok(username), Ok(password)) = (
        std::env::var("KRUNBOX_REGISTRY_USERNAME"),
        std::env::var("KRUNBOX_REGISTRY_PASSWORD"),
    ) {
        options = options.credentials(Credentials::Basic { username, password });
    }
    let spinner = indicatif::ProgressBar::new_spinner()
        .with_message(format!("pulling {} as {name}", args.image));
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    let pulled = images.pull(&name, &args.image, &options).await;
    spinner.finish_and_clear();
    let image = pulled.map_err(|e| e.to_string())?.image;
    eprintln!("krunbox: pulled {} as {name}", args.image);
    Ok((image.rootfs(), Some(image.config)))
}

/// Whether `reference` starts with a registry host (a name with a dot or a port, or
/// `localhost`), as `docker` tells a registry from a Docker Hub user. A bare name never goes
/// to a registry by itself.
fn names_a_registry(reference: &str) -> bool {
    match reference.split_once('/') {
        Some((host, rest)) => {
            !rest.is_empty()
                && (host.contains('.') || host.contains(':') || host == "localhost")
                && !Path::new(reference).exists()
        }
        None => false,
    }
}

/// `--image` with `--ephemeral`, `--persist` or `--store`: the image, writable if asked.
fn root(args: &RunArgs, image: Rootfs) -> Result<Rootfs, String> {
    Ok(match (args.ephemeral, &args.persist, &args.store) {
        (Some(bytes), _, _) => Rootfs::ephemeral(image, bytes),
        (None, Some(path), _) => Rootfs::persistent(image, path),
        (None, None, Some(dir)) => {
            let store = krunbox::rootfs::DirectoryStore::open(dir).map_err(|e| e.to_string())?;
            Rootfs::cow(image, store, args.max_dirty)
        }
        (None, None, None) => image,
    })
}

/// A size: bytes, or a number with `K`, `M`, `G` or `T` (powers of 1024).
fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, shift) = match text.char_indices().last() {
        Some((at, unit)) if unit.is_ascii_alphabetic() => {
            let shift = match unit.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("`{text}`: the unit must be K, M, G or T")),
            };
            (&text[..at], shift)
        }
        _ => (text, 0),
    };
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("`{text}` is not a size (examples: 512M, 2G)"))?;
    number
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("`{text}` is too large"))
}

/// `--allow-domain PATTERN[:PORT]`.
fn parse_allow_domain(value: &str) -> Result<Rule, String> {
    let (pattern, ports) = match value.split_once(':') {
        Some((pattern, ports)) => (pattern, Ports::parse(ports).map_err(|e| e.to_string())?),
        None => (value, Ports::any()),
    };
    Ok(Rule::allow_domain(pattern)
        .map_err(|e| e.to_string())?
        .ports(ports))
}

/// `--allow-tcp HOST:PORT`, HOST an address or CIDR block, IPv6 in brackets.
fn parse_allow_tcp(value: &str) -> Result<Rule, String> {
    let split = match value.strip_prefix('[') {
        Some(rest) => rest.split_once("]:"),
        None => value
            .rsplit_once(':')
            .filter(|(host, _)| !host.contains(':')),
    };
    let Some((host, ports)) = split else {
        return Err(
            "expected HOST:PORT, such as 192.0.2.7:22 or 10.0.0.0/8:80-89 \
                    (IPv6 in brackets: [2001:db8::/32]:443)"
                .into(),
        );
    };
    let ports = Ports::parse(ports).map_err(|e| e.to_string())?;
    Ok(Rule::allow_address(host)
        .map_err(|e| e.to_string())?
        .ports(ports))
}

/// `--dns-static NAME=IP`.
fn parse_dns_static(value: &str) -> Result<(DomainPattern, IpAddr), String> {
    let (name, address) = value
        .split_once('=')
        .ok_or("expected NAME=IP, such as api.test=127.0.0.1")?;
    let name = DomainPattern::parse(name).map_err(|e| e.to_string())?;
    let address = address
        .parse()
        .map_err(|_| format!("`{address}` is not an IP address"))?;
    Ok((name, address))
}

/// `--inject-header DOMAIN:HEADER=ENVVAR`: the header's value is read from the host's
/// environment now, so a missing variable is a usage error before anything boots.
#[derive(Debug, Clone)]
struct HeaderInjection {
    domain: DomainPattern,
    header: HeaderName,
    value: HeaderValue,
}

fn parse_inject_header(value: &str) -> Result<HeaderInjection, String> {
    let usage = || format!("{value:?} must look like DOMAIN:HEADER=ENVVAR");
    let (domain, rest) = value.split_once(':').ok_or_else(usage)?;
    let (header, variable) = rest.split_once('=').ok_or_else(usage)?;
    let domain = DomainPattern::parse(domain).map_err(|e| e.to_string())?;
    let header = HeaderName::from_bytes(header.trim().as_bytes())
        .map_err(|_| format!("{header:?} is not a header name"))?;
    let secret = std::env::var(variable)
        .map_err(|_| format!("the host has no environment variable {variable}"))?;
    let mut value = HeaderValue::from_str(&secret)
        .map_err(|_| format!("the value of {variable} is not a valid header value"))?;
    value.set_sensitive(true);
    Ok(HeaderInjection {
        domain,
        header,
        value,
    })
}

/// A `--mount` flag's value.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HostMount {
    host_dir: PathBuf,
    guest_path: String,
    read_only: bool,
}

/// `--mount HOST_DIR:GUEST_PATH[:ro]`.
fn parse_mount(value: &str) -> Result<HostMount, String> {
    let (rest, read_only) = match value.strip_suffix(":ro") {
        Some(rest) => (rest, true),
        None => (value, false),
    };
    let Some((host_dir, guest_path)) = rest.rsplit_once(':') else {
        return Err(format!(
            "{value:?} must look like HOST_DIR:GUEST_PATH or HOST_DIR:GUEST_PATH:ro"
        ));
    };
    if host_dir.is_empty() || !guest_path.starts_with('/') {
        return Err(format!(
            "{value:?}: the host directory must be named and the guest path absolute"
        ));
    }
    Ok(HostMount {
        host_dir: host_dir.into(),
        guest_path: guest_path.into(),
        read_only,
    })
}

/// `--publish GUEST[:HOST]`.
fn parse_publish(value: &str) -> Result<(u16, u16), String> {
    let port = |p: &str| {
        p.parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("{p:?} is not a port (1-65535)"))
    };
    match value.split_once(':') {
        Some((guest, host)) => Ok((port(guest)?, port(host)?)),
        None => Ok((port(value)?, 0)),
    }
}

/// The network the flags describe: the rules, with connections to a domain of an
/// --inject-header intercepted to add its headers (after the rules' own middleware, which
/// refuses requests by method, if they intercept it); published ports. `None`: no network.
fn network(args: &NetworkArgs) -> Result<Option<Network>, RuleError> {
    let rules = network_rules(args)?;
    if rules.is_none() && args.publish.is_empty() && args.inject_header.is_empty() {
        return Ok(None);
    }
    let rules = rules.unwrap_or_default();
    let injections = args.inject_header.clone();
    let mut network = Network::with_policy(move |flow: Flow| {
        let verdict = rules.verdict(&flow);
        let name = flow.hostname().unwrap_or_default().to_owned();
        let injections: Vec<HeaderInjection> = injections
            .iter()
            .filter(|i| i.domain.matches(&name))
            .cloned()
            .collect();
        async move {
            if flow.protocol() != Protocol::Tcp || !verdict.is_grant() || injections.is_empty() {
                return verdict;
            }
            let mut intercept = verdict.interception().cloned().unwrap_or_default();
            for i in injections {
                intercept = intercept.set_header(i.header, i.value);
            }
            Verdict::intercept(intercept)
        }
    });
    for (guest, host) in &args.publish {
        network = network.publish(*guest, *host);
    }
    if let Some(trust) = &args.upstream_ca {
        network = network.upstream_trust(trust.clone());
    }
    Ok(Some(network))
}

/// `--upstream-ca FILE`.
fn parse_upstream_ca(path: &str) -> Result<UpstreamTrust, String> {
    let pem = std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    UpstreamTrust::pem(&pem).map_err(|e| format!("{path}: {e}"))
}

/// `--rules FILE`.
fn parse_rules_file(path: &str) -> Result<Rules, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    Rules::from_json(&text).map_err(|e| match e {
        RuleError::Json { .. } => format!("{path} is not a list of rules: {e}"),
        e => format!("{path}: {e}"),
    })
}

/// The rules the network flags give, in the documented order: `None` without any (then the
/// guest has no network).
fn network_rules(args: &NetworkArgs) -> Result<Option<Rules>, RuleError> {
    if args.dns_static.is_empty()
        && args.rules.is_empty()
        && args.allow_domain.is_empty()
        && args.allow_tcp.is_empty()
    {
        return Ok(None);
    }
    let mut rules = Rules::new();
    for (name, address) in &args.dns_static {
        rules = rules.dns_static(&name.to_string(), *address)?;
    }
    for file in &args.rules {
        rules = rules.extend(file.clone());
    }
    for rule in args.allow_domain.iter().chain(&args.allow_tcp) {
        rules = rules.rule(rule.clone())?;
    }
    Ok(Some(rules))
}

async fn run(args: RunArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let (image, config) = image_of(&args).await?;
    let mut sandbox = Sandbox::builder()
        .rootfs(root(&args, image)?)
        .cpus(args.cpus)
        .memory_mib(args.memory);
    if let Some(config) = config {
        sandbox = sandbox.image_config(config);
    }
    if let Some(network) = network(&args.net)? {
        sandbox = sandbox.network(network);
    }
    for mount in &args.mount {
        let dir = if mount.read_only {
            HostDir::read_only(&mount.host_dir)
        } else {
            HostDir::new(&mount.host_dir)
        }
        .map_err(|e| format!("--mount {}: {e}", mount.host_dir.display()))?;
        let mut options = MountOptions::new();
        if mount.read_only {
            options = options.read_only();
        }
        sandbox = sandbox.mount_with(mount.guest_path.clone(), dir, options);
    }
    for path in &args.memfs {
        sandbox = sandbox.mount(path.clone(), MemoryFs::new());
    }
    let sandbox = sandbox.build()?;
    let vm = sandbox.boot().await?;
    for (guest, _) in &args.net.publish {
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
    vm.shutdown().await?;
    Ok(ExitCode::from(exit_code(status.code(), status.signal())))
}

/// `--stats`: how metrics are printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum StatsFormat {
    Text,
    Json,
}

/// The `--stats` report.
fn stats_text(metrics: &krunbox::Metrics, format: StatsFormat) -> String {
    if format == StatsFormat::Json {
        return serde_json::to_string(metrics)
            .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    }
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    let mut text = format!(
        "krunbox stats: cpu {:.2} s, memory {:.1} MiB (peak {:.1} MiB)",
        metrics.cpu_time.as_secs_f64(),
        mib(metrics.memory_bytes),
        mib(metrics.memory_peak_bytes),
    );
    if let (Some(read), Some(written)) = (metrics.disk_read_bytes, metrics.disk_written_bytes) {
        text += &format!(
            ", disk read {:.1} MiB, written {:.1} MiB",
            mib(read),
            mib(written)
        );
    }
    if let Some(net) = &metrics.network {
        text += &format!(
            ", network {:.1} MiB out, {:.1} MiB in, {} flows granted, {} denied",
            mib(net.bytes_from_guest),
            mib(net.bytes_to_guest),
            net.flows_granted,
            net.flows_denied,
        );
    }
    if let Some(root) = &metrics.root {
        text += &format!(
            ", root {:.1} of {:.1} MiB",
            mib(root.held_bytes),
            mib(root.max_bytes)
        );
    }
    text
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
    fn only_references_that_start_with_a_host_go_to_a_registry() {
        assert!(names_a_registry("registry.example.com/team/app:1"));
        assert!(names_a_registry("127.0.0.1:5000/public/app:1"));
        assert!(names_a_registry("localhost/app"));
        // A bare name, a Docker Hub user's image, a file: never pulled by themselves.
        assert!(!names_a_registry("alpine:3"));
        assert!(!names_a_registry("library/alpine"));
        assert!(!names_a_registry("no-such-image"));
        assert!(!names_a_registry("host.example/"));
    }

    #[test]
    fn pulled_images_are_named_after_their_last_path_part_and_tag() {
        assert_eq!(
            default_image_name("registry.example.com:5000/team/app:1").unwrap(),
            "app:1"
        );
        assert_eq!(default_image_name("alpine").unwrap(), "alpine:latest");
        assert_eq!(
            default_image_name("ghcr.io/a/tools@sha256:abc").unwrap(),
            "tools:latest"
        );
        assert!(default_image_name("host/:tag").is_err());
    }

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

    fn args(flags: &[&str]) -> Result<RunArgs, clap::Error> {
        let argv = ["krunbox", "run"]
            .iter()
            .chain(flags)
            .chain(&["--", "true"])
            .copied();
        match Cli::try_parse_from(argv)?.command {
            Cmd::Run(args) => Ok(*args),
            Cmd::Doctor { .. } | Cmd::Image { .. } => unreachable!(),
        }
    }

    fn refused(flags: &[&str]) -> String {
        match args(flags) {
            Ok(_) => panic!("accepted {flags:?}"),
            Err(e) => {
                assert_eq!(e.exit_code(), 2, "a usage error: {e}");
                e.to_string()
            }
        }
    }

    #[test]
    fn no_network_flag_means_no_network() {
        assert!(network_rules(&args(&[]).unwrap().net).unwrap().is_none());
    }

    #[test]
    fn network_flags_parse_into_rules_in_their_order() {
        let args = args(&[
            "--allow-domain",
            "api.test:8080",
            "--allow-domain",
            "*.Example.com",
            "--allow-domain",
            "ports.test:8000-8100",
            "--allow-tcp",
            "10.0.0.0/8:80",
            "--allow-tcp",
            "[2001:db8::/32]:443",
            "--allow-tcp",
            "192.0.2.7:22",
            "--dns-static",
            "api.test=127.0.0.1",
            "--dns-static",
            "api.test=::1",
        ])
        .unwrap();
        let domains: Vec<String> = args
            .net
            .allow_domain
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(
            domains,
            [
                "allow domain api.test port 8080",
                "allow domain *.example.com",
                "allow domain ports.test port 8000-8100",
            ]
        );
        let tcp: Vec<String> = args.net.allow_tcp.iter().map(|r| r.to_string()).collect();
        assert_eq!(
            tcp,
            [
                "allow address 10.0.0.0/8 port 80",
                "allow address 2001:db8::/32 port 443",
                "allow address 192.0.2.7/32 port 22",
            ]
        );
        assert_eq!(network_rules(&args.net).unwrap().unwrap().len(), 7);
    }

    #[test]
    fn the_rules_come_in_the_documented_order() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rules.json");
        std::fs::write(
            &file,
            r#"{"rules": [{"action": "deny", "domain": "no.test"}]}"#,
        )
        .unwrap();
        let args = args(&[
            "--allow-tcp",
            "10.0.0.0/8:80",
            "--allow-domain",
            "*.test",
            "--rules",
            file.to_str().unwrap(),
            "--dns-static",
            "a.test=127.0.0.1",
        ])
        .unwrap();
        let rules = network_rules(&args.net).unwrap().unwrap();
        let order: Vec<String> = rules.rules().iter().map(|r| r.to_string()).collect();
        assert_eq!(
            order,
            [
                "allow domain a.test (dns only) resolved as [127.0.0.1]",
                "deny domain no.test",
                "allow domain *.test",
                "allow address 10.0.0.0/8 port 80",
            ]
        );
    }

    #[test]
    fn ephemeral_takes_a_size_with_a_unit() {
        assert_eq!(
            args(&["--ephemeral", "512M"]).unwrap().ephemeral,
            Some(512 << 20)
        );
        assert_eq!(
            args(&["--ephemeral", "2g"]).unwrap().ephemeral,
            Some(2 << 30)
        );
        assert_eq!(
            args(&["--ephemeral", "65536"]).unwrap().ephemeral,
            Some(65536)
        );
        assert_eq!(args(&[]).unwrap().ephemeral, None);
        let persist = args(&["--persist", "/var/lib/x/root.qcow2"])
            .unwrap()
            .persist;
        assert_eq!(persist, Some(PathBuf::from("/var/lib/x/root.qcow2")));
        let both = refused(&["--ephemeral", "1G", "--persist", "x.qcow2"]);
        assert!(both.contains("cannot be used with"), "{both}");
        let both = refused(&["--persist", "x.qcow2", "--store", "blocks"]);
        assert!(both.contains("cannot be used with"), "{both}");
        let alone = refused(&["--max-dirty", "64M"]);
        assert!(alone.contains("--store"), "{alone}");
        let store = args(&["--store", "/var/lib/x/blocks", "--max-dirty", "32M"]).unwrap();
        assert_eq!(store.store, Some(PathBuf::from("/var/lib/x/blocks")));
        assert_eq!(store.max_dirty, 32 << 20);
        for bad in ["", "M", "12Q", "1.5G", "99999999999T"] {
            let message = refused(&["--ephemeral", bad]);
            assert!(
                message.contains("size") || message.contains("unit") || message.contains("large"),
                "{bad}: {message}"
            );
        }
    }

    #[test]
    fn mount_and_memfs_parse_and_bad_values_are_usage_errors() {
        let parsed = args(&[
            "--mount",
            "./project:/workspace",
            "--mount",
            "/srv/data:/data:ro",
            "--memfs",
            "/scratch",
        ])
        .unwrap();
        assert_eq!(
            parsed.mount,
            [
                HostMount {
                    host_dir: "./project".into(),
                    guest_path: "/workspace".into(),
                    read_only: false,
                },
                HostMount {
                    host_dir: "/srv/data".into(),
                    guest_path: "/data".into(),
                    read_only: true,
                },
            ]
        );
        assert_eq!(parsed.memfs, ["/scratch"]);
        for bad in ["/srv/data", ":/data", "/srv/data:data", "/srv/data:ro"] {
            let message = refused(&["--mount", bad]);
            assert!(message.contains("GUEST_PATH"), "{bad}: {message}");
        }
    }

    #[test]
    fn inject_header_and_publish_parse_and_give_a_network() {
        // Only this test reads or writes this variable.
        std::env::set_var("KRUNBOX_TEST_INJECTED", "Bearer from-the-host");
        let parsed = args(&[
            "--inject-header",
            "*.example.com:Authorization=KRUNBOX_TEST_INJECTED",
            "--publish",
            "8000",
            "--publish",
            "8001:18001",
        ])
        .unwrap();
        assert_eq!(parsed.net.inject_header.len(), 1);
        let injection = &parsed.net.inject_header[0];
        assert_eq!(injection.header, "authorization");
        assert_eq!(injection.value, "Bearer from-the-host");
        assert!(injection.value.is_sensitive());
        assert!(injection.domain.matches("api.example.com"));
        assert_eq!(parsed.net.publish, [(8000, 0), (8001, 18001)]);
        // Either flag alone gives a network (deny-all rules otherwise).
        assert!(network(&parsed.net).unwrap().is_some());
        assert!(network(&args(&[]).unwrap().net).unwrap().is_none());
        let cases: [(&[&str], &str); 6] = [
            (&["--inject-header", "api.test"], "DOMAIN:HEADER=ENVVAR"),
            (
                &["--inject-header", "api.test:X-Key"],
                "DOMAIN:HEADER=ENVVAR",
            ),
            (
                &["--inject-header", "api.test:X-Key=KRUNBOX_NO_SUCH_VARIABLE"],
                "no environment variable KRUNBOX_NO_SUCH_VARIABLE",
            ),
            (
                &["--inject-header", "api.test:Bad Header=PATH"],
                "not a header name",
            ),
            (&["--publish", "0"], "not a port"),
            (&["--publish", "80:http"], "not a port"),
        ];
        for (flags, says) in cases {
            let message = refused(flags);
            assert!(message.contains(says), "{flags:?}: {message}");
        }
    }

    #[test]
    fn bad_network_values_are_usage_errors_that_say_what_is_wrong() {
        let cases: [(&[&str], &str); 12] = [
            (&["--allow-domain", "a.*.com"], "first label"),
            (&["--allow-domain", "*."], "needs a domain after it"),
            (&["--allow-domain", "a..com"], "empty label"),
            (&["--allow-domain", "a.com:http"], "not a port"),
            (&["--allow-domain", "a.com:"], "not a port"),
            (&["--allow-domain", "a.com:90-80"], "empty"),
            (&["--allow-tcp", "10.0.0.1"], "HOST:PORT"),
            (&["--allow-tcp", "10.0.0.1/8:80"], "10.0.0.0/8"),
            (&["--allow-tcp", "example.com:80"], "not an IP address"),
            (&["--allow-tcp", "2001:db8::1:443"], "in brackets"),
            (&["--dns-static", "a.test"], "NAME=IP"),
            (&["--dns-static", "a.test=localhost"], "not an IP address"),
        ];
        for (flags, says) in cases {
            let message = refused(flags);
            assert!(message.contains(says), "{flags:?}: {message}");
        }
        let message = refused(&["--rules", "/no/such/rules.json"]);
        assert!(
            message.contains("cannot read /no/such/rules.json"),
            "{message}"
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rules.json");
        std::fs::write(&file, r#"{"rules": [{"action": "allow", "domain": "*"}]}"#).unwrap();
        let message = refused(&["--rules", file.to_str().unwrap()]);
        assert!(message.contains("rules[0]"), "{message}");
        std::fs::write(
            &file,
            r#"{"rules": [{"action": "allow", "domian": "a.test"}]}"#,
        )
        .unwrap();
        let message = refused(&["--rules", file.to_str().unwrap()]);
        assert!(message.contains("unknown field `domian`"), "{message}");
        std::fs::write(
            &file,
            r#"{"rules": [{"action": "allow", "domain": "a.test", "methods": ["get"]}]}"#,
        )
        .unwrap();
        let message = refused(&["--rules", file.to_str().unwrap()]);
        assert!(message.contains("not an HTTP method"), "{message}");
    }

    #[test]
    fn a_rules_file_can_limit_methods() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rules.json");
        std::fs::write(
            &file,
            r#"{"rules": [
                {"action": "deny", "domain": "api.test", "methods": ["POST", "DELETE"]},
                {"action": "allow", "domain": "api.test", "ports": 443, "methods": ["GET"]}
            ]}"#,
        )
        .unwrap();
        let args = args(&["--rules", file.to_str().unwrap()]).unwrap();
        let rules = network_rules(&args.net).unwrap().unwrap();
        let order: Vec<String> = rules.rules().iter().map(|r| r.to_string()).collect();
        assert_eq!(
            order,
            [
                "deny domain api.test methods POST,DELETE",
                "allow domain api.test port 443 methods GET",
            ]
        );
        assert!(network(&args.net).unwrap().is_some());
    }
}
