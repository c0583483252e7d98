"""Agent tools over an instance: what a model calls, ready-made (the crate's ``krunbox::tools``).

A :class:`Toolbox` offers ``bash`` (foreground with a timeout, or background), ``process``
(poll, feed, kill background processes), ``read``, ``write``, ``edit``, ``ls``, ``glob`` and
``grep``. :meth:`Toolbox.definitions` gives their JSON Schemas in the shape your model API
takes; :meth:`Toolbox.call` runs a call by name with its arguments and returns a
:class:`ToolResult` (bounded text, ``is_error`` when the model should change course). Every call
passes the permissions first: rules ``allow`` / ``ask`` / ``deny`` (first match wins), then a
mode; ``ask`` calls your approver::

    import krunbox
    from krunbox.tools import Toolbox

    async def approve(request: dict) -> bool | str:
        return request["arguments"]["command"].startswith("curl https://pypi.org")

    async with krunbox.Sandbox("agent").boot() as vm:
        tools = Toolbox(vm, workspace="/tmp", approver=approve, permissions={
            "mode": "workspace-write",
            "rules": [{"deny": "bash(git push:*)"}, {"ask": "bash(curl:*)"}],
        })
        schemas = tools.definitions("anthropic")      # for the model's `tools`
        result = await tools.call("grep", {"pattern": "TODO", "glob": "*.py"})
        block = result.to_anthropic("toolu_01")        # for the model's next turn

The approver gets ``{"tool", "arguments", "rule"}`` and returns ``True`` (run it), ``False`` or a
reason (a string: refused, and the model reads why), or a coroutine of one. One that raises
refuses (logged on the ``krunbox`` logger), and so does one that takes more than 5 minutes.
Coroutine approvers run on the event loop that made the toolbox (under :mod:`krunbox.sync`, by
``asyncio.run``).
:class:`krunbox.sync.Toolbox` is the same without ``await``. docs/tools.md has every tool.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Mapping, Optional, Union

from . import _krunbox
from ._krunbox import ToolResult

__all__ = ["Toolbox", "ToolResult", "AuditEvents", "Approver", "definitions"]

Approver = Callable[[Dict[str, Any]], Union[bool, str, Awaitable[Union[bool, str]]]]
"""Answers ``ask`` rules: gets ``{"tool", "arguments", "rule"}``, returns ``True`` to run the
call, ``False`` or a reason to refuse it (or a coroutine of either)."""


def _native_toolbox(
    instance: Any,
    workspace: str,
    permissions: Optional[Mapping[str, Any]],
    approver: Optional[Approver],
    output_cap: Optional[int],
    blocking: bool = False,
) -> _krunbox.Toolbox:
    return _krunbox.Toolbox(
        instance._native,
        workspace=workspace,
        permissions=None if permissions is None else json.dumps(permissions),
        approver=approver,
        output_cap=output_cap,
        blocking=blocking,
    )


def definitions(format: str = "mcp") -> List[Dict[str, Any]]:
    """Every tool's definition in ``format`` ("mcp", "openai" or "anthropic"), no instance
    needed (what a toolbox without a bare ``deny`` rule offers)."""
    result: List[Dict[str, Any]] = json.loads(_krunbox.tool_definitions(format))
    return result


class AuditEvents:
    """A toolbox's permission decisions from when they were asked for (an async iterator of
    dicts: ``tool``, ``subject``, ``decision``, ``by``, ``reason``, ``at``)."""

    def __init__(self, native: _krunbox.AuditEvents) -> None:
        self._native = native

    def __aiter__(self) -> AsyncIterator[Dict[str, Any]]:
        return self

    async def __anext__(self) -> Dict[str, Any]:
        event: Optional[Dict[str, Any]] = await self._native.next()
        if event is None:
            raise StopAsyncIteration
        return event


class Toolbox:
    """The tools over one instance (of :mod:`krunbox`), with their permissions.

    ``workspace`` is where relative paths start, ``bash`` runs, and ``workspace-write`` lets
    ``write`` and ``edit`` change files. ``permissions`` is ``{"mode": "read-only" |
    "workspace-write" | "full-access", "rules": [{"allow" | "ask" | "deny": PATTERN}, ...]}``.
    ``output_cap`` bounds each result's text (30,000 bytes by default).
    """

    def __init__(
        self,
        instance: Any,
        *,
        workspace: str = "/",
        permissions: Optional[Mapping[str, Any]] = None,
        approver: Optional[Approver] = None,
        output_cap: Optional[int] = None,
    ) -> None:
        self._native = _native_toolbox(instance, workspace, permissions, approver, output_cap)

    def definitions(self, format: str = "mcp") -> List[Dict[str, Any]]:
        """The tools' definitions in ``format``: "mcp", "openai" or "anthropic"."""
        result: List[Dict[str, Any]] = self._native.definitions(format)
        return result

    async def call(self, name: str, arguments: Optional[Mapping[str, Any]] = None) -> ToolResult:
        """Runs a model's call. Never raises for what the model sent: bad arguments, refused
        permissions and failed commands are results with ``is_error``."""
        return await self._native.call(name, json.dumps(arguments or {}))

    def audit_events(self) -> AuditEvents:
        """Every permission decision from now on."""
        return AuditEvents(self._native.audit_events())
