/* sched/stats.c: routing statistics: counting, merging, the routing_stats file, printing.
 * The counting rules are at the top of sched/stats.h; the file format is in
 * docs/scheduler.md. */
#include "sched/stats.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "sched/text.h"

_Static_assert(MOE_SCHED_MAX_K <= MOE_ROUTE_STATS_MAX_K, "a trace's K must fit the counting op");

/* Points the named arrays into s->data. */
static void carve(moe_routing_stats *s)
{
    size_t L = (size_t)s->layers, E = (size_t)s->experts;
    s->tokens = s->data;
    s->load = s->tokens + L;
    s->coact = s->load + L * E;
    s->trans = s->coact + L * E * E;
}

moe_status moe_routing_stats_create(moe_routing_stats **out, int layers, int experts)
{
    *out = NULL;
    if (layers < 1 || layers > MOE_SCHED_MAX_LAYERS || experts < 1 || experts > MOE_SCHED_MAX_E)
        MOE_FAIL(MOE_ERR_INVALID,
                 "routing statistics: %d layers and %d experts (need 1..%d and 1..%d)", layers,
                 experts, MOE_SCHED_MAX_LAYERS, MOE_SCHED_MAX_E);
    size_t L = (size_t)layers, E = (size_t)experts;
    size_t count = L + L * E + L * E * E + (L - 1) * E * E;
    moe_routing_stats *s = calloc(1, sizeof *s);
    if (!s)
        MOE_FAIL(MOE_ERR_NOMEM, "routing statistics: out of memory");
    s->data = calloc(count, sizeof(int64_t));
    if (!s->data) {
        free(s);
        MOE_FAIL(MOE_ERR_NOMEM,
                 "routing statistics: cannot allocate %zu counts (%d layers, %d experts)", count,
                 layers, experts);
    }
    s->layers = layers;
    s->experts = experts;
    s->count = count;
    carve(s);
    *out = s;
    return MOE_OK;
}

void moe_routing_stats_destroy(moe_routing_stats *s)
{
    if (!s)
        return;
    free(s->data);
    free(s);
}

void moe_routing_stats_reset(moe_routing_stats *s)
{
    memset(s->data, 0, s->count * sizeof(int64_t));
    s->steps = 0;
    s->top_k = 0;
}

static moe_status check_ids(const int32_t *idx, int N, int K, int E, const char *what)
{
    for (size_t i = 0; i < (size_t)N * K; i++)
        if (idx[i] >= E)
            MOE_FAIL(MOE_ERR_INVALID,
                     "routing statistics: %s id %d of token %zu (slot %zu) is not below E = %d",
                     what, idx[i], i / K, i % K, E);
    return MOE_OK;
}

moe_status moe_routing_stats_add(moe_routing_stats *s, int layer, const int32_t *idx,
                                 const int32_t *prev_idx, int N, int K)
{
    if (!s || layer < 0 || layer >= s->layers)
        MOE_FAIL(MOE_ERR_INVALID, "routing statistics: layer %d out of range [0, %d)", layer,
                 s ? s->layers : 0);
    if (N < 0 || K < 1 || K > MOE_SCHED_MAX_K || (N > 0 && !idx))
        MOE_FAIL(MOE_ERR_INVALID, "routing statistics: bad trace (N = %d, K = %d, max K %d)", N, K,
                 MOE_SCHED_MAX_K);
    if (prev_idx && layer == 0)
        MOE_FAIL(MOE_ERR_INVALID, "routing statistics: layer 0 has no previous MoE layer");
    if (s->top_k != 0 && s->top_k != K)
        MOE_FAIL(MOE_ERR_INVALID, "routing statistics: trace has K = %d, earlier traces K = %d", K,
                 s->top_k);
    const int E = s->experts;
    MOE_CHECK(check_ids(idx, N, K, E, "expert"));
    if (prev_idx)
        MOE_CHECK(check_ids(prev_idx, N, K, E, "previous-layer expert"));
    if (N == 0)
        return MOE_OK;
    s->top_k = K;

    routing_stats_count(s->tokens + layer, s->load + (size_t)layer * E,
                        s->coact + (size_t)layer * E * E,
                        prev_idx ? s->trans + (size_t)(layer - 1) * E * E : NULL, idx, prev_idx, N,
                        E, K); /* kernels/ops.h: the counting the backends share */
    return MOE_OK;
}

