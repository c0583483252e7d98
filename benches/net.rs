//! The guest's network: TCP upload throughput and HTTP requests per second through our
//! userspace stack (`src/net/`), against passt serving the same kind of guest in the same run.
//!
//! Two busybox VMs (1 vCPU, 256 MiB each) are booted once, both addressed alike (`10.0.2.15/24`,
//! gateway `10.0.2.2`):
//!
//! - **krunbox**: the library's own link ([`Network::with_policy`]): the policy grants the
//!   guest's connections to `10.0.2.2:PORT` for the two ports below as
//!   [`Verdict::connect_to`]`(127.0.0.1:PORT)` and denies everything else;
//! - **passt**: the guest's virtio-net device is served by `passt` (Debian's package, the same
//!   length-prefixed frame stream over a unix socket), started here and given to the instance
//!   through the bench-only `SandboxBuilder::network_backend_for_benchmarks`. passt maps
//!   connections to the gateway's address to the host's loopback, so the guest dials the same
//!   `10.0.2.2:PORT`; it is kept to loopback (`--outbound 127.0.0.1 --outbound-if4 lo`, no UDP,
//!   ICMP, DHCP, IPv6 or port forwarding) and ended by its pid at the end.
//!
//! The guest's commands are identical on both sides:
//!
//! - **upload**: `dd if=/dev/zero bs=64k count=.. | nc 10.0.2.2 SINK`, into a sink on the host's
//!   127.0.0.1 that counts bytes (and sends one, see [`sink`]); timed by the sink from its first
//!   byte to the guest's EOF (so neither the command's start nor the connection's setup is in
//!   it), and the count is checked;
//! - **http**: K sequential `wget -q -O /dev/null http://10.0.2.2:HTTP/` in a shell loop, each a
//!   new connection, against a tiny HTTP/1.1 server on 127.0.0.1 that answers `200` and closes;
//!   timed by the server from the first connection's accept to the last's (K - 1 whole
//!   request cycles, each including the guest's `wget` start), and the count is checked.
//!
//! Rounds alternate the sides (each round both, the order swapped every round); medians are
//! printed with the ratio krunbox / passt (higher is better for us on both: the goal is
//! at least passt's throughput). The bench reports, it asserts no timing. Under nested emulation
//! (how this runs on machines without usable KVM) absolute figures mean little; the ratios
//! measured in the same run are what we report.
//!
//! `cargo bench` (which passes `--bench`): 5 rounds, 256 MiB uploads, 200 requests; under
//! nested emulation (`KRUNBOX_NESTED_POOL` set) 3 rounds, 64 MiB, 100 requests. Without
//! `--bench` (`cargo test --benches`, and `scripts/test.sh` runs it once as a smoke test): 1
//! round, 8 MiB, 20 requests. `KRUNBOX_BENCH_ITERS` sets the rounds,
//! `KRUNBOX_BENCH_MIB` the upload size (MiB) and `KRUNBOX_BENCH_REQUESTS` K, in either mode.
//! `KRUNBOX_PASST` names the passt binary (default `passt` on `PATH`; `scripts/setup.sh`
//! installs it).

mod common;

use common::{env_or, median};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use krunbox::net::{Flow, Network, Protocol, Verdict};
use krunbox::{BuiltinImage, Instance, Rootfs, Sandbox};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

const MIB: f64 = 1024.0 * 1024.0;
const BLOCK: u64 = 64 * 1024;
const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
/// A guest command's deadline: generous, a 256 MiB upload under nested emulation is minutes.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(900);

/// What the sink saw of one connection: bytes, the time from the first to the end, and how
/// it ended if not cleanly.
type Received = (u64, Duration, Option<std::io::Error>);

