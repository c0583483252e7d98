"""Commands and files in real microVMs, through the asyncio API and the sync one.

Each test boots as few VMs as proves its point: under the nested emulation the tests run in,
a boot takes seconds and a fault costs the test.
"""

import asyncio

import pytest

import krunbox
import krunbox.sync
from krunbox.tools import Toolbox


def test_a_bad_definition_is_refused_before_anything_boots() -> None:
    with pytest.raises(krunbox.InvalidConfig, match="not a built-in image"):
        krunbox.Sandbox("windows")
    with pytest.raises(krunbox.KrunboxError):
        krunbox.sync.Sandbox("windows")
    # Network definitions are checked as they are made, each error saying what to change.
    with pytest.raises(krunbox.InvalidConfig, match=r"rules\[0\]"):
        krunbox.Network(rules=[{"action": "allow", "domain": "a.*.com"}])
    assert krunbox.Network(rules=[{"action": "allow", "domain": "*.example.com", "ports": "443"}])
    with pytest.raises(krunbox.InvalidConfig, match="not both"):
        krunbox.Network(rules=[], policy=lambda flow: True)
    with pytest.raises(krunbox.InvalidConfig):
        krunbox.Network(secrets=[krunbox.Secret("1BAD", "value", hosts=["x.test"])])
    with pytest.raises(krunbox.InvalidConfig, match="200 to 999"):
        krunbox.Answer(101)
    with pytest.raises(krunbox.InvalidConfig, match="power of two"):
        krunbox.Rootfs.cow(krunbox.Rootfs.builtin("busybox"), _OddStore())


class _OddStore:
    block_size = 1000

    def written_blocks(self) -> list[int]:
        return []


async def test_run_files_errors_and_cancellation_on_one_instance() -> None:
    async with krunbox.Sandbox("busybox", memory_mib=256).boot() as vm:
        done = await vm.run("echo out; echo err >&2; exit 3")
        assert (done.returncode, done.stdout, done.stderr) == (3, b"out\n", b"err\n")
        assert done.args == ["sh", "-c", "echo out; echo err >&2; exit 3"]

        with pytest.raises(krunbox.CommandFailed, match="exited with 3: err") as failed:
            await vm.run(["sh", "-c", "echo err >&2; exit 3"], check=True)
        assert failed.value.result.returncode == 3

        timed = await vm.run(["sleep", "30"], timeout=0.5)
        assert (timed.returncode, timed.timed_out) == (krunbox.TIMEOUT_EXIT_CODE, True)
        with pytest.raises(krunbox.CommandTimeout):
            await vm.run("sleep 30", timeout=0.5, check=True)

        isolation = vm.isolation()
        assert isolation["canaries"] and all(c["blocked"] for c in isolation["canaries"])
        assert any(layer["enforced"] for layer in isolation["layers"]), isolation
        metrics = vm.metrics()
        assert metrics["memory_bytes"] > 0 and metrics["network"] is None, metrics
        assert vm.published_address(8000) is None
        with pytest.raises(krunbox.InvalidConfig, match="no network"):
            vm.network_events()

        env = await vm.run("echo $GREETING from $PWD", cwd="/tmp", env={"GREETING": "hello"})
        assert env.stdout_text == "hello from /tmp\n"

        await vm.write_file("/tmp/note.txt", "written from Python\n")
        assert await vm.read_file("/tmp/note.txt") == b"written from Python\n"
        with pytest.raises(krunbox.GuestFsError, match="/tmp/missing"):
            await vm.read_file("/tmp/missing")
        with pytest.raises(krunbox.ExecFailed, match="no-such-program"):
            await vm.run(["no-such-program"])

        await _the_agent_tools(vm)

        # A cancelled task kills its command's process group in the guest.
        task = asyncio.create_task(vm.run("echo started > /tmp/started; exec sleep 300"))
        while b"started" not in await _read_or_empty(vm, "/tmp/started"):
            await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        left = await _wait_for(vm, "pgrep -x sleep || true", b"")
        assert left == b"", left
    with pytest.raises(krunbox.InstanceGone):
        await vm.run("true")


