/* sched/cost.c: the traffic model of sched/cost.h: expected rows from statistics, exact
 * rows from a trace. */
#include "sched/cost.h"

#include <stdlib.h>
#include <string.h>

/* Expected number of members used, from S1 = sum of single counts and S2 = sum of pair
 * counts over a set of experts (both totals over the tokens): the Dawson-Sankoff lower
 * bound 2 S1/(j+1) - 2 S2/(j(j+1)), j = 1 + floor(2 S2 / S1). For tokens using at most
 * 2 members it is S1 - S2, exactly. */
static double union_rows(int64_t s1, int64_t s2)
{
    if (s1 <= 0)
        return 0.0;
    double j = (double)(2 * s2 / s1 + 1);
    return 2.0 * (double)s1 / (j + 1) - 2.0 * (double)s2 / (j * (j + 1));
}

/* The matching upper bound: a token using m <= k members counts m - (2/k) C(m,2) >= 1
 * (equality at m = 1 and m = k), so S1 - 2 S2 / k bounds the members used from above;
 * k is the most members a token can use. */
static double union_rows_upper(int64_t s1, int64_t s2, int k)
{
    return (double)s1 - (k > 1 ? 2.0 * (double)s2 / k : 0.0);
}

/* Splits rows by the token's source rank, uniform over R, into t's byte counts. */
static void split_expected(moe_traffic *t, int R, int G, size_t row_bytes)
{
    double rb = (double)row_bytes, rows = t->rows;
    t->bytes_rank = rows * rb / R;
    t->bytes_node = rows * rb * (G - 1) / R;
    t->bytes_remote = rows * rb * (R - G) / R;
    t->bytes_saved = (t->assignments - rows) * rb * (R - 1) / R;
}

static moe_status cost_layer(const moe_placement *p, const moe_routing_stats *s, int l,
                             size_t row_bytes, moe_traffic *out, int64_t *s1, int64_t *s2)
{
    const int E = p->experts, R = p->ranks, G = p->ranks_per_node, nodes = R / G;
    const int *r = p->expert_rank + (size_t)l * E;
    const int64_t *w = s->load + (size_t)l * E, *C = s->coact + (size_t)l * E * E;
    memset(out, 0, sizeof *out);
    out->tokens = (double)s->tokens[l];
    /* per rank (s1[0..R), s2[0..R)) and per node (s1[R..R+nodes), ...) */
    memset(s1, 0, sizeof(int64_t) * (R + nodes));
    memset(s2, 0, sizeof(int64_t) * (R + nodes));
    for (int i = 0; i < E; i++) {
        out->assignments += (double)w[i];
        s1[r[i]] += w[i];
        s1[R + r[i] / G] += w[i];
        for (int j = i + 1; j < E; j++) {
            if (r[i] == r[j])
                s2[r[i]] += C[(size_t)i * E + j];
            if (r[i] / G == r[j] / G)
                s2[R + r[i] / G] += C[(size_t)i * E + j];
        }
    }
    const int K = s->top_k > 0 ? s->top_k : 1, El = p->per_rank;
    for (int q = 0; q < R; q++) {
        out->rows += union_rows(s1[q], s2[q]);
        out->rows_upper += union_rows_upper(s1[q], s2[q], K < El ? K : El);
    }
    for (int n = 0; n < nodes; n++) {
        out->node_rows += union_rows(s1[R + n], s2[R + n]);
        out->node_rows_upper += union_rows_upper(s1[R + n], s2[R + n], K < El * G ? K : El * G);
    }
    out->exact = s->top_k <= 2;
    split_expected(out, R, G, row_bytes);
    if (l + 1 < s->layers) {
        const int *rn = p->expert_rank + (size_t)(l + 1) * E;
        const int64_t *T = s->trans + (size_t)l * E * E;
        for (int i = 0; i < E; i++)
            for (int j = 0; j < E; j++) {
                out->transitions += (double)T[(size_t)i * E + j];
                out->transitions_rank += r[i] == rn[j] ? (double)T[(size_t)i * E + j] : 0.0;
            }
    }
    return MOE_OK;
}

moe_status moe_cost_stats(const moe_placement *p, const moe_routing_stats *s, int layer,
                          size_t row_bytes, moe_traffic *out)
{
    memset(out, 0, sizeof *out);
    if (p->layers != s->layers || p->experts != s->experts)
        MOE_FAIL(MOE_ERR_INVALID,
                 "cost: placement of %d layers x %d experts, statistics of %d x %d", p->layers,
                 p->experts, s->layers, s->experts);
    if (layer < -1 || layer >= p->layers)
        MOE_FAIL(MOE_ERR_INVALID, "cost: layer %d out of range [-1, %d)", layer, p->layers);
    const int nodes = p->ranks / p->ranks_per_node;
    int64_t *scratch = malloc(sizeof(int64_t) * 2 * (size_t)(p->ranks + nodes));
    if (!scratch)
        MOE_FAIL(MOE_ERR_NOMEM, "cost: out of memory");
    int64_t *s1 = scratch, *s2 = scratch + p->ranks + nodes;
    out->exact = 1;
    for (int l = layer < 0 ? 0 : layer; l < (layer < 0 ? p->layers : layer + 1); l++) {
        moe_traffic t;
        cost_layer(p, s, l, row_bytes, &t, s1, s2);
        moe_traffic_add(out, &t);
    }
    free(scratch);
    return MOE_OK;
}