/// The host's sink on 127.0.0.1: each connection gets one byte, then is read to its end and
/// closed; its byte count and the time from its first byte to its end are sent on.
///
/// The one byte is for passt: the version Debian 12 ships (0.0~git20230309) waits for the
/// guest to acknowledge its SYN-ACK by more than the guest ever does on a connection the host
/// side never writes to, counts that as lost data, and resets the connection after about half
/// a minute (fixed upstream in 4e73e9b, "tcp: Don't special case the handling of the ack of a
/// syn", 2023-03-27). A byte from the host, acknowledged, ends the wait. The guest's `nc`
/// prints it to /dev/null; our stack relays it like any other.
async fn sink() -> (u16, mpsc::UnboundedReceiver<Received>) {
    let listener = TcpListener::bind((LOOPBACK, 0)).await.expect("sink: bind");
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (mut conn, _) = listener.accept().await.expect("sink: accept");
            let tx = tx.clone();
            tokio::spawn(async move {
                if let Err(err) = conn.write_all(b"k").await {
                    let _ = tx.send((0, Duration::ZERO, Some(err)));
                    return;
                }
                let mut buf = vec![0u8; 256 * 1024];
                let mut total = 0u64;
                let mut first = None;
                let error = loop {
                    match conn.read(&mut buf).await {
                        Ok(0) => break None,
                        Ok(n) => {
                            first.get_or_insert_with(Instant::now);
                            total += n as u64;
                        }
                        Err(err) => break Some(err),
                    }
                };
                let took = first.map(|t| t.elapsed()).unwrap_or_default();
                let _ = tx.send((total, took, error));
            });
        }
    });
    (port, rx)
}

/// A tiny HTTP/1.1 server on 127.0.0.1: reads a request's head, answers `200` with two bytes
/// and closes. The moment of each accept is sent on.
async fn http_server() -> (u16, mpsc::UnboundedReceiver<Instant>) {
    let listener = TcpListener::bind((LOOPBACK, 0)).await.expect("http: bind");
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (mut conn, _) = listener.accept().await.expect("http: accept");
            let _ = tx.send(Instant::now());
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";
                let _ = conn.write_all(answer).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    (port, rx)
}

/// Whether a unix stream socket listens at `path` (in this network namespace).
fn listening(path: &Path) -> bool {
    let table = std::fs::read_to_string("/proc/net/unix").expect("reading /proc/net/unix");
    table.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.len() == 8 && fields[3] == "00010000" && Path::new(fields[7]) == path
    })
}

/// passt, serving one guest on a unix socket, reaching nothing but the host's loopback.
struct Passt {
    child: tokio::process::Child,
    /// What passt printed (its startup, then anything it logs), for a failure's message.
    log: Arc<Mutex<String>>,
}

impl Passt {
    async fn start(socket: &Path, network: &Network) -> Self {
        let binary = std::env::var("KRUNBOX_PASST").unwrap_or_else(|_| "passt".into());
        let mut child = tokio::process::Command::new(&binary)
            .args(["--foreground", "--stderr", "--socket"])
            .arg(socket)
            // As ourselves: started by root, passt would switch to `nobody`, which cannot make
            // its socket in our private directory.
            .args([
                "--runas",
                &format!("{}:{}", unsafe { libc::geteuid() }, unsafe {
                    libc::getegid()
                }),
            ])
            // The guest's addressing, as guest-init sets it statically (no DHCP here).
            .args(["--address", &network.guest_address().to_string()])
            .args(["--netmask", "24"])
            .args(["--gateway", &network.gateway_address().to_string()])
            // Connections to the gateway's address go to the host's loopback (passt's default
            // mapping; --no-map-gw would turn it off). Loopback is the template interface (it
            // has no MAC: passt's own is given) and the only way out: outbound sockets are
            // bound to 127.0.0.1 and to `lo`, so no other address can be reached.
            .args(["--mac-addr", "02:6b:62:00:02:02", "--interface", "lo"])
            .args(["--outbound", "127.0.0.1", "--outbound-if4", "lo"])
            .args(["--ipv4-only", "--no-udp", "--no-icmp", "--no-dhcp"])
            .args(["--no-ndp", "--no-dhcpv6", "--no-ra"])
            // No port of the host forwarded to the guest.
            .args(["--tcp-ports", "none", "--udp-ports", "none"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("starting {binary}: {e} (apt-get install passt, or run scripts/setup.sh)")
            });
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let log = Arc::new(Mutex::new(String::new()));
        let kept = log.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let mut log = kept.lock().unwrap();
                // passt logs to the system logger too, and says so when there is none.
                if log.len() < 64 * 1024 && !line.ends_with("bytes to syslog") {
                    log.push_str(&format!("{line}\n"));
                }
            }
            kept.lock()
                .unwrap()
                .push_str("(passt's stderr closed: it ended)\n");
        });
        // Ready once its socket listens. This passt says it is bound just before `listen`,
        // and a connection of ours to find out would become its one client: the kernel's
        // table of unix sockets says it without touching it (flags 00010000: listening).
        let started = Instant::now();
        while !listening(socket) {
            if started.elapsed() > Duration::from_secs(30)
                || child.try_wait().ok().flatten().is_some()
            {
                let _ = child.kill().await;
                panic!("passt did not start listening:\n{}", log.lock().unwrap());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Passt { child, log }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Ends passt by its pid (SIGTERM, then SIGKILL after 5 s) and waits for it.
    async fn stop(mut self) {
        if let Ok(None) = self.child.try_wait() {
            let pid = self.child.id().expect("passt's pid") as i32;
            // SAFETY: a plain kill(2) of our own child, which has not been reaped yet.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
                .await
                .is_err()
            {
                let _ = self.child.kill().await;
            }
        }
    }
}

/// One side under test: its VM and the name it is reported by.
struct Side {
    name: &'static str,
    vm: Instance,
    /// What the network's backend logged, if it is another program (passt).
    backend_log: Option<Arc<Mutex<String>>>,
    upload: Vec<f64>,
    http: Vec<f64>,
}

/// Runs `script` in the guest's shell; a failure is the command's status and output, and what
/// the network's backend logged.
async fn guest_sh(side: &Side, script: &str) -> Result<(), String> {
    let out = side
        .vm
        .command("sh")
        .args(["-c", script])
        .timeout(COMMAND_TIMEOUT)
        .output()
        .await
        .map_err(|e| format!("{}: running {script:?}: {e}", side.name))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{}: {script:?}: {}\n{}{}{}",
        side.name,
        out.status,
        out.stdout_text(),
        out.stderr_text(),
        side.backend_log
            .as_ref()
            .map(|log| format!("\n{} logged:\n{}", side.name, log.lock().unwrap()))
            .unwrap_or_default()
    ))
}

