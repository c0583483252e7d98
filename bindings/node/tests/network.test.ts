// The network from TypeScript, in a real microVM: a policy written in TypeScript grants one
// domain, async middleware adds a credential that an HTTPS origin on loopback receives (the
// guest never holds it), a secret reaches the origin while the guest holds a placeholder,
// and callbacks that throw cost only their own flow or request.

import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";

import { defineSandbox, network } from "krunbox";

import { startOrigin } from "./helpers.js";

test("a TypeScript policy and async middleware hold the credential on the host", async () => {
  const origin = await startOrigin(["api.test", "other.test"]);
  const token = `tok-${randomBytes(8).toString("hex")}`;
  const secretValue = `real-${randomBytes(8).toString("hex")}`;
  const asked: string[] = [];
  const warnings: string[] = [];
  const warned = (warning: Error) => warnings.push(warning.message);
  process.on("warning", warned);
  try {
    const sandbox = defineSandbox({
      rootfs: "agent",
      resources: { cpus: 1, memoryMiB: 512 },
      network: network.policy(
        async (conn) => {
          asked.push(`${conn.protocol} ${conn.hostname}`);
          const dns = conn.matchDns();
          if (dns) {
            if (dns.name === "boom.test") throw new Error("policy bug");
            if (dns.name === "api.test" || dns.name === "other.test") dns.accept({ addresses: ["127.0.0.1"] });
            return;
          }
          await sleep(5); // as a policy service would
          conn.matchHttp("api.test")?.accept(async (request) => {
            await sleep(5); // as a token service would
            if (request.path === "/throw") throw new Error("middleware bug");
            if (request.path === "/refuse") return new Response("not this path\n", { status: 403 });
            if (request.path !== "/with-secret") request.headers.set("authorization", `Bearer ${token}`);
          });
        },
        {
          upstreamCa: origin.ca,
          secrets: [{ name: "API_KEY", value: secretValue, hosts: ["api.test"] }],
        },
      ),
    });
    await using lane = await sandbox.boot();
    const curl = (url: string) =>
      lane.exec("curl", ["-sS", "-m", "20", "-o", "/dev/null", "-w", "%{http_code}", url], { timeoutMs: 60_000 });

    const got = await lane.exec("curl", ["-fsS", "-m", "20", `https://api.test:${origin.port}/hello`], {
      timeoutMs: 60_000,
    });
    assert.deepEqual([got.exitCode, got.stdout, got.stderr], [0, "hello from the origin\n", ""]);
    assert.equal(origin.seen.at(-1)?.headers.authorization, `Bearer ${token}`);

    // The guest holds the secret's placeholder; the origin gets its value.
    const placeholder = await lane.exec("sh", ["-c", 'printf %s "$API_KEY"']);
    assert.ok(placeholder.stdout.length > 0 && !placeholder.stdout.includes(secretValue));
    const withSecret = await lane.exec(
      "sh",
      ["-c", `curl -fsS -m 20 -H "x-api-key: $API_KEY" https://api.test:${origin.port}/with-secret`],
      { timeoutMs: 60_000 },
    );
    assert.equal(withSecret.exitCode, 0, withSecret.stderr);
    assert.equal(origin.seen.at(-1)?.headers["x-api-key"], secretValue);
    assert.equal(origin.seen.at(-1)?.headers.authorization, undefined);

    // A policy throwing on one name denies that query alone; a name it grants no TCP to is
    // refused; middleware throwing answers its request 500, a Response its own status.
    const boom = await curl(`https://boom.test:${origin.port}/`);
    assert.notEqual(boom.exitCode, 0);
    assert.match(boom.stderr, /resolve/i);
    const other = await curl(`https://other.test:${origin.port}/`);
    assert.notEqual(other.exitCode, 0);
    assert.equal((await curl(`https://api.test:${origin.port}/throw`)).stdout, "500");
    assert.equal((await curl(`https://api.test:${origin.port}/refuse`)).stdout, "403");
    const after = await lane.exec("curl", ["-fsS", "-m", "20", `https://api.test:${origin.port}/again`], {
      timeoutMs: 60_000,
    });
    assert.equal(after.stdout, "hello from the origin\n");
    assert.ok(!origin.seen.some((r) => r.path === "/throw" || r.path === "/refuse"));
    assert.ok(asked.includes("dns boom.test"));
    assert.ok(warnings.some((w) => /the network policy failed.*policy bug/s.test(w)), warnings.join("\n"));
    assert.ok(warnings.some((w) => /HTTP middleware failed.*middleware bug/s.test(w)), warnings.join("\n"));
  } finally {
    process.off("warning", warned);
    await origin.close();
  }
});

test("a DNS query accepted as it is is answered by the host's resolver", async () => {
  // `localhost` is in the host's hosts file: getaddrinfo answers it without any traffic (the
  // guest gets the gateway's address for the name). A query the policy does not grant is
  // refused; before, an accepted one was refused too.
  const sandbox = defineSandbox({
    rootfs: "busybox",
    resources: { cpus: 1, memoryMiB: 256 },
    network: network.policy((conn) => {
      if (conn.hostname === "localhost") conn.matchDns()?.accept();
    }),
  });
  await using lane = await sandbox.boot();
  const asked = await lane.exec("nslookup", ["localhost"], { timeoutMs: 30_000 });
  assert.equal(asked.exitCode, 0, asked.stdout + asked.stderr);
  assert.match(asked.stdout, /Name:\s+localhost\s+Address:?\s+\d+\.\d+\.\d+\.\d+/);
  const refused = await lane.exec("nslookup", ["elsewhere.test"], { timeoutMs: 30_000 });
  assert.notEqual(refused.exitCode, 0);
});
