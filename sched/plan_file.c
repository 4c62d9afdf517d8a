/* sched/plan_file.c: the placement plan file (format in docs/scheduler.md and
 * sched/placement.h): writing it, and reading it back with every line validated. */
#include "sched/placement.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "sched/text.h"

#define PLAN_MAGIC "moe-dist placement v1"

moe_status moe_placement_write(const moe_placement *p, FILE *f, const char *comment)
{
    fprintf(f, PLAN_MAGIC " experts %d ranks %d\n", p->experts, p->ranks);
    for (const char *c = comment; c && *c;) {
        const char *nl = strchr(c, '\n');
        int n = nl ? (int)(nl - c) : (int)strlen(c);
        fprintf(f, "# %.*s\n", n, c);
        c += n + (nl ? 1 : 0);
    }
    for (int l = 0; l < p->layers; l++) {
        fprintf(f, "layer %d:", l);
        for (int e = 0; e < p->experts; e++)
            fprintf(f, " %d", p->expert_rank[(size_t)l * p->experts + e]);
        fputc('\n', f);
    }
    if (ferror(f))
        MOE_FAIL(MOE_ERR_IO, "placement: write error: %s", strerror(errno ? errno : EIO));
    return MOE_OK;
}

moe_status moe_placement_save(const moe_placement *p, const char *path, const char *comment)
{
    FILE *f = fopen(path, "w");
    if (!f)
        MOE_FAIL(MOE_ERR_IO, "cannot write plan file %s: %s", path, strerror(errno));
    moe_status st = moe_placement_write(p, f, comment);
    if (fclose(f) != 0 && st == MOE_OK)
        st = MOE_ERR_IO;
    if (st != MOE_OK)
        MOE_FAIL(st, "cannot write plan file %s", path);
    return MOE_OK;
}

#define BAD(r, ...) MOE_TEXT_BAD((r), __VA_ARGS__)

static moe_status read_header(moe_text_reader *r, int *E, int *R)
{
    int got = moe_text_next(r);
    if (got < 0)
        return MOE_ERR_IO;
    if (got == 0) {
        r->lineno = 0; /* nothing but blank or comment lines: no line to name */
        return BAD(r, "empty file, expected '" PLAN_MAGIC " experts E ranks R'");
    }
    const char *p = r->line;
    if (!moe_text_word(&p, "moe-dist") || !moe_text_word(&p, "placement"))
        return BAD(r, "not a plan file (expected '" PLAN_MAGIC " experts E ranks R', found '%s')",
                   moe_text_excerpt(r->line));
    if (!moe_text_word(&p, "v1"))
        return BAD(r, "unsupported version '%s' (this build reads v1)", moe_text_excerpt(p));
    int64_t e, n;
    if (!moe_text_word(&p, "experts") || !moe_text_int64(&p, &e))
        return BAD(r, "header: expected 'experts E', found '%s'", moe_text_excerpt(p));
    if (!moe_text_word(&p, "ranks") || !moe_text_int64(&p, &n))
        return BAD(r, "header: expected 'ranks R', found '%s'", moe_text_excerpt(p));
    if (!moe_text_at_end(p))
        return BAD(r, "header: unexpected '%s' after the ranks", moe_text_excerpt(p));
    if (e < 1 || e > MOE_SCHED_MAX_E || n < 1 || n > e || e % n != 0)
        return BAD(r,
                   "header: %" PRId64 " experts on %" PRId64
                   " ranks (need 1 <= R <= E <= %d, R dividing E)",
                   e, n, MOE_SCHED_MAX_E);
    *E = (int)e;
    *R = (int)n;
    return MOE_OK;
}

