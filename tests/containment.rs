//! One hostile sandbox beside a normal one in the same process (issue 33). Bounds per sandbox
//! alone let one guest take what every sandbox of the process shares: its descriptors (a
//! `HostDir`'s inodes, the network's upstream sockets) and the blocking pool. Here the process
//! may open 4096 descriptors; a hostile guest creates files on a `HostDir` until it is
//! refused, holds as many connections as it can open to a granted origin, and floods the DNS
//! with names whose server never answers; then a second sandbox boots, runs a command, reads a
//! file of its own `HostDir` and makes a granted connection, and each succeeds. Every origin is
//! on 127.0.0.1.

mod common;
#[allow(dead_code)] // its sandboxes are not used here
#[path = "common/guest.rs"]
mod guest;
#[path = "common/http_origin.rs"]
mod http_origin;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use guest::sh;
use krunbox::fs::HostDir;
use krunbox::net::{Flow, Network, Protocol, Resolver, Verdict};
use krunbox::{BuiltinImage, Rootfs, Sandbox};
use tokio::io::AsyncReadExt;

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// What the test process may open: small, so the flood reaches its share in seconds (the
/// library raises the limit as far as the process may: the test drops the capability that
/// would let it).
const PROCESS_DESCRIPTORS: u64 = 2048;

/// The hostile guest's program: files on its `HostDir` until refused, connections to the
/// granted origin (never closed), DNS queries no server answers. It says how far each got.
const FLOOD: &str = r#"
import os, resource, socket, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
address = socket.gethostbyname("origin.test")
# 10,000 connections, never closed, in processes of their own (one may hold at most `hard`
# descriptors), started first so they connect while the files are made.
per = min(10000, hard - 100)
pipes, started = [], 0
while started < 10000:
    n = min(per, 10000 - started)
    started += n
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        held = []
        for i in range(n):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((address, int(os.environ["PORT"])))
            held.append(s)
        os.write(w, str(len(held)).encode())
        os.close(w)
        time.sleep(600)
        os._exit(0)
    os.close(w)
    pipes.append(r)
os.makedirs("/w/flood", exist_ok=True)
made, why = 0, "all made"
for i in range(20000):
    try:
        open(f"/w/flood/f{i}", "w").close()
        made += 1
    except OSError as e:
        why = e.strerror
        break
print(f"files {made} {why}", flush=True)
print(f"connections {sum(int(os.read(r, 32) or b'0') for r in pipes)}", flush=True)
dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(2000):
    name = f"n{i}.flood.test".encode()
    question = b"".join(bytes([len(p)]) + p for p in name.split(b".")) + b"\0\0\1\0\1"
    dns.sendto(i.to_bytes(2, "big") + b"\1\0\0\1\0\0\0\0\0\0" + question, ("10.0.2.2", 53))
print("dns sent", flush=True)
time.sleep(600)
"#;

