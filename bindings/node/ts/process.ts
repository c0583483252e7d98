// Commands started in a sandbox and streamed while they run: `ChildProcess` (pipes) and
// `Terminal` (a pty), their streams web streams.

import { ReadableStream, WritableStream } from "node:stream/web";

import { typed, typedSync } from "./errors.js";
import type { NativeProcess, ProcessExit } from "../native/index.js";

/** How a process ended. */
export interface Exit {
  /** Its exit code; 128 + N when signal N ended it; 124 when its timeout did. */
  readonly exitCode: number;
  /** The signal that ended it, if one did. */
  readonly signal?: number;
  /** Whether its timeout ended it. */
  readonly timedOut: boolean;
}

/** The most bytes one chunk of a stream holds. */
const CHUNK = 64 * 1024;

function exit(ended: ProcessExit): Exit {
  return { exitCode: ended.exitCode, signal: ended.signal ?? undefined, timedOut: ended.timedOut };
}

/** A promise whose rejection is not "unhandled" when nobody looks at it (it is still thrown to whoever awaits it). */
function observed<T>(promise: Promise<T>): Promise<T> {
  promise.catch(() => {});
  return promise;
}

/**
 * A stream of what `read` gives, ending at its first empty chunk. Cancelled (a `break` out of
 * `for await`), it goes on reading and discarding, so that the process never blocks on a full
 * pipe nobody reads and its `exit` still comes.
 */
function readable(started: Promise<NativeProcess>, read: (p: NativeProcess) => Promise<Buffer>): ReadableStream<Uint8Array> {
  const drain = async () => {
    const process = await started;
    while ((await read(process)).length > 0);
  };
  return new ReadableStream<Uint8Array>(
    {
      async pull(controller) {
        const chunk = await typed(async () => read(await started));
        if (chunk.length === 0) controller.close();
        else controller.enqueue(new Uint8Array(chunk.buffer, chunk.byteOffset, chunk.length));
      },
      cancel() {
        drain().catch(() => {});
      },
    },
    { highWaterMark: 0 },
  );
}

/** A stream writing to the process's stdin; closing it closes stdin. */
function writable(started: Promise<NativeProcess>): WritableStream<Uint8Array> {
  const close = async () => (await started).closeStdin();
  return new WritableStream<Uint8Array>({
    async write(chunk) {
      const data = Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength);
      await typed(async () => (await started).writeStdin(data));
    },
    close: () => typed(close),
    abort: () => typed(close),
  });
}

/** What a spawned process and a terminal share: its start, its end, and killing it. */
abstract class Started {
  /** Resolves once the guest runs it; rejects if it could not start (e.g. `ExecFailedError`). */
  readonly ready: Promise<void>;
  /** Resolves when it ends; output not read yet stays readable. */
  readonly exit: Promise<Exit>;
  /** Its process id in the guest. */
  readonly pid: Promise<number>;
  /** @internal Its methods wait for it to have started. */
  protected readonly started: Promise<NativeProcess>;

  /** @internal */
  constructor(started: Promise<NativeProcess>) {
    this.started = observed(typed(() => started));
    this.ready = observed(this.started.then(() => undefined));
    this.pid = observed(this.started.then((p) => p.pid));
    this.exit = observed(typed(async () => exit(await (await this.started).wait())));
  }

  /** Kills its process group (SIGKILL). */
  async kill(): Promise<void> {
    (await this.started).kill();
  }
}

/** A process started by `Instance.spawn`. Its methods wait for it to have started. */
export class ChildProcess extends Started {
  readonly stdin: WritableStream<Uint8Array>;
  readonly stdout: ReadableStream<Uint8Array>;
  readonly stderr: ReadableStream<Uint8Array>;

  /** @internal */
  constructor(started: Promise<NativeProcess>) {
    super(started);
    this.stdin = writable(this.started);
    this.stdout = readable(this.started, (p) => p.readStdout(CHUNK));
    this.stderr = readable(this.started, (p) => p.readStderr(CHUNK));
  }

  /** Sends `signal` (a number: 15 is SIGTERM) to its process group. */
  async signal(signal: number): Promise<void> {
    const started = await this.started;
    typedSync(() => started.signal(signal));
  }
}

/** The size of a terminal. */
export interface TerminalSize {
  readonly rows: number;
  readonly cols: number;
}

/** A process started by `Instance.pty` on a terminal of its own. */
export class Terminal extends Started {
  /** What is typed at the terminal. */
  readonly input: WritableStream<Uint8Array>;
  /** What the terminal shows. */
  readonly output: ReadableStream<Uint8Array>;

  /** @internal */
  constructor(started: Promise<NativeProcess>) {
    super(started);
    this.input = writable(this.started);
    this.output = readable(this.started, (p) => p.readStdout(CHUNK));
  }

  /** Changes the terminal's size; its foreground process group gets SIGWINCH. */
  async resize(size: TerminalSize): Promise<void> {
    const started = await this.started;
    typedSync(() => started.resize(size.rows, size.cols));
  }
}
