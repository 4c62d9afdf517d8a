/* sched/placement.c: the placement table and the planner (sched/placement.h says what
 * is optimised; docs/scheduler.md explains why). The plan file is in sched/plan_file.c.
 *
 * The planner works on one layer at a time in a `work` state that keeps, for the current
 * (partial) placement, every expert's co-activation with each rank and each node, so the
 * gain of a swap costs O(1) and applying it O(E). */
#include "sched/placement.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- the table ---- */

moe_status moe_placement_create(moe_placement **out, int layers, int experts, int ranks,
                                int ranks_per_node)
{
    *out = NULL;
    if (layers < 1 || layers > MOE_SCHED_MAX_LAYERS || experts < 1 || experts > MOE_SCHED_MAX_E)
        MOE_FAIL(MOE_ERR_INVALID, "placement: %d layers, %d experts (need 1..%d, 1..%d)", layers,
                 experts, MOE_SCHED_MAX_LAYERS, MOE_SCHED_MAX_E);
    if (ranks < 1 || experts % ranks != 0)
        MOE_FAIL(MOE_ERR_INVALID, "placement: %d ranks must divide %d experts", ranks, experts);
    if (ranks_per_node < 1 || ranks % ranks_per_node != 0)
        MOE_FAIL(MOE_ERR_INVALID, "placement: %d ranks per node must divide %d ranks",
                 ranks_per_node, ranks);
    moe_placement *p = calloc(1, sizeof *p);
    size_t n = (size_t)layers * experts;
    if (!p)
        MOE_FAIL(MOE_ERR_NOMEM, "placement: out of memory");
    p->expert_rank = malloc(sizeof(int) * n);
    p->expert_local = malloc(sizeof(int) * n);
    p->rank_experts = malloc(sizeof(int) * n);
    if (!p->expert_rank || !p->expert_local || !p->rank_experts) {
        moe_placement_destroy(p);
        MOE_FAIL(MOE_ERR_NOMEM, "placement: out of memory (%d layers, %d experts)", layers,
                 experts);
    }
    p->layers = layers;
    p->experts = experts;
    p->ranks = ranks;
    p->ranks_per_node = ranks_per_node;
    p->per_rank = experts / ranks;
    for (size_t i = 0; i < n; i++) {
        int e = (int)(i % experts);
        p->expert_rank[i] = e / p->per_rank;
        p->expert_local[i] = e % p->per_rank;
        p->rank_experts[i] = e;
    }
    *out = p;
    return MOE_OK;
}

void moe_placement_destroy(moe_placement *p)
{
    if (!p)
        return;
    free(p->expert_rank);
    free(p->expert_local);
    free(p->rank_experts);
    free(p);
}

moe_status moe_placement_set_layer(moe_placement *p, int layer, const int *expert_rank)
{
    const int E = p->experts, R = p->ranks, El = p->per_rank;
    if (layer < 0 || layer >= p->layers)
        MOE_FAIL(MOE_ERR_INVALID, "placement: layer %d out of range [0, %d)", layer, p->layers);
    int *fill = calloc((size_t)R, sizeof(int));
    if (!fill)
        MOE_FAIL(MOE_ERR_NOMEM, "placement: out of memory");
    for (int e = 0; e < E; e++) {
        int r = expert_rank[e];
        if (r < 0 || r >= R) {
            free(fill);
            MOE_FAIL(MOE_ERR_INVALID, "placement: layer %d: expert %d on rank %d, not in [0, %d)",
                     layer, e, r, R);
        }
        fill[r]++;
    }
    for (int r = 0; r < R; r++)
        if (fill[r] != El) {
            int got = fill[r];
            free(fill);
            MOE_FAIL(MOE_ERR_INVALID, "placement: layer %d: rank %d gets %d experts, expected %d",
                     layer, r, got, El);
        }
    memset(fill, 0, sizeof(int) * R);
    int *er = p->expert_rank + (size_t)layer * E, *el = p->expert_local + (size_t)layer * E;
    int *re = p->rank_experts + (size_t)layer * E;
    for (int e = 0; e < E; e++) { /* ascending e: each rank's list comes out sorted */
        int r = expert_rank[e];
        er[e] = r;
        el[e] = fill[r];
        re[r * El + fill[r]++] = e;
    }
    free(fill);
    return MOE_OK;
}

int moe_placement_equal(const moe_placement *a, const moe_placement *b)
{
    if (a->layers != b->layers || a->experts != b->experts || a->ranks != b->ranks ||
        a->ranks_per_node != b->ranks_per_node)
        return 0;
    size_t n = sizeof(int) * (size_t)a->layers * a->experts;
    return memcmp(a->expert_rank, b->expert_rank, n) == 0 &&
           memcmp(a->expert_local, b->expert_local, n) == 0 &&
           memcmp(a->rank_experts, b->rank_experts, n) == 0;
}

