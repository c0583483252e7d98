// The package as a user gets it: `npm pack`ed and installed from the tarball alone into a
// project of its own (scripts/node.sh does both), imported there by name from an ES module,
// and booting a microVM with the helper and guest-init it carries, no environment needed.

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { promisify } from "node:util";

// build/user-project, beside the compiled tests (build/bindings/node/tests/).
const PROJECT = join(__dirname, "..", "..", "..", "user-project");

const USER_MODULE = `
import { defineSandbox, InvalidConfigError, TIMEOUT_EXIT_CODE } from "krunbox";
import { createRequire } from "node:module";

const where = createRequire(process.cwd() + "/").resolve("krunbox");
const sandbox = defineSandbox({ rootfs: "busybox", resources: { cpus: 1, memoryMiB: 256 } });
const lane = await sandbox.boot();
try {
  const { exitCode, stdout } = await lane.exec("uname", ["-r"]);
  console.log(JSON.stringify({ where, exitCode, release: stdout.trim(), timeout: TIMEOUT_EXIT_CODE,
    typed: typeof InvalidConfigError }));
} finally {
  await lane.shutdown();
}
`;

test("the packed package, installed from its tarball, boots a microVM", async () => {
  const installed = join(PROJECT, "node_modules", "krunbox");
  for (const file of ["dist/index.js", "dist/index.d.ts", "native/index.js", "artifacts/bin/krunbox-vmm", "artifacts/guest-init"]) {
    assert.ok(existsSync(join(installed, file)), `the installed package has no ${file}`);
  }
  const env = { ...process.env };
  for (const name of ["KRUNBOX_VMM", "KRUNBOX_GUEST_INIT"]) delete env[name];
  // An ES module evaluated in the project (where its imports resolve), as its own file would be.
  const ran = await promisify(execFile)(process.execPath, ["--input-type=module", "-e", USER_MODULE], {
    cwd: PROJECT,
    env,
    timeout: 300_000,
  });
  const said = JSON.parse(ran.stdout) as { where: string; exitCode: number; release: string; timeout: number; typed: string };
  assert.equal(said.where, join(installed, "dist", "index.js"));
  assert.equal(said.exitCode, 0);
  assert.match(said.release, /^\d+\.\d+/);
  assert.deepEqual([said.timeout, said.typed], [124, "function"]);
});
