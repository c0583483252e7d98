/**
 * krunbox: run untrusted commands inside libkrun microVMs, from Node.js.
 *
 * ```ts
 * import { defineSandbox, fs } from "krunbox";
 *
 * const sandbox = defineSandbox({ rootfs: "agent", resources: { cpus: 1, memoryMiB: 512 } });
 * await using lane = await sandbox.boot({
 *   mounts: { "/workspace": fs.virtual(fs.memory({ files: { "/hello.txt": "hi\n" } })) },
 *   cwd: "/workspace",
 * });
 * const result = await lane.exec("cat", ["hello.txt"]);
 * ```
 *
 * @packageDocumentation
 */

export { defineSandbox, Sandbox, Instance, Pool, Snapshot } from "./sandbox.js";
import type { Instance } from "./sandbox.js";
export type { SandboxOptions, BootOptions, ExecOptions, ExecResult, FileStat, DirEntry } from "./sandbox.js";
export { ChildProcess, Terminal } from "./process.js";
export { Toolbox, ToolResult, toolDefinitions } from "./tools.js";
export type { ToolFormat, ToolboxOptions, Permissions, Rule, Approver, ApprovalRequest, AuditEvent } from "./tools.js";
export type { IsolationReport, IsolationLayer, CanaryReport, Metrics, NetworkMetrics } from "./observe.js";
export type { Exit, TerminalSize } from "./process.js";
export { fs, MemoryFs, HostDir } from "./fs.js";
export type { Mount, VirtualFs, VirtualFsStat } from "./fs.js";
export { rootfs, Rootfs, NativeBlockStore } from "./rootfs.js";
export type { BlockStore, BlockStoreContext, BlockRange, BlockChunk } from "./rootfs.js";
export { network, Network, Connection, Endpoint } from "./network.js";
export type {
  Policy,
  Middleware,
  Request,
  DnsMatch,
  HttpMatch,
  TransportMatch,
  Secret,
  NetworkOptions,
} from "./network.js";
export {
  KrunboxError,
  InvalidConfigError,
  MissingArtifactError,
  IsolationUnavailableError,
  IsolationBreachedError,
  ImageDigestMismatchError,
  BootFailedError,
  ExecFailedError,
  RequestTimeoutError,
  GuestHungError,
  TooManyError,
  PausedError,
  InstanceGoneError,
  OutputLimitExceededError,
  GuestFsError,
  StoreError,
  RootInUseError,
  SnapshotFailedError,
  SnapshotTamperedError,
  ImageError,
  AbortError,
} from "./errors.js";

import { native } from "./native.js";

/** The exit code of a command its timeout ended (124, as coreutils' `timeout` has it). */
export const TIMEOUT_EXIT_CODE: number = native.TIMEOUT_EXIT_CODE;
/** The most bytes `exec` collects of each of stdout and stderr. */
export const MAX_OUTPUT: number = native.MAX_OUTPUT;

/**
 * @internal For the package's bench: seconds the Rust API takes to run `args` on `instance`,
 * checked to exit 0 with `stdoutBytes` of stdout.
 */
export function _rustExecSeconds(instance: Instance, args: string[], stdoutBytes: number): Promise<number> {
  return native.rustExecSeconds(instance.nativeInstance, args, stdoutBytes);
}
