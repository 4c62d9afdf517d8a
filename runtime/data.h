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

/* Whether d is the synthetic corpus (made on demand: reading it cannot fail). */
int moe_data_is_synthetic(const moe_data *d);

/* Destroying NULL does nothing. */
void moe_data_destroy(moe_data *d);

/* ---- the synthetic corpus, for tests, metrics and the docs (docs/data.md) ---- */

/* The rule a synthetic process generates by (process p has kind p % 4). With
 * [data] synthetic = topics every process is a topic (MOE_SYNTH_TOPIC). */
typedef enum {
    MOE_SYNTH_MARKOV = 0,      /* sparse Markov chain: 3 successors per token (0.6/0.3/0.1) */
    MOE_SYNTH_MOTIF = 1,       /* one of the process's 4 motifs (length 3..8), repeated */
    MOE_SYNTH_PROGRESSION = 2, /* x, x+d, x+2d, ... mod band width; d one of 3 per process */
    MOE_SYNTH_RUNS = 3,        /* runs of r equal tokens; run values follow a permutation */
    MOE_SYNTH_TOPIC = 4,       /* synthetic = topics: every token uniform in the band */
} moe_synth_kind;

typedef struct {
    int process; /* 0 .. synthetic_processes-1 (the topic with synthetic = topics) */
    moe_synth_kind kind;
    int32_t band_lo;    /* first token of the process's vocabulary band; also the marker
                           that starts each of its sequences */
    int32_t band_width; /* the band is [band_lo, band_lo + band_width) */
} moe_synth_info;

/* "markov", "motif", "progression", "runs", "topic"; "?" for anything else. */
const char *moe_synth_kind_name(moe_synth_kind kind);

/* Which process generates sequence `seq` of a synthetic dataset. Returns MOE_ERR_INVALID
 * for a shard dataset or seq < 0. */
moe_status moe_data_synthetic_info(const moe_data *d, int64_t seq, moe_synth_info *info);

/* Approximate entropy floor of the synthetic corpus in nats per token: the loss of a
 * perfect predictor far into a sequence, averaged over the processes (the first tokens
 * of a sequence cost more, up to log(band width)). Topics: the mean of log(band width).
 * Returns -1 for shards (unknown). */
double moe_data_entropy_floor(const moe_data *d);

/* llm.c shard header: 256 int32, [0] magic, [1] version, [2] token count; then uint16. */
#define MOE_SHARD_MAGIC 20240520
#define MOE_SHARD_VERSION 1
#define MOE_SHARD_HEADER_INTS 256

#endif
