#!/usr/bin/env node
'use strict';
// Smoke test of the Node.js client against live daemons:
//   node clients/node/smoke.js --blockd 127.0.0.1:50051 --computed 127.0.0.1:50052 [--admin-token T]
// Generates twice with a shared prefix (the second must report usage.cached_tokens > 0),
// reads blockd's stats, prints a JSON summary and exits non-zero on any failure.

const { KVCacheClient } = require('./client');

function parseArgs(argv) {
  const args = {
    blockd: process.env.KVCACHE_BLOCKD || '127.0.0.1:50051',
    computed: process.env.KVCACHE_COMPUTED || '127.0.0.1:50052',
    adminToken: process.env.KVCACHE_ADMIN_TOKEN || null,
    maxTokens: 4,
  };
  const names = { '--blockd': 'blockd', '--computed': 'computed', '--admin-token': 'adminToken',
    '--max-tokens': 'maxTokens' };
  for (let i = 0; i < argv.length; i += 1) {
    const [flag, inline] = argv[i].split(/=(.*)/s);
    const key = names[flag];
    if (!key) throw new Error(`unknown argument ${argv[i]} (use --blockd, --computed, --admin-token)`);
    const value = inline !== undefined ? inline : argv[(i += 1)];
    if (value === undefined) throw new Error(`${flag} needs a value`);
    args[key] = key === 'maxTokens' ? Number(value) : value;
  }
  return args;
}

// Long enough to fill several KV blocks with any tokenizer; the run id keeps it out of
// blocks that earlier runs left in the cache.
function sharedPrefix() {
  const runId = `${process.pid}-${Date.now()}`;
  return `Run ${runId}. The Node.js client shares this long prefix between two requests so that the `
    + 'second one finds its key/value blocks in the prefix cache instead of computing them again. '
    + 'The quick brown fox jumps over the lazy dog, and the lazy dog keeps on sleeping in the sun. ';
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const client = new KVCacheClient({ blockd: args.blockd, computed: args.computed, adminToken: args.adminToken });
  try {
    const prefix = sharedPrefix();
    const request = (suffix) => ({ prompt: prefix + suffix, max_tokens: args.maxTokens, temperature: 0 });
    const first = await client.complete(request('First question: what does the fox do?'));
    let streamedChunks = 0;
    let second = null;
    let text = '';
    for await (const chunk of client.generate(request('Second question: where is the dog?'))) {
      streamedChunks += 1;
      text += chunk.text;
      if (chunk.finish_reason) second = { finish_reason: chunk.finish_reason, usage: chunk.usage };
    }
    const stats = await client.getStats();
    const summary = {
      ok: true,
      blockd: args.blockd,
      computed: args.computed,
      first: { usage: first.usage, finish_reason: first.finish_reason, text: first.text },
      second: { usage: second && second.usage, finish_reason: second && second.finish_reason, text,
        streamed_chunks: streamedChunks },
      stats: stats.total,
    };
    const failures = [];
    if (!second || !second.usage) failures.push('second stream ended without usage');
    else if (!(second.usage.cached_tokens > 0)) failures.push('second request reported no cached tokens');
    if (!(stats.total.hit_tokens > 0)) failures.push('blockd stats count no hit tokens');
    if (first.usage.completion_tokens < 1) failures.push('first request generated no tokens');
    if (failures.length) {
      summary.ok = false;
      summary.failures = failures;
    }
    console.log(JSON.stringify(summary, null, 2));
    return summary.ok ? 0 : 1;
  } finally {
    client.close();
  }
}

main().then((code) => process.exit(code)).catch((error) => {
  console.log(JSON.stringify({ ok: false, error: error.message }));
  console.error(`error: ${error.message}`);
  process.exit(error.name === 'KVCacheError' ? 3 : 1);
});