async def _the_agent_tools(vm: krunbox.Instance) -> None:
    """The crate's agent tools through Python: a coroutine approver, results' shapes, audit."""
    asked: list[str] = []

    async def approver(request: dict[str, object]) -> bool | str:
        asked.append(str(request["rule"]))
        await asyncio.sleep(0)
        return "not on a weekday"

    tools = Toolbox(
        vm,
        workspace="/tmp/agent",
        permissions={"mode": "workspace-write", "rules": [{"ask": "bash(wget:*)"}]},
        approver=approver,
    )
    audit = tools.audit_events()
    assert [t["name"] for t in tools.definitions("anthropic")][:3] == ["bash", "process", "read"]
    assert krunbox.tools.definitions("openai")[0]["function"]["name"] == "bash"
    wrote = await tools.call("write", {"path": "a.py", "content": "x = 1\nx = 1\n"})
    assert not wrote.is_error, wrote.text
    twice = await tools.call("edit", {"path": "a.py", "edits": [{"old_string": "x = 1", "new_string": "x = 2"}]})
    assert twice.is_error and "occurs 2 times" in twice.text, twice.text
    found = await tools.call("grep", {"pattern": "x = 1", "output": "files"})
    assert found.text == "/tmp/agent/a.py\n", found.text
    ran = await tools.call("bash", {"command": "ls"})
    assert (ran.text, ran.is_error) == ("exit code 0\na.py\n", False)
    refused = await tools.call("bash", {"command": "wget http://127.0.0.1:9/"})
    assert refused.is_error and refused.text.endswith("was refused: not on a weekday"), refused.text
    assert asked == ["ask bash(wget:*)"]
    assert refused.to_anthropic("toolu_1") == {
        "type": "tool_result", "tool_use_id": "toolu_1", "content": refused.text, "is_error": True,
    }
    outside = await tools.call("write", {"path": "/etc/motd", "content": "x"})
    assert "`mode workspace-write` forbids" in outside.text, outside.text
    decisions = [(e["tool"], e["decision"]) for e in [await audit.__anext__() for _ in range(6)]]
    assert decisions == [
        ("write", "allowed"), ("edit", "allowed"), ("grep", "allowed"), ("bash", "allowed"),
        ("bash", "refused"), ("write", "denied"),
    ], decisions


async def _read_or_empty(vm: krunbox.Instance, path: str) -> bytes:
    try:
        return await vm.read_file(path)
    except krunbox.GuestFsError:
        return b""


async def _wait_for(vm: krunbox.Instance, cmd: str, wanted: bytes, tries: int = 50) -> bytes:
    out = b""
    for _ in range(tries):
        out = (await vm.run(cmd)).stdout
        if out == wanted:
            break
        await asyncio.sleep(0.2)
    return out


def test_the_sync_api_runs_and_shuts_down() -> None:
    with krunbox.sync.Sandbox("busybox", memory_mib=256, hostname="lane-7").boot() as vm:
        done = vm.run(["hostname"])
        assert done.stdout_text == "lane-7\n"
        vm.write_file("/tmp/x", b"\x00\x01binary")
        assert vm.read_file("/tmp/x") == b"\x00\x01binary"
        with pytest.raises(krunbox.CommandFailed):
            vm.run("exit 1", check=True)
        lines: list[bytes] = []
        fed = vm.run("cat; echo to-err >&2", input=b"fed\n", on_stdout=lines.append)
        assert (fed.stdout, fed.stderr, b"".join(lines)) == (b"fed\n", b"to-err\n", b"fed\n")
        with vm.open_writer("/tmp/streamed") as writer:
            writer.write(b"a" * 100_000)
            writer.write("b")
        assert vm.stat("/tmp/streamed").size == 100_001
        with vm.open_reader("/tmp/streamed") as reader:
            assert sum(len(chunk) for chunk in reader) == 100_001
        vm.remove("/tmp/streamed")
        assert "streamed" not in [e.name for e in vm.list_dir("/tmp")]
        # The agent tools, blocking, with a plain approver.
        tools = krunbox.sync.Toolbox(
            vm, permissions={"rules": [{"ask": "bash"}]}, approver=lambda request: True
        )
        assert tools.call("bash", {"command": "hostname"}).text == "exit code 0\nlane-7\n"
        bad = tools.call("read", {"path": 7})
        assert bad.is_error and "invalid arguments for read" in bad.text, bad.text
    with pytest.raises(krunbox.InstanceGone):
        vm.run("true")
