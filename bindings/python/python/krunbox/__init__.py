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

import asyncio
import inspect
import os
from typing import (
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Dict,
    Generator,
    Generic,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

from . import _krunbox
from ._krunbox import (
    MAX_OUTPUT,
    TIMEOUT_EXIT_CODE,
    BootFailed,
    Cancelled,
    CommandFailed,
    CommandTimeout,
    Completed,
    DirEntry,
    ExecFailed,
    FileInfo,
    GuestFsError,
    GuestHung,
    ImageDigestMismatch,
    InstanceGone,
    InvalidConfig,
    IsolationUnavailable,
    KrunboxError,
    MissingArtifact,
    OutputLimitExceeded,
    Paused,
    RequestTimeout,
    RootInUse,
    SnapshotFailed,
    SnapshotTampered,
    StoreError,
    TooMany,
)

from .fs import HostDir, MemoryFs, Stat, VirtualFs
from .images import Image, Images
from .net import Answer, Flow, Network, Request, Secret, Verdict
from .rootfs import BlockStore, DirectoryStore, MemoryStore, Rootfs
from .tools import Toolbox, ToolResult

__all__ = [
    "Sandbox",
    "Toolbox",
    "ToolResult",
    "Command",
    "Mounts",
    "Filesystem",
    "Rootfs",
    "Images",
    "Image",
    "BlockStore",
    "DirectoryStore",
    "MemoryStore",
    "VirtualFs",
    "Stat",
    "MemoryFs",
    "HostDir",
    "Network",
    "Secret",
    "Verdict",
    "Flow",
    "Request",
    "Answer",
    "Instance",
    "Pool",
    "Snapshot",
    "Process",
    "OutputStream",
    "InputStream",
    "Completed",
    "FileInfo",
    "DirEntry",
    "FileReader",
    "FileWriter",
    "NetworkEvents",
    "TIMEOUT_EXIT_CODE",
    "MAX_OUTPUT",
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
    "Paused",
    "RequestTimeout",
    "RootInUse",
    "SnapshotFailed",
    "SnapshotTampered",
    "StoreError",
    "TooMany",
]

ARTIFACTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_artifacts")
"""The run-time files this package ships (the ``krunbox-vmm`` helper, guest-init): every boot
and image build of this process finds them first, unless ``KRUNBOX_VMM`` or
``KRUNBOX_GUEST_INIT`` name others. The guest kernel (libkrunfw) is found as the Rust library
finds it (``krunbox setup``, the cache)."""

_krunbox._search_artifacts_first(ARTIFACTS)

Command = Union[str, Sequence[str]]
"""A shell command line (run by ``sh -c``), or a program and its arguments."""

Filesystem = Union[MemoryFs, HostDir, VirtualFs]
"""What can be mounted: a :class:`MemoryFs`, a :class:`HostDir`, or a :class:`VirtualFs`."""

Mounts = Mapping[str, Filesystem]
"""Guest paths and the filesystems mounted there."""


def _mounts(mounts: Optional[Mounts]) -> List[Tuple[str, Any]]:
    return [] if mounts is None else [(str(path), fs) for path, fs in mounts.items()]


def _env_pairs(env: Optional[Mapping[str, str]]) -> Optional[List[Tuple[str, str]]]:
    return None if env is None else [(str(k), str(v)) for k, v in env.items()]


def _data(data: Union[bytes, bytearray, memoryview, str]) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


OnOutput = Callable[[bytes], Optional[Awaitable[None]]]
"""A callback for each chunk of a command's output, as it comes (plain or ``async``)."""


async def _collect(stream: "OutputStream", callback: Optional[OnOutput], name: str) -> bytes:
    """All of ``stream``, each chunk given to ``callback`` first; at most :data:`MAX_OUTPUT`."""
    parts: List[bytes] = []
    total = 0
    async for chunk in stream:
        total += len(chunk)
        if total > MAX_OUTPUT:
            raise OutputLimitExceeded(
                f"the command's {name} passed {MAX_OUTPUT} bytes: stream it with spawn()"
            )
        parts.append(chunk)
        if callback is not None:
            returned = callback(chunk)
            if inspect.isawaitable(returned):
                await returned
    return b"".join(parts)


def _completed(
    cmd: Command, returncode: int, stdout: bytes, stderr: bytes, timed_out: bool, check: bool
) -> Completed:
    """A streamed run's :class:`Completed`, as ``run`` gives it (checked if asked)."""
    done = Completed(_krunbox.command_args(cmd), returncode, stdout, stderr, timed_out=timed_out)
    if check:
        done.check_returncode()
    return done


async def _feed(stdin: Optional["InputStream"], data: Optional[bytes]) -> None:
    """Writes ``data`` to ``stdin`` and closes it; a process that ended without reading it all
    is no error (as ``subprocess`` has it)."""
    if stdin is None or data is None:
        return
    try:
        await stdin.write(data)
        await stdin.close()
    except InstanceGone:
        raise
    except KrunboxError:
        pass


class _Definition:
    """What the asyncio and the sync ``Sandbox`` share: the definition, checked as it is made."""

    def __init__(
        self,
        image: Union[str, Rootfs] = "agent",
        *,
        cpus: Optional[int] = None,
        memory_mib: Optional[int] = None,
        hostname: Optional[str] = None,
        mounts: Optional[Mounts] = None,
        network: Optional[Network] = None,
        snapshots: bool = False,
        snapshot_key_dir: Optional[str] = None,
    ) -> None:
        self._native = _krunbox.Sandbox(
            image,
            cpus=cpus,
            memory_mib=memory_mib,
            hostname=hostname,
            mounts=_mounts(mounts),
            network=None if network is None else network._native,
            snapshots=snapshots,
            snapshot_key_dir=snapshot_key_dir,
        )

    def __repr__(self) -> str:
        return repr(self._native)


class Sandbox(_Definition):
    """A sandbox definition: the root image and resources every instance boots with.

    ``image`` is a built-in image: ``"agent"`` (Debian with python3, pip, node, npm, gh, git
    and curl) or ``"busybox"``, or a :class:`Rootfs` (an image file, a writable root).
    ``mounts`` maps guest paths to filesystems (:class:`MemoryFs`, :class:`HostDir`, a
    :class:`VirtualFs` of yours). ``network`` gives it a :class:`Network` (without one it has
    no network device). Booting is cheap; boot one instance per task. ``snapshots=True``
    makes its instances snapshottable (:meth:`Instance.snapshot`, :meth:`Instance.fork`);
    ``snapshot_key_dir`` is where the key authenticating its snapshots lives (default: the
    cache directory).

    >>> sandbox = Sandbox("busybox", cpus=1, memory_mib=256)  # doctest: +SKIP
    """


    def boot(
        self,
        *,
        mounts: Optional[Mounts] = None,
        hostname: Optional[str] = None,
        cwd: Optional[str] = None,
    ) -> "_Booting":
        """Boots an instance: ``vm = await sandbox.boot()``, or ``async with sandbox.boot() as
        vm:`` to shut it down at the block's end. ``mounts``, ``hostname`` and ``cwd`` (where
        commands start) are this boot's own, besides the definition's."""
        return _Booting(self._native.boot(mounts=_mounts(mounts), hostname=hostname, cwd=cwd))

    def restore(self, snapshot: "Snapshot") -> "_Booting":
        """Restores ``snapshot`` as a new running instance (``await``, or ``async with``):
        its processes (:meth:`Instance.attach`), files and memory as they were. Each part is
        checked as it is copied into the new VM; a changed one raises
        :class:`SnapshotTampered` before the VM runs."""
        return _Booting(self._native.restore(snapshot._native))

    def pool(self, size: int) -> "Pool":
        """A warm pool keeping ``size`` instances of this definition booted ahead of need::

            async with sandbox.pool(2) as pool:
                vm = await pool.take()  # running, and never ran anything

        The pool boots in the background, one instance at a time; ``take`` boots one itself
        when none is ready. Pooled instances have no per-boot ``mounts``, ``hostname`` or
        ``cwd``. Raises :class:`InvalidConfig` for a size outside 1..64 or a persistent or
        copy-on-write root (one VM at a time may use it)."""
        return Pool(self._native.pool(size))


class _Booting:
    """A boot under way: awaitable (the instance) and an async context manager (the instance,
    shut down at the block's end)."""

    def __init__(self, booting: Awaitable[_krunbox.Instance]) -> None:
        self._booting = booting
        self._instance: Optional[Instance] = None

    async def _boot(self) -> "Instance":
        return Instance(await self._booting)

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
        input: Optional[Union[bytes, str]] = None,
        on_stdout: Optional[OnOutput] = None,
        on_stderr: Optional[OnOutput] = None,
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

        ``input`` is written to its stdin (then closed). ``on_stdout`` and ``on_stderr`` get
        each chunk of output as it comes (and the :class:`Completed` still has all of it)::

            await vm.run("pip install rich", on_stdout=lambda b: print(b.decode(), end=""))

        An exception in a callback kills the command and is raised here.
        """
        if input is None and on_stdout is None and on_stderr is None:
            return await self._native.run(
                cmd, timeout=timeout, cwd=cwd, env=_env_pairs(env), check=check
            )
        proc = await self.spawn(cmd, stdin=input is not None, timeout=timeout, cwd=cwd, env=env)
        try:
            stdout, stderr, _ = await asyncio.gather(
                _collect(proc.stdout, on_stdout, "stdout"),
                _collect(proc.stderr, on_stderr, "stderr"),
                _feed(proc.stdin, None if input is None else _data(input)),
            )
            returncode = await proc.wait()
        except BaseException:
            proc.kill()
            raise
        return _completed(cmd, returncode, stdout, stderr, proc.timed_out, check)

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

    async def list_dir(self, path: str) -> List[DirEntry]:
        """The entries of the guest directory ``path`` (name and type), sorted by name."""
        return await self._native.list_dir(path)

    async def stat(self, path: str, *, follow_symlinks: bool = True) -> FileInfo:
        """What ``stat`` says about ``path``: type, size, mode, owner, mtime."""
        return await self._native.stat(path, follow_symlinks)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Removes a file, a symlink or an empty directory; ``recursive=True`` a whole tree
        (never ``/`` or a tree holding a mount of the sandbox's)."""
        await self._native.remove(path, recursive)

    async def rename(self, source: str, destination: str) -> None:
        """Renames ``source`` to ``destination``, replacing a file there atomically."""
        await self._native.rename(source, destination)

    async def make_dir(self, path: str, *, mode: int = 0o755, parents: bool = False) -> None:
        """Makes the directory ``path``; ``parents=True`` also those above it, and an existing
        directory is then no error."""
        await self._native.make_dir(path, mode, parents)

    def open_reader(self, path: str) -> "_Opening[FileReader]":
        """Reads the guest file ``path`` in chunks, for files too large to hold::

            async with vm.open_reader("/tmp/big.tar") as reader:
                async for chunk in reader:
                    out.write(chunk)
        """
        async def opened() -> FileReader:
            return FileReader(await self._native.open_reader(path))

        return _Opening(opened())

    def open_writer(self, path: str, *, mode: int = 0o644) -> "_Opening[FileWriter]":
        """Creates (or truncates) the guest file ``path`` and writes it in chunks; the block's
        end (or ``await writer.close()``) waits until the guest has it all on disk::

            async with vm.open_writer("/tmp/big.bin") as writer:
                for chunk in chunks:
                    await writer.write(chunk)
        """
        async def opened() -> FileWriter:
            return FileWriter(await self._native.open_writer(path, mode))

        return _Opening(opened())

    def isolation(self) -> Dict[str, Any]:
        """The VMM helper's confinement: each isolation layer (``layer``, ``enforced``,
        ``detail``) and each canary it tried (``canary``, ``blocked``, ``detail``). A running
        instance's canaries were all blocked: a boot where one got through fails."""
        result: Dict[str, Any] = self._native.isolation()
        return result

    def metrics(self) -> Dict[str, Any]:
        """What the instance uses now: ``cpu_time`` (seconds), ``memory_bytes``,
        ``memory_peak_bytes``, ``disk_read_bytes``, ``disk_written_bytes``, ``network``
        (bytes each way, flows granted and denied, requests), host descriptors, ``root``
        (a writable root's held bytes), ``source``, and ``host_boot_work`` (seconds of the
        host's own work in the boot before the VM started)."""
        result: Dict[str, Any] = self._native.metrics()
        return result

    def published_address(self, guest_port: int) -> Optional[Tuple[str, int]]:
        """Where on the host (``("127.0.0.1", port)``) the guest's TCP ``guest_port`` is
        published (:class:`Network` ``publish=``); ``None`` if it is not."""
        return self._native.published_address(guest_port)

    def network_events(self) -> "NetworkEvents":
        """The network's audit events from now on, as an async iterator of dicts (``"type"``:
        ``"decided"``, ``"unreachable"``, ``"published"``, ``"request"``, or ``"missed"`` with
        the ``count`` a slow reader missed)::

            async for event in vm.network_events():
                if event["type"] == "request":
                    print(event["method"], event["hostname"], event["path"], event["status"])

        Raises :class:`InvalidConfig` for a sandbox without a network."""
        events = self._native.network_events()
        if events is None:
            raise InvalidConfig("this sandbox has no network: give it a krunbox.Network")
        return NetworkEvents(events)

    async def shutdown(self) -> None:
        """Stops the VM; later calls fail with :class:`InstanceGone`."""
        await self._native.shutdown()

    async def pause(self) -> None:
        """Stops the VM's vCPUs and devices: it uses no CPU until :meth:`resume`. Processes
        already running go on after the resume; new commands and file operations raise
        :class:`Paused` meanwhile. Pausing a paused instance does nothing."""
        await self._native.pause()

    async def resume(self) -> None:
        """Resumes a paused VM where it stopped."""
        await self._native.resume()

    @property
    def paused(self) -> bool:
        """Whether the VM is paused."""
        return self._native.is_paused()

    async def snapshot(self, dir: str) -> "Snapshot":
        """Writes a snapshot of this running instance into the new directory ``dir`` (its
        sandbox needs ``snapshots=True``); the instance goes on afterwards::

            snap = await vm.snapshot("/var/tmp/ready")
            twin = await sandbox.restore(snap)
        """
        return Snapshot(await self._native.snapshot(dir))

    async def fork(self, n: int) -> List["Instance"]:
        """Forks this instance into ``n`` new ones, each starting where this one is now and
        going its own way from there (its processes taken over with :meth:`attach`)."""
        return [Instance(native) for native in await self._native.fork(n)]

    def processes(self) -> List[int]:
        """The guest pids of a restored instance's processes not attached yet."""
        return self._native.processes()

    def attach(self, pid: int) -> "Process":
        """Takes over process ``pid`` (its :attr:`Process.pid` before the snapshot) of a
        restored instance: its stdin, its output from the snapshot on, its end."""
        return Process(self._native.attach(pid), has_stdin=True)

    @property
    def host_boot_work(self) -> float:
        """Seconds of the host's own work in this boot before the VM started (image check,
        layer, directory, jail): small and independent of the image's size once the image
        is sealed after its first check."""
        return self._native.host_boot_work()

    async def __aenter__(self) -> "Instance":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()


class _PoolState:
    """What the asyncio and the sync ``Pool`` share: what the pool says of itself."""

    def __init__(self, native: _krunbox.Pool) -> None:
        self._native = native

    @property
    def ready(self) -> int:
        """How many instances are ready now."""
        return self._native.ready()

    @property
    def last_failure(self) -> Optional[str]:
        """Why the last boot in the background failed, if the last one did."""
        return self._native.last_failure()


class Pool(_PoolState):
    """Instances of one :class:`Sandbox` booted ahead of need (see :meth:`Sandbox.pool`).
    ``async with`` shuts the pool and the instances still in it down at the block's end."""

    async def take(self) -> Instance:
        """A running instance that never ran anything: one from the pool (its replacement
        boots in the background), or one booted now if none is ready."""
        return Instance(await self._native.take())

    async def shutdown(self) -> None:
        """Stops the pool and shuts down the instances still in it."""
        await self._native.shutdown()

    async def __aenter__(self) -> "Pool":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()


_T = TypeVar("_T")


class _Opening(Generic[_T]):
    """A file being opened: awaitable, or an ``async with`` that closes it (a writer only
    when the block ends without an exception: a file half written is not made whole)."""

    def __init__(self, opening: Awaitable[_T]) -> None:
        self._opening: Awaitable[_T] = opening
        self._file: Optional[_T] = None

    def __await__(self) -> Generator[Any, None, _T]:
        return self._opening.__await__()

    async def __aenter__(self) -> _T:
        self._file = await self._opening
        return self._file

    async def __aexit__(self, kind: Optional[type], *exc: object) -> None:
        if isinstance(self._file, FileWriter) and kind is None:
            await self._file.close()


class NetworkEvents:
    """A sandbox network's audit events, from when it was asked for (an async iterator of
    dicts; it ends when the network stops)."""

    def __init__(self, native: _krunbox.NetworkEvents) -> None:
        self._native = native

    def __aiter__(self) -> AsyncIterator[Dict[str, Any]]:
        return self

    async def __anext__(self) -> Dict[str, Any]:
        event: Optional[Dict[str, Any]] = await self._native.next()
        if event is None:
            raise StopAsyncIteration
        return event


class FileReader:
    """A guest file read in chunks: ``async for chunk in reader``, or ``await reader.read()``."""

    def __init__(self, native: _krunbox.FileReader) -> None:
        self._native = native

    async def read(self, max: int = 1 << 20) -> bytes:
        """Up to ``max`` bytes (at most 1 MiB); ``b""`` at the end of the file."""
        return await self._native.read(max)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._native.read(1 << 20)
        if not chunk:
            raise StopAsyncIteration
        return chunk


class FileWriter:
    """A guest file written in chunks; :meth:`close` makes it whole."""

    def __init__(self, native: _krunbox.FileWriter) -> None:
        self._native = native

    async def write(self, data: Union[bytes, str]) -> None:
        """Writes ``data`` (a ``str`` as UTF-8), whole."""
        await self._native.write(_data(data))

    async def close(self) -> None:
        """Waits until the guest has written everything and ``fsync``ed the file; raises what
        went wrong on the way."""
        await self._native.finish()


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


class Snapshot:
    """A snapshot on disk (:meth:`Instance.snapshot`), its manifest checked.

    ``Snapshot.open(dir, key_dir)`` opens one another process wrote with the same key.
    """

    def __init__(self, native: _krunbox.Snapshot) -> None:
        self._native = native

    @classmethod
    def open(cls, dir: str, key_dir: str) -> "Snapshot":
        """Opens the snapshot in ``dir``, checking its manifest with the key in ``key_dir``
        (:class:`SnapshotTampered` if it changed)."""
        return cls(_krunbox.Snapshot.open(dir, key_dir))

    @property
    def dir(self) -> str:
        """Its directory."""
        return self._native.dir

    @property
    def digest(self) -> str:
        """SHA-256 of its manifest (hex)."""
        return self._native.digest

    def verify(self) -> None:
        """Hashes every part: :class:`SnapshotTampered` names one that changed."""
        self._native.verify()

    def __repr__(self) -> str:
        return repr(self._native)


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

    @property
    def timed_out(self) -> bool:
        """Whether its ``timeout`` ended it (known once :meth:`wait` has returned)."""
        return self._native.timed_out

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