double moe_placement_balance(const moe_placement *p, const moe_routing_stats *s, int layer)
{
    const int E = p->experts, R = p->ranks;
    const int64_t *w = s->load + (size_t)layer * E;
    const int *er = p->expert_rank + (size_t)layer * E;
    int64_t sum = 0, max = 0;
    for (int r = 0; r < R; r++) {
        int64_t W = 0;
        for (int e = 0; e < E; e++)
            W += er[e] == r ? w[e] : 0;
        sum += W;
        max = W > max ? W : max;
    }
    return sum > 0 ? (double)max * R / (double)sum : 1.0;
}

moe_plan_params moe_plan_params_default(void)
{
    return (moe_plan_params){.slack = 0.1, .transition_weight = 0.25, .max_moves = 0, .sweeps = 4};
}

/* ---- scores: (rank level, node level), compared lexicographically ---- */

typedef struct {
    double a, b;
} score2;

/* x strictly better than y, beyond rounding of sums of integers times the weight. */
static int better(score2 x, score2 y)
{
    double ta = 1e-9 * (1.0 + fabs(x.a) + fabs(y.a));
    if (x.a > y.a + ta)
        return 1;
    if (x.a < y.a - ta)
        return 0;
    return x.b > y.b + 1e-9 * (1.0 + fabs(x.b) + fabs(y.b));
}

static int same_score(score2 x, score2 y) { return !better(x, y) && !better(y, x); }

/* ---- the per-layer work state ---- */

typedef struct {
    int E, R, G, El, nodes;
    double wt;           /* transition weight */
    double bound;        /* max rank load allowed */
    const int64_t *A;    /* (E, E) co-activation */
    const int64_t *w;    /* (E) load */
    int64_t *pref;       /* (E, R): transitions to neighbour layers' experts on each rank */
    int64_t *prefn;      /* (E, nodes): the same per node */
    int *rank;           /* (E): current rank, -1 while unplaced */
    int64_t *S;          /* (E, R): sum of A(e, f) over f on the rank */
    int64_t *Nd;         /* (E, nodes): sum of A(e, f) over f on the node */
    int64_t *W;          /* (R): rank loads */
    int *fill;           /* (R): experts on each rank */
    int *members;        /* (R, El): scratch for rank swaps */
    int *order;          /* (E): scratch */
    int64_t moves;       /* swaps applied since refine() or a start began */
    int64_t total_moves; /* swaps applied by refine() in all */
    int64_t max_moves;
} work;

static void work_free(work *wk)
{
    free(wk->pref);
    free(wk->prefn);
    free(wk->rank);
    free(wk->S);
    free(wk->Nd);
    free(wk->W);
    free(wk->fill);
    free(wk->members);
    free(wk->order);
}

static moe_status work_alloc(work *wk, int E, int R, int G)
{
    memset(wk, 0, sizeof *wk);
    wk->E = E;
    wk->R = R;
    wk->G = G;
    wk->El = E / R;
    wk->nodes = R / G;
    wk->pref = malloc(sizeof(int64_t) * E * R);
    wk->prefn = malloc(sizeof(int64_t) * E * wk->nodes);
    wk->rank = malloc(sizeof(int) * E);
    wk->S = malloc(sizeof(int64_t) * E * R);
    wk->Nd = malloc(sizeof(int64_t) * E * wk->nodes);
    wk->W = malloc(sizeof(int64_t) * R);
    wk->fill = malloc(sizeof(int) * R);
    wk->members = malloc(sizeof(int) * E);
    wk->order = malloc(sizeof(int) * E);
    if (!wk->pref || !wk->prefn || !wk->rank || !wk->S || !wk->Nd || !wk->W || !wk->fill ||
        !wk->members || !wk->order) {
        work_free(wk);
        MOE_FAIL(MOE_ERR_NOMEM, "planner: out of memory (%d experts, %d ranks)", E, R);
    }
    return MOE_OK;
}

static void work_clear(work *wk)
{
    const int E = wk->E, R = wk->R;
    for (int e = 0; e < E; e++)
        wk->rank[e] = -1;
    memset(wk->S, 0, sizeof(int64_t) * E * R);
    memset(wk->Nd, 0, sizeof(int64_t) * E * wk->nodes);
    memset(wk->W, 0, sizeof(int64_t) * R);
    memset(wk->fill, 0, sizeof(int) * R);
}

