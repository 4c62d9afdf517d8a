/* runtime/model.h: the MoE transformer: parameter layout, activations, forward and
 * backward of each block, on the CPU reference ops of kernels/.
 *
 * Owns: the tensor table (names, shapes, offsets into one arena), the parameter and
 * gradient arenas, the activation buffers (all sized and allocated once at create), the
 * forward and backward passes of one micro-batch, and the routing statistics.
 * Does not own: the optimizer, the schedule, data, or communication (the trainer).
 *
 * Dimension letters: B sequences in a micro-batch, T sequence length, N = B*T tokens,
 * D d_model, H heads, Hd = D/H, V vocabulary, L layers, E experts per MoE layer,
 * El experts held by this rank, K top-k, F expert hidden, Fd dense hidden,
 * Fs = shared_experts * F, M routed rows (kept token-expert assignments).
 *
 * Arena order: every dense tensor first (replicated on all ranks, reduced over the world),
 * then the expert tensors (El experts per layer, reduced over the expert-data-parallel
 * group). Gradients use the same layout in a second arena.
 *
 * Loss of one optimizer step over S sequences in n = S/B micro-batches (all ranks):
 *   loss = ce + aux_loss_coef * aux + z_loss_coef * z
 *   ce  = sum of token cross-entropies / (S*T)
 *   aux = sum over MoE layers and micro-batches of aux(l, j) / n, with per micro-batch
 *         aux(l, j) = E * sum_e f_e * P_e (f_e: share of the micro-batch's top-k
 *         assignments on expert e, before capacity drops; P_e: mean router probability
 *         of e over its tokens), as Megatron-Core computes it per rank and micro-batch
 *   z   = sum over MoE layers and tokens of logsumexp(router logits)^2 / (S*T)
 * The capacity (capacity_factor > 0) is ceil(capacity_factor * N * K / E) rows per expert
 * per micro-batch. Both depend on the micro-batch, not on the world size: the same global
 * batch at the same micro_batch gives the same loss at any world size and ep. */
#ifndef MOE_RUNTIME_MODEL_H
#define MOE_RUNTIME_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/ops.h"
#include "runtime/config.h"
#include "util/status.h"

#define MOE_TENSOR_NAME_MAX 64

typedef struct {
    char name[MOE_TENSOR_NAME_MAX]; /* "layers.3.moe.experts.w1" */
    size_t offset;                  /* elements into the arena */
    size_t count;                   /* elements */
    int ndim;
    int shape[3];
    int layer;     /* -1 for embedding, final_norm, lm_head */
    int is_expert; /* sharded over expert parallelism; first dim is El */
    int decay;     /* weight decay applies (matrices; not norms) */
} moe_tensor;

/* Pointers into an arena (parameters or gradients), one set per layer. */
typedef struct {
    real *attn_norm;         /* (D) */
    real *wq, *wk, *wv, *wo; /* (D, D) */
    real *ffn_norm;          /* (D) */
    real *w1, *w3, *w2;      /* dense FFN: (Fd, D), (Fd, D), (D, Fd); NULL in MoE layers */
    real *router;            /* (E, D); NULL in dense layers */
    real *sw1, *sw3, *sw2;   /* shared experts: (Fs, D), (Fs, D), (D, Fs); NULL if none */
    real *ew1, *ew3, *ew2;   /* local experts: (El, F, D), (El, F, D), (El, D, F) */
} moe_layer_view;

typedef struct {
    real *embedding;        /* (V, D) */
    real *final_norm;       /* (D) */
    real *lm_head;          /* (V, D) */
    moe_layer_view *layers; /* L */
} moe_view;

/* Activations of one layer for one chunk of a micro-batch, saved for backward (N below:
 * the chunk's Nc tokens, B its Bc sequences). */
