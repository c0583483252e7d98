//! Soak test for streaming: many rounds of concurrent high-volume output through one VM, with a
//! no-progress watchdog that dumps what every side was doing when a stream stalls.
//!
//! ```text
//! cargo run --example soak -- [ROUNDS] [PROCS] [MIB] [STALL_SECS] [CPUS]
//! ```
//!
//! Defaults: 20 rounds of 4 processes of 64 MiB each, stall after 60 s without a byte, 2 vCPUs. One
//! process per round drops its stdout (output is then discarded by the host), one pauses its
//! reader for a while (the guest must stall, not flood the host).
//!
//! Set `KRUNBOX_KEEP_INSTANCE_DIR=1` to keep the VM's console and VMM logs after a stall.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use krunbox::{BuiltinImage, Instance, Rootfs, Sandbox};
use tokio::io::AsyncReadExt;

type AnyResult<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn arg(n: usize, default: u64) -> u64 {
    std::env::args()
        .nth(n)
        .map(|a| a.parse().expect("numeric argument"))
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> AnyResult {
    let (rounds, procs, mib, stall) = (arg(1, 20), arg(2, 4), arg(3, 64), arg(4, 60));
    let cpus = arg(5, 2) as u8;
    let vm = Sandbox::builder()
        .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
        .cpus(cpus)
        .memory_mib(512)
        .build()?
        .boot()
        .await?;
    eprintln!("soak: booted {vm:?}, vmm pid {:?}", vm.vmm_pid());
    // Every kernel message to the console (kept in the instance's console.log): if the guest
    // dies, its last words are there.
    vm.command("dmesg").args(["-n", "8"]).status().await?;
    let started = Instant::now();
    for round in 1..=rounds {
        let progress: Vec<Arc<AtomicU64>> = (0..procs).map(|_| Arc::default()).collect();
        let mut tasks = Vec::new();
        for (p, counter) in progress.iter().enumerate() {
            tasks.push(tokio::spawn(stream(vm.clone(), p, mib, counter.clone())));
        }
        let all = futures_join(tasks);
        tokio::pin!(all);
        let mut last = (0u64, Instant::now());
        loop {
            tokio::select! {
                result = &mut all => {
                    result?;
                    break;
                }
                _ = tokio::time::sleep(Duration::from_secs(1)) => {
                    let total: u64 = progress.iter().map(|c| c.load(Ordering::Relaxed)).sum();
                    if total != last.0 {
                        last = (total, Instant::now());
                    } else if last.1.elapsed() > Duration::from_secs(stall) {
                        dump(&vm, round, &progress);
                        std::process::exit(2);
                    }
                }
            }
        }
        eprintln!(
            "soak: round {round}/{rounds} done ({procs} x {mib} MiB) at {:.0} s",
            started.elapsed().as_secs_f64()
        );
    }
    vm.shutdown().await?;
    eprintln!("soak: no stall in {rounds} rounds");
    Ok(())
}

async fn futures_join(tasks: Vec<tokio::task::JoinHandle<AnyResult>>) -> AnyResult {
    let mut first = Ok(());
    for task in tasks {
        let result = task.await.expect("stream task panicked");
        if let Err(err) = &result {
            eprintln!("soak: {err}");
        }
        if first.is_ok() {
            first = result;
        }
    }
    first
}

/// One process: `head -c MIB MiB /dev/zero`, read by one of three kinds of reader.
async fn stream(vm: Instance, p: usize, mib: u64, counter: Arc<AtomicU64>) -> AnyResult {
    let bytes = mib << 20;
    let script = format!("head -c {bytes} /dev/zero; echo done >&2");
    let mut child = vm.command("sh").args(["-c", &script]).spawn().await?;
    let mut stderr = child.stderr.take().expect("piped stderr");
    let mut stdout = child.stdout.take().expect("piped stdout");
    if p == 1 {
        // A reader that goes away: the host discards the rest.
        drop(stdout);
        let mut text = String::new();
        stderr.read_to_string(&mut text).await?;
        counter.fetch_add(bytes, Ordering::Relaxed);
        if text != "done\n" {
            let end = child.wait().await;
            return Err(format!(
                "process {p}: stderr {text:?}; wait: {end:?}; violation: {:?}",
                vm.protocol_violation()
            )
            .into());
        }
    } else {
        let mut buf = vec![0u8; 256 * 1024];
        let mut received = 0u64;
        let mut paused = false;
        loop {
            let n = stdout.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            received += n as u64;
            counter.fetch_add(n as u64, Ordering::Relaxed);
            if p == 2 && !paused && received > bytes / 3 {
                paused = true;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
        if received != bytes {
            let end = child.wait().await;
            return Err(format!(
                "process {p} lost output: {received} of {bytes} bytes; wait: {end:?}; violation: {:?}",
                vm.protocol_violation()
            )
            .into());
        }
    }
    let status = child.wait().await?;
    assert!(status.success(), "process {p}: {status:?}");
    Ok(())
}

/// What every side was doing: per-stream progress, and each VMM thread's kernel wait point.
fn dump(vm: &Instance, round: u64, progress: &[Arc<AtomicU64>]) {
    eprintln!("soak: STALL in round {round}; {vm:?}");
    for (p, c) in progress.iter().enumerate() {
        eprintln!("  process {p}: {} bytes", c.load(Ordering::Relaxed));
    }
    let Some(pid) = vm.vmm_pid() else {
        eprintln!("  the VMM has exited");
        return;
    };
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return;
    };
    // Which KVM exits keep happening while nothing moves (KVM's debugfs counters, readable as
    // root where debugfs is mounted, as in the nested L1 of scripts/nested.sh).
    let kvm_stats = || -> Vec<(String, u64)> {
        let mut stats = Vec::new();
        if let Ok(dir) = std::fs::read_dir("/sys/kernel/debug/kvm") {
            for e in dir.flatten() {
                if let Ok(v) = std::fs::read_to_string(e.path()) {
                    if let Ok(v) = v.trim().parse() {
                        stats.push((e.file_name().to_string_lossy().into_owned(), v));
                    }
                }
            }
        }
        stats.sort();
        stats
    };
    let cpu_times = |pid: u32| -> Vec<(String, u64)> {
        let mut out = Vec::new();
        if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) {
            for t in dir.flatten() {
                let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                let f: Vec<&str> = stat
                    .rsplit(')')
                    .next()
                    .unwrap_or("")
                    .split_whitespace()
                    .collect();
                let ticks = f.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0)
                    + f.get(12).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0);
                out.push((t.file_name().to_string_lossy().into_owned(), ticks));
            }
        }
        out.sort();
        out
    };
    let (k1, c1) = (kvm_stats(), cpu_times(pid));
    std::thread::sleep(Duration::from_secs(5));
    let (k2, c2) = (kvm_stats(), cpu_times(pid));
    for ((name, a), (_, b)) in k1.iter().zip(&k2) {
        if b != a {
            eprintln!("  kvm {name}: +{} in 5 s", b.wrapping_sub(*a));
        }
    }
    for ((tid, a), (_, b)) in c1.iter().zip(&c2) {
        eprintln!(
            "  vmm thread {tid}: {} cpu ticks in 5 s",
            b.saturating_sub(*a)
        );
    }
    for task in tasks.flatten() {
        let path = task.path();
        let read = |f: &str| {
            std::fs::read_to_string(path.join(f))
                .unwrap_or_default()
                .trim()
                .to_string()
        };
        let stat = read("stat");
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|s| s.split_whitespace().next())
            .unwrap_or("?")
            .to_string();
        eprintln!(
            "  vmm thread {:?} {:<16} state {state} wchan {:<24} syscall {}",
            task.file_name(),
            read("comm"),
            read("wchan"),
            read("syscall")
                .split(' ')
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
}
