/* runtime/trainer.h: the training loop of one rank.
 *
 * Owns: which global sequences each micro-batch reads, the step (zero gradients,
 * micro-batches of forward + backward, gradient reduction, clipping, AdamW), the progress
 * line, the expert-load summary, the JSONL log.
 * Checkpoints: every [checkpoint] interval steps, every interval_minutes (rank 0's clock,
 * agreed by the world), when *stop_request is set on any rank (then the run stops after
 * the checkpoint with `stopped` set: the launcher exits for requeue), and at the end of
 * the run when either interval is set. Format and atomicity: checkpoint.h.
 * Does not own: the model's math (model.c), the data source (data.c), process groups
 * (comm/), signals and ending the job (launcher/).
 *
 * Data order: optimizer step s reads the global sequences [c, c + S) where c is the
 * number consumed before it and S = micro_batch * world * accum(s). Micro-batch j of
 * rank r reads sequences c + (j * world + r) * micro_batch + [0, micro_batch). */
#ifndef MOE_RUNTIME_TRAINER_H
#define MOE_RUNTIME_TRAINER_H

#include <signal.h>
#include <stdint.h>
#include <stdio.h>

#include "runtime/config.h"
#include "runtime/data.h"
#include "runtime/model.h"
#include "runtime/optimizer.h"
#include "util/fault.h"
#include "util/status.h"

typedef struct {
    int step;          /* 0-based step just taken */
    int micro_batches; /* accumulation of this step */
    int64_t sequences; /* S: sequences in the global batch */
    double loss;       /* ce + aux_coef*aux + z_coef*z */
    double ce, aux, z; /* mean cross-entropy, aux and z losses (see model.h) */
    double grad_norm;  /* global norm before clipping */
    double lr;
    int64_t dropped;   /* assignments dropped by the capacity in this step */
    int64_t a2a_bytes; /* token bytes sent between ranks (all ranks) */
    int64_t a2a_saved; /* bytes not sent because a token goes once to a rank */
    double seconds;    /* wall time of the step */
    int skipped;       /* fp16: the step found non-finite gradients and was skipped */
    double loss_scale; /* the loss scale this step ran with (1 without scaling) */
    /* this rank's communication time in the step (comm.h moe_comm_times): the token
     * exchange and the gradient reduction, each total and exposed */
    double exchange_s, exchange_exposed_s, reduction_s, reduction_exposed_s;
    double counts_s, counts_exposed_s; /* of the exchange: the count exchanges (moe_comm_times) */
    int64_t expert_rows; /* rows this rank's experts computed in the step (not summed) */
    int ready; /* moe_trainer_apply, _settle: 1 when this is a finished step's result, 0 when
                * there is none to report yet (the update of the step just taken still runs) */
} moe_step_result;

/* A gradient bucket: the tensors of one backward stage, dense and expert ranges. */
typedef struct {
    size_t dense_lo, dense_hi;   /* reduced over the world */
    size_t expert_lo, expert_hi; /* reduced over the expert-data-parallel group */
    int handles[2];
} moe_grad_bucket;

struct moe_comm;
struct moe_routing_stats;

typedef struct {
    moe_config cfg;
    struct moe_comm *comm; /* NULL: one process */
    int world, rank;
    moe_grad_bucket *buckets; /* L + 2, indexed by stage + 1 (stage -1 = embedding) */
    int reduce_now;           /* the last micro-batch of a step: reduce as stages finish */
    int last_micro;           /* the last micro-batch of a step is running */
    moe_status reduce_status;
    double *norm_sq;          /* (2) backend memory: squares of the dense and expert gradients */
    double *norm_parts;       /* (2, 4 (L + 2)) backend memory, two halves (a step's pieces
                               * write half norm_half): each update piece's two sums of
                               * squares (moe_trainer_apply), at 2 (2 bucket + part) */
    int norm_half;            /* the half of norm_parts this step's pieces write */
    unsigned char *updated;   /* (2 (L + 2)) the pieces of this step's update queued */
    int defer;                /* the update of buckets [0, defer) runs beside the next step's
                               * forward (moe_trainer_apply); 0: none */
    unsigned char *pending;   /* (2 (L + 2)) such pieces the next forward has not waited for */
    int held;                 /* a step whose deferred pieces were queued, not yet reported */
    int zero_queued;          /* the embedding's gradient zeroed on lane 1, not yet waited for */
    moe_step_result held_res; /* its result but the gradient norm */
    double *held_parts;       /* (4 (L + 2)) its pieces' sums of squares (this rank's) */
    int update_early;         /* update_in_backward: the update's pieces queued as stages end */
    int step_counted;         /* this step's AdamW step counted (its first piece queued) */
    double *step_host;        /* (3 + 8 (L + 2)) pinned: the step's ce sum, norm_sq and
                               * both halves of norm_parts, fetched at its end */
    double sums[10];          /* this rank's ce, aux, z, dropped, a2a bytes, a2a saved of the step,
                               * its share of the norm's two sums of squares, and of the held
                               * step's (moe_trainer_losses) */
    moe_model *model;
    moe_data *data;
    moe_optimizer *opt;
    int32_t *tokens;                     /* (micro_batch, T+1) */
    int32_t *tokens_next;                /* (micro_batch, T+1): the next step's first
                                            micro-batch, read while the device runs this
                                            step's optimizer (moe_trainer_apply) */
    int64_t next_first;                  /* its first sequence; -1: none held */
    moe_status next_status;              /* how reading it ended (reported by that step) */
    int64_t consumed;                    /* global sequences consumed by finished steps */
    int step;                            /* next step to take */
    FILE *jsonl;                         /* NULL when [log] jsonl is empty */
    moe_fault fault;                     /* MOE_FAULT, for tests */
    int precision;                       /* moe_precision of the GEMMs */
    int scaling;                         /* fp16 dynamic loss scaling on */
    double loss_scale;                   /* current scale (1 without scaling) */
    int64_t scale_good;                  /* clean steps since the scale last changed */
    int64_t skipped_steps;               /* steps skipped for non-finite gradients */
    struct moe_routing_stats *routing;   /* NULL unless placement = auto or [log] routing_stats */
    volatile sig_atomic_t *stop_request; /* non-zero: checkpoint and stop (set by a signal
                                            handler of the launcher); NULL: never */
    int stopped;                         /* the run stopped early after a stop request */
    int64_t ckpt_step;                   /* step of the newest checkpoint saved or resumed; -1 */
    double ckpt_time;                    /* when it was saved (or the run began), seconds */
    char ckpt_path[MOE_PATH_MAX + 64];   /* its directory; "" if none */
} moe_trainer;

