// Filesystems mounted into the guest: host-implemented, never a host path handed over.

import { constants } from "node:os";

import { report } from "./callback.js";
import { InvalidConfigError, typedSync } from "./errors.js";
import { native } from "./native.js";
import type { FsCall, FsReply, FsStat } from "../native/index.js";

type NativeFs = InstanceType<typeof native.NativeFs>;

/** A POSIX filesystem in this process's memory; its files can be read and written here too. */
export class MemoryFs {
  /** @internal */
  readonly native: NativeFs;

  /** @internal */
  constructor(made: NativeFs) {
    this.native = made;
  }

  /** Writes the file at `path` (its directories made as needed). */
  writeFile(path: string, data: string | Uint8Array): void {
    const bytes = typeof data === "string" ? Buffer.from(data) : Buffer.from(data.buffer, data.byteOffset, data.byteLength);
    typedSync(() => this.native.writeFile(path, bytes));
  }

  /** The file at `path`, whole. */
  readFile(path: string): Uint8Array {
    return typedSync(() => this.native.readFile(path));
  }

  /** The file at `path` as UTF-8 text. */
  readTextFile(path: string): string {
    return Buffer.from(this.readFile(path)).toString("utf8");
  }

  /** The names in the directory at `path`. */
  listDir(path: string): string[] {
    return typedSync(() => this.native.listDir(path));
  }
}

/** A directory of the host's, served so that the guest can never reach outside it. */
export class HostDir {
  /** @internal */
  readonly native: NativeFs;

  /** @internal */
  constructor(made: NativeFs) {
    this.native = made;
  }
}

/** What a path is, as a `VirtualFs` says. */
export interface VirtualFsStat {
  readonly kind: "file" | "dir" | "symlink";
  /** Bytes (default 0). */
  readonly size?: number;
  /** Permission bits (default 0o644, 0o755 for a directory). */
  readonly mode?: number;
  readonly uid?: number;
  readonly gid?: number;
  /** Last modification, in milliseconds since the epoch. */
  readonly mtimeMs?: number;
}

/**
 * A filesystem written in TypeScript, addressed by absolute paths ("/", "/notes/a.txt"), to
 * mount with `fs.virtual(...)`. `stat`, `listDir` and `read` are required; a method it does
 * not have is ENOSYS to the guest (mount it read-only to have writes refused with EROFS).
 *
 * To give the guest an error, throw one whose `code` is an errno name ("ENOENT", "EACCES",
 * "ENOTEMPTY", ...), as node:fs's own errors have: a `VirtualFs` over node:fs passes them on
 * as they are. Anything else thrown is EIO to the guest, and reported as a process warning.
 * Each method may return a value or a Promise; a slow one holds only its own guest call.
 */
export interface VirtualFs {
  stat(path: string): VirtualFsStat | Promise<VirtualFsStat>;
  /** The names in the directory (without "." and ".."). */
  listDir(path: string): Iterable<string> | Promise<Iterable<string>>;
  /** Up to `size` bytes from `offset` (fewer at the end). */
  read(path: string, offset: number, size: number): Uint8Array | Promise<Uint8Array>;
  /** Returns how many bytes it wrote (all of them when it returns nothing). */
  write?(path: string, offset: number, data: Uint8Array): number | void | Promise<number | void>;
  create?(path: string, mode: number): void | Promise<void>;
  makeDir?(path: string, mode: number): void | Promise<void>;
  remove?(path: string): void | Promise<void>;
  removeDir?(path: string): void | Promise<void>;
  /** Moves `from` and everything under it to `to`, replacing what is there. */
  rename?(from: string, to: string): void | Promise<void>;
  truncate?(path: string, size: number): void | Promise<void>;
  readLink?(path: string): string | Promise<string>;
}

const errnos = constants.errno as Record<string, number>;

/** The errno a thrown error names in its `code`, if it names one. */
function errnoOf(error: unknown): number | undefined {
  const code = (error as { code?: unknown } | null)?.code;
  return typeof code === "string" ? errnos[code] : undefined;
}

