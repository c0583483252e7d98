// What an instance tells about itself: the helper's confinement and the instance's resource
// use, as the Rust library reports them (its snake_case fields named in camelCase here).

/** One layer of the helper's confinement (namespaces, seccomp, Landlock, ...). */
export interface IsolationLayer {
  readonly layer: string;
  /** Whether it is in force for the helper and everything it starts. */
  readonly enforced: boolean;
  /** What was applied, or why the host could not provide it. */
  readonly detail: string;
}

/** Something the confined helper tried at start and must not have been able to do. */
export interface CanaryReport {
  readonly canary: string;
  readonly blocked: boolean;
  readonly detail: string;
}

/** How the VMM helper of an instance is confined. */
export interface IsolationReport {
  readonly layers: readonly IsolationLayer[];
  readonly canaries: readonly CanaryReport[];
  /** How long setting the confinement up took, in microseconds. */
  readonly setupMicros: number;
}

/** The network's counters. */
export interface NetworkMetrics {
  readonly bytesFromGuest: number;
  readonly bytesToGuest: number;
  readonly flowsGranted: number;
  readonly flowsDenied: number;
  readonly requests: number;
  readonly openConnections: number;
}

/** What an instance uses now. */
export interface Metrics {
  /** CPU time of the VM and its helper, in seconds. */
  readonly cpuTime: number;
  readonly memoryBytes: number;
  readonly memoryPeakBytes: number;
  readonly diskReadBytes: number | null;
  readonly diskWrittenBytes: number | null;
  /** `null` for an instance without a network. */
  readonly network: NetworkMetrics | null;
  readonly hostDescriptors: number;
  readonly hostDescriptorsMax: number;
  /** A writable root's use, `null` for a read-only one. */
  readonly root: Readonly<Record<string, number>> | null;
  /** Where the numbers come from: the instance's cgroup, or its processes. */
  readonly source: "cgroup" | "process";
  /** The host's own work in the boot before the VM started, in seconds. */
  readonly hostBootWork: number;
}

/** `value` with every object's keys in camelCase. */
export function camelCase(value: unknown): unknown {
  if (Array.isArray(value)) return value.map(camelCase);
  if (value === null || typeof value !== "object") return value;
  return Object.fromEntries(
    Object.entries(value).map(([key, inner]) => [key.replace(/_([a-z])/g, (_, c: string) => c.toUpperCase()), camelCase(inner)]),
  );
}
