// `defineSandbox`: a definition booted as often as wanted; `Instance`: a running microVM,
// with its commands and files.

import { ChildProcess, Terminal, type Exit, type TerminalSize } from "./process.js";
import { AbortError, InstanceGoneError, typed, typedSync } from "./errors.js";
import { nativeMounts, type Mount } from "./fs.js";
import { native } from "./native.js";
import type { Network } from "./network.js";
import { camelCase, type IsolationReport, type Metrics } from "./observe.js";
import { rootfs as roots, Rootfs } from "./rootfs.js";
import { Toolbox, type ToolboxOptions } from "./tools.js";
import type {
  CommandOptions,
  FileStat,
  DirEntry,
  NativeInstance,
  NativePool,
  NativeProcess,
  NativeSnapshot,
} from "../native/index.js";

export type { FileStat, DirEntry };

/** What `defineSandbox` takes. */
export interface SandboxOptions {
  /** The root filesystem: a `Rootfs`, or a built-in image's name ("agent", "busybox"). */
  readonly rootfs: Rootfs | "agent" | "busybox";
  readonly resources?: { readonly cpus?: number; readonly memoryMiB?: number };
  readonly hostname?: string;
  /** Mounts every boot has (guest path → mount). */
  readonly mounts?: Record<string, Mount>;
  /** Default-deny without one. */
  readonly network?: Network;
  /** Instances can be snapshotted (`snapshot`, `fork`): their memory is a file the library holds. */
  readonly snapshots?: boolean;
  /** Where the key authenticating this sandbox's snapshots lives (default: the cache directory). */
  readonly snapshotKeyDir?: string;
}

/** What one boot adds to its definition. */
export interface BootOptions {
  /** This boot's own mounts (guest path → mount), after the definition's. */
  readonly mounts?: Record<string, Mount>;
  /** The working directory of commands that do not give theirs. */
  readonly cwd?: string;
  readonly hostname?: string;
}

/** How a command runs. */
export interface ExecOptions {
  readonly cwd?: string;
  readonly env?: Record<string, string>;
  /** Its process group is killed after this many milliseconds; it then exits with 124. */
  readonly timeoutMs?: number;
  /** Aborting kills its process group and rejects with an `AbortError`; the sandbox stays usable. */
  readonly signal?: AbortSignal;
}

/** How a finished command ended, and what it wrote. */
export interface ExecResult extends Exit {
  /** stdout as UTF-8 text (invalid bytes replaced). */
  readonly stdout: string;
  readonly stderr: string;
  readonly stdoutBytes: Uint8Array;
  readonly stderrBytes: Uint8Array;
}

/** A sandbox definition: what each instance boots from. Cheap to boot many times. */
export class Sandbox {
  readonly #native: InstanceType<typeof native.NativeSandbox>;

  /** @internal */
  constructor(made: InstanceType<typeof native.NativeSandbox>) {
    this.#native = made;
  }