/** `filesystem` as the native side calls it: one function for every operation. */
function fsCalls(filesystem: VirtualFs): (call: FsCall) => Promise<FsReply> {
  const bytes = (data: Uint8Array) => Buffer.from(data.buffer, data.byteOffset, data.byteLength);
  const run = async (call: FsCall): Promise<FsReply> => {
    const path = call.path;
    switch (call.op) {
      case "stat": {
        const stat: VirtualFsStat = await filesystem.stat(path);
        return { stat: { ...stat } as FsStat };
      }
      case "listDir":
        return { names: [...(await filesystem.listDir(path))] };
      case "read":
        return { data: bytes(await filesystem.read(path, call.offset ?? 0, call.size ?? 0)) };
      case "write": {
        if (!filesystem.write) break;
        const wrote = await filesystem.write(path, call.offset ?? 0, call.data ?? Buffer.alloc(0));
        return { written: typeof wrote === "number" ? wrote : undefined };
      }
      case "create":
        if (!filesystem.create) break;
        await filesystem.create(path, call.mode ?? 0o644);
        return {};
      case "makeDir":
        if (!filesystem.makeDir) break;
        await filesystem.makeDir(path, call.mode ?? 0o755);
        return {};
      case "remove":
        if (!filesystem.remove) break;
        await filesystem.remove(path);
        return {};
      case "removeDir":
        if (!filesystem.removeDir) break;
        await filesystem.removeDir(path);
        return {};
      case "rename":
        if (!filesystem.rename) break;
        await filesystem.rename(path, call.to ?? "");
        return {};
      case "truncate":
        if (!filesystem.truncate) break;
        await filesystem.truncate(path, call.size ?? 0);
        return {};
      case "readLink":
        if (!filesystem.readLink) break;
        return { target: await filesystem.readLink(path) };
    }
    return { errno: errnos.ENOSYS };
  };
  return async (call: FsCall) => {
    try {
      return await run(call);
    } catch (error) {
      const errno = errnoOf(error);
      // An errno is the filesystem's answer, not a failure: passed on, not reported.
      if (errno !== undefined) return { errno };
      const what = `the VirtualFs's ${call.op}(${JSON.stringify(call.path)})`;
      report(what, error, "the guest's call fails with EIO", "the VirtualFs");
      throw error instanceof Error ? error : new Error(String(error));
    }
  };
}

// One native filesystem per object, so that its calls share one bound however often it is mounted.
const nativeFilesystems = new WeakMap<VirtualFs, NativeFs>();

function nativeFs(filesystem: VirtualFs): NativeFs {
  let made = nativeFilesystems.get(filesystem);
  if (!made) {
    for (const method of ["stat", "listDir", "read"] as const) {
      if (typeof filesystem[method] !== "function") {
        throw new InvalidConfigError(`a VirtualFs needs a ${method}() method`, "InvalidConfig");
      }
    }
    made = native.NativeFs.javascript(fsCalls(filesystem));
    nativeFilesystems.set(filesystem, made);
  }
  return made;
}

/** A filesystem as a mount: given in `mounts` of `defineSandbox` or `boot`. */
export interface Mount {
  /** @internal */
  readonly fs: NativeFs;
  readonly readOnly: boolean;
}

export const fs = {
  /** A memory filesystem holding `files` (path → contents). */
  memory(options: { files?: Record<string, string | Uint8Array> } = {}): MemoryFs {
    const made = new MemoryFs(native.NativeFs.memory());
    for (const [path, data] of Object.entries(options.files ?? {})) made.writeFile(path, data);
    return made;
  },

  /** The host directory `path`, read-only if asked. */
  hostDir(path: string, options: { readOnly?: boolean } = {}): HostDir {
    return typedSync(() => new HostDir(native.NativeFs.hostDir(path, options.readOnly ?? false)));
  },

  /**
   * `filesystem` as a mount, read-only if asked: a `MemoryFs`, a `HostDir`, or any object
   * with the `VirtualFs` methods.
   */
  virtual(filesystem: MemoryFs | HostDir | VirtualFs, options: { readOnly?: boolean } = {}): Mount {
    const made =
      filesystem instanceof MemoryFs || filesystem instanceof HostDir ? filesystem.native : nativeFs(filesystem);
    return { fs: made, readOnly: options.readOnly ?? false };
  },
};

/** `mounts` (guest path → mount) as the native side takes them. */
export function nativeMounts(mounts: Record<string, Mount> | undefined): InstanceType<typeof native.NativeMounts> {
  const made = new native.NativeMounts();
  for (const [path, mount] of Object.entries(mounts ?? {})) made.add(path, mount.fs, mount.readOnly);
  return made;
}
