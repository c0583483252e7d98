// The agent tools over an instance (the crate's `krunbox::tools`): what a model calls,
// ready-made. `instance.tools(options)` makes a `Toolbox`; `toolDefinitions(format)` gives the
// schemas without one.

import { guarded } from "./callback.js";
import { native } from "./native.js";
import type { NativeInstance, NativeToolbox, NativeToolResult } from "../native/index.js";

/** What the model API takes: an MCP tool, an OpenAI function tool, an Anthropic tool. */
export type ToolFormat = "mcp" | "openai" | "anthropic";

/** One call an `ask` rule holds until the approver answers. */
export interface ApprovalRequest {
  /** The tool: "bash", "write", ... */
  tool: string;
  /** The call's arguments, as the model sent them. */
  arguments: Record<string, unknown>;
  /** The rule that asks, e.g. "ask bash(curl:*)". */
  rule: string;
}

/**
 * Answers `ask` rules: `true` runs the call; `false` or a reason (shown to the model) refuses
 * it. One that throws, rejects or takes longer than 5 minutes refuses.
 */
export type Approver = (request: ApprovalRequest) => boolean | string | PromiseLike<boolean | string>;

/** A rule: `{ allow: "read" }`, `{ ask: "bash(curl:*)" }`, `{ deny: "write(/etc/**)" }`. */
export type Rule = { allow: string } | { ask: string } | { deny: string };

/** The rules, checked in order (the first match decides), then the mode. */
export interface Permissions {
  mode?: "read-only" | "workspace-write" | "full-access";
  rules?: Rule[];
}

export interface ToolboxOptions {
  /** Where relative paths start, `bash` runs, and `workspace-write` may write (default "/"). */
  workspace?: string;
  permissions?: Permissions;
  approver?: Approver;
  /** Bytes of text one result shows at most (default 30,000). */
  outputCap?: number;
}

/** One permission decision. */
export interface AuditEvent {
  tool: string;
  /** The command line or the absolute path the call acts on. */
  subject: string;
  decision: "allowed" | "denied" | "approved" | "refused";
  /** The rule (`deny bash(curl:*)`) or the mode (`mode read-only`) that decided. */
  by: string;
  reason: string | null;
  /** Seconds since the epoch. */
  at: number;
}

/** What a call returned: `text` for the model, `isError` when it should change course. */
export class ToolResult {
  readonly #native: NativeToolResult;

  /** @internal */
  constructor(made: NativeToolResult) {
    this.#native = made;
  }

  get text(): string {
    return this.#native.text;
  }

  get isError(): boolean {
    return this.#native.isError;
  }

  /** An MCP `CallToolResult`. */
  toMcp(): Record<string, unknown> {
    return this.#native.toMcp() as Record<string, unknown>;
  }

  /** An OpenAI tool message answering `callId`. */
  toOpenAI(callId: string): Record<string, unknown> {
    return this.#native.toOpenai(callId) as Record<string, unknown>;
  }

  /** An Anthropic `tool_result` block answering `toolUseId`. */
  toAnthropic(toolUseId: string): Record<string, unknown> {
    return this.#native.toAnthropic(toolUseId) as Record<string, unknown>;
  }
}

/**
 * The tools over one instance: `bash`, `process`, `read`, `write`, `edit`, `ls`, `glob`,
 * `grep` (docs/tools.md), with permissions checked before every call.
 *
 * ```ts
 * const tools = lane.tools({
 *   workspace: "/workspace",
 *   permissions: { mode: "workspace-write", rules: [{ ask: "bash(curl:*)" }] },
 *   approver: async (request) => (await askTheUser(request)) || "the user said no",
 * });
 * const schemas = tools.definitions("anthropic");
 * const result = await tools.call("grep", { pattern: "TODO", glob: "*.ts" });
 * ```
 */
export class Toolbox {
  readonly #native: NativeToolbox;

  /** @internal */
  constructor(instance: NativeInstance, options: ToolboxOptions = {}) {
    const { approver } = options;
    const asked = approver
      ? guarded("the tools' approver", "the call was refused", async (request: ApprovalRequest) => {
          const answer = await approver(request);
          return typeof answer === "string" ? { approve: false, reason: answer } : { approve: answer === true };
        })
      : undefined;
    this.#native = new native.NativeToolbox(
      instance,
      { workspace: options.workspace, permissions: options.permissions, outputCap: options.outputCap },
      asked as ((request: { tool: string; arguments: unknown; rule: string }) => Promise<{ approve: boolean; reason?: string }>) | undefined,
    );
  }

  /** The tools' definitions in `format` (default "mcp"). */
  definitions(format: ToolFormat = "mcp"): Record<string, unknown>[] {
    return this.#native.definitions(format) as Record<string, unknown>[];
  }

  /**
   * Runs a model's call by name with its arguments. Never rejects for what the model sent:
   * bad arguments, refused permissions and failed commands are results with `isError`.
   */
  async call(name: string, args: Record<string, unknown> = {}): Promise<ToolResult> {
    return new ToolResult(await this.#native.call(name, args));
  }

  /** Every permission decision from now on (subscribed at this call, not at the first read). */
  auditEvents(): AsyncGenerator<AuditEvent> {
    const events = this.#native.auditEvents();
    return (async function* () {
      for (;;) {
        const event = (await events.next()) as AuditEvent | null;
        if (event === null) return;
        yield event;
      }
    })();
  }
}

/** Every tool's definition in `format`, no instance needed. */
export function toolDefinitions(format: ToolFormat = "mcp"): Record<string, unknown>[] {
  return native.toolDefinitions(format) as Record<string, unknown>[];
}