#[test]
fn a_hostile_sandbox_cannot_take_what_a_neighbour_needs() {
    lower_descriptor_limit(PROCESS_DESCRIPTORS);
    run_long(async {
        let (port, heads) = http_origin::start().await;
        // A DNS server that never answers: each query the policy grants waits on it.
        let silent = tokio::net::UdpSocket::bind((LOOPBACK, 0)).await.unwrap();
        let silent_address: SocketAddr = silent.local_addr().unwrap();
        let network = || {
            Network::with_policy(move |flow: Flow| async move {
                match (flow.protocol(), flow.hostname()) {
                    (Protocol::Dns, Some("origin.test")) => {
                        Verdict::resolve(Resolver::fixed([LOOPBACK]))
                    }
                    (Protocol::Dns, Some(_)) => {
                        Verdict::resolve(Resolver::upstream([silent_address]))
                    }
                    (Protocol::Tcp, Some("origin.test")) => Verdict::accept(),
                    _ => Verdict::deny(),
                }
            })
        };

        let hostile_dir = tempfile::tempdir().unwrap();
        let hostile = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Agent))
            .memory_mib(512)
            .mount("/w", HostDir::new(hostile_dir.path()).expect("HostDir"))
            .network(network())
            .build()
            .expect("definition")
            .boot()
            .await
            .expect("booting the hostile sandbox");
        let mut flood = hostile
            .command("python3")
            .args(["-c", FLOOD])
            .env("PORT", port.to_string())
            .spawn()
            .await
            .expect("starting the flood");
        let mut said = String::new();
        let mut stdout = flood.stdout.take().unwrap();
        while !said.contains("dns sent") {
            let mut buf = [0u8; 512];
            let n = tokio::time::timeout(Duration::from_secs(400), stdout.read(&mut buf))
                .await
                .expect("the flood says how far it got")
                .unwrap();
            assert!(n > 0, "the flood ended: {said}");
            said.push_str(&String::from_utf8_lossy(&buf[..n]));
        }

        let normal_dir = tempfile::tempdir().unwrap();
        std::fs::write(normal_dir.path().join("hello"), b"the neighbour's file\n").unwrap();
        let normal = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .memory_mib(256)
            .mount("/w", HostDir::new(normal_dir.path()).expect("HostDir"))
            .network(network())
            .build()
            .expect("definition")
            .boot()
            .await
            .expect("the neighbour boots beside the flood");
        let (text, _) = sh(
            &normal,
            &format!(
                "cat /w/hello; echo rc-read=$?; touch /w/new; echo rc-write=$?; \
                 wget -q -O - http://origin.test:{port}/neighbour; echo rc-fetch=$?"
            ),
            Duration::from_secs(120),
        )
        .await;
        assert!(
            text.contains("the neighbour's file"),
            "{text}\nflood: {said}"
        );
        assert!(text.contains("rc-read=0"), "{text}");
        assert!(text.contains("rc-write=0"), "{text}");
        assert!(text.contains("origin says /neighbour"), "{text}");
        assert!(text.contains("rc-fetch=0"), "{text}");
        assert!(heads
            .lock()
            .unwrap()
            .iter()
            .any(|h| h.contains("/neighbour")));
        // The hostile guest was stopped by its own share (ENFILE), not by the process's
        // limit (EMFILE, "Too many open files"), after it started its 10,000 connections.
        assert!(said.contains("Too many open files in system"), "{said}");
        assert!(said.contains("connections 10000"), "{said}");
        // The process kept room of its own beyond what both guests hold.
        let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
        assert!(open < PROCESS_DESCRIPTORS - 512, "{open} descriptors open");
        drop(flood);
        normal.shutdown().await.unwrap();
        hostile.shutdown().await.unwrap();
        drop(silent);
    });
}

/// How long the flood test may take: its guest makes 10,000 connections and thousands of files
/// under nested emulation (.config/nextest.toml gives the binary as long).
const FLOOD_DEADLINE: Duration = Duration::from_secs(480);

/// Runs the flood test's body with [`FLOOD_DEADLINE`] instead of the usual one.
fn run_long<F: std::future::Future>(body: F) -> F::Output {
    common::rt().block_on(async {
        tokio::time::timeout(FLOOD_DEADLINE, body)
            .await
            .unwrap_or_else(|_| panic!("the test did not finish in {FLOOD_DEADLINE:?}"))
    })
}

/// Lowers this process's `RLIMIT_NOFILE` (soft and hard) to `limit` for good, before any
/// sandbox is made: every sandbox's share is counted against it. As root the library would
/// raise it again (`CAP_SYS_RESOURCE`), so this thread, and the runtime's threads it starts,
/// give that capability up first.
fn lower_descriptor_limit(limit: u64) {
    drop_sys_resource();
    let lowered = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: a plain call with a struct we own.
    let set = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lowered) };
    assert_eq!(set, 0, "{}", std::io::Error::last_os_error());
}

