// Validate an AsyncAPI document (JSON or YAML) with @asyncapi/parser, the reference parser.
// usage: node asyncapi_check.js [FILE]     (no FILE, or "-": the document is read from stdin)
// Prints each diagnostic as one JSON line {severity, code, message, path} on stdout;
// exits 1 if any has error severity (0), or the document cannot be read; 0 otherwise.
// The document's schemas use AsyncAPI's default schema format (a superset of JSON Schema
// draft 07), which the parser validates without a schema parser of its own; the AMQP
// bindings are validated against the binding schemas the parser ships (@asyncapi/specs).
const fs = require("fs");
const { Parser } = require("@asyncapi/parser");

const ERROR = 0;

async function read(path) {
  if (path && path !== "-") return fs.readFileSync(path, "utf8");
  let text = "";
  for await (const chunk of process.stdin) text += chunk;
  return text;
}

async function main() {
  const text = await read(process.argv[2]);
  const { document, diagnostics } = await new Parser().parse(text);
  for (const d of diagnostics) {
    console.log(JSON.stringify({ severity: d.severity, code: d.code, message: d.message, path: d.path }));
  }
  const errors = diagnostics.filter((d) => d.severity === ERROR).length;
  if (errors || !document) {
    console.error(`${errors} error(s): not a valid AsyncAPI document`);
    process.exit(1);
  }
}

main().catch((err) => { console.error(err.message || err); process.exit(1); });
