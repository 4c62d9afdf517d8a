/* Whole-model gradients against central finite differences, in double precision
 * (this test links moe_core_f64, where real = double). For several configurations
 * (dense layer, shared experts, k = 1..3, renormalised or not, capacity drops) it checks
 * sampled elements of every tensor of the gradient of
 *   loss = ce + aux_coef * aux + z_coef * z   (model.h) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/config.h"
#include "runtime/model.h"
#include "util/rng.h"

typedef struct {
    const char *name;
    int dense_layers, shared, K, renorm;
    double capacity_factor;
    int head_rows; /* 0: the model's choice; else LM-head chunks of this many tokens */
    int chunks;    /* 0: one; else the micro-batch runs as this many chunks (a2a_chunks) */
} model_case;

static moe_config small_config(const model_case *c)
{
    moe_config cfg;
    moe_config_defaults(&cfg);
    cfg.vocab_size = 11;
    cfg.d_model = 8;
    cfg.n_heads = 2;
    cfg.n_layers = 2;
    cfg.seq_len = 5;
    cfg.micro_batch = 2;
    cfg.experts = 4;
    cfg.top_k = c->K;
    cfg.expert_hidden = 6;
    cfg.dense_hidden = 7;
    cfg.dense_layers = c->dense_layers;
    cfg.shared_experts = c->shared;
    cfg.renorm_topk = c->renorm;
    cfg.capacity_factor = c->capacity_factor;
    cfg.aux_loss_coef = 0.3; /* large, so the aux gradient is visible */
    cfg.z_loss_coef = 0.2;
    cfg.seed = 7;
    if (c->chunks > 0)
        snprintf(cfg.a2a_chunks, sizeof cfg.a2a_chunks, "%d", c->chunks);
    return cfg;
}

/* A fingerprint of every discrete routing choice of the last forward (top-k experts and
 * which assignments the capacity kept), so a perturbation that flips one is skipped. */
static uint64_t routing_fingerprint(const moe_model *m)
{
    uint64_t h = 0;
    for (int c = 0; c < m->C; c++)
        for (int l = m->cfg.dense_layers; l < m->L; l++) {
            const moe_layer_acts *a = &m->chunk[c].acts[l];
            for (int i = 0; i < m->Nc * m->K; i++)
                h = moe_mix64(h ^ (uint64_t)(a->idx[i] * 7919 + (a->slot_row[i] >= 0)));
        }
    return h;
}

static double step_loss(moe_model *m, const int32_t *tokens, int64_t S, moe_fwd_stats *fs)
{
    assert_int_equal(moe_model_forward(m, tokens, fs), MOE_OK);
    double ce_sum = 0, tok = (double)S * m->T;
    assert_int_equal(moe_model_take_ce(m, &ce_sum), MOE_OK);
    return ce_sum / tok + m->cfg.aux_loss_coef * fs->aux_sum / ((double)S / m->B) +
           m->cfg.z_loss_coef * fs->z_sum / tok;
}

static void check_case(const model_case *c)
{
    moe_config cfg = small_config(c);
    moe_model *m = NULL;
    assert_int_equal(moe_model_create(&m, &cfg, NULL, NULL), MOE_OK);
    assert_int_equal(m->C, c->chunks > 0 ? c->chunks : 1);
    if (c->head_rows > 0) { /* smaller chunks than sized for: the buffers are large enough */
        assert_true(c->head_rows <= m->head_rows);
        m->head_rows = c->head_rows;
    }
    /* random weights everywhere, norms included, large enough that routing is decisive */
    for (size_t i = 0; i < m->n_params; i++)
        m->params[i] = 0.5 * moe_rng_normal(99, 1, i);
    for (int i = 0; i < m->n_tensors; i++)
        if (m->tensors[i].ndim == 1)
            for (size_t j = 0; j < m->tensors[i].count; j++)
                m->params[m->tensors[i].offset + j] = 1.0 + 0.3 * moe_rng_normal(98, i, j);
    int32_t tokens[2 * 6];
    for (int i = 0; i < 12; i++)
        tokens[i] = (int32_t)(moe_rng_u64(5, 0, i) % (uint64_t)cfg.vocab_size);
    const int64_t S = cfg.micro_batch;

    moe_fwd_stats fs;
    step_loss(m, tokens, S, &fs);
    const uint64_t routing = routing_fingerprint(m);
    if (c->capacity_factor > 0)
        assert_true(fs.dropped > 0); /* the case must really drop assignments */
    memset(m->grads, 0, sizeof(double) * m->n_params);
    assert_int_equal(moe_model_backward(m, S), MOE_OK);

    /* the LM head's backward run inside the forward (as the trainer does) gives the same
     * gradients, bit for bit */
    double *unfused = malloc(sizeof(double) * m->n_params);
    assert_non_null(unfused);
    memcpy(unfused, m->grads, sizeof(double) * m->n_params);
    memset(m->grads, 0, sizeof(double) * m->n_params);
    moe_model_fuse_head(m, S);
    step_loss(m, tokens, S, &fs);
    assert_int_equal(moe_model_backward(m, S), MOE_OK);
    size_t differ = 0;
    for (size_t i = 0; i < m->n_params; i++)
        differ += m->grads[i] != unfused[i];
    printf("  %s: LM head fused into the forward: %zu of %zu gradients differ\n", c->name, differ,
           m->n_params);
    assert_int_equal(differ, 0);
    free(unfused);

    int bad = 0, checked = 0;
    const double eps = 1e-5;
    for (int i = 0; i < m->n_tensors; i++) {
        const moe_tensor *t = &m->tensors[i];
        for (int s = 0; s < 8; s++) {
            size_t j = t->offset + moe_rng_u64(3, i, s) % t->count;
            double saved = m->params[j];
            moe_fwd_stats f1, f2;
            m->params[j] = saved + eps;
            double lp = step_loss(m, tokens, S, &f1);
            uint64_t rp = routing_fingerprint(m);
            m->params[j] = saved - eps;
            double lm = step_loss(m, tokens, S, &f2);
            uint64_t rm = routing_fingerprint(m);
            m->params[j] = saved;
            if (rp != routing || rm != routing)
                continue; /* the perturbation changed a discrete choice: not comparable */
            double fd = (lp - lm) / (2 * eps);
            double g = m->grads[j];
            checked++;
            if (fabs(g - fd) > 1e-8 + 1e-5 * fabs(fd)) {
                if (bad++ < 10)
                    printf("  %s: %s[%zu] analytic %.10g fd %.10g\n", c->name, t->name,
                           j - t->offset, g, fd);
            }
        }
    }
    printf("  %s: %d elements checked, %d mismatches\n", c->name, checked, bad);
    assert_true(checked > 8 * m->n_tensors / 2);
    assert_int_equal(bad, 0);
    moe_model_destroy(m);
}

