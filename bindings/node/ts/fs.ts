// Filesystems mounted into the guest: host-implemented, never a host path handed over.

import { InvalidConfigError, typedSync } from "./errors.js";
import { native } from "./native.js";

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

  /** `filesystem` as a mount, read-only if asked. */
  virtual(filesystem: MemoryFs | HostDir, options: { readOnly?: boolean } = {}): Mount {
    if (!(filesystem instanceof MemoryFs) && !(filesystem instanceof HostDir)) {
      throw new InvalidConfigError(
        "fs.virtual() takes a MemoryFs (fs.memory()) or a HostDir (fs.hostDir()); a filesystem " +
          "written in JavaScript is not supported yet",
        "InvalidConfig",
      );
    }
    return { fs: filesystem.native, readOnly: options.readOnly ?? false };
  },
};

/** `mounts` (guest path → mount) as the native side takes them. */
export function nativeMounts(mounts: Record<string, Mount> | undefined): InstanceType<typeof native.NativeMounts> {
  const made = new native.NativeMounts();
  for (const [path, mount] of Object.entries(mounts ?? {})) made.add(path, mount.fs, mount.readOnly);
  return made;
}
