"""The synchronous API: :mod:`krunbox`'s, each call waiting where it is made (the GIL released
while the VM works, so other threads go on)::

    from krunbox.sync import Sandbox

    with Sandbox("agent").boot() as vm:
        print(vm.run(["uname", "-r"]).stdout_text)
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from . import images as _images
from . import tools as _tools
from . import (
    MAX_OUTPUT,
    _completed,
    _Definition,
    Command,
    Completed,
    DirEntry,
    FileInfo,
    Image,
    InstanceGone,
    InvalidConfig,
    KrunboxError,
    Mounts,
    OutputLimitExceeded,
    Snapshot,
    _data,
    _env_pairs,
    _krunbox,
    _mounts,
    _PoolState,
)

__all__ = [
    "Sandbox",
    "Pool",
    "Instance",
    "Toolbox",
    "Process",
    "FileReader",
    "FileWriter",
    "NetworkEvents",
    "Images",
]

OnOutput = Callable[[bytes], Any]
"""A callback for each chunk of a command's output, as it comes."""


def _collect(stream: "OutputStream", callback: Optional[OnOutput], name: str) -> bytes:
    parts: List[bytes] = []
    total = 0
    for chunk in stream:
        total += len(chunk)
        if total > MAX_OUTPUT:
            raise OutputLimitExceeded(
                f"the command's {name} passed {MAX_OUTPUT} bytes: stream it with spawn()"
            )
        parts.append(chunk)
        if callback is not None:
            callback(chunk)
    return b"".join(parts)