static void test_dropless_k2_shared_dense(void **state)
{
    (void)state;
    model_case c = {"dropless k2 shared dense", 1, 1, 2, 1, 0, 0, 0};
    check_case(&c);
}

static void test_dropless_k1(void **state)
{
    (void)state;
    model_case c = {"dropless k1", 0, 0, 1, 0, 0, 0, 0};
    check_case(&c);
}

static void test_dropless_k3_norenorm(void **state)
{
    (void)state;
    model_case c = {"dropless k3 no renorm", 0, 1, 3, 0, 0, 0, 0};
    check_case(&c);
}

static void test_lm_head_in_chunks(void **state)
{
    (void)state;
    model_case c = {"dropless k2, LM head in chunks of 3 tokens", 1, 1, 2, 1, 0, 3, 0};
    check_case(&c);
}

static void test_capacity_k2(void **state)
{
    (void)state;
    model_case c = {"capacity k2", 0, 0, 2, 1, 0.5, 0, 0};
    check_case(&c);
}

/* The micro-batch in 2 chunks of 1 sequence: the aux term still uses the counts of the
 * whole micro-batch, each chunk's gradients add into the same arena. */
static void test_chunks(void **state)
{
    (void)state;
    model_case c = {"dropless k2 shared dense, 2 chunks", 1, 1, 2, 1, 0, 0, 2};
    check_case(&c);
    model_case cap = {"capacity k2, 2 chunks (capacity per chunk)", 0, 0, 2, 1, 0.5, 0, 2};
    check_case(&cap);
}

/* The test above would pass if backward did nothing and FD agreed by accident; this
 * one shows the check can fail: a wrong gradient is caught. */
static void test_detects_wrong_gradient(void **state)
{
    (void)state;
    model_case c = {"broken", 0, 0, 2, 1, 0, 0, 0};
    moe_config cfg = small_config(&c);
    moe_model *m = NULL;
    assert_int_equal(moe_model_create(&m, &cfg, NULL, NULL), MOE_OK);
    int32_t tokens[12];
    for (int i = 0; i < 12; i++)
        tokens[i] = i % cfg.vocab_size;
    moe_fwd_stats fs;
    double l0 = step_loss(m, tokens, 2, &fs);
    memset(m->grads, 0, sizeof(double) * m->n_params);
    assert_int_equal(moe_model_backward(m, 2), MOE_OK);
    int i = moe_model_find_tensor(m, "lm_head");
    assert_true(i >= 0);
    size_t j = m->tensors[i].offset + 3;
    double saved = m->params[j];
    m->params[j] = saved + 1e-5;
    double lp = step_loss(m, tokens, 2, &fs);
    m->params[j] = saved - 1e-5;
    double lm = step_loss(m, tokens, 2, &fs);
    double fd = (lp - lm) / 2e-5;
    assert_true(isfinite(l0));
    assert_true(fabs(m->grads[j] - fd) <= 1e-8 + 1e-5 * fabs(fd));
    assert_false(fabs(m->grads[j] * 1.001 - fd) <= 1e-8 + 1e-5 * fabs(fd));
    /* a backward for another step size than the fused forward's is refused */
    moe_model_fuse_head(m, 2);
    step_loss(m, tokens, 2, &fs);
    assert_int_equal(moe_model_backward(m, 3), MOE_ERR_INVALID);
    moe_model_destroy(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dropless_k2_shared_dense),
        cmocka_unit_test(test_dropless_k1),
        cmocka_unit_test(test_dropless_k3_norenorm),
        cmocka_unit_test(test_capacity_k2),
        cmocka_unit_test(test_chunks),
        cmocka_unit_test(test_lm_head_in_chunks),
        cmocka_unit_test(test_detects_wrong_gradient),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
