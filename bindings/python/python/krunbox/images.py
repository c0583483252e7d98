"""OCI images: imported from an archive or pulled from a registry into a local store, booted
as a :class:`~krunbox.Rootfs`::

    images = krunbox.Images()
    image = await images.pull("py", "docker.io/library/python:3.12-slim")
    sandbox = krunbox.Sandbox(krunbox.Rootfs.ephemeral(image.rootfs))
    async with sandbox.boot(cwd=image.config["working_dir"] or "/") as vm:
        await vm.run(["python3", "--version"])
"""

from __future__ import annotations

import os
from typing import List, Optional, Union

from . import _krunbox
from ._krunbox import Image

__all__ = ["Images", "Image"]

PathLike = Union[str, "os.PathLike[str]"]


class _Store:
    """What the asyncio and the sync ``Images`` share: the store and its synchronous calls."""

    def __init__(self, path: Optional[PathLike] = None) -> None:
        self._native = _krunbox.Images(None if path is None else os.fspath(path))

    def get(self, name: str) -> Optional[Image]:
        """The image stored as ``name``, if there is one."""
        return self._native.get(name)

    def names(self) -> List[str]:
        """The names of the stored images."""
        return self._native.names()

    def remove(self, name: str) -> bool:
        """Removes the image stored as ``name``; whether there was one."""
        return self._native.remove(name)


class Images(_Store):
    """A local store of OCI images by name (``path``: where; default the user's)."""

    async def import_archive(self, name: str, archive: PathLike) -> Image:
        """Imports ``archive`` (``docker save``'s tar, or an OCI image layout as a tar) as
        ``name``: its layers flattened into an image, every digest checked."""
        return await self._native.import_archive(name, os.fspath(archive))

    async def pull(
        self,
        name: str,
        reference: str,
        *,
        username: Optional[str] = None,
        password: Optional[str] = None,
        plain_http: bool = False,
        ca_pem: Optional[bytes] = None,
    ) -> Image:
        """Pulls ``reference`` (``registry/repository:tag`` or ``...@sha256:...``) as ``name``,
        over HTTPS (``plain_http=True`` for a registry on loopback), as ``username`` with
        ``password`` if given, trusting ``ca_pem`` beside the host's roots."""
        return await self._native.pull(
            name,
            reference,
            username=username,
            password=password,
            plain_http=plain_http,
            ca_pem=ca_pem,
        )
