/* sched/cost.h: the traffic a placement causes: dispatch rows and bytes that stay on the
 * token's rank, stay on its node, or cross nodes, predicted from routing statistics or
 * counted exactly on a trace.
 *
 * Owns: the traffic model of the runtime's token exchange (one row per token and rank
 * holding any of its experts; docs/scheduler.md) and its two estimators.
 * Does not own: the placement (sched/placement.h) or the bytes the runtime really sends
 * (runtime/ counts those; moe_fwd_stats.a2a_bytes).
 *
 * Dimension letters: N tokens, K top-k, E experts, R ranks, G ranks per node.
 *
 * Relation to the runtime's counters for one MoE layer and one forward, over all ranks,
 * with row_bytes = D * sizeof(real) (the token payload):
 *   a2a_bytes       = 2 * (bytes_node + bytes_remote)   (dispatch and combine)
 *   a2a_bytes_saved = 2 * bytes_saved
 * exactly when computed from a trace with the tokens' source ranks and the capacity's
 * dropped slots set to -1; in expectation otherwise. */
#ifndef MOE_SCHED_COST_H
#define MOE_SCHED_COST_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "sched/placement.h"
#include "sched/stats.h"
#include "util/status.h"

typedef struct {
    double tokens;           /* tokens with at least one expert */
    double assignments;      /* (token, distinct expert) pairs */
    double rows;             /* dispatch rows: one per (token, rank holding any of its experts) */
    double rows_upper;       /* an upper bound on rows (== rows when exact) */
    double node_rows;        /* one per (token, node holding any of its experts): what a
                                dispatch that sends a token once per node would send */
    double node_rows_upper;  /* an upper bound on node_rows (== node_rows when exact) */
    double bytes_rank;       /* row bytes whose destination is the token's own rank */
    double bytes_node;       /* ... another rank of the token's node */
    double bytes_remote;     /* ... a rank of another node */
    double bytes_saved;      /* row bytes not sent to other ranks because a token goes once
                                to each rank */
    double transitions;      /* statistics only: (expert in layer l, expert in l+1) pairs */
    double transitions_rank; /* those whose two experts are on one rank */
    int exact;               /* 1: rows and node_rows are exact, not estimated */
} moe_traffic;

/* Predicts the traffic of MoE layer `layer` (-1: all layers, summed) of placement p from
 * the statistics s (same layers and experts), with row_bytes bytes per row. The token's
 * source rank is taken as uniform over the R ranks and independent of its experts, so
 * bytes_rank : bytes_node : bytes_remote = 1 : G-1 : R-G of rows * row_bytes. Rows per rank
 * come from the expert loads and pair counts: exact when every token has at most 2
 * experts (top_k <= 2); for more, rows is the Dawson-Sankoff lower bound (exact when each
 * token has j or j+1 experts on a rank) and rows_upper the Sobel-Uppuluri-Kwerel upper
 * bound (docs/scheduler.md); the bytes follow rows. Totals over the counted tokens: divide
 * by s->steps for a step (moe_traffic_scale). */
moe_status moe_cost_stats(const moe_placement *p, const moe_routing_stats *s, int layer,
                          size_t row_bytes, moe_traffic *out);

/* Counts the traffic of a trace exactly: idx (N, K) expert ids of N tokens in MoE layer
 * `layer` (ids < 0 ignored, repeats count once), src_rank (N) the rank holding each token,
 * or NULL for the expectation over a uniform source rank (as moe_cost_stats). */
moe_status moe_cost_trace(const moe_placement *p, int layer, const int32_t *idx,
                          const int32_t *src_rank, int N, int K, size_t row_bytes,
                          moe_traffic *out);

/* dst += src (exact only if both are). */
void moe_traffic_add(moe_traffic *dst, const moe_traffic *src);

/* Multiplies every count by f (exact is kept). */
void moe_traffic_scale(moe_traffic *t, double f);

/* Bytes that leave the token's rank: bytes_node + bytes_remote. */
double moe_traffic_cross_rank(const moe_traffic *t);

/* Prints one line: rows, bytes within the rank / node / across nodes, and, when base is
 * given, each as a change from base (for `moe-dist plan-experts`). */
void moe_traffic_print(FILE *out, const char *label, const moe_traffic *t, const moe_traffic *base);

#endif
