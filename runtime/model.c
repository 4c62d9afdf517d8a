/* runtime/model.c: parameter layout, initialisation, forward and backward of the MoE
 * transformer on the reference ops. See model.h for shapes and the loss definition. */
#include "runtime/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "sched/placement.h"
#include "sched/stats.h"
#include "kernels/backend.h"
#include "util/clock.h"
#include "util/rng.h"

/* ---- layout --------------------------------------------------------------------- */

typedef struct {
    moe_tensor *t;
    int n, cap;
    size_t offset;
} layout_builder;

static moe_status layout_add(layout_builder *lb, const char *name, int layer, int is_expert,
                             int decay, int ndim, int d0, int d1, int d2)
{
    if (lb->n == lb->cap) {
        int cap = lb->cap ? 2 * lb->cap : 64;
        moe_tensor *t = realloc(lb->t, (size_t)cap * sizeof *t);
        if (!t)
            MOE_FAIL(MOE_ERR_NOMEM, "cannot grow the tensor table to %d entries", cap);
        lb->t = t;
        lb->cap = cap;
    }
    moe_tensor *t = &lb->t[lb->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->layer = layer;
    t->is_expert = is_expert;
    t->decay = decay;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = ndim > 1 ? d1 : 1;
    t->shape[2] = ndim > 2 ? d2 : 1;
    t->count = (size_t)d0 * (size_t)t->shape[1] * (size_t)t->shape[2];
    t->offset = lb->offset;
    lb->offset += t->count;
    return MOE_OK;
}

static moe_status layout_tensors(moe_model *m)
{
    layout_builder lb = {0};
    char name[MOE_TENSOR_NAME_MAX];
    moe_status st = MOE_OK;
    const int D = m->D;

    MOE_CHECK_GOTO(st, layout_add(&lb, "embedding", -1, 0, 1, 2, m->V, D, 0));
    for (int l = 0; l < m->L; l++) {
#define ADD(suffix, decay, ndim, d0, d1)                                                           \
    do {                                                                                           \
        snprintf(name, sizeof name, "layers.%d.%s", l, suffix);                                    \
        MOE_CHECK_GOTO(st, layout_add(&lb, name, l, 0, decay, ndim, d0, d1, 0));                   \
    } while (0)
        ADD("attn_norm", 0, 1, D, 0);
        /* wq, wk, wv one after another: the backward's one GEMM over [q | k | v] */
        ADD("attn.wq", 1, 2, D, D);
        ADD("attn.wk", 1, 2, D, D);
        ADD("attn.wv", 1, 2, D, D);
        ADD("attn.wo", 1, 2, D, D);
        ADD("ffn_norm", 0, 1, D, 0);
        if (l < m->cfg.dense_layers) {
            ADD("ffn.w1", 1, 2, m->Fd, D);
            ADD("ffn.w3", 1, 2, m->Fd, D);
            ADD("ffn.w2", 1, 2, D, m->Fd);
        } else {
            ADD("moe.router", 1, 2, m->E, D);
            if (m->Fs > 0) {
                ADD("moe.shared.w1", 1, 2, m->Fs, D);
                ADD("moe.shared.w3", 1, 2, m->Fs, D);
                ADD("moe.shared.w2", 1, 2, D, m->Fs);
            }
        }
#undef ADD
    }
    MOE_CHECK_GOTO(st, layout_add(&lb, "final_norm", m->L, 0, 0, 1, D, 0, 0));
    MOE_CHECK_GOTO(st, layout_add(&lb, "lm_head", m->L, 0, 1, 2, m->V, D, 0));
    m->n_dense = lb.offset;
    for (int l = m->cfg.dense_layers; l < m->L; l++) {
        snprintf(name, sizeof name, "layers.%d.moe.experts.w1", l);
        MOE_CHECK_GOTO(st, layout_add(&lb, name, l, 1, 1, 3, m->El, m->F, D));
        snprintf(name, sizeof name, "layers.%d.moe.experts.w3", l);
        MOE_CHECK_GOTO(st, layout_add(&lb, name, l, 1, 1, 3, m->El, m->F, D));
        snprintf(name, sizeof name, "layers.%d.moe.experts.w2", l);
        MOE_CHECK_GOTO(st, layout_add(&lb, name, l, 1, 1, 3, m->El, D, m->F));
    }
    m->tensors = lb.t;
    m->n_tensors = lb.n;
    m->n_params = lb.offset;
    return MOE_OK;
fail:
    free(lb.t);
    return st;
}

int moe_model_find_tensor(const moe_model *m, const char *name)
{
    for (int i = 0; i < m->n_tensors; i++)
        if (strcmp(m->tensors[i].name, name) == 0)
            return i;
    return -1;
}

static real *tensor_ptr(const moe_model *m, real *arena, const char *fmt, int l)
{
    char name[MOE_TENSOR_NAME_MAX];
    snprintf(name, sizeof name, fmt, l);
    int i = moe_model_find_tensor(m, name);
    return i < 0 ? NULL : arena + m->tensors[i].offset;
}

static moe_status build_view(moe_model *m, real *arena, moe_view *v)
{
    v->layers = calloc((size_t)m->L, sizeof *v->layers);
    if (!v->layers)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate %d layer views", m->L);
    v->embedding = tensor_ptr(m, arena, "embedding", 0);
    v->final_norm = tensor_ptr(m, arena, "final_norm", 0);
    v->lm_head = tensor_ptr(m, arena, "lm_head", 0);
    for (int l = 0; l < m->L; l++) {
        moe_layer_view *lv = &v->layers[l];
        lv->attn_norm = tensor_ptr(m, arena, "layers.%d.attn_norm", l);
        lv->wq = tensor_ptr(m, arena, "layers.%d.attn.wq", l);
        lv->wk = tensor_ptr(m, arena, "layers.%d.attn.wk", l);
        lv->wv = tensor_ptr(m, arena, "layers.%d.attn.wv", l);
        lv->wo = tensor_ptr(m, arena, "layers.%d.attn.wo", l);
        if (lv->wk != lv->wq + (size_t)m->D * m->D || lv->wv != lv->wk + (size_t)m->D * m->D)
            MOE_FAIL(MOE_ERR_INVALID, "layer %d: wq, wk, wv are not laid out one after another", l);
        lv->ffn_norm = tensor_ptr(m, arena, "layers.%d.ffn_norm", l);
        lv->w1 = tensor_ptr(m, arena, "layers.%d.ffn.w1", l);
        lv->w3 = tensor_ptr(m, arena, "layers.%d.ffn.w3", l);
        lv->w2 = tensor_ptr(m, arena, "layers.%d.ffn.w2", l);
        lv->router = tensor_ptr(m, arena, "layers.%d.moe.router", l);
        lv->sw1 = tensor_ptr(m, arena, "layers.%d.moe.shared.w1", l);
        lv->sw3 = tensor_ptr(m, arena, "layers.%d.moe.shared.w3", l);
        lv->sw2 = tensor_ptr(m, arena, "layers.%d.moe.shared.w2", l);
        lv->ew1 = tensor_ptr(m, arena, "layers.%d.moe.experts.w1", l);
        lv->ew3 = tensor_ptr(m, arena, "layers.%d.moe.experts.w3", l);
        lv->ew2 = tensor_ptr(m, arena, "layers.%d.moe.experts.w2", l);
    }
    return MOE_OK;
}

/* ---- initialisation ---------------------------------------------------------------- */

/* Norm weights are 1. Matrices are N(0, init_std); output projections (attn.wo and the
 * FFN/expert w2) are scaled by 1/sqrt(2L) (GPT-2). Each expert's slice draws from a
 * stream named by its global expert id, so it is the same on whichever rank holds it. */
static moe_status init_weights(moe_model *m)
{
    const double std = m->cfg.init_std;
    const double out_std = std / sqrt(2.0 * m->L);
    real *host = malloc(sizeof(real) * m->n_params);
    if (!host)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate %zu parameters on the host", m->n_params);
    for (int i = 0; i < m->n_tensors; i++) {
        const moe_tensor *t = &m->tensors[i];
        real *p = host + t->offset;
        if (t->ndim == 1) {
            for (size_t j = 0; j < t->count; j++)
                p[j] = 1;
            continue;
        }
        int is_out = strstr(t->name, ".wo") || strstr(t->name, ".w2");
        double s = strstr(t->name, ".router") ? m->cfg.router_init_std : is_out ? out_std : std;
        int parts = t->is_expert ? t->shape[0] : 1;
        size_t part = t->count / (size_t)parts;
        for (int e = 0; e < parts; e++) {
            char stream_name[MOE_TENSOR_NAME_MAX + 16];
            if (t->is_expert)
                snprintf(stream_name, sizeof stream_name, "%s.%d", t->name,
                         moe_model_local_experts(m, t->layer)[e]);
            else
                snprintf(stream_name, sizeof stream_name, "%s", t->name);
            uint64_t stream = moe_rng_stream(stream_name);
            for (size_t j = 0; j < part; j++)
                p[(size_t)e * part + j] = (real)(s * moe_rng_normal(m->cfg.seed, stream, j));
        }
    }
    m->be->copy(m->params, host, sizeof(real) * m->n_params, MOE_COPY_H2D);
    free(host);
    return MOE_OK;
}

/* ---- allocation ---------------------------------------------------------------------- */

/* Every buffer of the model is carved from one block per kind at create; this helper
 * records the sizes in a first pass and hands out pointers in a second. */
typedef struct {
    char *base;
    size_t used;
} carve;

static void *carve_take(carve *c, size_t nbytes)
{
    size_t at = (c->used + 63) & ~(size_t)63;
    c->used = at + nbytes;
    return c->base ? c->base + at : NULL;
}

#define TAKE(c, type, count) ((type *)carve_take((c), sizeof(type) * (size_t)(count)))

static int experts_take_tokens(const moe_model *m);

/* What one chunk keeps apart from the others (moe_chunk): c backend memory, h host.
 * Where the experts take the tokens (experts_take_tokens, fixed when the model is made)
 * no rows are unpacked: no lidx, lw. The received tokens are never unpacked: the
 * permutation reads them from the rows (moe_permute_rows). */
static void carve_chunk(moe_model *m, moe_chunk *ch, carve *c, carve *h)
{
    const int unpacked = !experts_take_tokens(m);
    const size_t N = (size_t)m->Nc, D = (size_t)m->D, NK = N * (size_t)m->K;
    const size_t R = (size_t)m->Rmax, Mx = (size_t)m->Mmax;
    const size_t rows = R > NK ? R : NK;
    ch->tokens = TAKE(c, int32_t, N);
    ch->targets = TAKE(c, int32_t, N);
    for (int l = 0; l <= m->L; l++) {
        real *x = TAKE(c, real, N * D);
        if (ch->x)
            ch->x[l] = x;
    }
    for (int l = 0; l < m->L; l++) {
        moe_layer_acts a = {0};
        int dense = l < m->cfg.dense_layers;
        a.h1 = TAKE(c, real, N * D);
        a.rstd1 = TAKE(c, real, N);
        a.q = TAKE(c, real, 3 * N * D); /* q, k, v one after another: one batched GEMM */
        a.k = a.q ? a.q + N * D : NULL;
        a.v = a.q ? a.q + 2 * N * D : NULL;
        a.att = TAKE(c, real, N * D);
        a.att_lse = TAKE(c, real, (size_t)m->Bc * m->H * m->T);
        a.xmid = TAKE(c, real, N * D);
        a.h2 = TAKE(c, real, N * D);
        a.rstd2 = TAKE(c, real, N);
        if (dense) {
            a.fa = TAKE(c, real, N * m->Fd);
            a.fb = TAKE(c, real, N * m->Fd);
            a.fh = TAKE(c, real, N * m->Fd);
        } else {
            a.logits = TAKE(c, real, N * m->E);
            a.probs = TAKE(c, real, N * m->E);
            a.rlse = TAKE(c, real, N);
            a.idx = TAKE(c, int32_t, NK);
            a.w = TAKE(c, real, NK);
            a.slot_row = TAKE(c, int32_t, NK);
            a.send_token = TAKE(c, int32_t, N * (size_t)(m->K < m->ep ? m->K : m->ep));
            a.token_rows = TAKE(c, int32_t, N * (size_t)m->ep);
            a.send_rows = TAKE(h, int, m->ep);
            a.recv_rows = TAKE(h, int, m->ep);
            if (unpacked) {
                a.lidx = TAKE(c, int32_t, R * m->K);
                a.lw = TAKE(c, real, R * m->K);
            }
            a.offsets = TAKE(h, int, m->El + 1);
            a.row_token = TAKE(c, int32_t, Mx);
            a.row_slot = TAKE(c, int32_t, Mx);
            a.lslot_row = TAKE(c, int32_t, R * m->K);
            a.xperm = TAKE(c, real, Mx * D);
            a.ea = TAKE(c, real, Mx * m->F);
            a.eb = TAKE(c, real, Mx * m->F);
            a.eh = TAKE(c, real, Mx * m->F);
            a.eout = TAKE(c, real, Mx * D);
            if (m->Fs > 0) {
                a.sa = TAKE(c, real, N * m->Fs);
                a.sb = TAKE(c, real, N * m->Fs);
                a.sh = TAKE(c, real, N * m->Fs);
            }
        }
        if (ch->acts)
            ch->acts[l] = a;
    }
    ch->hf = TAKE(c, real, N * D);
    ch->rstdf = TAKE(c, real, N);
    ch->ce_lse = TAKE(c, real, N);
    ch->ce_loss = TAKE(c, real, N);
    ch->dres = TAKE(c, real, N * D);
    ch->dh = TAKE(c, real, N * D);
    ch->send_buf = TAKE(c, char, rows * m->row_bytes);
    if (m->ep > 1) { /* at ep 1 the rows are read where they were packed (exchange_start) */
        ch->dyrecv = TAKE(c, real, R * D);
        ch->recv_buf = TAKE(c, char, rows * m->row_bytes);
    }
    ch->aux_part = TAKE(c, double, router_aux_part_len(m->Nc, m->E));
}

/* c: memory of the backend (device for cuda); h: host memory for what the host reads.
 * The chunks' own buffers, then the scratch they share (used by one chunk at a time:
 * the compute stream runs them in turn). */
static void carve_activations(moe_model *m, carve *c, carve *h)
{
    const size_t N = (size_t)m->Nc, D = (size_t)m->D, NK = N * (size_t)m->K;
    const size_t Fmax = (size_t)(m->Fd > m->Fs ? m->Fd : m->Fs);
    const size_t R = (size_t)m->Rmax, Mx = (size_t)m->Mmax;
    for (int i = 0; i < m->C; i++)
        carve_chunk(m, &m->chunk[i], c, h);
    m->expert_rank_dev = TAKE(c, int32_t, (size_t)m->L * m->E);
    m->expert_local_dev = TAKE(c, int32_t, (size_t)m->L * m->E);
    m->layer_counts = TAKE(h, int64_t, (size_t)m->L * m->E);
    m->aux_psum = TAKE(h, double, (size_t)m->L * m->E);
    m->ce_acc = TAKE(c, double, 1);
    m->logits = TAKE(c, real, (size_t)m->head_rows * m->V);
    /* on a device the logits' gradient gets its own buffer, which the cross-entropy
     * backward writes as the LM head GEMMs' 16-bit operand (marked); the cpu writes it
     * over the logits */
    m->dlogits = m->be->on_device ? TAKE(c, real, (size_t)m->head_rows * m->V) : m->logits;
    m->rope_cos = TAKE(c, real, (size_t)m->T * (m->Hd / 2));
    m->rope_sin = TAKE(c, real, (size_t)m->T * (m->Hd / 2));
    m->dq = TAKE(c, real, N * D);
    m->dk = TAKE(c, real, N * D);
    m->dv = TAKE(c, real, N * D);
    m->dqkv = TAKE(c, real, N * 3 * D);
    m->datt = TAKE(c, real, N * D);
    m->dfa = TAKE(c, real, N * Fmax);
    m->dfb = TAKE(c, real, N * Fmax);
    m->dfh = TAKE(c, real, N * Fmax);
    m->dxperm = TAKE(c, real, Mx * D);
    m->deout = TAKE(c, real, Mx * D);
    m->dea = TAKE(c, real, Mx * m->F);
    m->deb = TAKE(c, real, Mx * m->F);
    m->deh = TAKE(c, real, Mx * m->F);
    m->dlw = TAKE(c, real, R * m->K);
    m->dw = TAKE(c, real, NK);
    m->dprobs = TAKE(c, real, N * m->E);
    m->drlogits = TAKE(c, real, N * m->E);
    m->route_scratch = TAKE(c, int, R * m->K + (size_t)m->E + 1);
    m->xc_count = TAKE(h, int64_t, 2 * (size_t)m->ep * (1 + (size_t)m->El));
    m->xc_size = TAKE(h, size_t, 4 * (size_t)m->ep); /* read when an exchange starts */
    m->src_row_token = TAKE(c, int32_t, NK);
    m->src_row_slot = TAKE(c, int32_t, NK);
    m->load = TAKE(h, int64_t, (size_t)m->L * m->E);
}

/* The buffers that only GEMMs read: written by SwiGLU, the FFNs' h (each chunk's and
 * layer's) and the backward's da, db scratch; by RMSNorm, the attention's input h1; by
 * the permutation, the experts' input xperm; and by the cross-entropy backward, the
 * logits' gradient when it is not the logits themselves. Marked (backend.h
 * mark_operand), a 16-bit backend writes them as the GEMM operand at once, so no rounding
 * pass reads them again. Marked too: the experts' gate and up outputs ea, eb and the
 * gradient deh of their SwiGLU output, which only SwiGLU reads: a 16-bit backend's GEMMs
 * write them in 16 bits and SwiGLU reads them so (bf16 activations, as the peer keeps);
 * likewise the LM head's logits, which only the cross-entropy reads (where they have a
 * gradient buffer of their own: on a device); and q, k, v where the backend's attention
 * reads them so (attention_operands16: rope rotates them in 16 bits, the attention takes
 * them without copies). And the FFN's input h2 (read by GEMMs and by the dispatch's
 * packing, which sends 16-bit rows in these precisions anyway; the permutation reads the
 * received rows' 16-bit tokens into the marked xperm as they are) and the experts' output
 * gradient deout (written by the combine's backward for the down projection's GEMMs) and
 * the experts' outputs eout (written by that GEMM, read by the combine and its backward).
 * Where the attention takes q, k, v so, also its output att (written in 16 bits by the
 * attention, read by the output projection's GEMMs and the backward's row sums) and the
 * gradients datt (written by a GEMM), dq, dk, dv (written by the attention's backward,
 * read by rope_backward_qkv). Always: [dq | dk | dv] (dqkv, written by
 * attention_backward_qkv for the q, k, v projections' GEMM; on an H200 straight from the
 * attention's kernels, dq, dk and dv then unused). on = 0 removes the marks. */
static moe_status mark_operands(moe_model *m, int on)
{
    const size_t N = (size_t)m->Nc, Mx = (size_t)m->Mmax;
    const size_t Fmax = (size_t)(m->Fd > m->Fs ? m->Fd : m->Fs);
    const int qkv16 = m->qkv16 = m->be->attention_operands16(m->Hd);
    for (int i = 0; m->chunk && i < m->C; i++) {
        /* the final norm's output: only the LM head's GEMMs read it (a chunk of rows at a
         * time: the backend finds a part of a marked buffer) */
        MOE_CHECK(m->be->mark_operand(m->chunk[i].hf, on ? N * (size_t)m->D : 0));
        for (int l = 0; m->chunk[i].acts && l < m->L; l++) {
            const moe_layer_acts *a = &m->chunk[i].acts[l];
            MOE_CHECK(m->be->mark_operand(a->fh, on ? N * (size_t)m->Fd : 0));
            MOE_CHECK(m->be->mark_operand(a->sh, on ? N * (size_t)m->Fs : 0));
            MOE_CHECK(m->be->mark_operand(a->eh, on ? Mx * (size_t)m->F : 0));
            MOE_CHECK(m->be->mark_operand(a->h1, on ? N * (size_t)m->D : 0));
            MOE_CHECK(m->be->mark_operand(a->h2, on ? N * (size_t)m->D : 0));
            MOE_CHECK(m->be->mark_operand(a->xperm, on ? Mx * (size_t)m->D : 0));
            MOE_CHECK(m->be->mark_operand(a->ea, on ? Mx * (size_t)m->F : 0));
            MOE_CHECK(m->be->mark_operand(a->eout, on ? Mx * (size_t)m->D : 0));
            MOE_CHECK(m->be->mark_operand(a->eb, on ? Mx * (size_t)m->F : 0));
            if (qkv16) {
                MOE_CHECK(m->be->mark_operand(a->q, on ? N * (size_t)m->D : 0));
                MOE_CHECK(m->be->mark_operand(a->k, on ? N * (size_t)m->D : 0));
                MOE_CHECK(m->be->mark_operand(a->v, on ? N * (size_t)m->D : 0));
                MOE_CHECK(m->be->mark_operand(a->att, on ? N * (size_t)m->D : 0));
            }
        }
    }
    if (qkv16) { /* the attention's backward: its input and output gradients */
        MOE_CHECK(m->be->mark_operand(m->datt, on ? N * (size_t)m->D : 0));
        MOE_CHECK(m->be->mark_operand(m->dq, on ? N * (size_t)m->D : 0));
        MOE_CHECK(m->be->mark_operand(m->dk, on ? N * (size_t)m->D : 0));
        MOE_CHECK(m->be->mark_operand(m->dv, on ? N * (size_t)m->D : 0));
    }
    MOE_CHECK(m->be->mark_operand(m->dqkv, on ? N * 3 * (size_t)m->D : 0));
    MOE_CHECK(m->be->mark_operand(m->deh, on ? Mx * (size_t)m->F : 0));
    MOE_CHECK(m->be->mark_operand(m->deout, on ? Mx * (size_t)m->D : 0));
    MOE_CHECK(m->be->mark_operand(m->dfa, on ? N * Fmax : 0));
    MOE_CHECK(m->be->mark_operand(m->dfb, on ? N * Fmax : 0));
    MOE_CHECK(m->be->mark_operand(m->dea, on ? Mx * (size_t)m->F : 0));
    if (m->dlogits && m->dlogits != m->logits) { /* and the logits: 16-bit from the GEMM */
        MOE_CHECK(m->be->mark_operand(m->dlogits, on ? (size_t)m->head_rows * m->V : 0));
        MOE_CHECK(m->be->mark_operand(m->logits, on ? (size_t)m->head_rows * m->V : 0));
    }
    return m->be->mark_operand(m->deb, on ? Mx * (size_t)m->F : 0);
}

/* Points the per-chunk fields of m at chunk i (every function below that takes no chunk
 * works on this one). */
static void use_chunk(moe_model *m, int i)
{
    moe_chunk *ch = &m->chunk[i];
    m->cur = i;
    m->tokens = ch->tokens;
    m->targets = ch->targets;
    m->x = ch->x;
    m->acts = ch->acts;
    m->hf = ch->hf;
    m->rstdf = ch->rstdf;
    m->ce_lse = ch->ce_lse;
    m->ce_loss = ch->ce_loss;
    m->dres = ch->dres;
    m->dh = ch->dh;
    m->dyrecv = ch->dyrecv;
    m->send_buf = ch->send_buf;
    m->recv_buf = ch->recv_buf;
    m->aux_part = ch->aux_part;
}

/* The placement tables are the only place that knows which rank holds an expert;
 * everything else goes through expert_rank / expert_local. At create: contiguous (expert
 * e on EP rank e / El) or the plan file named by [parallel] placement. */
static moe_status alloc_placement(moe_model *m)
{
    size_t LE = (size_t)m->L * m->E;
    m->expert_rank = malloc(sizeof(int) * LE);
    m->expert_local = malloc(sizeof(int) * LE);
    m->local_experts = malloc(sizeof(int) * (size_t)m->L * m->El);
    if (!m->expert_rank || !m->expert_local || !m->local_experts)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate the expert placement");
    return MOE_OK;
}

/* Fills expert_local and local_experts from expert_rank, checking the counts. */
static moe_status derive_placement(moe_model *m)
{
    for (int l = m->cfg.dense_layers; l < m->L; l++) {
        const int *rank = m->expert_rank + (size_t)l * m->E;
        int *local = m->expert_local + (size_t)l * m->E;
        for (int p = 0; p < m->ep; p++) {
            int n = 0;
            for (int e = 0; e < m->E; e++) {
                if (rank[e] < 0 || rank[e] >= m->ep)
                    MOE_FAIL(MOE_ERR_INVALID,
                             "placement of layer %d: expert %d on rank %d, "
                             "outside the EP group of %d",
                             l, e, rank[e], m->ep);
                if (rank[e] != p)
                    continue;
                if (p == m->ep_rank && n < m->El)
                    m->local_experts[(size_t)l * m->El + n] = e;
                local[e] = n++;
            }
            if (n != m->El)
                MOE_FAIL(MOE_ERR_INVALID, "placement of layer %d gives rank %d %d experts, not %d",
                         l, p, n, m->El);
        }
    }
    return MOE_OK;
}

/* The placement tables in backend memory, for the dispatch kernel. */
static moe_status upload_placement(moe_model *m)
{
    size_t LE = (size_t)m->L * m->E;
    int32_t *tmp = malloc(sizeof(int32_t) * 2 * LE);
    if (!tmp)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot stage the expert placement");
    for (size_t i = 0; i < LE; i++) {
        tmp[i] = m->expert_rank[i];
        tmp[LE + i] = m->expert_local[i];
    }
    m->be->copy(m->expert_rank_dev, tmp, sizeof(int32_t) * LE, MOE_COPY_H2D);
    m->be->copy(m->expert_local_dev, tmp + LE, sizeof(int32_t) * LE, MOE_COPY_H2D);
    free(tmp);
    return m->be->sync();
}

moe_status moe_model_set_placement(moe_model *m, const int *expert_rank)
{
    size_t LE = (size_t)m->L * m->E;
    int *saved = malloc(sizeof(int) * LE);
    if (!saved)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate a placement");
    memcpy(saved, m->expert_rank, sizeof(int) * LE);
    for (int l = m->cfg.dense_layers; l < m->L; l++)
        memcpy(m->expert_rank + (size_t)l * m->E, expert_rank + (size_t)l * m->E,
               sizeof(int) * m->E);
    moe_status st = derive_placement(m);
    if (st != MOE_OK) { /* keep the old placement */
        memcpy(m->expert_rank, saved, sizeof(int) * LE);
        derive_placement(m);
    }
    free(saved);
    MOE_CHECK(st);
    return upload_placement(m);
}

static moe_status initial_placement(moe_model *m)
{
    for (int l = 0; l < m->L; l++)
        for (int e = 0; e < m->E; e++)
            m->expert_rank[(size_t)l * m->E + e] = e / m->El;
    const char *plan = m->cfg.placement;
    if (strcmp(plan, "contiguous") != 0 && strcmp(plan, "auto") != 0) {
        moe_placement *pl = NULL;
        MOE_CHECK(moe_placement_load(&pl, plan, m->ep));
        moe_status st = MOE_OK;
        int n_moe = m->L - m->cfg.dense_layers;
        if (pl->layers != n_moe || pl->experts != m->E || pl->ranks != m->ep) {
            moe_log_at(__FILE__, __LINE__,
                       "[parallel] placement = %s: a plan for %d MoE layers, %d experts, %d ranks; "
                       "this run has %d, %d, ep %d",
                       plan, pl->layers, pl->experts, pl->ranks, n_moe, m->E, m->ep);
            st = MOE_ERR_INVALID;
        }
        for (int l = 0; st == MOE_OK && l < n_moe; l++)
            memcpy(m->expert_rank + (size_t)(m->cfg.dense_layers + l) * m->E,
                   pl->expert_rank + (size_t)l * m->E, sizeof(int) * m->E);
        moe_placement_destroy(pl);
        MOE_CHECK(st);
    }
    return derive_placement(m);
}

moe_status moe_model_create(moe_model **out, const moe_config *cfg, struct moe_comm *comm,
                            const moe_backend *be)
{
    moe_status st = MOE_OK;
    moe_model *m = calloc(1, sizeof *m);
    *out = NULL;
    if (!m)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate the model");
    m->cfg = *cfg;
    m->be = be ? be : &moe_backend_cpu;
    m->loss_scale = 1.0;
    m->tokens_mark = -1;
    be = m->be;
    m->B = cfg->micro_batch;
    m->T = cfg->seq_len;
    m->N = m->B * m->T;
    m->D = cfg->d_model;
    m->H = cfg->n_heads;
    m->Hd = m->D / m->H;
    m->V = cfg->vocab_size;
    m->L = cfg->n_layers;
    m->E = cfg->experts;
    m->comm = comm;
    m->ep = comm ? moe_comm_size(comm, MOE_GROUP_EP) : 1;
    m->ep_rank = comm ? moe_comm_rank(comm, MOE_GROUP_EP) : 0;
    if (m->ep != cfg->ep) {
        moe_log_at(__FILE__, __LINE__, "[parallel] ep = %d but the EP group has %d ranks", cfg->ep,
                   m->ep);
        free(m);
        return MOE_ERR_INVALID;
    }
    m->El = cfg->experts / m->ep;
    m->K = cfg->top_k;
    m->F = cfg->expert_hidden;
    m->Fd = cfg->dense_hidden;
    m->Fs = cfg->shared_experts * cfg->expert_hidden;
    m->C = moe_config_chunks(cfg, moe_comm_ep_hosts(comm));
    m->Bc = m->B / m->C;
    m->Nc = m->Bc * m->T;
    /* worst case of dropless routing: every peer sends all its tokens here */
    m->Rmax = m->ep * m->Nc;
    m->Mmax = m->Rmax * (m->K < m->El ? m->K : m->El);
    {
        /* GEMM operands: token-major (N rows) and expert-row-major (Mmax rows) ones */
        int wt = m->D, we = m->D > m->F ? m->D : m->F;
        int widths[] = {m->Fd, m->Fs, m->V, m->E};
        for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++)
            wt = widths[i] > wt ? widths[i] : wt;
        size_t a = (size_t)m->Nc * wt, b = (size_t)m->Mmax * we;
        m->max_gemm_operand = a > b ? a : b;
    }
    /* LM head chunk: at most 2^27 logits (512 MiB in fp32) at once, the whole micro-batch
     * when that fits (a (N, V) fp32 copy would be 2 GiB, and its gradient as much, at the
     * bench shape: N 16384, V 32768). Each chunk's GEMM adds into the head's whole weight
     * gradient, so fewer chunks move less: 2^27 ran 2-3% faster than 2^25 at the bench
     * shape on an H200 for 0.75 GiB (docs/results.md) */
    size_t head_logits = (size_t)1 << 27;
    const char *head_env = getenv("MOE_HEAD_MIB"); /* a benchmark knob: MiB of fp32 logits */
    if (head_env && atoi(head_env) > 0 && atoi(head_env) <= 16384)
        head_logits = (size_t)atoi(head_env) << 18;
    m->head_rows = (int)(head_logits / (size_t)m->V);
    m->head_rows = m->head_rows < 1 ? 1 : m->head_rows > m->Nc ? m->Nc : m->head_rows;
    m->row_bytes = moe_dispatch_row_bytes(m->D, m->K, MOE_ROW_FP32); /* the largest row */
    m->row_x16 = MOE_ROW_FP32;
    m->dispatch_bytes = m->row_bytes;
    m->capacity = cfg->capacity_factor > 0
                      ? (int)ceil(cfg->capacity_factor * m->Nc * m->K / (double)m->E)
                      : -1;

    MOE_CHECK_GOTO(st, alloc_placement(m));
    MOE_CHECK_GOTO(st, initial_placement(m));
    MOE_CHECK_GOTO(st, layout_tensors(m));
    m->params = be->alloc(m->n_params * sizeof(real));
    m->grads = be->alloc(m->n_params * sizeof(real));
    m->chunk = calloc((size_t)m->C, sizeof *m->chunk);
    int chunks_ok = m->chunk != NULL;
    for (int i = 0; chunks_ok && i < m->C; i++) {
        m->chunk[i].x = calloc((size_t)m->L + 1, sizeof *m->chunk[i].x);
        m->chunk[i].acts = calloc((size_t)m->L, sizeof *m->chunk[i].acts);
        m->chunk[i].pending = MOE_COMM_NONE;
        chunks_ok = m->chunk[i].x && m->chunk[i].acts;
    }
    if (!m->params || !m->grads || !chunks_ok) {
        moe_log_at(__FILE__, __LINE__, "cannot allocate %zu parameters and their gradients",
                   m->n_params);
        st = MOE_ERR_NOMEM;
        goto fail;
    }
    MOE_CHECK_GOTO(st, build_view(m, m->params, &m->p));
    MOE_CHECK_GOTO(st, build_view(m, m->grads, &m->g));

    carve c = {0}, h = {0};
    carve_activations(m, &c, &h); /* sizing pass */
    size_t nbytes = c.used, host_nbytes = h.used;
    c.base = be->alloc(nbytes);
    h.base = calloc(1, host_nbytes);
    c.used = h.used = 0;
    m->act_base = c.base;
    m->host_base = h.base;
    if (!c.base || !h.base) {
        moe_log_at(__FILE__, __LINE__, "cannot allocate %zu bytes of activations (%s)", nbytes,
                   be->name);
        st = MOE_ERR_NOMEM;
        goto fail;
    }
    carve_activations(m, &c, &h);
    for (int i = 0; i < m->C; i++)
        for (int l = m->cfg.dense_layers; l < m->L; l++)
            m->chunk[i].acts[l].mb_counts = m->layer_counts + (size_t)l * m->E;
    MOE_CHECK_GOTO(st, mark_operands(m, 1));
    use_chunk(m, 0);
    {
        /* the router's partials and the dispatch counts come back through host memory the
         * backend copies into without waiting (one wait per MoE layer and chunk) */
        const size_t aux = (router_aux_part_len(m->Nc, m->E) + 7) & ~(size_t)7;
        const size_t counts = ((size_t)MOE_PACK_COUNTS(m->ep, m->El) + 15) & ~(size_t)15;
        const size_t each = sizeof(double) * aux + sizeof(int) * counts;
        /* and the tokens, so that their copies to the device do not wait for the host */
        const size_t tokens = sizeof(int32_t) * 2 * (size_t)m->N;
        m->fetch_base = be->alloc_host(each * (size_t)m->C + tokens);
        if (!m->fetch_base) {
            moe_log_at(__FILE__, __LINE__, "cannot allocate %zu bytes of host memory (%s)",
                       each * (size_t)m->C + tokens, be->name);
            st = MOE_ERR_NOMEM;
            goto fail;
        }
        m->tokens_h = (int32_t *)((char *)m->fetch_base + each * (size_t)m->C);
        for (int i = 0; i < m->C; i++) {
            char *at = (char *)m->fetch_base + each * (size_t)i;
            m->chunk[i].aux_host = (double *)at;
            m->chunk[i].pack_counts = (int *)(at + sizeof(double) * aux);
        }
    }

    /* the ops' scratch, sized now so that no step allocates: the sorts of the routing
     * plans, scatters and embedding backward take about 16 bytes per item plus per-tile
     * counts; the host copies back at most the router's partials */
    {
        const size_t items = (size_t)m->Rmax * m->K + (size_t)m->Nc * m->K + (size_t)m->Nc;
        const size_t ops = 64 * items + ((size_t)16 << 20);
        /* attention's backward on sm_80+: 16-bit copies of q, k, v, dout after its row sums */
        const size_t att = 4 * sizeof(uint16_t) * (size_t)m->Nc * m->D +
                           sizeof(float) * (size_t)m->Nc * m->H + 256;
        const size_t dev = ops > att ? ops : att;
        const size_t host = sizeof(double) * router_aux_part_len(m->Nc, m->E) + ((size_t)1 << 20);
        MOE_CHECK_GOTO(st, be->reserve(dev, host));
    }
    be->rope_tables(m->rope_cos, m->rope_sin, m->T, m->Hd, cfg->rope_theta);
    MOE_CHECK_GOTO(st, init_weights(m));
    MOE_CHECK_GOTO(st, upload_placement(m));
    MOE_CHECK_GOTO(st, be->sync());
    *out = m;
    return MOE_OK;
fail:
    moe_model_destroy(m);
    return st;
}

