// A sandbox's life past boot: a warm pool handing out a fresh instance, paused (new work
// refused with PausedError) and resumed; a snapshot restored as a twin that takes over the
// source's shell, in real microVMs.

import assert from "node:assert/strict";
import { closeSync, mkdtempSync, openSync, readFileSync, readSync, rmSync, writeSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";

import { InvalidConfigError, PausedError, Snapshot, SnapshotTamperedError, Terminal, defineSandbox } from "krunbox";

import { readUntil } from "./helpers.js";

const encode = (text: string) => new TextEncoder().encode(text);

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

test("a snapshot restores as a twin that takes over the shell, and a changed byte is refused", async () => {
  const work = mkdtempSync(join(tmpdir(), "krunbox-snapshot-"));
  try {
    const keys = join(work, "keys");
    const sandbox = defineSandbox({
      rootfs: "busybox",
      resources: { memoryMiB: 256 },
      snapshots: true,
      snapshotKeyDir: keys,
    });
    {
      await using vm = await sandbox.boot();
      const shell = vm.pty("sh");
      const pid = await shell.pid;
      const input = shell.input.getWriter();
      const screen = shell.output.getReader();
      await input.write(encode("X=41; echo kept > /tmp/f; echo set-$X\n"));
      await readUntil(screen, /set-41/);
      const taken = await vm.snapshot(join(work, "snap"));
      const snapshot = Snapshot.open(join(work, "snap"), keys);
      assert.equal(snapshot.digest, taken.digest);
      {
        await using twin = await sandbox.restore(snapshot);
        assert.deepEqual(twin.processes(), [pid]);
        const twinShell = twin.attach(pid);
        assert.ok(twinShell instanceof Terminal);
        const twinInput = twinShell.input.getWriter();
        await twinInput.write(encode("echo got-$((X + 1)) $(cat /tmp/f)\n"));
        await readUntil(twinShell.output.getReader(), /got-42 kept/);
      }
      await input.write(encode("echo src-$X\n"));
      await readUntil(screen, /src-41/);
    }
    // One byte of guest memory changed on disk (in its first data extent, as the manifest
    // lists them): refused.
    const manifest = JSON.parse(readFileSync(join(work, "snap", "manifest.json"), "utf8"));
    const at: number = manifest.manifest.memory.extents[0][0];
    const memory = openSync(join(work, "snap", "memory.img"), "r+");
    const byte = Buffer.alloc(1);
    readSync(memory, byte, 0, 1, at);
    byte[0] = byte[0]! ^ 1;
    writeSync(memory, byte, 0, 1, at);
    closeSync(memory);
    await assert.rejects(Snapshot.open(join(work, "snap"), keys).verify(), SnapshotTamperedError);
  } finally {
    rmSync(work, { recursive: true, force: true });
  }
});
