"""The network from Python, in a real microVM: a policy written in Python grants one domain,
async middleware adds a credential that an HTTPS origin on loopback receives (the guest never
holds it), and callbacks that raise cost only their own flow or request.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

import pytest

import krunbox


def _get_when_up(url: str) -> bytes:
    """``url``'s body, once its server answers (at most a minute)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body: bytes = response.read()
                return body
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


async def test_a_python_policy_and_async_middleware_hold_the_credential_on_the_host(
    origin: Tuple[int, bytes, List[Optional[str]]], caplog: pytest.LogCaptureFixture
) -> None:
    port, ca_pem, seen = origin
    token = "tok-" + secrets.token_hex(8)
    test_loop = asyncio.get_running_loop()
    middleware_loops: List[asyncio.AbstractEventLoop] = []

    async def add_token(request: krunbox.Request) -> Optional[krunbox.Answer]:
        middleware_loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0.01)  # as a token service would
        if request.path == "/raise":
            raise RuntimeError("middleware bug")
        if request.path == "/refuse":
            return krunbox.Answer(403, "not this path\n")
        if request.path != "/with-secret":
            request.set_header("authorization", f"Bearer {token}")
        return None

    def policy(flow: krunbox.Flow) -> krunbox.Verdict:
        if flow.protocol == "dns":
            if flow.hostname == "boom.test":
                raise RuntimeError("policy bug")
            if flow.hostname in ("api.test", "other.test"):
                return krunbox.Verdict.resolve(["127.0.0.1"])
            return krunbox.Verdict.deny()
        if flow.protocol == "tcp" and flow.hostname == "api.test":
            return krunbox.Verdict.intercept([add_token])
        return krunbox.Verdict.deny()

    secret = krunbox.Secret("API_KEY", "real-" + secrets.token_hex(8), hosts=["api.test"])
    network = krunbox.Network(
        policy=policy, upstream_ca=ca_pem, publish={8000: 0}, secrets=[secret]
    )
    sandbox = krunbox.Sandbox("agent", memory_mib=512, network=network)
    curl = "curl -sS -m 20 -o /dev/null -w '%{http_code}' "
    caplog.set_level(logging.ERROR, logger="krunbox")
    async with sandbox.boot() as vm:
        events = vm.network_events()
        got = await vm.run(f"curl -fsS -m 20 https://api.test:{port}/hello", timeout=60)
        assert (got.returncode, got.stdout, got.stderr) == (0, b"hello from the origin\n", b"")
        assert seen == [f"Bearer {token}"]
        assert middleware_loops and all(loop is test_loop for loop in middleware_loops)

        # The policy raising on one name denies that query alone; a name it denies is
        # refused; middleware raising answers its request 500, an Answer its own status.
        boom = await vm.run(f"curl -sS -m 20 https://boom.test:{port}/", timeout=60)
        assert boom.returncode != 0 and b"resolve" in boom.stderr.lower(), boom
        other = await vm.run(f"curl -sS -m 20 https://other.test:{port}/", timeout=60)
        assert other.returncode != 0, other
        codes = await vm.run(
            f"{curl} https://api.test:{port}/raise; echo; {curl} https://api.test:{port}/refuse",
            timeout=60,
        )
        assert codes.stdout_text.split() == ["500", "403"], codes
        assert len(seen) == 1  # neither went upstream

        again = await vm.run(f"curl -fsS -m 20 https://api.test:{port}/again", timeout=60)
        assert again.stdout == b"hello from the origin\n", again
        assert seen == [f"Bearer {token}"] * 2
        # A secret: the guest's variable holds a placeholder, the origin gets the value.
        held = await vm.run(
            f"curl -fsS -m 20 -H \"authorization: Bearer $API_KEY\" "
            f"https://api.test:{port}/with-secret; echo $API_KEY",
            timeout=60,
        )
        placeholder = held.stdout_text.splitlines()[-1]
        assert placeholder and placeholder != secret.value, held
        assert seen[-1] == f"Bearer {secret.value}"
        env = await vm.run("env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'")
        assert token not in env.stdout_text and secret.value not in env.stdout_text

        # The audit: the request the middleware changed, the flow the policy denied.
        seen_events: List[Dict[str, Any]] = []

        async def read_until_with_secret() -> None:
            async for event in events:
                seen_events.append(event)
                if event["type"] == "request" and event["path"] == "/with-secret":
                    return

        await asyncio.wait_for(read_until_with_secret(), timeout=60)
        requests = [(e["path"], e["status"]) for e in seen_events if e["type"] == "request"]
        assert requests == [
            ("/hello", 200),
            ("/raise", 500),
            ("/refuse", 403),
            ("/again", 200),
            ("/with-secret", 200),
        ]
        assert seen_events[-1]["secrets_swapped"] == ["API_KEY"], seen_events[-1]
        denied = [
            e["flow"].hostname
            for e in seen_events
            if e["type"] == "decided" and e["outcome"] == "deny"
        ]
        assert "other.test" in denied and "boom.test" in denied, denied

        # A published port: the guest's server, reached from the host's loopback.
        page = secrets.token_hex(8).encode()
        await vm.run("mkdir -p /tmp/www", check=True)
        await vm.write_file("/tmp/www/page.txt", page)
        server = await vm.spawn("cd /tmp/www && exec python3 -m http.server 8000")
        host, port = vm.published_address(8000) or ("", 0)
        assert host == "127.0.0.1" and port > 0
        assert await asyncio.to_thread(_get_when_up, f"http://{host}:{port}/page.txt") == page
        server.kill()

    raised = [r.getMessage() for r in caplog.records if r.name == "krunbox"]
    assert any("network policy" in m and "policy bug" in m for m in raised), raised
    assert any("middleware" in m and "middleware bug" in m for m in raised), raised


async def test_a_dns_query_accepted_as_it_is_is_answered_by_the_host_resolver() -> None:
    """``Verdict.accept()`` on a query: the host's resolver answers it (``localhost`` is in the
    host's hosts file, so no traffic leaves); an ungranted name is refused."""

    def policy(flow: krunbox.Flow) -> krunbox.Verdict:
        if flow.protocol == "dns" and flow.hostname == "localhost":
            return krunbox.Verdict.accept()
        return krunbox.Verdict.deny()

    sandbox = krunbox.Sandbox("busybox", memory_mib=256, network=krunbox.Network(policy=policy))
    async with sandbox.boot() as vm:
        asked = await vm.run(["nslookup", "localhost"], timeout=30)
        assert asked.returncode == 0, asked.stdout_text + asked.stderr_text
        assert re.search(rb"Name:\s+localhost\s+Address:?\s+\d+\.\d+\.\d+\.\d+", asked.stdout)
        refused = await vm.run(["nslookup", "elsewhere.test"], timeout=30)
        assert refused.returncode != 0
