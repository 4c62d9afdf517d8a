/* runtime/optimizer.c: AdamW, the warmup + cosine schedule, clipping. */
#include "runtime/optimizer.h"

#include "kernels/backend.h"

#include <math.h>
#include <stdlib.h>

moe_status moe_optimizer_create(moe_optimizer **out, size_t n_params, const moe_backend *be)
{
    moe_optimizer *opt = calloc(1, sizeof *opt);
    *out = NULL;
    if (!opt)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate the optimizer");
    opt->be = be;
    opt->m = be->alloc(n_params * sizeof(real));
    opt->v = be->alloc(n_params * sizeof(real));
    opt->n_params = n_params;
    if (!opt->m || !opt->v) {
        moe_optimizer_destroy(opt);
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate optimizer state for %zu parameters", n_params);
    }
    *out = opt;
    return MOE_OK;
}

void moe_optimizer_destroy(moe_optimizer *opt)
{
    if (!opt)
        return;
    opt->be->release(opt->m);
    opt->be->release(opt->v);
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

double moe_clip_scale(double norm, double clip)
{
    if (clip <= 0 || norm <= clip)
        return 1.0;
    return clip / norm;
}

void moe_optimizer_step(moe_optimizer *opt, moe_model *model, const moe_config *cfg, double lr,
                        double grad_scale)
{
    opt->t++;
    for (int i = 0; i < model->n_tensors; i++) {
        const moe_tensor *t = &model->tensors[i];
        real *g = model->grads + t->offset;
        if (grad_scale != 1.0)
            opt->be->scale_inplace(g, (real)grad_scale, t->count);
        opt->be->adamw_update(model->params + t->offset, g, opt->m + t->offset, opt->v + t->offset,
                              t->count, (real)lr, (real)cfg->beta1, (real)cfg->beta2,
                              (real)cfg->adam_eps, t->decay ? (real)cfg->weight_decay : 0, opt->t);
    }
}
