"""A Python process killed mid-command leaves nothing behind: its helper and VMM end with
it, and its instance directory is swept by the next boot on the machine.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import pytest

import krunbox
import krunbox.sync

_SCRIPT = """
import asyncio, krunbox

async def main():
    vm = await krunbox.Sandbox("busybox", memory_mib=256).boot()
    proc = await vm.spawn("echo started; exec sleep 300")
    assert await proc.stdout.__anext__() == b"started\\n"
    print("ready", flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


def _parents() -> Dict[int, int]:
    """Every live (not zombie) process's parent, by pid."""
    parents: Dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            parents[int(entry)] = int(ppid)
    return parents


def _descendants(root: int) -> List[int]:
    parents = _parents()
    found: List[int] = []
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        found += children
        frontier += children
    return found


def test_a_killed_python_process_leaves_no_helper_vmm_or_instance_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Short: the control socket's path must fit a unix socket address (108 bytes).
    runtime = Path(tempfile.mkdtemp(prefix="kb-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    child = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE, env=dict(os.environ)
    )
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 120)
        assert ready and child.stdout.readline() == b"ready\n"
        below = _descendants(child.pid)
        names = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in below}
        assert "krunbox-vmm" in names.values(), names
        left = [p.name for p in runtime.iterdir()]
        assert len(left) == 1 and left[0].startswith("krunbox-"), left
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()

    deadline = time.monotonic() + 30
    alive = below
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in below if pid in _parents()]
    assert alive == [], {pid: names[pid] for pid in alive}

    # The next boot sweeps the directory the killed process could not remove.
    with krunbox.sync.Sandbox("busybox", memory_mib=256).boot() as vm:
        now = [p.name for p in runtime.iterdir()]
        assert left[0] not in now and len(now) == 1, (left, now)
        assert vm.run("echo ok").stdout == b"ok\n"
    del vm  # the instance's directory goes with the last reference to it
    assert list(runtime.iterdir()) == []
    runtime.rmdir()


async def test_a_pool_hands_out_a_fresh_instance_that_pauses_and_resumes() -> None:
    sandbox = krunbox.Sandbox("busybox", memory_mib=256)
    with pytest.raises(krunbox.InvalidConfig):
        sandbox.pool(0)
    async with sandbox.pool(1) as pool:
        vm = await pool.take()
        try:
            assert vm.host_boot_work > 0
            await vm.pause()
            assert vm.paused
            with pytest.raises(krunbox.Paused):
                await vm.run(["true"])
            await vm.resume()
            assert not vm.paused
            done = await vm.run("echo back", check=True)
            assert done.stdout == b"back\n"
        finally:
            await vm.shutdown()