/// A guest that forks hundreds of processes adds no task to its VMM's cgroup; a VMM that
/// passes its cgroup's `memory.max` is killed by the host's OOM killer, in its own cgroup only:
/// the instance says so, and the test process and a neighbour sandbox go on. The
/// guest cannot make its VMM hold more than its RAM and a little, so the bound is made tight
/// here (no overhead beyond the guest's 256 MiB) and the guest fills its memory. Where this
/// process can make no cgroup (not root, no delegated parent) the isolation report says why and
/// the rest is not asserted.
#[test]
fn a_vmm_past_its_memory_bound_is_killed_in_its_own_cgroup_and_the_neighbour_lives_on() {
    common::run(async {
        let neighbour = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .memory_mib(256)
            .build()
            .expect("definition")
            .boot()
            .await
            .expect("the neighbour boots");
        let tight = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .memory_mib(256)
            .limits(krunbox::Limits::new().host_memory_overhead(0))
            .build()
            .expect("definition")
            .boot()
            .await
            .expect("the tightly bound sandbox boots");
        if !tight.isolation().is_enforced(krunbox::Layer::Cgroup) {
            // SAFETY: geteuid has no preconditions.
            assert!(
                unsafe { libc::geteuid() } != 0,
                "root, and no cgroup: {}",
                tight.isolation()
            );
            return;
        }
        // The guest's processes are not the host's: a guest that forks hundreds leaves its
        // VMM's cgroup with the tasks it had, far below its pids.max.
        let pid = tight.vmm_pid().unwrap();
        let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        let dir = format!(
            "/sys/fs/cgroup{}",
            own.lines().find_map(|l| l.strip_prefix("0::")).unwrap()
        );
        let tasks = || -> u64 {
            std::fs::read_to_string(format!("{dir}/pids.current"))
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        };
        let before = tasks();
        let (text, _) = sh(
            &tight,
            "i=0; while [ $i -lt 500 ]; do sleep 60 & i=$((i+1)); done; \
             echo forked $(ls -d /proc/[0-9]* | wc -l)",
            Duration::from_secs(120),
        )
        .await;
        assert!(text.contains("forked"), "{text}");
        let during = tasks();
        assert!(
            during <= before + 2 && during < 512,
            "the cgroup had {before} tasks, then {during}: {text}"
        );
        // Fill the guest's memory: both of its tmpfs, as far as they take.
        let filled = tight
            .command("sh")
            .args([
                "-c",
                "head -c 130000000 /dev/zero > /tmp/a; head -c 130000000 /dev/zero > /dev/shm/b; \
                 echo filled",
            ])
            .timeout(Duration::from_secs(120))
            .output()
            .await;
        let error = match filled {
            Err(error) => error,
            Ok(out) => panic!(
                "the guest filled its memory and the VMM lived: {} {}",
                out.stdout_text(),
                out.stderr_text()
            ),
        };
        let message = error.to_string();
        assert!(
            message.contains("cgroup killed its VMM for memory"),
            "{message}"
        );
        assert!(!tight.is_running());
        // The neighbour and this process are untouched.
        let (text, _) = sh(&neighbour, "echo neighbour alive", Duration::from_secs(60)).await;
        assert_eq!(text.trim(), "neighbour alive");
        neighbour.shutdown().await.unwrap();
    });
}

/// Drops `CAP_SYS_RESOURCE` from this thread's effective and permitted sets (threads it starts
/// inherit the sets): without it no hard resource limit can be raised.
fn drop_sys_resource() {
    const CAP_SYS_RESOURCE: u32 = 24;
    const VERSION_3: u32 = 0x2008_0522;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget/capset with a v3 header and two data structs, as the ABI asks.
    unsafe {
        assert_eq!(
            libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()),
            0
        );
        data[0].effective &= !(1 << CAP_SYS_RESOURCE);
        data[0].permitted &= !(1 << CAP_SYS_RESOURCE);
        assert_eq!(
            libc::syscall(libc::SYS_capset, &header, data.as_ptr()),
            0,
            "{}",
            std::io::Error::last_os_error()
        );
    }
}
