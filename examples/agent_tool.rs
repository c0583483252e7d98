//! An "agent tool" in miniature: run model-written Python in a fresh microVM with a time limit,
//! no network and no host environment, and hand back what it printed.
//!
//! ```sh
//! cargo run --example agent_tool -- 'print(sum(range(10)))'
//! ```
//! (On hosts whose KVM cannot boot guests, run it through `scripts/nested.sh run --`.)

use std::time::Duration;

use krunbox::{BuiltinImage, Rootfs, Sandbox};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let code = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "import platform; print('hello from', platform.release())".into());

    let sandbox = Sandbox::builder()
        .rootfs(Rootfs::builtin(BuiltinImage::Agent))
        .memory_mib(512)
        .build()?;
    let vm = sandbox.boot().await?;
    vm.write_file("/tmp/task.py", code.as_bytes()).await?;
    let out = vm
        .command("python3")
        .arg("/tmp/task.py")
        .current_dir("/tmp")
        .timeout(Duration::from_secs(30))
        .output_limit(1 << 20)
        .output()
        .await?;
    print!("{}", out.stdout_text());
    eprint!("{}", out.stderr_text());
    eprintln!("[{}]", out.status);
    vm.shutdown().await?;
    std::process::exit(out.status.code().unwrap_or(1));
}
