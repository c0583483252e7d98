// Storage from TypeScript, in real microVMs: a copy-on-write root whose blocks a store
// written in TypeScript keeps across boots (and refuses a second running sandbox), a store
// that throws costing only its own boot, and memory and host-directory mounts.

import assert from "node:assert/strict";
import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";

import {
  StoreError,
  defineSandbox,
  fs,
  rootfs,
  type BlockChunk,
  type BlockRange,
  type BlockStore,
  type BlockStoreContext,
} from "krunbox";

/** Blocks in a Map, every method async as a remote store's would be. */
class MapStore implements BlockStore {
  readonly blockSize = 4096;
  readonly blocks = new Map<bigint, Uint8Array>();
  readonly bases: string[] = [];
  flushes = 0;

  async attach(context: BlockStoreContext): Promise<void> {
    if (this.bases.length > 0 && this.bases[0] !== context.base) throw new Error("a layer of another base");
    this.bases.push(context.base);
  }
  async list(): Promise<Iterable<bigint>> {
    return this.blocks.keys();
  }
  async read(range: BlockRange): Promise<readonly BlockChunk[]> {
    await new Promise((resolve) => setImmediate(resolve));
    const chunks: BlockChunk[] = [];
    for (let i = 0n; i < BigInt(range.count); i++) {
      const data = this.blocks.get(range.first + i);
      if (data) chunks.push({ index: range.first + i, data });
    }
    return chunks;
  }
  async write(chunks: readonly BlockChunk[]): Promise<void> {
    for (const chunk of chunks) this.blocks.set(chunk.index, chunk.data);
  }
  async flush(): Promise<void> {
    this.flushes += 1;
  }
}

test("a cow root over a TypeScript store keeps its changes across boots", async () => {
  const store = new MapStore();
  const root = () => rootfs.cow({ base: rootfs.builtIn("busybox"), writable: store });
  const resources = { cpus: 1, memoryMiB: 256 };
  {
    await using lane = await defineSandbox({ rootfs: root(), resources }).boot();
    const wrote = await lane.exec("sh", ["-c", "echo kept > /etc/kept && sync"]);
    assert.equal(wrote.exitCode, 0, wrote.stderr);
  }
  assert.ok(store.blocks.size > 0 && store.flushes > 0);
  assert.equal(store.bases.length, 1);

  // A new definition over the same store boots with what the first boot wrote; while it
  // runs, a second sandbox over the store is refused.
  const again = defineSandbox({ rootfs: root(), resources });
  {
    await using lane = await again.boot();
    assert.equal(await lane.readTextFile("/etc/kept"), "kept\n");
    await assert.rejects(defineSandbox({ rootfs: root(), resources }).boot(), (e: unknown) =>
      e instanceof StoreError || (e as { code?: string }).code === "RootInUse");
  }
  assert.deepEqual(store.bases, [store.bases[0], store.bases[0]]);

  // A store that throws fails the boot that needs it, reported, and nothing else.
  const broken = new MapStore();
  broken.attach = async () => {
    throw new Error("the bucket is gone");
  };
  const warnings: string[] = [];
  const warned = (warning: Error) => warnings.push(warning.message);
  process.on("warning", warned);
  try {
    await assert.rejects(
      defineSandbox({ rootfs: rootfs.cow({ base: rootfs.builtIn("busybox"), writable: broken }), resources }).boot(),
      (e: unknown) => e instanceof StoreError && /the bucket is gone/.test(e.message),
    );
  } finally {
    process.off("warning", warned);
  }
  assert.ok(warnings.some((w) => /the block store failed.*the bucket is gone/s.test(w)), warnings.join("\n"));
});

test("memory and host-directory mounts, per definition and per boot", async () => {
  const workspace = fs.memory({ files: { "/task.txt": "count the words\n" } });
  const shared = mkdtempSync(join(tmpdir(), "krunbox-node-host-"));
  writeFileSync(join(shared, "from-host.txt"), "from the host\n");
  const sandbox = defineSandbox({
    rootfs: "busybox",
    resources: { cpus: 1, memoryMiB: 256 },
    mounts: { "/shared": fs.virtual(fs.hostDir(shared)) },
  });
  await using lane = await sandbox.boot({ mounts: { "/workspace": fs.virtual(workspace) }, cwd: "/workspace" });
  const ran = await lane.exec("sh", [
    "-c",
    "wc -w < task.txt > count.txt && cat /shared/from-host.txt && echo guest > /shared/from-guest.txt",
  ]);
  assert.deepEqual([ran.exitCode, ran.stdout, ran.stderr], [0, "from the host\n", ""]);
  assert.equal(workspace.readTextFile("/count.txt").trim(), "3");
  assert.deepEqual(workspace.listDir("/").sort(), ["count.txt", "task.txt"]);
  assert.equal(readFileSync(join(shared, "from-guest.txt"), "utf8"), "guest\n");
});