moe_status moe_routing_stats_merge(moe_routing_stats *dst, const moe_routing_stats *src)
{
    if (dst->layers != src->layers || dst->experts != src->experts)
        MOE_FAIL(MOE_ERR_INVALID,
                 "routing statistics: cannot merge %d layers x %d experts into %d x %d",
                 src->layers, src->experts, dst->layers, dst->experts);
    if (dst->top_k != 0 && src->top_k != 0 && dst->top_k != src->top_k)
        MOE_FAIL(MOE_ERR_INVALID, "routing statistics: cannot merge top-%d counts into top-%d",
                 src->top_k, dst->top_k);
    for (size_t i = 0; i < dst->count; i++)
        dst->data[i] += src->data[i];
    if (dst->top_k == 0)
        dst->top_k = src->top_k;
    if (src->steps > dst->steps)
        dst->steps = src->steps;
    return MOE_OK;
}

/* ---- the file ---- */

#define STATS_MAGIC "moe-dist routing_stats v1"

static void write_row(FILE *f, const int64_t *v, int n)
{
    for (int i = 0; i < n; i++)
        fprintf(f, " %" PRId64, v[i]);
    fputc('\n', f);
}

moe_status moe_routing_stats_save(const moe_routing_stats *s, const char *path)
{
    FILE *f = fopen(path, "w");
    if (!f)
        MOE_FAIL(MOE_ERR_IO, "cannot write routing_stats file %s: %s", path, strerror(errno));
    const int L = s->layers, E = s->experts;
    fprintf(f, STATS_MAGIC " layers %d experts %d top_k %d steps %" PRId64 "\n", L, E, s->top_k,
            s->steps);
    fprintf(f, "tokens:");
    write_row(f, s->tokens, L);
    for (int l = 0; l < L; l++) {
        fprintf(f, "load %d:", l);
        write_row(f, s->load + (size_t)l * E, E);
        for (int i = 0; i < E; i++) {
            fprintf(f, "coact %d %d:", l, i);
            write_row(f, s->coact + ((size_t)l * E + i) * E, E);
        }
        for (int i = 0; l + 1 < L && i < E; i++) {
            fprintf(f, "trans %d %d:", l, i);
            write_row(f, s->trans + ((size_t)l * E + i) * E, E);
        }
    }
    fprintf(f, "end\n");
    int bad = ferror(f);
    if (fclose(f) != 0 || bad)
        MOE_FAIL(MOE_ERR_IO, "cannot write routing_stats file %s: %s", path,
                 strerror(errno ? errno : EIO));
    return MOE_OK;
}

#define BAD(r, ...) MOE_TEXT_BAD((r), __VA_ARGS__)

/* Reads the next line, which must be `keyword`, then the nidx indices ix[], then ':' and
 * exactly n counts >= 0 into v. */
static moe_status read_row(moe_text_reader *r, const char *keyword, int nidx, const int *ix,
                           int64_t *v, int n)
{
    char head[64];
    int at = snprintf(head, sizeof head, "%s", keyword);
    for (int k = 0; k < nidx; k++)
        at += snprintf(head + at, sizeof head - at, " %d", ix[k]);
    snprintf(head + at, sizeof head - at, ":");
    int got = moe_text_next(r);
    if (got < 0)
        return MOE_ERR_IO;
    if (got == 0)
        return BAD(r, "the file ends here, expected '%s' (truncated?)", head);
    const char *p = r->line;
    int ok = moe_text_word(&p, keyword);
    for (int k = 0; ok && k < nidx; k++) {
        int64_t have;
        ok = moe_text_int64(&p, &have) && have == ix[k];
    }
    if (!ok || !moe_text_char(&p, ':'))
        return BAD(r, "expected '%s', found '%s'", head, moe_text_excerpt(r->line));
    for (int i = 0; i < n; i++) {
        if (moe_text_at_end(p))
            return BAD(r, "'%s' has %d counts, expected %d", head, i, n);
        if (!moe_text_int64(&p, &v[i]))
            return BAD(r, "count %d of '%s' is not an integer: '%s'", i, head, moe_text_excerpt(p));
        if (v[i] < 0)
            return BAD(r, "count %d of '%s' is negative (%" PRId64 ")", i, head, v[i]);
    }
    if (!moe_text_at_end(p))
        return BAD(r, "'%s' has more than %d counts: '%s'", head, n, moe_text_excerpt(p));
    return MOE_OK;
}

