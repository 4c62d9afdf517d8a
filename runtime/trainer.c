/* runtime/trainer.c: the training loop, progress line and logs. */
#include "runtime/trainer.h"

#include "comm/comm.h"
#include "kernels/backend.h"
#include "sched/placement.h"
#include "sched/stats.h"
#include "runtime/checkpoint.h"
#include "util/clock.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Buckets: one per backward stage (the head, each layer, the embedding). Within the
 * dense region a stage's tensors are contiguous, and so are a layer's expert tensors. */
static moe_status build_buckets(moe_trainer *tr)
{
    const moe_model *m = tr->model;
    tr->buckets = calloc((size_t)m->L + 2, sizeof *tr->buckets);
    if (!tr->buckets)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate gradient buckets");
    for (int b = 0; b < m->L + 2; b++) {
        tr->buckets[b].dense_lo = tr->buckets[b].expert_lo = SIZE_MAX;
        tr->buckets[b].handles[0] = tr->buckets[b].handles[1] = MOE_COMM_NONE;
    }
    for (int i = 0; i < m->n_tensors; i++) {
        const moe_tensor *t = &m->tensors[i];
        moe_grad_bucket *b = &tr->buckets[t->layer + 1];
        size_t *lo = t->is_expert ? &b->expert_lo : &b->dense_lo;
        size_t *hi = t->is_expert ? &b->expert_hi : &b->dense_hi;
        if (*lo != SIZE_MAX && *hi != t->offset)
            MOE_FAIL(MOE_ERR_INVALID, "tensor %s is not contiguous with its bucket", t->name);
        if (*lo == SIZE_MAX)
            *lo = t->offset;
        *hi = t->offset + t->count;
    }
    if (tr->buckets[0].expert_lo != SIZE_MAX) /* reduce_and_square relies on it */
        MOE_FAIL(MOE_ERR_INVALID, "the embedding's gradient bucket holds expert tensors");
    for (int b = 0; b < m->L + 2; b++) {
        if (tr->buckets[b].dense_lo == SIZE_MAX)
            tr->buckets[b].dense_lo = tr->buckets[b].dense_hi = 0;
        if (tr->buckets[b].expert_lo == SIZE_MAX)
            tr->buckets[b].expert_lo = tr->buckets[b].expert_hi = 0;
    }
    return MOE_OK;
}

/* The update's pieces: a dense and an expert one per bucket (L + 2 buckets). */
static size_t n_pieces(const moe_trainer *tr) { return 2 * ((size_t)tr->model->L + 2); }

/* The update in pieces (norm_in_update: nothing clips, nothing skips): AdamW over bucket
 * b's dense (part 0) or expert (part 1) parameters, queued on background lane `lane` of
 * the backend, once a step; its sums of squares go to its own slot of norm_parts (an
 * empty piece leaves its zeros). The pieces of lane 1 run in the order queued: the
 * update's partial sums are ordered (optim.cu); apply joins them. A piece of lane 2
 * (tr->defer) leaves a mark that the next forward waits for before it reads the piece's
 * parameters (on_params_needed). */
static void update_piece(moe_trainer *tr, int b, int part, int lane)
{
    const moe_grad_bucket *k = &tr->buckets[b];
    const size_t lo = part ? k->expert_lo : k->dense_lo, hi = part ? k->expert_hi : k->dense_hi;
    const int slot = 2 * b + part;
    if (tr->updated[slot])
        return;
    tr->updated[slot] = 1;
    if (lo == hi)
        return;
    moe_model *m = tr->model;
    if (!tr->step_counted) {
        moe_optimizer_next(tr->opt);
        tr->step_counted = 1;
    }
    m->be->background(lane);
    moe_optimizer_piece(tr->opt, m, &tr->cfg, moe_lr_at(&tr->cfg, tr->step), tr->loss_scale, lo, hi,
                        tr->norm_parts + 2 * (n_pieces(tr) * tr->norm_half + slot));
    if (lane == 2) {
        m->be->background_mark(slot);
        tr->pending[slot] = 1;
    }
    m->be->background(0);
}

/* The background mark of zero_dense's lane-1 work; lane 2's pieces mark their slots,
 * below 2 * MAX_DEFER. */
#define ZERO_MARK 63
#define MAX_DEFER 31

/* Zeroes those of bucket b's dense gradients that the step's first backward adds to, not
 * writes (moe_model_added_grads: the embedding's, 128 MiB at the bench shape), on
 * background lane 1 after what the queue holds so far: beside the forward, not before
 * it. The backward's grad_ready(0), which comes before the embedding's backward adds to
 * them, waits for it (on_grad_ready). */
static void zero_dense(moe_trainer *tr, int b)
{
    const moe_grad_bucket *k = &tr->buckets[b];
    moe_model *m = tr->model;
    size_t lo, hi;
    moe_model_added_grads(m, &lo, &hi);
    lo = lo > k->dense_lo ? lo : k->dense_lo;
    hi = hi < k->dense_hi ? hi : k->dense_hi;
    if (hi <= lo)
        return;
    m->be->background(1);
    m->be->zero(m->grads + lo, sizeof(real) * (hi - lo));
    m->be->background_mark(ZERO_MARK);
    m->be->background(0);
    tr->zero_queued = 1;
}

/* Called by forward before it reads a stage's parameters: where their update still runs
 * on lane 2, the queue waits for it, then zeroes those of the bucket's dense gradients
 * that the backward adds to (zero_dense: read by that update, so left out when accumulate
 * zeroed the others). */
static void on_params_needed(void *ctx, int stage, int part)
{
    moe_trainer *tr = ctx;
    const int b = stage + 1, slot = 2 * b + part;
    if (b < 0 || b >= tr->model->L + 2 || !tr->pending[slot])
        return;
    tr->pending[slot] = 0;
    tr->model->be->background_await(slot);
    if (part == 0)
        zero_dense(tr, b);
}

/* The ranks that hold each expert (1: its gradients need no reduction). */
static int expert_holders(const moe_trainer *tr)
{
    return tr->comm ? moe_comm_size(tr->comm, MOE_GROUP_EDP) : 1;
}

/* Called by backward when a stage's gradients are final: on the last micro-batch of a
 * step, starts their reduction (dense over the world, experts over the EDP group), and
 * with update_early queues the update of those that need none (dense ones in a world of
 * one, expert ones where no other rank holds the expert): the optimizer runs beside the
 * rest of the backward instead of after it. */
