// What the tests share: reading web streams, and an HTTPS origin on loopback with a CA of its
// own (made by the openssl command, as an operator would).

import { execFileSync } from "node:child_process";
import { createSocket } from "node:dgram";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createServer, type Server } from "node:https";
import type { IncomingHttpHeaders } from "node:http";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { ReadableStream } from "node:stream/web";

/** All of `stream`, as UTF-8 text. */
export async function text(stream: ReadableStream<Uint8Array>): Promise<string> {
  const chunks: Uint8Array[] = [];
  for await (const chunk of stream) chunks.push(chunk);
  return Buffer.concat(chunks).toString("utf8");
}

/** Reads `stream` until what it gave matches `pattern` (what it gave is returned). */
export async function readUntil(
  reader: ReadableStreamDefaultReader<Uint8Array> | { read(): Promise<{ done: boolean; value?: Uint8Array }> },
  pattern: RegExp,
  seen = "",
): Promise<string> {
  while (!pattern.test(seen)) {
    const { done, value } = await reader.read();
    if (done) throw new Error(`the stream ended before ${pattern}: ${JSON.stringify(seen)}`);
    seen += Buffer.from(value ?? new Uint8Array()).toString("utf8");
  }
  return seen;
}

/** An HTTPS origin for `names` on 127.0.0.1: its port, its CA (PEM), the requests it saw. */
export interface Origin {
  readonly port: number;
  readonly ca: string;
  readonly seen: { path: string; headers: IncomingHttpHeaders }[];
  close(): Promise<void>;
}

/** What the origin answers: a status, a content type and a body. */
export type Answer = { status: number; type: string; body: string };

const hello: Answer = { status: 200, type: "text/plain", body: "hello from the origin\n" };

export async function startOrigin(
  names: readonly string[],
  options: { port?: number; answer?: (path: string) => Answer } = {},
): Promise<Origin> {
  const port = options.port ?? 0;
  const respond = options.answer ?? (() => hello);
  const dir = mkdtempSync(join(tmpdir(), "krunbox-origin-"));
  const at = (name: string) => join(dir, name);
  const openssl = (...args: string[]) => execFileSync("openssl", args, { stdio: "pipe" });
  openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=krunbox test CA",
    "-keyout", at("ca.key"), "-out", at("ca.pem"));
  openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", `/CN=${names[0]}`, "-keyout", at("leaf.key"),
    "-out", at("leaf.csr"));
  writeFileSync(at("leaf.ext"), `subjectAltName=${names.map((n) => `DNS:${n}`).join(",")}\n`);
  openssl("x509", "-req", "-in", at("leaf.csr"), "-CA", at("ca.pem"), "-CAkey", at("ca.key"),
    "-CAcreateserial", "-days", "2", "-extfile", at("leaf.ext"), "-out", at("leaf.pem"));
  const seen: Origin["seen"] = [];
  const server: Server = createServer(
    { key: readFileSync(at("leaf.key")), cert: readFileSync(at("leaf.pem")) },
    (request, response) => {
      seen.push({ path: request.url ?? "", headers: request.headers });
      const answer = respond(request.url ?? "");
      response.writeHead(answer.status, { "content-type": answer.type });
      response.end(answer.body);
    },
  );
  await new Promise<void>((resolve) => server.listen(port, "127.0.0.1", resolve));
  const address = server.address();
  const ca = readFileSync(at("ca.pem"), "utf8");
  rmSync(dir, { recursive: true });
  return {
    port: typeof address === "object" && address ? address.port : port,
    ca,
    seen,
    close: () => new Promise((resolve) => server.close(() => resolve())),
  };
}

/**
 * A DNS server on 127.0.0.1 answering every A query with `address` (TTL 60) and anything
 * else with no records: what a test's resolver must do, and no more. Written here because
 * Node has no DNS server; every length it reads is checked against the datagram.
 */
export async function startResolver(address: string): Promise<{ port: number; close(): Promise<void> }> {
  const socket = createSocket("udp4");
  socket.on("message", (query, from) => {
    if (query.length < 12 || query.readUInt16BE(4) !== 1) return;
    let at = 12;
    while (at < query.length && query[at] !== 0) at += (query[at] ?? 0) + 1;
    const end = at + 5;
    if (end > query.length) return;
    const type = query.readUInt16BE(at + 1);
    const question = query.subarray(12, end);
    const header = Buffer.alloc(12);
    header.writeUInt16BE(query.readUInt16BE(0), 0); // the query's id
    header.writeUInt16BE(0x8180, 2); // a response, recursion desired and available, no error
    header.writeUInt16BE(1, 4);
    const answers = type === 1 ? 1 : 0;
    header.writeUInt16BE(answers, 6);
    const record = Buffer.alloc(16);
    record.writeUInt16BE(0xc00c, 0); // the name: a pointer to the question's
    record.writeUInt16BE(1, 2);
    record.writeUInt16BE(1, 4);
    record.writeUInt32BE(60, 6);
    record.writeUInt16BE(4, 10);
    address.split(".").forEach((octet, i) => record.writeUInt8(Number(octet), 12 + i));
    const reply = Buffer.concat(answers ? [header, question, record] : [header, question]);
    socket.send(reply, from.port, from.address);
  });
  await new Promise<void>((resolve) => socket.bind(0, "127.0.0.1", resolve));
  return {
    port: socket.address().port,
    close: () => new Promise((resolve) => socket.close(() => resolve())),
  };
}