typedef struct {
    real *h1, *rstd1;    /* (N, D), (N): attention-norm output and 1/rms */
    real *q, *k, *v;     /* (N, D): q, k after RoPE */
    real *att, *att_lse; /* (N, D), (B, H, T) */
    real *xmid;          /* (N, D): residual after attention */
    real *h2, *rstd2;    /* (N, D), (N): ffn-norm output */
    real *fa, *fb, *fh;  /* dense: (N, Fd) gate, up, swiglu */
    /* MoE, the side that owns the tokens */
    real *logits, *probs, *rlse; /* router: (N, E), (N, E), (N) */
    int32_t *idx;                /* (N, K) global expert ids */
    real *w;                     /* (N, K) */
    int64_t *mb_counts;          /* (E): layer_counts of the layer (the whole micro-batch) */
    int32_t *slot_row;           /* (N*K): -1 where the capacity dropped the assignment */
    int32_t *send_token;         /* (N*min(K,ep)): token of each row sent, by destination */
    int32_t *token_rows;         /* (N, ep): its inverse, the row of each (token, destination) */
    int *send_rows, *recv_rows;  /* (ep): rows sent to / received from each EP peer */
    int n_send, n_recv;
    /* MoE, the side that holds the experts: rows received from every EP peer */
    int32_t *lidx;                 /* (R, K): local expert of each slot, -1 if elsewhere */
    real *lw;                      /* (R, K): router weight of each slot */
    int *offsets;                  /* (El + 1) rows per local expert */
    int32_t *row_token, *row_slot; /* (R*K): received row and slot of each expert row */
    int32_t *lslot_row;            /* (R*K): the inverse, expert row of each slot or -1 */
    int n_rows;                    /* M: expert rows */
    real *xperm;                   /* (M, D) inputs in expert order */
    real *ea, *eb, *eh;            /* (M, F) */
    real *eout;                    /* (M, D) */
    real *sa, *sb, *sh;            /* shared: (N, Fs) */
} moe_layer_acts;

/* What a chunk of a micro-batch keeps apart from the other chunks (moe_model.chunk):
 * everything indexed by its tokens, and every buffer a token exchange reads or writes
 * while another chunk computes. */
typedef struct {
    int32_t *tokens, *targets;           /* (Nc) */
    real **x;                            /* L+1 residual streams (Nc, D) */
    moe_layer_acts *acts;                /* L */
    real *hf, *rstdf, *ce_lse, *ce_loss; /* final norm (Nc, D), (Nc); losses (Nc) */
    real *dres, *dh;                     /* backward: the residual gradient, (Nc, D) */
    real *dyrecv;                        /* (Rmax, D) */
    char *send_buf, *recv_buf;           /* packed exchange rows: max(rows) * row_bytes */
    double *aux_part;                    /* router_aux_part_len(Nc, E) */
    double *aux_host;     /* the same, fetched into host memory (read after the dispatch counts) */
    int *pack_counts;     /* MOE_PACK_COUNTS(ep, El): the dispatch counts, fetched likewise */
    long mark;            /* the backend's queue mark after them */
    int pending;          /* moe_comm_handle of its exchange in flight */
    const void *received; /* where its last exchange's rows arrive: recv, or at ep 1 send */
} moe_chunk;

typedef struct {
    double aux_sum;          /* sum over MoE layers and sequences of aux(l, s) */
    double z_sum;            /* sum over MoE layers and tokens of lse^2 */
    int64_t tokens;          /* N */
    int64_t dropped;         /* assignments dropped by the capacity */
    int64_t a2a_bytes;       /* bytes this rank sent to other ranks in token exchanges */
    int64_t a2a_bytes_saved; /* bytes not sent because a token goes once to a rank */
    int64_t expert_rows;     /* expert rows this rank's experts computed (all MoE layers) */
} moe_fwd_stats;

struct moe_comm;
struct moe_backend;
/* Called by backward when the gradients of a stage are final: stage L (final norm and
 * LM head), L-1 ... 0 (layers), -1 (embedding). Stage 0's call comes before the
 * embedding's backward adds to its gradients (moe_model_added_grads); what the listener
 * queues there runs before those additions. */
typedef void (*moe_grad_ready_fn)(void *ctx, int stage);
/* Called by forward before it first reads a stage's parameters in a micro-batch: stage
 * -1 (the embedding), 0 ... L-1 (layer l: part 0 its dense parameters -- norms,
 * attention, router, dense and shared FFN --, part 1 its experts), L (final norm and LM
 * head), in that order. Whatever the listener queues there runs before those reads. */
typedef void (*moe_params_needed_fn)(void *ctx, int stage, int part);