static void on_grad_ready(void *ctx, int stage)
{
    moe_trainer *tr = ctx;
    if (stage == 0 && tr->zero_queued) { /* the embedding's backward adds next */
        tr->model->be->background_await(ZERO_MARK);
        tr->zero_queued = 0;
    }
    if (tr->last_micro && stage == tr->model->L - 1 &&
        moe_fault_nan_due(&tr->fault, tr->rank, tr->step)) {
        const real nan_value = (real)NAN; /* MOE_FAULT=nan: poison this stage's gradients */
        moe_grad_bucket *b = &tr->buckets[stage + 1];
        tr->model->be->copy(tr->model->grads + b->dense_lo, &nan_value, sizeof nan_value,
                            MOE_COPY_H2D);
        moe_log("MOE_FAULT: injected a NaN into the gradients of layer %d at step %d", stage,
                tr->step);
    }
    if (tr->last_micro && tr->update_early && stage + 1 >= tr->defer) {
        if (tr->world == 1)
            update_piece(tr, stage + 1, 0, 1);
        if (expert_holders(tr) == 1)
            update_piece(tr, stage + 1, 1, 1);
    }
    if (!tr->reduce_now || tr->reduce_status != MOE_OK)
        return;
    moe_grad_bucket *b = &tr->buckets[stage + 1];
    real *g = tr->model->grads;
    moe_model *m = tr->model;
    const double t0 = moe_model_phase_begin(m);
    moe_status st = MOE_OK;
    if (b->dense_hi > b->dense_lo && tr->world > 1)
        st = moe_comm_allreduce_start(tr->comm, MOE_GROUP_WORLD, g + b->dense_lo,
                                      b->dense_hi - b->dense_lo, sizeof(real), MOE_COMM_NONE,
                                      &b->handles[0]);
    if (st == MOE_OK && b->expert_hi > b->expert_lo && moe_comm_size(tr->comm, MOE_GROUP_EDP) > 1)
        st = moe_comm_allreduce_start(tr->comm, MOE_GROUP_EDP, g + b->expert_lo,
                                      b->expert_hi - b->expert_lo, sizeof(real), MOE_COMM_NONE,
                                      &b->handles[1]);
    tr->reduce_status = st;
    moe_model_phase_end(m, t0, MOE_PHASE_REDUCTION);
}

static moe_status wait_bucket(moe_trainer *tr, int b)
{
    for (int h = 0; h < 2; h++) {
        moe_status st = moe_comm_wait(tr->comm, tr->buckets[b].handles[h]);
        tr->buckets[b].handles[h] = MOE_COMM_NONE;
        MOE_CHECK(st);
    }
    return MOE_OK;
}

/* Whether the gradient norm comes from the optimizer's own pass over the gradients
 * (moe_optimizer_piece's sq_out): nothing clips and no loss scale can skip the step, so
 * the update does not need the norm first, and the separate pass over every gradient
 * that would compute it is saved. The norm is then reported as always; only a
 * non-finite gradient is found after the update instead of before it (the job ends
 * either way, with the same message, and nothing is written). */
static int norm_in_update(const moe_trainer *tr) { return tr->cfg.grad_clip <= 0 && !tr->scaling; }

/* Has the gradient reductions waited for in the order backward issued them and sums
 * the squares for the norm into tr->norm_sq on the backend (nothing returns to the host):
 * [0] the dense gradients, first everything but the embedding's bucket (reduced last,
 * after the whole backward) while that one's reduction still runs, then the embedding's;
 * [1] this rank's expert gradients, then summed over the EP group (each expert lives on
 * one rank of it; dense gradients are the same on every rank after their reduction), so
 * every rank holds the global sums. The same sums, in the same order, with or without
 * reductions. The squaring is timed as the optimizer's. */
static moe_status reduce_and_square(moe_trainer *tr)
{
    moe_model *m = tr->model;
    const moe_backend *be = m->be;
    const moe_grad_bucket *emb = &tr->buckets[0]; /* stage -1: dense only */
    double *sq = tr->norm_sq;
    for (int b = m->L + 1; b >= 1; b--)
        MOE_CHECK(wait_bucket(tr, b));
    MOE_CHECK(tr->reduce_status);
    if (norm_in_update(tr)) { /* the optimizer sums the squares: only the reductions */
        MOE_CHECK(wait_bucket(tr, 0));
        return tr->reduce_status;
    }
    double t = moe_model_phase_begin(m);
    be->zero(sq, 2 * sizeof(double));
    be->sum_into(sq, m->grads, emb->dense_lo, 1);
    if (m->n_dense > emb->dense_hi)
        be->sum_into(sq, m->grads + emb->dense_hi, m->n_dense - emb->dense_hi, 1);
    be->sum_into(sq + 1, m->grads + m->n_dense, m->n_params - m->n_dense, 1);
    moe_model_phase_end(m, t, MOE_PHASE_OPTIMIZER);
    if (tr->comm && moe_comm_size(tr->comm, MOE_GROUP_EP) > 1) {
        moe_comm_handle h = MOE_COMM_NONE;
        moe_comm_set_context(tr->comm, "gradient norm", -1);
        MOE_CHECK(moe_comm_allreduce_start(tr->comm, MOE_GROUP_EP, sq + 1, 1, sizeof(double),
                                           MOE_COMM_NONE, &h));
        MOE_CHECK(moe_comm_wait(tr->comm, h));
    }
    MOE_CHECK(wait_bucket(tr, 0));
    MOE_CHECK(tr->reduce_status);
    t = moe_model_phase_begin(m);
    be->sum_into(sq, m->grads + emb->dense_lo, emb->dense_hi - emb->dense_lo, 1);
    moe_model_phase_end(m, t, MOE_PHASE_OPTIMIZER);
    return MOE_OK;
}

/* [precision] mode: auto is bf16 on sm_80 and later, fp16 on sm_75, fp32 on the cpu. fp16
 * turns on dynamic loss scaling. */
static moe_status setup_precision(moe_trainer *tr)
{
    const moe_backend *be = tr->model->be;
    const char *mode = tr->cfg.precision;
    int cc = be->compute_capability();
    moe_precision p = MOE_PREC_FP32;
    if (strcmp(mode, "auto") == 0)
        p = !be->on_device ? MOE_PREC_FP32 : cc >= 80 ? MOE_PREC_BF16 : MOE_PREC_FP16;
    else if (strcmp(mode, "bf16") == 0)
        p = MOE_PREC_BF16;
    else if (strcmp(mode, "fp16") == 0)
        p = MOE_PREC_FP16;
    if (p != MOE_PREC_FP32 && !be->on_device)
        MOE_FAIL(MOE_ERR_INVALID,
                 "[precision] mode = %s needs a GPU; this run uses the %s backend (fp32 only)",
                 mode, be->name);
    if (p == MOE_PREC_BF16 && cc < 80)
        MOE_FAIL(MOE_ERR_INVALID,
                 "[precision] mode = bf16: this GPU is sm_%d, and bf16 tensor cores need sm_80 "
                 "or later (T4 is sm_75); use fp16 (with dynamic loss scaling) or auto",
                 cc);
    tr->precision = p;
    moe_model_set_precision(tr->model, p);
    tr->scaling = p == MOE_PREC_FP16;
    tr->loss_scale = tr->scaling ? tr->cfg.loss_scale_init : 1.0;
    tr->model->loss_scale = tr->loss_scale;
    MOE_CHECK(
        be->set_precision(p, tr->model->params, tr->model->n_params, tr->model->max_gemm_operand));
    if (strcmp(tr->cfg.master_weights, "bf16") == 0) {
        if (p != MOE_PREC_BF16)
            MOE_FAIL(MOE_ERR_INVALID,
                     "[precision] master_weights = bf16 needs bf16 GEMMs; [precision] mode = %s "
                     "gives %s here",
                     mode, p == MOE_PREC_FP16 ? "fp16 (sm_75)" : "fp32 (no GPU)");
        /* the experts' weights: the arena's tail from n_dense (model.h) */
        MOE_CHECK(be->master_in_shadow(tr->model->n_dense));
    }
    if (strcmp(tr->cfg.expert_grads, "bf16") == 0) {
        /* their gradients in bf16: read only by AdamW, the norm's sums and the finiteness
         * check, so not where they are reduced across the ranks that share an expert */
        const int edp = expert_holders(tr);
        if (edp > 1)
            MOE_FAIL(MOE_ERR_INVALID,
                     "[precision] expert_grads = bf16 keeps each expert's gradient on its one "
                     "rank; here %d ranks share each expert ([parallel] ep = %d of %d ranks): "
                     "set ep = %d or expert_grads = fp32",
                     edp, tr->world / edp, tr->world, tr->world);
        MOE_CHECK(be->grads_in_shadow(tr->model->grads));
    }
    return be->refresh_shadow();
}

