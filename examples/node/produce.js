'use strict';
// Publish JSON lines from stdin to a partq stream, in order, with publisher confirms:
//   PARTQ_AMQP_URL=amqp://guest:guest@127.0.0.1:5672/ node produce.js STREAM PARTITIONS < lines.jsonl
// Each line is {"key": "...", "body": "..." or any JSON value, "message_id"?: "..."}.
// Prints {"sent", "confirmed", "failed", "errors"} as JSON; exits 1 if any publish failed.
const readline = require('node:readline');
const { Producer } = require('./partq');

const WINDOW = 1000; // unconfirmed messages at most: bounds memory, keeps the pipe full

async function main() {
  const [stream, count] = process.argv.slice(2);
  if (!stream || !count) {
    console.error('usage: node produce.js STREAM PARTITIONS < lines.jsonl');
    return 2;
  }
  const url = process.env.PARTQ_AMQP_URL ?? 'amqp://guest:guest@127.0.0.1:5672/';
  const producer = await Producer.open(url, stream, Number(count));
  const pending = new Set();
  const result = { sent: 0, confirmed: 0, failed: 0, errors: [] };
  let line = 0;
  try {
    for await (const text of readline.createInterface({ input: process.stdin })) {
      line += 1;
      if (!text.trim()) continue;
      let doc;
      try {
        doc = JSON.parse(text);
      } catch (err) {
        throw new Error(`line ${line} is not JSON (${err.message}): fix it; ${result.sent} sent before it`);
      }
      const body = typeof doc.body === 'string' ? doc.body : JSON.stringify(doc.body);
      const done = producer.publish(doc.key, body, doc.message_id).then(
        () => { result.confirmed += 1; },
        (err) => { result.failed += 1; if (result.errors.length < 10) result.errors.push(err.message); },
      ).finally(() => pending.delete(done));
      pending.add(done);
      result.sent += 1;
      while (pending.size >= WINDOW) await Promise.race(pending);
    }
    await Promise.all(pending);
  } finally {
    await producer.close();
  }
  console.log(JSON.stringify(result));
  return result.failed ? 1 : 0;
}

main().then((code) => { process.exitCode = code; }, (err) => {
  console.error(`produce.js: ${err.message}`);
  process.exitCode = 2;
});
