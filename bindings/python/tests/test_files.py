"""Files and streamed runs in a real microVM: list, stat, rename, remove, directories, a file
streamed in and out in chunks, and ``run`` with ``input=`` and output callbacks.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import List

import pytest

import krunbox


async def test_files_streams_and_callbacks_on_one_instance() -> None:
    async with krunbox.Sandbox("busybox", memory_mib=256).boot() as vm:
        await vm.make_dir("/tmp/work/a/b", parents=True)
        await vm.make_dir("/tmp/work/a/b", parents=True)  # there already: no error
        await vm.write_file("/tmp/work/one.txt", "one\n")
        await vm.run("ln -s one.txt /tmp/work/link")
        listed = [(e.name, e.type) for e in await vm.list_dir("/tmp/work")]
        assert listed == [("a", "dir"), ("link", "symlink"), ("one.txt", "file")]

        info = await vm.stat("/tmp/work/link")
        assert (info.type, info.size, info.mode) == ("file", 4, 0o644)
        assert (await vm.stat("/tmp/work/link", follow_symlinks=False)).type == "symlink"
        assert info.mtime > 1_600_000_000

        await vm.rename("/tmp/work/one.txt", "/tmp/work/a/moved.txt")
        assert await vm.read_file("/tmp/work/a/moved.txt") == b"one\n"
        with pytest.raises(krunbox.GuestFsError, match="not empty|Directory not empty"):
            await vm.remove("/tmp/work/a")
        await vm.remove("/tmp/work/a", recursive=True)
        assert [e.name for e in await vm.list_dir("/tmp/work")] == ["link"]
        with pytest.raises(krunbox.GuestFsError):
            await vm.stat("/tmp/work/a")

        # 3 MiB out in chunks and back: the same bytes, as the guest's own sha256sum says.
        data = os.urandom(3 << 20)
        async with vm.open_writer("/tmp/big.bin", mode=0o600) as writer:
            for start in range(0, len(data), 700_000):
                await writer.write(data[start : start + 700_000])
        summed = await vm.run("sha256sum /tmp/big.bin", check=True)
        assert summed.stdout_text.split()[0] == hashlib.sha256(data).hexdigest()
        assert (await vm.stat("/tmp/big.bin")).mode == 0o600
        back = bytearray()
        async with vm.open_reader("/tmp/big.bin") as reader:
            async for chunk in reader:
                assert 0 < len(chunk) <= 1 << 20
                back += chunk
        assert bytes(back) == data

        # input= goes to stdin; callbacks get the output as it comes, async ones awaited.
        out: List[bytes] = []
        err: List[bytes] = []

        async def on_stderr(chunk: bytes) -> None:
            err.append(chunk)

        done = await vm.run(
            "tr a-z A-Z; echo done >&2; exit 4",
            input="shout\n",
            on_stdout=out.append,
            on_stderr=on_stderr,
        )
        assert (done.returncode, done.stdout, done.stderr) == (4, b"SHOUT\n", b"done\n")
        assert (b"".join(out), b"".join(err)) == (b"SHOUT\n", b"done\n")
        with pytest.raises(krunbox.CommandFailed) as failed:
            await vm.run("cat; exit 2", input=b"x", on_stdout=out.append, check=True)
        assert failed.value.result.stdout == b"x"

        # A callback that raises kills the command and is raised here.
        def explode(chunk: bytes) -> None:
            raise ValueError("callback bug")

        with pytest.raises(ValueError, match="callback bug"):
            await vm.run("echo first; exec sleep 300", on_stdout=explode)
        for _ in range(50):  # the kill is asynchronous: wait for the sleep to be gone
            left = (await vm.run("pgrep -x sleep || true")).stdout
            if left == b"":
                break
            await asyncio.sleep(0.2)
        assert left == b"", left
