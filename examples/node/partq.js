'use strict';
// partq's wire contract in Node.js (docs/contract.md): the hash, the names, the headers,
// and a producer that counts a message as sent only when the broker confirmed it.

const amqp = require('amqplib');
const murmur = require('murmurhash3js-revisited');

const MAX_PARTITIONS = 65536;
const STREAM_NAME = /^[a-z0-9][a-z0-9_.-]{0,99}$/;
const LONE_SURROGATE = /[\uD800-\uDFFF]/u; // with the u flag, a surrogate pair is one code point

// The partition of a key: murmur3 x86_32 of its bytes (a string's UTF-8), seed 0, unsigned,
// modulo the stream's partition count. The library takes bytes: hashing a JS string
// directly would hash UTF-16 code units, which is the mismatch this contract exists to avoid.
function partitionFor(key, partitions) {
  if (!Number.isInteger(partitions) || partitions < 1 || partitions > MAX_PARTITIONS) {
    throw new RangeError(`partitions must be a whole number in 1..${MAX_PARTITIONS}, got ${partitions}`);
  }
  return murmur.x86.hash32(keyBytes(key), 0) % partitions;
}

function keyBytes(key) {
  if (typeof key === 'string') {
    if (LONE_SURROGATE.test(key)) {
      throw new TypeError('key holds a lone surrogate, which has no UTF-8: fix it, or pass a Buffer');
    }
    return Buffer.from(key, 'utf8');
  }
  if (Buffer.isBuffer(key) || key instanceof Uint8Array) return Buffer.from(key);
  throw new TypeError(`key must be a string or a Buffer, not ${typeof key} (convert numbers to strings yourself)`);
}

function checkStream(stream) {
  if (typeof stream !== 'string' || !STREAM_NAME.test(stream)) {
    throw new TypeError(`invalid stream name ${JSON.stringify(stream)}: use [a-z0-9][a-z0-9_.-]*, at most 100 characters`);
  }
  return stream;
}

const exchangeName = (stream) => `partq.${checkStream(stream)}`;
const queueName = (stream, partition) => `partq.${checkStream(stream)}.p${String(partition).padStart(5, '0')}`;

// The headers partq's consumers read: the key (a string as partq-key, bytes as base64 in
// partq-key-b64), the partition it was hashed to and the publish time in milliseconds.
function headersFor(key, partition, nowMs) {
  const headers = typeof key === 'string'
    ? { 'partq-key': key }
    : { 'partq-key-b64': keyBytes(key).toString('base64') };
  headers['partq-partition'] = { '!': 'long', value: partition };
  headers['partq-published-ms'] = { '!': 'long', value: nowMs };
  return headers;
}

class Producer {
  // Use Producer.open(url, stream, partitions): it checks the partition count first.
  constructor(connection, channel, stream, partitions) {
    this.connection = connection;
    this.channel = channel;
    this.stream = stream;
    this.partitions = partitions;
    this.exchange = exchangeName(stream);
    this.returned = new Map(); // message id -> why the broker returned it (unroutable)
    this.counter = 0;
    channel.on('return', (msg) => {
      const { replyCode, replyText } = msg.fields;
      this.returned.set(msg.properties.messageId, `${replyCode} ${replyText}`);
    });
  }

  static async open(url, stream, partitions) {
    checkStream(stream);
    partitionFor('', partitions); // validates the count
    const connection = await amqp.connect(url);
    try {
      await checkPartitionCount(connection, stream, partitions);
      const channel = await connection.createConfirmChannel();
      return new Producer(connection, channel, stream, partitions);
    } catch (err) {
      await connection.close().catch(() => {});
      throw err;
    }
  }

  // Resolves when the broker confirmed the message; rejects if it nacked or returned it.
  publish(key, body, messageId) {
    const partition = partitionFor(key, this.partitions);
    const now = Date.now();
    const id = messageId ?? `${process.pid}-${now}-${this.counter++}`;
    const content = Buffer.isBuffer(body) ? body : Buffer.from(String(body), 'utf8');
    const options = {
      persistent: true,
      mandatory: true,
      messageId: id,
      timestamp: Math.floor(now / 1000),
      appId: 'partq',
      headers: headersFor(key, partition, now),
    };
    return new Promise((resolve, reject) => {
      // A returned message is still acked by the broker: the return arrives first.
      this.channel.publish(this.exchange, String(partition), content, options, (err) => {
        const returned = this.returned.get(id);
        this.returned.delete(id);
        if (err) reject(new Error(`message ${id} was not confirmed: ${err.message ?? err}`));
        else if (returned) reject(new Error(`message ${id} was returned unroutable (${returned}): is the stream created?`));
        else resolve(partition);
      });
    });
  }

  async close() {
    await this.channel.waitForConfirms().catch(() => {});
    await this.connection.close();
  }
}

// The stream's queues p00000 .. p(P-1) exist and p(P) does not: a producer configured with
// another count than the stream was created with would put keys in the wrong partitions.
async function checkPartitionCount(connection, stream, partitions) {
  const exists = async (queue) => {
    const channel = await connection.createChannel();
    channel.on('error', () => {}); // a passive declare of a missing queue closes the channel
    try {
      await channel.checkQueue(queue);
      await channel.close();
      return true;
    } catch (err) {
      if (err.code === 404) return false;
      throw err;
    }
  };
  if (!(await exists(queueName(stream, partitions - 1)))) {
    throw new Error(`stream ${stream} has no queue ${queueName(stream, partitions - 1)}: create it (partq stream create ${stream} --partitions ${partitions}) or pass its partition count`);
  }
  if (partitions < MAX_PARTITIONS && (await exists(queueName(stream, partitions)))) {
    throw new Error(`stream ${stream} has more than ${partitions} partitions (${queueName(stream, partitions)} exists): pass its partition count (partq stream describe ${stream})`);
  }
}

module.exports = { MAX_PARTITIONS, Producer, exchangeName, headersFor, partitionFor, queueName };