/* Parses "layer l: r0 ... r{E-1}" into ranks (E), checking each rank gets El experts. */
static moe_status read_layer(moe_text_reader *r, int l, int E, int R, int *ranks, int *fill)
{
    const char *p = r->line;
    int64_t got_l;
    if (!moe_text_word(&p, "layer") || !moe_text_int64(&p, &got_l) || !moe_text_char(&p, ':'))
        return BAD(r, "expected 'layer %d: r0 r1 ...', found '%s'", l, moe_text_excerpt(r->line));
    if (got_l != l)
        return BAD(r,
                   "layer %" PRId64 " where layer %d was expected (layers go 0, 1, ... in order)",
                   got_l, l);
    memset(fill, 0, sizeof(int) * R);
    for (int e = 0; e < E; e++) {
        int64_t v;
        if (moe_text_at_end(p))
            return BAD(r, "layer %d has %d ranks, expected one per expert (%d)", l, e, E);
        if (!moe_text_int64(&p, &v))
            return BAD(r, "layer %d: the rank of expert %d is not an integer: '%s'", l, e,
                       moe_text_excerpt(p));
        if (v < 0 || v >= R)
            return BAD(r, "layer %d: expert %d on rank %" PRId64 ", not in [0, %d)", l, e, v, R);
        ranks[e] = (int)v;
        fill[v]++;
    }
    if (!moe_text_at_end(p))
        return BAD(r, "layer %d has more than %d ranks (one per expert): '%s'", l, E,
                   moe_text_excerpt(p));
    for (int q = 0; q < R; q++)
        if (fill[q] != E / R)
            return BAD(r, "layer %d: rank %d gets %d experts, expected %d (E / R)", l, q, fill[q],
                       E / R);
    return MOE_OK;
}

moe_status moe_placement_load(moe_placement **out, const char *path, int ranks_per_node)
{
    *out = NULL;
    moe_text_reader r;
    moe_status st;
    int *ranks = NULL, *fill = NULL, E = 0, R = 0, L = 0, cap = 0;
    MOE_CHECK(moe_text_open(&r, path, "plan file"));
    MOE_CHECK_GOTO(st, read_header(&r, &E, &R));
    if (ranks_per_node == 0)
        ranks_per_node = R;
    if (ranks_per_node < 1 || R % ranks_per_node != 0) {
        st = BAD(&r, "%d ranks per node do not divide the plan's %d ranks", ranks_per_node, R);
        goto fail;
    }
    fill = malloc(sizeof(int) * R);
    if (!fill) {
        st = MOE_ERR_NOMEM;
        goto fail;
    }
    for (;;) {
        int got = moe_text_next(&r);
        if (got < 0) {
            st = MOE_ERR_IO;
            goto fail;
        }
        if (got == 0)
            break;
        if (L == MOE_SCHED_MAX_LAYERS) {
            st = BAD(&r, "more than %d layers", MOE_SCHED_MAX_LAYERS);
            goto fail;
        }
        if (L == cap) {
            cap = cap ? 2 * cap : 8;
            int *grown = realloc(ranks, sizeof(int) * (size_t)cap * E);
            if (!grown) {
                st = MOE_ERR_NOMEM;
                goto fail;
            }
            ranks = grown;
        }
        MOE_CHECK_GOTO(st, read_layer(&r, L, E, R, ranks + (size_t)L * E, fill));
        L++;
    }
    if (L == 0) {
        st = BAD(&r, "no 'layer' lines after the header");
        goto fail;
    }
    moe_text_close(&r);
    free(fill);
    fill = NULL;
    moe_placement *p = NULL;
    MOE_CHECK_GOTO(st, moe_placement_create(&p, L, E, R, ranks_per_node));
    for (int l = 0; l < L; l++) {
        st = moe_placement_set_layer(p, l, ranks + (size_t)l * E);
        if (st != MOE_OK) { /* cannot happen: read_layer checked the same */
            moe_placement_destroy(p);
            free(ranks);
            MOE_FAIL(st, "plan file %s: layer %d", path, l);
        }
    }
    free(ranks);
    *out = p;
    return MOE_OK;
fail:
    if (st == MOE_ERR_NOMEM)
        moe_log_at(__FILE__, __LINE__, "plan file %s: out of memory", path);
    moe_text_close(&r);
    free(ranks);
    free(fill);
    return st;
}
