// A sandbox's life past boot: a warm pool handing out a fresh instance, paused (new work
// refused with PausedError) and resumed, in a real microVM.

import assert from "node:assert/strict";
import { test } from "node:test";

import { InvalidConfigError, PausedError, defineSandbox } from "krunbox";

test("a pool hands out a fresh instance that pauses and resumes", async () => {
  const sandbox = defineSandbox({ rootfs: "busybox", resources: { memoryMiB: 256 } });
  await assert.rejects(sandbox.pool(0), InvalidConfigError);
  await using pool = await sandbox.pool(1);
  await using vm = await pool.take();
  assert.ok(vm.hostBootWorkMs > 0);
  await vm.pause();
  assert.equal(vm.paused, true);
  await assert.rejects(vm.exec("true"), PausedError);
  await vm.resume();
  assert.equal(vm.paused, false);
  const done = await vm.exec("echo", ["back"]);
  assert.equal(done.stdout, "back\n");
});