static void work_place(work *wk, int e, int q)
{
    const int E = wk->E, R = wk->R, n = q / wk->G;
    wk->rank[e] = q;
    wk->W[q] += wk->w[e];
    wk->fill[q]++;
    for (int f = 0; f < E; f++) {
        int64_t a = wk->A[(size_t)f * E + e];
        wk->S[(size_t)f * R + q] += a;
        wk->Nd[(size_t)f * wk->nodes + n] += a;
    }
}

static void work_load(work *wk, const int *ranks)
{
    work_clear(wk);
    for (int e = 0; e < wk->E; e++)
        work_place(wk, e, ranks[e]);
}

static int64_t max_load(const work *wk)
{
    int64_t m = 0;
    for (int q = 0; q < wk->R; q++)
        m = wk->W[q] > m ? wk->W[q] : m;
    return m;
}

static int within(const work *wk, int64_t W) { return (double)W <= wk->bound; }

/* The score of the (complete) current placement. */
static score2 work_score(const work *wk)
{
    const int R = wk->R, nodes = wk->nodes;
    int64_t sr = 0, sn = 0, pr = 0, pn = 0;
    for (int e = 0; e < wk->E; e++) {
        int q = wk->rank[e], n = q / wk->G;
        sr += wk->S[(size_t)e * R + q];
        sn += wk->Nd[(size_t)e * nodes + n];
        pr += wk->pref[(size_t)e * R + q];
        pn += wk->prefn[(size_t)e * nodes + n];
    }
    /* S and Nd count each pair from both ends */
    return (score2){0.5 * (double)sr + wk->wt * (double)pr, 0.5 * (double)sn + wk->wt * (double)pn};
}

/* Gain of swapping expert a (rank p) with expert b (rank q), p != q. */
static score2 swap_gain(const work *wk, int a, int b)
{
    const int R = wk->R, nodes = wk->nodes, p = wk->rank[a], q = wk->rank[b];
    const int np = p / wk->G, nq = q / wk->G;
    const int64_t ab = wk->A[(size_t)a * wk->E + b];
    const int64_t *Sa = wk->S + (size_t)a * R, *Sb = wk->S + (size_t)b * R;
    const int64_t *Pa = wk->pref + (size_t)a * R, *Pb = wk->pref + (size_t)b * R;
    int64_t dr = Sa[q] + Sb[p] - Sa[p] - Sb[q] - 2 * ab;
    int64_t dp = Pa[q] + Pb[p] - Pa[p] - Pb[q];
    int64_t dn = 0, dpn = 0;
    if (np != nq) {
        const int64_t *Na = wk->Nd + (size_t)a * nodes, *Nb = wk->Nd + (size_t)b * nodes;
        const int64_t *Qa = wk->prefn + (size_t)a * nodes, *Qb = wk->prefn + (size_t)b * nodes;
        dn = Na[nq] + Nb[np] - Na[np] - Nb[nq] - 2 * ab;
        dpn = Qa[nq] + Qb[np] - Qa[np] - Qb[nq];
    }
    return (score2){(double)dr + wk->wt * (double)dp, (double)dn + wk->wt * (double)dpn};
}

static void apply_swap(work *wk, int a, int b)
{
    const int E = wk->E, R = wk->R, nodes = wk->nodes, p = wk->rank[a], q = wk->rank[b];
    const int np = p / wk->G, nq = q / wk->G;
    for (int f = 0; f < E; f++) {
        int64_t d = wk->A[(size_t)f * E + a] - wk->A[(size_t)f * E + b];
        wk->S[(size_t)f * R + p] -= d;
        wk->S[(size_t)f * R + q] += d;
        if (np != nq) {
            wk->Nd[(size_t)f * nodes + np] -= d;
            wk->Nd[(size_t)f * nodes + nq] += d;
        }
    }
    wk->W[p] += wk->w[b] - wk->w[a];
    wk->W[q] += wk->w[a] - wk->w[b];
    wk->rank[a] = q;
    wk->rank[b] = p;
    wk->moves++;
}

/* Fills wk->members: the experts of rank r at members[r * El ...], ascending. */
static void list_members(work *wk)
{
    memset(wk->fill, 0, sizeof(int) * wk->R);
    for (int e = 0; e < wk->E; e++) {
        int r = wk->rank[e];
        wk->members[r * wk->El + wk->fill[r]++] = e;
    }
}

/* Gain of exchanging the whole contents of ranks p and q (needs list_members). The
 * rank-level co-activation does not change; the transitions and the node level may. */
