'use strict';
// Checks partitionFor against partq's golden vectors: node vectors.js PATH/partition-vectors.json
const fs = require('node:fs');
const murmur = require('murmurhash3js-revisited');
const { partitionFor } = require('./partq');

const path = process.argv[2];
if (!path) {
  console.error('usage: node vectors.js PATH/partition-vectors.json');
  process.exit(2);
}
const { vectors } = JSON.parse(fs.readFileSync(path, 'utf8'));
const problems = [];
let checked = 0;
for (const v of vectors) {
  const key = 'key_hex' in v ? Buffer.from(v.key_hex, 'hex') : v.key;
  const name = 'key_hex' in v ? `hex ${v.key_hex.slice(0, 16)}…` : JSON.stringify(v.key);
  const bytes = typeof key === 'string' ? Buffer.from(key, 'utf8') : key;
  const hash = murmur.x86.hash32(bytes, 0);
  if (hash !== v.murmur3_x86_32) problems.push(`key ${name}: hash ${hash}, expected ${v.murmur3_x86_32}`);
  for (const [partitions, expected] of Object.entries(v.partition)) {
    const got = partitionFor(key, Number(partitions));
    if (got !== expected) problems.push(`key ${name} mod ${partitions}: ${got}, expected ${expected}`);
    checked += 1;
  }
}
console.log(JSON.stringify({ vectors: vectors.length, checked, problems }));
process.exit(problems.length ? 1 : 0);