/* Phases of a training step, timed when moe_model.timing is set: each boundary then
 * waits for the backend, so the phases add up to the step (at the cost of the overlap of
 * host and device; the bench reports untimed steps for the step time). The exchange is
 * the token dispatch and combine with their counts; the reduction the gradient
 * all-reduce; forward and backward exclude both. */
typedef enum {
    MOE_PHASE_DATA,
    MOE_PHASE_FORWARD,
    MOE_PHASE_BACKWARD,
    MOE_PHASE_EXCHANGE,
    MOE_PHASE_REDUCTION,
    MOE_PHASE_OPTIMIZER,
    MOE_PHASES
} moe_phase;

typedef struct moe_model {
    moe_config cfg;
    int B, T, N, D, H, Hd, V, L, E, El, K, F, Fd, Fs;
    /* A micro-batch of B sequences runs as C chunks of Bc sequences (Nc tokens), layer
     * by layer in turn, so that one chunk's token exchange travels while another
     * computes ([parallel] a2a_chunks). tokens, targets, x, acts, hf, rstdf, ce_lse,
     * ce_loss, dres, dh, dyrecv, send_buf, recv_buf and aux_part below point
     * into chunk `cur` (use_chunk in model.c); the other buffers are shared by the
     * chunks (each used within one stage). */
    int C, Bc, Nc, cur;
    moe_chunk *chunk;           /* C */
    int capacity;               /* per expert per chunk, -1 dropless */
    double loss_scale;          /* backward seeds are multiplied by it (fp16 loss scaling); 1 */
    int64_t head_sequences;     /* > 0: the next forward runs the LM head's backward too */
    int64_t head_done;          /* the step size it ran for, until the backward that follows */
    int backward_begun;         /* that forward also began the last layer's backward */
    int grads_fresh;            /* the next backward writes the gradients, not adds (but the
                                 * embedding's: moe_model_added_grads) */
    size_t max_gemm_operand;    /* elements of the largest activation operand of any GEMM */
    int ep, ep_rank;            /* expert-parallel degree and this rank's place in its EP group */
    int *expert_rank;           /* (L, E): EP rank holding each expert of each layer */
    int *expert_local;          /* (L, E): its index among that rank's El experts */
    int *local_experts;         /* (L, El): global ids of this rank's experts, by layer */
    int timing;                 /* time the phases (moe_phase) into phase_s */
    double phase_s[MOE_PHASES]; /* seconds per phase since the caller last zeroed them */
    /* Seconds the host spent blocked on the backend's queue in a step's own waits (the
     * dispatch counts of each MoE layer and chunk, the step's losses) since the caller
     * last zeroed it: the rest of a step the host spends issuing work, so a host that is
     * rarely blocked is what bounds the step (the bench reports it). */
    double host_wait_s;
    struct moe_routing_stats *routing; /* NULL, or statistics to collect (sched/stats.h) */
    int64_t *routing_dev;         /* its counts' block in backend memory, added to during forward */
    struct moe_comm *comm;        /* NULL: one process */
    const struct moe_backend *be; /* where buffers live and ops run */
    int32_t *expert_rank_dev, *expert_local_dev; /* (L, E) copies in backend memory */
    moe_grad_ready_fn grad_ready;                /* NULL: nobody listens */
    void *grad_ready_ctx;
    moe_params_needed_fn params_needed; /* NULL: nobody listens */
    void *params_needed_ctx;

    moe_tensor *tensors;
    int n_tensors;
    size_t n_params; /* arena elements */
    size_t n_dense;  /* elements [0, n_dense) are dense, the rest expert */
    real *params, *grads;
    moe_view p, g;

    /* activations; in this block and the next, N is a chunk's Nc tokens */
    int32_t *tokens, *targets; /* (N) */
    int32_t *tokens_h;         /* (2 * B * T) host staging of tokens then targets (in fetch_base) */
    long tokens_mark;          /* the queue's mark after the last copies of tokens_h (-1: none) */
    real **x;                  /* L+1 residual streams (N, D): x[0] embedding, x[L] final */
    moe_layer_acts *acts;      /* L */
    real *hf, *rstdf;          /* final norm (N, D), (N) */
    real *logits, *ce_lse, *ce_loss; /* (head_rows, V), (N), (N) */
    real *dlogits; /* (head_rows, V): their gradient; on a device its own buffer, marked
                      as a GEMM operand (16-bit there); on the cpu the logits, in place */
    int head_rows; /* tokens per LM-head chunk (the logits never exist for all N at once) */
    real *rope_cos, *rope_sin; /* (T, Hd/2), computed once */

    /* backward scratch, reused across layers */
    real *dres, *dh, *dq, *dk, *dv, *datt; /* (N, D) */
    real *dqkv;                            /* (N, 3 D): [dq | dk | dv] rotated back */
    real *dfa, *dfb, *dfh;                 /* (N, max(Fd, Fs)) */
    real *dxperm, *deout;                  /* (Mmax, D) */
    real *dea, *deb, *deh;                 /* (Mmax, F) */
    real *dyrecv;                          /* (Rmax, D) */
    real *dlw;                             /* (Rmax, K) */
    real *dw, *dprobs, *drlogits;          /* (N, K), (N, E), (N, E) */
    char *send_buf, *recv_buf;             /* packed exchange rows: max(rows) * row_bytes */
    size_t row_bytes;                      /* D reals + K reals + K int32, 8-aligned */
    int row_x16;                           /* the token part of dispatch rows (ops.h MOE_ROW_*) */
    int qkv16;             /* q, k, v, att and their gradients marked as 16-bit (mark_operands) */
    size_t dispatch_bytes; /* a dispatch row: moe_dispatch_row_bytes(D, K, row_x16) */
    int Rmax, Mmax;        /* rows received / expert rows, worst case */
    int *route_scratch;    /* (Rmax*K + E + 1) */
    size_t *xc_size;       /* (4*ep): byte counts and displacements of the exchange starting
                              (comm reads them when it starts, so the chunks share them) */
    int64_t *xc_count;     /* (2*ep*(1+El)): rows, then per local expert, sent and received */
    int32_t *src_row_token, *src_row_slot; /* (N*K) */
    int64_t *layer_counts; /* (L, E): top-k assignments per expert in this micro-batch */
    double *aux_psum;      /* (L, E): the router's probability sums in this micro-batch */
    double *aux_part;      /* router_aux_part_len(N, E): the router's partials */
    double *ce_acc;        /* (1) backend memory: the sum of token cross-entropies of the forwards
                              since it was last zeroed (moe_model_take_ce, or the trainer, which
                              fetches and zeroes it itself once per step) */

    int64_t *load;    /* (L, E): assignments per expert since the last reset */
    void *act_base;   /* the one backend block all activations are carved from */
    void *host_base;  /* the one host block for what the host reads */
    void *fetch_base; /* backend host memory (pinned): the chunks' aux_host, pack_counts,
                       * tokens_h */
} moe_model;

