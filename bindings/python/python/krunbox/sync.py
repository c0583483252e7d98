"""The synchronous API: :mod:`krunbox`'s, each call waiting where it is made (the GIL released
while the VM works, so other threads go on)::

    from krunbox.sync import Sandbox

    with Sandbox("agent").boot() as vm:
        print(vm.run(["uname", "-r"]).stdout_text)
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, Optional, Tuple, Union

from . import ARTIFACTS, Command, Completed, _data, _env_pairs, _krunbox

__all__ = ["Sandbox", "Instance", "Process"]


class Sandbox:
    """A sandbox definition (see :class:`krunbox.Sandbox`)."""

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

    def boot(self) -> "Instance":
        """Boots an instance; ``with sandbox.boot() as vm:`` shuts it down at the block's end."""
        return Instance(self._native.boot_blocking())

    def __repr__(self) -> str:
        return repr(self._native)


class Instance:
    """A running sandbox (see :class:`krunbox.Instance`)."""

    def __init__(self, native: _krunbox.Instance) -> None:
        self._native = native

    def run(
        self,
        cmd: Command,
        *,
        timeout: Optional[float] = None,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        check: bool = False,
    ) -> Completed:
        """Runs ``cmd`` to its end (see :meth:`krunbox.Instance.run`)."""
        return self._native.run_blocking(
            cmd, timeout=timeout, cwd=cwd, env=_env_pairs(env), check=check
        )

    def spawn(
        self,
        cmd: Command,
        *,
        stdin: bool = False,
        pty: Optional[Tuple[int, int]] = None,
        timeout: Optional[float] = None,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
    ) -> "Process":
        """Starts ``cmd`` (see :meth:`krunbox.Instance.spawn`)."""
        has_stdin = stdin or pty is not None
        native = self._native.spawn_blocking(
            cmd, stdin=has_stdin, pty=pty, timeout=timeout, cwd=cwd, env=_env_pairs(env)
        )
        return Process(native, has_stdin=has_stdin)

    def read_file(self, path: str) -> bytes:
        """The file at ``path`` in the guest, whole."""
        return self._native.read_file_blocking(path)

    def write_file(self, path: str, data: Union[bytes, str]) -> None:
        """Writes ``data`` to ``path`` in the guest, replacing the file."""
        self._native.write_file_blocking(path, _data(data))

    def shutdown(self) -> None:
        """Stops the VM."""
        self._native.shutdown_blocking()

    def __enter__(self) -> "Instance":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class OutputStream:
    """A process's stdout or stderr: ``for chunk in stream`` gets its bytes as they come."""

    def __init__(self, read: Callable[[int], bytes]) -> None:
        self._read = read

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        chunk = self._read(65536)
        if not chunk:
            raise StopIteration
        return chunk

    def read(self) -> bytes:
        """Everything until the stream ends."""
        return b"".join(self)


class InputStream:
    """A process's stdin."""

    def __init__(self, native: _krunbox.Process) -> None:
        self._native = native

    def write(self, data: Union[bytes, str]) -> None:
        """Writes ``data``, whole."""
        self._native.write_stdin_blocking(_data(data))

    def close(self) -> None:
        """Closes it."""
        self._native.close_stdin_blocking()


class Process:
    """A command running in the guest (see :class:`krunbox.Process`)."""

    def __init__(self, native: _krunbox.Process, *, has_stdin: bool) -> None:
        self._native = native
        self.stdout = OutputStream(native.read_stdout_blocking)
        self.stderr = OutputStream(native.read_stderr_blocking)
        self.stdin: Optional[InputStream] = InputStream(native) if has_stdin else None

    @property
    def pid(self) -> int:
        """Its process id in the guest."""
        return self._native.pid

    def wait(self) -> int:
        """Waits for it to end: its exit code, ``-N`` for signal N, 124 for its timeout."""
        return self._native.wait_blocking()

    def signal(self, signal: int) -> None:
        """Sends ``signal`` to its process group."""
        self._native.signal(int(signal))

    def kill(self) -> None:
        """Kills its process group."""
        self._native.kill()

    def resize(self, rows: int, cols: int) -> None:
        """Resizes its pty."""
        self._native.resize(rows, cols)
