'use strict';
// Node.js client for the kvcache.v1 contract. The .proto files are loaded at run
// time with @grpc/proto-loader, so this file needs no generated code.
//
//   const { KVCacheClient } = require('./client');
//   const client = new KVCacheClient({ blockd: '127.0.0.1:50051', computed: '127.0.0.1:50052' });
//   for await (const chunk of client.generate({ prompt: 'Hello', max_tokens: 8 })) process.stdout.write(chunk.text);
//   const { usage } = await client.complete({ prompt: 'Hello' });
//   const stats = await client.getStats();
//
// Field names are the proto's (snake_case); 64-bit counters come back as Numbers.

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'proto');
const PROTO_FILES = ['kvcache/v1/directory.proto', 'kvcache/v1/generation.proto'];
// stream_interval asking for the whole completion after the first token (uint32 max).
const WHOLE_COMPLETION = 4294967295;

let cachedPackage = null;

function loadContract() {
  if (cachedPackage === null) {
    const definition = protoLoader.loadSync(PROTO_FILES, {
      includeDirs: [PROTO_ROOT],
      keepCase: true,
      longs: Number,
      enums: String,
      defaults: true,
      oneofs: true,
    });
    cachedPackage = grpc.loadPackageDefinition(definition).kvcache.v1;
  }
  return cachedPackage;
}

// A failed call: one-line message like "blockd at 127.0.0.1:50051 is unreachable (UNAVAILABLE)".
class KVCacheError extends Error {
  constructor(service, address, error) {
    const codeName = Object.keys(grpc.status).find((k) => grpc.status[k] === error.code) || 'UNKNOWN';
    const details = String(error.details || error.message || '').replace(/\s+/g, ' ').trim();
    const where = `${service} at ${address}`;
    const message = error.code === grpc.status.UNAVAILABLE
      ? `${where} is unreachable (UNAVAILABLE)`
      : `${where}: ${details || 'no details'} (${codeName})`;
    super(message);
    this.name = 'KVCacheError';
    this.service = service;
    this.address = address;
    this.code = error.code;
    this.codeName = codeName;
    this.details = details;
  }
}

function credentials(tls) {
  if (!tls) return grpc.credentials.createInsecure();
  const fs = require('fs');
  const read = (p) => (p ? fs.readFileSync(p) : null);
  return grpc.credentials.createSsl(read(tls.rootCert), read(tls.clientKey), read(tls.clientCert));
}

function deadlineIn(seconds) {
  return new Date(Date.now() + seconds * 1000);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

class KVCacheClient {
  // options: { blockd, computed, adminToken, timeoutSeconds (unary, 30), generateTimeoutSeconds (600),
  //            maxAttempts (4, UNAVAILABLE only), tls: { rootCert, clientCert, clientKey } }
  constructor(options = {}) {
    const v1 = loadContract();
    this.blockdAddress = options.blockd || '127.0.0.1:50051';
    this.computedAddress = options.computed || '127.0.0.1:50052';
    this.adminToken = options.adminToken || null;
    this.timeoutSeconds = options.timeoutSeconds || 30;
    this.generateTimeoutSeconds = options.generateTimeoutSeconds || 600;
    this.maxAttempts = options.maxAttempts || 4;
    const creds = credentials(options.tls);
    this.generation = new v1.GenerationService(this.computedAddress, creds);
    this.admin = new v1.DirectoryAdminService(this.blockdAddress, creds);
    this.routing = new v1.RoutingService(this.blockdAddress, creds);
  }

  adminMetadata() {
    const metadata = new grpc.Metadata();
    if (this.adminToken) metadata.set('authorization', `Bearer ${this.adminToken}`);
    return metadata;
  }

  // One unary call with a deadline, retried on UNAVAILABLE with exponential backoff and jitter.
  async unary(service, address, stub, method, request, metadata = new grpc.Metadata()) {
    for (let attempt = 0; ; attempt += 1) {
      try {
        return await new Promise((resolve, reject) => {
          stub[method](request, metadata, { deadline: deadlineIn(this.timeoutSeconds) },
            (error, reply) => (error ? reject(error) : resolve(reply)));
        });
      } catch (error) {
        if (error.code === grpc.status.UNAVAILABLE && attempt + 1 < this.maxAttempts) {
          await sleep(Math.random() * Math.min(2000, 100 * 2 ** attempt));
          continue;
        }
        throw new KVCacheError(service, address, error);
      }
    }
  }

  // Streams GenerateResponse messages (one per token, or per request.stream_interval tokens): { request_id, token_ids, text, finish_reason, usage }.
  // request: { prompt | prompt_token_ids | messages, max_tokens, temperature, cache_salt, ... }
  async *generate(request) {
    const call = this.generation.Generate(request, new grpc.Metadata(),
      { deadline: deadlineIn(this.generateTimeoutSeconds) });
    try {
      for await (const message of call) {
        yield {
          request_id: message.request_id,
          token_ids: message.token_ids,
          text: message.text,
          finish_reason: message.finish_reason || null,
          usage: message.usage || null,
        };
      }
    } catch (error) {
      throw new KVCacheError('computed', this.computedAddress, error);
    } finally {
      call.cancel();
    }
  }

  // The whole completion: { request_id, text, token_ids, finish_reason, usage }. Asks for
  // it in two messages (stream_interval: the first token, then the rest) unless told.
  async complete(request) {
    const result = { request_id: '', text: '', token_ids: [], finish_reason: null, usage: null };
    for await (const chunk of this.generate({ stream_interval: WHOLE_COMPLETION, ...request })) {
      result.request_id = result.request_id || chunk.request_id;
      result.text += chunk.text;
      result.token_ids.push(...chunk.token_ids);
      if (chunk.finish_reason) {
        result.finish_reason = chunk.finish_reason;
        result.usage = chunk.usage;
      }
    }
    if (!result.finish_reason || !result.usage) {
      throw new Error(`stream from computed at ${this.computedAddress} ended without usage`);
    }
    return result;
  }

  tokenize(text, addSpecialTokens = true) {
    return this.unary('computed', this.computedAddress, this.generation, 'Tokenize',
      { text, add_special_tokens: addSpecialTokens }).then((reply) => reply.token_ids);
  }

  getModelInfo() {
    return this.unary('computed', this.computedAddress, this.generation, 'GetModelInfo', {});
  }

  // GetStatsResponse: { total: PoolStats, pools: [PoolStats], last_event_sequence }.
  getStats(poolId = '') {
    return this.unary('blockd', this.blockdAddress, this.admin, 'GetStats', { pool_id: poolId },
      this.adminMetadata());
  }

  flush({ poolId = '', cacheSalt = '' } = {}) {
    return this.unary('blockd', this.blockdAddress, this.admin, 'Flush',
      { pool_id: poolId, cache_salt: cacheSalt }, this.adminMetadata());
  }

  route(tokenIds, cacheSalt = '') {
    return this.unary('blockd', this.blockdAddress, this.routing, 'Route',
      { token_ids: tokenIds, cache_salt: cacheSalt });
  }

  close() {
    this.generation.close();
    this.admin.close();
    this.routing.close();
  }
}

module.exports = { KVCacheClient, KVCacheError, loadContract };