static const char *update_mode(const moe_trainer *tr)
{
    if (!norm_in_update(tr))
        return "AdamW after the backward (the global norm first: it clips or scales the loss)";
    if (!tr->update_early)
        return "AdamW after the backward (MOE_UPDATE_IN_BACKWARD=0)";
    const int edp = expert_holders(tr);
    if (tr->world == 1)
        return "AdamW beside the backward, each stage's parameters once their gradients are "
               "final";
    if (edp == 1)
        return "AdamW beside the backward for the expert parameters, after their reduction for "
               "the dense ones";
    return "AdamW after the backward (every gradient is reduced across ranks first)";
}

const char *moe_trainer_update_mode(const moe_trainer *tr)
{
    static char buf[320];
    if (!tr->defer)
        return update_mode(tr);
    snprintf(buf, sizeof buf,
             "%s; the first %d of its %d buckets (embedding, layers, head) beside the next "
             "step's forward, each waited for where it is read (the norm logged a step later)",
             update_mode(tr), tr->defer, tr->model->L + 2);
    return buf;
}

const char *moe_trainer_precision(const moe_trainer *tr)
{
    if (tr->precision == MOE_PREC_BF16 && strcmp(tr->cfg.expert_grads, "bf16") == 0)
        return "bf16 GEMMs and expert master weights and gradients, fp32 elsewhere";
    if (tr->precision == MOE_PREC_BF16 && strcmp(tr->cfg.master_weights, "bf16") == 0)
        return "bf16 GEMMs and expert master weights, fp32 elsewhere";
    return tr->precision == MOE_PREC_BF16   ? "bf16 GEMMs, fp32 elsewhere"
           : tr->precision == MOE_PREC_FP16 ? "fp16 GEMMs with dynamic loss scaling, fp32 elsewhere"
                                            : "fp32";
}

moe_status moe_trainer_create(moe_trainer **out, const moe_config *cfg, struct moe_comm *comm)
{
    moe_status st = MOE_OK;
    moe_trainer *tr = calloc(1, sizeof *tr);
    *out = NULL;
    if (!tr)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate the trainer");
    tr->cfg = *cfg;
    tr->comm = comm;
    MOE_CHECK_GOTO(st, moe_fault_from_env(&tr->fault));
    tr->world = comm ? moe_comm_size(comm, MOE_GROUP_WORLD) : 1;
    tr->rank = comm ? moe_comm_rank(comm, MOE_GROUP_WORLD) : 0;
    const moe_backend *be = NULL;
    MOE_CHECK_GOTO(st, moe_backend_select(cfg->backend, &be));
    if (be->on_device && tr->world > 1) /* device collectives over NCCL */
        MOE_CHECK_GOTO(st, moe_comm_enable_device(comm, be->native_stream()));
    MOE_CHECK_GOTO(st, moe_model_create(&tr->model, cfg, comm, be));
    MOE_CHECK_GOTO(st, setup_precision(tr));
    if (cfg->dense_layers < cfg->n_layers &&
        (strcmp(cfg->placement, "auto") == 0 || cfg->routing_stats_path[0])) {
        MOE_CHECK_GOTO(st, moe_routing_stats_create(&tr->routing, cfg->n_layers - cfg->dense_layers,
                                                    cfg->experts));
        MOE_CHECK_GOTO(st, moe_model_attach_routing(tr->model, tr->routing));
    }
    const size_t n_parts = n_pieces(tr);
    tr->norm_sq = be->alloc(2 * sizeof(double));
    tr->norm_parts = be->alloc(4 * n_parts * sizeof(double));
    tr->updated = calloc(n_parts, 1);
    tr->pending = calloc(n_parts, 1);
    tr->held_parts = calloc(2 * n_parts, sizeof(double));
    tr->step_host = be->alloc_host((3 + 4 * n_parts) * sizeof(double));
    /* MOE_UPDATE_IN_BACKWARD=0: every piece after the backward (a knob to measure it) */
    const char *early = getenv("MOE_UPDATE_IN_BACKWARD");
    tr->update_early = norm_in_update(tr) && !(early && strcmp(early, "0") == 0);
    /* MOE_UPDATE_DEFER=n: the update of the first n buckets (the embedding, then the
     * first layers) beside the next step's forward; unset or 0: none (opt-in until it is
     * timed on a GPU: docs/design.md) */
    const char *defer = getenv("MOE_UPDATE_DEFER");
    const int n_buckets = tr->model->L + 2;
    tr->defer = defer ? atoi(defer) : 0;
    if (!tr->update_early || tr->defer < 0)
        tr->defer = 0;
    if (tr->defer > n_buckets)
        tr->defer = n_buckets;
    if (tr->defer > MAX_DEFER) /* the backend's 64 background marks, ZERO_MARK among them */
        tr->defer = MAX_DEFER;
    if (!tr->norm_sq || !tr->norm_parts || !tr->updated || !tr->pending || !tr->held_parts ||
        !tr->step_host) {
        st = MOE_ERR_NOMEM;
        moe_log_at(__FILE__, __LINE__, "cannot allocate the gradient norm's sums");
        goto fail;
    }
    tr->model->grad_ready = on_grad_ready;
    tr->model->grad_ready_ctx = tr;
    tr->model->params_needed = on_params_needed;
    tr->model->params_needed_ctx = tr;
    MOE_CHECK_GOTO(st, build_buckets(tr));
    MOE_CHECK_GOTO(st, moe_data_create(&tr->data, cfg));
    MOE_CHECK_GOTO(st, moe_optimizer_create(&tr->opt, tr->model, cfg, be));
    tr->tokens = malloc(sizeof(int32_t) * (size_t)cfg->micro_batch * (cfg->seq_len + 1));
    tr->tokens_next = malloc(sizeof(int32_t) * (size_t)cfg->micro_batch * (cfg->seq_len + 1));
    tr->next_first = -1;
    if (!tr->tokens || !tr->tokens_next) {
        st = MOE_ERR_NOMEM;
        moe_log_at(__FILE__, __LINE__, "cannot allocate the token buffer");
        goto fail;
    }
    tr->ckpt_step = -1;
    tr->ckpt_time = moe_clock_seconds();
    *out = tr;
    return MOE_OK;
fail:
    moe_trainer_destroy(tr);
    return st;
}