static score2 rank_swap_gain(const work *wk, int p, int q)
{
    const int R = wk->R, nodes = wk->nodes, El = wk->El;
    const int np = p / wk->G, nq = q / wk->G;
    int64_t dp = 0, dn = 0, dpn = 0;
    for (int side = 0; side < 2; side++) {
        int from = side ? q : p, to = side ? p : q, nf = from / wk->G, nt = to / wk->G;
        for (int k = 0; k < El; k++) {
            int e = wk->members[from * El + k];
            const int64_t *Se = wk->S + (size_t)e * R, *Ne = wk->Nd + (size_t)e * nodes;
            const int64_t *Pe = wk->pref + (size_t)e * R, *Qe = wk->prefn + (size_t)e * nodes;
            dp += Pe[to] - Pe[from];
            if (np != nq) {
                dn += Ne[nt] - Se[to] - Ne[nf] + Se[from];
                dpn += Qe[nt] - Qe[nf];
            }
        }
    }
    return (score2){wk->wt * (double)dp, (double)dn + wk->wt * (double)dpn};
}

static void apply_rank_swap(work *wk, int p, int q)
{
    const int E = wk->E, R = wk->R, nodes = wk->nodes;
    for (int e = 0; e < E; e++) {
        int *r = &wk->rank[e];
        *r = *r == p ? q : *r == q ? p : *r;
        int64_t *Se = wk->S + (size_t)e * R, t = Se[p];
        Se[p] = Se[q];
        Se[q] = t;
        int64_t *Ne = wk->Nd + (size_t)e * nodes;
        memset(Ne, 0, sizeof(int64_t) * nodes);
        for (int r2 = 0; r2 < R; r2++)
            Ne[r2 / wk->G] += Se[r2];
    }
    int64_t t = wk->W[p];
    wk->W[p] = wk->W[q];
    wk->W[q] = t;
    wk->moves++;
}

/* Steepest ascent: applies the best strictly improving swap (experts first, then whole
 * ranks) that keeps every rank within the bound, until none is left or max_moves. */
static void refine(work *wk)
{
    const int E = wk->E, R = wk->R;
    const score2 zero = {0, 0};
    wk->moves = 0;
    while (wk->moves < wk->max_moves) {
        score2 best = zero;
        int ba = -1, bb = -1;
        for (int a = 0; a < E; a++)
            for (int b = a + 1; b < E; b++) {
                int p = wk->rank[a], q = wk->rank[b];
                if (p == q)
                    continue;
                int64_t d = wk->w[a] - wk->w[b];
                if (!within(wk, wk->W[p] - d) || !within(wk, wk->W[q] + d))
                    continue;
                score2 g = swap_gain(wk, a, b);
                if (better(g, best)) {
                    best = g;
                    ba = a;
                    bb = b;
                }
            }
        if (ba >= 0) {
            apply_swap(wk, ba, bb);
            continue;
        }
        list_members(wk);
        for (int p = 0; p < R; p++)
            for (int q = p + 1; q < R; q++) {
                score2 g = rank_swap_gain(wk, p, q);
                if (better(g, best)) {
                    best = g;
                    ba = p;
                    bb = q;
                }
            }
        if (ba < 0)
            break;
        apply_rank_swap(wk, ba, bb);
    }
    wk->total_moves += wk->moves;
}

/* ---- the starts ---- */

/* Balance only: longest processing time first with El slots per rank (experts by load,
 * heaviest first, each to the least loaded rank with room), then swaps that lower the
 * most loaded rank while keeping its partner strictly below it (the sum of squared rank
 * loads falls at each, so this ends). */
static void start_balance(work *wk)
{
    const int E = wk->E, R = wk->R;
    for (int e = 0; e < E; e++)
        wk->order[e] = e;
    for (int i = 1; i < E; i++) { /* insertion sort: load desc, then id asc */
        int e = wk->order[i], j = i;
        while (j > 0 && wk->w[wk->order[j - 1]] < wk->w[e]) {
            wk->order[j] = wk->order[j - 1];
            j--;
        }
        wk->order[j] = e;
    }
    work_clear(wk);
    for (int i = 0; i < E; i++) {
        int best = -1;
        for (int q = 0; q < R; q++)
            if (wk->fill[q] < wk->El && (best < 0 || wk->W[q] < wk->W[best]))
                best = q;
        work_place(wk, wk->order[i], best);
    }
    for (int64_t iter = 0; iter < (int64_t)E * E * 4; iter++) {
        int q = 0;
        for (int r = 1; r < R; r++)
            q = wk->W[r] > wk->W[q] ? r : q;
        int64_t best_max = wk->W[q];
        int ba = -1, bb = -1;
        for (int a = 0; a < E; a++) {
            if (wk->rank[a] != q)
                continue;
            for (int b = 0; b < E; b++) {
                int p = wk->rank[b];
                int64_t d = wk->w[a] - wk->w[b];
                if (p == q || d <= 0 || wk->W[p] + d >= wk->W[q])
                    continue;
                int64_t m = wk->W[q] - d > wk->W[p] + d ? wk->W[q] - d : wk->W[p] + d;
                if (m < best_max) {
                    best_max = m;
                    ba = a;
                    bb = b;
                }
            }
        }
        if (ba < 0)
            break;
        apply_swap(wk, ba, bb);
    }
}

