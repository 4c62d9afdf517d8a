/* tests/unit/test_trainer_step.c: a training step on the CPU backend.
 * - The host waits for the backend only where the design says: once per MoE layer, chunk
 *   and micro-batch (the dispatch counts) and once at the end of the step (the losses and
 *   the gradient norm come back together). The trainer runs on a copy of the cpu backend
 *   whose waiting calls are counted: sync, queue_wait, copies to the host, and every op
 *   that returns a value to the host (sum_values, sum_squares, all_finite).
 * - A skip is decided on the backend and seen by the host at the step's end: a non-finite
 *   gradient (MOE_FAULT=nan) leaves the parameters unchanged.
 * - AdamW's moments in bf16 ([precision] optimizer_state = bf16): the losses follow the
 *   fp32-moment run closely (the update is computed in double from the widened moments;
 *   only their storage rounds) but not identically (so the bf16 path ran).
 * - The next step's first micro-batch, read while the optimizer runs, is the one the step
 *   then takes, with the losses of reading it at the step's start.
 * - The model's grad_ready callbacks come in the stages' order.
 * - Without MoE layers (no count wait), a micro-batch's forward waits for the copies of
 *   the tokens before it rewrites their host staging. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "runtime/trainer.h"

static struct {
    long sync, queue_wait, d2h, values;
} waits;

static moe_status count_sync(void)
{
    waits.sync++;
    return moe_backend_cpu.sync();
}

static moe_status count_queue_wait(long mark, moe_status (*watch)(void *), void *ctx)
{
    waits.queue_wait++;
    return moe_backend_cpu.queue_wait(mark, watch, ctx);
}

static void count_copy(void *dst, const void *src, size_t nbytes, moe_copy_kind kind)
{
    waits.d2h += kind == MOE_COPY_D2H;
    moe_backend_cpu.copy(dst, src, nbytes, kind);
}

static double count_sum_values(const real *x, size_t n)
{
    waits.values++;
    return moe_backend_cpu.sum_values(x, n);
}

static double count_sum_squares(const real *x, size_t n)
{
    waits.values++;
    return moe_backend_cpu.sum_squares(x, n);
}

static int count_all_finite(const real *x, size_t n)
{
    waits.values++;
    return moe_backend_cpu.all_finite(x, n);
}

static moe_backend counting;

/* 3 layers, the first `dense` dense; `chunks` chunks, `accum` micro-batches; AdamW state
 * fp32 or bf16. */
static moe_trainer *make_trainer_dense(int chunks, int accum, const char *state, int dense)
{
    moe_config cfg;
    moe_config_defaults(&cfg);
    cfg.vocab_size = 64;
    cfg.d_model = 16;
    cfg.n_layers = 3;
    cfg.dense_layers = dense;
    cfg.dense_hidden = 12;
    cfg.n_heads = 2;
    cfg.seq_len = 8;
    cfg.experts = 4;
    cfg.top_k = 2;
    cfg.expert_hidden = 8;
    cfg.micro_batch = 4;
    cfg.steps = 12;
    cfg.accum[0].from_step = 0;
    cfg.accum[0].micro_batches = accum;
    cfg.n_accum = 1;
    snprintf(cfg.a2a_chunks, sizeof cfg.a2a_chunks, "%d", chunks);
    cfg.warmup_steps = 2;
    cfg.lr = 3e-3;
    snprintf(cfg.backend, sizeof cfg.backend, "cpu");
    snprintf(cfg.optimizer_state, sizeof cfg.optimizer_state, "%s", state);
    assert_int_equal(moe_config_validate(&cfg), MOE_OK);
    moe_trainer *tr = NULL;
    assert_int_equal(moe_trainer_create(&tr, &cfg, NULL), MOE_OK);
    assert_int_equal(tr->model->C, chunks);
    counting = moe_backend_cpu;
    counting.sync = count_sync;
    counting.queue_wait = count_queue_wait;
    counting.copy = count_copy;
    counting.sum_values = count_sum_values;
    counting.sum_squares = count_sum_squares;
    counting.all_finite = count_all_finite;
    tr->model->be = &counting;
    return tr;
}