void moe_trainer_destroy(moe_trainer *tr)
{
    if (!tr)
        return;
    if (tr->jsonl)
        fclose(tr->jsonl);
    free(tr->tokens);
    free(tr->tokens_next);
    free(tr->buckets);
    free(tr->updated);
    free(tr->pending);
    free(tr->held_parts);
    moe_routing_stats_destroy(tr->routing);
    moe_optimizer_destroy(tr->opt);
    if (tr->model) {
        tr->model->be->release(tr->norm_sq);
        tr->model->be->release(tr->norm_parts);
        tr->model->be->release_host(tr->step_host);
    }
    moe_data_destroy(tr->data);
    moe_model_destroy(tr->model);
    free(tr);
}

/* The first sequence of this rank's micro-batch j of the step that starts after
 * `consumed` global sequences: the ranks' micro-batches of each j side by side. */
static int64_t micro_first(const moe_trainer *tr, int64_t consumed, int j)
{
    return consumed + ((int64_t)j * tr->world + tr->rank) * tr->cfg.micro_batch;
}

moe_status moe_trainer_accumulate(moe_trainer *tr, moe_step_result *res)
{
    moe_model *m = tr->model;
    const int micro = tr->cfg.micro_batch;
    const int accum = moe_config_accum_at(&tr->cfg, tr->step);
    const int64_t S = (int64_t)micro * tr->world * accum;
    double t0 = moe_clock_seconds();
    memset(res, 0, sizeof *res);
    res->step = tr->step;
    res->micro_batches = accum;
    res->sequences = S;
    MOE_CHECK(moe_fault_check(&tr->fault, tr->rank, tr->step));
    /* the gradients the first backward adds to (the embedding's; it writes the others).
     * A bucket whose update still runs is zeroed where the forward waits for it. */
    for (int b = 0; b < m->L + 2; b++)
        if (!tr->pending[2 * b])
            zero_dense(tr, b);
    if (norm_in_update(tr)) { /* the update's pieces: none queued yet */
        if (tr->defer)        /* the other half may be the held step's */
            tr->norm_half ^= 1;
        m->be->zero(tr->norm_parts + 2 * n_pieces(tr) * tr->norm_half,
                    sizeof(double) * 2 * n_pieces(tr));
        memset(tr->updated, 0, n_pieces(tr));
        tr->step_counted = 0;
    }
    moe_model_fresh_grads(m);
    /* ce (on the backend, m->ce_acc, until apply), aux, z, dropped, a2a bytes, a2a saved:
     * summed over micro-batches here, over ranks in apply */
    double *sums = tr->sums;
    memset(tr->sums, 0, sizeof tr->sums);
    for (int j = 0; j < accum; j++) {
        int64_t first = micro_first(tr, tr->consumed, j);
        moe_fwd_stats fs;
        double t = moe_model_phase_begin(m);
        if (j == 0 && tr->next_first == first) { /* read during the last step (prefetch) */
            int32_t *held = tr->tokens_next;
            tr->tokens_next = tr->tokens;
            tr->tokens = held;
            tr->next_first = -1;
            MOE_CHECK(tr->next_status); /* its message was logged when it was read */
        } else {
            MOE_CHECK(moe_data_batch(tr->data, tr->tokens, first, micro));
        }
        moe_model_phase_end(m, t, MOE_PHASE_DATA);
        /* forward and backward: their wall time less the exchange and reduction in them */
        double *ph = m->phase_s, comm0 = ph[MOE_PHASE_EXCHANGE] + ph[MOE_PHASE_REDUCTION];
        t = moe_model_phase_begin(m);
        moe_model_fuse_head(m, S); /* the LM head's backward while its logits are at hand */
        MOE_CHECK(moe_model_forward(m, tr->tokens, &fs));
        if (j == 0 && memchr(tr->pending, 1, n_pieces(tr))) /* the forward asks for all */
            MOE_FAIL(MOE_ERR_INVALID,
                     "step %d: the forward did not wait for every parameter "
                     "update that ran beside it",
                     tr->step + 1);
        double comm1 = ph[MOE_PHASE_EXCHANGE] + ph[MOE_PHASE_REDUCTION];
        moe_model_phase_end(m, t + (comm1 - comm0), MOE_PHASE_FORWARD);
        tr->reduce_now = tr->comm && j == accum - 1;
        tr->last_micro = j == accum - 1;
        tr->reduce_status = MOE_OK;
        t = moe_model_phase_begin(m);
        MOE_CHECK(moe_model_backward(m, S));
        moe_model_phase_end(m, t + (ph[MOE_PHASE_EXCHANGE] + ph[MOE_PHASE_REDUCTION] - comm1),
                            MOE_PHASE_BACKWARD);
        sums[1] += fs.aux_sum;
        sums[2] += fs.z_sum;
        sums[3] += (double)fs.dropped;
        sums[4] += (double)fs.a2a_bytes;
        sums[5] += (double)fs.a2a_bytes_saved;
        res->expert_rows += fs.expert_rows;
    }
    {
        moe_comm_set_context(tr->comm, "gradient reduction", -1);
        double *ph = m->phase_s, opt0 = ph[MOE_PHASE_OPTIMIZER];
        const double t = moe_model_phase_begin(m);
        MOE_CHECK(reduce_and_square(tr));
        moe_model_phase_end(m, t + (ph[MOE_PHASE_OPTIMIZER] - opt0), MOE_PHASE_REDUCTION);
    }
    res->seconds = moe_clock_seconds() - t0;
    return MOE_OK;
}

/* Queues the fetch of the step's cross-entropy sum (zeroed behind the copy for the next
 * step) and sums of squares: with the update in pieces (norm_in_update), both halves of
 * norm_parts (the step's and, with tr->defer, the held step's). Returns the mark that the
 * wait in losses_finish waits for. */
static long losses_fetch(moe_trainer *tr)
{
    const moe_backend *be = tr->model->be;
    be->fetch(tr->step_host, tr->model->ce_acc, sizeof(double));
    if (norm_in_update(tr)) /* half 0 only without tr->defer */
        be->fetch(tr->step_host + 3, tr->norm_parts,
                  sizeof(double) * (tr->defer ? 4 : 2) * n_pieces(tr));
    else
        be->fetch(tr->step_host + 1, tr->norm_sq, 2 * sizeof(double));
    const long mark = be->queue_mark();
    be->zero(tr->model->ce_acc, sizeof(double));
    return mark;
}

/* The two sums of squares of the pieces' slots in parts, added in the order of the
 * buckets. */
static void sum_parts(const moe_trainer *tr, const double *parts, double sq[2])
{
    sq[0] = sq[1] = 0.0;
    for (size_t i = 0; i < n_pieces(tr); i++) {
        sq[0] += parts[2 * i];
        sq[1] += parts[2 * i + 1];
    }
}

static const double *fetched_half(const moe_trainer *tr, int h)
{
    return tr->step_host + 3 + 2 * n_pieces(tr) * (size_t)h;
}

/* The held step's sums of squares, this rank's: its pieces' own (kept by apply), those of
 * lane 2 from the half they wrote (fetched since), in the order of the buckets, as
 * without the deferral. */
static void held_sums(moe_trainer *tr, int half, double sq[2])
{
    memcpy(tr->held_parts, fetched_half(tr, half), sizeof(double) * 4 * (size_t)tr->defer);
    sum_parts(tr, tr->held_parts, sq);
}