class _Beside(threading.Thread):
    """Work on a thread of its own (a stream pumped while another is), its result or
    exception kept for :meth:`result`; on an exception it calls ``failed`` first (kills the
    process, so that the other streams end too rather than wait on a reader that stopped)."""

    def __init__(self, work: Callable[[], Any], failed: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self._work = work
        self._failed = failed
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self.start()

    def run(self) -> None:
        try:
            self._value = self._work()
        except BaseException as error:  # handed to result()
            self._error = error
            self._failed()

    def result(self) -> Any:
        self.join()
        if self._error is not None:
            raise self._error
        return self._value


class Sandbox(_Definition):
    """A sandbox definition (see :class:`krunbox.Sandbox`)."""


    def boot(
        self,
        *,
        mounts: Optional[Mounts] = None,
        hostname: Optional[str] = None,
        cwd: Optional[str] = None,
    ) -> "Instance":
        """Boots an instance; ``with sandbox.boot() as vm:`` shuts it down at the block's end.
        ``mounts``, ``hostname`` and ``cwd`` are this boot's own (see
        :meth:`krunbox.Sandbox.boot`)."""
        native = self._native.boot_blocking(mounts=_mounts(mounts), hostname=hostname, cwd=cwd)
        return Instance(native)

    def restore(self, snapshot: Snapshot) -> "Instance":
        """Restores ``snapshot`` as a new running instance (see
        :meth:`krunbox.Sandbox.restore`)."""
        return Instance(self._native.restore_blocking(snapshot._native))

    def pool(self, size: int) -> "Pool":
        """A warm pool of ``size`` instances (see :meth:`krunbox.Sandbox.pool`); ``with
        sandbox.pool(2) as pool:`` shuts it down at the block's end."""
        return Pool(self._native.pool(size))


class Pool(_PoolState):
    """Instances booted ahead of need (see :class:`krunbox.Pool`)."""

    def take(self) -> "Instance":
        """A running instance that never ran anything."""
        return Instance(self._native.take_blocking())

    def shutdown(self) -> None:
        """Stops the pool and shuts down the instances still in it."""
        self._native.shutdown_blocking()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class Instance:
    """A running sandbox (see :class:`krunbox.Instance`)."""

    def __init__(self, native: _krunbox.Instance) -> None:
        self._native = native

    def run(
        self,
        cmd: Command,
        *,
        input: Optional[Union[bytes, str]] = None,
        on_stdout: Optional[OnOutput] = None,
        on_stderr: Optional[OnOutput] = None,
        timeout: Optional[float] = None,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        check: bool = False,
    ) -> Completed:
        """Runs ``cmd`` to its end (see :meth:`krunbox.Instance.run`). ``on_stderr`` is
        called on a thread of its own."""
        if input is None and on_stdout is None and on_stderr is None:
            return self._native.run_blocking(
                cmd, timeout=timeout, cwd=cwd, env=_env_pairs(env), check=check
            )
        proc = self.spawn(cmd, stdin=input is not None, timeout=timeout, cwd=cwd, env=env)
        try:
            feeding = _Beside(lambda: self._feed(proc, input), proc.kill)
            errors = _Beside(lambda: _collect(proc.stderr, on_stderr, "stderr"), proc.kill)
            stdout = _collect(proc.stdout, on_stdout, "stdout")
            stderr = errors.result()
            feeding.result()
            returncode = proc.wait()
        except BaseException:
            proc.kill()
            raise
        return _completed(cmd, returncode, stdout, stderr, proc.timed_out, check)

    @staticmethod
    def _feed(proc: "Process", data: Optional[Union[bytes, str]]) -> None:
        if proc.stdin is None or data is None:
            return
        try:
            proc.stdin.write(data)
            proc.stdin.close()
        except InstanceGone:
            raise
        except KrunboxError:
            pass  # it ended without reading it all: no error, as in subprocess

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

    def list_dir(self, path: str) -> List[DirEntry]:
        """The entries of the guest directory ``path``, sorted by name."""
        return self._native.list_dir_blocking(path)

    def stat(self, path: str, *, follow_symlinks: bool = True) -> FileInfo:
        """What ``stat`` says about ``path``."""
        return self._native.stat_blocking(path, follow_symlinks)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Removes a file, a symlink or an empty directory; ``recursive=True`` a whole tree."""
        self._native.remove_blocking(path, recursive)

    def rename(self, source: str, destination: str) -> None:
        """Renames ``source`` to ``destination``, replacing a file there atomically."""
        self._native.rename_blocking(source, destination)

    def make_dir(self, path: str, *, mode: int = 0o755, parents: bool = False) -> None:
        """Makes the directory ``path`` (``parents=True``: and those above it)."""
        self._native.make_dir_blocking(path, mode, parents)

    def open_reader(self, path: str) -> "FileReader":
        """Reads the guest file ``path`` in chunks: ``with vm.open_reader(p) as r: for chunk
        in r: ...``."""
        return FileReader(self._native.open_reader_blocking(path))

    def open_writer(self, path: str, *, mode: int = 0o644) -> "FileWriter":
        """Writes the guest file ``path`` in chunks; the ``with`` block's end (or
        :meth:`FileWriter.close`) waits until the guest has it all on disk."""
        return FileWriter(self._native.open_writer_blocking(path, mode))

    def isolation(self) -> Dict[str, Any]:
        """The VMM helper's confinement (see :meth:`krunbox.Instance.isolation`)."""
        result: Dict[str, Any] = self._native.isolation()
        return result

    def metrics(self) -> Dict[str, Any]:
        """What the instance uses now (see :meth:`krunbox.Instance.metrics`)."""
        result: Dict[str, Any] = self._native.metrics()
        return result

    def published_address(self, guest_port: int) -> Optional[Tuple[str, int]]:
        """Where on the host the guest's TCP ``guest_port`` is published, if it is."""
        return self._native.published_address(guest_port)

    def network_events(self) -> "NetworkEvents":
        """The network's audit events from now on, as an iterator of dicts (see
        :meth:`krunbox.Instance.network_events`)."""
        events = self._native.network_events()
        if events is None:
            raise InvalidConfig("this sandbox has no network: give it a krunbox.Network")
        return NetworkEvents(events)

    def shutdown(self) -> None:
        """Stops the VM."""
        self._native.shutdown_blocking()

    def pause(self) -> None:
        """Stops the VM's vCPUs and devices until :meth:`resume` (see
        :meth:`krunbox.Instance.pause`)."""
        self._native.pause_blocking()

    def resume(self) -> None:
        """Resumes a paused VM where it stopped."""
        self._native.resume_blocking()

    @property
    def paused(self) -> bool:
        """Whether the VM is paused."""
        return self._native.is_paused()

    @property
    def host_boot_work(self) -> float:
        """Seconds of the host's own work in this boot before the VM started."""
        return self._native.host_boot_work()

    def snapshot(self, dir: str) -> Snapshot:
        """Writes a snapshot of this instance into the new directory ``dir`` (see
        :meth:`krunbox.Instance.snapshot`)."""
        return Snapshot(self._native.snapshot_blocking(dir))

    def fork(self, n: int) -> List["Instance"]:
        """Forks this instance into ``n`` new ones (see :meth:`krunbox.Instance.fork`)."""
        return [Instance(native) for native in self._native.fork_blocking(n)]

    def processes(self) -> List[int]:
        """The guest pids of a restored instance's processes not attached yet."""
        return self._native.processes()

    def attach(self, pid: int) -> "Process":
        """Takes over process ``pid`` of a restored instance (see
        :meth:`krunbox.Instance.attach`)."""
        return Process(self._native.attach(pid), has_stdin=True)

    def __enter__(self) -> "Instance":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class NetworkEvents:
    """A sandbox network's audit events (an iterator of dicts; it ends when the network
    stops)."""

    def __init__(self, native: _krunbox.NetworkEvents) -> None:
        self._native = native

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        return self

    def __next__(self) -> Dict[str, Any]:
        event: Optional[Dict[str, Any]] = self._native.next_blocking()
        if event is None:
            raise StopIteration
        return event


