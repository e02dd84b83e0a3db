// Continue's own schema (@continuedev/config-yaml's configYamlSchema) over a config.yaml: prints each model's
// provider and apiBase when it is valid, else the schema's issues (exit 1).
// Usage: node continue_config.mjs CONFIG.yaml   (run with NODE_PATH pointing at the clients' node_modules)
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";

const require = createRequire(process.env.NODE_PATH.split(":")[0] + "/");
const YAML = require("yaml");
const { configYamlSchema } = require("@continuedev/config-yaml");
const result = configYamlSchema.safeParse(YAML.parse(readFileSync(process.argv[2], "utf8")));
if (!result.success) {
  console.log(JSON.stringify(result.error.issues, null, 1));
  process.exit(1);
}
console.log(JSON.stringify(result.data.models.map((m) => ({ provider: m.provider, apiBase: m.apiBase, roles: m.roles }))));
