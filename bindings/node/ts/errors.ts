// Errors: one `KrunboxError` subclass per kind of failure a caller acts on differently, each
// with the library's one-line message and a stable `code`, the Rust variant's name
// (`krunbox::Error::code`).

/** Anything krunbox reports; its message says what happened and what to do. */
export class KrunboxError extends Error {
  /** The Rust library's variant: "InvalidConfig", "BootTimeout", "Cancelled", ... */
  readonly code: string;

  constructor(message: string, code: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
    this.code = code;
  }
}

/** A definition or argument krunbox refuses. */
export class InvalidConfigError extends KrunboxError {}
/** A part krunbox needs (helper, guest-init, kernel) was not found: run `krunbox setup`. */
export class MissingArtifactError extends KrunboxError {}
/** This host cannot confine the VMM helper as asked. */
export class IsolationUnavailableError extends KrunboxError {}
/**
 * The helper's jail did not hold: a canary reached what it must not (a host file, host
 * loopback, a denied system call), and the VM was not started.
 */
export class IsolationBreachedError extends KrunboxError {}
/** A root image's bytes are not the ones its digest names. */
export class ImageDigestMismatchError extends KrunboxError {}
/** The VM did not come up (its VMM exited, it timed out, or its setup failed). */
export class BootFailedError extends KrunboxError {}
/** The guest could not start the program (not found, not executable, ...). */
export class ExecFailedError extends KrunboxError {}
/** The guest did not answer one request in time; the instance stays usable. */
export class RequestTimeoutError extends KrunboxError {}
/** The guest stopped answering; the instance is gone. */
export class GuestHungError extends KrunboxError {}
/** An instance's cap (running processes, waiting requests) is reached. */
export class TooManyError extends KrunboxError {}
/** The instance is paused: resume it before starting commands or file operations. */
export class PausedError extends KrunboxError {}
/** The instance was shut down or its VM ended. */
export class InstanceGoneError extends KrunboxError {}
/** A command wrote more output than `exec` collects. */
export class OutputLimitExceededError extends KrunboxError {}
/** A file operation in the guest failed. */
export class GuestFsError extends KrunboxError {}
/** A block store failed. */
export class StoreError extends KrunboxError {}
/** A persistent root or store is in use by another sandbox. */
export class RootInUseError extends KrunboxError {}
/** A snapshot could not be taken or restored; the instance runs as before. */
export class SnapshotFailedError extends KrunboxError {}
/** A snapshot's manifest or a part of it changed after it was written; nothing of it was used. */
export class SnapshotTamperedError extends KrunboxError {}
/** The root image could not be read, built, pulled or laid out. */
export class ImageError extends KrunboxError {}

/**
 * A command stopped through its `AbortSignal` (its process group killed); `code` is
 * "Cancelled" and `cause` the signal's reason. Named "AbortError", as Node's own APIs name
 * theirs.
 */
export class AbortError extends KrunboxError {
  constructor(message = "the command was aborted; its process group was killed", cause?: unknown) {
    super(message, "Cancelled", { cause });
    this.name = "AbortError";
  }
}

type ErrorClass = new (message: string, code: string, options?: { cause?: unknown }) => KrunboxError;

const byCode: Record<string, ErrorClass> = {
  InvalidConfig: InvalidConfigError,
  MissingArtifact: MissingArtifactError,
  IsolationUnavailable: IsolationUnavailableError,
  IsolationBreached: IsolationBreachedError,
  ImageDigestMismatch: ImageDigestMismatchError,
  ImageBuild: ImageError,
  ImageArchive: ImageError,
  Registry: ImageError,
  BuildStep: ImageError,
  WritableLayer: ImageError,
  RootLayer: ImageError,
  RootBaseMismatch: StoreError,
  BlockStore: StoreError,
  RootInUse: RootInUseError,
  Snapshot: SnapshotFailedError,
  SnapshotTampered: SnapshotTamperedError,
  VmmSpawn: BootFailedError,
  VmExited: BootFailedError,
  BootTimeout: BootFailedError,
  GuestSetup: BootFailedError,
  NetworkSetup: BootFailedError,
  Exec: ExecFailedError,
  RequestTimeout: RequestTimeoutError,
  GuestHung: GuestHungError,
  GuestUnresponsive: GuestHungError,
  TooMany: TooManyError,
  Paused: PausedError,
  InstanceGone: InstanceGoneError,
  OutputLimitExceeded: OutputLimitExceededError,
  Fs: GuestFsError,
};

const coded = /^\[krunbox:(\w+)\] ([\s\S]*)$/;

/** The typed error for what the native addon threw (its message `[krunbox:Code] text`). */
export function translate(error: unknown): unknown {
  if (!(error instanceof Error)) return error;
  const match = coded.exec(error.message);
  if (!match) return error;
  const [, code, message] = match as unknown as [string, string, string];
  if (code === "Cancelled") return new AbortError(message);
  const Class = byCode[code] ?? KrunboxError;
  return new Class(message, code);
}

/** Runs `call` (a native call), its errors typed. */
export async function typed<T>(call: () => Promise<T>): Promise<T> {
  try {
    return await call();
  } catch (error) {
    throw translate(error);
  }
}

/** Runs `call` (a synchronous native call), its errors typed. */
export function typedSync<T>(call: () => T): T {
  try {
    return call();
  } catch (error) {
    throw translate(error);
  }
}
