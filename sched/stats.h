/* sched/stats.h: routing statistics of the MoE layers, the input of the expert scheduler.
 *
 * Owns: the counts (per MoE layer: tokens, expert load, co-activation of expert pairs,
 * transitions to the next MoE layer), their one contiguous int64 block (so the runtime
 * sums them across ranks in one call), the `routing_stats` file and the printout.
 * Does not own: collecting them during training or reducing them across ranks (runtime/),
 * nor placement (sched/placement.h).
 *
 * Dimension letters: Lm MoE layers (numbered 0..Lm-1 among the MoE layers only), E experts
 * per MoE layer, N tokens, K top-k.
 *
 * What one token adds in MoE layer l, given its set of distinct experts X (ids in [0, E);
 * negative ids, as for dropped slots, are ignored, and an id repeated within a token counts
 * once) and, when given, its set Y in MoE layer l-1:
 *   tokens[l]        += 1 if X is not empty
 *   load[l][e]       += 1 for each e in X
 *   coact[l][i][j]   += 1 for each ordered pair i != j of X (symmetric, diagonal 0)
 *   trans[l-1][i][j] += 1 for each i in Y, j in X */
#ifndef MOE_SCHED_STATS_H
#define MOE_SCHED_STATS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "util/status.h"

#define MOE_SCHED_MAX_K 64    /* largest top-k a trace may have */
#define MOE_SCHED_MAX_E 65536 /* largest number of experts per layer */
#define MOE_SCHED_MAX_LAYERS 65536

typedef struct moe_routing_stats {
    int layers;    /* Lm */
    int experts;   /* E */
    int top_k;     /* K of the traces added (0 until the first add) */
    int64_t steps; /* training steps the counts cover: set by the caller, kept by the file */

    int64_t *data;   /* every count below, one block of `count` int64 */
    size_t count;    /* Lm + Lm*E + Lm*E*E + (Lm-1)*E*E */
    int64_t *tokens; /* (Lm): tokens with at least one expert */
    int64_t *load;   /* (Lm, E): assignments per expert */
    int64_t *coact;  /* (Lm, E, E): tokens that chose both i and j */
    int64_t *trans;  /* (Lm-1, E, E): tokens that chose i in layer l and j in layer l+1 */
} moe_routing_stats;

/* Allocates zeroed statistics for `layers` MoE layers of `experts` experts (both >= 1 and
 * at most the MOE_SCHED_MAX_* limits). On failure *out is NULL (MOE_ERR_INVALID,
 * MOE_ERR_NOMEM). */
moe_status moe_routing_stats_create(moe_routing_stats **out, int layers, int experts);

/* Destroying NULL does nothing. */
void moe_routing_stats_destroy(moe_routing_stats *s);

/* Zeroes every count and `steps`; keeps the shape. top_k goes back to 0. */
void moe_routing_stats_reset(moe_routing_stats *s);

/* Adds N tokens of MoE layer `layer`: idx (N, K) their expert ids; prev_idx (N, K) the ids
 * of the same tokens in MoE layer layer-1, or NULL (no transitions counted; must be NULL
 * for layer 0). Ids < 0 are ignored; an id >= E is an error. K must match the K of earlier
 * adds. On error (MOE_ERR_INVALID) nothing is counted. */
moe_status moe_routing_stats_add(moe_routing_stats *s, int layer, const int32_t *idx,
                                 const int32_t *prev_idx, int N, int K);

/* dst += src: both must have the same layers and experts, and the same top_k where both
 * have one. Counts add; dst->steps becomes max(dst->steps, src->steps), as when merging
 * the statistics of several ranks over the same steps (summing dst->data over ranks with
 * an allreduce does the same; steps and top_k are not in the block). */
moe_status moe_routing_stats_merge(moe_routing_stats *dst, const moe_routing_stats *src);

/* Writes the `routing_stats` text file (format in docs/scheduler.md). MOE_ERR_IO when the
 * file cannot be written, naming it. */
moe_status moe_routing_stats_save(const moe_routing_stats *s, const char *path);

/* Reads a `routing_stats` file written by moe_routing_stats_save, validating it: header,
 * every line's keyword, indices, number of values, counts >= 0, co-activation symmetric
 * with a zero diagonal, loads consistent with tokens and top_k. Errors name the file and
 * line (MOE_ERR_IO: cannot read; MOE_ERR_INVALID: bad content). On failure *out is NULL. */
moe_status moe_routing_stats_load(moe_routing_stats **out, const char *path);

/* Prints, per MoE layer: tokens, expert load min / max / mean and max/mean, the `top`
 * most co-activated pairs and the `top` most frequent transitions to the next layer, each
 * with its share of the layer's tokens (for `moe-dist inspect`). */
moe_status moe_routing_stats_print(const moe_routing_stats *s, FILE *out, int top);

#endif
