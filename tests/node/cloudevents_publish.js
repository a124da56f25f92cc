// Publish CloudEvents, made by the npm `cloudevents` SDK, to a topic exchange with amqplib.
// usage: node cloudevents_publish.js URL EXCHANGE MODE [--prefix=ce-|--prefix=cloudEvents_]
//        < [{"routing_key": "...", "type": "...", "source": "...", "id": "...", "data": {...}}]
// MODE structured: the body is the SDK's structured JSON (content type application/cloudevents+json).
// MODE binary: the body is the data; the SDK's HTTP `ce-` headers become AMQP headers under the prefix
// (AMQP 0.9.1 has no CloudEvents binding, so SDKs differ), content-type the content_type property.
// An input event may give "data_base64" instead of "data": the data is then those bytes.
const amqp = require("amqplib");
const { CloudEvent, HTTP } = require("cloudevents");

const PREFIXES = ["ce-", "cloudEvents_"];

function parseArgs(argv) {
  const [url, exchange, mode, ...flags] = argv;
  const prefixFlag = flags.find((f) => f.startsWith("--prefix="));
  const prefix = prefixFlag ? prefixFlag.slice("--prefix=".length) : "ce-";
  if (!url || !exchange || !["structured", "binary"].includes(mode) || !PREFIXES.includes(prefix)) {
    throw new Error(`usage: node cloudevents_publish.js URL EXCHANGE structured|binary [--prefix=${PREFIXES.join("|")}]`);
  }
  return { url, exchange, mode, prefix };
}

function toEvent(input) {
  const { routing_key: _routingKey, data_base64: dataBase64, ...attributes } = input;
  if (dataBase64 !== undefined) attributes.data = Buffer.from(dataBase64, "base64");
  return new CloudEvent(attributes);  // validates: a bad event fails here, before anything is sent
}

// The AMQP body and properties of one event, from the SDK's HTTP rendering of it.
function toAmqp(event, mode, prefix) {
  const message = mode === "structured" ? HTTP.structured(event) : HTTP.binary(event);
  const properties = { persistent: true, headers: {} };
  for (const [name, value] of Object.entries(message.headers)) {
    if (name.toLowerCase() === "content-type") properties.contentType = value;
    else if (name.toLowerCase().startsWith("ce-")) properties.headers[prefix + name.slice(3)] = String(value);
  }
  const body = message.body === undefined ? Buffer.alloc(0) : Buffer.from(message.body);
  return { body, properties };
}

async function main() {
  const { url, exchange, mode, prefix } = parseArgs(process.argv.slice(2));
  let input = "";
  for await (const chunk of process.stdin) input += chunk;
  const messages = JSON.parse(input).map((m) => ({ routingKey: m.routing_key, ...toAmqp(toEvent(m), mode, prefix) }));
  const connection = await amqp.connect(url.replace(/\/\/$/, "/%2F"));
  try {
    const channel = await connection.createConfirmChannel();
    await channel.assertExchange(exchange, "topic", { durable: true });
    for (const m of messages) channel.publish(exchange, m.routingKey, m.body, m.properties);
    await channel.waitForConfirms();
  } finally {
    await connection.close();
  }
}

main().catch((err) => { console.error(err); process.exit(1); });
