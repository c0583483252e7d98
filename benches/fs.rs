//! Workspaces: small-file operations per second and large-file MiB/s through our filesystems
//! (`src/fs/`: FUSE in the guest, relayed by guest-init over vsock to the library), against
//! libkrun's own virtio-fs passthrough of the same host directory in the same run.
//!
//! One busybox VM (1 vCPU, 256 MiB) is booted once with three mounts, so that every side runs
//! on the same guest kernel, vCPU and page cache, one after another:
//!
//! - **memfs**: a [`MemoryFs`] at `/tmp/memfs`;
//! - **hostdir**: a [`HostDir`] of a host temporary directory `T` at `/tmp/hostdir`;
//! - **passthrough**: the same directory `T` served by libkrun's virtio-fs passthrough server
//!   inside the VMM helper, given to the instance through the bench-only
//!   `SandboxBuilder::virtiofs_passthrough_for_benchmarks` and mounted by the guest itself
//!   (`mount -t virtiofs fsbench /tmp/baseline`). Not a supported way to share a directory
//!   (the server does not jail itself); here it is only the baseline.
//!
//! Before the boot `T/small/` and the `MemoryFs`'s `/small/` are seeded alike with F files of
//! 4 KiB (`f0` … `f{F-1}`, each beginning with the line `krunbox-fs-bench fI`). The guest's
//! commands are identical on every side, in the side's directory:
//!
//! - **stat**: `[ -f small/fI ]` for each file (one `stat(2)`);
//! - **read**: `read -r line < small/fI` for each file (open, one read of the first line, which
//!   fetches the file's 4 KiB page, close), and the line is checked;
//! - **write**: `echo "$DATA" > w-SIDE-R/fI` for F new files (create, one 4 KiB write, close);
//!   the host checks every file's bytes afterwards;
//! - **large write**: `dd if=/dev/zero of=big-SIDE bs=1M count=M`; the host checks its size;
//! - **large read**: `dd if=big-SIDE of=/dev/null bs=1M`.
//!
//! Before each of them the guest drops its caches (`sync; echo 3 > /proc/sys/vm/drop_caches`),
//! so every figure is cold: each stat is a lookup the filesystem answers, each read reaches it,
//! and neither side's attribute timeout (ours 1 s, the passthrough's 5 s) decides anything.
//! The small-file loops are shell builtins only (busybox ash's `[`, `read`, `echo` and
//! redirections: no process is started in them), and the time is taken inside the guest, from
//! the kernel's monotonic clock in `/proc/timer_list` read by the builtin `read` (busybox's
//! `date` has no `%N`), so neither a command's round trip through the control channel nor a
//! process start is in the small-file figures; the large-file figures include one start of
//! `dd`. What the guest wrote is removed after each round, unmeasured: by the guest in memory,
//! by the host in `T` (libkrun's passthrough lists a host tmpfs directory that is being emptied
//! incompletely, so a guest's `rm -r` there can fail with `ENOTEMPTY`).
//!
//! Rounds rotate the sides (each round all three, each side first in turn); medians are printed
//! with the ratios memfs / passthrough and hostdir / passthrough (higher is better for us on
//! all: the issue's goal is at least 0.8). The bench reports, it asserts no timing; a wrong
//! result (a file's bytes, a size, an exit status) fails it. Under nested emulation (how this
//! runs on machines without usable KVM) absolute figures mean little; the ratios measured in
//! the same run are what we report.
//!
//! `cargo bench` (which passes `--bench`): 5 rounds of 1000 files and 128 MiB; under nested
//! emulation (`KRUNBOX_NESTED_POOL` set: its guests fault under sustained I/O, and its rounds
//! vary a lot, hence 5 of them) 300 files and 16 MiB. Without `--bench` (`cargo test
//! --benches`, and `scripts/test.sh` runs it once as a smoke test): 2 rounds, 20 files, 1 MiB,
//! about a minute in the nested L1 (debug builds of the library and the VMM helper: a cold
//! small-file operation costs tens of milliseconds there, so a few hundred files would take
//! minutes). `KRUNBOX_BENCH_ITERS` sets the rounds, `KRUNBOX_BENCH_FILES` F and
//! `KRUNBOX_BENCH_MIB` M, in either mode.

use std::time::Duration;