/* 3 layers, the first dense: 2 MoE layers */
static moe_trainer *make_trainer(int chunks, int accum, const char *state)
{
    return make_trainer_dense(chunks, accum, state, 1);
}

static void check_waits(int chunks, int accum)
{
    moe_trainer *tr = make_trainer(chunks, accum, "fp32");
    const int moe_layers = 2;
    for (int s = 0; s < 3; s++) {
        moe_step_result r;
        memset(&waits, 0, sizeof waits);
        assert_int_equal(moe_trainer_accumulate(tr, &r), MOE_OK);
        assert_int_equal(waits.queue_wait, (long)moe_layers * chunks * accum);
        assert_int_equal(moe_trainer_apply(tr, &r), MOE_OK);
        assert_int_equal(waits.queue_wait, (long)moe_layers * chunks * accum + 1);
        assert_int_equal(waits.sync, 0);
        assert_int_equal(waits.d2h, 0);
        assert_int_equal(waits.values, 0);
        assert_true(r.ce > 0 && r.grad_norm > 0 && r.skipped == 0);
    }
    moe_trainer_destroy(tr);
}

static void test_waits_one_chunk(void **state)
{
    (void)state;
    check_waits(1, 1);
}

static void test_waits_chunks_and_accumulation(void **state)
{
    (void)state;
    check_waits(2, 3);
}

/* Without MoE layers no count wait follows a forward's copies of the tokens from the
 * host's staging (pinned on a device: the copy may still be queued), so each later
 * micro-batch's forward waits for the one before's copies before it rewrites the staging;
 * the step's first needs none (the last step's wait for the losses came after them). */
static void test_waits_dense_accumulation(void **state)
{
    (void)state;
    const int accum = 3;
    moe_trainer *tr = make_trainer_dense(1, accum, "fp32", 3);
    for (int s = 0; s < 3; s++) {
        moe_step_result r;
        memset(&waits, 0, sizeof waits);
        assert_int_equal(moe_trainer_accumulate(tr, &r), MOE_OK);
        assert_int_equal(waits.queue_wait, accum - 1);
        assert_int_equal(moe_trainer_apply(tr, &r), MOE_OK);
        assert_int_equal(waits.queue_wait, accum);
        assert_true(r.ce > 0 && r.grad_norm > 0 && r.skipped == 0);
    }
    moe_trainer_destroy(tr);
}

/* A NaN in the gradients of the second step (MOE_FAULT=nan@0:1): without loss scaling the
 * step fails, and the skip decided on the backend left the parameters and the optimizer's
 * step count as they were. */
static void test_nan_step_changes_nothing(void **state)
{
    (void)state;
    moe_trainer *tr = make_trainer(1, 1, "fp32");
    tr->fault = (moe_fault){.kind = MOE_FAULT_NAN, .rank = 0, .step = 1};
    moe_step_result r;
    assert_int_equal(moe_trainer_accumulate(tr, &r), MOE_OK);
    assert_int_equal(moe_trainer_apply(tr, &r), MOE_OK);
    const size_t n = tr->model->n_params;
    real *before = malloc(sizeof(real) * n);
    assert_non_null(before);
    memcpy(before, tr->model->params, sizeof(real) * n);
    const int t = tr->opt->t;
    assert_int_equal(moe_trainer_accumulate(tr, &r), MOE_OK);
    assert_int_equal(moe_trainer_apply(tr, &r), MOE_ERR_NUMERIC);
    assert_memory_equal(before, tr->model->params, sizeof(real) * n);
    assert_int_equal(tr->opt->t, t);
    free(before);
    moe_trainer_destroy(tr);
}

static void test_bf16_moments_follow_fp32(void **state)
{
    (void)state;
    moe_trainer *a = make_trainer(1, 1, "fp32"), *b = make_trainer(1, 1, "bf16");
    assert_int_equal(a->opt->moments16, 0);
    assert_int_equal(b->opt->moments16, 1);
    double worst = 0;
    int differ = 0;
    for (int s = 0; s < 12; s++) {
        moe_step_result ra, rb;
        assert_int_equal(moe_trainer_accumulate(a, &ra), MOE_OK);
        assert_int_equal(moe_trainer_apply(a, &ra), MOE_OK);
        assert_int_equal(moe_trainer_accumulate(b, &rb), MOE_OK);
        assert_int_equal(moe_trainer_apply(b, &rb), MOE_OK);
        const double rel = fabs(ra.loss - rb.loss) / ra.loss;
        worst = rel > worst ? rel : worst;
        differ |= ra.loss != rb.loss;
    }
    printf("bf16 moments against fp32 moments, 12 steps: worst relative loss difference %.2e\n",
           worst);
    assert_true(differ);       /* the moments were rounded: the runs part */
    assert_true(worst < 1e-3); /* and only by their rounding */
    moe_trainer_destroy(a);
    moe_trainer_destroy(b);
}

