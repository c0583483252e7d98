//! The sandboxes the network tests boot, and running a shell script in one's guest.

use std::time::{Duration, Instant};

use krunbox::{BuiltinImage, Instance, Network, Rootfs, Sandbox};

/// A sandbox on a built-in image, with `network` (none: no network device at all). Busybox
/// gets 256 MiB; the agent image (Python, git, pip) 512.
pub fn sandbox(image: BuiltinImage, network: Option<Network>) -> Sandbox {
    let memory_mib = match image {
        BuiltinImage::Busybox => 256,
        BuiltinImage::Agent => 512,
    };
    let mut builder = Sandbox::builder()
        .rootfs(Rootfs::builtin(image))
        .memory_mib(memory_mib);
    if let Some(network) = network {
        builder = builder.network(network);
    }
    builder
        .build()
        .expect("sandbox definition (run scripts/setup.sh)")
}

/// Runs `script` with `sh -c` in the guest, giving up after `timeout`: what it wrote (stdout,
/// then stderr) and how long it took.
pub async fn sh(vm: &Instance, script: &str, timeout: Duration) -> (String, Duration) {
    let started = Instant::now();
    let out = vm
        .command("sh")
        .args(["-c", script])
        .timeout(timeout)
        .output()
        .await
        .expect("running sh in the guest");
    let text = format!("{}{}", out.stdout_text(), out.stderr_text());
    (text, started.elapsed())
}
