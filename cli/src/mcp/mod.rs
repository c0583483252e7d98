//! `krunbox mcp`: an MCP server (the official Rust SDK, rmcp) whose tools are
//! `krunbox::tools` over a sandbox of each session's own, over stdio or streamable HTTP.

mod session;

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use krunbox::tools::{Mode, Permissions, Rule};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::ServiceExt;

use crate::definition::{sandbox, DefinitionArgs};
use session::{Definition, Session};

#[derive(clap::Args)]
pub(crate) struct McpArgs {
    /// Serve streamable HTTP at http://ADDR/mcp (a loopback address, e.g. 127.0.0.1:8080)
    /// instead of stdio. Each MCP session gets a sandbox of its own.
    #[arg(long, value_name = "ADDR")]
    http: Option<SocketAddr>,
    /// A JSON object of these flags, read first (command-line flags after it): keys are the
    /// long flags' names, values a string or number, an array for a repeatable flag, `true`
    /// for a switch. Example: {"image": "agent", "mount": ["./project:/workspace"],
    /// "workspace": "/workspace", "rule": ["ask bash(curl:*)"]}
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The directory the tools start in (relative paths, `bash`'s working directory) and the
    /// one `workspace-write` lets `write` and `edit` change. Default: the first --mount's
    /// guest path, else the first --memfs's, else /.
    #[arg(long, value_name = "GUEST_PATH")]
    workspace: Option<String>,
    /// What runs without a rule: read-only, workspace-write or full-access.
    #[arg(long, default_value = "workspace-write")]
    mode: Mode,
    /// A permission rule, `allow|ask|deny PATTERN`, checked in order before the mode (first
    /// match wins). Patterns: `read`, `bash(git:*)` (a command prefix), `bash(make test)` (a
    /// command), `write(/workspace/**)` (a path glob), `*`. `ask` asks the MCP client's user
    /// (elicitation). Repeatable.
    #[arg(long, value_name = "RULE")]
    rule: Vec<Rule>,
    /// The most sessions with a sandbox at once (each a VM); one more is refused until one
    /// ends.
    #[arg(long, default_value_t = 8, value_name = "N")]
    max_sessions: usize,
    #[command(flatten)]
    pub(crate) sandbox: DefinitionArgs,
}

/// The shapes `krunbox tools` prints the definitions in.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum ToolFormat {
    /// MCP `tools/list` entries.
    Mcp,
    /// OpenAI function tools.
    Openai,
    /// Anthropic tools.
    Anthropic,
}

/// Every tool's definition as a JSON array in `format`.
pub(crate) fn tool_definitions(format: ToolFormat) -> serde_json::Value {
    let tools = krunbox::tools::definitions();
    serde_json::Value::Array(
        tools
            .iter()
            .map(|tool| match format {
                ToolFormat::Mcp => tool.to_mcp(),
                ToolFormat::Openai => tool.to_openai(),
                ToolFormat::Anthropic => tool.to_anthropic(),
            })
            .collect(),
    )
}

/// How long an HTTP session may see no request before rmcp closes it (and its VM stops): past
/// the longest command (10 minutes) and an approval's wait (5).
const SESSION_IDLE: std::time::Duration = std::time::Duration::from_secs(3600);

/// Serves MCP until stdin closes (stdio) or SIGINT/SIGTERM (HTTP).
pub(crate) async fn mcp(args: McpArgs) -> Result<(), Box<dyn std::error::Error>> {
    let workspace = args
        .workspace
        .clone()
        .or_else(|| args.sandbox.mount.first().map(|m| m.guest_path.clone()))
        .or_else(|| args.sandbox.memfs.first().cloned())
        .unwrap_or_else(|| "/".into());
    if args.http.is_some() && (args.sandbox.persist.is_some() || args.sandbox.store.is_some()) {
        return Err(
            "--persist and --store keep one root for one VM at a time; with --http every \
                    session boots its own: use --ephemeral, or serve stdio"
                .into(),
        );
    }
    let definition = Arc::new(Definition {
        sandbox: sandbox(&args.sandbox).await?,
        workspace,
        permissions: Permissions {
            mode: args.mode,
            rules: args.rule.clone(),
        },
        sessions: Arc::new(tokio::sync::Semaphore::new(args.max_sessions.max(1))),
        max_sessions: args.max_sessions.max(1),
    });
    match args.http {
        None => stdio(definition).await,
        Some(addr) => http(definition, addr).await,
    }
}

async fn stdio(definition: Arc<Definition>) -> Result<(), Box<dyn std::error::Error>> {
    let session = Session::new(&definition);
    session.boot_soon();
    let running = session
        .clone()
        .serve((tokio::io::stdin(), tokio::io::stdout()))
        .await?;
    // The session ends when the client closes our stdin, or sends SIGTERM (as the SDKs do
    // when it does not exit by itself): either way its sandbox is stopped first.
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let quit = tokio::select! {
        quit = running.waiting() => quit.map(|_| ()).map_err(|e| e.to_string()),
        _ = terminate.recv() => Ok(()),
    };
    session.stop().await;
    quit?;
    Ok(())
}

