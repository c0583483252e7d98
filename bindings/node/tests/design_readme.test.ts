// The design's README example (torkbot/sandbox's first example, in
// shared/reference/torkbot-sandbox-README.txt) run with our package: its lines are the
// example's, changed only where our names differ or a test must (each change is marked
// `// ours:` and listed in the package's README):
// - `from "krunbox"`; our built-in image "agent" for "alpine:3.23"; `type BlockStore`;
// - 1 vCPU and 1 GiB (a test shares a nested VM);
// - the resolver is this test's on loopback, not 1.1.1.1, and the policy takes the test
//   origin's CA (`upstreamCa`), since api.github.com here is a server of this test's on
//   127.0.0.1:443 with a CA of its own;
// - `BlobBackedBlockStore` and `GitHubInstallationTokenService` are the user's classes in
//   the example: here stand-ins written below.

import assert from "node:assert/strict";
import { test } from "node:test";

import {
  defineSandbox,
  fs,
  network,
  rootfs,
  type BlockChunk,
  type BlockRange,
  type BlockStore,
  type Connection,
  type HttpMatch,
  type Request,
} from "krunbox";

import { startOrigin, startResolver } from "./helpers.js";

/** The example's blob-backed store, as a test's stand-in: blocks under a key prefix in a Map. */
class BlobBackedBlockStore implements BlockStore {
  static readonly buckets = new Map<string, Map<string, Uint8Array>>();
  readonly blockSize = 65536;
  readonly #objects: Map<string, Uint8Array>;
  readonly #prefix: string;

  constructor(options: { bucket: string; keyPrefix: string }) {
    const bucket = BlobBackedBlockStore.buckets.get(options.bucket) ?? new Map<string, Uint8Array>();
    BlobBackedBlockStore.buckets.set(options.bucket, bucket);
    this.#objects = bucket;
    this.#prefix = `${options.keyPrefix}/`;
  }
  async list(): Promise<Iterable<bigint>> {
    return [...this.#objects.keys()].filter((k) => k.startsWith(this.#prefix)).map((k) => BigInt(k.slice(this.#prefix.length)));
  }
  async read(range: BlockRange): Promise<readonly BlockChunk[]> {
    const chunks: BlockChunk[] = [];
    for (let index = range.first; index < range.first + BigInt(range.count); index++) {
      const data = this.#objects.get(`${this.#prefix}${index}`);
      if (data) chunks.push({ index, data });
    }
    return chunks;
  }
  async write(chunks: readonly BlockChunk[]): Promise<void> {
    for (const chunk of chunks) this.#objects.set(`${this.#prefix}${chunk.index}`, chunk.data);
  }
}

/** The example's token service, as a test's stand-in: it serves one installation. */
class GitHubInstallationTokenService {
  readonly #installationId: number;
  constructor(options: { installationId: number }) {
    this.#installationId = options.installationId;
  }
  async canServe(github: HttpMatch): Promise<boolean> {
    return this.#installationId === 123456 && github.hostname === "api.github.com";
  }
  async tokenForRequest(request: Request): Promise<string> {
    assert.equal(request.hostname, "api.github.com");
    return `ghs_installation_${this.#installationId}`;
  }
}

test("the design's README example runs with our names", async () => {
  const origin = await startOrigin(["api.github.com"], {
    port: 443,
    answer: () => ({ status: 200, type: "application/json", body: '{"login":"octocat"}\n' }),
  });
  const resolver = await startResolver("127.0.0.1");
  try {
    // ---- the example, from here ----
    const workspace = fs.memory({
      files: {
        "/task.txt": "Summarize the current GitHub user\n",
      },
    });

    const writableRootfs: BlockStore = new BlobBackedBlockStore({ // ours: type BlockStore
      bucket: "agent-rootfs-overlays",
      keyPrefix: "lanes/github-worker",
    });

    const githubTokens = new GitHubInstallationTokenService({
      installationId: 123456,
    });

    const sandbox = defineSandbox({
      rootfs: rootfs.cow({
        base: rootfs.builtIn("agent"), // ours: our built-in image
        writable: writableRootfs,
      }),
      resources: {
        cpus: 1, // ours: a test shares a nested VM
        memoryMiB: 1024, // ours
      },
      network: network.policy(async (conn: Connection) => {
        // Let the guest resolve names, but answer DNS via an explicit resolver.
        if (conn.matchDns()?.accept({ resolvers: [`127.0.0.1:${resolver.port}`] })) return; // ours: the test's resolver

        // Only GitHub API HTTP(S) traffic gets HTTP middleware.
        const github = conn.matchHttp("api.github.com");
        if (!github) return;

        // Keep the credential decision in host-controlled TypeScript.
        if (!(await githubTokens.canServe(github))) return;

        github.accept(async (request) => {
          request.headers.set(
            "authorization",
            `Bearer ${await githubTokens.tokenForRequest(request)}`,
          );
        });
      }, { upstreamCa: origin.ca }), // ours: the test origin's CA
    });

    await using lane = await sandbox.boot({
      mounts: {
        "/workspace": fs.virtual(workspace),
      },
      cwd: "/workspace",
    });

    const result = await lane.exec("sh", [
      "-lc",
      "cat task.txt && curl -fsSL https://api.github.com/user",
    ]);

    if (result.exitCode !== 0) {
      throw new Error(result.stderr);
    }
    // ---- to here ----

    assert.equal(result.stdout, 'Summarize the current GitHub user\n{"login":"octocat"}\n');
    assert.deepEqual(
      origin.seen.map((r) => [r.path, r.headers.authorization]),
      [["/user", "Bearer ghs_installation_123456"]],
    );
    // The guest never held the token; its root's writes went to the store.
    const env = await lane.exec("sh", ["-c", "env; cat /proc/self/environ"]);
    assert.ok(!env.stdout.includes("ghs_installation"));
    const wrote = await lane.exec("sh", ["-c", "echo lane > /etc/lane && sync"]);
    assert.equal(wrote.exitCode, 0, wrote.stderr);
    assert.ok((BlobBackedBlockStore.buckets.get("agent-rootfs-overlays")?.size ?? 0) > 0);
  } finally {
    await resolver.close();
    await origin.close();
  }
});
