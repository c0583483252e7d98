"""Run untrusted commands in libkrun microVMs, from asyncio.

A :class:`Sandbox` is a definition (its root image and resources), booted into as many
:class:`Instance` s as wanted; each is a VM of its own, shut down when its ``async with``
ends::

    import asyncio
    import krunbox

    async def main():
        sandbox = krunbox.Sandbox("agent", memory_mib=512)
        async with sandbox.boot() as vm:
            done = await vm.run("python3 -c 'print(6 * 7)'", timeout=30)
            print(done.returncode, done.stdout_text)   # 0 42

    asyncio.run(main())

The same API without ``await`` is :mod:`krunbox.sync`. Errors are :class:`KrunboxError` s, one
subclass per case a caller handles differently.
"""

from __future__ import annotations

import os
from typing import (
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from . import _krunbox
from ._krunbox import (
    TIMEOUT_EXIT_CODE,
    BootFailed,
    Cancelled,
    CommandFailed,
    CommandTimeout,
    Completed,
    ExecFailed,
    GuestFsError,
    GuestHung,
    ImageDigestMismatch,
    InstanceGone,
    InvalidConfig,
    IsolationUnavailable,
    KrunboxError,
    MissingArtifact,
    OutputLimitExceeded,
    RequestTimeout,
    RootInUse,
    StoreError,
    TooMany,
)

__all__ = [
    "Sandbox",
    "Instance",
    "Process",
    "OutputStream",
    "InputStream",
    "Completed",
    "TIMEOUT_EXIT_CODE",
    "KrunboxError",
    "BootFailed",
    "Cancelled",
    "CommandFailed",
    "CommandTimeout",
    "ExecFailed",
    "GuestFsError",
    "GuestHung",
    "ImageDigestMismatch",
    "InstanceGone",
    "InvalidConfig",
    "IsolationUnavailable",
    "MissingArtifact",
    "OutputLimitExceeded",
    "RequestTimeout",
    "RootInUse",
    "StoreError",
    "TooMany",
]

ARTIFACTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_artifacts")
"""The run-time files this package ships (the ``krunbox-vmm`` helper, guest-init); the guest
kernel (libkrunfw) is found as the Rust library finds it (``krunbox setup``, the cache)."""

Command = Union[str, Sequence[str]]
"""A shell command line (run by ``sh -c``), or a program and its arguments."""


def _env_pairs(env: Optional[Mapping[str, str]]) -> Optional[List[Tuple[str, str]]]:
    return None if env is None else [(str(k), str(v)) for k, v in env.items()]


def _data(data: Union[bytes, bytearray, memoryview, str]) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


class Sandbox:
    """A sandbox definition: the root image and resources every instance boots with.

    ``image`` is a built-in image: ``"agent"`` (Debian with python3, pip, node, npm, gh, git
    and curl) or ``"busybox"``. Booting is cheap; boot one instance per task.

    >>> sandbox = Sandbox("busybox", cpus=1, memory_mib=256)  # doctest: +SKIP
    """

    def __init__(
        self,
        image: str = "agent",
        *,
        cpus: Optional[int] = None,
        memory_mib: Optional[int] = None,
        hostname: Optional[str] = None,
    ) -> None:
        self._native = _krunbox.Sandbox(
            image, cpus=cpus, memory_mib=memory_mib, hostname=hostname, artifacts=ARTIFACTS
        )

    def boot(self) -> "_Booting":
        """Boots an instance: ``vm = await sandbox.boot()``, or ``async with sandbox.boot() as
        vm:`` to shut it down at the block's end."""
        return _Booting(self._native)

    def __repr__(self) -> str:
        return repr(self._native)


class _Booting:
    """A boot under way: awaitable (the instance) and an async context manager (the instance,
    shut down at the block's end)."""

    def __init__(self, native: _krunbox.Sandbox) -> None:
        self._native = native
        self._instance: Optional[Instance] = None

    async def _boot(self) -> "Instance":
        return Instance(await self._native.boot())

    def __await__(self) -> Generator[Any, None, "Instance"]:
        return self._boot().__await__()

    async def __aenter__(self) -> "Instance":
        self._instance = await self._boot()
        return self._instance

    async def __aexit__(self, *exc: object) -> None:
        if self._instance is not None:
            await self._instance.shutdown()


class Instance:
    """A running sandbox: a VM of its own. ``async with`` shuts it down at the block's end."""

    def __init__(self, native: _krunbox.Instance) -> None:
        self._native = native

    async def run(
        self,
        cmd: Command,
        *,
        timeout: Optional[float] = None,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        check: bool = False,
    ) -> Completed:
        """Runs ``cmd`` to its end and returns its :class:`Completed`.

        ``cmd`` is a shell command line (``"ls -l | wc -l"``, run by ``sh -c``) or a list of a
        program and its arguments. ``timeout`` (seconds) kills the command's process group
        when it passes: the exit code is then 124. ``check=True`` raises
        :class:`CommandFailed` (:class:`CommandTimeout` for a timeout) for an exit code other
        than 0. Cancelling the awaiting task kills the command's process group.
        """
        return await self._native.run(
            cmd, timeout=timeout, cwd=cwd, env=_env_pairs(env), check=check
        )

    async def spawn(
        self,
        cmd: Command,
        *,
        stdin: bool = False,
        pty: Optional[Tuple[int, int]] = None,
        timeout: Optional[float] = None,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
    ) -> "Process":
        """Starts ``cmd`` and returns its :class:`Process` as soon as it runs::

            proc = await vm.spawn(["cat"], stdin=True)
            await proc.stdin.write(b"hello")
            await proc.stdin.close()
            async for chunk in proc.stdout:
                print(chunk)
            print(await proc.wait())   # 0

        ``pty=(rows, cols)`` runs it on a terminal of that size: its output (stdout and stderr
        together) is ``stdout``, its keyboard ``stdin``. The process is killed if the
        :class:`Process` is dropped before it ends.
        """
        native = await self._native.spawn(
            cmd, stdin=stdin or pty is not None, pty=pty, timeout=timeout, cwd=cwd,
            env=_env_pairs(env),
        )
        return Process(native, has_stdin=stdin or pty is not None)

    async def read_file(self, path: str) -> bytes:
        """The file at ``path`` in the guest, whole."""
        return await self._native.read_file(path)

    async def write_file(self, path: str, data: Union[bytes, str]) -> None:
        """Writes ``data`` (a ``str`` as UTF-8) to ``path`` in the guest, replacing the file."""
        await self._native.write_file(path, _data(data))

    async def shutdown(self) -> None:
        """Stops the VM; later calls fail with :class:`InstanceGone`."""
        await self._native.shutdown()

    async def __aenter__(self) -> "Instance":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()


class OutputStream:
    """A process's stdout or stderr: ``async for chunk in stream`` gets its bytes as they come,
    ``await stream.read()`` all of the rest."""

    def __init__(self, read: Callable[[int], Awaitable[bytes]]) -> None:
        self._read = read

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._read(65536)
        if not chunk:
            raise StopAsyncIteration
        return chunk

    async def read(self) -> bytes:
        """Everything until the stream ends."""
        return b"".join([chunk async for chunk in self])


class InputStream:
    """A process's stdin."""

    def __init__(self, native: _krunbox.Process) -> None:
        self._native = native

    async def write(self, data: Union[bytes, str]) -> None:
        """Writes ``data`` (a ``str`` as UTF-8), whole."""
        await self._native.write_stdin(_data(data))

    async def close(self) -> None:
        """Closes it: the process reads its end."""
        await self._native.close_stdin()


class Process:
    """A command running in the guest (:meth:`Instance.spawn`)."""

    def __init__(self, native: _krunbox.Process, *, has_stdin: bool) -> None:
        self._native = native
        self.stdout = OutputStream(native.read_stdout)
        """Its standard output (a pty's whole output)."""
        self.stderr = OutputStream(native.read_stderr)
        """Its standard error."""
        self.stdin: Optional[InputStream] = InputStream(native) if has_stdin else None
        """Its standard input, when spawned with ``stdin=True`` or a pty."""

    @property
    def pid(self) -> int:
        """Its process id in the guest."""
        return self._native.pid

    async def wait(self) -> int:
        """Waits for it to end: its exit code, ``-N`` for signal N, 124 for its timeout."""
        return await self._native.wait()

    def signal(self, signal: int) -> None:
        """Sends ``signal`` (e.g. ``signal.SIGTERM``) to its process group."""
        self._native.signal(int(signal))

    def kill(self) -> None:
        """Kills its process group (``wait`` then returns -9)."""
        self._native.kill()

    def resize(self, rows: int, cols: int) -> None:
        """Resizes its pty; the foreground process group gets SIGWINCH."""
        self._native.resize(rows, cols)
