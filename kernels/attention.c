/* kernels/attention.c: CPU reference of causal multi-head attention, scale 1/sqrt(Hd).
 * q, k, v, out are (B*T, H*Hd); head h of token (b, t) is the Hd values at row b*T+t,
 * columns h*Hd... The forward saves lse (B, H, T); the backward recomputes the
 * probabilities from it, as a fused kernel does. Dot products and sums are in double.
 *
 * Parallel over (sequence, head) pairs: each pair owns its slices of every output and
 * gradient and computes them in a fixed order, so the bits do not depend on the thread
 * count. Scratch: stack arrays of T doubles per pair (scores of one query in the
 * forward, dout.out per query in the backward); the backward makes two passes (dq by
 * query rows, then dk and dv by key rows) so that every gradient row is one sum held in
 * double and added once. */
#include <math.h>

#include "kernels/ops.h"

#define LANES 8

/* sum_i a[i] b[i] in double, in a fixed order: LANES interleaved partial sums (which gcc
 * vectorizes without -ffast-math), added in lane order, then the tail. */
static inline double dot_d(const real *a, const real *b, int n)
{
    double acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] += (double)a[i + l] * b[i + l];
    double s = 0.0;
    for (int l = 0; l < LANES; l++)
        s += acc[l];
    for (; i < n; i++)
        s += (double)a[i] * b[i];
    return s;
}

/* One query row: p[j] = softmax over j <= t of the scaled scores; returns the lse. */
static double attention_row(double *p, const real *qt, const real *k, int t, int ld, int Hd,
                            double scale)
{
    double m = -INFINITY;
    for (int j = 0; j <= t; j++) {
        p[j] = scale * dot_d(qt, k + (size_t)j * ld, Hd);
        if (p[j] > m)
            m = p[j];
    }
    double sum = 0.0;
    for (int j = 0; j <= t; j++) {
        p[j] = exp(p[j] - m);
        sum += p[j];
    }
    for (int j = 0; j <= t; j++)
        p[j] /= sum;
    return m + log(sum);
}

void attention_forward(real *out, real *lse, const real *q, const real *k, const real *v, int B,
                       int T, int H, int Hd)
{
    if (T <= 0 || Hd <= 0)
        return; /* nothing to do, and no zero-length arrays */
    const int ld = H * Hd;
    const double scale = 1.0 / sqrt((double)Hd);
#pragma omp parallel for schedule(static) if ((long)B * H * T * T * Hd > 32768)
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        size_t base = (size_t)b * T * ld + (size_t)h * Hd;
        const real *qb = q + base, *kb = k + base, *vb = v + base;
        double p[T];
        double acc[Hd];
        for (int t = 0; t < T; t++) {
            lse[(size_t)bh * T + t] =
                (real)attention_row(p, qb + (size_t)t * ld, kb, t, ld, Hd, scale);
            for (int d = 0; d < Hd; d++)
                acc[d] = 0.0;
            for (int j = 0; j <= t; j++) {
                const real *vj = vb + (size_t)j * ld;
                for (int d = 0; d < Hd; d++)
                    acc[d] += p[j] * vj[d];
            }
            real *o = out + base + (size_t)t * ld;
            for (int d = 0; d < Hd; d++)
                o[d] = (real)acc[d];
        }
    }
}

/* Pointers to the (b, h) slices of the backward's operands; rows are ld apart. */
typedef struct {
    const real *q, *k, *v, *dout, *lse;
    const double *dsum; /* (T): dout_i . out_i = sum_j p_ij dp_ij */
    int T, Hd, ld;
    double scale;
} attn_slice;

/* p_ij and ds_ij = p_ij (dout_i . v_j - dsum_i), i >= j, recomputed from lse. */
static inline double attn_p(const attn_slice *s, int i, int j)
{
    double sc = s->scale * dot_d(s->q + (size_t)i * s->ld, s->k + (size_t)j * s->ld, s->Hd);
    return exp(sc - s->lse[i]);
}

static inline double attn_ds(const attn_slice *s, int i, int j, double p)
{
    double dp = dot_d(s->dout + (size_t)i * s->ld, s->v + (size_t)j * s->ld, s->Hd);
    return p * (dp - s->dsum[i]);
}

/* dq_i = scale * sum_{j <= i} ds_ij k_j. */
static void attention_backward_dq(real *dq, const attn_slice *s)
{
    double acc[s->Hd];
    for (int i = 0; i < s->T; i++) {
        for (int d = 0; d < s->Hd; d++)
            acc[d] = 0.0;
        for (int j = 0; j <= i; j++) {
            double ds = attn_ds(s, i, j, attn_p(s, i, j));
            const real *kj = s->k + (size_t)j * s->ld;
            for (int d = 0; d < s->Hd; d++)
                acc[d] += ds * kj[d];
        }
        real *dqi = dq + (size_t)i * s->ld;
        for (int d = 0; d < s->Hd; d++)
            dqi[d] = (real)(s->scale * acc[d]);
    }
}

/* dk_j = scale * sum_{i >= j} ds_ij q_i ; dv_j = sum_{i >= j} p_ij dout_i. */
static void attention_backward_dkv(real *dk, real *dv, const attn_slice *s)
{
    double acck[s->Hd], accv[s->Hd];
    for (int j = 0; j < s->T; j++) {
        for (int d = 0; d < s->Hd; d++)
            acck[d] = accv[d] = 0.0;
        for (int i = j; i < s->T; i++) {
            double p = attn_p(s, i, j);
            const real *qi = s->q + (size_t)i * s->ld, *gi = s->dout + (size_t)i * s->ld;
            if (dk) {
                double ds = attn_ds(s, i, j, p);
                for (int d = 0; d < s->Hd; d++)
                    acck[d] += ds * qi[d];
            }
            for (int d = 0; d < s->Hd; d++)
                accv[d] += p * gi[d];
        }
        size_t row = (size_t)j * s->ld;
        for (int d = 0; d < s->Hd; d++) {
            if (dk)
                dk[row + d] = (real)(s->scale * acck[d]);
            if (dv)
                dv[row + d] = (real)accv[d];
        }
    }
}

void attention_backward(real *dq, real *dk, real *dv, const real *dout, const real *out,
                        const real *lse, const real *q, const real *k, const real *v, int B, int T,
                        int H, int Hd)
{
    if (T <= 0 || Hd <= 0)
        return;
    const int ld = H * Hd;
#pragma omp parallel for schedule(static) if ((long)B * H * T * T * Hd > 16384)
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        size_t base = (size_t)b * T * ld + (size_t)h * Hd;
        double dsum[T];
        for (int i = 0; i < T; i++)
            dsum[i] = dot_d(dout + base + (size_t)i * ld, out + base + (size_t)i * ld, Hd);
        attn_slice s = {q + base, k + base, v + base, dout + base, lse + (size_t)bh * T,
                        dsum,     T,        Hd,       ld,          1.0 / sqrt((double)Hd)};
        if (dq)
            attention_backward_dq(dq + base, &s);
        if (dk || dv)
            attention_backward_dkv(dk ? dk + base : NULL, dv ? dv + base : NULL, &s);
    }
}

void attention_backward_qkv(real *dqkv, real *dq, real *dk, real *dv, const real *dout,
                            const real *out, const real *lse, const real *q, const real *k,
                            const real *v, const real *cos_t, const real *sin_t, int B, int T,
                            int H, int Hd)
{
    attention_backward(dq, dk, dv, dout, out, lse, q, k, v, B, T, H, Hd);
    rope_backward_qkv(dqkv, dq, dk, dv, cos_t, sin_t, B, T, H, Hd);
}
