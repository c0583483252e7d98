//! The glue an agent framework writes to give a model a sandbox: a project directory mounted
//! at `/workspace`, the ready-made tools over it (bash, read, edit, grep, …), permissions from
//! a JSON config, and a loop that runs the model's tool calls and hands back results in the
//! model API's own shapes.
//!
//! The model here is stdin: each line is an Anthropic `tool_use` block (or, with `--openai`,
//! an OpenAI `tool_call`); each answer is printed as the matching `tool_result` / tool message.
//! In a framework, those lines come from and go to the model's API. The tool definitions to
//! send the model are printed first.
//!
//! ```sh
//! cargo run --example agent_tool -- ./my-project <<'EOF'
//! {"type": "tool_use", "id": "t1", "name": "grep", "input": {"pattern": "TODO", "glob": "*.rs"}}
//! {"type": "tool_use", "id": "t2", "name": "bash", "input": {"command": "ls -la"}}
//! {"type": "tool_use", "id": "t3", "name": "bash", "input": {"command": "curl -s example.com"}}
//! EOF
//! ```
//! (On hosts whose KVM cannot boot guests, run it through `scripts/nested.sh run --`.)

use std::path::PathBuf;

use krunbox::fs::HostDir;
use krunbox::tools::{Approval, ApprovalRequest, Permissions, Toolbox};
use krunbox::{BuiltinImage, Rootfs, Sandbox};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};

/// What the framework's configuration would hold: the workspace may be changed, `curl` needs
/// a yes from the user, pushing is never allowed.
const PERMISSIONS: &str = r#"{
    "mode": "workspace-write",
    "rules": [
        {"deny": "bash(git push:*)"},
        {"ask": "bash(curl:*)"}
    ]
}"#;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let project = PathBuf::from(args.next().unwrap_or_else(|| ".".into()));
    let openai = args.next().as_deref() == Some("--openai");

    let sandbox = Sandbox::builder()
        .rootfs(Rootfs::builtin(BuiltinImage::Agent))
        .memory_mib(1024)
        .mount("/workspace", HostDir::new(&project)?)
        .build()?;
    let vm = sandbox.boot().await?;

    let permissions: Permissions = serde_json::from_str(PERMISSIONS)?;
    let tools = Toolbox::builder(&vm)
        .workspace("/workspace")
        .permissions(permissions)
        // Where a framework would prompt its user.
        .approver(|request: ApprovalRequest| async move {
            eprintln!("[approval] refusing {} {}", request.tool, request.arguments);
            Approval::Refuse(Some("the user said no".into()))
        })
        .build();

    // Every decision, for the framework's log.
    let mut audit = tools.audit_events();
    tokio::spawn(async move {
        while let Ok(event) = audit.recv().await {
            eprintln!(
                "[audit] {} {:?} by {}: {}",
                event.tool, event.decision, event.by, event.subject
            );
        }
    });

    // 1. What the model is told it can call.
    let definitions: Vec<Value> = tools
        .definitions()
        .iter()
        .map(|tool| {
            if openai {
                tool.to_openai()
            } else {
                tool.to_anthropic()
            }
        })
        .collect();
    println!("{}", json!({ "tools": definitions }));

    // 2. The model's calls, one at a time, and the results it gets back.
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let call: Value = match serde_json::from_str(&line) {
            Ok(call) => call,
            Err(err) => {
                eprintln!("not JSON: {err}");
                continue;
            }
        };
        let answer = if openai {
            // {"id", "type": "function", "function": {"name", "arguments": "<JSON text>"}}
            let function = &call["function"];
            let arguments = serde_json::from_str(function["arguments"].as_str().unwrap_or("{}"))
                .unwrap_or(Value::Null);
            let name = function["name"].as_str().unwrap_or_default();
            let result = tools.call(name, arguments).await;
            result.to_openai(call["id"].as_str().unwrap_or_default())
        } else {
            // {"type": "tool_use", "id", "name", "input"}
            let name = call["name"].as_str().unwrap_or_default();
            let result = tools.call(name, call["input"].clone()).await;
            result.to_anthropic(call["id"].as_str().unwrap_or_default())
        };
        println!("{answer}");
    }
    vm.shutdown().await?;
    Ok(())
}
