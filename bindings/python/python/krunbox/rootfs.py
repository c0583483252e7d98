"""Root filesystems: a built-in image, an image file, and writable roots over one.

``Sandbox`` takes a built-in image's name (``"agent"``, ``"busybox"``) or a :class:`Rootfs`::

    Rootfs.builtin("agent")                          # read-only
    Rootfs.ephemeral(Rootfs.builtin("agent"))        # writable, changes gone with the VM
    Rootfs.persistent(Rootfs.builtin("agent"), "lane.qcow2")   # changes kept in a file
    Rootfs.cow(Rootfs.builtin("agent"), store)       # changes kept in a block store

A block store keeps a copy-on-write root's changes as numbered blocks: the library's
:class:`DirectoryStore` (files in a directory, served without passing through Python) or
:class:`MemoryStore`, or any object of yours with :class:`BlockStore`'s methods, plain or
``async`` (a database, an object store)::

    class DictStore:
        block_size = 4096

        def __init__(self):
            self.blocks = {}

        def written_blocks(self):
            return list(self.blocks)

        def read_blocks(self, first, count):
            zero = bytes(self.block_size)
            return b"".join(self.blocks.get(first + i, zero) for i in range(count))

        def write_blocks(self, first, data):
            for i in range(len(data) // self.block_size):
                self.blocks[first + i] = data[i * self.block_size : (i + 1) * self.block_size]

        def flush(self):
            pass

What a store's method raises fails that I/O (``EIO`` in the guest) and is logged; the
instance's ``shutdown`` then raises :class:`StoreError`. A store serves one instance at a
time: every sandbox given the same ``Rootfs.cow(...)`` shares its guard (a second boot while
one runs fails with :class:`StoreError`); across separate ``Rootfs.cow`` calls over one
store object, that is the store's to enforce (its ``attach``).
"""

from __future__ import annotations

from typing import Any, Awaitable, Iterable, Protocol, Union

from ._krunbox import DirectoryStore, MemoryStore, Rootfs

__all__ = ["Rootfs", "BlockStore", "DirectoryStore", "MemoryStore"]


class BlockStore(Protocol):
    """What a block store written in Python has. ``attach(base_sha256, disk_bytes)`` and
    ``detach()`` are optional: called when a boot starts and ends using it (refuse a base
    the store was not made for by raising)."""

    block_size: int
    """Bytes per block: a power of two from 4096 to 1 MiB, the same for the store's life."""

    def written_blocks(self) -> Union[Iterable[int], Awaitable[Iterable[int]]]:
        """The index of every block written so far."""

    def read_blocks(self, first: int, count: int) -> Union[bytes, Awaitable[bytes]]:
        """``count`` blocks from index ``first`` on, exactly ``count * block_size`` bytes
        (zeros for blocks never written)."""

    def write_blocks(self, first: int, data: bytes) -> Any:
        """Stores ``data`` (whole blocks) from index ``first`` on; durable after ``flush``."""

    def flush(self) -> Any:
        """Makes every write that returned durable (the guest's ``fsync`` waits for it)."""