/* Affinity: fills rank 0, 1, ... in turn; each slot takes the unplaced expert with the
 * highest gain towards the rank (co-activation with the rank's experts and transitions
 * to its neighbours' experts, then the same towards the node), ties to the heavier, then
 * the lower id (so the first expert of a rank is the heaviest left when nothing else
 * speaks). An expert is preferred when the rank could still end within the bound with it
 * and the lightest experts left in its remaining slots. */
static void start_greedy(work *wk)
{
    const int E = wk->E, R = wk->R, El = wk->El, nodes = wk->nodes;
    work_clear(wk);
    for (int q = 0; q < R; q++) {
        const int n = q / wk->G;
        for (int slot = 0; slot < El; slot++) {
            int m1 = -1, m2 = -1; /* the two lightest unplaced experts */
            for (int e = 0; e < E; e++) {
                if (wk->rank[e] >= 0)
                    continue;
                if (m1 < 0 || wk->w[e] < wk->w[m1]) {
                    m2 = m1;
                    m1 = e;
                } else if (m2 < 0 || wk->w[e] < wk->w[m2]) {
                    m2 = e;
                }
            }
            int best = -1, best_ok = 0;
            score2 best_gain = {0, 0};
            for (int e = 0; e < E; e++) {
                if (wk->rank[e] >= 0)
                    continue;
                int rest = El - slot - 1, light = e == m1 ? m2 : m1;
                int64_t low =
                    wk->W[q] + wk->w[e] + (rest > 0 && light >= 0 ? rest * wk->w[light] : 0);
                int ok = within(wk, low);
                score2 g = {(double)wk->S[(size_t)e * R + q] +
                                wk->wt * (double)wk->pref[(size_t)e * R + q],
                            (double)wk->Nd[(size_t)e * nodes + n] +
                                wk->wt * (double)wk->prefn[(size_t)e * nodes + n]};
                int take = best < 0 || ok > best_ok ||
                           (ok == best_ok && (better(g, best_gain) || (same_score(g, best_gain) &&
                                                                       wk->w[e] > wk->w[best])));
                if (take) {
                    best = e;
                    best_ok = ok;
                    best_gain = g;
                }
            }
            work_place(wk, best, q);
        }
    }
}

/* Brings the greedy start within the bound: while the most loaded rank exceeds it, swaps
 * one of its experts for a lighter one of a rank that stays strictly below it (preferring
 * partners that stay within the bound, then the best gain). Returns 1 if within. */
static int repair(work *wk)
{
    const int E = wk->E, R = wk->R;
    for (int64_t iter = 0; iter < (int64_t)E * E * 4; iter++) {
        int q = 0;
        for (int r = 1; r < R; r++)
            q = wk->W[r] > wk->W[q] ? r : q;
        if (within(wk, wk->W[q]))
            return 1;
        int ba = -1, bb = -1, best_ok = 0;
        score2 best_gain = {0, 0};
        for (int a = 0; a < E; a++) {
            if (wk->rank[a] != q)
                continue;
            for (int b = 0; b < E; b++) {
                int p = wk->rank[b];
                int64_t d = wk->w[a] - wk->w[b];
                if (p == q || d <= 0 || wk->W[p] + d >= wk->W[q])
                    continue;
                int ok = within(wk, wk->W[p] + d);
                score2 g = swap_gain(wk, a, b);
                if (ba < 0 || ok > best_ok || (ok == best_ok && better(g, best_gain))) {
                    ba = a;
                    bb = b;
                    best_ok = ok;
                    best_gain = g;
                }
            }
        }
        if (ba < 0)
            return 0;
        apply_swap(wk, ba, bb);
    }
    return within(wk, max_load(wk));
}

/* ---- layers ---- */

/* pref for layer l from the placed neighbours in `ranks` (Lm, E): transitions from experts
 * of layer l-1 on each rank into e, and from e into experts of layer l+1 on each rank. */
