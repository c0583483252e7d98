// Commands to their end in a real microVM: output and exit codes, a timeout (124), an abort
// that kills the process group and leaves the sandbox usable, the guest's files, typed
// errors, the isolation and metrics reports, and `await using` shutting the instance down.

import assert from "node:assert/strict";
import { test } from "node:test";

import {
  AbortError,
  ExecFailedError,
  GuestFsError,
  InstanceGoneError,
  InvalidConfigError,
  KrunboxError,
  TIMEOUT_EXIT_CODE,
  defineSandbox,
  toolDefinitions,
  type Instance,
} from "krunbox";

/** The crate's agent tools through TypeScript: an async approver, result shapes, the audit. */
async function agentTools(lane: Instance): Promise<void> {
  const asked: string[] = [];
  const tools = lane.tools({
    workspace: "/tmp/agent",
    permissions: { mode: "workspace-write", rules: [{ ask: "bash(wget:*)" }] },
    approver: async (request) => {
      asked.push(request.rule);
      return "not today";
    },
  });
  const audit = tools.auditEvents();
  assert.deepEqual(tools.definitions("openai").map((t) => (t.function as { name: string }).name).slice(0, 2), ["bash", "process"]);
  assert.equal((toolDefinitions("anthropic")[2] as { name: string }).name, "read");
  const wrote = await tools.call("write", { path: "a.txt", content: "one\ntwo\n" });
  assert.ok(!wrote.isError, wrote.text);
  const edited = await tools.call("edit", { path: "a.txt", edits: [{ old_string: "two", new_string: "three" }] });
  assert.ok(!edited.isError, edited.text);
  assert.equal((await tools.call("read", { path: "/tmp/agent/a.txt" })).text, "     1\tone\n     2\tthree\n");
  const refused = await tools.call("bash", { command: "wget http://127.0.0.1:9/" });
  assert.ok(refused.isError);
  assert.match(refused.text, /was refused: not today$/);
  assert.deepEqual(asked, ["ask bash(wget:*)"]);
  assert.deepEqual(refused.toOpenAI("call_1"), { role: "tool", tool_call_id: "call_1", content: refused.text });
  const bad = await tools.call("grep", {});
  assert.ok(bad.isError && /missing field `pattern`/.test(bad.text), bad.text);
  const decisions: string[] = [];
  for await (const event of audit) {
    decisions.push(`${event.tool} ${event.decision}`);
    if (decisions.length === 4) break;
  }
  assert.deepEqual(decisions, ["write allowed", "edit allowed", "read allowed", "bash refused"]);
}

/** Waits for the guest file `path` to exist (at most 30 s). */
async function waitForFile(lane: Instance, path: string): Promise<string> {
  const deadline = Date.now() + 30_000;
  for (;;) {
    try {
      return await lane.readTextFile(path);
    } catch (error) {
      if (!(error instanceof GuestFsError) || Date.now() > deadline) throw error;
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
  }
}

test("exec, its timeout and abort, files and typed errors, and await using", async () => {
  assert.throws(() => defineSandbox({ rootfs: "windows" as "agent" }), (e: unknown) =>
    e instanceof InvalidConfigError && e.code === "InvalidConfig" && /not a built-in image/.test(e.message));

  const sandbox = defineSandbox({ rootfs: "busybox", resources: { cpus: 1, memoryMiB: 256 } });
  let kept: Instance | undefined;
  {
    await using lane = await sandbox.boot({ cwd: "/tmp" });
    kept = lane;

    const isolation = lane.isolation();
    assert.ok(isolation.canaries.length > 0 && isolation.canaries.every((c) => c.blocked), JSON.stringify(isolation));
    assert.ok(isolation.layers.some((layer) => layer.enforced));
    const metrics = lane.metrics();
    assert.ok(metrics.memoryBytes > 0 && metrics.network === null, JSON.stringify(metrics));
    assert.equal(lane.publishedAddress(8000), undefined);

    const ran = await lane.exec("sh", ["-c", 'echo out; echo "$X" >&2; pwd; exit 3'], { env: { X: "from env" } });
    assert.deepEqual([ran.exitCode, ran.stdout, ran.stderr, ran.timedOut], [3, "out\n/tmp\n", "from env\n", false]);

    const slow = await lane.exec("sleep", ["30"], { timeoutMs: 300 });
    assert.deepEqual([slow.exitCode, slow.timedOut], [TIMEOUT_EXIT_CODE, true]);

    // An abort kills the whole process group (the shell and its background sleep), rejects
    // with an AbortError carrying the signal's reason, and the sandbox goes on.
    const controller = new AbortController();
    const aborted = lane.exec("sh", ["-c", "sleep 31 & echo $! > /tmp/bg; wait"], { signal: controller.signal });
    const background = (await waitForFile(lane, "/tmp/bg")).trim();
    const reason = new Error("the user changed their mind");
    controller.abort(reason);
    await assert.rejects(aborted, (e: unknown) =>
      e instanceof AbortError && e.name === "AbortError" && e.code === "Cancelled" && e.cause === reason);
    const gone = await lane.exec("sh", ["-c", `kill -0 ${background} 2>/dev/null && echo alive || echo gone`]);
    assert.equal(gone.stdout, "gone\n");
    await assert.rejects(lane.exec("true", [], { signal: controller.signal }), AbortError);

    await lane.writeFile("/tmp/dir/a.txt", "alpha", { parents: true, mode: 0o600 });
    assert.equal(await lane.readTextFile("/tmp/dir/a.txt"), "alpha");
    const stat = await lane.stat("/tmp/dir/a.txt");
    assert.deepEqual([stat.kind, stat.size, stat.mode], ["file", 5, 0o600]);
    await lane.rename("/tmp/dir/a.txt", "/tmp/dir/b.txt");
    await lane.makeDir("/tmp/dir/sub/deeper", { parents: true });
    const listed = (await lane.listDir("/tmp/dir")).map((e) => `${e.name}:${e.kind}`).sort();
    assert.deepEqual(listed, ["b.txt:file", "sub:dir"]);
    await lane.remove("/tmp/dir", { recursive: true });

    await assert.rejects(lane.readFile("/tmp/dir/b.txt"), (e: unknown) => e instanceof GuestFsError && e.code === "Fs");
    await assert.rejects(lane.exec("/no/such/program"), (e: unknown) =>
      e instanceof ExecFailedError && e instanceof KrunboxError && e.code === "Exec");
    await assert.rejects(lane.exec("true", [], { timeoutMs: -1 }), (e: unknown) =>
      e instanceof InvalidConfigError && /timeoutMs=-1/.test(e.message));
    await agentTools(lane);
  }
  // Leaving the block shut the instance down.
  await assert.rejects(kept.exec("true"), (e: unknown) => e instanceof InstanceGoneError && e.code === "InstanceGone");
});
