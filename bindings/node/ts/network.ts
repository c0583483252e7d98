// The sandbox's network, as TypeScript defines it. Default-deny: a flow the policy does not
// grant is blocked. The policy gets each new flow as a `Connection`, and grants it with one
// of its matchers' `accept`s (or denies it, or says nothing, which denies it too).

import { BlockList, isIP } from "node:net";

import { guarded } from "./callback.js";
import { InvalidConfigError, typedSync } from "./errors.js";
import { native } from "./native.js";
import type { FlowInfo, HttpRequestInfo, HttpRequestResult, ReleaseInfo, VerdictSpec } from "../native/index.js";

/** An address range: each test of `Endpoint` is one of these lists. */
function ranges(v4: string[], v6: string[]): BlockList {
  const list = new BlockList();
  for (const range of v4) {
    const [net, prefix] = range.split("/") as [string, string];
    list.addSubnet(net, Number(prefix), "ipv4");
  }
  for (const range of v6) {
    const [net, prefix] = range.split("/") as [string, string];
    list.addSubnet(net, Number(prefix), "ipv6");
  }
  return list;
}

// The IANA special-purpose registries' ranges (RFC 6890 and its updates).
const loopback = ranges(["127.0.0.0/8"], ["::1/128"]);
const privateUse = ranges(["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10"], ["fc00::/7"]);
const linkLocal = ranges(["169.254.0.0/16"], ["fe80::/10"]);
const multicast = ranges(["224.0.0.0/4"], ["ff00::/8"]);
const broadcast = ranges(["255.255.255.255/32"], []);
const documentation = ranges(
  ["192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24"],
  ["2001:db8::/32", "3fff::/20"],
);
const reserved = ranges(
  ["0.0.0.0/8", "192.0.0.0/24", "198.18.0.0/15", "240.0.0.0/4"],
  ["::/128", "::ffff:0:0/96", "64:ff9b:1::/48", "100::/64", "2001::/23"],
);

/** One end of a flow: an IP address and a port, with tests of the address's range. */
export class Endpoint {
  constructor(
    readonly ip: string,
    readonly port: number,
  ) {}

  private in(list: BlockList): boolean {
    const family = isIP(this.ip) === 6 ? "ipv6" : "ipv4";
    return list.check(this.ip, family);
  }

  isLoopback(): boolean {
    return this.in(loopback);
  }
  isPrivate(): boolean {
    return this.in(privateUse);
  }
  isLinkLocal(): boolean {
    return this.in(linkLocal);
  }
  isMulticast(): boolean {
    return this.in(multicast);
  }
  isBroadcast(): boolean {
    return this.in(broadcast);
  }
  isDocumentation(): boolean {
    return this.in(documentation);
  }
  isReserved(): boolean {
    return this.in(reserved);
  }
  /** None of the ranges above: an address on the public internet. */
  isPublicInternet(): boolean {
    return ![loopback, privateUse, linkLocal, multicast, broadcast, documentation, reserved].some(
      (list) => this.in(list),
    );
  }

  toString(): string {
    return isIP(this.ip) === 6 ? `[${this.ip}]:${this.port}` : `${this.ip}:${this.port}`;
  }
}

/** An intercepted HTTP request on its way upstream. */
export interface Request {
  /** The trusted hostname it goes to (from the gateway's DNS answers, never from the request). */
  readonly hostname: string;
  readonly scheme: "http" | "https";
  readonly method: string;
  /** The path and query. */
  readonly path: string;
  readonly url: string;
  /** Its headers; changes made before the middleware returns are what goes upstream. */
  readonly headers: Headers;
}

/**
 * HTTP middleware: changes `request.headers`, or returns a `Response` that the guest gets
 * instead of going upstream (its status and text body).
 */
export type Middleware = (request: Request) => void | Response | Promise<void | Response>;

/** A DNS query the policy may answer. */
export interface DnsMatch {
  /** The name asked. */
  readonly name: string;
  /**
   * Answers it: from `resolvers` (DNS servers, "address" or "address:port"), with fixed
   * `addresses`, or from the host's resolver when neither is given. Returns true.
   */
  accept(options?: { resolvers?: readonly string[]; addresses?: readonly string[] }): true;
}

/** A TCP or UDP flow the policy may grant as it is. */
export interface TransportMatch {
  /** Grants it, to where the guest sent it, or to `to` ("address:port") instead. */
  accept(options?: { to?: string }): true;
}

/** A TCP flow to a trusted hostname, which the policy may grant as HTTP(S). */
export interface HttpMatch {
  readonly hostname: string;
  readonly port: number;
  /**
   * Grants it through the host's HTTP(S) interception: each request goes through
   * `middleware`, in order. A flow that is not HTTP fails closed.
   */
  accept(...middleware: Middleware[]): true;
}

