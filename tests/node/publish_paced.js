// Publish N JSON events {"i": i} to a topic exchange with amqplib, spread evenly over SECONDS, each with its
// timestamp property (whole seconds, as AMQP has it) and a message id; before event START_SECOND_AT (an index)
// it waits for the next whole second, so that event is the first of its second. Confirmed before exit.
// usage: node publish_paced.js URL EXCHANGE PREFIX N SECONDS START_SECOND_AT
const amqp = require("amqplib");

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function main() {
  const [url, exchange, prefix, n, seconds, startSecondAt] = process.argv.slice(2);
  const count = Number(n);
  const connection = await amqp.connect(url.replace(/\/\/$/, "/%2F"));
  const channel = await connection.createConfirmChannel();
  const began = Date.now();
  for (let i = 0; i < count; i++) {
    if (i === Number(startSecondAt)) await sleep(1000 - (Date.now() % 1000) + 5);
    const due = began + (i * Number(seconds) * 1000) / count;
    if (due > Date.now()) await sleep(due - Date.now());
    channel.publish(exchange, `${prefix}.${i}`, Buffer.from(JSON.stringify({ i }), "utf8"),
                    { persistent: true, contentType: "application/json", messageId: `e${i}`,
                      timestamp: Math.floor(Date.now() / 1000) });
    if (i % 500 === 499) await channel.waitForConfirms();
  }
  await channel.waitForConfirms();
  await connection.close();
}

main().catch((err) => { console.error(err); process.exit(1); });
