// The user's callbacks (policy, middleware, block store) as the native side calls them:
// always a Promise, and what they throw or reject reported here (as a process warning,
// which `process.on("warning")` receives) before the native side turns it into the failure
// of that one flow, request or store call.

/** Emits the warning for `error`, thrown by `what`, which costs `consequence`. */
export function report(what: string, error: unknown, consequence: string): void {
  const text = error instanceof Error ? (error.stack ?? error.message) : String(error);
  process.emitWarning(`${what} failed; ${consequence}: ${text}`, {
    type: "KrunboxCallbackWarning",
    code: "KRUNBOX_CALLBACK_FAILED",
  });
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
