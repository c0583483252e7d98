// The user's callbacks (policy, middleware, block store) as the native side calls them:
// always a Promise, and what they throw or reject reported here (as a process warning,
// which `process.on("warning")` receives) before the native side turns it into the failure
// of that one flow, request or store call.

/** At most this many warnings a minute for one kind of callback; the rest are counted. */
const WARNINGS_A_MINUTE = 10;
const reported = new Map<string, { since: number; shown: number; held: number }>();

function warn(message: string): void {
  process.emitWarning(message, { type: "KrunboxCallbackWarning", code: "KRUNBOX_CALLBACK_FAILED" });
}

/**
 * Emits the warning for `error`, thrown by `what` (its kind: "the network policy", ...),
 * which costs `consequence`. A guest can make a callback fail once per flow or file call, so
 * each kind gets at most 10 warnings a minute; the next one says how many were held back.
 */
export function report(what: string, error: unknown, consequence: string, kind = what): void {
  const now = Date.now();
  let count = reported.get(kind);
  if (!count || now - count.since >= 60_000) {
    if (count && count.held > 0) warn(`${kind}: ${count.held} more failures in the last minute were not shown`);
    count = { since: now, shown: 0, held: 0 };
    reported.set(kind, count);
  }
  if (count.shown >= WARNINGS_A_MINUTE) {
    count.held += 1;
    return;
  }
  count.shown += 1;
  const text = error instanceof Error ? (error.stack ?? error.message) : String(error);
  warn(`${what} failed; ${consequence}: ${text}`);
}

/** `fn` made to always return a Promise, its failures reported. */
export function guarded<A, R>(
  what: string,
  consequence: string,
  fn: (argument: A) => R | PromiseLike<R>,
): (argument: A) => Promise<R> {
  return (argument: A) => {
    let result: Promise<R>;
    try {
      result = Promise.resolve(fn(argument));
    } catch (error) {
      result = Promise.reject(error);
    }
    return result.catch((error: unknown) => {
      report(what, error, consequence);
      throw error instanceof Error ? error : new Error(String(error));
    });
  };
}
