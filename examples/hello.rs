//! The smallest program of your own on krunbox: boot a microVM from the built-in busybox image,
//! run a command in it, print what it printed, and say so if the command failed.
//!
//! Its `Cargo.toml` needs two dependencies (the test command builds exactly this file as a
//! fresh project outside this repository: `scripts/as-a-user.sh`):
//!
//! ```toml
//! [dependencies]
//! krunbox = { path = "/path/to/krunbox" }
//! tokio = { version = "1", features = ["rt-multi-thread", "macros"] }
//! ```
//!
//! ```sh
//! cargo run --example hello -- uname -r
//! ```
//! (On hosts whose KVM cannot boot guests, run it through `scripts/nested.sh run --`.)

use krunbox::{BuiltinImage, Rootfs, Sandbox};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.is_empty() {
        argv = vec!["uname".into(), "-r".into()];
    }

    let sandbox = Sandbox::builder()
        .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
        .build()?;
    let vm = sandbox.boot().await?;
    let out = vm.command(&argv[0]).args(&argv[1..]).output().await?;
    vm.shutdown().await?;

    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        return Err(format!("{argv:?} failed: {:?}", out.status).into());
    }
    Ok(())
}
