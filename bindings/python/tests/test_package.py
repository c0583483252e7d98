"""The package as installed from its wheel: what it ships, and `python -m krunbox doctor`."""

import os
import subprocess
import sys

import krunbox


def test_the_wheel_ships_the_helper_and_guest_init_executable() -> None:
    for part in ("bin/krunbox-vmm", "guest-init"):
        path = os.path.join(krunbox.ARTIFACTS, part)
        assert os.path.isfile(path), path
        assert os.access(path, os.X_OK), f"{path} is not executable"
    # The package points the library at them itself, through no environment variable that
    # the programs it starts would inherit: the tests boot with the wheel's own.
    for variable in ("KRUNBOX_VMM", "KRUNBOX_GUEST_INIT", "KRUNBOX_DATA_DIR"):
        assert variable not in os.environ, variable


def test_doctor_says_this_host_boots_microvms() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "krunbox", "doctor"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The report names the helper it found: the wheel's.
    assert os.path.join(krunbox.ARTIFACTS, "bin/krunbox-vmm") in done.stdout, done.stdout