/** A new flow from the guest, as the policy is asked about it. */
export class Connection {
  /**
   * "tcp", "udp" or "dns" (queries over UDP and TCP alike); "other" for a kind this package
   * does not know yet, which is denied whatever the policy says.
   */
  readonly protocol: "tcp" | "udp" | "dns" | "other";
  /** The name the guest resolved for the destination (for "dns", the name asked). */
  readonly hostname: string | undefined;
  readonly src: Endpoint;
  readonly dst: Endpoint;
  /** The addresses the gateway's DNS answered for `hostname`. */
  readonly upstream: readonly string[];
  #verdict: VerdictSpec | undefined;
  readonly #register: (middleware: Middleware) => number;

  /** @internal */
  constructor(flow: FlowInfo, register: (middleware: Middleware) => number) {
    this.protocol = flow.protocol as Connection["protocol"];
    this.hostname = flow.hostname ?? undefined;
    this.src = new Endpoint(flow.srcIp, flow.srcPort);
    this.dst = new Endpoint(flow.dstIp, flow.dstPort);
    this.upstream = flow.upstream;
    this.#register = register;
  }

  #undecided(): void {
    if (this.#verdict) {
      throw new InvalidConfigError(`${this} was already decided (${this.#verdict.kind})`, "InvalidConfig");
    }
  }

  #decide(verdict: VerdictSpec): true {
    this.#undecided();
    this.#verdict = verdict;
    return true;
  }

  /** Grants the raw transport (TCP, UDP) to where the guest sent it; DNS from the host's resolver. */
  accept(): true {
    return this.#decide({ kind: "accept" });
  }

  /** Blocks it (what saying nothing does too). */
  deny(): true {
    return this.#decide({ kind: "deny" });
  }

  /** A DNS query, if this is one. */
  matchDns(): DnsMatch | undefined {
    if (this.protocol !== "dns") return undefined;
    return {
      name: this.hostname ?? "",
      accept: (options = {}) => {
        if (options.addresses && options.resolvers) {
          throw new InvalidConfigError("answer DNS from resolvers or with addresses, not both", "InvalidConfig");
        }
        if (options.addresses) return this.#decide({ kind: "resolve", addresses: [...options.addresses] });
        if (options.resolvers) return this.#decide({ kind: "resolveWith", servers: [...options.resolvers] });
        return this.#decide({ kind: "accept" });
      },
    };
  }

  #matchTransport(protocol: "tcp" | "udp", target?: string): TransportMatch | undefined {
    if (this.protocol !== protocol) return undefined;
    if (target !== undefined && target !== this.dst.toString() && target !== `${this.hostname}:${this.dst.port}`) {
      return undefined;
    }
    return {
      accept: (options = {}) =>
        this.#decide(options.to ? { kind: "connectTo", to: options.to } : { kind: "accept" }),
    };
  }

  /** A TCP flow, to `target` ("address:port" or "hostname:port") if given. */
  matchTcp(target?: string): TransportMatch | undefined {
    return this.#matchTransport("tcp", target);
  }

  /** A UDP flow, to `target` ("address:port" or "hostname:port") if given. */
  matchUdp(target?: string): TransportMatch | undefined {
    return this.#matchTransport("udp", target);
  }

  /**
   * A TCP flow to a trusted hostname: `host` itself, or one the predicate takes. The name is
   * the gateway's (from DNS answers it gave), never the request's Host header; a flow to an
   * address the guest did not resolve through the gateway has none and never matches.
   */
  matchHttp(host: string | ((candidate: { hostname: string; port: number }) => boolean)): HttpMatch | undefined {
    if (this.protocol !== "tcp" || this.hostname === undefined) return undefined;
    const candidate = { hostname: this.hostname, port: this.dst.port };
    const matches = typeof host === "string" ? host.toLowerCase() === candidate.hostname : host(candidate);
    if (!matches) return undefined;
    return {
      ...candidate,
      accept: (...middleware: Middleware[]) => {
        this.#undecided();
        return this.#decide({ kind: "intercept", middleware: middleware.map((m) => this.#register(m)) });
      },
    };
  }

  /** @internal The decision: deny when none was made, and for a kind of flow not known here. */
  verdict(): VerdictSpec {
    if (this.protocol === "other") return { kind: "deny" };
    return this.#verdict ?? { kind: "deny" };
  }

  toString(): string {
    return `${this.protocol} ${this.hostname ?? ""} ${this.src} -> ${this.dst}`.replace(/ +/g, " ");
  }
}

/** A network policy: grants what it accepts of each flow, denies the rest. */
export type Policy = (conn: Connection) => void | unknown | Promise<void | unknown>;

/** A secret the guest holds only as a placeholder (in environment variable `name`). */
export interface Secret {
  readonly name: string;
  readonly value: string;
  /** The hosts the gateway puts its value in requests to (`api.example.com`, `*.example.com`). */
  readonly hosts: readonly string[];
  /** Also in query strings (default false). */
  readonly inQuery?: boolean;
  /** Also in request bodies (default false). */
  readonly inBody?: boolean;
}