use krunbox::fs::{HostDir, MemoryFs};
use krunbox::{BuiltinImage, Instance, Rootfs, Sandbox};

const SMALL: usize = 4096;
/// The virtio-fs tag of the passthrough share.
const TAG: &str = "fsbench";
/// A guest command's deadline: generous, a round under nested emulation is minutes.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(900);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn env_or(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => match v.parse() {
            Ok(n) if n > 0 => n,
            _ => panic!("{name}={v:?}: expected a positive integer"),
        },
        Err(_) => default,
    }
}

/// Seeded file `i`: its first line names it, the rest is padding to 4 KiB.
fn seed(i: usize) -> Vec<u8> {
    let mut bytes = format!("krunbox-fs-bench f{i}\n").into_bytes();
    bytes.resize(SMALL - 1, b'.');
    bytes.push(b'\n');
    bytes
}

/// What the guest's `echo "$DATA"` writes to each new file.
fn written() -> Vec<u8> {
    let mut bytes = vec![b'x'; SMALL - 1];
    bytes.push(b'\n');
    bytes
}

/// The shell's clock: nanoseconds of the guest kernel's monotonic clock into `$T`, from the
/// third line of `/proc/timer_list` ("now at N nsecs"), with builtins only.
const CLOCK: &str = "clock() { { read -r _; read -r _; read -r _ _ T _; } < /proc/timer_list; }";

/// The guest's script for one round of one side: prints `NAME NANOSECONDS` for each workload.
fn workload(dir: &str, write_dir: &str, big: &str, files: usize, mib: u64) -> String {
    format!(
        r#"set -e
{CLOCK}
drop() {{ sync; echo 3 > /proc/sys/vm/drop_caches; }}
cd {dir}
DATA=$(head -c {data} /dev/zero | tr '\0' x)
N={files}

drop; clock; t0=$T
i=0; while [ $i -lt $N ]; do
  [ -f small/f$i ] || {{ echo "no small/f$i" >&2; exit 3; }}
  i=$((i + 1))
done
clock; echo "stat $((T - t0))"

drop; clock; t0=$T
i=0; while [ $i -lt $N ]; do
  read -r line < small/f$i
  [ "$line" = "krunbox-fs-bench f$i" ] || {{ echo "small/f$i begins with $line" >&2; exit 4; }}
  i=$((i + 1))
done
clock; echo "read $((T - t0))"

mkdir {write_dir}
drop; clock; t0=$T
i=0; while [ $i -lt $N ]; do
  echo "$DATA" > {write_dir}/f$i
  i=$((i + 1))
done
clock; echo "write $((T - t0))"

drop; clock; t0=$T
dd if=/dev/zero of={big} bs=1048576 count={mib} 2>/dev/null
clock; echo "bigwrite $((T - t0))"

drop; clock; t0=$T
dd if={big} of=/dev/null bs=1048576 2>/dev/null
clock; echo "bigread $((T - t0))"
"#,
        data = SMALL - 1,
    )
}

/// Where a side keeps what its guest commands wrote, for the host's checks.
enum Store {
    Memory(MemoryFs),
    /// The host directory `T`.
    Dir(std::path::PathBuf),
}

impl Store {
    fn read(&self, path: &str) -> Vec<u8> {
        match self {
            Store::Memory(fs) => fs
                .read_file(&format!("/{path}"))
                .unwrap_or_else(|e| panic!("MemoryFs: reading /{path}: {e:?}")),
            Store::Dir(dir) => std::fs::read(dir.join(path))
                .unwrap_or_else(|e| panic!("{}: reading {path}: {e}", dir.display())),
        }
    }

    /// Removes what a round wrote: the guest does in memory (`rm -r`), the host in `T`.
    /// (libkrun's passthrough lists a host tmpfs directory that is being emptied
    /// incompletely, so a guest's `rm -r` there can fail with `ENOTEMPTY`.)
    async fn remove(&self, vm: &Instance, guest_dir: &str, paths: &[&str], what: &str) {
        match self {
            Store::Memory(_) => {
                guest_sh(
                    vm,
                    &format!("{what}: cleaning up"),
                    &format!("cd {guest_dir} && rm -r {}", paths.join(" ")),
                )
                .await;
            }
            Store::Dir(dir) => {
                for path in paths {
                    let path = dir.join(path);
                    if path.is_dir() {
                        std::fs::remove_dir_all(&path)
                    } else {
                        std::fs::remove_file(&path)
                    }
                    .unwrap_or_else(|e| panic!("{what}: removing {}: {e}", path.display()));
                }
            }
        }
    }