class Images(_images._Store):
    """A local store of OCI images (see :class:`krunbox.Images`), importing and pulling here."""

    def import_archive(self, name: str, archive: _images.PathLike) -> Image:
        """Imports ``archive`` as ``name`` (see :meth:`krunbox.Images.import_archive`)."""
        return self._native.import_archive_blocking(name, os.fspath(archive))

    def pull(
        self,
        name: str,
        reference: str,
        *,
        username: Optional[str] = None,
        password: Optional[str] = None,
        plain_http: bool = False,
        ca_pem: Optional[bytes] = None,
    ) -> Image:
        """Pulls ``reference`` as ``name`` (see :meth:`krunbox.Images.pull`)."""
        return self._native.pull_blocking(
            name,
            reference,
            username=username,
            password=password,
            plain_http=plain_http,
            ca_pem=ca_pem,
        )


class FileReader:
    """A guest file read in chunks: ``for chunk in reader``, or :meth:`read`."""

    def __init__(self, native: _krunbox.FileReader) -> None:
        self._native = native

    def read(self, max: int = 1 << 20) -> bytes:
        """Up to ``max`` bytes (at most 1 MiB); ``b""`` at the end of the file."""
        return self._native.read_blocking(max)

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        chunk = self._native.read_blocking(1 << 20)
        if not chunk:
            raise StopIteration
        return chunk

    def __enter__(self) -> "FileReader":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class FileWriter:
    """A guest file written in chunks; :meth:`close` makes it whole."""

    def __init__(self, native: _krunbox.FileWriter) -> None:
        self._native = native

    def write(self, data: Union[bytes, str]) -> None:
        """Writes ``data`` (a ``str`` as UTF-8), whole."""
        self._native.write_blocking(_data(data))

    def close(self) -> None:
        """Waits until the guest has written everything and ``fsync``ed the file."""
        self._native.finish_blocking()

    def __enter__(self) -> "FileWriter":
        return self

    def __exit__(self, kind: Optional[type], *exc: object) -> None:
        if kind is None:
            self.close()


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

    @property
    def timed_out(self) -> bool:
        """Whether its ``timeout`` ended it (known once :meth:`wait` has returned)."""
        return self._native.timed_out

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


class Toolbox:
    """:class:`krunbox.tools.Toolbox` over an instance of this module: :meth:`call` waits here."""

    def __init__(
        self,
        instance: Instance,
        *,
        workspace: str = "/",
        permissions: Optional[Mapping[str, Any]] = None,
        approver: Optional[_tools.Approver] = None,
        output_cap: Optional[int] = None,
    ) -> None:
        self._native = _tools._native_toolbox(
            instance, workspace, permissions, approver, output_cap, blocking=True
        )

    def definitions(self, format: str = "mcp") -> List[Dict[str, Any]]:
        """The tools' definitions in ``format``: "mcp", "openai" or "anthropic"."""
        result: List[Dict[str, Any]] = self._native.definitions(format)
        return result

    def call(self, name: str, arguments: Optional[Mapping[str, Any]] = None) -> _tools.ToolResult:
        """Runs a model's call; bad arguments, refused permissions and failed commands are
        results with ``is_error``."""
        return self._native.call_blocking(name, json.dumps(arguments or {}))