/* Waits for the queue to pass mark, the time counted as the host's wait. */
static moe_status wait_mark(moe_trainer *tr, long mark)
{
    const double t_wait = moe_clock_seconds();
    MOE_CHECK(tr->model->be->queue_wait(mark, moe_comm_watch, tr->comm));
    moe_model_waited(tr->model, mark);
    tr->model->host_wait_s += moe_clock_seconds() - t_wait;
    return MOE_OK;
}

/* This rank's share of global sums of squares sq (dense, expert): the dense one from world
 * rank 0 (the same on every rank), the experts' from the ranks of EDP rank 0 (one holder
 * of each expert); 0 elsewhere. */
static void sq_share(const moe_trainer *tr, const double sq[2], double out[2])
{
    out[0] = moe_comm_rank(tr->comm, MOE_GROUP_WORLD) == 0 ? sq[0] : 0.0;
    out[1] = moe_comm_rank(tr->comm, MOE_GROUP_EDP) == 0 ? sq[1] : 0.0;
}

/* The step's one wait for what losses_fetch queued, then the losses summed over ranks
 * (tr->sums, ce from the backend) and the communication times. When AdamW's pass summed
 * the squares (norm_in_update), they are this rank's and become global in the same sum
 * over the world: the dense one (the same on every rank) from world rank 0, the experts'
 * from the ranks of EDP rank 0 (one holder of each expert); so do the held step's
 * (tr->held), into held_sq. */
static moe_status losses_finish(moe_trainer *tr, moe_step_result *res, long mark, double held_sq[2])
{
    MOE_CHECK(wait_mark(tr, mark));
    double *sums = tr->sums, *sq = tr->step_host + 1;
    if (norm_in_update(tr)) /* the step's (lane 2's slots still zero with tr->defer) */
        sum_parts(tr, fetched_half(tr, tr->norm_half), sq);
    const int held = tr->held && held_sq;
    if (held)
        held_sums(tr, tr->norm_half ^ 1, held_sq);
    sums[0] = tr->step_host[0];
    const int local_sq = norm_in_update(tr) && tr->comm;
    if (local_sq) {
        sq_share(tr, sq, sums + 6);
        if (held)
            sq_share(tr, held_sq, sums + 8);
    }
    if (tr->comm)
        MOE_CHECK(
            moe_comm_sum_doubles(tr->comm, MOE_GROUP_WORLD, sums, local_sq ? (held ? 10 : 8) : 6));
    if (local_sq) {
        sq[0] = sums[6];
        sq[1] = sums[7];
        if (held) {
            held_sq[0] = sums[8];
            held_sq[1] = sums[9];
        }
    }
    moe_comm_times ct;
    moe_comm_take_times(tr->comm, &ct);
    res->exchange_s = ct.exchange_s;
    res->exchange_exposed_s = ct.exchange_exposed_s;
    res->reduction_s = ct.reduction_s;
    res->reduction_exposed_s = ct.reduction_exposed_s;
    res->counts_s = ct.counts_s;
    res->counts_exposed_s = ct.counts_exposed_s;
    const double tokens = (double)res->sequences * tr->cfg.seq_len;
    res->ce = sums[0] / tokens;
    /* the aux loss: the mean over the step's micro-batches */
    res->aux = sums[1] / ((double)tr->world * res->micro_batches);
    res->z = sums[2] / tokens;
    res->dropped = (int64_t)sums[3];
    res->a2a_bytes = (int64_t)sums[4];
    res->a2a_saved = (int64_t)sums[5];
    res->loss = res->ce + tr->cfg.aux_loss_coef * res->aux + tr->cfg.z_loss_coef * res->z;
    return MOE_OK;
}

moe_status moe_trainer_losses(moe_trainer *tr, moe_step_result *res)
{
    return losses_finish(tr, res, losses_fetch(tr), NULL);
}

/* Reads the first micro-batch of the step after this one (its first sequence follows
 * from tr->consumed and this step's sequences, as moe_trainer_accumulate computes it)
 * into tr->tokens_next, while the device runs the optimizer that apply has queued: the
 * host's share of the data (0.19 ms a step at the bench shape) then leaves no gap on
 * the device between the steps. A failure is kept for that step to report (the same
 * read would fail there). Past [train] steps (the last step of a run, or the steps
 * `moe-dist bench` adds) only the synthetic corpus is read ahead: it cannot fail, while a
 * shard's bad token there would be reported for a step that never runs. */
static void prefetch_next(moe_trainer *tr, const moe_step_result *res)
{
    const int micro = tr->cfg.micro_batch;
    tr->next_first = -1;
    if (tr->step + 1 >= tr->cfg.steps && !moe_data_is_synthetic(tr->data))
        return;
    moe_model *m = tr->model;
    const double t = moe_model_phase_begin(m);
    const int64_t first = micro_first(tr, tr->consumed + res->sequences, 0);
    tr->next_status = moe_data_batch(tr->data, tr->tokens_next, first, micro);
    tr->next_first = first;
    moe_model_phase_end(m, t, MOE_PHASE_DATA);
}

/* A step's gradient norm that is not finite ends the job. found_late: the step's update
 * ran beside the next step's forward (tr->defer) and is found now, when the gradients
 * have been overwritten: the bucket is named by the pieces' sums of squares (held_parts),
 * not the tensor by a scan of the gradients. */
static moe_status norm_not_finite(moe_trainer *tr, int step, double norm, int found_late)
{
    moe_model *m = tr->model;
    if (found_late) {
        for (int slot = 0; slot < 2 * tr->defer; slot++) {
            const double v = tr->held_parts[2 * slot] + tr->held_parts[2 * slot + 1];
            if (isfinite(v))
                continue;
            const int b = slot / 2;
            char what[64];
            if (b == 0)
                snprintf(what, sizeof what, "the embedding");
            else
                snprintf(what, sizeof what, "layer %d's %s parameters", b - 1,
                         slot % 2 ? "expert" : "dense");
            MOE_FAIL(MOE_ERR_NUMERIC,
                     "step %d: gradient norm is %g: the gradient of %s is not finite on this "
                     "rank (found after step %d: this update ran beside its forward)",
                     step, norm, what, step + 1);
        }
    }
    /* name the first tensor whose gradient is not finite here (dense gradients are the
     * same on every rank; expert ones differ) */
    for (int i = 0; !found_late && i < m->n_tensors; i++) {
        const moe_tensor *t = &m->tensors[i];
        if (!m->be->all_finite(m->grads + t->offset, t->count))
            MOE_FAIL(MOE_ERR_NUMERIC,
                     "step %d: gradient norm is %g: the gradient of %s (layer %d) is not "
                     "finite on this rank",
                     step, norm, t->name, t->layer);
    }
    MOE_FAIL(MOE_ERR_NUMERIC,
             "step %d: gradient norm is %g (the non-finite gradient is on another rank)", step,
             norm);
}

/* The held step's result with its norm from its global sums of squares: into *res. */
static moe_status release_held(moe_trainer *tr, const double held_sq[2], moe_step_result *res)
{
    const double norm = sqrt(held_sq[0] + held_sq[1]) / tr->held_res.loss_scale;
    tr->held = 0;
    if (!isfinite(norm))
        return norm_not_finite(tr, tr->held_res.step + 1, norm, 1);
    *res = tr->held_res;
    res->grad_norm = norm;
    res->ready = 1;
    return MOE_OK;
}

