"""examples/python/agent_tool.py, run as a user runs it, against an API of this test's on
loopback: the model's code reaches it and the token is on the request, never in the guest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "python" / "agent_tool.py"


def test_the_agent_tool_example_reaches_one_api_with_a_host_held_token(
    origin: Tuple[int, bytes, List[Optional[str]]], tmp_path: Path
) -> None:
    port, ca_pem, seen = origin
    ca = tmp_path / "ca.pem"
    ca.write_bytes(ca_pem)
    env = dict(
        os.environ,
        GITHUB_TOKEN="ghp_host_held",
        AGENT_API_HOST="api.test",
        AGENT_API_PORT=str(port),
        AGENT_API_ADDRESS="127.0.0.1",
        AGENT_API_CA=str(ca),
    )
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], env=env, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == b"logged in as octocat\n", done
    assert seen == ["Bearer ghp_host_held"]