void moe_model_destroy(moe_model *m)
{
    if (!m)
        return;
    const moe_backend *be = m->be;
    if (m->act_base)
        (void)mark_operands(m, 0); /* removing a mark cannot fail */
    be->release(m->act_base);
    free(m->host_base);
    be->release_host(m->fetch_base);
    free(m->p.layers);
    free(m->g.layers);
    for (int i = 0; m->chunk && i < m->C; i++) {
        free(m->chunk[i].x);
        free(m->chunk[i].acts);
    }
    free(m->chunk);
    be->release(m->params);
    be->release(m->grads);
    if (be->on_device)
        be->release(m->routing_dev);
    free(m->tensors);
    free(m->expert_rank);
    free(m->expert_local);
    free(m->local_experts);
    free(m);
}

/* ---- forward ----------------------------------------------------------------------- */

/* Each function below works on the chunk use_chunk chose (N: its Nc tokens). A layer
 * runs in three stages per chunk: (a) attention, the router and the start of the token
 * dispatch; (b) once the rows arrived, the experts and the start of the combine; (c) once
 * the partial sums are back, the residual. moe_model_forward runs (c) of layer l-1 and
 * (a) of layer l for every chunk, then (b) of layer l for every chunk, so each exchange
 * travels while the compute stream works on another chunk. */

