"""Streaming processes in a real microVM: stdin and stdout as they run, signals, a pty."""

import asyncio
import signal

import krunbox
import krunbox.sync


async def _until(stream: krunbox.OutputStream, wanted: bytes) -> bytes:
    seen = b""
    async for chunk in stream:
        seen += chunk
        if wanted in seen:
            break
    return seen


async def test_streams_signals_and_a_pty_with_resize() -> None:
    async with krunbox.Sandbox("busybox", memory_mib=256).boot() as vm:
        # stdin in, stdout out, while it runs.
        cat = await vm.spawn(["cat"], stdin=True)
        assert cat.stdin is not None
        await cat.stdin.write("hello ")
        assert await _until(cat.stdout, b"hello ") == b"hello "
        await cat.stdin.write(b"again")
        await cat.stdin.close()
        assert await cat.stdout.read() == b"again"
        assert await cat.wait() == 0

        # A signal reaches a process that another task is waiting on.
        sleeper = await vm.spawn("echo ready; echo err >&2; exec sleep 300")
        assert b"ready" in await _until(sleeper.stdout, b"ready")
        # (Not read to its end: the sleep holds stderr open.)
        assert await _until(sleeper.stderr, b"err\n") == b"err\n"
        waiting = asyncio.create_task(sleeper.wait())
        await asyncio.sleep(0.2)
        sleeper.signal(signal.SIGTERM)
        assert await waiting == -signal.SIGTERM

        killed = await vm.spawn(["sleep", "300"])
        killed.kill()
        assert await killed.wait() == -signal.SIGKILL

        # A terminal: its size, then a resize the program sees.
        term = await vm.spawn("stty size; read line; stty size", pty=(24, 80))
        assert term.stdin is not None
        assert b"24 80" in await _until(term.stdout, b"24 80")
        term.resize(30, 100)
        await term.stdin.write(b"go\n")
        assert b"30 100" in await _until(term.stdout, b"30 100")
        assert await term.wait() == 0


def test_the_sync_api_streams_too() -> None:
    with krunbox.sync.Sandbox("busybox", memory_mib=256).boot() as vm:
        proc = vm.spawn(["sh", "-c", "read x; echo got $x; exit 4"], stdin=True)
        assert proc.stdin is not None
        proc.stdin.write("it\n")
        assert proc.stdout.read() == b"got it\n"
        assert proc.wait() == 4