/* AdamW is queued before the host knows the gradient norm: the kernel clips with the
 * sums of squares on the backend, or skips the step when they are not finite (the same
 * decision on every rank: the sums are global). Then the step's one wait for the
 * backend brings back the cross-entropy sum and the sums of squares together, and the
 * host learns what the device decided. With tr->defer the pieces of buckets
 * [0, defer) are queued on lane 2 after that fetch, in the forward's order, and the
 * step is held until the next apply (or settle) brings back their sums. */
moe_status moe_trainer_apply(moe_trainer *tr, moe_step_result *res)
{
    moe_model *m = tr->model;
    const moe_backend *be = m->be;
    double t0 = moe_clock_seconds();
    const double tp = moe_model_phase_begin(m);
    res->loss_scale = tr->loss_scale;
    res->lr = moe_lr_at(&tr->cfg, tr->step);
    const int fused = norm_in_update(tr);
    long mark = -1;
    if (fused) { /* the pieces not queued during the backward, then the wait for all */
        for (int b = tr->defer; b < m->L + 2; b++)
            for (int part = 0; part < 2; part++)
                update_piece(tr, b, part, 1);
        be->background_join(); /* and the held step's lane 2, long done */
        mark = losses_fetch(tr);
        for (int b = 0; b < tr->defer; b++)
            for (int part = 0; part < 2; part++)
                update_piece(tr, b, part, 2);
    } else {
        moe_optimizer_step(tr->opt, m, &tr->cfg, res->lr, tr->norm_sq, tr->loss_scale);
    }
    MOE_CHECK(be->refresh_shadow());
    moe_model_phase_end(m, tp, MOE_PHASE_OPTIMIZER);
    prefetch_next(tr, res);
    if (mark < 0)
        mark = losses_fetch(tr);
    double held_sq[2] = {0, 0};
    const int held = tr->held; /* the step before, whose lane 2 the forward waited for */
    MOE_CHECK(losses_finish(tr, res, mark, held_sq)); /* fused: the sums made global there */
    const double *sq = tr->step_host + 1;
    double norm = sqrt(sq[0] + sq[1]);
    res->ready = 1;
    if (tr->scaling && moe_adamw_factor(sq, tr->cfg.grad_clip, tr->loss_scale) < 0) {
        /* fp16 overflow: the step was skipped (the data moves on); halve the scale. */
        res->skipped = 1;
        res->grad_norm = norm;
        moe_optimizer_unstep(tr->opt);
        tr->skipped_steps++;
        tr->loss_scale *= tr->cfg.loss_scale_backoff;
        tr->scale_good = 0;
        m->loss_scale = tr->loss_scale;
        tr->consumed += res->sequences;
        tr->step++;
        res->seconds += moe_clock_seconds() - t0;
        return MOE_OK;
    }
    norm /= tr->loss_scale; /* the gradients carry the loss scale */
    moe_step_result before = {0};
    if (held) /* the earlier step first: its update ran before this one's */
        MOE_CHECK(release_held(tr, held_sq, &before));
    if (!isfinite(norm)) { /* the device skipped the update (unless fused): nothing changed */
        if (!fused)
            moe_optimizer_unstep(tr->opt);
        return norm_not_finite(tr, tr->step + 1, norm, 0);
    }
    res->grad_norm = norm;
    if (tr->scaling && ++tr->scale_good >= tr->cfg.loss_scale_growth_interval) {
        tr->loss_scale *= tr->cfg.loss_scale_growth;
        tr->scale_good = 0;
        m->loss_scale = tr->loss_scale;
    }
    tr->consumed += res->sequences;
    tr->step++;
    res->seconds += moe_clock_seconds() - t0;
    if (fused && tr->defer) { /* lane 2's sums come back with the next step's */
        memcpy(tr->held_parts, fetched_half(tr, tr->norm_half), sizeof(double) * 2 * n_pieces(tr));
        tr->held_res = *res;
        tr->held = 1;
        *res = before; /* ready 0 on the first step */
    }
    return MOE_OK;
}

moe_status moe_trainer_settle(moe_trainer *tr, moe_step_result *res)
{
    memset(res, 0, sizeof *res);
    if (!tr->held)
        return MOE_OK;
    const moe_backend *be = tr->model->be;
    be->background_join();
    be->fetch(tr->step_host + 3, tr->norm_parts, sizeof(double) * 4 * n_pieces(tr));
    MOE_CHECK(wait_mark(tr, be->queue_mark()));
    double sq[2];
    held_sums(tr, tr->norm_half, sq); /* no step since: the held step's half */
    if (tr->comm) {
        double v[2];
        sq_share(tr, sq, v);
        MOE_CHECK(moe_comm_sum_doubles(tr->comm, MOE_GROUP_WORLD, v, 2));
        sq[0] = v[0];
        sq[1] = v[1];
    }
    return release_held(tr, sq, res);
}

/* "41k", "1.2M": a compact count for the progress line. */
static void fmt_count(char *buf, size_t cap, double x)
{
    if (x >= 1e6)
        snprintf(buf, cap, "%.1fM", x / 1e6);
    else if (x >= 1e3)
        snprintf(buf, cap, "%.0fk", x / 1e3);
    else
        snprintf(buf, cap, "%.0f", x);
}

static void fmt_duration(char *buf, size_t cap, double s)
{
    if (s < 60)
        snprintf(buf, cap, "%.1fs", s);
    else if (s < 3600)
        snprintf(buf, cap, "%dm%02ds", (int)(s / 60), (int)fmod(s, 60));
    else
        snprintf(buf, cap, "%dh%02dm", (int)(s / 3600), (int)fmod(s / 60, 60));
}

static void print_progress(const moe_trainer *tr, const moe_step_result *r, double elapsed,
                           double tok_per_s, int tty, FILE *out)
{
    char tps[16], el[16], eta[16];
    int remaining = tr->cfg.steps - (r->step + 1);
    fmt_count(tps, sizeof tps, tok_per_s);
    fmt_duration(el, sizeof el, elapsed);
    fmt_duration(eta, sizeof eta, elapsed / (r->step + 1) * remaining);
    fprintf(out, "%sstep %d/%d loss %.4f aux %.4f lr %.1e norm %.3f tok/s %s elapsed %s eta %s",
            tty ? "\r\033[K" : "", r->step + 1, tr->cfg.steps, r->ce, r->aux, r->lr, r->grad_norm,
            tps, el, eta);
    if (r->dropped)
        fprintf(out, " dropped %lld", (long long)r->dropped);
    if (tr->world > 1)
        fprintf(out, " a2a %.1fMB", r->a2a_bytes / 1e6);
    if (tr->world > 1)
        fprintf(out, " comm %.1fms exposed %.1fms", 1e3 * (r->exchange_s + r->reduction_s),
                1e3 * (r->exchange_exposed_s + r->reduction_exposed_s));
    if (tr->scaling)
        fprintf(out, " scale %.0f skipped %lld%s", r->loss_scale, (long long)tr->skipped_steps,
                r->skipped ? " (this step)" : "");
    if (!tty)
        fputc('\n', out);
    fflush(out);
}

/* Per MoE layer: share of assignments of the least and most loaded expert, and max/mean,
 * since the last summary (summed over ranks; collective); then resets the counts. */
