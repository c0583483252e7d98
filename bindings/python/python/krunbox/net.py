"""A sandbox's network: denied unless granted, by declarative rules or by a policy of yours.

Rules are dicts (or their JSON), the Rust crate's ``Rules`` format::

    network = krunbox.Network(rules=[
        {"action": "allow", "domain": "pypi.org", "ports": "443"},
        {"action": "allow", "domain": "*.pythonhosted.org", "ports": "443"},
    ])

A policy is a callable (plain or ``async``) that gets each new :class:`Flow` (a DNS query, a
TCP connection, a UDP flow) and returns a :class:`Verdict` (or ``True`` / ``False``). It runs
on the host: credentials stay there. :meth:`Verdict.intercept` sends a connection's HTTP(S)
requests through middleware, callables that get each :class:`Request` and may change its
headers or answer it themselves (an :class:`Answer`)::

    async def add_token(request: krunbox.Request) -> None:
        request.set_header("authorization", f"Bearer {await tokens.get()}")

    def policy(flow: krunbox.Flow) -> krunbox.Verdict:
        if flow.protocol == "dns":
            return krunbox.Verdict.accept()          # the host's resolver answers
        if flow.hostname == "api.example.com":
            return krunbox.Verdict.intercept([add_token])
        return krunbox.Verdict.deny()

    sandbox = krunbox.Sandbox("agent", network=krunbox.Network(policy=policy))

A policy or middleware that raises costs only its own flow (denied) or request (answered
500); what it raised is logged on the ``krunbox`` logger. The instance and the interpreter
go on. Coroutines run on the event loop that booted the sandbox last (under :mod:`krunbox.sync`,
by ``asyncio.run``), where your objects live: keep that loop running while the instance
lives, and boot one sandbox from one loop. Plain callables run on a worker thread, never
blocking the loop. At most 64 calls into one policy (with its middleware) run at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence, Tuple, Union

from . import _krunbox
from ._krunbox import Answer, Flow, Request, Verdict

__all__ = ["Network", "Secret", "Verdict", "Flow", "Request", "Answer", "Policy"]

Policy = Callable[[Flow], Union[Verdict, bool, Awaitable[Union[Verdict, bool]]]]
"""What decides each flow: a callable (plain or ``async``) of a :class:`Flow`."""


@dataclass(frozen=True)
class Secret:
    """A credential the guest never holds: commands see a placeholder in ``env_var``, which
    the host swaps for ``value`` in requests to ``hosts`` (exact names, or ``*.example.com``)
    over verified TLS only. ``in_query`` and ``in_body`` swap it there too.

    >>> Secret("API_KEY", "sk-real", hosts=["api.example.com"])  # doctest: +ELLIPSIS
    Secret(env_var='API_KEY', ...)
    """

    env_var: str
    value: str = field(repr=False)
    hosts: Sequence[str] = ()
    in_query: bool = False
    in_body: bool = False


Rules = Union[str, Mapping[str, Any], Sequence[Mapping[str, Any]]]
"""Rules as JSON text, as ``{"rules": [...]}``, or as the list of rule dicts."""


class Network:
    """A sandbox's network. Without ``rules`` or ``policy`` every flow is denied.

    ``rules``: declarative rules (a list of dicts, ``{"rules": [...]}``, or its JSON).
    ``policy``: a callable deciding each flow (not both). ``secrets``: :class:`Secret` s.
    ``publish``: guest port to host port (0: any free one) on the host's 127.0.0.1.
    ``upstream_ca``: PEM certificates that intercepted HTTPS upstreams are verified against,
    instead of the host's trust store.
    """

    def __init__(
        self,
        *,
        rules: Optional[Rules] = None,
        policy: Optional[Policy] = None,
        secrets: Sequence[Secret] = (),
        publish: Union[Mapping[int, int], Sequence[Tuple[int, int]]] = (),
        upstream_ca: Optional[Union[bytes, str]] = None,
    ) -> None:
        if rules is not None and not isinstance(rules, str):
            rules = json.dumps(rules if isinstance(rules, Mapping) else {"rules": list(rules)})
        ports = list(publish.items()) if isinstance(publish, Mapping) else list(publish)
        ca = upstream_ca.encode() if isinstance(upstream_ca, str) else upstream_ca
        self._native = _krunbox.Network(
            rules=rules,
            policy=policy,
            secrets=[(s.env_var, s.value, list(s.hosts), s.in_query, s.in_body) for s in secrets],
            publish=[(int(g), int(h)) for g, h in ports],
            upstream_ca=ca,
        )
