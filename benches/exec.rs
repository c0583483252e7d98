//! Command execution on one booted VM: round-trip latency and stdout/stdin throughput, each
//! against the same operation done locally on the host.
//!
//! One busybox VM (2 vCPUs, 512 MiB) is booted once; then, alternating guest and host:
//!
//! - **round trip**: `vm.command("true").output()` against a local fork+exec of `/bin/true`
//!   (`tokio::process::Command::output`), median of N each;
//! - **stdout**: `head -c BYTES /dev/zero` in the guest, read through [`Child::stdout`] with a
//!   256 KiB buffer, against the same `head` spawned on the host and read through its pipe;
//! - **stdin**: BYTES written into `wc -c` through [`Stdio::piped`], against the same into a
//!   local `wc -c`; the count `wc` prints is checked.
//!
//! Throughput times run from spawn to exit (a process's start is part of the cost), one
//! transfer per side: at BYTES = 256 MiB a transfer is long enough to average itself, and under
//! emulation the guest moves only a few MiB/s. Every result is checked (exit status, exact byte
//! counts): a broken run panics rather than print numbers.
//!
//! Under nested emulation (how this is run on machines without usable KVM) absolute times mean
//! little; the ratios against the host baseline measured in the same run are what we report.
//!
//! `cargo bench` (which passes `--bench`): N = 20 round trips, BYTES = 256 MiB. Without
//! `--bench` (`cargo test --benches` runs it as a smoke test): N = 3, BYTES = 16 MiB, printing
//! the same lines. `KRUNBOX_BENCH_ITERS` sets N and `KRUNBOX_BENCH_MIB` sets BYTES (in MiB), in
//! either mode.
//!
//! [`Child::stdout`]: krunbox::Child::stdout
//! [`Stdio::piped`]: krunbox::Stdio::piped

mod common;

use common::{env_or, median};
use std::process::Stdio as StdStdio;
use std::time::{Duration, Instant};

use krunbox::{BuiltinImage, Instance, Rootfs, Sandbox, Stdio};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const BUF: usize = 256 * 1024;
const MIB: f64 = 1024.0 * 1024.0;

fn mib_per_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / MIB / d.as_secs_f64()
}

/// Reads `reader` to its end with a `BUF`-sized buffer, counting bytes.
async fn count<R: AsyncRead + Unpin>(mut reader: R) -> u64 {
    let mut buf = vec![0u8; BUF];
    let mut total = 0u64;
    loop {
        let n = reader.read(&mut buf).await.expect("reading stdout");
        if n == 0 {
            return total;
        }
        total += n as u64;
    }
}

/// Reads `reader` to its end into a string (small outputs: `wc`, stderr).
async fn text<R: AsyncRead + Unpin>(mut reader: R) -> String {
    let mut s = String::new();
    reader.read_to_string(&mut s).await.expect("reading output");
    s
}

/// Writes `bytes` zero bytes in `BUF`-sized writes, then closes the stream.
async fn feed<W: AsyncWrite + Unpin>(mut writer: W, bytes: u64) {
    let buf = vec![0u8; BUF];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(BUF as u64) as usize;
        writer.write_all(&buf[..n]).await.expect("writing stdin");
        left -= n as u64;
    }
    writer.shutdown().await.expect("closing stdin");
}

/// `wc -c`'s output as a number.
fn wc_count(out: &str) -> u64 {
    out.trim()
        .parse()
        .unwrap_or_else(|_| panic!("wc -c printed {out:?}"))
}

async fn guest_true(vm: &Instance) -> Duration {
    let start = Instant::now();
    let out = vm.command("true").output().await.expect("guest true");
    let elapsed = start.elapsed();
    assert!(out.status.success(), "guest true: {}", out.status);
    elapsed
}

async fn host_true() -> Duration {
    let start = Instant::now();
    let out = tokio::process::Command::new("/bin/true")
        .output()
        .await
        .expect("host /bin/true");
    let elapsed = start.elapsed();
    assert!(out.status.success(), "host /bin/true: {}", out.status);
    elapsed
}

async fn guest_stdout(vm: &Instance, bytes: u64) -> Duration {
    let start = Instant::now();
    let mut child = vm
        .command("head")
        .args(["-c", &bytes.to_string(), "/dev/zero"])
        .spawn()
        .await
        .expect("guest head");
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (got, err) = tokio::join!(count(stdout), text(stderr));
    let status = child.wait().await.expect("guest head: wait");
    let elapsed = start.elapsed();
    assert!(status.success(), "guest head: {status}; stderr: {err}");
    assert_eq!(got, bytes, "guest head: byte count; stderr: {err}");
    elapsed
}

