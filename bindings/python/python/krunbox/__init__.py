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

from typing import Any, Generator, List, Mapping, Optional, Sequence, Tuple, Union

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
            image, cpus=cpus, memory_mib=memory_mib, hostname=hostname
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
