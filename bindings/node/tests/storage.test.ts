// Storage from TypeScript, in real microVMs: a copy-on-write root whose blocks a store
// written in TypeScript keeps across boots (and refuses a second running sandbox), a store
// that throws costing only its own boot, memory and host-directory mounts, and a mount
// served by a VirtualFs written in TypeScript.

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
  type VirtualFs,
  type VirtualFsStat,
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

/** A writable tree in a Map and a Set; `/secret` refuses with EACCES, `/broken` has a bug. */
class MapFs implements VirtualFs {
  readonly files = new Map<string, Buffer>([["/notes/hello.txt", Buffer.from("hello from TypeScript\n")]]);
  readonly dirs = new Set(["/", "/notes"]);

  async stat(path: string): Promise<VirtualFsStat> {
    if (this.dirs.has(path)) return { kind: "dir" };
    const file = this.files.get(path);
    if (file) return { kind: "file", size: file.length, mtimeMs: Date.now() };
    if (path === "/secret" || path === "/broken") return { kind: "file", size: 10 };
    throw Object.assign(new Error(`${path}: no such file`), { code: "ENOENT" });
  }
  listDir(path: string): string[] {
    const prefix = path === "/" ? "/" : `${path}/`;
    const names = new Set<string>();
    for (const p of [...this.files.keys(), ...this.dirs]) {
      if (p.startsWith(prefix) && p !== prefix) names.add(p.slice(prefix.length).split("/")[0] ?? "");
    }
    if (path === "/") names.add("secret").add("broken");
    return [...names].sort();
  }
  async read(path: string, offset: number, size: number): Promise<Uint8Array> {
    if (path === "/secret") throw Object.assign(new Error("not for the guest"), { code: "EACCES" });
    if (path === "/broken") throw new TypeError("a bug in the filesystem");
    return (this.files.get(path) ?? Buffer.alloc(0)).subarray(offset, offset + size);
  }
  write(path: string, offset: number, data: Uint8Array): number {
    const file = this.files.get(path) ?? Buffer.alloc(0);
    const grown = Buffer.alloc(Math.max(file.length, offset + data.length));
    file.copy(grown);
    grown.set(data, offset);
    this.files.set(path, grown);
    return data.length;
  }
  create(path: string): void {
    this.files.set(path, Buffer.alloc(0));
  }
  truncate(path: string, size: number): void {
    const file = this.files.get(path) ?? Buffer.alloc(0);
    const cut = Buffer.alloc(size);
    file.copy(cut, 0, 0, Math.min(size, file.length));
    this.files.set(path, cut);
  }
  makeDir(path: string): void {
    this.dirs.add(path);
  }
  remove(path: string): void {
    this.files.delete(path);
  }
  removeDir(path: string): void {
    if ([...this.files.keys(), ...this.dirs].some((p) => p.startsWith(`${path}/`))) {
      throw Object.assign(new Error("not empty"), { code: "ENOTEMPTY" });
    }
    this.dirs.delete(path);
  }
  rename(from: string, to: string): void {
    for (const [p, data] of [...this.files]) {
      if (p === from || p.startsWith(`${from}/`)) {
        this.files.delete(p);
        this.files.set(to + p.slice(from.length), data);
      }
    }
    for (const p of [...this.dirs]) {
      if (p === from || p.startsWith(`${from}/`)) {
        this.dirs.delete(p);
        this.dirs.add(to + p.slice(from.length));
      }
    }
  }
}

test("a VirtualFs written in TypeScript, mounted in a microVM", async () => {
  const tree = new MapFs();
  const warnings: string[] = [];
  const warned = (warning: Error) => warnings.push(warning.message);
  process.on("warning", warned);
  try {
    const sandbox = defineSandbox({ rootfs: "busybox", resources: { cpus: 1, memoryMiB: 256 } });
    await using lane = await sandbox.boot({ mounts: { "/ts": fs.virtual(tree) } });
    const script = [
      "cat /ts/notes/hello.txt",
      "echo written > /ts/notes/new.txt",
      "mkdir -p /ts/a/b && echo deep > /ts/a/b/c.txt",
      "mv /ts/a /ts/moved",
      "ls /ts | tr '\\n' ' '; echo",
      "cat /ts/secret 2>&1 | grep -c 'Permission denied'",
      "cat /ts/broken 2>&1 | grep -Eci 'I/O error|Input/output error'",
      "mkdir /ts/full && touch /ts/full/x && rmdir /ts/full 2>&1 | grep -c 'not empty'",
      "rm -r /ts/moved && ls /ts | tr '\\n' ' '; echo",
    ].join("; ");
    const ran = await lane.exec("sh", ["-c", script]);
    assert.equal(
      ran.stdout,
      "hello from TypeScript\nbroken moved notes secret \n1\n1\n1\nbroken full notes secret \n",
      ran.stderr,
    );
    assert.equal(tree.files.get("/notes/new.txt")?.toString(), "written\n");
    assert.ok(!tree.dirs.has("/moved") && !tree.files.has("/moved/b/c.txt"));
  } finally {
    process.off("warning", warned);
  }
  // The bug was reported (once for each read the guest's kernel tried); the guest's own errors
  // (EACCES, ENOTEMPTY, ENOENT) were answers, not reports.
  assert.ok(warnings.length >= 1);
  for (const warning of warnings) {
    assert.match(warning, /the VirtualFs's read\("\/broken"\) failed.*a bug in the filesystem/s);
  }
});