static void attention_block_forward(moe_model *m, int l)
{
    const moe_layer_view *w = &m->p.layers[l];
    moe_layer_acts *a = &m->acts[l];
    const int N = m->Nc, D = m->D;
    m->be->rmsnorm_forward(a->h1, a->rstd1, m->x[l], w->attn_norm, N, D, (real)m->cfg.norm_eps);
    m->be->matmul_forward_batch(a->q, (size_t)N * D, a->h1, w->wq, 3, N, D, D); /* q, k, v */
    m->be->rope_forward(a->q, m->rope_cos, m->rope_sin, m->Bc, m->T, m->H, m->Hd);
    m->be->rope_forward(a->k, m->rope_cos, m->rope_sin, m->Bc, m->T, m->H, m->Hd);
    m->be->attention_forward(a->att, a->att_lse, a->q, a->k, a->v, m->Bc, m->T, m->H, m->Hd);
    m->be->matmul_forward_add(a->xmid, m->x[l], a->att, w->wo, N, D, D); /* + the residual */
}

/* SwiGLU FFN of width F on rows x (n, D): out (n, D) = base + (silu(x W1^T) * x W3^T) W2^T
 * (base: the residual, added by the last GEMM). */
static void swiglu_ffn_forward(const moe_model *m, real *out, const real *base, real *fa, real *fb,
                               real *fh, const real *x, const real *w1, const real *w3,
                               const real *w2, int n, int D, int F)
{
    m->be->matmul_forward(fa, x, w1, n, D, F);
    m->be->matmul_forward(fb, x, w3, n, D, F);
    m->be->swiglu_forward(fh, fa, fb, (size_t)n * F);
    if (base)
        m->be->matmul_forward_add(out, base, fh, w2, n, F, D);
    else
        m->be->matmul_forward(out, fh, w2, n, F, D);
}

