// Processes streamed while they run, in a real microVM: stdin, stdout and stderr as web
// streams, a large output through them, and a terminal resized while its shell runs.

import assert from "node:assert/strict";
import { test } from "node:test";

import { defineSandbox } from "krunbox";

import { readUntil, text } from "./helpers.js";

const encode = (s: string) => new TextEncoder().encode(s);

test("spawn's web streams and a pty", async () => {
  const sandbox = defineSandbox({ rootfs: "busybox", resources: { cpus: 1, memoryMiB: 256 } });
  await using lane = await sandbox.boot();

  const child = lane.spawn("sh", ["-c", "cat; echo done >&2; exit 7"]);
  await child.ready;
  assert.ok((await child.pid) > 1);
  const stdin = child.stdin.getWriter();
  await stdin.write(encode("hello "));
  await stdin.write(encode("world\n"));
  await stdin.close();
  const [out, err] = await Promise.all([text(child.stdout), text(child.stderr)]);
  assert.deepEqual([out, err], ["hello world\n", "done\n"]);
  assert.deepEqual(await child.exit, { exitCode: 7, signal: undefined, timedOut: false });

  // 8 MiB through the stream, read as it comes.
  const big = lane.spawn("head", ["-c", String(8 << 20), "/dev/zero"]);
  let bytes = 0;
  for await (const chunk of big.stdout) bytes += chunk.length;
  assert.equal(bytes, 8 << 20);
  assert.equal((await big.exit).exitCode, 0);

  // A process that cannot start rejects `ready` and `exit`.
  const missing = lane.spawn("/no/such/program");
  await assert.rejects(missing.ready, { code: "Exec" });
  await assert.rejects(missing.exit, { code: "Exec" });

  const term = lane.pty("sh", [], { size: { rows: 30, cols: 100 } });
  const keys = term.input.getWriter();
  const screen = term.output.getReader();
  await keys.write(encode("stty size\n"));
  const first = await readUntil(screen, /30 100/);
  await term.resize({ rows: 40, cols: 120 });
  await keys.write(encode("stty size; exit 5\n"));
  await readUntil(screen, /40 120/, first.slice(first.indexOf("30 100") + 6));
  assert.equal((await term.exit).exitCode, 5);
});