/* Builds the model, data source and optimizer for cfg on this rank. comm NULL: one
 * process. Collective over the world. On failure *out is NULL. */
moe_status moe_trainer_create(moe_trainer **out, const moe_config *cfg, struct moe_comm *comm);
void moe_trainer_destroy(moe_trainer *tr);

/* Zeroes the embedding's gradients (the first backward writes the others: see
 * moe_model_fresh_grads) and queues every micro-batch of step tr->step (forward +
 * backward), reducing gradients across ranks as the last micro-batch's stages finish,
 * and the sums of squares of the gradient norm. Fills step, micro_batches, sequences.
 * The host waits only for each MoE layer's counts. Collective. */
moe_status moe_trainer_accumulate(moe_trainer *tr, moe_step_result *res);

/* Instead of apply (for a dump of the step's gradients): waits for the step and fills
 * its loss fields and communication times, leaving the parameters and the step as they
 * are. Collective. */
moe_status moe_trainer_losses(moe_trainer *tr, moe_step_result *res);

/* Queues AdamW (clipping and the fp16 skip decided on the device), then waits for the
 * step once and fills the loss fields (summed over ranks), grad_norm, lr, skipped and the
 * communication times; advances the step and the data position. Collective.
 * With tr->defer, the update of the first buckets runs beside the next step's forward:
 * the step's gradient norm is not known when apply returns. apply then keeps the step's
 * result and fills res with the step before it (res->ready 0 on the first); a non-finite
 * gradient in those buckets is reported by the next apply or settle. Without, res is
 * this step's (res->ready 1). */
moe_status moe_trainer_apply(moe_trainer *tr, moe_step_result *res);

/* Waits for the update still running (tr->defer) and fills res with the step apply
 * kept (res->ready 1), or sets res->ready 0 when none is kept. Before anything reads or
 * moves the parameters or the optimizer's state between steps (checkpoint, re-plan) and
 * at the end. Collective. */
moe_status moe_trainer_settle(moe_trainer *tr, moe_step_result *res);

/* Collective: sums the routing statistics over ranks, plans a placement from them
 * (sched/), moves expert weights and Adam state to their new ranks, and resets the
 * statistics. Called at a step boundary. */
moe_status moe_trainer_replan(moe_trainer *tr, FILE *out);

/* The precision in words, for the banner. */
const char *moe_trainer_precision(const moe_trainer *tr);
/* When AdamW runs (docs/design.md: in pieces beside the backward where nothing clips and
 * no loss scale can skip the step), in words for the start-up lines. */
const char *moe_trainer_update_mode(const moe_trainer *tr);

/* Trains until cfg.steps, printing progress to out, saving checkpoints (see the top).
 * Returns early with tr->stopped set after the checkpoint of a stop request. The JSONL
 * log is opened here: truncated on a fresh run, appended to after a resume. Collective. */
moe_status moe_trainer_run(moe_trainer *tr, FILE *out);

/* Restores the state of a checkpoint (spec "auto" or a directory; see
 * moe_checkpoint_resume) before run. Collective; on failure the trainer is unchanged. */
moe_status moe_trainer_resume(moe_trainer *tr, const char *spec);

/* Saves a checkpoint of the current step now (tr->ckpt_* updated). Collective. */
moe_status moe_trainer_checkpoint(moe_trainer *tr);

#endif
