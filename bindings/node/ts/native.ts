// The native addon (napi-rs, built from ../src), loaded once, told where the package's own
// helper and guest-init are.
import { existsSync } from "node:fs";
import { join } from "node:path";
import * as native from "../native/index.js";

const artifacts = join(__dirname, "..", "artifacts");
if (existsSync(artifacts)) native.searchArtifactsFirst(artifacts);

export { native };