/* Lays out the tensors for cfg on this rank (its experts: those the placement gives
 * its place in the EP group of `comm`; contiguous blocks by default), allocates every
 * buffer (micro-batch of cfg->micro_batch sequences; exchange buffers for the worst
 * case of dropless routing), and initialises the weights from cfg->seed. The weights of
 * a tensor (and of each expert) depend only on its global name and the seed, not on the
 * rank or ep. comm NULL: one process, cfg->ep must be 1. be: the backend (NULL: cpu);
 * params, grads and activations live in its memory. On failure *out is NULL. */
moe_status moe_model_create(moe_model **out, const moe_config *cfg, struct moe_comm *comm,
                            const struct moe_backend *be);

/* Destroying NULL does nothing. */
void moe_model_destroy(moe_model *m);

/* Sets the placement: expert_rank (L, E), the EP rank of each expert of each MoE layer
 * (rows of dense layers are ignored). Every rank must get El experts of each MoE layer.
 * Moves no weights: for a fresh model, or before loading a checkpoint. */
moe_status moe_model_set_placement(moe_model *m, const int *expert_rank);

/* Collective over the EP group: moves every expert's slice of the parameters and of the
 * n_extra (at most 7) arenas laid out like them, of extra_elem[i] bytes per element (Adam
 * m and v, fp32 or bf16) to its rank under expert_rank (L, E), then sets the placement.
 * Gradients are not moved (they are zero between steps). */
