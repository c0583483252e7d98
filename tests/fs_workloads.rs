//! Real workloads on host filesystems mounted in a real microVM, checked by the host afterwards:
//! git, a Python venv, tar of a tree with symlinks, sqlite with fsync, a directory of 64k
//! entries. Each test boots one agent-image VM with two mounts of the same kind of tree: a
//! `MemoryFs` at `/mem` and a `HostDir` (a fresh host directory) at `/host`, and runs the
//! workload on both.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use krunbox::fs::{HostDir, MemoryFs};
use krunbox::{BuiltinImage, Instance, Rootfs, Sandbox};

struct Mounts {
    vm: Instance,
    memory: MemoryFs,
    host: PathBuf,
    _host_dir: tempfile::TempDir,
}

/// Boots the agent image with an empty `MemoryFs` at /mem and an empty host directory at
/// /host, after `seed` has filled both (the memory side through its host API, the directory
/// with std::fs).
async fn boot(seed: impl Fn(&MemoryFs, &Path)) -> Mounts {
    let memory = MemoryFs::new();
    let host_dir = tempfile::tempdir().expect("a host directory");
    seed(&memory, host_dir.path());
    let vm = Sandbox::builder()
        .rootfs(Rootfs::builtin(BuiltinImage::Agent))
        .memory_mib(768)
        .mount("/mem", memory.clone())
        .mount("/host", HostDir::new(host_dir.path()).expect("HostDir"))
        .build()
        .expect("sandbox definition (run scripts/setup.sh)")
        .boot()
        .await
        .expect("booting the agent image");
    Mounts {
        vm,
        memory,
        host: host_dir.path().to_path_buf(),
        _host_dir: host_dir,
    }
}

/// Runs a `sh -e` script; panics with its output unless it succeeds within 200 s.
async fn run(vm: &Instance, script: &str) -> String {
    run_within(vm, script, Duration::from_secs(200)).await
}

async fn run_within(vm: &Instance, script: &str, timeout: Duration) -> String {
    let out = vm
        .command("sh")
        .args(["-ec", script])
        .timeout(timeout)
        .output()
        .await
        .expect("running sh in the guest");
    let text = format!("{}{}", out.stdout_text(), out.stderr_text());
    assert!(
        out.status.success(),
        "`{script}` failed ({}):\n{text}",
        out.status
    );
    out.stdout_text()
}

