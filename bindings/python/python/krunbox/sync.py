"""The synchronous API: :mod:`krunbox`'s, each call waiting where it is made (the GIL released
while the VM works, so other threads go on)::

    from krunbox.sync import Sandbox

    with Sandbox("agent").boot() as vm:
        print(vm.run(["uname", "-r"]).stdout_text)
"""

from __future__ import annotations

from typing import Mapping, Optional, Union

from . import Command, Completed, _data, _env_pairs, _krunbox

__all__ = ["Sandbox", "Instance"]


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
            image, cpus=cpus, memory_mib=memory_mib, hostname=hostname
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