/* Router: logits, probabilities, top-k and the aux partials of the chunk; the partials
 * are queued for the host (router_aux_layer reads them). */
static void router_forward_layer(moe_model *m, int l)
{
    const moe_layer_view *w = &m->p.layers[l];
    moe_layer_acts *a = &m->acts[l];
    const int N = m->Nc, E = m->E, K = m->K;
    m->be->matmul_forward(a->logits, a->h2, w->router, N, m->D, E);
    m->be->router_forward(a->probs, a->rlse, a->idx, a->w, m->aux_part, a->logits, N, E, K,
                          m->cfg.renorm_topk);
    m->be->fetch(m->chunk[m->cur].aux_host, m->aux_part,
                 sizeof(double) * router_aux_part_len(N, E));
}

/* Once the backend returned a host value after router_forward_layer (the dispatch
 * counts): the layer's counts and probability sums add up over the chunks in order (the
 * same additions as one pass over the micro-batch); after the last chunk the layer's aux
 * term and expert loads go into stats. */
static void router_aux_layer(moe_model *m, int l, moe_fwd_stats *stats)
{
    const int N = m->Nc, E = m->E, K = m->K;
    int64_t *counts = m->layer_counts + (size_t)l * E;
    double *psum = m->aux_psum + (size_t)l * E;
    if (m->cur == 0) {
        memset(counts, 0, sizeof(int64_t) * E);
        memset(psum, 0, sizeof(double) * E);
    }
    /* the reference's sum, on the partials the backend computed */
    stats->z_sum += router_aux_partials(counts, psum, m->chunk[m->cur].aux_host, N, E);
    if (m->cur < m->C - 1)
        return;
    const double Nm = m->N; /* the micro-batch */
    double aux = 0;
    for (int e = 0; e < E; e++) {
        aux += (double)counts[e] / (Nm * K) * (psum[e] / Nm);
        m->load[(size_t)l * E + e] += counts[e];
    }
    stats->aux_sum += E * aux;
}

/* ---- MoE: dispatch, experts, combine ------------------------------------------------ */

/* Starts the chunk's exchange inside the EP group: send_rows[p] rows of row_nbytes bytes
 * (grouped by peer, in peer order) to each peer p; recv_rows[p] rows from each into
 * recv. It is in flight until exchange_finish; the rows are then read at
 * exchange_rows(m). At ep 1 nothing travels: the rows are read where they were packed
 * (send), which no op writes before their reader has run. */
static moe_status exchange_start(moe_model *m, const void *send, const int *send_rows, void *recv,
                                 const int *recv_rows, size_t row_nbytes)
{
    moe_chunk *ch = &m->chunk[m->cur];
    ch->received = m->ep == 1 ? send : recv;
    if (m->ep == 1)
        return MOE_OK;
    size_t *sc = m->xc_size, *sd = sc + m->ep, *rc = sd + m->ep, *rd = rc + m->ep;
    moe_comm_row_layout(m->ep, send_rows, recv_rows, row_nbytes, m->xc_size);
    return moe_comm_exchange_start(m->comm, send, sc, sd, recv, rc, rd, MOE_COMM_NONE,
                                   &ch->pending);
}

/* The rows the chunk's last exchange received. */
static const void *exchange_rows(const moe_model *m) { return m->chunk[m->cur].received; }

/* Waits for the chunk's exchange (on a GPU, the compute stream waits for it). */
static moe_status exchange_finish(moe_model *m)
{
    moe_chunk *ch = &m->chunk[m->cur];
    if (ch->pending == MOE_COMM_NONE)
        return MOE_OK;
    const double t0 = moe_model_phase_begin(m);
    moe_status st = moe_comm_wait(m->comm, ch->pending);
    ch->pending = MOE_COMM_NONE;
    moe_model_phase_end(m, t0, MOE_PHASE_EXCHANGE);
    return st;
}

/* MOE_EP1_EXCHANGE_ROWS=1: at ep 1 the exchange buffers anyway, forward and backward (a
 * benchmark knob), read once. */
static int ep1_exchange_rows(void)
{
    static int on = -1;
    if (on < 0)
        on = getenv("MOE_EP1_EXCHANGE_ROWS") != NULL;
    return on;
}

/* Whether the experts take the tokens themselves in the forward: at ep 1 with one chunk
 * and no capacity every token is one row, in token order, every expert is local under its
 * own id (derive_placement) and no slot is dropped, so the experts' routing plan is the
 * source's, their rows' weights are the router's w and their input rows are h2 itself.
 * No dispatch rows are packed (token, weights, local ids) or unpacked: moe_pack_dispatch
 * only counts (rows NULL), the experts' plan is made where the source's would be, and
 * the permutation reads h2 (at the bench shape on an H200, 2 passes of 39-41 us a layer).
 * The same rows, weights and plan, so the same bits. */
