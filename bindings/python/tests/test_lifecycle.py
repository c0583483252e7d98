"""A Python process killed mid-command leaves nothing behind: its helper and VMM end with
it, and its instance directory is swept by the next boot on the machine.
"""

from __future__ import annotations

import asyncio
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


async def _read_until(stream: krunbox.OutputStream, needle: bytes) -> bytes:
    """Reads ``stream`` until ``needle`` appears (60 s at most); returns what was read."""
    seen = b""
    while needle not in seen:
        try:
            seen += await asyncio.wait_for(stream.__anext__(), timeout=60)
        except StopAsyncIteration:
            raise AssertionError(f"the stream ended before {needle!r}: {seen!r}") from None
    return seen


async def test_a_snapshot_restores_as_a_twin_that_takes_over_the_shell(tmp_path: Path) -> None:
    keys = str(tmp_path / "keys")
    sandbox = krunbox.Sandbox(
        "busybox", memory_mib=256, snapshots=True, snapshot_key_dir=keys
    )
    async with sandbox.boot() as vm:
        shell = await vm.spawn(["sh"], pty=(24, 80))
        assert shell.stdin is not None
        await shell.stdin.write("X=41; echo kept > /tmp/f; echo set-$X\n")
        await _read_until(shell.stdout, b"set-41")
        taken = await vm.snapshot(str(tmp_path / "snap"))
        snapshot = krunbox.Snapshot.open(str(tmp_path / "snap"), keys)
        assert snapshot.digest == taken.digest
        async with sandbox.restore(snapshot) as twin:
            assert twin.processes() == [shell.pid]
            twin_shell = twin.attach(shell.pid)
            assert twin_shell.stdin is not None
            await twin_shell.stdin.write("echo got-$((X + 1)) $(cat /tmp/f)\n")
            await _read_until(twin_shell.stdout, b"got-42 kept")
        # The source goes on as it was.
        await shell.stdin.write("echo src-$X\n")
        await _read_until(shell.stdout, b"src-41")
    # A changed byte of memory: refused, naming the reason.
    memory = tmp_path / "snap" / "memory.img"
    with open(memory, "r+b") as f:
        offset = os.lseek(f.fileno(), 0, os.SEEK_DATA)
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(krunbox.SnapshotTampered):
        snapshot.verify()