static void set_pref(work *wk, const moe_routing_stats *s, const int *ranks, int l, int use_prev,
                     int use_next)
{
    const int E = wk->E, R = wk->R;
    memset(wk->pref, 0, sizeof(int64_t) * E * R);
    if (use_prev && l > 0) {
        const int64_t *T = s->trans + (size_t)(l - 1) * E * E;
        const int *rp = ranks + (size_t)(l - 1) * E;
        for (int i = 0; i < E; i++)
            for (int e = 0; e < E; e++)
                wk->pref[(size_t)e * R + rp[i]] += T[(size_t)i * E + e];
    }
    if (use_next && l + 1 < s->layers) {
        const int64_t *T = s->trans + (size_t)l * E * E;
        const int *rn = ranks + (size_t)(l + 1) * E;
        for (int e = 0; e < E; e++)
            for (int j = 0; j < E; j++)
                wk->pref[(size_t)e * R + rn[j]] += T[(size_t)e * E + j];
    }
    memset(wk->prefn, 0, sizeof(int64_t) * E * wk->nodes);
    for (int e = 0; e < E; e++)
        for (int q = 0; q < R; q++)
            wk->prefn[(size_t)e * wk->nodes + q / wk->G] += wk->pref[(size_t)e * R + q];
}

/* Sets wk->bound for the layer; returns 1 if the slack bound had to be relaxed. Leaves
 * the balance-only start in wk. */
static int set_bound(work *wk, double slack)
{
    int64_t sum = 0;
    for (int e = 0; e < wk->E; e++)
        sum += wk->w[e];
    double target = (1.0 + slack) * (double)sum / wk->R;
    wk->bound = INFINITY;
    start_balance(wk);
    double reached = (double)max_load(wk);
    wk->bound = reached > target ? reached : target;
    return reached > target;
}

/* 1 if the contiguous placement keeps every rank of the layer within the bound. */
static int contiguous_within(const work *wk)
{
    for (int q = 0; q < wk->R; q++) {
        int64_t W = 0;
        for (int k = 0; k < wk->El; k++)
            W += wk->w[q * wk->El + k];
        if (!within(wk, W))
            return 0;
    }
    return 1;
}

/* Plans one layer from the three starts; writes the best to out (E). */
static void plan_layer(work *wk, int *out, int *scratch)
{
    const int E = wk->E;
    score2 best_score = {0, 0};
    int have = 0;
    for (int start = 0; start < 3; start++) {
        if (start == 0) {
            start_greedy(wk);
            if (!repair(wk))
                continue;
        } else if (start == 1) {
            start_balance(wk);
        } else {
            for (int e = 0; e < E; e++)
                scratch[e] = e / wk->El;
            work_load(wk, scratch);
            if (!within(wk, max_load(wk)))
                continue;
        }
        refine(wk);
        score2 sc = work_score(wk);
        if (!have || better(sc, best_score)) {
            have = 1;
            best_score = sc;
            memcpy(out, wk->rank, sizeof(int) * E);
        }
    }
}

/* Refines every layer against both neighbours, until a pass moves nothing or `sweeps`
 * passes. Returns the passes run. */
static int sweep_layers(work *wk, const moe_routing_stats *s, int *ranks, const double *bounds,
                        int sweeps)
{
    const int E = s->experts;
    int done = 0;
    for (; done < sweeps; done++) {
        int64_t moved = 0;
        for (int l = 0; l < s->layers; l++) {
            wk->A = s->coact + (size_t)l * E * E;
            wk->w = s->load + (size_t)l * E;
            wk->bound = bounds[l];
            set_pref(wk, s, ranks, l, 1, 1);
            work_load(wk, ranks + (size_t)l * E);
            refine(wk);
            moved += wk->moves;
            memcpy(ranks + (size_t)l * E, wk->rank, sizeof(int) * E);
        }
        if (moved == 0) {
            done++;
            break;
        }
    }
    return done;
}

static moe_status fill_placement(moe_placement *p, const int *ranks)
{
    for (int l = 0; l < p->layers; l++)
        MOE_CHECK(moe_placement_set_layer(p, l, ranks + (size_t)l * p->experts));
    return MOE_OK;
}