static int experts_take_tokens(const moe_model *m)
{
    return !ep1_exchange_rows() && m->ep == 1 && m->C == 1 && m->capacity < 0;
}

/* The weights of the experts' rows' slots (R, K): the router's where the experts take the
 * tokens, else the unpacked ones. */
static const real *experts_slot_w(const moe_model *m, const moe_layer_acts *a)
{
    return experts_take_tokens(m) ? a->w : a->lw;
}

/* Source side, queued without waiting: applies the capacity, then builds one row per
 * (token, EP rank holding at least one of its kept experts), grouped by rank. A token
 * whose experts share a rank is sent there once, with the local expert and weight of
 * each of its slots (local id -1 for slots elsewhere). The counts come back to the host
 * behind a queue mark (moe_dispatch_send reads them). */
static void moe_dispatch_pack(moe_model *m, int l)
{
    moe_layer_acts *a = &m->acts[l];
    moe_chunk *ch = &m->chunk[m->cur];
    const int N = m->Nc, K = m->K;
    const int direct = experts_take_tokens(m);
    if (direct) /* the experts' plan (moe_experts_forward's call with R = N), the source's */
        m->be->moe_route_plan(NULL, a->row_token, a->row_slot, a->lslot_row, m->route_scratch,
                              a->idx, a->w, N, m->El, K, N, -1);
    else
        m->be->moe_route_plan(NULL, m->src_row_token, m->src_row_slot, a->slot_row,
                              m->route_scratch, a->idx, a->w, N, m->E, K, N, m->capacity);
    m->be->moe_pack_dispatch(
        direct ? NULL : m->send_buf, a->send_token, a->token_rows, ch->pack_counts, a->h2, a->idx,
        a->w, direct ? a->lslot_row : a->slot_row, m->expert_rank_dev + (size_t)l * m->E,
        m->expert_local_dev + (size_t)l * m->E, N, m->D, K, m->ep, m->El, m->dispatch_bytes,
        m->row_x16);
    ch->mark = m->be->queue_mark();
    /* Taking the tokens, the experts have N K rows (no slot is dropped), so their input
     * rows are gathered from h2 here, behind the mark: the stream has work while the host
     * waits for the counts and plans the GEMMs (moe_dispatch_send checks the count). */
    if (direct)
        m->be->moe_permute(a->xperm, a->h2, a->row_token, N * K, m->D);
}

/* The layer's one wait for the backend per chunk: the dispatch counts (and the router's
 * partials, fetched before them). Exchanges the counts (rows, and assignments per local
 * expert, so the experts' side knows its plan's offsets without asking its backend),
 * then starts sending the rows. */
static moe_status moe_dispatch_send(moe_model *m, int l, moe_fwd_stats *stats)
{
    moe_layer_acts *a = &m->acts[l];
    moe_chunk *ch = &m->chunk[m->cur];
    const int N = m->Nc, K = m->K, D = m->D, ep = m->ep, El = m->El;
    const double t_wait = moe_clock_seconds();
    MOE_CHECK(m->be->queue_wait(ch->mark, moe_comm_watch, m->comm));
    moe_model_waited(m, ch->mark);
    m->host_wait_s += moe_clock_seconds() - t_wait;
    const int *send_rows = ch->pack_counts, *send_assign = ch->pack_counts + ep;
    const int *send_experts = ch->pack_counts + 2 * ep + 1;
    a->n_send = ch->pack_counts[2 * ep];
    router_aux_layer(m, l, stats);
    int64_t kept = 0;
    for (int p = 0; p < ep; p++) {
        a->send_rows[p] = send_rows[p];
        kept += send_assign[p];
    }
    stats->dropped += (int64_t)N * K - kept;
    /* token payload of dispatch and combine, with and without sending a token once */
    for (int p = 0; p < ep; p++) {
        if (p == m->ep_rank)
            continue;
        const int64_t token = (int64_t)moe_dispatch_token_bytes(D, m->row_x16) +
                              (int64_t)D * (int64_t)sizeof(real); /* there and back */
        stats->a2a_bytes += (int64_t)send_rows[p] * token;
        stats->a2a_bytes_saved += (int64_t)(send_assign[p] - send_rows[p]) * token;
    }

    /* per peer: rows, then assignments per local expert there */
    const int per = 1 + El;
    int64_t *scount = m->xc_count, *rcount = m->xc_count + (size_t)ep * per;
    for (int p = 0; p < ep; p++) {
        scount[(size_t)p * per] = send_rows[p];
        for (int e = 0; e < El; e++)
            scount[(size_t)p * per + 1 + e] = send_experts[(size_t)p * El + e];
    }
    if (ep > 1) {
        const double t0 = moe_model_phase_begin(m);
        MOE_CHECK(moe_comm_exchange_counts(m->comm, scount, rcount, per));
        moe_model_phase_end(m, t0, MOE_PHASE_EXCHANGE);
    } else
        memcpy(rcount, scount, sizeof(int64_t) * (size_t)per);
    a->n_recv = 0;
    for (int p = 0; p < ep; p++) {
        a->recv_rows[p] = (int)rcount[(size_t)p * per];
        a->n_recv += a->recv_rows[p];
    }
    if (a->n_recv > m->Rmax)
        MOE_FAIL(MOE_ERR_COMM, "layer %d: %d rows received, more than the %d sized for", l,
                 a->n_recv, m->Rmax);
    /* the experts' side plan: rows per local expert, summed over the peers */
    a->offsets[0] = 0;
    for (int e = 0; e < El; e++) {
        int64_t rows = 0;
        for (int p = 0; p < ep; p++)
            rows += rcount[(size_t)p * per + 1 + e];
        a->offsets[e + 1] = a->offsets[e] + (int)rows;
    }
    a->n_rows = a->offsets[El];
    if (experts_take_tokens(m) && a->n_rows != N * K) /* moe_dispatch_pack permuted N K */
        MOE_FAIL(MOE_ERR_COMM, "layer %d: %d expert rows, not the %d of %d tokens' %d slots", l,
                 a->n_rows, N * K, N, K);
    stats->expert_rows += a->n_rows;
    if (a->n_rows > m->Mmax)
        MOE_FAIL(MOE_ERR_COMM, "layer %d: %d expert rows announced, more than the %d sized for", l,
                 a->n_rows, m->Mmax);
    return exchange_start(m, m->send_buf, a->send_rows, m->recv_buf, a->recv_rows,
                          m->dispatch_bytes);
}

/* Experts' side: groups the received rows' slots by local expert, runs the grouped
 * SwiGLU experts, and writes each row's weighted sum of its experts' outputs (R, D)
 * into out. */
static void moe_experts_forward(moe_model *m, int l, real *out)
{
    const moe_layer_view *w = &m->p.layers[l];
    moe_layer_acts *a = &m->acts[l];
    const int R = a->n_recv, D = m->D, K = m->K, F = m->F;
    /* offsets and n_rows came with the counts (moe_dispatch_send): nothing returns here */
    const int direct = experts_take_tokens(m); /* the plan made with the source's */
    if (!direct)
        m->be->moe_route_plan(NULL, a->row_token, a->row_slot, a->lslot_row, m->route_scratch,
                              a->lidx, a->lw, R, m->El, K, R > 0 ? R : 1, -1);
    const int M = a->n_rows;
    if (!direct) /* from the received rows themselves; else moe_dispatch_pack gathered them */
        m->be->moe_permute_rows(a->xperm, exchange_rows(m), m->dispatch_bytes, m->row_x16,
                                a->row_token, M, D);
    m->be->grouped_matmul_forward_pair_swiglu(a->eh, a->ea, a->eb, a->xperm, w->ew1, w->ew3,
                                              a->offsets, m->El, D, F);
    m->be->grouped_matmul_forward(a->eout, a->eh, w->ew2, a->offsets, m->El, F, D);
    m->be->moe_combine_forward(out, NULL, a->eout, experts_slot_w(m, a), a->row_token, a->row_slot,
                               M, D, K, a->lslot_row, R);
}

/* Stage (a): attention, the FFN norm, and the dense FFN or the MoE router and the
 * packing of the dispatch: all queued, nothing waited for. */
static void layer_forward_begin(moe_model *m, int l)
{
    const moe_layer_view *w = &m->p.layers[l];
    moe_layer_acts *a = &m->acts[l];
    const int N = m->Nc, D = m->D;
    attention_block_forward(m, l);
    m->be->rmsnorm_forward(a->h2, a->rstd2, a->xmid, w->ffn_norm, N, D, (real)m->cfg.norm_eps);
    if (l < m->cfg.dense_layers) {
        real *out = m->x[l + 1];
        swiglu_ffn_forward(m, out, a->xmid, a->fa, a->fb, a->fh, a->h2, w->w1, w->w3, w->w2, N, D,
                           m->Fd);
        return;
    }
    router_forward_layer(m, l);
    if (m->routing) { /* routing statistics for the scheduler, counted where idx is */
        const moe_routing_stats *rs = m->routing;
        const int lm = l - m->cfg.dense_layers, E = m->E;
        int64_t *base = m->routing_dev;
        m->be->routing_stats_count(
            base + (rs->tokens - rs->data) + lm, base + (rs->load - rs->data) + (size_t)lm * E,
            base + (rs->coact - rs->data) + (size_t)lm * E * E,
            lm > 0 ? base + (rs->trans - rs->data) + (size_t)(lm - 1) * E * E : NULL, a->idx,
            lm > 0 ? m->acts[l - 1].idx : NULL, N, E, m->K);
    }
    moe_dispatch_pack(m, l);
}

/* Stage (b) of a MoE layer: the counts, then the dispatch starts. */
static moe_status layer_forward_send(moe_model *m, int l, moe_fwd_stats *stats)
{
    if (l < m->cfg.dense_layers)
        return MOE_OK;
    moe_comm_set_context(m->comm, "forward dispatch", l); /* named by a timeout (comm.h) */
    return moe_dispatch_send(m, l, stats);
}

/* Stage (c) of a MoE layer: once the rows arrived, the experts. */
static moe_status layer_forward_experts(moe_model *m, int l)
{
    moe_layer_acts *a = &m->acts[l];
    if (l < m->cfg.dense_layers)
        return MOE_OK;
    moe_comm_set_context(m->comm, "forward dispatch", l);
    MOE_CHECK(exchange_finish(m));
    if (!experts_take_tokens(m)) /* else nothing was packed */
        m->be->moe_unpack_dispatch(NULL, a->lw, a->lidx, exchange_rows(m), a->n_recv, m->D, m->K,
                                   m->dispatch_bytes, m->row_x16);
    moe_experts_forward(m, l, (real *)m->send_buf);
    return MOE_OK;
}

/* Stage (d): the partial sums go back to the rows' owners (sizes reversed). */
static moe_status layer_forward_return(moe_model *m, int l)
{
    moe_layer_acts *a = &m->acts[l];
    if (l < m->cfg.dense_layers)
        return MOE_OK;
    moe_comm_set_context(m->comm, "forward combine", l);
    return exchange_start(m, m->send_buf, a->recv_rows, m->recv_buf, a->send_rows,
                          sizeof(real) * m->D);
}