/// The guest uploads `blocks` × 64 KiB to the sink; returns MiB/s as the sink timed it.
async fn upload(
    side: &Side,
    gateway: Ipv4Addr,
    port: u16,
    results: &mut mpsc::UnboundedReceiver<Received>,
    blocks: u64,
) -> f64 {
    let ran = guest_sh(
        side,
        &format!("dd if=/dev/zero bs={BLOCK} count={blocks} 2>/dev/null | nc {gateway} {port} >/dev/null"),
    )
    .await;
    let received = tokio::time::timeout(Duration::from_secs(30), results.recv()).await;
    let (bytes, took, error) = match (ran, received) {
        (Ok(()), Ok(Some(received))) => received,
        (ran, received) => panic!(
            "{}: upload of {} bytes: {}\nthe sink saw: {:?}",
            side.name,
            blocks * BLOCK,
            ran.err()
                .unwrap_or_else(|| "the guest's command succeeded".into()),
            received.ok().flatten()
        ),
    };
    assert!(
        error.is_none(),
        "{}: the sink's connection failed: {error:?}",
        side.name
    );
    assert_eq!(
        bytes,
        blocks * BLOCK,
        "{}: bytes the sink received",
        side.name
    );
    assert!(results.is_empty(), "{}: more than one upload", side.name);
    bytes as f64 / MIB / took.as_secs_f64()
}