static moe_status print_expert_load(moe_trainer *tr, int tty, FILE *out)
{
    moe_model *m = tr->model;
    if (tr->comm)
        MOE_CHECK(moe_comm_sum_int64(tr->comm, MOE_GROUP_WORLD, m->load, m->L * m->E));
    if (tty && tr->rank == 0)
        fputc('\n', out);
    for (int l = tr->cfg.dense_layers; l < m->L && tr->rank == 0; l++) {
        int64_t *load = m->load + (size_t)l * m->E;
        int64_t total = 0, lo = load[0], hi = load[0];
        for (int e = 0; e < m->E; e++) {
            total += load[e];
            lo = load[e] < lo ? load[e] : lo;
            hi = load[e] > hi ? load[e] : hi;
        }
        double mean = (double)total / m->E;
        fprintf(out, "  expert load layer %d: min %.3f max %.3f max/mean %.2f\n", l,
                total ? (double)lo / total : 0.0, total ? (double)hi / total : 0.0,
                mean > 0 ? (double)hi / mean : 0.0);
    }
    memset(m->load, 0, sizeof(int64_t) * (size_t)m->L * m->E);
    return MOE_OK;
}

/* A number as JSON: non-finite values (the gradient norm of a skipped fp16 step) as null. */
static const char *json_num(char *buf, size_t cap, double x)
{
    if (isfinite(x))
        snprintf(buf, cap, "%.9g", x);
    else
        snprintf(buf, cap, "null");
    return buf;
}

static void write_jsonl(FILE *f, const moe_step_result *r, double tok_per_s)
{
    char loss[32], ce[32], aux[32], z[32], norm[32];
    fprintf(f,
            "{\"step\":%d,\"loss\":%s,\"ce\":%s,\"aux\":%s,\"z\":%s,\"grad_norm\":%s,"
            "\"lr\":%.9g,\"sequences\":%lld,\"dropped\":%lld,\"a2a_bytes\":%lld,"
            "\"a2a_bytes_saved\":%lld,\"loss_scale\":%.9g,\"skipped\":%d,\"step_s\":%.6f,"
            "\"tok_per_s\":%.1f,\"exchange_ms\":%.4f,\"exchange_exposed_ms\":%.4f,"
            "\"reduction_ms\":%.4f,\"reduction_exposed_ms\":%.4f,\"counts_ms\":%.4f}\n",
            r->step + 1, json_num(loss, sizeof loss, r->loss), json_num(ce, sizeof ce, r->ce),
            json_num(aux, sizeof aux, r->aux), json_num(z, sizeof z, r->z),
            json_num(norm, sizeof norm, r->grad_norm), r->lr, (long long)r->sequences,
            (long long)r->dropped, (long long)r->a2a_bytes, (long long)r->a2a_saved, r->loss_scale,
            r->skipped, r->seconds, tok_per_s, 1e3 * r->exchange_s, 1e3 * r->exchange_exposed_s,
            1e3 * r->reduction_s, 1e3 * r->reduction_exposed_s, 1e3 * r->counts_s);
    fflush(f);
}

moe_status moe_trainer_checkpoint(moe_trainer *tr)
{
    moe_ckpt_state state = {.step = tr->step,
                            .consumed = tr->consumed,
                            .loss_scale = tr->loss_scale,
                            .loss_scale_good = tr->scale_good,
                            .loss_scale_dynamic = tr->scaling};
    double t0 = moe_clock_seconds();
    if (tr->held)
        MOE_FAIL(MOE_ERR_INVALID,
                 "a checkpoint of step %d while its update still runs "
                 "(moe_trainer_settle first)",
                 tr->step);
    MOE_CHECK(tr->model->be->sync_master()); /* bf16 master weights into the arena */
    MOE_CHECK(moe_checkpoint_save(&tr->cfg, tr->comm, tr->model, tr->opt, &state, &tr->fault,
                                  tr->ckpt_path, sizeof tr->ckpt_path));
    tr->ckpt_step = tr->step;
    tr->ckpt_time = moe_clock_seconds();
    if (tr->rank == 0) {
        printf("checkpoint: step %d -> %s (%.2fs)\n", tr->step, tr->ckpt_path, tr->ckpt_time - t0);
        fflush(stdout);
    }
    return MOE_OK;
}

moe_status moe_trainer_resume(moe_trainer *tr, const char *spec)
{
    moe_ckpt_state state;
    int found = 0;
    char path[sizeof tr->ckpt_path];
    MOE_CHECK(moe_checkpoint_resume(spec, &tr->cfg, tr->comm, tr->model, tr->opt, &state, &found,
                                    path, sizeof path));
    if (!found)
        return MOE_OK;
    if (state.step > INT32_MAX)
        MOE_FAIL(MOE_ERR_INVALID, "%s: step %lld is beyond this build's range", path,
                 (long long)state.step);
    tr->step = (int)state.step;
    tr->consumed = state.consumed;
    tr->next_first = -1; /* nothing read ahead holds for the resumed position */
    if (tr->scaling && state.loss_scale_dynamic) {
        tr->loss_scale = state.loss_scale;
        tr->scale_good = state.loss_scale_good;
        tr->model->loss_scale = tr->loss_scale;
    }
    MOE_CHECK(tr->model->be->refresh_shadow());
    tr->ckpt_step = state.step;
    memcpy(tr->ckpt_path, path, sizeof path);
    if (tr->rank == 0) {
        printf("resumed from %s: step %d, %lld sequences consumed\n", path, tr->step,
               (long long)tr->consumed);
        fflush(stdout);
    }
    return MOE_OK;
}

/* At a step boundary: every rank learns whether any rank was asked to stop and whether
 * rank 0's clock says a checkpoint is due. *stop: the run must end now (a stop request
 * with steps left), after a checkpoint; *due: a checkpoint is due. Collective. */
static moe_status checkpoint_boundary(moe_trainer *tr, int *stop, int *due)
{
    const moe_config *cfg = &tr->cfg;
    int64_t flags[2] = {tr->stop_request && *tr->stop_request != 0, 0};
    if (tr->rank == 0 && cfg->ckpt_interval_minutes > 0 &&
        moe_clock_seconds() - tr->ckpt_time >= 60.0 * cfg->ckpt_interval_minutes)
        flags[1] = 1;
    if (tr->comm) {
        moe_comm_set_context(tr->comm, "step boundary", -1);
        MOE_CHECK(moe_comm_sum_int64(tr->comm, MOE_GROUP_WORLD, flags, 2));
    }
    const int last = tr->step >= cfg->steps;
    *stop = flags[0] > 0 && !last;
    if (*stop && tr->rank == 0)
        moe_log("stop requested (SIGUSR1/SIGTERM on %lld rank(s)): checkpoint, then exit",
                (long long)flags[0]);
    *due =
        ((cfg->ckpt_interval > 0 && tr->step % cfg->ckpt_interval == 0) || flags[1] > 0 || *stop) &&
        tr->ckpt_step != tr->step;
    return MOE_OK;
}

/* Sums the routing statistics over the world (every rank then holds the same counts)
 * and rank 0 writes them to [log] routing_stats. Collective. */
static moe_status reduce_routing_stats(moe_trainer *tr)
{
    MOE_CHECK(moe_model_routing_collect(tr->model));
    if (tr->comm && tr->world > 1)
        MOE_CHECK(moe_comm_sum_int64(tr->comm, MOE_GROUP_WORLD, tr->routing->data,
                                     (int)tr->routing->count));
    return MOE_OK;
}