async fn host_stdout(bytes: u64) -> Duration {
    let start = Instant::now();
    let mut child = tokio::process::Command::new("head")
        .args(["-c", &bytes.to_string(), "/dev/zero"])
        .stdin(StdStdio::null())
        .stdout(StdStdio::piped())
        .stderr(StdStdio::piped())
        .spawn()
        .expect("host head");
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (got, err) = tokio::join!(count(stdout), text(stderr));
    let status = child.wait().await.expect("host head: wait");
    let elapsed = start.elapsed();
    assert!(status.success(), "host head: {status}; stderr: {err}");
    assert_eq!(got, bytes, "host head: byte count; stderr: {err}");
    elapsed
}

async fn guest_stdin(vm: &Instance, bytes: u64) -> Duration {
    let start = Instant::now();
    let mut child = vm
        .command("wc")
        .arg("-c")
        .stdin(Stdio::piped())
        .spawn()
        .await
        .expect("guest wc");
    let stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let ((), out, err) = tokio::join!(feed(stdin, bytes), text(stdout), text(stderr));
    let status = child.wait().await.expect("guest wc: wait");
    let elapsed = start.elapsed();
    assert!(status.success(), "guest wc: {status}; stderr: {err}");
    assert_eq!(wc_count(&out), bytes, "guest wc: byte count");
    elapsed
}

async fn host_stdin(bytes: u64) -> Duration {
    let start = Instant::now();
    let mut child = tokio::process::Command::new("wc")
        .arg("-c")
        .stdin(StdStdio::piped())
        .stdout(StdStdio::piped())
        .stderr(StdStdio::piped())
        .spawn()
        .expect("host wc");
    let stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let ((), out, err) = tokio::join!(feed(stdin, bytes), text(stdout), text(stderr));
    let status = child.wait().await.expect("host wc: wait");
    let elapsed = start.elapsed();
    assert!(status.success(), "host wc: {status}; stderr: {err}");
    assert_eq!(wc_count(&out), bytes, "host wc: byte count");
    elapsed
}

fn report_rate(what: &str, bytes: u64, host: Duration, guest: Duration) {
    let (h, g) = (mib_per_s(bytes, host), mib_per_s(bytes, guest));
    let mib = bytes / (1 << 20);
    let label = |side: &str| format!("exec/{what}-{side}");
    println!("{:<30}        {h:>10.1} MiB/s  ({mib} MiB)", label("host"));
    println!("{:<30}        {g:>10.1} MiB/s  ({mib} MiB)", label("guest"));
    println!("{:<30} {:.3}x", label("ratio guest / host"), g / h);
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs us once as a smoke test.
    let smoke = !std::env::args().any(|a| a == "--bench");
    let (iters, mib) = if smoke { (3, 16) } else { (20, 256) };
    let iters = env_or("KRUNBOX_BENCH_ITERS", iters);
    let bytes = env_or("KRUNBOX_BENCH_MIB", mib) as u64 * (1 << 20);

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let sandbox = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .cpus(2)
            .memory_mib(512)
            .build()
            .unwrap();
        let vm = sandbox.boot().await.expect("boot");

        // Warm both sides once, unmeasured (page cache, first-exec costs).
        guest_true(&vm).await;
        host_true().await;

        let (mut g, mut h) = (Vec::new(), Vec::new());
        for _ in 0..iters {
            h.push(host_true().await);
            g.push(guest_true(&vm).await);
        }
        let (g, h) = (median(g), median(h));
        println!("{:<30} median {h:>10.3?}  ({iters} runs)", "exec/true-host");
        println!(
            "{:<30} median {g:>10.3?}  ({iters} runs)",
            "exec/true-guest"
        );
        println!(
            "{:<30} {:.2}x",
            "exec/true-ratio guest / host",
            g.as_secs_f64() / h.as_secs_f64()
        );

        let h = host_stdout(bytes).await;
        let g = guest_stdout(&vm, bytes).await;
        report_rate("stdout", bytes, h, g);

        let h = host_stdin(bytes).await;
        let g = guest_stdin(&vm, bytes).await;
        report_rate("stdin", bytes, h, g);

        assert!(vm.is_running(), "the VM died during the benchmark");
        vm.shutdown().await.expect("shutdown");
    });
}