static moe_status read_header(moe_text_reader *r, int64_t hv[4])
{
    int got = moe_text_next(r);
    if (got < 0)
        return MOE_ERR_IO;
    if (got == 0) {
        r->lineno = 0; /* nothing but blank or comment lines: no line to name */
        return BAD(r, "empty file, expected '" STATS_MAGIC " layers L experts E top_k K steps S'");
    }
    const char *p = r->line;
    static const char *const magic[] = {"moe-dist", "routing_stats"};
    for (int i = 0; i < 2; i++)
        if (!moe_text_word(&p, magic[i]))
            return BAD(r, "not a routing_stats file (expected '" STATS_MAGIC " ...', found '%s')",
                       moe_text_excerpt(r->line));
    if (!moe_text_word(&p, "v1"))
        return BAD(r, "unsupported version '%s' (this build reads v1)", moe_text_excerpt(p));
    static const char *const keys[] = {"layers", "experts", "top_k", "steps"};
    for (int i = 0; i < 4; i++)
        if (!moe_text_word(&p, keys[i]) || !moe_text_int64(&p, &hv[i]))
            return BAD(r, "header: expected '%s' and a number, found '%s'", keys[i],
                       moe_text_excerpt(p));
    if (!moe_text_at_end(p))
        return BAD(r, "header: unexpected '%s' after steps", moe_text_excerpt(p));
    if (hv[0] < 1 || hv[0] > MOE_SCHED_MAX_LAYERS || hv[1] < 1 || hv[1] > MOE_SCHED_MAX_E)
        return BAD(r, "header: %" PRId64 " layers and %" PRId64 " experts (need 1..%d and 1..%d)",
                   hv[0], hv[1], MOE_SCHED_MAX_LAYERS, MOE_SCHED_MAX_E);
    if (hv[2] < 0 || hv[2] > MOE_SCHED_MAX_K || hv[3] < 0)
        return BAD(r, "header: top_k %" PRId64 " (need 0..%d) or steps %" PRId64 " (need >= 0)",
                   hv[2], MOE_SCHED_MAX_K, hv[3]);
    return MOE_OK;
}

/* Reads layer l's load and co-activation rows, then its transition rows; checks that
 * they agree with tokens and top_k. */
static moe_status read_layer(moe_text_reader *r, moe_routing_stats *s, int l)
{
    const int E = s->experts, K = s->top_k;
    int64_t *load = s->load + (size_t)l * E;
    MOE_CHECK(read_row(r, "load", 1, (int[]){l}, load, E));
    int64_t sum = 0;
    for (int e = 0; e < E; e++)
        sum += load[e];
    int64_t t = s->tokens[l];
    if (sum < t || sum > (int64_t)K * t)
        return BAD(r,
                   "layer %d: %" PRId64 " assignments for %" PRId64
                   " tokens at top-%d (need tokens <= assignments <= top_k * tokens)",
                   l, sum, t, K);
    int64_t *coact = s->coact + (size_t)l * E * E;
    for (int i = 0; i < E; i++) {
        int64_t *row = coact + (size_t)i * E;
        MOE_CHECK(read_row(r, "coact", 2, (int[]){l, i}, row, E));
        if (row[i] != 0)
            return BAD(r, "coact %d: diagonal (%d,%d) is %" PRId64 ", must be 0", l, i, i, row[i]);
        int64_t rsum = 0;
        for (int j = 0; j < E; j++) {
            rsum += row[j];
            if (j < i && row[j] != coact[(size_t)j * E + i])
                return BAD(
                    r, "coact %d is not symmetric: (%d,%d) = %" PRId64 " but (%d,%d) = %" PRId64, l,
                    i, j, row[j], j, i, coact[(size_t)j * E + i]);
        }
        if (rsum > (int64_t)(K > 0 ? K - 1 : 0) * load[i])
            return BAD(r, "coact %d %d: row sum %" PRId64 " exceeds (top_k-1) * load = %" PRId64, l,
                       i, rsum, (int64_t)(K > 0 ? K - 1 : 0) * load[i]);
    }
    for (int i = 0; l + 1 < s->layers && i < E; i++) {
        int64_t *row = s->trans + ((size_t)l * E + i) * E;
        MOE_CHECK(read_row(r, "trans", 2, (int[]){l, i}, row, E));
        int64_t rsum = 0;
        for (int j = 0; j < E; j++)
            rsum += row[j];
        if (rsum > (int64_t)K * load[i])
            return BAD(r, "trans %d %d: row sum %" PRId64 " exceeds top_k * load = %" PRId64, l, i,
                       rsum, (int64_t)K * load[i]);
    }
    return MOE_OK;
}