/* The next step's first micro-batch is read while the step's optimizer runs (apply): it is
 * the batch the data source gives at the next step's position, the next step takes it
 * (and reads nothing), and the losses are those of a trainer that reads every batch when
 * its step starts (its read-ahead dropped after each apply), bit for bit. */
static void test_next_batch_read_ahead(void **state)
{
    (void)state;
    moe_trainer *a = make_trainer(1, 2, "fp32"), *b = make_trainer(1, 2, "fp32");
    const int micro = a->cfg.micro_batch;
    const size_t n = (size_t)micro * (a->cfg.seq_len + 1);
    int32_t *want = malloc(sizeof(int32_t) * n);
    assert_non_null(want);
    for (int s = 0; s < 4; s++) {
        moe_step_result ra, rb;
        assert_int_equal(moe_trainer_accumulate(a, &ra), MOE_OK);
        assert_int_equal(a->next_first, -1); /* the batch read ahead (s > 0) was taken */
        assert_int_equal(moe_trainer_apply(a, &ra), MOE_OK);
        assert_int_equal(a->next_first, a->consumed); /* one rank: rank 0's first sequence */
        assert_int_equal(moe_data_batch(a->data, want, a->consumed, micro), MOE_OK);
        assert_memory_equal(want, a->tokens_next, sizeof(int32_t) * n);
        assert_int_equal(moe_trainer_accumulate(b, &rb), MOE_OK);
        assert_int_equal(moe_trainer_apply(b, &rb), MOE_OK);
        b->next_first = -1; /* b reads each batch when its step starts */
        assert_true(ra.loss == rb.loss && ra.grad_norm == rb.grad_norm);
    }
    free(want);
    moe_trainer_destroy(a);
    moe_trainer_destroy(b);
}

/* The model's grad_ready callback in a backward: after each stage (L, the layers from the
 * last, -1 the embedding), every micro-batch, in that order (the trainer queues each
 * stage's reduction and update from it). */
static struct {
    int events[32], n;
} calls;

static void record_stage(void *ctx, int stage)
{
    (void)ctx;
    assert_true(calls.n < 32);
    calls.events[calls.n++] = stage;
}

static void check_stage_callbacks(int chunks, int accum)
{
    moe_trainer *tr = make_trainer(chunks, accum, "fp32");
    memset(&calls, 0, sizeof calls);
    tr->model->grad_ready = record_stage;
    /* 3 layers: stage 3 (head), 2, 1, 0, the embedding (-1); once per micro-batch */
    const int want[5] = {3, 2, 1, 0, -1};
    for (int s = 0; s < 2; s++) {
        moe_step_result r;
        calls.n = 0;
        assert_int_equal(moe_trainer_accumulate(tr, &r), MOE_OK);
        assert_int_equal(calls.n, 5 * accum);
        for (int a = 0; a < accum; a++)
            assert_memory_equal(calls.events + 5 * a, want, sizeof want);
        assert_int_equal(moe_trainer_apply(tr, &r), MOE_OK);
    }
    moe_trainer_destroy(tr);
}

static void test_stage_callbacks(void **state)
{
    (void)state;
    check_stage_callbacks(1, 1);
    check_stage_callbacks(2, 1);
    check_stage_callbacks(2, 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_waits_one_chunk),
        cmocka_unit_test(test_waits_chunks_and_accumulation),
        cmocka_unit_test(test_waits_dense_accumulation),
        cmocka_unit_test(test_nan_step_changes_nothing),
        cmocka_unit_test(test_bf16_moments_follow_fp32),
        cmocka_unit_test(test_next_batch_read_ahead),
        cmocka_unit_test(test_stage_callbacks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