  /** Boots an instance: a microVM of its own, with this boot's mounts and working directory. */
  async boot(options: BootOptions = {}): Promise<Instance> {
    const mounts = nativeMounts(options.mounts);
    const spec = { cwd: options.cwd, hostname: options.hostname };
    return new Instance(await typed(() => this.#native.boot(spec, mounts)));
  }

  /**
   * A warm pool keeping `size` (1 to 64) instances of this definition booted ahead of need,
   * one at a time in the background. `take()` hands out a running instance that never ran
   * anything (booting one itself when none is ready). Pooled instances have no per-boot
   * mounts, hostname or cwd; a persistent or copy-on-write root cannot be pooled.
   *
   * ```ts
   * await using pool = await sandbox.pool(2);
   * await using vm = await pool.take();
   * ```
   */
  async pool(size: number): Promise<Pool> {
    return new Pool(await typed(() => this.#native.pool(size)));
  }

  /**
   * Restores `snapshot` as a new running instance: its processes (`attach`), files and
   * memory as they were. Each part is checked as it is copied into the new microVM; a changed
   * one rejects with a `SnapshotTamperedError` before the microVM runs.
   */
  async restore(snapshot: Snapshot): Promise<Instance> {
    return new Instance(await typed(() => this.#native.restore(snapshot.native)));
  }
}

/** A snapshot on disk (`Instance.snapshot`), its manifest checked. */
export class Snapshot {
  /** @internal */
  readonly native: NativeSnapshot;

  /** @internal */
  constructor(made: NativeSnapshot) {
    this.native = made;
  }

  /** Opens the snapshot in `dir`, checking its manifest with the key in `keyDir`. */
  static open(dir: string, keyDir: string): Snapshot {
    return new Snapshot(typedSync(() => native.NativeSnapshot.open(dir, keyDir)));
  }

  /** Its directory. */
  get dir(): string {
    return this.native.dir;
  }

  /** SHA-256 of its manifest (hex). */
  get digest(): string {
    return this.native.digest;
  }

  /** Hashes every part: rejects with a `SnapshotTamperedError` naming one that changed. */
  verify(): Promise<void> {
    return typed(() => this.native.verify());
  }
}

/** Instances of one sandbox booted ahead of need; `await using` shuts it down. */
export class Pool implements AsyncDisposable {
  readonly #native: NativePool;

  /** @internal */
  constructor(made: NativePool) {
    this.#native = made;
  }

  /** A running instance that never ran anything. */
  async take(): Promise<Instance> {
    return new Instance(await typed(() => this.#native.take()));
  }

  /** How many instances are ready now. */
  get ready(): number {
    return typedSync(() => this.#native.ready());
  }

  /** Why the last boot in the background failed, if the last one did. */
  get lastFailure(): string | undefined {
    return typedSync(() => this.#native.lastFailure()) ?? undefined;
  }

  /** Stops the pool and shuts down the instances still in it. */
  shutdown(): Promise<void> {
    return typed(() => this.#native.shutdown());
  }

  /** `shutdown()`, for `await using`. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.shutdown();
  }
}

/** Defines a sandbox; nothing boots until `boot()`. */
export function defineSandbox(options: SandboxOptions): Sandbox {
  const root = typeof options.rootfs === "string" ? roots.builtIn(options.rootfs) : options.rootfs;
  const spec = {
    cpus: options.resources?.cpus,
    memoryMib: options.resources?.memoryMiB,
    hostname: options.hostname,
    snapshots: options.snapshots,
    snapshotKeyDir: options.snapshotKeyDir,
  };
  const mounts = nativeMounts(options.mounts);
  return typedSync(() => new Sandbox(new native.NativeSandbox(root.native, spec, mounts, options.network?.native)));
}

function commandOptions(options: ExecOptions & { stdin?: boolean; size?: TerminalSize }): CommandOptions {
  return {
    cwd: options.cwd,
    env: options.env,
    timeoutMs: options.timeoutMs,
    stdin: options.stdin,
    rows: options.size?.rows,
    cols: options.size?.cols,
  };
}

function bytes(data: string | Uint8Array): Buffer {
  return typeof data === "string" ? Buffer.from(data) : Buffer.from(data.buffer, data.byteOffset, data.byteLength);
}

/**
 * A running sandbox: a microVM. `await using` shuts it down at the end of its scope (or call
 * `shutdown()`).
 */
export class Instance implements AsyncDisposable {
  readonly #native: NativeInstance;

  /** @internal */
  constructor(made: NativeInstance) {
    this.#native = made;
  }

  /** The agent tools over this instance (docs/tools.md), with their permissions. */
  tools(options: ToolboxOptions = {}): Toolbox {
    return new Toolbox(this.#native, options);
  }

  /** Runs `command` with `args` to its end and returns what it wrote. */
  async exec(command: string, args: readonly string[] = [], options: ExecOptions = {}): Promise<ExecResult> {
    const { signal } = options;
    if (signal?.aborted) throw new AbortError(undefined, signal.reason);
    const cancel = new native.NativeCancel();
    const abort = () => cancel.cancel();
    signal?.addEventListener("abort", abort, { once: true });
    try {
      const output = await typed(() => this.#native.exec([command, ...args], commandOptions(options), cancel));
      return {
        exitCode: output.exitCode,
        signal: output.signal ?? undefined,
        timedOut: output.timedOut,
        stdout: output.stdout.toString("utf8"),
        stderr: output.stderr.toString("utf8"),
        stdoutBytes: output.stdout,
        stderrBytes: output.stderr,
      };
    } catch (error) {
      if (error instanceof AbortError && signal?.aborted) throw new AbortError(error.message, signal.reason);
      throw error;
    } finally {
      signal?.removeEventListener("abort", abort);
    }
  }

  /** Starts `command` with `args`, its stdin, stdout and stderr streamed (returns at once). */
  spawn(command: string, args: readonly string[] = [], options: Omit<ExecOptions, "signal"> = {}): ChildProcess {
    const started = typed(() => this.#native.spawn([command, ...args], commandOptions({ ...options, stdin: true })));
    return new ChildProcess(started);
  }

  /** Starts `command` with `args` on a terminal of `size` (default 24 x 80) (returns at once). */
  pty(
    command: string,
    args: readonly string[] = [],
    options: Omit<ExecOptions, "signal"> & { size?: TerminalSize } = {},
  ): Terminal {
    const size = options.size ?? { rows: 24, cols: 80 };
    const started = typed(() => this.#native.spawn([command, ...args], commandOptions({ ...options, stdin: true, size })));
    return new Terminal(started);
  }

  /** The guest file at `path`, whole. */
  readFile(path: string): Promise<Uint8Array> {
    return typed(() => this.#native.readFile(path));
  }

  /** The guest file at `path` as UTF-8 text. */
  async readTextFile(path: string): Promise<string> {
    return Buffer.from(await this.readFile(path)).toString("utf8");
  }

  /** Writes `data` to the guest file `path`, replacing it; with `mode`, making its directories if `parents`. */
  writeFile(path: string, data: string | Uint8Array, options: { mode?: number; parents?: boolean } = {}): Promise<void> {
    return typed(() => this.#native.writeFile(path, bytes(data), options.mode, options.parents));
  }

  /** What is at `path` (symlinks followed). */
  stat(path: string): Promise<FileStat> {
    return typed(() => this.#native.stat(path));
  }

  /** The entries of the guest directory `path`. */
  listDir(path: string): Promise<DirEntry[]> {
    return typed(() => this.#native.listDir(path));
  }

  /** Removes the file or empty directory `path`; with `recursive`, everything under it. */
  remove(path: string, options: { recursive?: boolean } = {}): Promise<void> {
    return typed(() => this.#native.remove(path, options.recursive));
  }

  /** Renames `from` to `to`, replacing what is there. */
  rename(from: string, to: string): Promise<void> {
    return typed(() => this.#native.rename(from, to));
  }

  /** Makes the directory `path`, with its parents if asked. */
  makeDir(path: string, options: { parents?: boolean } = {}): Promise<void> {
    return typed(() => this.#native.makeDir(path, options.parents));
  }

  /** How the instance's VMM helper is confined: each layer in force or not, each canary blocked. */
  isolation(): IsolationReport {
    return camelCase(typedSync(() => this.#native.isolation())) as IsolationReport;
  }

  /** What the instance uses now: CPU time, memory, disk and network bytes, host descriptors. */
  metrics(): Metrics {
    return camelCase(typedSync(() => this.#native.metrics())) as Metrics;
  }

  /** The host's "address:port" where the published guest port `guestPort` is reachable. */
  publishedAddress(guestPort: number): string | undefined {
    return typedSync(() => this.#native.publishedAddress(guestPort)) ?? undefined;
  }

  /**
   * Stops the microVM's vCPUs and devices: it uses no CPU until `resume()`. Processes already
   * running go on after the resume; new commands and file operations throw `PausedError`
   * meanwhile.
   */
  pause(): Promise<void> {
    return typed(() => this.#native.pause());
  }

  /** Resumes a paused microVM where it stopped. */
  resume(): Promise<void> {
    return typed(() => this.#native.resume());
  }

  /**
   * Writes a snapshot of this running instance into the new directory `dir` (its sandbox
   * needs `snapshots: true`); the instance goes on afterwards.
   *
   * ```ts
   * const snapshot = await vm.snapshot("/var/tmp/ready");
   * await using twin = await sandbox.restore(snapshot);
   * ```
   */
  async snapshot(dir: string): Promise<Snapshot> {
    return new Snapshot(await typed(() => this.#native.snapshot(dir)));
  }

  /** Forks this instance into `n` new ones, each starting where this one is now. */
  async fork(n: number): Promise<Instance[]> {
    const forks = await typed(() => this.#native.fork(n));
    return forks.map((made) => new Instance(made));
  }

  /** The guest pids of a restored instance's processes not attached yet. */
  processes(): number[] {
    return typedSync(() => this.#native.processes());
  }

  /** Takes over process `pid` (its pid before the snapshot) of a restored instance. */
  attach(pid: number): ChildProcess | Terminal {
    const made: NativeProcess = typedSync(() => this.#native.attach(pid));
    return made.terminal ? new Terminal(Promise.resolve(made)) : new ChildProcess(Promise.resolve(made));
  }

  /** Whether the microVM is paused. */
  get paused(): boolean {
    return this.#native.isPaused();
  }

  /** Milliseconds of the host's own work in this boot before the VM started. */
  get hostBootWorkMs(): number {
    return this.#native.hostBootWorkMs();
  }

  /** Stops the microVM. Calls after it fail with `InstanceGoneError`. */
  shutdown(): Promise<void> {
    return typed(() => this.#native.shutdown());
  }

  /** `shutdown()`, for `await using`; an instance already gone is fine. */
  async [Symbol.asyncDispose](): Promise<void> {
    try {
      await this.shutdown();
    } catch (error) {
      if (!(error instanceof InstanceGoneError)) throw error;
    }
  }

  /** @internal For the bench comparing this API with Rust's on one instance. */
  get nativeInstance(): NativeInstance {
    return this.#native;
  }
}
