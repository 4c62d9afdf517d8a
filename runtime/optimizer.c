/* runtime/optimizer.c: AdamW, the warmup + cosine schedule, clipping. */
#include "runtime/optimizer.h"

#include "kernels/backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

moe_status moe_optimizer_create(moe_optimizer **out, const moe_model *model, const moe_config *cfg,
                                const moe_backend *be)
{
    const size_t n_params = model->n_params;
    moe_optimizer *opt = calloc(1, sizeof *opt);
    *out = NULL;
    if (!opt)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate the optimizer");
    opt->be = be;
    opt->moments16 = strcmp(cfg->optimizer_state, "bf16") == 0;
    const size_t elem = opt->moments16 ? sizeof(uint16_t) : sizeof(real);
    opt->m = be->alloc(n_params * elem);
    opt->v = be->alloc(n_params * elem);
    opt->n_params = n_params;
    /* runs of adjacent tensors (the arena is in tensor order) with the same decay */
    int64_t *off = malloc(sizeof(int64_t) * ((size_t)model->n_tensors + 1));
    real *wd = malloc(sizeof(real) * ((size_t)model->n_tensors + 1));
    int n = 0;
    for (int i = 0; off && wd && i < model->n_tensors; i++) {
        const moe_tensor *t = &model->tensors[i];
        real w = t->decay ? (real)cfg->weight_decay : 0;
        if (n == 0 || wd[n - 1] != w || off[n] != (int64_t)t->offset) {
            off[n] = (int64_t)t->offset;
            wd[n++] = w;
        }
        off[n] = (int64_t)(t->offset + t->count);
    }
    opt->n_segs = n;
    opt->seg_offsets = be->alloc(sizeof(int64_t) * ((size_t)n + 1));
    opt->seg_wd = be->alloc(sizeof(real) * ((size_t)n + 1));
    if (!opt->m || !opt->v || !off || !wd || !opt->seg_offsets || !opt->seg_wd ||
        (n > 0 && off[0] != 0) || (n > 0 && off[n] != (int64_t)n_params)) {
        free(off);
        free(wd);
        moe_optimizer_destroy(opt);
        MOE_FAIL(MOE_ERR_NOMEM, "cannot set up optimizer state for %zu parameters", n_params);
    }
    be->copy(opt->seg_offsets, off, sizeof(int64_t) * ((size_t)n + 1), MOE_COPY_H2D);
    be->copy(opt->seg_wd, wd, sizeof(real) * (size_t)n, MOE_COPY_H2D);
    free(off);
    free(wd);
    *out = opt;
    return be->sync();
}

void moe_optimizer_destroy(moe_optimizer *opt)
{
    if (!opt)
        return;
    opt->be->release(opt->m);
    opt->be->release(opt->v);
    opt->be->release(opt->seg_offsets);
    opt->be->release(opt->seg_wd);
    free(opt);
}

double moe_lr_at(const moe_config *cfg, int step)
{
    if (step < cfg->warmup_steps)
        return cfg->lr * (double)(step + 1) / (double)cfg->warmup_steps;
    int decay_steps = cfg->steps - cfg->warmup_steps;
    if (decay_steps <= 1)
        return cfg->lr;
    double progress = (double)(step - cfg->warmup_steps) / (double)(decay_steps - 1);
    if (progress > 1)
        progress = 1;
    return cfg->min_lr + 0.5 * (cfg->lr - cfg->min_lr) * (1.0 + cos(M_PI * progress));
}

/* AdamW over the arena's elements [lo, hi) at the step counted (opt->t). */
static void update_range(moe_optimizer *opt, moe_model *model, const moe_config *cfg, double lr,
                         const double *norm_sq, double loss_scale, size_t lo, size_t hi,
                         double *sq_out)
{
    opt->be->adamw_update_multi(
        model->params, model->grads, opt->m, opt->v, opt->moments16, opt->n_params, lo, hi,
        opt->seg_offsets, opt->seg_wd, opt->n_segs, (real)lr, (real)cfg->beta1, (real)cfg->beta2,
        (real)cfg->adam_eps, norm_sq, cfg->grad_clip, loss_scale, opt->t, sq_out, model->n_dense);
}

void moe_optimizer_step(moe_optimizer *opt, moe_model *model, const moe_config *cfg, double lr,
                        const double *norm_sq, double loss_scale)
{
    opt->t++;
    update_range(opt, model, cfg, lr, norm_sq, loss_scale, 0, opt->n_params, NULL);
}

void moe_optimizer_next(moe_optimizer *opt) { opt->t++; }

void moe_optimizer_piece(moe_optimizer *opt, moe_model *model, const moe_config *cfg, double lr,
                         double loss_scale, size_t lo, size_t hi, double *sq_out)
{
    update_range(opt, model, cfg, lr, NULL, loss_scale, lo, hi, sq_out);
}

void moe_optimizer_unstep(moe_optimizer *opt) { opt->t--; }

moe_status moe_optimizer_read(const moe_optimizer *opt, int k, size_t lo, size_t n, real *dst)
{
    const void *arena = k == 0 ? opt->m : opt->v;
    if (!opt->moments16) {
        opt->be->copy(dst, (const real *)arena + lo, sizeof(real) * n, MOE_COPY_D2H);
        return opt->be->sync();
    }
    uint16_t *tmp = malloc(sizeof(uint16_t) * (n ? n : 1));
    if (!tmp)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot stage %zu optimizer moments", n);
    opt->be->copy(tmp, (const uint16_t *)arena + lo, sizeof(uint16_t) * n, MOE_COPY_D2H);
    for (size_t i = 0; i < n; i++)
        dst[i] = (real)moe_bf16_widen(tmp[i]);
    free(tmp);
    return opt->be->sync();
}

moe_status moe_optimizer_write(moe_optimizer *opt, int k, size_t lo, size_t n, const real *src)
{
    void *arena = k == 0 ? opt->m : opt->v;
    if (!opt->moments16) {
        opt->be->copy((real *)arena + lo, src, sizeof(real) * n, MOE_COPY_H2D);
        return opt->be->sync();
    }
    uint16_t *tmp = malloc(sizeof(uint16_t) * (n ? n : 1));
    if (!tmp)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot stage %zu optimizer moments", n);
    for (size_t i = 0; i < n; i++)
        tmp[i] = moe_bf16_round((float)src[i]);
    opt->be->copy((uint16_t *)arena + lo, tmp, sizeof(uint16_t) * n, MOE_COPY_H2D);
    moe_status st = opt->be->sync(); /* tmp is pageable: the copy has read it */
    free(tmp);
    return st;
}