    fn size(&self, path: &str) -> u64 {
        match self {
            Store::Memory(_) => self.read(path).len() as u64,
            Store::Dir(dir) => std::fs::metadata(dir.join(path))
                .unwrap_or_else(|e| panic!("{}: {path}: {e}", dir.display()))
                .len(),
        }
    }
}

/// One side under test: where the guest reaches it, and what it measured.
struct Side {
    name: &'static str,
    /// Its guest mount point.
    dir: &'static str,
    store: Store,
    stat: Vec<f64>,
    read: Vec<f64>,
    write: Vec<f64>,
    big_write: Vec<f64>,
    big_read: Vec<f64>,
}

/// Runs `script` in the guest's shell and returns its stdout; a failure panics with the
/// command's status and output.
async fn guest_sh(vm: &Instance, what: &str, script: &str) -> String {
    let out = vm
        .command("sh")
        .args(["-c", script])
        .timeout(COMMAND_TIMEOUT)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}\n{}{}",
        out.status,
        out.stdout_text(),
        out.stderr_text()
    );
    out.stdout_text()
}

/// One round of one side: the workloads, the host's checks of what was written, the cleanup.
/// Returns the rates (ops/s for the small files, MiB/s for the large one) in the script's
/// order: stat, read, write, large write, large read.
async fn round(vm: &Instance, side: &Side, label: &str, files: usize, mib: u64) -> [f64; 5] {
    let write_dir = format!("w-{}-{label}", side.name);
    let big = format!("big-{}", side.name);
    let what = format!("{}, round {label}", side.name);
    let out = guest_sh(vm, &what, &workload(side.dir, &write_dir, &big, files, mib)).await;
    let times: Vec<(String, f64)> = out
        .lines()
        .map(|line| {
            let (name, ns) = line
                .split_once(' ')
                .unwrap_or_else(|| panic!("{what}: unexpected output {line:?}"));
            let ns: u64 = ns
                .parse()
                .unwrap_or_else(|_| panic!("{what}: unexpected output {line:?}"));
            (name.to_string(), ns.max(1) as f64 / 1e9)
        })
        .collect();
    let names: Vec<&str> = times.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["stat", "read", "write", "bigwrite", "bigread"],
        "{what}: {out}"
    );

    let expected = written();
    for i in 0..files {
        let path = format!("{write_dir}/f{i}");
        assert!(side.store.read(&path) == expected, "{what}: {path}'s bytes");
    }
    assert_eq!(side.store.size(&big), mib << 20, "{what}: {big}'s size");
    side.store
        .remove(vm, side.dir, &[&write_dir, &big], &what)
        .await;

    let f = files as f64;
    let m = mib as f64;
    [
        f / times[0].1,
        f / times[1].1,
        f / times[2].1,
        m / times[3].1,
        m / times[4].1,
    ]
}