export interface NetworkOptions {
  readonly secrets?: readonly Secret[];
  /** Guest ports reachable on the host's loopback. */
  readonly publish?: readonly { guestPort: number; hostPort: number }[];
  /** PEM certificates intercepted upstreams are verified against, instead of the host's trust store. */
  readonly upstreamCa?: string;
}

/** A network definition, given to `defineSandbox`. */
export class Network {
  /** @internal */
  readonly native: InstanceType<typeof native.NativeNetwork>;

  /** @internal */
  constructor(made: InstanceType<typeof native.NativeNetwork>) {
    this.native = made;
  }
}

function nativeOptions(options: NetworkOptions, rules?: string) {
  return {
    rules,
    secrets: options.secrets?.map((s) => ({ ...s, hosts: [...s.hosts] })),
    publish: options.publish?.map((p) => ({ ...p })),
    upstreamCa: options.upstreamCa,
  };
}

/** The HTTP(S) request the middleware runner got, as a `Request`. */
function request(info: HttpRequestInfo): Request {
  const scheme = info.scheme === "http" ? "http" : "https";
  return {
    hostname: info.hostname,
    scheme,
    method: info.method,
    path: info.path,
    url: `${scheme}://${info.hostname}${info.path}`,
    headers: new Headers(info.headers as [string, string][]),
  };
}

/** What the middleware made of `request`: its headers if it changed them, and its answer. */
async function answer(request: Request, before: string, response: void | Response): Promise<HttpRequestResult> {
  const after = [...request.headers];
  const headers = JSON.stringify(after) === before ? undefined : after;
  if (!(response instanceof Response)) return { headers };
  return { headers, status: response.status, body: await response.text() };
}

/**
 * The middleware a network's policy registered, by id, until the native side releases it:
 * one by one when the flow that took it ends, or all of a policy call's when its verdict was
 * never taken (the policy threw, or its flow went away while it ran).
 */
class Registry {
  readonly #middleware = new Map<number, Middleware>();
  readonly #byCall = new Map<number, number[]>();
  /** Calls still running in the policy, and those of them the native side gave up on. */
  readonly #running = new Set<number>();
  readonly #abandoned = new Set<number>();
  #next = 0;

  register(call: number, middleware: Middleware): number {
    this.#next = (this.#next + 1) >>> 0;
    this.#middleware.set(this.#next, middleware);
    const ids = this.#byCall.get(call) ?? [];
    ids.push(this.#next);
    this.#byCall.set(call, ids);
    return this.#next;
  }

  get(id: number): Middleware | undefined {
    return this.#middleware.get(id);
  }

  started(call: number): void {
    this.#running.add(call);
  }

  /** The policy's part of `call` is done: what it registered is released if the native side gave up meanwhile. */
  finished(call: number): void {
    this.#running.delete(call);
    if (this.#abandoned.delete(call)) this.#forgetCall(call, false);
  }

  release(info: ReleaseInfo): void {
    if (info.middleware != null) this.#middleware.delete(info.middleware);
    if (info.call == null) return;
    if (!info.taken && this.#running.has(info.call)) {
      this.#abandoned.add(info.call);
      return;
    }
    this.#forgetCall(info.call, info.taken ?? false);
  }

  #forgetCall(call: number, taken: boolean): void {
    const ids = this.#byCall.get(call) ?? [];
    this.#byCall.delete(call);
    if (!taken) for (const id of ids) this.#middleware.delete(id);
  }
}

/** A network whose every flow `policy` decides. */
function policy(decide: Policy, options: NetworkOptions = {}): Network {
  const registry = new Registry();
  const asked = guarded("the network policy", "the flow is denied", async (flow: FlowInfo) => {
    registry.started(flow.call);
    try {
      const conn = new Connection(flow, (middleware) => registry.register(flow.call, middleware));
      await decide(conn);
      return conn.verdict();
    } finally {
      registry.finished(flow.call);
    }
  });
  const run = guarded("HTTP middleware", "the request is answered 500", async (info: HttpRequestInfo) => {
    const middleware = registry.get(info.middleware);
    if (!middleware) throw new Error(`middleware ${info.middleware} is not registered`);
    const req = request(info);
    const before = JSON.stringify([...req.headers]);
    return answer(req, before, await middleware(req));
  });
  const release = (info: ReleaseInfo) => registry.release(info);
  return typedSync(() => new Network(new native.NativeNetwork(nativeOptions(options), asked, run, release)));
}

/**
 * A network of declarative rules (`{ rules: [...] }`, as the Rust library's `Rules` take them),
 * as an object or its JSON.
 */
function rules(rules: object | string, options: NetworkOptions = {}): Network {
  const json = typeof rules === "string" ? rules : JSON.stringify(rules);
  return typedSync(() => new Network(new native.NativeNetwork(nativeOptions(options, json))));
}

/** No network at all beyond loopback in the guest (what a sandbox without one has). */
function denyAll(options: NetworkOptions = {}): Network {
  return typedSync(() => new Network(new native.NativeNetwork(nativeOptions(options))));
}

export const network = { policy, rules, denyAll };

