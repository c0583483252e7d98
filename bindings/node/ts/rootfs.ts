// Root filesystems: a built-in or given image, and writable roots over one (ephemeral,
// persistent, copy-on-write over a block store, which may be written in TypeScript).

import { guarded } from "./callback.js";
import { InvalidConfigError, typedSync } from "./errors.js";
import { native } from "./native.js";
import type { StoreCall, StoreReply } from "../native/index.js";

/** A root filesystem definition, given to `defineSandbox`. */
export class Rootfs {
  /** @internal */
  readonly native: InstanceType<typeof native.NativeRootfs>;

  /** @internal */
  constructor(made: InstanceType<typeof native.NativeRootfs>) {
    this.native = made;
  }
}

/** What a store is attached to for one boot. */
export interface BlockStoreContext {
  /** The SHA-256 (lowercase hex) of the base image the layer lies over. */
  readonly base: string;
  /** The layer disk's size in bytes: block indexes are below `diskBytes / blockSize`. */
  readonly diskBytes: number;
}

/** Blocks `first` to `first + count - 1`. */
export interface BlockRange {
  readonly first: bigint;
  readonly count: number;
}

/** One block: its index and its `blockSize` bytes. */
export interface BlockChunk {
  readonly index: bigint;
  readonly data: Uint8Array;
}

/**
 * Storage for a copy-on-write root's layer, in blocks of `blockSize` bytes, written in
 * TypeScript. krunbox calls, for one boot: `attach` first (if given), `list`, then `read`s of
 * listed blocks and `write`s and `flush`es as the guest goes, `detach` last. A method that
 * throws or rejects fails that operation: the guest's I/O gets EIO (a failed `attach` fails
 * the boot). The `data` of written chunks is the store's to keep: krunbox never changes it.
 * Attach one store to one running sandbox at a time (krunbox refuses a second).
 */
export interface BlockStore {
  /** A power of two from 4096 to 1 MiB. */
  readonly blockSize: number;
  attach?(context: BlockStoreContext): Promise<void>;
  /** The indexes of the blocks it holds. */
  list(context: BlockStoreContext): Promise<Iterable<bigint>>;
  /** The blocks of `range` it holds (those it does not are zeros). */
  read(range: BlockRange, context: BlockStoreContext): Promise<readonly BlockChunk[]>;
  write(chunks: readonly BlockChunk[], context: BlockStoreContext): Promise<void>;
  /** Makes what was written durable. */
  flush?(context: BlockStoreContext): Promise<void>;
  detach?(context: BlockStoreContext): Promise<void>;
}

/** A store of the library's own: blocks never pass through JavaScript. */
export class NativeBlockStore {
  /** @internal */
  readonly native: InstanceType<typeof native.NativeStore>;

  /** @internal */
  constructor(made: InstanceType<typeof native.NativeStore>) {
    this.native = made;
  }
}

/** The blocks `range` asks for, in order, from what `read` gave: zeros for those it does not hold. */
function assemble(range: BlockRange, chunks: readonly BlockChunk[], blockSize: number): Buffer {
  const out = Buffer.alloc(range.count * blockSize);
  for (const chunk of chunks) {
    const at = chunk.index - range.first;
    if (at < 0n || at >= BigInt(range.count)) {
      throw new Error(`read() gave block ${chunk.index}, outside ${range.first} + ${range.count}`);
    }
    if (chunk.data.length !== blockSize) {
      throw new Error(`read() gave ${chunk.data.length} bytes for block ${chunk.index}, not ${blockSize}`);
    }
    out.set(chunk.data, Number(at) * blockSize);
  }
  return out;
}

/** `data` (blocks from `first` on) as one chunk a block. */
function split(first: bigint, data: Buffer, blockSize: number): BlockChunk[] {
  const chunks: BlockChunk[] = [];
  for (let at = 0; at < data.length; at += blockSize) {
    chunks.push({ index: first + BigInt(at / blockSize), data: data.subarray(at, at + blockSize) });
  }
  return chunks;
}