/* Stage (e) of a MoE layer: x[l+1] = xmid + shared experts + the partial sums received. */
static moe_status layer_forward_end(moe_model *m, int l)
{
    const moe_layer_view *w = &m->p.layers[l];
    moe_layer_acts *a = &m->acts[l];
    const int N = m->Nc, D = m->D;
    real *out = m->x[l + 1];
    if (l < m->cfg.dense_layers)
        return MOE_OK;
    moe_comm_set_context(m->comm, "forward combine", l);
    MOE_CHECK(exchange_finish(m));
    const real *rows = (const real *)exchange_rows(m);
    if (m->ep > 1) {
        /* (shared experts + the rows in row order) + xmid, in one pass (xmid is the op's
         * last, added after the rows): a token whose top-2 experts sit on two ranks gets
         * two rows whose sum has the bits of ep 1's one row, so the layer's output keeps
         * ep 1's bits; adding onto xmid first rounds after the first row (50 fp32 steps
         * of the tiny config at world 2 then left world 1's losses at step 34, by
         * 1.5e-4) */
        if (m->Fs > 0)
            swiglu_ffn_forward(m, out, NULL, a->sa, a->sb, a->sh, a->h2, w->sw1, w->sw3, w->sw2, N,
                               D, m->Fs);
        m->be->moe_permute_backward(out, m->Fs > 0 ? out : NULL, rows, a->send_token, a->n_send, D,
                                    a->token_rows, N, m->ep, a->xmid);
        return MOE_OK;
    }
    const real *base = a->xmid; /* (xmid + shared experts) + the row, at ep 1 */
    if (m->Fs > 0) {
        swiglu_ffn_forward(m, out, a->xmid, a->sa, a->sb, a->sh, a->h2, w->sw1, w->sw3, w->sw2, N,
                           D, m->Fs);
        base = out;
    }
    m->be->moe_permute_backward(out, base, rows, a->send_token, a->n_send, D, a->token_rows, N,
                                m->ep, NULL);
    return MOE_OK;
}

/* The listener's call before the forward first reads a stage's parameters (model.h). */
static void params_needed(moe_model *m, int stage, int part)
{
    if (m->params_needed)
        m->params_needed(m->params_needed_ctx, stage, part);
}

/* Layer l over the chunks, in the order that keeps the compute stream fed while the
 * host waits and tokens travel: (e) of layer l-1 and (a) for every chunk; then per chunk
 * i: (b) -- the host waits for chunk i's counts while the stream still computes the
 * chunks after it --, (d) of chunk i-1, (c) of chunk i. The exchanges enter their stream
 * as dispatch 0, dispatch 1, combine 0, dispatch 2, combine 1, ...: no dispatch queues
 * behind a combine that waits for experts. */
static moe_status layer_forward_chunks(moe_model *m, int l, moe_fwd_stats *stats)
{
    params_needed(m, l, 0);
    for (int i = 0; i < m->C; i++) {
        use_chunk(m, i);
        if (l > 0)
            MOE_CHECK(layer_forward_end(m, l - 1));
        layer_forward_begin(m, l);
    }
    for (int i = 0; i < m->C; i++) {
        use_chunk(m, i);
        MOE_CHECK(layer_forward_send(m, l, stats));
        if (i > 0) {
            use_chunk(m, i - 1);
            MOE_CHECK(layer_forward_return(m, l));
            use_chunk(m, i);
        }
        if (i == 0)
            params_needed(m, l, 1);
        MOE_CHECK(layer_forward_experts(m, l));
    }
    use_chunk(m, m->C - 1);
    return layer_forward_return(m, l);
}

void moe_model_fuse_head(moe_model *m, int64_t step_sequences)
{
    m->head_sequences = step_sequences;
}

void moe_model_fresh_grads(moe_model *m) { m->grads_fresh = 1; }

void moe_model_waited(moe_model *m, long mark)
{
    if (m->tokens_mark >= 0 && mark >= m->tokens_mark)
        m->tokens_mark = -1;
}

void moe_model_added_grads(const moe_model *m, size_t *lo, size_t *hi)
{
    *lo = (size_t)(m->g.embedding - m->grads);
    *hi = *lo + (size_t)m->V * m->D;
}

/* MOE_WRITE_DW where the backward's weight gradients are the step's first contribution
 * (moe_model_fresh_grads: the step's first backward, its first chunk), else 0. */
static int first_dw(const moe_model *m) { return m->grads_fresh && m->cur == 0 ? MOE_WRITE_DW : 0; }

void moe_model_set_precision(moe_model *m, int p)
{
    m->row_x16 = p == MOE_PREC_BF16   ? MOE_ROW_BF16
                 : p == MOE_PREC_FP16 ? MOE_ROW_FP16
                                      : MOE_ROW_FP32;
    m->dispatch_bytes = moe_dispatch_row_bytes(m->D, m->K, m->row_x16);
}

/* The gradient of each token's loss in a step of step_sequences sequences. */
static real head_dloss(const moe_model *m, int64_t step_sequences)
{
    return (real)(m->loss_scale / ((double)step_sequences * m->T));
}

/* The LM head's backward for rows [r0, r0 + rows) of the current chunk, whose logits are
 * in m->logits: the gradient of the loss of a step of step_sequences sequences goes to
 * m->dlogits (the logits themselves on the cpu), then dh and the head's gradient add
 * theirs. ce_done: m->dlogits holds it already (cross_entropy_fused). */
static void head_backward(moe_model *m, int r0, int rows, int64_t step_sequences, int ce_done)
{
    const real *h = m->hf + (size_t)r0 * m->D;
    if (!ce_done)
        m->be->cross_entropy_backward(m->dlogits, m->logits, m->ce_lse + r0, m->targets + r0,
                                      head_dloss(m, step_sequences), rows, m->V);
    m->be->matmul_backward(m->dh + (size_t)r0 * m->D, m->g.lm_head, m->dlogits, h, m->p.lm_head,
                           rows, m->D, m->V, MOE_WRITE_DX | (r0 == 0 ? first_dw(m) : 0));
}

/* The final norm's backward for the current chunk: dL/dx[L] into m->dres (written) from
 * m->dh. */
static void final_norm_backward(moe_model *m)
{
    m->be->rmsnorm_backward(m->dres, m->g.final_norm, m->dh, m->x[m->L], m->p.final_norm, m->rstdf,
                            m->Nc, m->D, MOE_WRITE_DX | first_dw(m), NULL);
}

static moe_status layer_backward_begin(moe_model *m, int l);

moe_status moe_model_forward(moe_model *m, const int32_t *tokens, moe_fwd_stats *stats)
{
    const int N = m->N, D = m->D, T = m->T, Nc = m->Nc;
    memset(stats, 0, sizeof *stats);
    if (m->tokens_mark >= 0) { /* no wait since the last copies of tokens_h: one now */
        MOE_CHECK(m->be->queue_wait(m->tokens_mark, moe_comm_watch, m->comm));
        m->tokens_mark = -1;
    }
    for (int b = 0; b < m->B; b++) {
        for (int t = 0; t < T; t++) {
            int32_t in = tokens[(size_t)b * (T + 1) + t];
            int32_t tg = tokens[(size_t)b * (T + 1) + t + 1];
            if (in < 0 || in >= m->V || tg < 0 || tg >= m->V)
                MOE_FAIL(MOE_ERR_INVALID,
                         "token %d at sequence %d position %d is outside the "
                         "vocabulary [0, %d)",
                         in < 0 || in >= m->V ? in : tg, b, t, m->V);
            m->tokens_h[(size_t)b * T + t] = in;
            m->tokens_h[(size_t)N + (size_t)b * T + t] = tg;
        }
    }
    /* the copies first: they need no parameter, so they run while the update the
     * embedding waits for (params_needed) may still run */
    for (int i = 0; i < m->C; i++) { /* chunk i: sequences [i*Bc, (i+1)*Bc) */
        use_chunk(m, i);
        m->be->copy(m->tokens, m->tokens_h + (size_t)i * Nc, sizeof(int32_t) * Nc, MOE_COPY_H2D);
        m->be->copy(m->targets, m->tokens_h + N + (size_t)i * Nc, sizeof(int32_t) * Nc,
                    MOE_COPY_H2D);
    }
    m->tokens_mark = m->be->queue_mark();
    params_needed(m, -1, 0);
    for (int i = 0; i < m->C; i++) {
        use_chunk(m, i);
        m->be->embedding_forward(m->x[0], m->tokens, m->p.embedding, Nc, D);
    }
    for (int l = 0; l < m->L; l++)
        MOE_CHECK(layer_forward_chunks(m, l, stats));
    params_needed(m, m->L, 0);
    for (int i = 0; i < m->C; i++) {
        use_chunk(m, i);
        MOE_CHECK(layer_forward_end(m, m->L - 1));
        m->be->rmsnorm_forward(m->hf, m->rstdf, m->x[m->L], m->p.final_norm, Nc, D,
                               (real)m->cfg.norm_eps);
        /* LM head and cross-entropy in chunks of head_rows tokens: the logits of the whole
         * chunk never exist at once; fused, each chunk's backward follows at once */
        for (int r0 = 0; r0 < Nc; r0 += m->head_rows) {
            int rows = Nc - r0 < m->head_rows ? Nc - r0 : m->head_rows;
            m->be->matmul_forward(m->logits, m->hf + (size_t)r0 * D, m->p.lm_head, rows, D, m->V);
            /* with the backward and a dlogits of its own: both in one pass over the rows */
            const int ce_both = m->head_sequences > 0 && m->dlogits != m->logits;
            if (ce_both)
                m->be->cross_entropy_fused(m->ce_loss + r0, m->ce_lse + r0, m->dlogits, m->logits,
                                           m->targets + r0, head_dloss(m, m->head_sequences), rows,
                                           m->V);
            else
                m->be->cross_entropy_forward(m->ce_loss + r0, m->ce_lse + r0, m->logits,
                                             m->targets + r0, rows, m->V);
            if (m->head_sequences > 0)
                head_backward(m, r0, rows, m->head_sequences, ce_both);
        }
        m->be->sum_into(m->ce_acc, m->ce_loss, (size_t)Nc, 0);
        /* fused: this chunk's backward starts here, up to the last layer's exchange of
         * row gradients, which then travels while the next chunk's head computes (else
         * the first exchange of the backward has little to hide behind) */
        if (m->head_sequences > 0) {
            final_norm_backward(m);
            MOE_CHECK(layer_backward_begin(m, m->L - 1));
        }
    }
    stats->tokens = N;
    m->head_done = m->head_sequences;
    m->backward_begun = m->head_sequences > 0;
    m->head_sequences = 0;
    return MOE_OK; /* nothing waits: failures on the device surface at the next wait */
}

moe_status moe_model_take_ce(moe_model *m, double *ce_sum)
{
    m->be->copy(ce_sum, m->ce_acc, sizeof(double), MOE_COPY_D2H);
    m->be->zero(m->ce_acc, sizeof(double));
    return m->be->sync();
}

/* ---- backward ---------------------------------------------------------------------- */

