// bindings.mjs TYPEDEFS OUT: the Node addon's loader (OUT/index.js) and TypeScript types
// (OUT/index.d.ts), made by the napi CLI's own API from the type definitions napi-derive
// wrote into TYPEDEFS while cargo built the addon (scripts/node.sh). Run in bindings/node.
import { readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { generateTypeDef, writeJsBinding } from "@napi-rs/cli";

const [typeDefDir, outputDir] = process.argv.slice(2);
const pkg = JSON.parse(await readFile("package.json", "utf8"));
const { exports, dts } = await generateTypeDef({
  typeDefDir,
  cwd: process.cwd(),
  declareBindingTarget: true,
});
if (exports.length === 0) throw new Error(`no type definitions in ${typeDefDir}`);
await writeFile(join(outputDir, "index.d.ts"), dts);
await writeJsBinding({
  platform: true,
  idents: exports,
  jsBinding: "index.js",
  binaryName: pkg.napi.binaryName,
  packageName: pkg.name,
  version: pkg.version,
  outputDir,
});
