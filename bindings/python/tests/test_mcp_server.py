"""`krunbox mcp` (the CLI's MCP server) driven over stdio by the official MCP Python SDK (`mcp`
from PyPI), as any MCP client would: list the tools, run `bash` in the session's microVM, edit
then read a file on the mounted workspace, grep, an `ask` rule refused through elicitation, a
`deny` rule; and the session's end stops the VM (its helper process is gone). Here rather than
under cli/ because it shares this package's virtualenv (one set-up for both).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Set

import jsonschema  # type: ignore[import-untyped]
import mcp.types as types
from mcp import ClientSession, StdioServerParameters
from mcp.client.context import ClientRequestContext
from mcp.client.stdio import stdio_client

REPO = Path(__file__).resolve().parents[3]


def krunbox_cli() -> str:
    """The `krunbox` binary of this build (scripts/test.sh says which; else the default)."""
    return os.environ.get("KRUNBOX_CLI") or str(REPO / "target" / "debug" / "krunbox")


def helpers_below(root: int) -> Set[int]:
    """The pids of `krunbox-vmm` processes descending from `root`."""
    parent: Dict[int, int] = {}
    names: Dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, not ')'.
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        parent[int(entry)] = int(stat[stat.rindex(")") + 2 :].split()[1])
        names[int(entry)] = comm

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == root:
                return True
        return False

    return {pid for pid, name in names.items() if name.startswith("krunbox-vmm") and descends(pid)}


def text(result: types.CallToolResult) -> str:
    return "".join(block.text for block in result.content if isinstance(block, types.TextContent))


async def test_an_mcp_client_uses_the_tools_and_the_session_end_stops_the_vm(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text("def greet():\n    return 'hello'\n")
    asked: List[str] = []

    async def elicitation(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult | types.ErrorData:
        asked.append(params.message)
        return types.ElicitResult(action="decline")

    server = StdioServerParameters(
        command=krunbox_cli(),
        args=[
            "mcp",
            "--image", "busybox",
            "--memory", "256",
            "--mount", f"{tmp_path}:/workspace",
            "--rule", "deny bash(rm:*)",
            "--rule", "ask bash(wget:*)",
        ],
        # The SDK passes a minimal environment: krunbox's own settings (its cache) go along.
        env={k: v for k, v in os.environ.items() if k.startswith("KRUNBOX_")} | {"RUST_LOG": "krunbox=info"},
    )
    log = tmp_path / "server.log"
    with log.open("w") as errlog:
        async with stdio_client(server, errlog=errlog) as (read, write):
            async with ClientSession(read, write, elicitation_callback=elicitation) as session:
                await session.initialize()
                listed = await session.list_tools()
                tools = {tool.name: tool for tool in listed.tools}
                assert sorted(tools) == sorted(["bash", "process", "read", "write", "edit", "ls", "glob", "grep"])
                for tool in tools.values():
                    jsonschema.Draft202012Validator.check_schema(tool.input_schema)

                ran = await session.call_tool("bash", {"command": "uname -s && echo $((6 * 7)) > /workspace/answer"})
                assert not ran.is_error, text(ran)
                assert text(ran) == "exit code 0\nLinux\n"
                assert (tmp_path / "answer").read_text() == "42\n"

                edited = await session.call_tool(
                    "edit",
                    {"path": "app.py", "edits": [{"old_string": "'hello'", "new_string": "'hello, sandbox'"}]},
                )
                assert not edited.is_error, text(edited)
                shown = await session.call_tool("read", {"path": "/workspace/app.py"})
                assert text(shown) == "     1\tdef greet():\n     2\t    return 'hello, sandbox'\n"
                assert (tmp_path / "app.py").read_text() == "def greet():\n    return 'hello, sandbox'\n"

                found = await session.call_tool("grep", {"pattern": "sandbox", "glob": "*.py"})
                assert text(found) == "/workspace/app.py:2:    return 'hello, sandbox'\n"

                refused = await session.call_tool("bash", {"command": "wget -q -O- http://127.0.0.1:9/"})
                assert refused.is_error
                assert "was refused" in text(refused), text(refused)
                assert len(asked) == 1 and "wget" in asked[0], asked

                denied = await session.call_tool("bash", {"command": "rm -rf /workspace/app.py"})
                assert denied.is_error and "permission denied" in text(denied), text(denied)
                assert (tmp_path / "app.py").exists()

                bad = await session.call_tool("read", {"file": "app.py"})
                assert bad.is_error and "unknown field `file`" in text(bad), text(bad)

                helpers = helpers_below(os.getpid())
                assert len(helpers) == 1, helpers

    # The client closed the server's stdin: the session ended, the server stopped its VM (the
    # SDK would kill the server after 2 s, and the VM with it: the log says the server did it)
    # and the helper is gone.
    assert "MCP session ended: stopping its sandbox" in log.read_text(), log.read_text()
    deadline = time.monotonic() + 60
    while helpers & set(map(int, filter(str.isdigit, os.listdir("/proc")))):
        assert time.monotonic() < deadline, f"the helper outlived the session: {helpers}"
        time.sleep(0.2)


def test_every_example_in_the_docs_validates_against_its_tool_schema() -> None:
    """docs/tools.md's example calls, each checked against the schema `krunbox mcp` serves."""
    import subprocess

    listed = subprocess.run(
        [krunbox_cli(), "tools", "--format", "mcp"], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    schemas = {tool["name"]: tool["inputSchema"] for tool in json.loads(listed.stdout)}
    examples: List[Any] = []
    docs = (REPO / "docs" / "tools.md").read_text()
    for block in docs.split("```json")[1:]:
        example = json.loads(block.split("```")[0])
        if isinstance(example, dict) and "tool" in example and "arguments" in example:
            examples.append(example)
    assert len(examples) >= 8, f"only {len(examples)} examples in docs/tools.md"
    for example in examples:
        schema = schemas[example["tool"]]
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.validate(example["arguments"], schema, cls=jsonschema.Draft202012Validator)
    assert {example["tool"] for example in examples} == set(schemas)