/** `store` as the native side calls it: one function for every operation. */
function storeCalls(store: BlockStore): (call: StoreCall) => Promise<StoreReply> {
  let context: BlockStoreContext = { base: "", diskBytes: 0 };
  const size = store.blockSize;
  return guarded("the block store", "the store operation fails (EIO in the guest)", async (call: StoreCall) => {
    switch (call.op) {
      case "attach":
        context = { base: call.base ?? "", diskBytes: call.diskBytes ?? 0 };
        await store.attach?.(context);
        return {};
      case "list":
        return { blocks: [...(await store.list(context))].map((index) => Number(index)) };
      case "read": {
        const range = { first: BigInt(call.first ?? 0), count: call.count ?? 0 };
        return { data: assemble(range, await store.read(range, context), size) };
      }
      case "write":
        await store.write(split(BigInt(call.first ?? 0), call.data ?? Buffer.alloc(0), size), context);
        return {};
      case "flush":
        await store.flush?.(context);
        return {};
      case "detach":
        await store.detach?.(context);
        return {};
      default:
        throw new Error(`unknown store operation ${call.op}`);
    }
  });
}

// One native store per store object, so that its in-use guard holds across sandboxes.
const nativeStores = new WeakMap<BlockStore, InstanceType<typeof native.NativeStore>>();

function nativeStore(store: BlockStore | NativeBlockStore): InstanceType<typeof native.NativeStore> {
  if (store instanceof NativeBlockStore) return store.native;
  let made = nativeStores.get(store);
  if (!made) {
    if (typeof store.list !== "function" || typeof store.read !== "function" || typeof store.write !== "function") {
      throw new InvalidConfigError("a block store needs list(), read() and write() methods", "InvalidConfig");
    }
    const size = store.blockSize;
    made = typedSync(() => native.NativeStore.javascript(size, storeCalls(store)));
    nativeStores.set(store, made);
  }
  return made;
}

const DEFAULT_EPHEMERAL_BYTES = 256 * 1024 * 1024;
const DEFAULT_DIRTY_BYTES = 64 * 1024 * 1024;

export const rootfs = {
  /** The built-in image `name` ("agent": Debian with python3, node, git, curl; "busybox"), read-only. */
  builtIn(name: "agent" | "busybox" | (string & {})): Rootfs {
    return typedSync(() => new Rootfs(native.NativeRootfs.builtin(name)));
  },

  /** The filesystem image at `path`, read-only, checked against its `sha256` at each boot. */
  image(options: { path: string; sha256: string; fstype?: string }): Rootfs {
    return new Rootfs(native.NativeRootfs.image(options.path, options.sha256, options.fstype ?? "ext4"));
  },

  /** `base` made writable; changes live in memory (at most `maxDirtyBytes`) and go with the instance. */
  ephemeral(options: { base: Rootfs; maxDirtyBytes?: number }): Rootfs {
    const bytes = options.maxDirtyBytes ?? DEFAULT_EPHEMERAL_BYTES;
    return typedSync(() => new Rootfs(native.NativeRootfs.ephemeral(options.base.native, bytes)));
  },

  /** `base` made writable; changes kept in the file at `path` across boots. */
  persistent(options: { base: Rootfs; path: string }): Rootfs {
    return new Rootfs(native.NativeRootfs.persistent(options.base.native, options.path));
  },

  /**
   * `base` made writable; changes kept in `writable` across boots, at most `maxDirtyBytes`
   * of them in memory before they are written there.
   */
  cow(options: { base: Rootfs; writable: BlockStore | NativeBlockStore; maxDirtyBytes?: number }): Rootfs {
    const bytes = options.maxDirtyBytes ?? DEFAULT_DIRTY_BYTES;
    const store = nativeStore(options.writable);
    return typedSync(() => new Rootfs(native.NativeRootfs.cow(options.base.native, store, bytes)));
  },

  /** The library's store keeping blocks as files in the directory `path`. */
  directoryStore(path: string): NativeBlockStore {
    return typedSync(() => new NativeBlockStore(native.NativeStore.directory(path)));
  },

  /** The library's store keeping blocks in this process's memory. */
  memoryStore(): NativeBlockStore {
    return new NativeBlockStore(native.NativeStore.memory());
  },
};
