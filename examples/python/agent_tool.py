"""An agent tool: run model-written Python in a microVM that can reach one API, with a token
the guest never holds.

An agent framework registers ``run_python`` as a tool; the model writes code, the tool runs it
in a fresh sandbox and returns what it printed. The sandbox's network answers DNS for the API's
host only and sends its HTTPS requests through middleware that adds the token on the host:
the code (and anything it installs or is tricked into running) can use the API but cannot
read, print or send the token anywhere. Every other flow is denied.

Here the model is replaced by a fixed script. Run it against GitHub's API::

    GITHUB_TOKEN=ghp_... python examples/python/agent_tool.py

``AGENT_API_HOST`` and ``AGENT_API_PORT`` name another API; ``AGENT_API_ADDRESS`` answers
its DNS with a fixed address and ``AGENT_API_CA`` (a PEM file) is the CA its certificate is
checked against (the package's tests point these at a server on loopback).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Optional

import krunbox

API_HOST = os.environ.get("AGENT_API_HOST", "api.github.com")
API_PORT = int(os.environ.get("AGENT_API_PORT", "443"))

# What the model wrote: it calls the API without any credential of its own.
MODEL_CODE = f"""
import json, urllib.request
with urllib.request.urlopen("https://{API_HOST}:{API_PORT}/user", timeout=30) as response:
    print("logged in as", json.load(response)["login"])
"""


def api_sandbox(token: str) -> krunbox.Sandbox:
    """A sandbox whose only way out is ``API_HOST``, its requests carrying ``token``."""
    address = os.environ.get("AGENT_API_ADDRESS")
    ca_file = os.environ.get("AGENT_API_CA")

    async def add_token(request: krunbox.Request) -> Optional[krunbox.Answer]:
        request.set_header("authorization", f"Bearer {token}")
        return None

    def policy(flow: krunbox.Flow) -> krunbox.Verdict:
        if flow.hostname != API_HOST:
            return krunbox.Verdict.deny()
        if flow.protocol == "dns":
            return krunbox.Verdict.resolve([address]) if address else krunbox.Verdict.accept()
        if flow.protocol == "tcp" and flow.destination[1] == API_PORT:
            return krunbox.Verdict.intercept([add_token])
        return krunbox.Verdict.deny()

    upstream_ca = Path(ca_file).read_bytes() if ca_file else None
    network = krunbox.Network(policy=policy, upstream_ca=upstream_ca)
    return krunbox.Sandbox("agent", memory_mib=512, network=network)


async def run_python(sandbox: krunbox.Sandbox, code: str, timeout: float = 60) -> str:
    """The tool: runs ``code`` with python3 in a fresh instance of ``sandbox`` and returns
    what it printed (stderr too, and the exit code when it failed), for the model to read."""
    async with sandbox.boot() as vm:
        done = await vm.run(["python3", "-c", code], timeout=timeout)
    report = done.stdout_text + done.stderr_text
    if done.returncode != 0:
        report += f"\n(exit code {done.returncode})"
    return report


async def main() -> None:
    sandbox = api_sandbox(os.environ["GITHUB_TOKEN"])
    print(await run_python(sandbox, MODEL_CODE), end="")


if __name__ == "__main__":
    asyncio.run(main())