fn on_both(script: &str) -> String {
    ["/mem", "/host"]
        .iter()
        .map(|root| script.replace("$ROOT", root))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn git_init_add_commit_status_and_clone_of_a_local_bare_repo() {
    common::run(async {
        let m = boot(|_, _| {}).await;
        let git = "git -c user.name=agent -c user.email=agent@example.invalid";
        let out = run(
            &m.vm,
            &on_both(&format!(
                "cd $ROOT && mkdir repo && cd repo && git init -q -b main . && \
                 printf 'hello\\n' > README && mkdir src && printf 'fn main() {{}}\\n' > src/main.rs && \
                 {git} add . && {git} commit -q -m first && \
                 printf 'more\\n' >> README && git status --porcelain && \
                 {git} commit -q -am second && git status --porcelain && \
                 git clone -q --bare $ROOT/repo $ROOT/bare.git && \
                 git clone -q $ROOT/bare.git $ROOT/clone && \
                 git -C $ROOT/clone log --format=%s"
            )),
        )
        .await;
        // Per mount: the modified file before the second commit, a clean tree after it, then
        // the clone's history.
        assert_eq!(
            out.matches(" M README\nsecond\nfirst\n").count(),
            2,
            "status and the clone's log on both mounts:\n{out}"
        );
        // The host reads what git wrote.
        let readme = "hello\nmore\n";
        assert_eq!(
            m.memory.read_file("/clone/README").unwrap(),
            readme.as_bytes()
        );
        assert_eq!(
            std::fs::read_to_string(m.host.join("clone/README")).unwrap(),
            readme
        );
        assert_eq!(
            m.memory.read_file("/bare.git/HEAD").unwrap(),
            b"ref: refs/heads/main\n"
        );
        assert!(
            m.host.join("bare.git/objects/pack").is_dir()
                || m.host.join("bare.git/objects").is_dir()
        );
        m.vm.shutdown().await.unwrap();
    })
}

#[test]
fn a_python_venv_is_made_and_imported_from() {
    common::run(async {
        let m = boot(|_, _| {}).await;
        let out = run(
            &m.vm,
            &on_both(
                "python3 -m venv --without-pip $ROOT/venv && \
                 site=$($ROOT/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])') && \
                 printf 'ANSWER = 42\\n' > \"$site/workspace_module.py\" && \
                 $ROOT/venv/bin/python -c 'import sys, workspace_module; print(sys.prefix, workspace_module.ANSWER)'",
            ),
        )
        .await;
        assert!(out.contains("/mem/venv 42\n"), "{out}");
        assert!(out.contains("/host/venv 42\n"), "{out}");
        let cfg = String::from_utf8(m.memory.read_file("/venv/pyvenv.cfg").unwrap()).unwrap();
        assert!(
            cfg.contains("include-system-site-packages = false"),
            "{cfg}"
        );
        assert!(std::fs::read_to_string(m.host.join("venv/pyvenv.cfg"))
            .unwrap()
            .contains("include-system-site-packages = false"));
        m.vm.shutdown().await.unwrap();
    })
}

/// The tar tests' tree: 25 directories of 40 files (1,000), and two symlinks in each (one
/// relative, to a directory; one absolute, out of the tree).
const TREE_DIRS: usize = 25;
const TREE_FILES: usize = 40;

fn tree_file(d: usize, f: usize) -> String {
    format!("tree/d{d:02}/f{f:02}.txt")
}

fn tree_contents(d: usize, f: usize) -> Vec<u8> {
    format!("file {d} {f}\n")
        .repeat(1 + (d * f) % 50)
        .into_bytes()
}

/// Under nested emulation every uncached FUSE request is a round trip of about a millisecond
/// and tar makes several per file: a thousand files take about a minute there (milliseconds on
/// real KVM). The deadline is ten times that: reaching it means something is stuck.
const TAR_DEADLINE: Duration = Duration::from_secs(600);

/// Prints, on stderr, every guest process in uninterruptible sleep (state D: waiting in the
/// kernel, for a FUSE reply for one) with where it waits, if `SCRIPT` is still running after
/// `secs` seconds; stopped without a trace when it ends first. What a stuck tar test shows.
fn with_stuck_report(script: &str, secs: u64) -> String {
    format!(
        "( trap 'kill $s 2>/dev/null; exit 0' TERM; sleep {secs} & s=$!; wait $s; \
           echo 'still running after {secs} s; processes in state D:'; \
           for p in /proc/[0-9]*; do \
             [ \"$(cut -d' ' -f3 $p/stat 2>/dev/null)\" = D ] || continue; \
             echo \"$p $(cat $p/comm) wchan=$(cat $p/wchan 2>/dev/null)\"; cat $p/stack 2>/dev/null; \
           done ) >&2 & w=$!
         trap 'kill $w 2>/dev/null' EXIT
         {script}"
    )
}

/// Runs a tar test's body with [`TAR_DEADLINE`] instead of the usual one.
fn run_long<F: std::future::Future>(body: F) -> F::Output {
    common::rt().block_on(async {
        tokio::time::timeout(TAR_DEADLINE, body)
            .await
            .unwrap_or_else(|_| panic!("the test did not finish in {TAR_DEADLINE:?}"))
    })
}

/// Archives the tree on `root` and extracts the archive beside it (`tar c | tar x`), in the
/// guest; returns what it printed: the root, the files and symlinks extracted, a link's target.
async fn tar_round_trip(vm: &Instance, root: &str) -> String {
    run_within(
        vm,
        &with_stuck_report(
            &format!(
                "cd {root} && mkdir out && tar cf - tree | tar xf - -C out && \
                 echo {root} $(find out/tree -type f | wc -l) $(find out/tree -type l | wc -l) \
                 $(readlink out/tree/d07/up)"
            ),
            TAR_DEADLINE.as_secs() - 120,
        ),
        TAR_DEADLINE - Duration::from_secs(60),
    )
    .await
}

#[test]
fn tar_creates_and_extracts_a_thousand_files_with_symlinks_on_a_memory_fs() {
    run_long(async {
        let m = boot(|memory, _| {
            for d in 0..TREE_DIRS {
                for f in 0..TREE_FILES {
                    let path = format!("/{}", tree_file(d, f));
                    memory.write_file(&path, &tree_contents(d, f)).unwrap();
                }
                memory
                    .symlink(&format!("/tree/d{d:02}/up"), "../d00")
                    .unwrap();
                memory
                    .symlink(&format!("/tree/d{d:02}/abs"), "/etc/hostname")
                    .unwrap();
            }
        })
        .await;
        let out = tar_round_trip(&m.vm, "/mem").await;
        let files = TREE_DIRS * TREE_FILES;
        assert_eq!(out, format!("/mem {files} {} ../d00\n", 2 * TREE_DIRS));
        // The host reads the extracted copy (no guest I/O): every file's bytes.
        for d in 0..TREE_DIRS {
            for f in 0..TREE_FILES {
                let path = format!("/out/{}", tree_file(d, f));
                assert_eq!(
                    m.memory.read_file(&path).unwrap(),
                    tree_contents(d, f),
                    "{path}"
                );
            }
        }
        m.vm.shutdown().await.unwrap();
    })
}

#[test]
fn tar_creates_and_extracts_a_thousand_files_with_symlinks_on_a_host_dir() {
    run_long(async {
        let m = boot(|_, host| {
            for d in 0..TREE_DIRS {
                for f in 0..TREE_FILES {
                    let on_host = host.join(tree_file(d, f));
                    std::fs::create_dir_all(on_host.parent().unwrap()).unwrap();
                    std::fs::write(on_host, tree_contents(d, f)).unwrap();
                }
                let dir = host.join(format!("tree/d{d:02}"));
                std::os::unix::fs::symlink("../d00", dir.join("up")).unwrap();
                std::os::unix::fs::symlink("/etc/hostname", dir.join("abs")).unwrap();
            }
        })
        .await;
        let out = tar_round_trip(&m.vm, "/host").await;
        let files = TREE_DIRS * TREE_FILES;
        assert_eq!(out, format!("/host {files} {} ../d00\n", 2 * TREE_DIRS));
        for d in 0..TREE_DIRS {
            for f in 0..TREE_FILES {
                let path = m.host.join("out").join(tree_file(d, f));
                assert_eq!(
                    std::fs::read(&path).unwrap(),
                    tree_contents(d, f),
                    "{path:?}"
                );
            }
        }
        assert_eq!(
            std::fs::read_link(m.host.join("out/tree/d03/abs")).unwrap(),
            Path::new("/etc/hostname"),
            "an absolute symlink is stored as it is, not followed on the host"
        );
        m.vm.shutdown().await.unwrap();
    })
}

#[test]
fn sqlite_with_fsync_commits_and_the_file_is_whole() {
    common::run(async {
        let m = boot(|_, _| {}).await;
        let script = r#"
import sqlite3, sys
path = sys.argv[1]
db = sqlite3.connect(path)
db.execute("PRAGMA journal_mode=DELETE")
db.execute("PRAGMA synchronous=FULL")
db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT)")
for batch in range(10):
    with db:
        db.executemany("INSERT INTO t (body) VALUES (?)", [("row %d" % i,) for i in range(100)])
db.close()
db = sqlite3.connect(path)
print(path, db.execute("PRAGMA integrity_check").fetchone()[0], db.execute("SELECT count(*) FROM t").fetchone()[0])
"#;
        let out = run(
            &m.vm,
            &on_both(&format!(
                "cat > /tmp/db.py <<'EOF'\n{script}\nEOF\npython3 /tmp/db.py $ROOT/app.db"
            )),
        )
        .await;
        assert!(out.contains("/mem/app.db ok 1000\n"), "{out}");
        assert!(out.contains("/host/app.db ok 1000\n"), "{out}");
        let memory_db = m.memory.read_file("/app.db").unwrap();
        let host_db = std::fs::read(m.host.join("app.db")).unwrap();
        for db in [&memory_db, &host_db] {
            assert!(db.starts_with(b"SQLite format 3\0"));
            assert!(db.len() >= 8192, "{} bytes", db.len());
        }
        assert!(
            m.memory.read_file("/app.db-journal").is_err(),
            "the journal is gone"
        );
        assert!(
            !m.host.join("app.db-journal").exists(),
            "the journal is gone"
        );
        m.vm.shutdown().await.unwrap();
    })
}