/// The guest fetches `/` `requests` times, one `wget` (and connection) after another; returns
/// requests per second as the server timed them.
async fn http(
    side: &Side,
    gateway: Ipv4Addr,
    port: u16,
    accepted: &mut mpsc::UnboundedReceiver<Instant>,
    requests: usize,
) -> f64 {
    guest_sh(
        side,
        &format!(
            "i=0; while [ $i -lt {requests} ]; do \
             wget -q -O /dev/null http://{gateway}:{port}/ || exit 1; i=$((i + 1)); done"
        ),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let mut times = Vec::new();
    while let Ok(t) = accepted.try_recv() {
        times.push(t);
    }
    assert_eq!(
        times.len(),
        requests,
        "{}: requests the server saw",
        side.name
    );
    if requests < 2 {
        return f64::NAN;
    }
    let span = times[requests - 1] - times[0];
    (requests - 1) as f64 / span.as_secs_f64()
}

fn report(
    what: &str,
    unit: &str,
    detail: &str,
    ours: &Side,
    passt: &Side,
    pick: fn(&Side) -> &[f64],
) {
    let (o, p) = (median(pick(ours).to_vec()), median(pick(passt).to_vec()));
    let runs = pick(ours).len();
    println!(
        "{:<32} median {p:>10.1} {unit}  ({detail}, {runs} runs)",
        format!("net/{what}-passt")
    );
    println!(
        "{:<32} median {o:>10.1} {unit}  ({detail}, {runs} runs)",
        format!("net/{what}-krunbox")
    );
    println!(
        "{:<32} {:.3}x",
        format!("net/{what}-ratio krunbox / passt"),
        o / p
    );
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs us once as a smoke test.
    let smoke = !std::env::args().any(|a| a == "--bench");
    // Under nested emulation (scripts/nested.sh's runner sets KRUNBOX_NESTED_POOL) the guest
    // moves one or two MiB/s: a full run would take most of an hour.
    let nested = std::env::var_os("KRUNBOX_NESTED_POOL").is_some();
    let (rounds, mib, requests) = match (smoke, nested) {
        (true, _) => (1, 8, 20),
        (false, false) => (5, 256, 200),
        (false, true) => (3, 64, 100),
    };
    let rounds = env_or("KRUNBOX_BENCH_ITERS", rounds);
    let mib = env_or("KRUNBOX_BENCH_MIB", mib) as u64;
    let requests = env_or("KRUNBOX_BENCH_REQUESTS", requests);
    let blocks = mib * (1 << 20) / BLOCK;

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (sink_port, mut sink_results) = sink().await;
        let (http_port, mut http_accepts) = http_server().await;

        // Ours: the guest's connections to the gateway on the two ports reach the servers on
        // loopback, as passt's gateway mapping does; nothing else is granted.
        let ports = [sink_port, http_port];
        let ours_network = Network::with_policy(move |flow: Flow| async move {
            let dst = flow.destination();
            if flow.protocol() == Protocol::Tcp
                && dst.ip() == IpAddr::V4(Ipv4Addr::new(10, 0, 2, 2))
                && ports.contains(&dst.port())
            {
                Verdict::connect_to(SocketAddr::new(LOOPBACK, dst.port()))
            } else {
                Verdict::deny()
            }
        });
        let gateway = ours_network.gateway_address();
        let builder = || {
            Sandbox::builder()
                .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
                .memory_mib(256)
        };
        let ours_sandbox = builder().network(ours_network).build().unwrap();

        let dir = tempfile::tempdir().expect("a directory for passt's socket");
        let socket = dir.path().join("passt.sock");
        let passt = Passt::start(&socket, &Network::deny_all()).await;
        let passt_sandbox = builder()
            .network_backend_for_benchmarks(&socket)
            .build()
            .unwrap();

        let ours_vm = ours_sandbox.boot().await.expect("boot (krunbox network)");
        let passt_vm = match passt_sandbox.boot().await {
            Ok(vm) => vm,
            Err(e) => panic!("boot (passt network): {e}\npasst:\n{}", passt.log()),
        };
        let mut sides = [
            Side {
                name: "krunbox",
                vm: ours_vm,
                backend_log: None,
                upload: Vec::new(),
                http: Vec::new(),
            },
            Side {
                name: "passt",
                vm: passt_vm,
                backend_log: Some(passt.log.clone()),
                upload: Vec::new(),
                http: Vec::new(),
            },
        ];

        // Warm both sides once, unmeasured: first execs, ARP, the page cache.
        for side in &sides {
            upload(side, gateway, sink_port, &mut sink_results, 16).await;
            http(side, gateway, http_port, &mut http_accepts, 2).await;
        }

        for round in 0..rounds {
            // Alternate which side goes first, so neither always follows the other.
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for i in order {
                let side = &sides[i];
                let rate = upload(side, gateway, sink_port, &mut sink_results, blocks).await;
                let rps = http(side, gateway, http_port, &mut http_accepts, requests).await;
                eprintln!(
                    "net: round {}/{rounds}, {}: upload {rate:.1} MiB/s, http {rps:.1} req/s",
                    round + 1,
                    side.name
                );
                sides[i].upload.push(rate);
                sides[i].http.push(rps);
            }
        }

        let [ours, theirs] = &sides;
        report(
            "upload",
            "MiB/s",
            &format!("{mib} MiB"),
            ours,
            theirs,
            |s| &s.upload,
        );
        report(
            "http",
            "req/s",
            &format!("{requests} requests"),
            ours,
            theirs,
            |s| &s.http,
        );

        let [ours, theirs] = sides;
        for side in [&ours, &theirs] {
            assert!(
                side.vm.is_running(),
                "{}: the VM died during the benchmark",
                side.name
            );
        }
        ours.vm.shutdown().await.expect("shutdown");
        theirs.vm.shutdown().await.expect("shutdown");
        passt.stop().await;
    });
}