fn report(what: &str, unit: &str, detail: &str, sides: &[Side], pick: fn(&Side) -> &[f64]) {
    let runs = pick(&sides[0]).len();
    let medians: Vec<f64> = sides.iter().map(|s| median(pick(s).to_vec())).collect();
    for (side, m) in sides.iter().zip(&medians) {
        println!(
            "{:<40} median {m:>10.1} {unit}  ({detail}, {runs} runs)",
            format!("fs/{what}-{}", side.name)
        );
    }
    let baseline = medians[sides.len() - 1];
    for (side, m) in sides.iter().zip(&medians).take(sides.len() - 1) {
        println!(
            "{:<40} {:.3}x",
            format!("fs/{what}-ratio {} / passthrough", side.name),
            m / baseline
        );
    }
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs us once as a smoke test.
    let smoke = !std::env::args().any(|a| a == "--bench");
    // Under nested emulation (scripts/nested.sh's runner sets KRUNBOX_NESTED_POOL) the guest
    // moves a MiB or two per second, and sustained I/O makes the emulation fault.
    let nested = std::env::var_os("KRUNBOX_NESTED_POOL").is_some();
    let (rounds, files, mib) = match (smoke, nested) {
        (true, _) => (2, 20, 1),
        (false, false) => (5, 1000, 128),
        (false, true) => (5, 300, 16),
    };
    let rounds = env_or("KRUNBOX_BENCH_ITERS", rounds);
    let files = env_or("KRUNBOX_BENCH_FILES", files);
    let mib = env_or("KRUNBOX_BENCH_MIB", mib) as u64;

    // The same files on every side: T/small/ for HostDir and the passthrough, /small/ in
    // memory.
    let dir = tempfile::tempdir().expect("a host directory to share");
    let host_dir = dir.path().canonicalize().unwrap();
    std::fs::create_dir(host_dir.join("small")).unwrap();
    let memfs = MemoryFs::new();
    for i in 0..files {
        let bytes = seed(i);
        std::fs::write(host_dir.join(format!("small/f{i}")), &bytes).unwrap();
        memfs
            .write_file(&format!("/small/f{i}"), &bytes)
            .unwrap_or_else(|e| panic!("seeding the MemoryFs: {e:?}"));
    }
    let hostdir = HostDir::new(&host_dir).unwrap_or_else(|e| panic!("HostDir: {e:?}"));

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let sandbox = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .memory_mib(256)
            .mount("/tmp/memfs", memfs.clone())
            .mount("/tmp/hostdir", hostdir)
            .virtiofs_passthrough_for_benchmarks(&host_dir, TAG)
            .build()
            .unwrap();
        let vm = sandbox.boot().await.expect("boot");
        // The passthrough runs inside the helper's jail, which holds the shared directory too;
        // say so if a layer of it is not in force here (the figures would then be another
        // configuration's).
        for layer in vm.isolation().layers().iter().filter(|l| !l.enforced) {
            eprintln!(
                "fs: jail layer {} not in force: {}",
                layer.layer, layer.detail
            );
        }
        guest_sh(
            &vm,
            "mounting the passthrough",
            &format!("mkdir -p /tmp/baseline && mount -t virtiofs {TAG} /tmp/baseline"),
        )
        .await;

        let side = |name, dir, store| Side {
            name,
            dir,
            store,
            stat: Vec::new(),
            read: Vec::new(),
            write: Vec::new(),
            big_write: Vec::new(),
            big_read: Vec::new(),
        };
        // The baseline last: the ratios are against it.
        let mut sides = [
            side("memfs", "/tmp/memfs", Store::Memory(memfs)),
            side("hostdir", "/tmp/hostdir", Store::Dir(host_dir.clone())),
            side("passthrough", "/tmp/baseline", Store::Dir(host_dir.clone())),
        ];

        // Warm every side once, unmeasured: first execs, the FUSE sessions, the host's caches.
        for side in &sides {
            round(&vm, side, "warm", files.min(5), 1).await;
        }

        for r in 0..rounds {
            // Rotate which side goes first, so none always follows the same other.
            for k in 0..sides.len() {
                let i = (r + k) % sides.len();
                let rates = round(&vm, &sides[i], &r.to_string(), files, mib).await;
                let side = &mut sides[i];
                eprintln!(
                    "fs: round {}/{rounds}, {}: stat {:.0}/s, read {:.0}/s, write {:.0}/s, \
                     large write {:.1} MiB/s, large read {:.1} MiB/s",
                    r + 1,
                    side.name,
                    rates[0],
                    rates[1],
                    rates[2],
                    rates[3],
                    rates[4]
                );
                side.stat.push(rates[0]);
                side.read.push(rates[1]);
                side.write.push(rates[2]);
                side.big_write.push(rates[3]);
                side.big_read.push(rates[4]);
            }
        }

        let small = format!("{files} files of 4 KiB, cold");
        let large = format!("{mib} MiB, cold");
        report("stat", "ops/s", &small, &sides, |s| &s.stat);
        report("read", "ops/s", &small, &sides, |s| &s.read);
        report("write", "ops/s", &small, &sides, |s| &s.write);
        report("large-write", "MiB/s", &large, &sides, |s| &s.big_write);
        report("large-read", "MiB/s", &large, &sides, |s| &s.big_read);

        assert!(vm.is_running(), "the VM died during the benchmark");
        vm.shutdown().await.expect("shutdown");
    });
    drop(dir);
}