moe_status moe_routing_stats_load(moe_routing_stats **out, const char *path)
{
    *out = NULL;
    moe_text_reader r;
    moe_routing_stats *s = NULL;
    moe_status st;
    MOE_CHECK(moe_text_open(&r, path, "routing_stats file"));
    int64_t hv[4];
    MOE_CHECK_GOTO(st, read_header(&r, hv));
    MOE_CHECK_GOTO(st, moe_routing_stats_create(&s, (int)hv[0], (int)hv[1]));
    s->top_k = (int)hv[2];
    s->steps = hv[3];
    MOE_CHECK_GOTO(st, read_row(&r, "tokens", 0, NULL, s->tokens, s->layers));
    for (int l = 0; l < s->layers; l++)
        MOE_CHECK_GOTO(st, read_layer(&r, s, l));
    int got = moe_text_next(&r);
    if (got < 0) {
        st = MOE_ERR_IO;
        goto fail;
    }
    if (got == 0) {
        st = BAD(&r, "the file ends here, expected 'end' (truncated?)");
        goto fail;
    }
    const char *p = r.line;
    if (!moe_text_word(&p, "end") || !moe_text_at_end(p)) {
        st = BAD(&r, "expected 'end', found '%s'", moe_text_excerpt(r.line));
        goto fail;
    }
    got = moe_text_next(&r);
    if (got != 0) {
        st = got < 0 ? MOE_ERR_IO
                     : BAD(&r, "unexpected text after 'end': '%s'", moe_text_excerpt(r.line));
        goto fail;
    }
    moe_text_close(&r);
    *out = s;
    return MOE_OK;
fail:
    moe_text_close(&r);
    moe_routing_stats_destroy(s);
    return st;
}

/* ---- printing ---- */

typedef struct {
    int64_t count;
    int i, j;
} pair_count;

/* Inserts (count, i, j) into top[0..*n) kept sorted by count desc, then i, j asc; keeps
 * at most cap entries. Candidates arrive in (i, j) order, so ties keep the first. */
static void top_insert(pair_count *top, int *n, int cap, int64_t count, int i, int j)
{
    if (count <= 0 || (*n == cap && count <= top[cap - 1].count))
        return;
    int at = *n < cap ? (*n)++ : cap - 1;
    while (at > 0 && top[at - 1].count < count) {
        top[at] = top[at - 1];
        at--;
    }
    top[at] = (pair_count){count, i, j};
}

static void print_top(FILE *out, const char *title, const int64_t *m, int E, int symmetric,
                      int64_t tokens, int top, pair_count *buf)
{
    int n = 0;
    for (int i = 0; i < E; i++)
        for (int j = symmetric ? i + 1 : 0; j < E; j++)
            top_insert(buf, &n, top, m[(size_t)i * E + j], i, j);
    fprintf(out, "  %s:", title);
    for (int k = 0; k < n; k++)
        fprintf(out, " %d%s%d %.1f%%", buf[k].i, symmetric ? "+" : "->", buf[k].j,
                100.0 * (double)buf[k].count / (double)(tokens > 0 ? tokens : 1));
    fprintf(out, n ? "\n" : " none\n");
}

moe_status moe_routing_stats_print(const moe_routing_stats *s, FILE *out, int top)
{
    if (top < 0 || top > 1000)
        MOE_FAIL(MOE_ERR_INVALID, "routing statistics: top %d out of range [0, 1000]", top);
    pair_count *buf = malloc(sizeof(pair_count) * (size_t)(top > 0 ? top : 1));
    if (!buf)
        MOE_FAIL(MOE_ERR_NOMEM, "routing statistics: out of memory");
    const int L = s->layers, E = s->experts;
    fprintf(out, "routing statistics: %d MoE layers, %d experts, top-%d, %" PRId64 " steps\n", L, E,
            s->top_k, s->steps);
    for (int l = 0; l < L; l++) {
        const int64_t *load = s->load + (size_t)l * E;
        int64_t lo = load[0], hi = load[0], sum = 0;
        for (int e = 0; e < E; e++) {
            lo = load[e] < lo ? load[e] : lo;
            hi = load[e] > hi ? load[e] : hi;
            sum += load[e];
        }
        double mean = (double)sum / E;
        fprintf(out,
                "layer %d: %" PRId64 " tokens, %" PRId64 " assignments; expert load min %" PRId64
                " max %" PRId64 " mean %.1f max/mean %.2f\n",
                l, s->tokens[l], sum, lo, hi, mean, mean > 0 ? (double)hi / mean : 0.0);
        if (top == 0)
            continue;
        print_top(out, "co-activated pairs (share of tokens)", s->coact + (size_t)l * E * E, E, 1,
                  s->tokens[l], top, buf);
        if (l + 1 < L) {
            char title[64];
            snprintf(title, sizeof title, "transitions to layer %d (share of tokens)", l + 1);
            print_top(out, title, s->trans + (size_t)l * E * E, E, 0, s->tokens[l], top, buf);
        }
    }
    free(buf);
    return MOE_OK;
}
