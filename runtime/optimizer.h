/* runtime/optimizer.h: AdamW over the model's tensor table, the learning-rate schedule
 * and global-norm clipping.
 *
 * Owns: the optimizer state (first and second moments, one arena each, fp32, or bf16
 * with [precision] optimizer_state = bf16), the schedule. Does not own: the parameters or gradients
 * (the model), the reduction of gradients across ranks (the trainer, through comm/). */
#ifndef MOE_RUNTIME_OPTIMIZER_H
#define MOE_RUNTIME_OPTIMIZER_H

#include "runtime/config.h"
#include "runtime/model.h"
#include "util/status.h"

struct moe_backend;

typedef struct {
    const struct moe_backend *be; /* where the state lives */
    void *m, *v;                  /* (n_params) each: real, or bf16 (uint16_t) when moments16 */
    int moments16;                /* [precision] optimizer_state = bf16 */
    int64_t *seg_offsets;         /* (n_segs + 1) runs of tensors with one weight decay */
    real *seg_wd;                 /* (n_segs) their weight decay; both in backend memory */
    int n_segs;
    size_t n_params;
    int t; /* AdamW steps taken */
} moe_optimizer;

/* Allocates zeroed state for the model's parameters in the backend's memory, and the
 * table of runs of tensors that share a weight decay (one multi-tensor AdamW launch per
 * step). On failure *out is NULL. */
moe_status moe_optimizer_create(moe_optimizer **out, const moe_model *model, const moe_config *cfg,
                                const struct moe_backend *be);
void moe_optimizer_destroy(moe_optimizer *opt);

/* Learning rate at optimizer step `step` (0-based): linear warmup from lr/warmup to lr
 * over warmup_steps, then cosine decay to min_lr at the last step. */
double moe_lr_at(const moe_config *cfg, int step);

/* One AdamW step over every tensor of the model in one multi-tensor pass: weight decay
 * on tensors with decay != 0 (matrices and embeddings; never norms). norm_sq (2 doubles
 * in the backend's memory) holds the sums of squares of the gradients, which carry
 * loss_scale: the kernel multiplies the gradients by moe_adamw_factor (clipping to
 * cfg->grad_clip, removal of the loss scale) or, when the norm is not finite, changes
 * nothing; the host need not read the norm first. Counts the step (opt->t); a caller
 * that learns later that the step was skipped calls moe_optimizer_unstep. */
void moe_optimizer_step(moe_optimizer *opt, moe_model *model, const moe_config *cfg, double lr,
                        const double *norm_sq, double loss_scale);
/* The same step in pieces, where nothing clips and nothing skips (the gradients are
 * divided by loss_scale only): moe_optimizer_next counts it (opt->t), then
 * moe_optimizer_piece steps the elements [lo, hi) of the arena, writing the sums of
 * squares of their gradients below n_dense and from it to sq_out (2 doubles in the
 * backend's memory) from the update's own pass over them; pieces that cover the arena
 * once give every element the bits the whole step gives it (ops.h adamw_update_multi). */
void moe_optimizer_next(moe_optimizer *opt);
void moe_optimizer_piece(moe_optimizer *opt, moe_model *model, const moe_config *cfg, double lr,
                         double loss_scale, size_t lo, size_t hi, double *sq_out);
void moe_optimizer_unstep(moe_optimizer *opt);

/* The moments as real values in host memory, whatever their precision (checkpoints):
 * moment k (0: m, 1: v), elements [lo, lo + n), into dst; and back from src (rounded to
 * bf16 when moments16: exact for values that came from bf16). Wait for the backend. */
moe_status moe_optimizer_read(const moe_optimizer *opt, int k, size_t lo, size_t n, real *dst);
moe_status moe_optimizer_write(moe_optimizer *opt, int k, size_t lo, size_t n, const real *src);

#endif
