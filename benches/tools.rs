//! The agent tools' protocol overhead: N `read` + `edit` pairs through `krunbox mcp` (the
//! official Rust MCP SDK as the client, over stdio) against the same N pairs through the Rust
//! API (`Toolbox::call`) on an instance of this process, in the same run.
//!
//! Each side has its own busybox VM (the server boots its session's); each pair reads a
//! 200-line file in the guest's `/tmp` and edits one line of it (`value = i` to `value = i+1`),
//! and every result is checked (no error, the edit's count, the read's line), so a broken run
//! panics rather than print numbers. Reported: the median time of a pair on each side and their
//! ratio. Under nested emulation absolute times mean little; the ratio is what we report.
//!
//! `cargo bench` (which passes `--bench`): N = 100. Without `--bench` (the test command's smoke
//! run): N = 10. `KRUNBOX_BENCH_ITERS` sets N in either mode. The server is `krunbox` beside this
//! bench's executable in the target directory, or `$KRUNBOX_CLI`.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{env_or, median};
use krunbox::tools::{Mode, Permissions, Toolbox};
use krunbox::{BuiltinImage, Rootfs, Sandbox};
use rmcp::model::CallToolRequestParams;
use rmcp::transport::TokioChildProcess;
use rmcp::ServiceExt;
use serde_json::{json, Value};

const FILE: &str = "/tmp/bench/state.py";

fn file_text() -> String {
    let mut text: String = (0..199)
        .map(|i| format!("# line {i} of the bench file\n"))
        .collect();
    text += "value = 0\n";
    text
}

fn edit_args(i: usize) -> Value {
    json!({"path": FILE, "edits": [{"old_string": format!("value = {i}\n"), "new_string": format!("value = {}\n", i + 1)}]})
}

fn check_pair(i: usize, read: (String, bool), edit: (String, bool)) {
    assert!(!read.1, "read {i}: {}", read.0);
    assert!(
        read.0.contains(&format!("   200\tvalue = {i}\n")),
        "read {i}: {}",
        read.0
    );
    assert!(
        !edit.1 && edit.0.contains("1 replacement"),
        "edit {i}: {}",
        edit.0
    );
}

fn cli() -> PathBuf {
    if let Some(cli) = std::env::var_os("KRUNBOX_CLI") {
        return cli.into();
    }
    // target/<profile>/deps/tools-HASH → target/<profile>/krunbox
    let exe = std::env::current_exe().expect("the bench's own path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .map(|profile| profile.join("krunbox"))
        .expect("a target directory")
}

async fn through_rust(n: usize) -> Vec<Duration> {
    let vm = Sandbox::builder()
        .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
        .memory_mib(256)
        .build()
        .expect("sandbox (run scripts/setup.sh)")
        .boot()
        .await
        .expect("booting busybox");
    let tools = Toolbox::builder(&vm)
        .permissions(Permissions::mode(Mode::FullAccess))
        .build();
    let wrote = tools
        .call("write", json!({"path": FILE, "content": file_text()}))
        .await;
    assert!(!wrote.is_error, "{}", wrote.text);
    let mut times = Vec::with_capacity(n);
    for i in 0..n {
        let start = Instant::now();
        let read = tools
            .call("read", json!({"path": FILE, "offset": 200}))
            .await;
        let edit = tools.call("edit", edit_args(i)).await;
        times.push(start.elapsed());
        check_pair(i, (read.text, read.is_error), (edit.text, edit.is_error));
    }
    vm.shutdown().await.expect("shutdown");
    times
}

async fn through_mcp(n: usize) -> Vec<Duration> {
    let mut server = tokio::process::Command::new(cli());
    server
        .args([
            "mcp",
            "--image",
            "busybox",
            "--memory",
            "256",
            "--mode",
            "full-access",
        ])
        // Its audit log at info level would be one line a call: errors only, on our stderr.
        .env("RUST_LOG", "krunbox=warn");
    let (transport, _) = TokioChildProcess::builder(server)
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("starting krunbox mcp");
    let client = ().serve(transport).await.expect("the MCP handshake");
    let call = |name: &'static str, args: Value| {
        let client = &client;
        async move {
            let Value::Object(args) = args else {
                unreachable!()
            };
            let result = client
                .call_tool(CallToolRequestParams::new(name).with_arguments(args))
                .await
                .unwrap_or_else(|e| panic!("{name} over MCP: {e}"));
            let text: String = result
                .content
                .iter()
                .filter_map(|block| block.as_text().map(|t| t.text.clone()))
                .collect();
            (text, result.is_error.unwrap_or(false))
        }
    };
    let wrote = call("write", json!({"path": FILE, "content": file_text()})).await;
    assert!(!wrote.1, "{}", wrote.0);
    let mut times = Vec::with_capacity(n);
    for i in 0..n {
        let start = Instant::now();
        let read = call("read", json!({"path": FILE, "offset": 200})).await;
        let edit = call("edit", edit_args(i)).await;
        times.push(start.elapsed());
        check_pair(i, read, edit);
    }
    client.cancel().await.expect("ending the session");
    times
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[tokio::main]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let n = env_or("KRUNBOX_BENCH_ITERS", if full { 100 } else { 10 });
    let rust = median(through_rust(n).await);
    let mcp = median(through_mcp(n).await);
    println!(
        "tools: {n} read+edit pairs, median per pair: MCP (stdio, rmcp client) {:.2} ms, Rust API {:.2} ms: {:.2}x",
        ms(mcp),
        ms(rust),
        mcp.as_secs_f64() / rust.as_secs_f64()
    );
}