moe_status moe_model_move_experts(moe_model *m, const int *expert_rank, void **extra,
                                  const size_t *extra_elem, int n_extra);

/* Collects routing statistics into s from now on (NULL: stop). Forward counts on the
 * backend (device-side counters on a GPU: no copy, no synchronisation per step);
 * moe_model_routing_collect adds them into s and zeroes them. */
/* Phase timing (m->timing): begin waits for the backend and returns the clock; end waits
 * again and adds the time since t0 to the phase. Without timing both do nothing. */
double moe_model_phase_begin(moe_model *m);
void moe_model_phase_end(moe_model *m, double t0, moe_phase phase);

moe_status moe_model_attach_routing(moe_model *m, struct moe_routing_stats *s);
moe_status moe_model_routing_collect(moe_model *m);

/* The placement of layer l: expert -> EP rank (E), and this rank's experts (El). */
static inline const int *moe_model_expert_rank(const moe_model *m, int l)
{
    return m->expert_rank + (size_t)l * m->E;
}
static inline const int *moe_model_local_experts(const moe_model *m, int l)
{
    return m->local_experts + (size_t)l * m->El;
}

/* Forward of one micro-batch. tokens: (B, T+1), inputs are [:, :T], targets [:, 1:].
 * Fills stats with this micro-batch's sums that the host knows (the router's, from the
 * counts' wait) and adds the sum of its token cross-entropies into m->ce_acc on the
 * backend, without waiting for it. Collective over the EP group. */
moe_status moe_model_forward(moe_model *m, const int32_t *tokens, moe_fwd_stats *stats);

/* Waits for the backend and takes m->ce_acc: the sum of token cross-entropies of the
 * forwards since the last take (then zeroes it). */
moe_status moe_model_take_ce(moe_model *m, double *ce_sum);

/* Backward of the last forward, accumulating into m->grads the gradient of the step
 * loss (see the top of this file), times m->loss_scale, for a step of `step_sequences`
 * sequences in all. After moe_model_fresh_grads, the gradients are written instead,
 * whatever they held, but for those of moe_model_added_grads.
 * Collective over the EP group (token exchanges). Calls m->grad_ready after each
 * stage when set. */
moe_status moe_model_backward(moe_model *m, int64_t step_sequences);

/* The next forward also runs the LM head's backward (cross-entropy gradient, dh and the
 * head's weight gradient) for a step of step_sequences sequences, while each chunk of
 * logits is still in memory, so the backward need not compute them again. The backward
 * that follows must be for the same step_sequences. Gradients are identical either way. */
void moe_model_fuse_head(moe_model *m, int64_t step_sequences);

/* The next backward (with the LM head's part in the forward before it, where fused) is a
 * step's first: it writes the gradients (its first chunk's weight-gradient GEMMs and
 * norms overwrite, empty experts' slices are zeroed), all but those of
 * moe_model_added_grads, which the caller must zero. Later backwards add, as before. */
void moe_model_fresh_grads(moe_model *m);
/* The gradients [*lo, *hi) of m->grads that a backward only adds to, the fresh one too:
 * the embedding table's (a scatter of the tokens' rows, rows of absent tokens untouched).
 * They lie within the dense ones [0, n_dense). */
void moe_model_added_grads(const moe_model *m, size_t *lo, size_t *hi);
/* The host waited until the backend's queue passed `mark` (queue_wait): the forward's
 * copies of the tokens queued before it have left the host's staging, which the next
 * forward then rewrites without a wait of its own. */
void moe_model_waited(moe_model *m, long mark);

/* The GEMM precision the backend runs: in bf16 / fp16 the dispatch rows carry the token
 * in that 16-bit form (ops.h MOE_ROW_*), half the bytes, the same bits as the experts'
 * GEMM operand it becomes. */
void moe_model_set_precision(moe_model *m, int p); /* a moe_precision (kernels/backend.h) */

/* The logits (N, V) of the last forward, recomputed chunk by chunk into host memory. */
moe_status moe_model_logits(moe_model *m, real *host);

/* Index of the tensor named `name`, or -1. */
int moe_model_find_tensor(const moe_model *m, const char *name);

#endif