static moe_status save_routing_stats(moe_trainer *tr)
{
    MOE_CHECK(reduce_routing_stats(tr));
    tr->routing->steps = tr->step;
    if (tr->rank == 0)
        MOE_CHECK(moe_routing_stats_save(tr->routing, tr->cfg.routing_stats_path));
    return MOE_OK;
}

moe_status moe_trainer_replan(moe_trainer *tr, FILE *out)
{
    moe_model *m = tr->model;
    const int n_moe = m->L - tr->cfg.dense_layers;
    moe_placement *plan = NULL;
    moe_plan_report report;
    moe_plan_params params = moe_plan_params_default();
    moe_status st = MOE_OK;
    if (tr->held)
        MOE_FAIL(MOE_ERR_INVALID,
                 "a re-plan at step %d while its update still runs "
                 "(moe_trainer_settle first)",
                 tr->step);
    MOE_CHECK(reduce_routing_stats(tr));
    tr->routing->steps = tr->cfg.replan_interval;
    if (tr->rank == 0 && tr->cfg.routing_stats_path[0])
        MOE_CHECK(moe_routing_stats_save(tr->routing, tr->cfg.routing_stats_path));
    /* every rank plans from the same counts; the planner is deterministic */
    MOE_CHECK(moe_plan_experts(&plan, tr->routing, m->ep, m->ep, &params, &report));
    int *table = malloc(sizeof(int) * (size_t)m->L * m->E);
    if (!table) {
        moe_placement_destroy(plan);
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate a placement");
    }
    memcpy(table, m->expert_rank, sizeof(int) * (size_t)m->L * m->E);
    for (int l = 0; l < n_moe; l++)
        memcpy(table + (size_t)(tr->cfg.dense_layers + l) * m->E,
               plan->expert_rank + (size_t)l * m->E, sizeof(int) * m->E);
    void *extra[2] = {tr->opt->m, tr->opt->v};
    const size_t moment = tr->opt->moments16 ? sizeof(uint16_t) : sizeof(real);
    const size_t extra_elem[2] = {moment, moment};
    st = m->be->sync_master(); /* the arena moves, then rounds into the shadow again */
    if (st == MOE_OK)
        st = moe_model_move_experts(m, table, extra, extra_elem, 2);
    if (st == MOE_OK)
        st = m->be->refresh_shadow();
    if (st == MOE_OK)
        st = m->be->sync();
    if (st == MOE_OK) { /* the moves' exchanges are not the next step's communication */
        moe_comm_times moved;
        moe_comm_take_times(tr->comm, &moved);
        moe_comm_take_sites(tr->comm, NULL, 0);
    }
    if (st == MOE_OK && tr->rank == 0)
        fprintf(out,
                "re-plan at step %d: experts grouped by co-activation, objective %.0f -> %.0f "
                "(contiguous), worst load max/mean %.2f\n",
                tr->step, report.objective[0], report.objective_contiguous[0],
                report.worst_balance);
    moe_routing_stats_reset(tr->routing);
    free(table);
    moe_placement_destroy(plan);
    return st;
}

/* A finished step's result (r->ready): the progress line (every [log] interval steps,
 * the first and the last) and the JSONL record; *tokens counts the steps reported. */
static void report_step(moe_trainer *tr, const moe_step_result *r, int first_step, double start,
                        int64_t *tokens, moe_step_result *final, int tty, FILE *out)
{
    if (!r->ready)
        return;
    *tokens += r->sequences * tr->cfg.seq_len;
    const double elapsed = moe_clock_seconds() - start;
    const double tps = *tokens / elapsed;
    const int done = r->step + 1;
    if (tr->rank == 0 &&
        (done % tr->cfg.log_interval == 0 || done == tr->cfg.steps || done == first_step + 1))
        print_progress(tr, r, elapsed, tps, tty, out);
    if (tr->jsonl)
        write_jsonl(tr->jsonl, r, tps);
    *final = *r;
}

moe_status moe_trainer_run(moe_trainer *tr, FILE *out)
{
    /* a launcher (mpirun, srun) hands ranks a pseudo-terminal even when its own output
     * goes to a file: under one, print plain lines */
    const int tty = isatty(fileno(out)) && !getenv("OMPI_COMM_WORLD_SIZE") && !getenv("PMI_RANK") &&
                    !getenv("SLURM_PROCID");
    double start = moe_clock_seconds();
    int64_t tokens = 0;
    moe_step_result r = {0}, final = {0};
    if (tr->cfg.jsonl_path[0] && tr->rank == 0 && !tr->jsonl) {
        tr->jsonl = fopen(tr->cfg.jsonl_path, tr->step > 0 ? "a" : "w");
        if (!tr->jsonl)
            MOE_FAIL(MOE_ERR_IO, "[log] jsonl: cannot open '%s' for writing: %m",
                     tr->cfg.jsonl_path);
    }
    const int first_step = tr->step;
    while (tr->step < tr->cfg.steps) {
        MOE_CHECK(moe_trainer_accumulate(tr, &r));
        MOE_CHECK(moe_trainer_apply(tr, &r));
        report_step(tr, &r, first_step, start, &tokens, &final, tty, out);
        const int last = tr->step == tr->cfg.steps;
        const int load = tr->cfg.expert_load_interval > 0 &&
                         tr->step % tr->cfg.expert_load_interval == 0 &&
                         tr->cfg.dense_layers < tr->cfg.n_layers;
        const int replan = tr->routing && strcmp(tr->cfg.placement, "auto") == 0 &&
                           tr->step % tr->cfg.replan_interval == 0 && tr->step < tr->cfg.steps;
        int stop = 0, due = 0;
        MOE_CHECK(checkpoint_boundary(tr, &stop, &due));
        if (last || load || replan || due || stop) { /* the step just taken, reported first */
            MOE_CHECK(moe_trainer_settle(tr, &r));
            report_step(tr, &r, first_step, start, &tokens, &final, tty, out);
        }
        if (load)
            MOE_CHECK(print_expert_load(tr, tty, out));
        if (replan)
            MOE_CHECK(moe_trainer_replan(tr, out));
        if (due)
            MOE_CHECK(moe_trainer_checkpoint(tr));
        if (stop) {
            tr->stopped = 1;
            break;
        }
    }
    if (!tr->stopped && (tr->cfg.ckpt_interval > 0 || tr->cfg.ckpt_interval_minutes > 0) &&
        tr->ckpt_step != tr->step)
        MOE_CHECK(moe_trainer_checkpoint(tr));
    if (tr->routing && tr->cfg.routing_stats_path[0])
        MOE_CHECK(save_routing_stats(tr));
    if (tr->rank == 0) {
        double elapsed = moe_clock_seconds() - start;
        if (tty)
            fputc('\n', out);
        if (tr->stopped)
            fprintf(out, "stopped at step %d of %d: checkpoint %s\n", tr->step, tr->cfg.steps,
                    tr->ckpt_path);
        else
            fprintf(out, "done: %d steps, final loss %.4f, %.0f tokens/s, %.1fs\n", tr->cfg.steps,
                    final.ce, tokens / elapsed, elapsed);
    }
    return MOE_OK;
}