/* Backward of swiglu_ffn_forward: dx (n, D) +=, weight gradients += (written where they
 * are the step's first: first_dw). dh is (n, D). */
static void swiglu_ffn_backward(moe_model *m, real *dx, real *gw1, real *gw3, real *gw2,
                                const real *dout, const real *x, const real *fa, const real *fb,
                                const real *fh, const real *w1, const real *w3, const real *w2,
                                int n, int D, int F)
{
    size_t nf = (size_t)n * F;
    const int first = first_dw(m);
    m->be->matmul_backward(m->dfh, gw2, dout, fh, w2, n, F, D, MOE_WRITE_DX | first);
    m->be->swiglu_backward(m->dfa, m->dfb, m->dfh, fa, fb, nf); /* overwrites dfa, dfb */
    m->be->matmul_backward(dx, gw1, m->dfa, x, w1, n, D, F, first);
    m->be->matmul_backward(dx, gw3, m->dfb, x, w3, n, D, F, first);
}

/* Gradient of the router: top-k weights (dw), aux and z terms, softmax, linear. The aux
 * term uses the counts of the whole micro-batch (all chunks). */
static void router_backward_layer(moe_model *m, int l, int64_t step_sequences)
{
    const moe_layer_view *w = &m->p.layers[l];
    const moe_layer_view *g = &m->g.layers[l];
    moe_layer_acts *a = &m->acts[l];
    const int N = m->Nc, E = m->E, K = m->K;
    /* aux: averaged over the step's micro-batches; z: over its tokens */
    const double n_micro = (double)step_sequences / m->B;
    m->be->router_backward(m->drlogits, m->dprobs, m->dw, a->probs, a->idx, a->rlse, a->mb_counts,
                           m->N, N, E, K, m->cfg.renorm_topk,
                           m->loss_scale * m->cfg.aux_loss_coef / n_micro,
                           m->loss_scale * m->cfg.z_loss_coef / n_micro);
    m->be->matmul_backward(m->dh, g->router, m->drlogits, a->h2, w->router, N, m->D, E,
                           first_dw(m));
}

/* Whether layer l's dispatch rows are the tokens themselves, in order: at ep 1 the rows
 * go out in token order (moe_pack_dispatch), so when every token has a kept slot,
 * send_token is the identity and nothing crosses a rank. With one chunk a micro-batch
 * (dres, dh and dw then serve that chunk alone between the stages), the backward skips
 * the exchange buffers: the experts take dres as their rows' gradient, and write the
 * gradient of their input straight into dh (onto the shared experts') and that of the
 * slot weights into dw: no copy of dres into send_buf, no packing of gradient rows, no
 * scatter (at the bench shape on an H200, 3 passes of 46-69 us a layer). */
static int rows_are_tokens(const moe_model *m, int l)
{
    const moe_layer_acts *a = &m->acts[l];
    return !ep1_exchange_rows() && m->ep == 1 && m->C == 1 && a->n_send == m->Nc &&
           a->n_recv == m->Nc;
}

/* Experts' side of backward: from dy (R, D), the gradient of each received row's
 * weighted sum, computes the expert weight gradients and writes, per row, the gradient
 * of its input (D reals) and of its slots' weights (K reals) into out rows; out NULL
 * (rows_are_tokens): into dh (added to it with shared experts) and dw instead. */
static void moe_experts_backward(moe_model *m, int l, const real *dy, real *out)
{
    const moe_layer_view *w = &m->p.layers[l];
    const moe_layer_view *g = &m->g.layers[l];
    moe_layer_acts *a = &m->acts[l];
    const int R = a->n_recv, D = m->D, K = m->K, F = m->F, M = a->n_rows;
    /* the weight gradients are written by a step's first chunk (chunks run in order) */
    const int first = first_dw(m);
    real *dlw = out ? m->dlw : m->dw;
    m->be->zero(dlw, sizeof(real) * (size_t)R * K); /* deout: written by the op */
    m->be->moe_combine_backward(m->deout, dlw, dy, a->eout, experts_slot_w(m, a), a->row_token,
                                a->row_slot, M, D, K);
    /* deh and dxperm are written by their first GEMM (every row has its expert) */
    m->be->grouped_matmul_backward(m->deh, g->ew2, m->deout, a->eh, w->ew2, a->offsets, m->El, F, D,
                                   first | MOE_WRITE_DX);
    m->be->swiglu_backward(m->dea, m->deb, m->deh, a->ea, a->eb, (size_t)M * F); /* overwrites */
    m->be->grouped_matmul_backward_pair(m->dxperm, g->ew1, g->ew3, m->dea, m->deb, a->xperm, w->ew1,
                                        w->ew3, a->offsets, m->El, D, F, first | MOE_WRITE_DX);
    if (!out) {
        m->be->moe_permute_backward(m->dh, m->Fs > 0 ? m->dh : NULL, m->dxperm, a->row_token, M, D,
                                    a->lslot_row, R, K, NULL);
        return;
    }
    /* each received row's input gradient (the sum of its expert rows') and slot weights'
     * into the row sent back, in one pass */
    m->be->moe_pack_grad_rows(out, m->dxperm, a->row_token, M, a->lslot_row, m->dlw, R, D, K);
}

/* Backward of a layer in three stages per chunk, mirroring forward. On entry to (a)
 * m->dres = dL/dx[l+1]; on exit from (c) dL/dx[l].
 * (a): the dense FFN, or the shared experts and the start of sending each sent row's
 * gradient to the rank that computed it. */
static moe_status layer_backward_begin(moe_model *m, int l)
{
    const moe_layer_view *w = &m->p.layers[l];
    const moe_layer_view *g = &m->g.layers[l];
    moe_layer_acts *a = &m->acts[l];
    const int N = m->Nc, D = m->D;
    moe_comm_set_context(m->comm, "backward dispatch", l); /* named by a timeout (comm.h) */
    if (l < m->cfg.dense_layers || m->Fs > 0)              /* else the scatter of (c) writes dh */
        m->be->zero(m->dh, sizeof(real) * (size_t)N * D);
    if (l < m->cfg.dense_layers) {
        swiglu_ffn_backward(m, m->dh, g->w1, g->w3, g->w2, m->dres, a->h2, a->fa, a->fb, a->fh,
                            w->w1, w->w3, w->w2, N, D, m->Fd);
        return MOE_OK;
    }
    if (m->Fs > 0)
        swiglu_ffn_backward(m, m->dh, g->sw1, g->sw3, g->sw2, m->dres, a->h2, a->sa, a->sb, a->sh,
                            w->sw1, w->sw3, w->sw2, N, D, m->Fs);
    if (rows_are_tokens(m, l)) /* the experts read dres itself */
        return MOE_OK;
    m->be->moe_permute((real *)m->send_buf, m->dres, a->send_token, a->n_send, D);
    return exchange_start(m, m->send_buf, a->send_rows, m->dyrecv, a->recv_rows, sizeof(real) * D);
}

/* (b) of a MoE layer: the experts' backward, and its row gradients start back. */
static moe_status layer_backward_experts(moe_model *m, int l)
{
    moe_layer_acts *a = &m->acts[l];
    if (l < m->cfg.dense_layers)
        return MOE_OK;
    moe_comm_set_context(m->comm, "backward dispatch", l);
    if (rows_are_tokens(m, l)) { /* nothing was sent: dres, dh and dw directly */
        moe_experts_backward(m, l, m->dres, NULL);
        return MOE_OK;
    }
    MOE_CHECK(exchange_finish(m));
    moe_experts_backward(m, l, (const real *)exchange_rows(m), (real *)m->send_buf);
    moe_comm_set_context(m->comm, "backward combine", l);
    return exchange_start(m, m->send_buf, a->recv_rows, m->recv_buf, a->send_rows,
                          sizeof(real) * (m->D + m->K));
}

/* (c): the row gradients into dh and the router's, then the FFN norm and attention. */
static moe_status layer_backward_end(moe_model *m, int l, int64_t step_sequences)
{
    const moe_layer_view *w = &m->p.layers[l];
    const moe_layer_view *g = &m->g.layers[l];
    moe_layer_acts *a = &m->acts[l];
    const int N = m->Nc, D = m->D, K = m->K;
    if (l >= m->cfg.dense_layers) {
        moe_comm_set_context(m->comm, "backward combine", l);
        MOE_CHECK(exchange_finish(m));
        if (!rows_are_tokens(m, l)) /* else the experts wrote dh and dw */
            m->be->moe_scatter_grad_rows(m->dh, m->dw, m->Fs > 0 ? m->dh : NULL,
                                         (const real *)exchange_rows(m), a->send_token, a->n_send,
                                         D, K, a->token_rows, N, m->ep);
        router_backward_layer(m, l, step_sequences);
    }
    const int first = first_dw(m);
    /* In a 16-bit precision, where dq is marked (qkv16), the FFN norm's backward also
     * writes the residual gradient rounded, into dq, which is free until the attention's
     * backward below writes it: the output projection's GEMMs read that, and no rounding
     * pass reads dres's 64 MiB (at the bench shape) again. The same bits as that pass. */
    real *dres_op = m->row_x16 != MOE_ROW_FP32 && m->qkv16 ? m->dq : NULL;
    m->be->rmsnorm_backward(m->dres, g->ffn_norm, m->dh, a->xmid, w->ffn_norm, a->rstd2, N, D,
                            first, dres_op);

    /* attention branch: xmid = x[l] + attn(norm(x[l])) */
    m->be->matmul_backward(m->datt, g->wo, dres_op ? dres_op : m->dres, a->att, w->wo, N, D, D,
                           MOE_WRITE_DX | first);
    /* the q, k, v projections' backward as one GEMM over [dq | dk | dv] and [wq; wk; wv] */
    m->be->attention_backward_qkv(m->dqkv, m->dq, m->dk, m->dv, m->datt, a->att, a->att_lse, a->q,
                                  a->k, a->v, m->rope_cos, m->rope_sin, m->Bc, m->T, m->H, m->Hd);
    m->be->matmul_backward(m->dh, g->wq, m->dqkv, a->h1, w->wq, N, D, 3 * D, MOE_WRITE_DX | first);
    m->be->rmsnorm_backward(m->dres, g->attn_norm, m->dh, m->x[l], w->attn_norm, a->rstd1, N, D,
                            first, NULL);
    return MOE_OK;
}

static void grad_ready(moe_model *m, int stage)
{
    if (m->grad_ready)
        m->grad_ready(m->grad_ready_ctx, stage);
}

moe_status moe_model_logits(moe_model *m, real *host)
{
    const int Nc = m->Nc;
    const int marked = m->dlogits && m->dlogits != m->logits; /* fp32 logits here */
    if (marked)
        MOE_CHECK(m->be->mark_operand(m->logits, 0));
    for (int i = 0; i < m->C; i++) {
        use_chunk(m, i);
        for (int r0 = 0; r0 < Nc; r0 += m->head_rows) {
            int rows = Nc - r0 < m->head_rows ? Nc - r0 : m->head_rows;
            m->be->matmul_forward(m->logits, m->hf + (size_t)r0 * m->D, m->p.lm_head, rows, m->D,
                                  m->V);
            m->be->copy(host + ((size_t)i * Nc + r0) * m->V, m->logits,
                        sizeof(real) * (size_t)rows * m->V, MOE_COPY_D2H);
        }
    }
    if (marked)
        MOE_CHECK(m->be->mark_operand(m->logits, (size_t)m->head_rows * m->V));
    return m->be->sync();
}

