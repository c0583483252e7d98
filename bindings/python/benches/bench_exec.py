"""The Python API against the Rust API on one booted VM: a ``run("true")`` round trip and a
run writing 16 MiB to stdout, each timed through ``krunbox`` (asyncio) and, alternating with
it, through the library's Rust API in the same process (``_krunbox._rust_run_seconds``): the
ratio is what the binding costs. The goal is at most 1.2x. It reports, it asserts no timing.

Each side runs once untimed first, then they alternate which goes first. Run by the test
command once as a smoke test (3 round trips, one 16 MiB run each); with ``--bench`` 20 round
trips and 5 runs of 16 MiB. Under nested emulation absolute times mean
little; the ratios measured in the same run are what we report.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import List

import krunbox
from krunbox import _krunbox

MIB = 1 << 20


async def python_seconds(vm: krunbox.Instance, args: List[str], stdout_bytes: int) -> float:
    start = time.perf_counter()
    done = await vm.run(args)
    seconds = time.perf_counter() - start
    if done.returncode != 0 or len(done.stdout) != stdout_bytes:
        raise RuntimeError(f"the bench's run of {args} went wrong: {done}")
    return seconds


async def compare(
    vm: krunbox.Instance, name: str, args: List[str], stdout_bytes: int, rounds: int
) -> None:
    python: List[float] = []
    rust: List[float] = []

    async def rust_seconds() -> float:
        native = vm._native
        return await asyncio.to_thread(_krunbox._rust_run_seconds, native, args, stdout_bytes)

    # One untimed run of each first (the guest's page cache, the host's allocations), then
    # the sides alternate which goes first, so neither always pays for the other's leftovers.
    await python_seconds(vm, args, stdout_bytes)
    await rust_seconds()
    for i in range(rounds):
        if i % 2:
            rust.append(await rust_seconds())
            python.append(await python_seconds(vm, args, stdout_bytes))
        else:
            python.append(await python_seconds(vm, args, stdout_bytes))
            rust.append(await rust_seconds())
    p, r = statistics.median(python), statistics.median(rust)
    print(f"python/{name:<24} python {p * 1e3:9.1f} ms  rust {r * 1e3:9.1f} ms  ({rounds} rounds)")

    print(f"python/{name + ' ratio python / rust':<24} {p / r:.3f}x  (goal: at most 1.2x)")


async def main() -> None:
    full = "--bench" in sys.argv
    trips, streams = (20, 5) if full else (3, 1)
    sandbox = krunbox.Sandbox("busybox", cpus=2, memory_mib=512)
    async with sandbox.boot() as vm:
        await compare(vm, "run(true)", ["true"], 0, trips)
        head = ["head", "-c", str(16 * MIB), "/dev/zero"]
        await compare(vm, "16 MiB of stdout", head, 16 * MIB, streams)


if __name__ == "__main__":
    asyncio.run(main())