async fn http(
    definition: Arc<Definition>,
    addr: SocketAddr,
) -> Result<(), Box<dyn std::error::Error>> {
    if !addr.ip().is_loopback() {
        return Err(format!(
            "--http {addr}: serve on a loopback address; an MCP client that reaches the server \
             runs commands in its sandboxes, and this server has no authentication"
        )
        .into());
    }
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let mut config = StreamableHttpServerConfig::default();
    config.legacy_session_mode = true;
    // Any loopback address the server was bound to, not only the defaults' names.
    config.allowed_hosts.push(bound.ip().to_string());
    config.allowed_hosts.push(bound.to_string());
    let stop = config.cancellation_token.clone();
    let mut sessions = LocalSessionManager::default();
    // A session (and its VM) ends when its client ends it; rmcp's idle limit is only for
    // clients that vanished, and must outlast a long command and a user thinking.
    sessions.session_config.keep_alive = Some(SESSION_IDLE);
    let service = StreamableHttpService::new(
        move || Ok(Session::new(&definition)),
        sessions.into(),
        config,
    );
    let service = hyper_util::service::TowerToHyperService::new(service);
    eprintln!("krunbox: MCP on http://{bound}/mcp");
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = tokio::signal::ctrl_c() => break,
            _ = terminate.recv() => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(err) => {
                // Out of descriptors, an aborted connection: the sessions go on.
                tracing::warn!("accepting an MCP connection: {err}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let service = service.clone();
        tokio::spawn(async move {
            let io = hyper_util::rt::TokioIo::new(stream);
            let _ =
                hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(io, service)
                    .await;
        });
    }
    // Ends every session; each one's sandbox stops as its handler goes.
    stop.cancel();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    Ok(())
}

/// `krunbox mcp --config FILE ...` with the file's flags put before the command line's.
pub(crate) fn expand_config(argv: Vec<OsString>) -> Result<Vec<OsString>, String> {
    // Only `krunbox mcp ...`: `mcp` elsewhere (a command's argument) is not this subcommand.
    let mcp = 1;
    if argv.get(mcp).is_none_or(|a| a != "mcp") {
        return Ok(argv);
    }
    let config = argv[mcp + 1..].windows(2).find_map(|pair| match pair {
        [flag, file] if flag == "--config" => Some(PathBuf::from(file)),
        _ => None,
    });
    let config = config.or_else(|| {
        argv[mcp + 1..].iter().find_map(|a| {
            a.to_str()
                .and_then(|a| a.strip_prefix("--config="))
                .map(PathBuf::from)
        })
    });
    let Some(path) = config else {
        return Ok(argv);
    };
    let text =
        std::fs::read_to_string(&path).map_err(|e| format!("--config {}: {e}", path.display()))?;
    let flags = config_flags(&text).map_err(|e| format!("--config {}: {e}", path.display()))?;
    let mut expanded = argv[..=mcp].to_vec();
    expanded.extend(flags.into_iter().map(OsString::from));
    expanded.extend_from_slice(&argv[mcp + 1..]);
    Ok(expanded)
}

/// A config file's JSON object as flags (by key; a repeated flag's values in their order).
fn config_flags(text: &str) -> Result<Vec<String>, String> {
    let object: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(text).map_err(|e| format!("not a JSON object of flags: {e}"))?;
    let mut flags = Vec::new();
    for (key, value) in object {
        if key == "config" {
            return Err("a config file cannot name another".into());
        }
        let flag = format!("--{key}");
        // `--key=value`: a value starting with `-` stays a value.
        let one = |value: &serde_json::Value| -> Result<String, String> {
            match value {
                serde_json::Value::String(s) => Ok(format!("{flag}={s}")),
                serde_json::Value::Number(n) => Ok(format!("{flag}={n}")),
                other => Err(format!("{key}: {other} is not a string or a number")),
            }
        };
        match &value {
            serde_json::Value::Bool(true) => flags.push(flag.clone()),
            serde_json::Value::Bool(false) => {}
            serde_json::Value::Array(items) => {
                for item in items {
                    flags.push(one(item)?);
                }
            }
            other => flags.push(one(other)?),
        }
    }
    Ok(flags)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_mcp_subcommand_reads_a_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("mcp.json");
        std::fs::write(&file, r#"{"memory": 300}"#).unwrap();
        let argv = |args: &[&str]| -> Vec<OsString> { args.iter().map(OsString::from).collect() };
        let file = file.to_str().unwrap();
        let run = argv(&["krunbox", "run", "--", "mcp", "--config", file]);
        assert_eq!(expand_config(run.clone()).unwrap(), run);
        let expanded = expand_config(argv(&[
            "krunbox", "mcp", "--config", file, "--memory", "400",
        ]));
        assert_eq!(
            expanded.unwrap(),
            argv(&[
                "krunbox",
                "mcp",
                "--memory=300",
                "--config",
                file,
                "--memory",
                "400"
            ])
        );
        let missing = expand_config(argv(&["krunbox", "mcp", "--config", "/no/such.json"]));
        assert!(missing.unwrap_err().contains("/no/such.json"));
    }

    #[test]
    fn a_config_file_is_flags_before_the_command_line() {
        let flags = config_flags(
            r#"{"image": "busybox", "memory": 256, "mount": ["/a:/w", "/b:/x:ro"],
                "rule": ["ask bash(curl:*)"], "plain-http": true, "tty": false}"#,
        )
        .unwrap();
        assert_eq!(
            flags,
            [
                "--image=busybox",
                "--memory=256",
                "--mount=/a:/w",
                "--mount=/b:/x:ro",
                "--plain-http",
                "--rule=ask bash(curl:*)"
            ]
        );
        assert!(config_flags(r#"{"mount": [{"x": 1}]}"#)
            .unwrap_err()
            .contains("mount"));
        assert!(config_flags("[1]").unwrap_err().contains("JSON object"));
        assert!(config_flags(r#"{"config": "x"}"#).is_err());
    }
}
