"""Storage written in Python, in real microVMs: a copy-on-write root whose blocks a Python
store keeps across boots, and a mount served by a Python ``VirtualFs`` beside the library's
``MemoryFs`` and ``HostDir``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from pathlib import Path
from typing import Dict, Iterable, List, Set

import pytest

import krunbox


class DictStore:
    """Blocks in a dict; reads are async, to be awaited on the test's loop."""

    block_size = 4096

    def __init__(self) -> None:
        self.blocks: Dict[int, bytes] = {}
        self.attached: List[str] = []
        self.flushes = 0
        self.read_loops: Set[asyncio.AbstractEventLoop] = set()

    def attach(self, base_sha256: str, disk_bytes: int) -> None:
        if self.attached and self.attached[0] != base_sha256:
            raise ValueError("this store holds a layer of another base")
        self.attached.append(base_sha256)

    def written_blocks(self) -> Iterable[int]:
        return list(self.blocks)

    async def read_blocks(self, first: int, count: int) -> bytes:
        self.read_loops.add(asyncio.get_running_loop())
        await asyncio.sleep(0)
        zero = bytes(self.block_size)
        return b"".join(self.blocks.get(first + i, zero) for i in range(count))

    def write_blocks(self, first: int, data: bytes) -> None:
        size = self.block_size
        for i in range(len(data) // size):
            self.blocks[first + i] = data[i * size : (i + 1) * size]

    def flush(self) -> None:
        self.flushes += 1


async def test_a_cow_root_over_a_python_store_keeps_its_changes_across_boots() -> None:
    store = DictStore()
    sandbox = krunbox.Sandbox(
        krunbox.Rootfs.cow(krunbox.Rootfs.builtin("busybox"), store), memory_mib=256
    )
    async with sandbox.boot() as vm:
        await vm.run("echo kept > /etc/kept && rm /etc/hostname.busybox 2>/dev/null; sync")
    assert store.blocks and store.flushes > 0
    assert len(store.attached) == 1

    # A new definition over the same store boots with what the first boot wrote.
    again_root = krunbox.Rootfs.cow(krunbox.Rootfs.builtin("busybox"), store)
    again = krunbox.Sandbox(again_root, memory_mib=256)
    async with again.boot() as vm:
        assert await vm.read_file("/etc/kept") == b"kept\n"
    assert store.attached == [store.attached[0]] * 2
    # The async reads ran on this test's loop, where the store's objects live.
    assert store.read_loops == {asyncio.get_running_loop()}

    # One root over a store is attached to one running instance at a time.
    sandbox_b = krunbox.Sandbox(again_root, memory_mib=256)
    async with again.boot():
        with pytest.raises(krunbox.StoreError):
            await sandbox_b.boot()


class DictFs(krunbox.VirtualFs):
    """A writable tree in dicts; ``/secret`` raises PermissionError, ``/broken`` a bug."""

    def __init__(self) -> None:
        self.files: Dict[str, bytearray] = {"/notes/hello.txt": bytearray(b"hello from Python\n")}
        self.dirs: Set[str] = {"/", "/notes"}

    def stat(self, path: str) -> krunbox.Stat:
        if path in self.dirs:
            return krunbox.Stat("dir")
        if path in self.files:
            return krunbox.Stat("file", size=len(self.files[path]), mtime=time.time())
        if path in ("/secret", "/broken"):
            return krunbox.Stat("file", size=10)
        raise FileNotFoundError(path)  # no errno: its class says ENOENT

    def list_dir(self, path: str) -> List[str]:
        prefix = path.rstrip("/") + "/"
        names = {
            p[len(prefix) :].split("/")[0]
            for p in list(self.files) + list(self.dirs)
            if p.startswith(prefix) and p != prefix
        }
        return sorted(names | ({"secret", "broken"} if path == "/" else set()))

    async def read(self, path: str, offset: int, size: int) -> bytes:
        if path == "/secret":
            raise PermissionError(errno.EACCES, "not for the guest", path)
        if path == "/broken":
            raise ValueError("a bug in the filesystem")
        return bytes(self.files[path][offset : offset + size])

    def write(self, path: str, offset: int, data: bytes) -> int:
        file = self.files[path]
        file[offset : offset + len(data)] = data
        return len(data)

    def create(self, path: str, mode: int) -> None:
        self.files[path] = bytearray()

    def truncate(self, path: str, size: int) -> None:
        del self.files[path][size:]

    def make_dir(self, path: str, mode: int) -> None:
        self.dirs.add(path)

    def remove(self, path: str) -> None:
        del self.files[path]

    def remove_dir(self, path: str) -> None:
        if any(p.startswith(path + "/") for p in list(self.files) + list(self.dirs)):
            raise OSError(errno.ENOTEMPTY, "not empty", path)
        self.dirs.remove(path)

    def rename(self, source: str, destination: str) -> None:
        moved = {p for p in list(self.files) + list(self.dirs) if p == source or p.startswith(source + "/")}
        for old in moved:
            new = destination + old[len(source) :]
            if old in self.files:
                self.files[new] = self.files.pop(old)
            else:
                self.dirs.remove(old)
                self.dirs.add(new)


async def test_python_memory_and_host_filesystems_mounted_side_by_side(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tree = DictFs()
    shared = krunbox.MemoryFs()
    shared.write_file("/task.txt", b"from the host\n")
    project = tmp_path / "project"
    project.mkdir()
    (project / "main.py").write_text("print('hi')\n")
    (project / ".env").write_text("TOKEN=host-only\n")

    caplog.set_level(logging.ERROR, logger="krunbox")
    sandbox = krunbox.Sandbox("busybox", memory_mib=256, mounts={"/py": tree})
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    masked = krunbox.HostDir(project, hide=[".env"], hidden_store=hidden)
    mounts: krunbox.Mounts = {"/shared": shared, "/project": masked}
    async with sandbox.boot(mounts=mounts, cwd="/py") as vm:
        listed = await vm.run("ls; cat notes/hello.txt")
        assert listed.stdout_text == "broken\nnotes\nsecret\nhello from Python\n", listed

        made = await vm.run(
            "mkdir out && echo made > out/a.txt && echo more >> out/a.txt && mv out/a.txt "
            "out/b.txt && cat out/b.txt && rm notes/hello.txt && ls notes | wc -l"
        )
        assert made.stdout_text == "made\nmore\n0\n", made
        assert tree.files == {"/out/b.txt": bytearray(b"made\nmore\n")}
        assert "/out" in tree.dirs

        # A directory renamed with what is in it; a name removed and made again; a listing
        # longer than a page removed as it is read (rm -r).
        moved = await vm.run(
            "mv out done && cat done/b.txt && echo x > f && rm f && echo y > f && cat f && "
            "mkdir many && for i in $(seq 200); do echo $i > many/n$i; done && "
            "ls many | wc -l && rm -r many && ls"
        )
        assert moved.stdout_text == "made\nmore\ny\n200\nbroken\ndone\nf\nnotes\nsecret\n", moved
        assert set(tree.files) == {"/done/b.txt", "/f"} and "/many" not in tree.dirs

        secret = await vm.run("cat secret")
        assert secret.returncode != 0 and b"Permission denied" in secret.stderr, secret
        broken = await vm.run("cat broken")
        assert broken.returncode != 0 and b"Input/output error" in broken.stderr, broken

        both = await vm.run(
            "cat /shared/task.txt; echo back > /shared/reply.txt; ls -a /project; "
            "echo guest > /project/.env; cat /project/.env"
        )
        assert both.stdout_text == "from the host\n.\n..\nmain.py\nguest\n", both
    assert shared.read_file("/reply.txt") == b"back\n"
    assert (project / ".env").read_text() == "TOKEN=host-only\n"
    assert (hidden / ".env").read_text() == "guest\n"
    logged = [r.getMessage() for r in caplog.records if r.name == "krunbox"]
    assert any("a bug in the filesystem" in m for m in logged), logged
    # What the filesystem answered with an OSError (a missing name, a refusal) is not a
    # failure of it, and is not logged.
    assert not any("FileNotFoundError" in m or "PermissionError" in m for m in logged), logged
