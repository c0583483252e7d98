//! The boundary, tested through the real command line: where the host lacks the kernel
//! features behind the VMM helper's confinement, `krunbox run` refuses to boot. The library's
//! side of the boundary is tested in the library's tests/isolation.rs.

#[allow(dead_code)] // common::run: this test bounds the CLI's run with the deadline itself
#[path = "../../tests/common/mod.rs"]
mod common;

/// Seccomp programs under which `unshare` fails with EPERM and Landlock does not exist (ENOSYS):
/// what a host with neither user namespaces nor Landlock looks like to a process and its
/// children. One program per errno (a seccompiler filter has one action for all its matches).
fn host_without_namespaces_or_landlock() -> Vec<seccompiler::BpfProgram> {
    use seccompiler::{SeccompAction, SeccompFilter, TargetArch};
    [
        (libc::SYS_unshare, libc::EPERM),
        (libc::SYS_landlock_create_ruleset, libc::ENOSYS),
    ]
    .into_iter()
    .map(|(nr, errno)| {
        SeccompFilter::new(
            [(nr, Vec::new())].into_iter().collect(),
            SeccompAction::Allow,
            SeccompAction::Errno(errno as u32),
            TargetArch::try_from(std::env::consts::ARCH).unwrap(),
        )
        .unwrap()
        .try_into()
        .unwrap()
    })
    .collect()
}

#[test]
fn on_a_host_without_landlock_or_namespaces_the_file_canary_gets_through_and_the_boot_is_refused() {
    use std::os::unix::process::CommandExt;
    // The real CLI, started in a process where the kernel features behind the helper's file
    // confinement are missing; the helper inherits that. Nothing in krunbox is weakened: the
    // canary file is then readable, and the boot must fail closed.
    let programs = host_without_namespaces_or_landlock();
    let mut cli = std::process::Command::new(env!("CARGO_BIN_EXE_krunbox"));
    cli.args(["run", "--image", "busybox", "--", "echo", "the-guest-ran"]);
    // SAFETY: only prctl calls (installing already-built programs) between fork and exec.
    unsafe {
        cli.pre_exec(move || {
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            for program in &programs {
                seccompiler::apply_filter(program).map_err(std::io::Error::other)?;
            }
            Ok(())
        });
    }
    let out = common::rt().block_on(async {
        tokio::time::timeout(
            common::TEST_DEADLINE,
            tokio::task::spawn_blocking(move || cli.output()),
        )
        .await
        .expect("the CLI finishes")
        .unwrap()
        .expect("running krunbox")
    });
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stderr}");
    assert!(!out.status.success(), "stdout: {stdout}\nstderr: {stderr}");
    assert!(!stdout.contains("the-guest-ran"), "the guest ran: {stdout}");
    assert!(
        stderr.contains("confinement failed its canaries") && stderr.contains("read a host file"),
        "{stderr}"
    );
    // The report says why: no namespaces, no Landlock.
    assert!(stderr.contains("[OFF] landlock filesystem"), "{stderr}");
    assert!(stderr.contains("[OFF] user namespace"), "{stderr}");
}
