// Publish JSON-described messages to a topic exchange with amqplib (a non-Python publisher).
// usage: node publish.js URL EXCHANGE < [{"routing_key": "...", "body": "...", "properties": {...}}]
const amqp = require("amqplib");

async function main() {
  const [url, exchange] = process.argv.slice(2);
  let input = "";
  for await (const chunk of process.stdin) input += chunk;
  const messages = JSON.parse(input);
  const connection = await amqp.connect(url.replace(/\/\/$/, "/%2F"));
  const channel = await connection.createConfirmChannel();
  await channel.assertExchange(exchange, "topic", { durable: true });
  for (const m of messages) {
    channel.publish(exchange, m.routing_key, Buffer.from(m.body, "utf8"),
                    Object.assign({ persistent: true }, m.properties || {}));
  }
  await channel.waitForConfirms();
  await connection.close();
}

main().catch((err) => { console.error(err); process.exit(1); });
