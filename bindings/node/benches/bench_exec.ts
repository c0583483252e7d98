// The TypeScript API against the Rust API on one booted VM: an `exec("true")` round trip and
// an exec writing 16 MiB to stdout, each timed through `krunbox` and, alternating with it,
// through the library's Rust API in the same process (`_rustExecSeconds`): the ratio is
// what the binding costs. The goal is at most 1.2x. It reports, it asserts no timing.
//
// Each side runs once untimed first, then they alternate which goes first. Run by the test
// command once as a smoke test (3 round trips, one 16 MiB run each); with `--bench` 20 round
// trips and 5 runs of 16 MiB. Under nested emulation absolute times mean little; the ratios
// measured in the same run are what we report.

import { defineSandbox, _rustExecSeconds, type Instance } from "krunbox";

const MIB = 1 << 20;

async function nodeSeconds(lane: Instance, args: string[], stdoutBytes: number): Promise<number> {
  const start = process.hrtime.bigint();
  const done = await lane.exec(args[0] ?? "", args.slice(1));
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  if (done.exitCode !== 0 || done.stdoutBytes.length !== stdoutBytes) {
    throw new Error(`the bench's run of ${args.join(" ")} went wrong: exit ${done.exitCode}`);
  }
  return seconds;
}

function median(values: number[]): number {
  const sorted = [...values].sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  return sorted.length % 2 ? (sorted[mid] ?? 0) : ((sorted[mid - 1] ?? 0) + (sorted[mid] ?? 0)) / 2;
}

async function compare(lane: Instance, name: string, args: string[], stdoutBytes: number, rounds: number) {
  const node: number[] = [];
  const rust: number[] = [];
  const rustSeconds = () => _rustExecSeconds(lane, args, stdoutBytes);
  // One untimed run of each first, then the sides alternate which goes first, so neither
  // always pays for the other's leftovers.
  await nodeSeconds(lane, args, stdoutBytes);
  await rustSeconds();
  for (let i = 0; i < rounds; i++) {
    if (i % 2) {
      rust.push(await rustSeconds());
      node.push(await nodeSeconds(lane, args, stdoutBytes));
    } else {
      node.push(await nodeSeconds(lane, args, stdoutBytes));
      rust.push(await rustSeconds());
    }
  }
  const [n, r] = [median(node), median(rust)];
  const label = name.padEnd(24);
  console.log(`node/${label} node ${(n * 1e3).toFixed(1).padStart(9)} ms  rust ${(r * 1e3).toFixed(1).padStart(9)} ms  (${rounds} rounds)`);
  console.log(`node/${`${name} ratio node / rust`.padEnd(24)} ${(n / r).toFixed(3)}x  (goal: at most 1.2x)`);
}

async function main() {
  const full = process.argv.includes("--bench");
  const [trips, streams] = full ? [20, 5] : [3, 1];
  const sandbox = defineSandbox({ rootfs: "busybox", resources: { cpus: 2, memoryMiB: 512 } });
  await using lane = await sandbox.boot();
  await compare(lane, "exec(true)", ["true"], 0, trips);
  await compare(lane, "16 MiB of stdout", ["head", "-c", String(16 * MIB), "/dev/zero"], 16 * MIB, streams);
}

main().catch((error: unknown) => {
  console.error(error);
  process.exitCode = 1;
});