moe_status moe_model_backward(moe_model *m, int64_t step_sequences)
{
    const int Nc = m->Nc, D = m->D;
    const int64_t fused = m->head_done; /* the forward ran the LM head's backward */
    m->head_done = 0;
    if (fused && fused != step_sequences)
        MOE_FAIL(MOE_ERR_INVALID,
                 "the forward ran the LM head's backward for %lld sequences, the backward is "
                 "for %lld",
                 (long long)fused, (long long)step_sequences);
    const int begun = m->backward_begun; /* the forward ran the final norm and (a) of L-1 */
    m->backward_begun = 0;
    for (int i = 0; i < m->C && !begun; i++) {
        use_chunk(m, i);
        if (!fused) {
            for (int r0 = 0; r0 < Nc; r0 += m->head_rows) {
                int rows = Nc - r0 < m->head_rows ? Nc - r0 : m->head_rows;
                if (rows < Nc || m->C > 1) /* the logits of this one were overwritten */
                    m->be->matmul_forward(m->logits, m->hf + (size_t)r0 * D, m->p.lm_head, rows, D,
                                          m->V);
                head_backward(m, r0, rows, step_sequences, 0);
            }
        }
        final_norm_backward(m);
    }
    grad_ready(m, m->L);
    for (int l = m->L - 1; l >= 0; l--) {
        for (int i = 0; i < m->C; i++) {
            use_chunk(m, i);
            if (l < m->L - 1)
                MOE_CHECK(layer_backward_end(m, l + 1, step_sequences));
            if (l < m->L - 1 || !begun)
                MOE_CHECK(layer_backward_begin(m, l));
        }
        if (l < m->L - 1)
            grad_ready(m, l + 1);
        for (int i = 0; i < m->C; i++) {
            use_chunk(m, i);
            MOE_CHECK(layer_backward_experts(m, l));
        }
    }
    for (int i = 0; i < m->C; i++) {
        use_chunk(m, i);
        MOE_CHECK(layer_backward_end(m, 0, step_sequences));
    }
    grad_ready(m, 0);
    for (int i = 0; i < m->C; i++) {
        use_chunk(m, i);
        m->be->embedding_backward(m->g.embedding, m->dres, m->tokens, Nc, D, m->V);
    }
    m->grads_fresh = 0;
    grad_ready(m, -1);
    return MOE_OK;
}

/* ---- moving experts between ranks (re-planning) ----------------------------------------- */

/* An arena laid out like the parameters, of elem-byte elements (the parameters, Adam's
 * moments in fp32 or bf16). */
typedef struct {
    char *base;
    size_t elem;
} arena_ref;

/* The slices of expert `local` of every expert tensor of layer l, in tensor order, in an
 * arena: (tensor i, its offset of slice `local`, bytes). Calls fn for each. */
typedef void (*slice_fn)(void *ctx, char *slice, size_t nbytes);

static void for_each_slice(const moe_model *m, arena_ref a, int l, int local, slice_fn fn,
                           void *ctx)
{
    for (int i = 0; i < m->n_tensors; i++) {
        const moe_tensor *t = &m->tensors[i];
        if (!t->is_expert || t->layer != l)
            continue;
        size_t per = t->count / (size_t)m->El;
        fn(ctx, a.base + (t->offset + (size_t)local * per) * a.elem, per * a.elem);
    }
}

typedef struct {
    const moe_backend *be;
    char *cursor;
    int to_arena; /* 1: buffer -> arena, 0: arena -> buffer */
} slice_copy;

static void copy_slice(void *ctx, char *slice, size_t nbytes)
{
    slice_copy *c = ctx;
    if (c->to_arena)
        c->be->copy(slice, c->cursor, nbytes, MOE_COPY_H2D);
    else
        c->be->copy(c->cursor, slice, nbytes, MOE_COPY_D2H);
    c->cursor += nbytes;
}

/* Waits for the backend, watching the communication it may wait for (a failure
 * surfaces at the step's own wait). */
static void phase_wait(moe_model *m)
{
    (void)m->be->queue_wait(m->be->queue_mark(), moe_comm_watch, m->comm);
}

double moe_model_phase_begin(moe_model *m)
{
    if (!m->timing)
        return 0.0;
    phase_wait(m);
    return moe_clock_seconds();
}

void moe_model_phase_end(moe_model *m, double t0, moe_phase phase)
{
    if (!m->timing)
        return;
    phase_wait(m);
    m->phase_s[phase] += moe_clock_seconds() - t0;
}

moe_status moe_model_attach_routing(moe_model *m, moe_routing_stats *s)
{
    if (m->be->on_device)
        m->be->release(m->routing_dev);
    m->routing_dev = NULL;
    m->routing = s;
    if (!s)
        return MOE_OK;
    if (s->layers != m->L - m->cfg.dense_layers || s->experts != m->E)
        MOE_FAIL(MOE_ERR_INVALID,
                 "routing statistics of %d layers x %d experts for a model of %d MoE layers x "
                 "%d experts",
                 s->layers, s->experts, m->L - m->cfg.dense_layers, m->E);
    if (m->K > MOE_SCHED_MAX_K)
        MOE_FAIL(MOE_ERR_INVALID, "routing statistics: top_k = %d, at most %d", m->K,
                 MOE_SCHED_MAX_K);
    if (!m->be->on_device) { /* the cpu backend counts into s itself */
        m->routing_dev = s->data;
        return MOE_OK;
    }
    m->routing_dev = m->be->alloc(sizeof(int64_t) * s->count);
    if (!m->routing_dev)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate %zu routing counters on the device", s->count);
    m->be->zero(m->routing_dev, sizeof(int64_t) * s->count);
    return m->be->sync();
}

moe_status moe_model_routing_collect(moe_model *m)
{
    moe_routing_stats *s = m->routing;
    if (!s)
        return MOE_OK;
    s->top_k = m->K;
    if (!m->be->on_device)
        return MOE_OK;
    int64_t *host = malloc(sizeof(int64_t) * s->count);
    if (!host)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate %zu routing counters", s->count);
    m->be->copy(host, m->routing_dev, sizeof(int64_t) * s->count, MOE_COPY_D2H);
    m->be->zero(m->routing_dev, sizeof(int64_t) * s->count);
    moe_status st = m->be->sync();
    if (st == MOE_OK)
        for (size_t i = 0; i < s->count; i++)
            s->data[i] += host[i];
    free(host);
    return st;
}

moe_status moe_model_move_experts(moe_model *m, const int *expert_rank, void **extra,
                                  const size_t *extra_elem, int n_extra)
{
    const int E = m->E, P = m->ep, me = m->ep_rank;
    const int n_arenas = 1 + (n_extra < 7 ? n_extra : 7);
    arena_ref arenas[8] = {{(char *)m->params, sizeof(real)}};
    size_t elems = sizeof(real); /* bytes of one element over the arenas */
    for (int a = 1; a < n_arenas; a++) {
        arenas[a] = (arena_ref){(char *)extra[a - 1], extra_elem[a - 1]};
        elems += extra_elem[a - 1];
    }
    size_t per_expert = 0; /* elements of one expert over its tensors of one layer */
    for (int i = 0; i < m->n_tensors; i++)
        if (m->tensors[i].is_expert && m->tensors[i].layer == m->L - 1)
            per_expert += m->tensors[i].count / (size_t)m->El;
    const size_t unit = per_expert * elems; /* bytes moved per expert */
    moe_status st = MOE_OK;
    char *sendb = malloc(unit * (size_t)m->El);
    char *recvb = malloc(unit * (size_t)m->El);
    char *keep = malloc(unit * (size_t)m->El);
    size_t *sizes = calloc(4 * (size_t)P, sizeof(size_t));
    int *new_local = malloc(sizeof(int) * E);
    if (!sendb || !recvb || !keep || !sizes || !new_local) {
        st = MOE_ERR_NOMEM;
        moe_log_at(__FILE__, __LINE__, "cannot allocate the expert move buffers");
        goto fail;
    }
    for (int l = m->cfg.dense_layers; l < m->L; l++) {
        const int *old_rank = m->expert_rank + (size_t)l * E;
        const int *old_local = m->expert_local + (size_t)l * E;
        const int *new_rank = expert_rank + (size_t)l * E;
        for (int p = 0, n = 0; p < P; p++, n = 0)
            for (int e = 0; e < E; e++)
                if (new_rank[e] == p)
                    new_local[e] = n++;
        /* pack what leaves, by destination then expert id; stage what stays */
        size_t *sc = sizes, *sd = sc + P, *rc = sd + P, *rd = rc + P;
        slice_copy out = {m->be, sendb, 0}, stay = {m->be, keep, 0};
        for (int p = 0; p < P; p++) {
            sd[p] = (size_t)(out.cursor - sendb);
            for (int e = 0; e < E; e++)
                if (old_rank[e] == me && new_rank[e] == p && p != me)
                    for (int a = 0; a < n_arenas; a++)
                        for_each_slice(m, arenas[a], l, old_local[e], copy_slice, &out);
            sc[p] = (size_t)(out.cursor - sendb) - sd[p];
        }
        for (int e = 0; e < E; e++)
            if (old_rank[e] == me && new_rank[e] == me)
                for (int a = 0; a < n_arenas; a++)
                    for_each_slice(m, arenas[a], l, old_local[e], copy_slice, &stay);
        size_t ro = 0;
        for (int p = 0; p < P; p++) {
            int n = 0;
            for (int e = 0; e < E; e++)
                n += old_rank[e] == p && new_rank[e] == me && p != me;
            rc[p] = (size_t)n * unit;
            rd[p] = ro;
            ro += rc[p];
        }
        if (P > 1) {
            moe_comm_handle done;
            MOE_CHECK_GOTO(st, moe_comm_exchange_host_start(m->comm, sendb, sc, sd, recvb, rc, rd,
                                                            MOE_COMM_NONE, &done));
            MOE_CHECK_GOTO(st, moe_comm_wait(m->comm, done));
        }
        /* unpack: staying experts, then arrivals by source then expert id */
        slice_copy in = {m->be, keep, 1};
        for (int e = 0; e < E; e++)
            if (old_rank[e] == me && new_rank[e] == me)
                for (int a = 0; a < n_arenas; a++)
                    for_each_slice(m, arenas[a], l, new_local[e], copy_slice, &in);
        in.cursor = recvb;
        for (int p = 0; p < P; p++)
            for (int e = 0; e < E; e++)
                if (old_rank[e] == p && new_rank[e] == me && p != me)
                    for (int a = 0; a < n_arenas; a++)
                        for_each_slice(m, arenas[a], l, new_local[e], copy_slice, &in);
    }
    st = moe_model_set_placement(m, expert_rank);
fail:
    free(sendb);
    free(recvb);
    free(keep);
    free(sizes);
    free(new_local);
    return st;
}
