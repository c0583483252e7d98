"""Commands and files in real microVMs, through the asyncio API and the sync one.

Each test boots as few VMs as proves its point: under the nested emulation the tests run in,
a boot takes seconds and a fault costs the test.
"""

import asyncio

import pytest

import krunbox
import krunbox.sync


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
    with pytest.raises(krunbox.InstanceGone):
        vm.run("true")
