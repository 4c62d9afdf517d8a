/* sched/placement.h: expert placement: which rank holds each expert of each MoE layer,
 * the contiguous baseline, the planner that groups co-activated experts under a balance
 * bound, and the plan file.
 *
 * Owns: moe_placement (expert -> rank and rank -> experts per MoE layer), the planner
 * (greedy grouping, then pairwise swaps), its objective, and the plan file format.
 * Does not own: the statistics (sched/stats.h), the traffic prediction (sched/cost.h), or
 * moving weights between ranks (runtime/).
 *
 * Dimension letters: Lm MoE layers, E experts per MoE layer, R ranks (of the expert-
 * parallel group), G ranks per node (rank r is on node r / G), El = E / R experts per rank.
 *
 * Objective of a placement (maximised; docs/scheduler.md explains it). With C_l the
 * co-activation counts of layer l, T_l the transitions l -> l+1, w the transition weight:
 *   rank level:  sum_l sum_{i<j on one rank} C_l(i,j) + w * sum_l sum_{rank_l(i) = rank_l+1(j)}
 * T_l(i,j) node level:  the same with "on one node" in place of "on one rank" compared
 * lexicographically: the rank level first, then the node level. For top-2 the rank-level
 * co-activation term is exactly the number of dispatch rows saved (a token whose two experts share
 * a rank is sent there once). Every rank's load (the sum of its experts' load) stays within max <=
 * (1 + slack) * mean. */
#ifndef MOE_SCHED_PLACEMENT_H
#define MOE_SCHED_PLACEMENT_H

#include <stdint.h>
#include <stdio.h>

#include "sched/stats.h"
#include "util/status.h"

typedef struct moe_placement {
    int layers;         /* Lm */
    int experts;        /* E */
    int ranks;          /* R */
    int ranks_per_node; /* G: R is a multiple of G */
    int per_rank;       /* El = E / R */
    int *expert_rank;   /* (Lm, E): rank holding each expert */
    int *expert_local;  /* (Lm, E): its index among that rank's experts */
    int *rank_experts;  /* (Lm, R, El): each rank's experts, ascending global ids */
} moe_placement;

/* Allocates the contiguous placement (expert e on rank e / El in every layer): the
 * baseline, and what the runtime does without a plan. Needs layers >= 1, experts >= 1,
 * ranks >= 1 dividing experts, ranks_per_node >= 1 dividing ranks. On failure *out is NULL
 * (MOE_ERR_INVALID, MOE_ERR_NOMEM). */
moe_status moe_placement_create(moe_placement **out, int layers, int experts, int ranks,
                                int ranks_per_node);

/* Destroying NULL does nothing. */
void moe_placement_destroy(moe_placement *p);

/* Sets layer `layer` from expert_rank (E): every rank must get exactly El experts, ids in
 * [0, R). Fills the inverse tables. On error (MOE_ERR_INVALID, naming the rank) the
 * placement is unchanged. */
moe_status moe_placement_set_layer(moe_placement *p, int layer, const int *expert_rank);

/* 1 if a and b have the same shape and tables, else 0. */
int moe_placement_equal(const moe_placement *a, const moe_placement *b);

/* max/mean of the rank loads of `layer` under the loads of s (1.0 when the layer has no
 * load). s must have the placement's layers and experts. */
double moe_placement_balance(const moe_placement *p, const moe_routing_stats *s, int layer);

typedef struct {
    double slack;             /* balance bound: max rank load <= (1 + slack) * mean; >= 0 */
    double transition_weight; /* weight of the inter-layer transitions in the objective; >= 0 */
    int max_moves;            /* cap on the swaps of one refinement, per layer (0: 64 * E;
                                 -1: none, the starts only) */
    int sweeps;               /* passes over the layers after the first, each seeing both
                                 neighbours' placements (0: none) */
} moe_plan_params;

/* The defaults: slack 0.1, transition_weight 0.25, max_moves 0 (64 * E), sweeps 4. */
moe_plan_params moe_plan_params_default(void);

typedef struct {
    int layers_relaxed;   /* layers whose bound could not be met: their bound became the
                             best balance the balance-only heuristic reached */
    double worst_balance; /* max over layers of max/mean rank load */
    double worst_bound;   /* max over layers of the bound used, as a multiple of the mean */
    int64_t moves;        /* swaps applied by the refinement, all starts and sweeps */
    int sweeps;           /* sweeps run after the first pass */
    double objective[2];  /* rank-level and node-level objective of the plan */
    double objective_contiguous[2]; /* the same for the contiguous placement */
} moe_plan_report;

/* Plans a placement for `ranks` ranks, `ranks_per_node` per node, from the statistics s
 * (params NULL: the defaults). Per layer, in order (a layer sees the placement of the one
 * before it through the transitions): the bound B = max((1 + slack) * mean, the max of a
 * balance-only placement); three starts (a greedy affinity grouping repaired to meet B, the
 * balance-only placement, the contiguous one when it meets B); each refined by the swap
 * that most improves the objective while keeping every rank within B (an expert of one rank
 * for an expert of another, or the contents of two ranks), to a fixed point or max_moves;
 * the best result is kept (ties: the earlier start). Then `sweeps` passes refine every
 * layer against both neighbours, until nothing moves. Deterministic: ties are broken by
 * the lower index. The result's objective is never below the contiguous placement's when
 * that meets the bound. report may be NULL. On failure *out is NULL. */
moe_status moe_plan_experts(moe_placement **out, const moe_routing_stats *s, int ranks,
                            int ranks_per_node, const moe_plan_params *params,
                            moe_plan_report *report);

/* Improves p in place by the swaps of moe_plan_experts (every layer against both
 * neighbours, max(1, sweeps) passes), from p itself: for a re-plan that should move few
 * experts. A layer's bound is that of moe_plan_experts, or p's own max if p exceeds it
 * (balance never gets worse). The objective never decreases. report may be NULL. */
moe_status moe_placement_refine(moe_placement *p, const moe_routing_stats *s,
                                const moe_plan_params *params, moe_plan_report *report);

/* The objective of p under s (see the top of this file): out[0] rank level, out[1] node
 * level. params NULL: the defaults (only transition_weight matters here). */
moe_status moe_placement_objective(const moe_placement *p, const moe_routing_stats *s,
                                   const moe_plan_params *params, double out[2]);

/* Writes the plan text (format in docs/scheduler.md):
 *   moe-dist placement v1 experts E ranks R
 *   layer 0: r0 r1 ... r{E-1}
 *   ...
 * `comment` (may be NULL, may hold several lines) goes after the header as '#' lines. */
moe_status moe_placement_write(const moe_placement *p, FILE *f, const char *comment);

/* Writes the plan file `path`. MOE_ERR_IO names the file. */
moe_status moe_placement_save(const moe_placement *p, const char *path, const char *comment);

/* Reads a plan file, validating it: the header, layers numbered 0, 1, ... in order, E rank
 * ids per line each in [0, R), exactly El experts per rank per layer, at least one layer.
 * Blank lines and '#' lines are skipped. ranks_per_node (0: all ranks on one node) must
 * divide R. Errors name the file and line (MOE_ERR_IO: cannot read; MOE_ERR_INVALID). On
 * failure *out is NULL. */
moe_status moe_placement_load(moe_placement **out, const char *path, int ranks_per_node);

#endif
