// `krunbox mcp --http` (the CLI's MCP server) driven by the official MCP TypeScript SDK
// (@modelcontextprotocol/sdk from npm) over streamable HTTP on loopback: list the tools, run
// `bash` in the session's microVM, write then edit then read a file, grep, an `ask` rule
// refused through elicitation, a `deny` rule; ending the session stops its VM while the server
// runs on. Here rather than under cli/ because it shares this package's node_modules and tsc.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { ElicitRequestSchema } from "@modelcontextprotocol/sdk/types.js";

const REPO = join(__dirname, "..", "..", "..", "..");
const CLI = process.env.KRUNBOX_CLI ?? join(REPO, "target", "debug", "krunbox");

/** The pids of `krunbox-vmm` processes descending from `root`. */
function helpersBelow(root: number): Set<number> {
  const parent = new Map<number, number>();
  const name = new Map<number, string>();
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry)) continue;
    let stat: string;
    try {
      stat = readFileSync(`/proc/${entry}/stat`, "utf8");
    } catch {
      continue;
    }
    // "pid (comm) state ppid ...": comm may hold spaces, not ')'.
    const close = stat.lastIndexOf(")");
    name.set(Number(entry), stat.slice(stat.indexOf("(") + 1, close));
    parent.set(Number(entry), Number(stat.slice(close + 2).split(" ")[1]));
  }
  const descends = (pid: number): boolean => {
    for (let p = parent.get(pid) ?? 0; p > 1; p = parent.get(p) ?? 0) {
      if (p === root) return true;
    }
    return false;
  };
  return new Set([...name].filter(([pid, comm]) => comm.startsWith("krunbox-vmm") && descends(pid)).map(([pid]) => pid));
}

function text(result: Awaited<ReturnType<Client["callTool"]>>): string {
  const content = result.content as Array<{ type: string; text?: string }>;
  return content.map((block) => (block.type === "text" ? block.text : "")).join("");
}

test("an MCP client over streamable HTTP uses the tools, and ending its session stops the VM", async () => {
  const server = spawn(
    CLI,
    ["mcp", "--http", "127.0.0.1:0", "--image", "busybox", "--memory", "256", "--memfs", "/workspace",
      "--rule", "deny bash(rm:*)", "--rule", "ask bash(wget:*)"],
    { stdio: ["ignore", "inherit", "pipe"] },
  );
  const serverPid = server.pid!;
  try {
    // "krunbox: MCP on http://127.0.0.1:PORT/mcp" on stderr says where.
    const url = await new Promise<string>((resolve, reject) => {
      let seen = "";
      server.stderr!.on("data", (chunk: Buffer) => {
        seen += chunk.toString();
        const found = /MCP on (http:\/\/\S+)/.exec(seen);
        if (found) resolve(found[1]);
      });
      server.on("exit", (code) => reject(new Error(`the server exited (${code}): ${seen}`)));
    });
    server.stderr!.resume();

    const asked: string[] = [];
    const client = new Client({ name: "krunbox-test", version: "1.0.0" }, { capabilities: { elicitation: {} } });
    client.setRequestHandler(ElicitRequestSchema, async (request) => {
      asked.push(request.params.message);
      return { action: "decline" };
    });
    const transport = new StreamableHTTPClientTransport(new URL(url));
    await client.connect(transport);

    const { tools } = await client.listTools();
    assert.deepEqual(tools.map((t) => t.name).sort(), ["bash", "edit", "glob", "grep", "ls", "process", "read", "write"]);

    const ran = await client.callTool({ name: "bash", arguments: { command: "uname -s; pwd" } });
    assert.equal(text(ran), "exit code 0\nLinux\n/workspace\n");
    assert.ok(!ran.isError);

    const wrote = await client.callTool({ name: "write", arguments: { path: "todo.txt", content: "one\ntwo\n" } });
    assert.ok(!wrote.isError, text(wrote));
    const edited = await client.callTool({
      name: "edit",
      arguments: { path: "todo.txt", edits: [{ old_string: "two", new_string: "three" }] },
    });
    assert.ok(!edited.isError, text(edited));
    const read = await client.callTool({ name: "read", arguments: { path: "/workspace/todo.txt" } });
    assert.equal(text(read), "     1\tone\n     2\tthree\n");
    const found = await client.callTool({ name: "grep", arguments: { pattern: "^th" } });
    assert.equal(text(found), "/workspace/todo.txt:2:three\n");

    const refused = await client.callTool({ name: "bash", arguments: { command: "wget -q -O- http://127.0.0.1:9/" } });
    assert.ok(refused.isError);
    assert.match(text(refused), /was refused/);
    assert.equal(asked.length, 1);
    assert.match(asked[0], /wget/);
    const denied = await client.callTool({ name: "bash", arguments: { command: "rm /workspace/todo.txt" } });
    assert.ok(denied.isError);
    assert.match(text(denied), /permission denied/);

    const helpers = helpersBelow(serverPid);
    assert.equal(helpers.size, 1, `one sandbox for the session: ${[...helpers]}`);
    await transport.terminateSession();
    await client.close();
    // The session is over: its VM's helper goes, and the server runs on.
    const deadline = Date.now() + 60_000;
    while ([...helpers].some((pid) => helpersBelow(serverPid).has(pid))) {
      assert.ok(Date.now() < deadline, "the helper outlived its session");
      await new Promise((r) => setTimeout(r, 200));
    }
    assert.equal(server.exitCode, null, "the server still runs");
  } finally {
    server.kill("SIGTERM");
  }
});
