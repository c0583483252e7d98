// An agent tool: run model-written Python in a microVM that can reach one API, with a token
// the guest never holds.
//
// An agent framework registers `runPython` as a tool; the model writes code, the tool runs it
// in a fresh sandbox and returns what it printed. The sandbox's network answers DNS for the
// API's host only and sends its HTTPS requests through middleware that adds the token on the
// host: the code (and anything it installs or is tricked into running) can use the API but
// cannot read, print or send the token anywhere. Every other flow is denied.
//
// Here the model is replaced by a fixed script. Run it against GitHub's API (after
// `scripts/node.sh build`, from bindings/node):
//
//     GITHUB_TOKEN=ghp_... node build/examples/node/agent_tool.js
//
// AGENT_API_HOST and AGENT_API_PORT name another API; AGENT_API_ADDRESS answers its DNS with
// a fixed address and AGENT_API_CA (a PEM file) is the CA its certificate is checked against
// (the package's tests point these at a server on loopback).

import { readFileSync } from "node:fs";

import { defineSandbox, network, type Sandbox } from "krunbox";

const API_HOST = process.env.AGENT_API_HOST ?? "api.github.com";
const API_PORT = Number(process.env.AGENT_API_PORT ?? "443");

// What the model wrote: it calls the API without any credential of its own.
const MODEL_CODE = `
import json, urllib.request
with urllib.request.urlopen("https://${API_HOST}:${API_PORT}/user", timeout=30) as response:
    print("logged in as", json.load(response)["login"])
`;

/** A sandbox whose only way out is API_HOST, its requests carrying `token`. */
export function apiSandbox(token: string): Sandbox {
  const address = process.env.AGENT_API_ADDRESS;
  const caFile = process.env.AGENT_API_CA;
  return defineSandbox({
    rootfs: "agent",
    resources: { memoryMiB: 512 },
    network: network.policy(
      (conn) => {
        if (conn.hostname !== API_HOST) return;
        if (conn.matchDns()?.accept(address ? { addresses: [address] } : {})) return;
        if (conn.dst.port !== API_PORT) return;
        conn.matchHttp(API_HOST)?.accept((request) => {
          request.headers.set("authorization", `Bearer ${token}`);
        });
      },
      { upstreamCa: caFile ? readFileSync(caFile, "utf8") : undefined },
    ),
  });
}

/**
 * The tool: runs `code` with python3 in a fresh instance of `sandbox` and returns what it
 * printed (stderr too, and the exit code when it failed), for the model to read.
 */
export async function runPython(sandbox: Sandbox, code: string, timeoutMs = 60_000): Promise<string> {
  await using lane = await sandbox.boot();
  const done = await lane.exec("python3", ["-c", code], { timeoutMs });
  let report = done.stdout + done.stderr;
  if (done.exitCode !== 0) report += `\n(exit code ${done.exitCode})`;
  return report;
}

async function main(): Promise<void> {
  const token = process.env.GITHUB_TOKEN;
  if (!token) throw new Error("set GITHUB_TOKEN (the token the sandbox's requests carry)");
  process.stdout.write(await runPython(apiSandbox(token), MODEL_CODE));
}

if (require.main === module) {
  main().catch((error: unknown) => {
    console.error(error);
    process.exitCode = 1;
  });
}