moe_status moe_placement_objective(const moe_placement *p, const moe_routing_stats *s,
                                   const moe_plan_params *params, double out[2])
{
    if (p->layers != s->layers || p->experts != s->experts)
        MOE_FAIL(MOE_ERR_INVALID, "placement of %d layers x %d experts, statistics of %d x %d",
                 p->layers, p->experts, s->layers, s->experts);
    moe_plan_params def = moe_plan_params_default();
    const double wt = (params ? params : &def)->transition_weight;
    const int E = p->experts, G = p->ranks_per_node;
    int64_t cr = 0, cn = 0, tr = 0, tn = 0;
    for (int l = 0; l < s->layers; l++) {
        const int *r = p->expert_rank + (size_t)l * E;
        const int64_t *C = s->coact + (size_t)l * E * E;
        for (int i = 0; i < E; i++)
            for (int j = i + 1; j < E; j++) {
                cr += r[i] == r[j] ? C[(size_t)i * E + j] : 0;
                cn += r[i] / G == r[j] / G ? C[(size_t)i * E + j] : 0;
            }
        if (l + 1 == s->layers)
            continue;
        const int *rn = p->expert_rank + (size_t)(l + 1) * E;
        const int64_t *T = s->trans + (size_t)l * E * E;
        for (int i = 0; i < E; i++)
            for (int j = 0; j < E; j++) {
                tr += r[i] == rn[j] ? T[(size_t)i * E + j] : 0;
                tn += r[i] / G == rn[j] / G ? T[(size_t)i * E + j] : 0;
            }
    }
    out[0] = (double)cr + wt * (double)tr;
    out[1] = (double)cn + wt * (double)tn;
    return MOE_OK;
}

static moe_status check_params(const moe_plan_params *prm)
{
    if (!(prm->slack >= 0) || !(prm->transition_weight >= 0) || !isfinite(prm->slack) ||
        !isfinite(prm->transition_weight) || prm->max_moves < -1 || prm->sweeps < 0)
        MOE_FAIL(MOE_ERR_INVALID,
                 "planner: slack %g and transition_weight %g must be finite and >= 0, max_moves "
                 "%d >= -1, sweeps %d >= 0",
                 prm->slack, prm->transition_weight, prm->max_moves, prm->sweeps);
    return MOE_OK;
}

static int64_t move_cap(const moe_plan_params *prm, int E)
{
    return prm->max_moves < 0 ? 0 : prm->max_moves > 0 ? prm->max_moves : 64 * (int64_t)E;
}

/* Fills the report's balance, bound and objective figures for p. */
static moe_status finish_report(moe_plan_report *rep, const moe_placement *p,
                                const moe_routing_stats *s, const moe_plan_params *prm,
                                const double *bounds, int64_t moves)
{
    moe_placement *contig;
    MOE_CHECK(moe_placement_create(&contig, p->layers, p->experts, p->ranks, p->ranks_per_node));
    moe_status st = moe_placement_objective(contig, s, prm, rep->objective_contiguous);
    moe_placement_destroy(contig);
    MOE_CHECK(st);
    MOE_CHECK(moe_placement_objective(p, s, prm, rep->objective));
    rep->moves = moves;
    rep->worst_balance = rep->worst_bound = 0;
    for (int l = 0; l < p->layers; l++) {
        double bal = moe_placement_balance(p, s, l);
        int64_t sum = 0;
        for (int e = 0; e < p->experts; e++)
            sum += s->load[(size_t)l * p->experts + e];
        double bound = sum > 0 ? bounds[l] * p->ranks / (double)sum : 1.0;
        rep->worst_balance = bal > rep->worst_balance ? bal : rep->worst_balance;
        rep->worst_bound = bound > rep->worst_bound ? bound : rep->worst_bound;
    }
    return MOE_OK;
}