/// Entries in the big directory: 64k.
const MANY: usize = 65_536;

#[test]
fn a_directory_of_64k_entries_is_listed_completely() {
    common::run(async {
        let m = boot(|memory, host| {
            std::fs::create_dir(host.join("many")).unwrap();
            for i in 0..MANY {
                let name = format!("entry-{i:05}");
                memory.write_file(&format!("/many/{name}"), b"").unwrap();
                std::fs::write(host.join("many").join(&name), b"").unwrap();
            }
        })
        .await;
        let out = run(
            &m.vm,
            &on_both(
                "ls -f $ROOT/many > /tmp/listing && sort /tmp/listing > /tmp/sorted && \
                 echo $ROOT $(wc -l < /tmp/sorted) $(uniq -d /tmp/sorted | wc -l) \
                 $(grep -v '^[.]' /tmp/sorted | head -1) $(tail -1 /tmp/sorted)",
            ),
        )
        .await;
        // `ls -f` lists . and .. too; no name twice.
        let all = MANY + 2;
        assert!(
            out.contains(&format!("/mem {all} 0 entry-00000 entry-65535\n")),
            "{out}"
        );
        assert!(
            out.contains(&format!("/host {all} 0 entry-00000 entry-65535\n")),
            "{out}"
        );
        m.vm.shutdown().await.unwrap();
    })
}
