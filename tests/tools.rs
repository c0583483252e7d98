//! The agent tools (`krunbox::tools`) against a real microVM: files in the guest's own tmpfs
//! and on a host directory mounted at `/workspace`, real `sh` for `bash`, and the guest-side
//! search (ripgrep's crates in guest-init) for `ls`, `glob` and `grep`.
//!
//! One busybox VM for the whole test: every tool and permission path is a call on it, so the
//! test costs one boot.

mod common;

use std::path::Path;
use std::time::Duration;

use krunbox::fs::HostDir;
use krunbox::tools::{Approval, ApprovalRequest, Decision, Mode, Permissions, Toolbox};
use krunbox::{BuiltinImage, Instance, Rootfs, Sandbox};
use serde_json::json;

fn project(dir: &Path) {
    let write = |path: &str, text: &[u8]| {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write(".gitignore", b"target/\n*.log\n");
    write("src/main.rs", b"fn main() {\n    println!(\"hello\");\n}\n");
    write("src/lib.rs", b"pub fn answer() -> u32 {\n    42\n}\n");
    write("target/debug/build.rs", b"fn main() {}\n");
    write("debug.log", b"fn main in a log\n");
    write("data.bin", b"fn main\0\x01\x02\x03");
    write("config.py", b"x = 1\ny = 2\nx = 1\n");
}

async fn boot(workspace: &Path) -> Instance {
    Sandbox::builder()
        .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
        .memory_mib(512)
        .mount("/workspace", HostDir::new(workspace).expect("HostDir"))
        .build()
        .expect("sandbox definition (run scripts/setup.sh)")
        .boot()
        .await
        .expect("booting busybox")
}

async fn ok(tools: &Toolbox, name: &str, args: serde_json::Value) -> String {
    let result = tools.call(name, args.clone()).await;
    assert!(!result.is_error, "{name} {args} failed: {}", result.text);
    result.text
}

async fn fails(tools: &Toolbox, name: &str, args: serde_json::Value) -> String {
    let result = tools.call(name, args.clone()).await;
    assert!(
        result.is_error,
        "{name} {args} should fail: {}",
        result.text
    );
    result.text
}

#[test]
fn every_tool_works_on_guest_files_and_a_mount_and_permissions_hold() {
    common::run(async {
        let host = tempfile::tempdir().unwrap();
        project(host.path());
        let vm = boot(host.path()).await;
        let tools = Toolbox::builder(&vm)
            .workspace("/workspace")
            .permissions(Permissions::mode(Mode::FullAccess))
            .output_cap(4000)
            .build();

        files(&tools, host.path()).await;
        edits(&tools, host.path()).await;
        search(&tools).await;
        shell(&tools).await;
        background(&tools).await;
        permissions(&vm).await;
        rules_reach_searches_and_stdin(&vm).await;

        let unknown = fails(&tools, "rm", json!({})).await;
        assert!(unknown.contains("the tools are bash, process"), "{unknown}");
        let bad = fails(&tools, "read", json!({"file": "x"})).await;
        assert!(bad.contains("unknown field `file`"), "{bad}");
        vm.shutdown().await.unwrap();
    })
}

async fn files(tools: &Toolbox, host: &Path) {
    // read: numbered lines from an offset, on the mount.
    let main = ok(
        tools,
        "read",
        json!({"path": "src/main.rs", "offset": 2, "limit": 1}),
    )
    .await;
    assert!(
        main.starts_with("     2\t    println!(\"hello\");\n"),
        "{main}"
    );
    assert!(main.contains("read on with offset=3"), "{main}");
    let binary = ok(tools, "read", json!({"path": "data.bin"})).await;
    assert!(binary.contains("binary file (11 bytes)"), "{binary}");

    // write: in the guest's tmpfs (parents created) and on the mount (seen by the host).
    let lines: String = (1..=3000).map(|i| format!("line {i}\n")).collect();
    let wrote = ok(
        tools,
        "write",
        json!({"path": "/tmp/guest/deep/big.txt", "content": lines}),
    )
    .await;
    assert!(
        wrote.starts_with("created /tmp/guest/deep/big.txt"),
        "{wrote}"
    );
    ok(
        tools,
        "write",
        json!({"path": "notes.md", "content": "# notes\n"}),
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(host.join("notes.md")).unwrap(),
        "# notes\n"
    );

    // A read past the output cap is cut at a line, saying how to read on.
    let big = ok(tools, "read", json!({"path": "/tmp/guest/deep/big.txt"})).await;
    assert!(big.starts_with("     1\tline 1\n     2\tline 2\n"), "{big}");
    assert!(big.contains("bytes of output: showing lines 1-"), "{big}");
    let tail = ok(
        tools,
        "read",
        json!({"path": "/tmp/guest/deep/big.txt", "offset": 2999}),
    )
    .await;
    assert_eq!(tail, "  2999\tline 2999\n  3000\tline 3000\n");
    let missing = fails(tools, "read", json!({"path": "nope.txt"})).await;
    assert!(missing.contains("nope.txt"), "{missing}");
}

async fn edits(tools: &Toolbox, host: &Path) {
    let config = || std::fs::read_to_string(host.join("config.py")).unwrap();
    let original = config();
    let ambiguous = fails(
        tools,
        "edit",
        json!({"path": "config.py",
        "edits": [{"old_string": "x = 1", "new_string": "x = 9"}]}),
    )
    .await;
    assert!(ambiguous.contains("occurs 2 times"), "{ambiguous}");
    assert_eq!(config(), original);

    // All or none: the first edit applies in memory, the second fails, the file is untouched.
    let partial = fails(
        tools,
        "edit",
        json!({"path": "config.py", "edits": [
        {"old_string": "y = 2", "new_string": "y = 3"},
        {"old_string": "z = 0", "new_string": "z = 1"}]}),
    )
    .await;
    assert!(
        partial.contains("edit 2: old_string was not found"),
        "{partial}"
    );
    assert_eq!(config(), original);

    ok(
        tools,
        "edit",
        json!({"path": "config.py", "edits": [
        {"old_string": "y = 2", "new_string": "y = 3"},
        {"old_string": "x = 1", "new_string": "x = 5", "replace_all": true}]}),
    )
    .await;
    assert_eq!(config(), "x = 5\ny = 3\nx = 5\n");
    // An edit in the guest's own files, read back through the tool.
    ok(
        tools,
        "edit",
        json!({"path": "/tmp/guest/deep/big.txt",
        "edits": [{"old_string": "line 1500\n", "new_string": "line fifteen hundred\n"}]}),
    )
    .await;
    let edited = ok(
        tools,
        "read",
        json!({"path": "/tmp/guest/deep/big.txt", "offset": 1500, "limit": 1}),
    )
    .await;
    assert!(
        edited.starts_with("  1500\tline fifteen hundred\n"),
        "{edited}"
    );
}

async fn search(tools: &Toolbox) {
    // .gitignore holds: target/ and *.log are neither listed nor searched.
    let listed = ok(tools, "ls", json!({})).await;
    assert!(
        listed.contains("src/\n") && listed.contains("config.py (18 bytes)"),
        "{listed}"
    );
    assert!(
        !listed.contains("target") && !listed.contains("debug.log"),
        "{listed}"
    );
    let rs = ok(tools, "glob", json!({"pattern": "*.rs"})).await;
    assert_eq!(rs, "/workspace/src/lib.rs\n/workspace/src/main.rs\n");
    let grep = ok(
        tools,
        "grep",
        json!({"pattern": "FN MAIN", "case_insensitive": true, "context": 1}),
    )
    .await;
    assert_eq!(
        grep,
        "/workspace/src/main.rs:1:fn main() {\n/workspace/src/main.rs-2-    println!(\"hello\");\n\
         [1 binary files skipped]\n"
    );
    let files = ok(
        tools,
        "grep",
        json!({"pattern": "line 2\\d\\d\\d", "path": "/tmp/guest", "output": "files"}),
    )
    .await;
    assert_eq!(files, "/tmp/guest/deep/big.txt\n");
    // Past the output cap, grep's lines are cut with a note.
    let many = ok(
        tools,
        "grep",
        json!({"pattern": "^line", "path": "/tmp/guest"}),
    )
    .await;
    assert!(
        many.contains("[cut at ") && many.contains("narrow the pattern"),
        "{many}"
    );
    let bad = fails(tools, "grep", json!({"pattern": "("})).await;
    assert!(bad.contains("regex"), "{bad}");
}

async fn shell(tools: &Toolbox) {
    let out = fails(
        tools,
        "bash",
        json!({"command": "echo out; echo err >&2; exit 3"}),
    )
    .await;
    assert!(
        out.starts_with("exit code 3\n") && out.contains("out\n") && out.contains("err\n"),
        "{out}"
    );
    let cwd = ok(tools, "bash", json!({"command": "pwd && ls src"})).await;
    assert_eq!(cwd, "exit code 0\n/workspace\nlib.rs\nmain.rs\n");
    // Long output keeps its head and tail around a note.
    let long = ok(tools, "bash", json!({"command": "seq 1 100000"})).await;
    assert!(long.contains("bytes of output cut here"), "{long}");
    assert!(
        long.starts_with("exit code 0\n1\n2\n") && long.ends_with("99999\n100000\n"),
        "{long}"
    );
    let slow = fails(
        tools,
        "bash",
        json!({"command": "sleep 30", "timeout_secs": 1}),
    )
    .await;
    assert!(slow.starts_with("timed out after 1s"), "{slow}");
}

async fn background(tools: &Toolbox) {
    let ticker = ok(
        tools,
        "bash",
        json!({"background": true,
        "command": "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.2; done"}),
    )
    .await;
    assert!(
        ticker.starts_with("started background process 1"),
        "{ticker}"
    );
    let echo = ok(
        tools,
        "bash",
        json!({"background": true, "command": "read line; echo got $line"}),
    )
    .await;
    assert!(echo.starts_with("started background process 2"), "{echo}");

    let first = poll_until(tools, 1, "tick 1").await;
    assert!(
        first.starts_with("process 1 (pid ") && first.contains(": running\n"),
        "{first}"
    );
    // A poll shows only what came after the previous one.
    let second = poll_until(tools, 1, "tick").await;
    assert!(!second.contains("tick 0\n"), "{second}");

    ok(
        tools,
        "process",
        json!({"action": "write", "id": 2, "input": "hello\n", "close_stdin": true}),
    )
    .await;
    let answered = poll_until(tools, 2, "exit code 0").await;
    assert!(answered.contains("got hello\n"), "{answered}");

    let killed = ok(tools, "process", json!({"action": "kill", "id": 1})).await;
    assert_eq!(killed, "process 1 ended: killed by signal 9");
    let list = ok(tools, "process", json!({"action": "list"})).await;
    assert!(
        list.contains("1\tpid ") && list.contains("killed by signal 9"),
        "{list}"
    );
    // The kill took the whole process group: no shell still ticks (`[t]` keeps this command's
    // own text from matching).
    let gone = ok(
        tools,
        "bash",
        json!({"command": "ps -o args | grep -c '[t]ick' || true"}),
    )
    .await;
    assert_eq!(gone, "exit code 0\n0\n");
    let nothing = fails(tools, "process", json!({"action": "poll", "id": 7})).await;
    assert!(nothing.contains("no background process 7"), "{nothing}");
}

/// Polls until a poll shows `wanted`; returns every poll's text, in order.
async fn poll_until(tools: &Toolbox, id: u32, wanted: &str) -> String {
    let mut seen = String::new();
    for _ in 0..200 {
        let polled = ok(tools, "process", json!({"action": "poll", "id": id})).await;
        seen += &polled;
        if polled.contains(wanted) {
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("process {id} never printed {wanted:?}: {seen}");
}

async fn permissions(vm: &Instance) {
    let permissions: Permissions = serde_json::from_value(json!({
        "mode": "read-only",
        "rules": [
            {"deny": "bash(rm:*)"},
            {"ask": "bash(echo:*)"},
            {"allow": "write(/tmp/**)"},
        ]
    }))
    .unwrap();
    let tools = Toolbox::builder(vm)
        .workspace("/workspace")
        .permissions(permissions)
        .approver(|request: ApprovalRequest| async move {
            match request.arguments["command"].as_str() {
                Some("echo approved") => Approval::Approve,
                Some("echo panic") => panic!("the approver broke"),
                _ => Approval::Refuse(Some("not that one".into())),
            }
        })
        .build();
    let mut audit = tools.audit_events();

    let denied = fails(
        &tools,
        "bash",
        json!({"command": "ls && rm -rf /workspace"}),
    )
    .await;
    assert!(
        denied.contains("permission denied: `deny bash(rm:*)`"),
        "{denied}"
    );
    let refused = fails(&tools, "bash", json!({"command": "echo no"})).await;
    assert!(refused.ends_with("was refused: not that one"), "{refused}");
    let broke = fails(&tools, "bash", json!({"command": "echo panic"})).await;
    assert!(
        broke.contains("the approver failed: the approver broke"),
        "{broke}"
    );
    let approved = ok(&tools, "bash", json!({"command": "echo approved"})).await;
    assert_eq!(approved, "exit code 0\napproved\n");
    // The mode: read-only refuses writes outside the rule, allows reads.
    ok(
        &tools,
        "write",
        json!({"path": "/tmp/allowed.txt", "content": "x"}),
    )
    .await;
    let mode = fails(&tools, "write", json!({"path": "x.txt", "content": "x"})).await;
    assert!(mode.contains("`mode read-only` forbids"), "{mode}");
    ok(&tools, "read", json!({"path": "src/lib.rs"})).await;

    let mut decisions = Vec::new();
    while let Ok(event) = audit.try_recv() {
        decisions.push((event.tool, event.decision, event.by));
    }
    assert_eq!(
        decisions,
        [
            ("bash", Decision::Denied, "deny bash(rm:*)".to_string()),
            ("bash", Decision::Refused, "ask bash(echo:*)".into()),
            ("bash", Decision::Refused, "ask bash(echo:*)".into()),
            ("bash", Decision::Approved, "ask bash(echo:*)".into()),
            ("write", Decision::Allowed, "allow write(/tmp/**)".into()),
            ("write", Decision::Denied, "mode read-only".into()),
            ("read", Decision::Allowed, "mode read-only".into()),
        ]
    );
}

/// A path rule that keeps files from `read` keeps them from searches too, and what `process`
/// writes to a background shell is held to the `bash` rules.
async fn rules_reach_searches_and_stdin(vm: &Instance) {
    let permissions: Permissions = serde_json::from_value(json!({
        "mode": "full-access",
        "rules": [{"deny": "read(/workspace/src/**)"}, {"deny": "bash(rm:*)"}]
    }))
    .unwrap();
    let tools = Toolbox::builder(vm)
        .workspace("/workspace")
        .permissions(permissions)
        .build();
    let found = ok(&tools, "grep", json!({"pattern": "fn ", "output": "files"})).await;
    assert_eq!(found, "no matches for \"fn \" under /workspace (5 files searched, 1 binary files skipped)\n[2 results withheld by permission rules]\n");
    let listed = ok(&tools, "glob", json!({"pattern": "/workspace/**/*.rs"})).await;
    assert!(
        listed.starts_with("no files under /workspace match"),
        "{listed}"
    );
    assert!(listed.contains("[2 results withheld"), "{listed}");

    let shell = ok(&tools, "bash", json!({"command": "sh", "background": true})).await;
    let id: u32 = shell["started background process ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let refused = fails(
        &tools,
        "process",
        json!({"action": "write", "id": id, "input": "rm -rf /workspace\n"}),
    )
    .await;
    assert!(refused.contains("`deny bash(rm:*)` forbids"), "{refused}");
    // Written in pieces, the line is decided whole.
    ok(
        &tools,
        "process",
        json!({"action": "write", "id": id, "input": "r"}),
    )
    .await;
    let pieces = fails(
        &tools,
        "process",
        json!({"action": "write", "id": id, "input": "m -rf /workspace\n"}),
    )
    .await;
    assert!(pieces.contains("`deny bash(rm:*)` forbids"), "{pieces}");
    ok(&tools, "process", json!({"action": "kill", "id": id})).await;
}
