/* tests/unit/test_trainer_bf16_state.c: training with AdamW's moments in bf16
 * ([precision] optimizer_state = bf16) on the CPU: the moments take half the bytes, the
 * losses follow the fp32-moment run closely (the update is computed in double from the
 * widened moments; only their storage rounds) but not identically (so the bf16 path ran). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "runtime/trainer.h"

static moe_trainer *make_trainer(const char *state)
{
    moe_config cfg;
    moe_config_defaults(&cfg);
    cfg.vocab_size = 64;
    cfg.d_model = 16;
    cfg.n_layers = 2;
    cfg.dense_layers = 0;
    cfg.n_heads = 2;
    cfg.seq_len = 8;
    cfg.experts = 4;
    cfg.top_k = 2;
    cfg.expert_hidden = 8;
    cfg.micro_batch = 4;
    cfg.steps = 12;
    cfg.warmup_steps = 2;
    cfg.lr = 3e-3;
    snprintf(cfg.backend, sizeof cfg.backend, "cpu");
    snprintf(cfg.optimizer_state, sizeof cfg.optimizer_state, "%s", state);
    assert_int_equal(moe_config_validate(&cfg), MOE_OK);
    moe_trainer *tr = NULL;
    assert_int_equal(moe_trainer_create(&tr, &cfg, NULL), MOE_OK);
    return tr;
}

static void test_bf16_moments_follow_fp32(void **state)
{
    (void)state;
    moe_trainer *a = make_trainer("fp32"), *b = make_trainer("bf16");
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bf16_moments_follow_fp32),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
