// examples/node/agent_tool.ts, run as a user runs it, against an API of this test's on
// loopback: the model's code reaches it and the token is on the request, never in the guest.

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { promisify } from "node:util";

import { startOrigin } from "./helpers.js";

// The compiled example, beside this compiled test (build/examples/node/, build/bindings/node/tests/).
const EXAMPLE = join(__dirname, "..", "..", "..", "examples", "node", "agent_tool.js");

test("the agent tool example reaches one API with a host-held token", async () => {
  const origin = await startOrigin(["api.test"], {
    answer: () => ({ status: 200, type: "application/json", body: '{"login": "octocat"}\n' }),
  });
  try {
    const ca = join(mkdtempSync(join(tmpdir(), "krunbox-example-")), "ca.pem");
    writeFileSync(ca, origin.ca);
    const env = {
      ...process.env,
      GITHUB_TOKEN: "ghp_host_held",
      AGENT_API_HOST: "api.test",
      AGENT_API_PORT: String(origin.port),
      AGENT_API_ADDRESS: "127.0.0.1",
      AGENT_API_CA: ca,
    };
    const done = await promisify(execFile)(process.execPath, [EXAMPLE], { env, timeout: 300_000 });
    assert.equal(done.stdout, "logged in as octocat\n");
    assert.deepEqual(origin.seen.map((r) => r.headers.authorization), ["Bearer ghp_host_held"]);
  } finally {
    await origin.close();
  }
});