moe_status moe_cost_trace(const moe_placement *p, int layer, const int32_t *idx,
                          const int32_t *src_rank, int N, int K, size_t row_bytes, moe_traffic *out)
{
    memset(out, 0, sizeof *out);
    if (layer < 0 || layer >= p->layers)
        MOE_FAIL(MOE_ERR_INVALID, "cost: layer %d out of range [0, %d)", layer, p->layers);
    if (N < 0 || K < 1 || (N > 0 && !idx))
        MOE_FAIL(MOE_ERR_INVALID, "cost: bad trace (N = %d, K = %d)", N, K);
    const int E = p->experts, R = p->ranks, G = p->ranks_per_node, nodes = R / G;
    for (size_t i = 0; i < (size_t)N * K; i++)
        if (idx[i] >= E)
            MOE_FAIL(MOE_ERR_INVALID, "cost: expert id %d of token %zu is not below E = %d", idx[i],
                     i / K, E);
    for (int n = 0; src_rank && n < N; n++)
        if (src_rank[n] < 0 || src_rank[n] >= R)
            MOE_FAIL(MOE_ERR_INVALID, "cost: source rank %d of token %d is not in [0, %d)",
                     src_rank[n], n, R);
    /* per token: experts seen (stamp), experts per rank, nodes used (stamp) */
    int *stamp_e = malloc(sizeof(int) * E), *per_rank = calloc((size_t)R, sizeof(int));
    int *stamp_n = malloc(sizeof(int) * nodes), *used = malloc(sizeof(int) * R);
    if (!stamp_e || !per_rank || !stamp_n || !used) {
        free(stamp_e);
        free(per_rank);
        free(stamp_n);
        free(used);
        MOE_FAIL(MOE_ERR_NOMEM, "cost: out of memory");
    }
    for (int e = 0; e < E; e++)
        stamp_e[e] = -1;
    for (int n = 0; n < nodes; n++)
        stamp_n[n] = -1;
    const int *er = p->expert_rank + (size_t)layer * E;
    const double rb = (double)row_bytes;
    for (int t = 0; t < N; t++) {
        int n_used = 0, n_assign = 0;
        for (int k = 0; k < K; k++) {
            int e = idx[(size_t)t * K + k];
            if (e < 0 || stamp_e[e] == t)
                continue;
            stamp_e[e] = t;
            n_assign++;
            int q = er[e];
            if (per_rank[q]++ == 0)
                used[n_used++] = q;
            if (stamp_n[q / G] != t) {
                stamp_n[q / G] = t;
                out->node_rows += 1;
            }
        }
        if (n_assign == 0)
            continue;
        out->tokens += 1;
        out->assignments += n_assign;
        out->rows += n_used;
        for (int u = 0; src_rank && u < n_used; u++) {
            int q = used[u], src = src_rank[t];
            if (q == src) {
                out->bytes_rank += rb;
            } else {
                *(q / G == src / G ? &out->bytes_node : &out->bytes_remote) += rb;
                out->bytes_saved += (per_rank[q] - 1) * rb;
            }
        }
        for (int u = 0; u < n_used; u++)
            per_rank[used[u]] = 0;
    }
    if (!src_rank)
        split_expected(out, R, G, row_bytes);
    out->rows_upper = out->rows;
    out->node_rows_upper = out->node_rows;
    out->exact = 1;
    free(stamp_e);
    free(per_rank);
    free(stamp_n);
    free(used);
    return MOE_OK;
}

void moe_traffic_add(moe_traffic *dst, const moe_traffic *src)
{
    dst->tokens += src->tokens;
    dst->assignments += src->assignments;
    dst->rows += src->rows;
    dst->rows_upper += src->rows_upper;
    dst->node_rows += src->node_rows;
    dst->node_rows_upper += src->node_rows_upper;
    dst->bytes_rank += src->bytes_rank;
    dst->bytes_node += src->bytes_node;
    dst->bytes_remote += src->bytes_remote;
    dst->bytes_saved += src->bytes_saved;
    dst->transitions += src->transitions;
    dst->transitions_rank += src->transitions_rank;
    dst->exact = dst->exact && src->exact;
}

void moe_traffic_scale(moe_traffic *t, double f)
{
    t->tokens *= f;
    t->assignments *= f;
    t->rows *= f;
    t->rows_upper *= f;
    t->node_rows *= f;
    t->node_rows_upper *= f;
    t->bytes_rank *= f;
    t->bytes_node *= f;
    t->bytes_remote *= f;
    t->bytes_saved *= f;
    t->transitions *= f;
    t->transitions_rank *= f;
}

double moe_traffic_cross_rank(const moe_traffic *t) { return t->bytes_node + t->bytes_remote; }

static void print_change(FILE *out, double v, double base)
{
    if (base > 0)
        fprintf(out, " (%+.1f%%)", 100.0 * (v - base) / base);
}

void moe_traffic_print(FILE *out, const char *label, const moe_traffic *t, const moe_traffic *base)
{
    fprintf(out, "%s: rows %.0f", label, t->rows);
    if (!t->exact)
        fprintf(out, "..%.0f", t->rows_upper);
    if (base)
        print_change(out, t->rows, base->rows);
    fprintf(out, ", bytes: rank %.4g node %.4g remote %.4g", t->bytes_rank, t->bytes_node,
            t->bytes_remote);
    fprintf(out, ", cross-rank %.4g", moe_traffic_cross_rank(t));
    if (base)
        print_change(out, moe_traffic_cross_rank(t), moe_traffic_cross_rank(base));
    fprintf(out, ", node rows %.0f", t->node_rows);
    if (base)
        print_change(out, t->node_rows, base->node_rows);
    if (t->transitions > 0)
        fprintf(out, ", transitions on one rank %.1f%%",
                100.0 * t->transitions_rank / t->transitions);
    fprintf(out, "%s\n", t->exact ? "" : " (estimate)");
}
