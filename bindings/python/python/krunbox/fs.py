"""Filesystems the guest mounts: :class:`MemoryFs`, :class:`HostDir`, and your own, written in
Python as a :class:`VirtualFs`.

Mounts are given to a sandbox (every instance gets them) or to one boot::

    workspace = krunbox.MemoryFs()
    workspace.write_file("/task.txt", b"summarize this\\n")
    sandbox = krunbox.Sandbox("agent", mounts={"/workspace": workspace})
    async with sandbox.boot(mounts={"/src": krunbox.HostDir("./src", hide=[".env"])}) as vm:
        ...
"""

from __future__ import annotations

import errno
from typing import Awaitable, Iterable, Optional, TypeVar, Union

from ._krunbox import HostDir, MemoryFs, Stat

__all__ = ["VirtualFs", "Stat", "MemoryFs", "HostDir"]


_T = TypeVar("_T")
_Maybe = Union[_T, Awaitable[_T]]
"""A method's result, or an awaitable of it (an ``async`` method)."""


def _error(code: int, path: str) -> OSError:
    return OSError(code, errno.errorcode.get(code, "error"), path)


class VirtualFs:
    """A filesystem written in Python: subclass it and override what yours does. Paths are
    absolute within it (``"/"``, ``"/notes/a.txt"``). Each method may be plain or ``async``
    (awaited on the event loop that booted the instance) and never blocks the sandbox's own
    threads. Raise ``OSError`` (``FileNotFoundError``, ``PermissionError``, or
    ``OSError(errno.X, ...)``) for the guest's call to fail with that errno; any other
    exception fails it with ``EIO`` and is logged on the ``krunbox`` logger.

    What is not overridden fails: reads with ``ENOSYS``, changes with ``EROFS``. A minimal
    read-only filesystem of one file::

        class Hello(krunbox.VirtualFs):
            TEXT = b"hello from Python\\n"

            def stat(self, path):
                if path == "/":
                    return krunbox.Stat("dir")
                if path == "/hello.txt":
                    return krunbox.Stat("file", size=len(self.TEXT))
                raise FileNotFoundError(path)

            def list_dir(self, path):
                return ["hello.txt"]

            def read(self, path, offset, size):
                return self.TEXT[offset : offset + size]

    ``read_only = True`` mounts it read-only (the guest's kernel refuses every change).
    """

    read_only: bool = False

    def stat(self, path: str) -> _Maybe[Stat]:
        """What ``path`` is (:class:`Stat`); raise ``FileNotFoundError`` when nothing is."""
        raise _error(errno.ENOENT, path)

    def list_dir(self, path: str) -> _Maybe[Iterable[str]]:
        """The names in the directory ``path``."""
        raise _error(errno.ENOTDIR, path)

    def read(self, path: str, offset: int, size: int) -> _Maybe[bytes]:
        """Up to ``size`` bytes of the file ``path`` from ``offset`` (fewer at its end)."""
        raise _error(errno.ENOSYS, path)

    def read_link(self, path: str) -> _Maybe[str]:
        """The target of the symlink ``path``."""
        raise _error(errno.EINVAL, path)

    def write(self, path: str, offset: int, data: bytes) -> _Maybe[Optional[int]]:
        """Writes ``data`` to the file ``path`` at ``offset``; returns how much (``None``: all)."""
        raise _error(errno.EROFS, path)

    def create(self, path: str, mode: int) -> _Maybe[None]:
        """Makes the empty file ``path`` (``mode``: its permission bits)."""
        raise _error(errno.EROFS, path)

    def make_dir(self, path: str, mode: int) -> _Maybe[None]:
        """Makes the directory ``path``."""
        raise _error(errno.EROFS, path)

    def truncate(self, path: str, size: int) -> _Maybe[None]:
        """Cuts (or zero-extends) the file ``path`` to ``size`` bytes."""
        raise _error(errno.EROFS, path)

    def remove(self, path: str) -> _Maybe[None]:
        """Removes the file or symlink ``path``."""
        raise _error(errno.EROFS, path)

    def remove_dir(self, path: str) -> _Maybe[None]:
        """Removes the empty directory ``path``."""
        raise _error(errno.EROFS, path)

    def rename(self, source: str, destination: str) -> _Maybe[None]:
        """Renames ``source`` to ``destination``, replacing what is there."""
        raise _error(errno.EROFS, source)
