/* runtime/data.h: where training tokens come from.
 *
 * Owns: the built-in synthetic corpus and llm.c token shards (memory-mapped, headers
 * checked against file length at open).
 * Does not own: which rank reads which sequences (the trainer computes global sequence
 * indices; this module turns an index into tokens).
 *
 * A dataset is a function from a global sequence index s >= 0 to T+1 tokens (inputs
 * are the first T, targets the last T). It is deterministic: the same index gives the
 * same tokens on every rank and at every world size. */
#ifndef MOE_RUNTIME_DATA_H
#define MOE_RUNTIME_DATA_H

#include <stdint.h>

#include "runtime/config.h"
#include "util/status.h"

typedef struct moe_data moe_data;

/* Opens the source named by cfg->data_source ("synthetic" or "shards", with
 * cfg->data_path a comma-separated list of llm.c shard files) for sequences of
 * cfg->seq_len + 1 tokens. Shards: every file is checked (magic 20240520, version 1,
 * token count against the file length, tokens < vocab_size is checked lazily per batch);
 * an error names the file and what is wrong. On failure *out is NULL. */
moe_status moe_data_create(moe_data **out, const moe_config *cfg);

/* Fills tokens (B, T+1), row b = sequence first_seq + b. Shards: sequence s starts at
 * token (s * T) modulo the usable length of the concatenated shards (wrapping = a new
 * epoch). Errors: a token >= vocab_size (names the file and the token position). */
moe_status moe_data_batch(moe_data *d, int32_t *tokens, int64_t first_seq, int B);

/* Number of tokens available (synthetic: INT64_MAX). */
int64_t moe_data_tokens(const moe_data *d);

/* Destroying NULL does nothing. */
void moe_data_destroy(moe_data *d);

/* llm.c shard header: 256 int32, [0] magic, [1] version, [2] token count; then uint16. */
#define MOE_SHARD_MAGIC 20240520
#define MOE_SHARD_VERSION 1
#define MOE_SHARD_HEADER_INTS 256

#endif