moe_status moe_plan_experts(moe_placement **out, const moe_routing_stats *s, int ranks,
                            int ranks_per_node, const moe_plan_params *params,
                            moe_plan_report *report)
{
    *out = NULL;
    moe_plan_params prm = params ? *params : moe_plan_params_default();
    MOE_CHECK(check_params(&prm));
    const int L = s->layers, E = s->experts;
    moe_placement *p = NULL, *alt_p = NULL;
    int *plan = NULL, *alt = NULL, *scratch = NULL;
    double *bounds = NULL;
    work wk;
    int have_work = 0, contig_ok = 1;
    moe_plan_report rep = {0};
    double obj[2], obj_alt[2];
    moe_status st;
    MOE_CHECK_GOTO(st, moe_placement_create(&p, L, E, ranks, ranks_per_node));
    MOE_CHECK_GOTO(st, moe_placement_create(&alt_p, L, E, ranks, ranks_per_node));
    MOE_CHECK_GOTO(st, work_alloc(&wk, E, ranks, ranks_per_node));
    have_work = 1;
    plan = malloc(sizeof(int) * L * E);
    alt = malloc(sizeof(int) * L * E);
    scratch = malloc(sizeof(int) * E);
    bounds = malloc(sizeof(double) * L);
    if (!plan || !alt || !scratch || !bounds) {
        moe_log_at(__FILE__, __LINE__, "planner: out of memory");
        st = MOE_ERR_NOMEM;
        goto fail;
    }
    wk.wt = prm.transition_weight;
    wk.max_moves = move_cap(&prm, E);

    /* first pass: layer by layer, each seeing the one before */
    for (int l = 0; l < L; l++) {
        wk.A = s->coact + (size_t)l * E * E;
        wk.w = s->load + (size_t)l * E;
        set_pref(&wk, s, plan, l, 1, 0);
        rep.layers_relaxed += set_bound(&wk, prm.slack);
        bounds[l] = wk.bound;
        contig_ok = contig_ok && contiguous_within(&wk);
        plan_layer(&wk, plan + (size_t)l * E, scratch);
    }
    rep.sweeps = sweep_layers(&wk, s, plan, bounds, prm.sweeps);
    MOE_CHECK_GOTO(st, fill_placement(p, plan));

    /* the contiguous placement, refined the same way, when it meets every bound: so the
     * plan is never below it (the first pass optimises a layer against the planned layer
     * before it, not against the contiguous one; without transitions the layers are
     * independent and contiguous is already one of each layer's starts) */
    if (contig_ok && L > 1 && prm.transition_weight > 0) {
        MOE_CHECK_GOTO(st, moe_placement_objective(p, s, &prm, obj));
        memcpy(alt, alt_p->expert_rank, sizeof(int) * L * E);
        sweep_layers(&wk, s, alt, bounds, prm.sweeps > 0 ? prm.sweeps : 1);
        MOE_CHECK_GOTO(st, fill_placement(alt_p, alt));
        MOE_CHECK_GOTO(st, moe_placement_objective(alt_p, s, &prm, obj_alt));
        if (better((score2){obj_alt[0], obj_alt[1]}, (score2){obj[0], obj[1]}))
            MOE_CHECK_GOTO(st, fill_placement(p, alt));
    }
    MOE_CHECK_GOTO(st, finish_report(&rep, p, s, &prm, bounds, wk.total_moves));
    if (report)
        *report = rep;
    *out = p;
    p = NULL;
    st = MOE_OK;
fail:
    if (have_work)
        work_free(&wk);
    moe_placement_destroy(p);
    moe_placement_destroy(alt_p);
    free(plan);
    free(alt);
    free(scratch);
    free(bounds);
    return st;
}

moe_status moe_placement_refine(moe_placement *p, const moe_routing_stats *s,
                                const moe_plan_params *params, moe_plan_report *report)
{
    moe_plan_params prm = params ? *params : moe_plan_params_default();
    MOE_CHECK(check_params(&prm));
    if (p->layers != s->layers || p->experts != s->experts)
        MOE_FAIL(MOE_ERR_INVALID,
                 "refine: placement of %d layers x %d experts, statistics of %d x %d", p->layers,
                 p->experts, s->layers, s->experts);
    const int L = s->layers, E = s->experts;
    int *ranks = malloc(sizeof(int) * L * E);
    double *bounds = malloc(sizeof(double) * L);
    moe_plan_report rep = {0};
    work wk;
    moe_status st = work_alloc(&wk, E, p->ranks, p->ranks_per_node);
    if (st != MOE_OK || !ranks || !bounds) {
        if (st == MOE_OK)
            work_free(&wk);
        free(ranks);
        free(bounds);
        MOE_FAIL(MOE_ERR_NOMEM, "refine: out of memory");
    }
    memcpy(ranks, p->expert_rank, sizeof(int) * L * E);
    wk.wt = prm.transition_weight;
    wk.max_moves = move_cap(&prm, E);
    for (int l = 0; l < L; l++) {
        wk.A = s->coact + (size_t)l * E * E;
        wk.w = s->load + (size_t)l * E;
        rep.layers_relaxed += set_bound(&wk, prm.slack);
        work_load(&wk, ranks + (size_t)l * E);
        double now = (double)max_load(&wk);
        bounds[l] = now > wk.bound ? now : wk.bound; /* never worse than it was */
    }
    rep.sweeps = sweep_layers(&wk, s, ranks, bounds, prm.sweeps > 0 ? prm.sweeps : 1);
    st = fill_placement(p, ranks);
    if (st == MOE_OK)
        st = finish_report(&rep, p, s, &prm, bounds, wk.total_moves);
    if (st == MOE_OK && report)
        *report = rep;
    work_free(&wk);
    free(ranks);
    free(bounds);
    MOE_CHECK(st);
    return MOE_OK;
}
