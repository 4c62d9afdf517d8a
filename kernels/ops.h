/* kernels/ops.h: every numeric op of the model, one declaration each.
 *
 * The CPU reference (kernels/<op>.c, plain loops, `real` = float, or double for the
 * finite-difference tests) and, later, the CUDA version implement these same
 * declarations. Kernels see pointers, counts and sizes; nothing of the model, the
 * config, MPI or the runtime. They cannot fail on valid arguments and return nothing;
 * callers (runtime/) validate shapes once, at start.
 *
 * Dimension letters:
 *   N tokens (rows), D d_model, F hidden width of an FFN/expert, E experts,
 *   K top-k, V vocabulary, B sequences, T sequence length, H heads, Hd head dim,
 *   M routed rows (token-expert assignments kept), I/O in/out features of a linear.
 *
 * Conventions:
 *   - Matrices are row-major. A linear layer's weight is (O, I), PyTorch's layout:
 *     out = x W^T.
 *   - Backward functions ACCUMULATE (+=) into every gradient they produce (inputs and
 *     parameters), so residual branches add up without extra copies; the caller zeros
 *     gradients once per step. A NULL gradient pointer means "not needed". Two say that
 *     they overwrite instead (cross_entropy_backward, swiglu_backward): their outputs
 *     are scratch that nothing else adds to, so zeroing them would be wasted traffic.
 *   - Activations of a batch of B sequences of length T are (B*T, D), token-major.
 */
#ifndef MOE_KERNELS_OPS_H
#define MOE_KERNELS_OPS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/real.h"

/* A function the host and CUDA device code both call. */
#ifdef __CUDACC__
#define MOE_HD __host__ __device__
#else
#define MOE_HD
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- embedding ---------------------------------------------------------------- */
/* out (N,D) = table[tokens[n]] ; table (V,D). */
void embedding_forward(real *out, const int32_t *tokens, const real *table, int N, int D);
/* dtable (V,D) += scatter of dout (N,D) by tokens, each in [0, V) (the data reader checks
 * them; V bounds the device's sort of the tokens). */
void embedding_backward(real *dtable, const real *dout, const int32_t *tokens, int N, int D, int V);

/* ---- elementwise ---------------------------------------------------------------- */
/* y[i] += x[i] for i < n. */
void add_inplace(real *y, const real *x, size_t n);

/* ---- RMSNorm: out = x / sqrt(mean(x^2) + eps) * weight ------------------------ */
/* out (N,D), rstd (N) saved for backward, x (N,D), weight (D). */
void rmsnorm_forward(real *out, real *rstd, const real *x, const real *weight, int N, int D,
                     real eps);
/* dx (N,D) +=, dweight (D) +=; either may be NULL. write (the flags MOE_WRITE_DX,
 * MOE_WRITE_DW below): that gradient is written, not added to (its contents before are
 * ignored: the final norm's dx, a step's first dweight). dx_op (N,D), may be NULL (and is
 * where dx is): gets dx's final values as a GEMM operand, so a buffer marked as holding
 * 16-bit values (mark_operand) gets them rounded, as a GEMM would round dx, and any other
 * buffer a copy (the residual gradient, read next by the attention's output projection:
 * no separate rounding pass over it). */
void rmsnorm_backward(real *dx, real *dweight, const real *dout, const real *x, const real *weight,
                      const real *rstd, int N, int D, int write, real *dx_op);

/* ---- linear: out (N,O) = x (N,I) W^T, W (O,I) -------------------------------------- */
void matmul_forward(real *out, const real *x, const real *w, int N, int I, int O);
/* count products of one input: out + c * out_stride (N,O) = x W_c^T with W_c = w + c*O*I
 * (weights one after another: the q, k, v projections), c < count. */
void matmul_forward_batch(real *out, size_t out_stride, const real *x, const real *w, int count,
                          int N, int I, int O);
/* out (N,O) = base (N,O) + x W^T (a residual added as the product is written; base may be
 * out): the sum of the fp32 product and base, rounded once. */
void matmul_forward_add(real *out, const real *base, const real *x, const real *w, int N, int I,
                        int O);
/* dx (N,I) += dout W ; dw (O,I) += dout^T x. Either may be NULL. write (the flags
 * MOE_WRITE_DX, MOE_WRITE_DW below): that gradient is written, not added to (its contents
 * before are ignored). */
void matmul_backward(real *dx, real *dw, const real *dout, const real *x, const real *w, int N,
                     int I, int O, int write);

/* ---- grouped linear: rows offsets[g]..offsets[g+1] of x use weight g ------------- */
/* x (M,I), w (G,O,I), out (M,O); offsets (G+1), offsets[0] = 0, offsets[G] = M.
 * Groups with no rows are skipped (their weight gradient stays untouched). The backward
 * adds to dx and dw, except where `write` says (flags): MOE_WRITE_DW, dw is written, not
 * added to (its contents before are ignored, an empty group's slice is zeroed: the first
 * contribution to a gradient in a step); MOE_WRITE_DX, dx (M,I) likewise (every row
 * belongs to a group). */
#define MOE_WRITE_DW 1
#define MOE_WRITE_DX 2
void grouped_matmul_forward(real *out, const real *x, const real *w, const int *offsets, int G,
                            int I, int O);
void grouped_matmul_backward(real *dx, real *dw, const real *dout, const real *x, const real *w,
                             const int *offsets, int G, int I, int O, int write);
/* Two grouped linears of the same x (the experts' gate and up projections): the same as
 * grouped_matmul_forward(out_a, x, wa, ...) then grouped_matmul_forward(out_b, x, wb, ...).
 * A backend may run each group's two products as one batched GEMM. */
void grouped_matmul_forward_pair(real *out_a, real *out_b, const real *x, const real *wa,
                                 const real *wb, const int *offsets, int G, int I, int O);
/* The pair, then SwiGLU of its outputs: the same as grouped_matmul_forward_pair(out_a,
 * out_b, x, wa, wb, ...) then swiglu_forward(h, out_a, out_b, offsets[G] * O) (the
 * experts' forward up to the down projection). A backend may compute h where the
 * products end (a GEMM's epilogue). */
void grouped_matmul_forward_pair_swiglu(real *h, real *out_a, real *out_b, const real *x,
                                        const real *wa, const real *wb, const int *offsets, int G,
                                        int I, int O);
/* Their backward: the same as grouped_matmul_backward(dx, dwa, dout_a, x, wa, ..., write)
 * then grouped_matmul_backward(dx, dwb, dout_b, x, wb, ..., write & ~MOE_WRITE_DX):
 * dx gets both products, dwa and dwb one each. A backend may sum dx's two products as
 * one (CUDA's wgmma kernel: one sum, one store), so its roundings may differ. */
void grouped_matmul_backward_pair(real *dx, real *dwa, real *dwb, const real *dout_a,
                                  const real *dout_b, const real *x, const real *wa, const real *wb,
                                  const int *offsets, int G, int I, int O, int write);

/* ---- SwiGLU: h = silu(a) * b, silu(a) = a * sigmoid(a) ---------------------------- */
/* a, b, h: n elements each (a gate, b up projection). */
void swiglu_forward(real *h, const real *a, const real *b, size_t n);
/* da =, db = (OVERWRITES, unlike most backward functions: its two callers would only
 * zero them first; either may be NULL). */
void swiglu_backward(real *da, real *db, const real *dh, const real *a, const real *b, size_t n);

/* ---- rotary position embedding (half rotation, as Llama/Mixtral in transformers) --- */
/* cos, sin: (T, Hd/2), cos[t][i] = cos(t * theta^(-2i/Hd)). Computed once per T. */
void rope_tables(real *cos_t, real *sin_t, int T, int Hd, double theta);
/* x (B*T, H*Hd) in place: for each head, pairs (i, i + Hd/2) rotate by angle t*f_i. */
void rope_forward(real *x, const real *cos_t, const real *sin_t, int B, int T, int H, int Hd);
/* dx in place: the inverse rotation (rope is orthogonal), so pass the gradient of the
 * rotated output and it becomes the gradient of the input (the one backward that
 * transforms its gradient in place instead of accumulating). */
void rope_backward(real *dx, const real *cos_t, const real *sin_t, int B, int T, int H, int Hd);
/* The attention's input gradients side by side, for one GEMM over [q | k | v] (its
 * weights wq, wk, wv lie one after another): row r of dqkv (B*T, 3*H*Hd) is dq's row r
 * rotated back as rope_backward does, then dk's likewise, then dv's as it is. dq, dk, dv
 * are read only; dqkv may not overlap them. */
void rope_backward_qkv(real *dqkv, const real *dq, const real *dk, const real *dv,
                       const real *cos_t, const real *sin_t, int B, int T, int H, int Hd);

/* ---- causal multi-head attention ---------------------------------------------------- */
/* q, k, v, out: (B*T, H*Hd). lse (B, H, T): log-sum-exp of each query's scaled scores,
 * saved for backward (which recomputes the probabilities, as a fused kernel does).
 * scale = 1/sqrt(Hd). */
void attention_forward(real *out, real *lse, const real *q, const real *k, const real *v, int B,
                       int T, int H, int Hd);
/* dq, dk, dv = (OVERWRITES, as swiglu_backward: its caller would only zero them first,
 * and the kernels then need not read them); any may be NULL. */
void attention_backward(real *dq, real *dk, real *dv, const real *dout, const real *out,
                        const real *lse, const real *q, const real *k, const real *v, int B, int T,
                        int H, int Hd);
/* attention_backward into dq, dk, dv, then rope_backward_qkv of them into dqkv (B*T,
 * 3*H*Hd): the projections' one GEMM operand. dqkv's values are the two ops'; dq, dk, dv
 * are the op's scratch, their contents afterwards unspecified (a backend may write dqkv
 * straight from the attention's sums, as the CUDA one does on sm_90 for Hd = 64). */
void attention_backward_qkv(real *dqkv, real *dq, real *dk, real *dv, const real *dout,
                            const real *out, const real *lse, const real *q, const real *k,
                            const real *v, const real *cos_t, const real *sin_t, int B, int T,
                            int H, int Hd);

/* ---- router ------------------------------------------------------------------------- */
/* From fp32 logits (N,E): probs (N,E) = softmax, lse (N) = logsumexp(logits), and the
 * top-k: idx (N,K) experts in order of decreasing probability (ties: lower index first),
 * w (N,K) their probabilities, divided by their sum when renorm != 0. */
void router_forward(real *probs, real *lse, int32_t *idx, real *w, double *aux_part,
                    const real *logits, int N, int E, int K, int renorm);
/* Gradient of the top-k weights dw (N,K) into dprobs (N,E) +=. */
void router_topk_backward(real *dprobs, const real *dw, const real *probs, const int32_t *idx,
                          int N, int E, int K, int renorm);
/* dlogits (N,E) += softmax backward of dprobs. */
void softmax_backward(real *dlogits, const real *dprobs, const real *probs, int N, int E);

/* The auxiliary losses' partial sums, written by router_forward into aux_part (skipped
 * when NULL) in the same pass: per chunk of MOE_AUX_CHUNK consecutive rows, E top-k
 * assignment counts (before capacity drops, as doubles: exact), E sums of probs and the
 * sum of lse^2, i.e. router_aux_part_len(N, E) doubles. router_aux_partials adds the
 * chunks in order: counts (E) +=, psum (E) +=, and returns the sum of lse^2.
 * The losses, once partials are summed over ranks (global token count Ng):
 *   aux = E * sum_e (counts_e / (Ng*K)) * (psum_e / Ng)
 *   z   = (sum lse^2) / Ng */
#define MOE_AUX_CHUNK 64
static inline size_t router_aux_part_len(int N, int E)
{
    return N > 0 ? (size_t)((N + MOE_AUX_CHUNK - 1) / MOE_AUX_CHUNK) * (2 * (size_t)E + 1) : 0;
}
double router_aux_partials(int64_t *counts, double *psum, const double *aux_part, int N, int E);
/* Gradients of coef_aux*aux + coef_z*z given the global partials:
 * dprobs (N,E) += coef_aux * E * counts_e / (Ng*K) / Ng ;
 * dlogits (N,E) += coef_z * 2 * lse_n / Ng * probs (the z-loss term). */
void router_aux_backward(real *dprobs, real *dlogits, const real *probs, const real *lse,
                         const int64_t *counts, int64_t Ng, int N, int E, int K, double coef_aux,
                         double coef_z);
/* The router's backward in one: dlogits (N,E) = (written, not added to) the gradient of
 * the logits from that of the top-k weights dw (N,K) and the aux and z terms. The same as
 * zeroing dprobs and dlogits, then router_topk_backward(dprobs, dw, probs, idx, ...),
 * router_aux_backward(dprobs, dlogits, probs, lse, counts, ...) and
 * softmax_backward(dlogits, dprobs, probs, ...). dprobs (N,E): scratch (a backend may
 * leave it untouched; its contents after are unspecified). counts: host memory. */
void router_backward(real *dlogits, real *dprobs, const real *dw, const real *probs,
                     const int32_t *idx, const real *lse, const int64_t *counts, int64_t Ng, int N,
                     int E, int K, int renorm, double coef_aux, double coef_z);

/* ---- routing plan: which (token, slot) goes to which expert row ------------- */
/* Orders the N*K assignments stably by expert (then token, then slot) and applies the
 * capacity. Capacity is per group of `group` consecutive tokens (N % group == 0; the
 * runtime uses one group: the rank's micro-batch, as Megatron-Core). capacity < 0: dropless. When
 * an expert has more than `capacity` assignments within a group, it keeps those with the highest
 * weight (ties: lower token index, then lower slot) and drops the rest; a dropped
 * assignment contributes nothing to its token's output.
 * Outputs: offsets (E+1) row ranges per expert over the M kept rows,
 * row_token (N*K) and row_slot (N*K) for rows 0..M-1, slot_row (N*K): the row of each
 * (token, slot) or -1 if dropped. A negative expert id in idx means "no assignment
 * here" (the experts' side of an exchange marks slots held by other ranks so): such a
 * slot is never a row and its slot_row is -1. Returns M. scratch: N*K ints.
 * offsets NULL: the plan stays on the backend (no synchronisation on a GPU) and the
 * return value is -1; the caller knows the counts otherwise (the source side from
 * moe_pack_dispatch, the experts' side from the exchanged counts). scratch then needs
 * N*K + E + 1 ints. */
int moe_route_plan(int *offsets, int32_t *row_token, int32_t *row_slot, int32_t *slot_row,
                   int *scratch, const int32_t *idx, const real *w, int N, int E, int K, int group,
                   int capacity);

/* out (M,D) = x[row_token[m]] (gather tokens into expert order). */
void moe_permute(real *out, const real *x, const int32_t *row_token, int M, int D);
/* dx (N,D) = base + scatter of dout (M,D): base's row (0 where base is NULL; base may be
 * dx itself: the rows are added to it), then the rows of the token added in row order,
 * then last's row (last (N,D), optional: NULL adds nothing; not dx). So at ep > 1 a
 * layer's output is (shared experts + its returned rows) + xmid in one pass, the
 * additions of ep 1's xmid + (its one row). slot_row (N,K), optional (NULL: not known):
 * the inverse of row_token, the row of each (token, slot) or -1, every row once; it lets
 * a backend gather each token's rows instead of sorting the rows by token (the same
 * sums). Without it K is not read; N is read where base is not dx or last is given. */
void moe_permute_backward(real *dx, const real *base, const real *dout, const int32_t *row_token,
                          int M, int D, const int32_t *slot_row, int N, int K, const real *last);
/* Not an op: the reference's start of those sums, dx (n,D) = base (0 where base is NULL),
 * nothing where base is dx. */
void moe_rows_base(real *dx, const real *base, int n, int D);

/* y (N,D) = base + sum over kept rows of w[token, slot] * expert_out[row], in row order
 * (base as for moe_permute_backward); slot_row (N,K) optional, as there. */
void moe_combine_forward(real *y, const real *base, const real *expert_out, const real *w,
                         const int32_t *row_token, const int32_t *row_slot, int M, int D, int K,
                         const int32_t *slot_row, int N);
/* dexpert_out (M,D) = w * dy[token] (OVERWRITES: each row is one product, and its caller
 * would only zero it first); dw (N,K) += <dy[token], expert_out[row]>. */
void moe_combine_backward(real *dexpert_out, real *dw, const real *dy, const real *expert_out,
                          const real *w, const int32_t *row_token, const int32_t *row_slot, int M,
                          int D, int K);

/* ---- routing statistics (the expert scheduler's counters) ----------------------------
 * Adds N tokens of one MoE layer to its counters (sched/stats.h): for each token whose
 * ids idx (N,K) hold at least one id >= 0, with X its distinct ids >= 0: tokens += 1,
 * load[x] += 1 and coact[x*E + y] += 1 for x != y in X; when prev_idx (N,K) is given
 * (the same tokens in the previous MoE layer, distinct ids Y): trans[y*E + x] += 1.
 * Ids < 0 are ignored, ids must be < E, K <= MOE_ROUTE_STATS_MAX_K. Integer counts: the
 * same on every backend whatever the order of the additions. */
#define MOE_ROUTE_STATS_MAX_K 64
void routing_stats_count(int64_t *tokens, int64_t *load, int64_t *coact, int64_t *trans,
                         const int32_t *idx, const int32_t *prev_idx, int N, int E, int K);

/* ---- packing rows for the exchange between ranks --------------------------------- */
/* Row layout of a dispatch row (row_bytes bytes, row_bytes >= moe_dispatch_row_bytes(D,
 * K, x16)): the token, D reals (x16 MOE_ROW_FP32) or D 16-bit values (MOE_ROW_BF16,
 * MOE_ROW_FP16: rounded to nearest even, padded to 4 bytes); then K reals (the weight of
 * each slot whose expert is on the destination, else 0) and K int32 (that expert's local
 * id there, else -1). The 16-bit forms carry exactly what a 16-bit GEMM precision reads
 * of the experts' input (its operand is the same rounding of the same value), in half
 * the bytes.
 *
 * Builds one row per (token n, destination p) such that some kept slot of n (slot_row
 * >= 0) has its expert on p (expert_rank[e] == p), grouped by p in order, tokens in
 * order within a p. send_token (rows): the token of each row; token_rows (N,P), when not
 * NULL: its inverse, the row of each (token, destination) or -1 (the slot_row of
 * moe_permute_backward and moe_scatter_grad_rows for these rows, with K = P).
 * expert_rank/expert_local:
 * (E), local ids < El. The counts go to host memory, counts[MOE_PACK_COUNTS(P, El)]:
 *   [0, P)            rows per destination (send_rows)
 *   [P, 2P)           kept assignments per destination (what sending a token once saves;
 *                     their sum is the kept count M)
 *   [2P]              rows in all
 *   [2P+1, 2P+1+P*El) kept assignments per destination and local expert there (the
 *                     destination's routing-plan offsets)
 * rows NULL: the counts, send_token and token_rows alone (x, w, row_bytes and x16 not
 * read; at ep 1 the experts may take the tokens themselves).
 * The cpu writes them before returning. A GPU backend does not wait: counts must be host
 * memory from its alloc_host, and they land with the queue (read them after a
 * queue_wait on a later mark, or sync), so the host can queue more work before it needs
 * them. */
#define MOE_PACK_COUNTS(P, El) (2 * (P) + 1 + (P) * (El))
enum { MOE_ROW_FP32 = 0, MOE_ROW_BF16 = 1, MOE_ROW_FP16 = 2 };
/* Bytes of the token part of a dispatch row, and of the whole row (a multiple of 8). */
MOE_HD static inline size_t moe_dispatch_token_bytes(int D, int x16)
{
    return x16 == MOE_ROW_FP32 ? sizeof(real) * (size_t)D : ((size_t)D * 2 + 3) & ~(size_t)3;
}
MOE_HD static inline size_t moe_dispatch_row_bytes(int D, int K, int x16)
{
    return (moe_dispatch_token_bytes(D, x16) + (size_t)K * (sizeof(real) + sizeof(int32_t)) + 7) &
           ~(size_t)7;
}
void moe_pack_dispatch(char *rows, int32_t *send_token, int32_t *token_rows, int *counts,
                       const real *x, const int32_t *idx, const real *w, const int32_t *slot_row,
                       const int32_t *expert_rank, const int32_t *expert_local, int N, int D, int K,
                       int P, int El, size_t row_bytes, int x16);
/* Splits R dispatch rows into x (R,D) (16-bit tokens widened, exactly; a backend keeps
 * them in 16 bits where x is marked, backend.h mark_operand), w (R,K), lidx (R,K). x
 * NULL: the weights and ids only (moe_permute_rows then reads the tokens). */
void moe_unpack_dispatch(real *x, real *w, int32_t *lidx, const char *rows, int R, int D, int K,
                         size_t row_bytes, int x16);
/* out (M,D) = the token of dispatch row row_token[m] (rows of row_bytes in format x16, as
 * moe_unpack_dispatch reads them; 16-bit tokens widened, exactly, and kept in 16 bits
 * where out is marked): moe_unpack_dispatch's x then moe_permute, without that x. */
void moe_permute_rows(real *out, const char *rows, size_t row_bytes, int x16,
                      const int32_t *row_token, int M, int D);
/* The gradient rows sent back, rows (R, D+K) = [dx | dw] row by row, where dx (R, D) is
 * the sum of each received row's expert rows: the rows m of dout (M, D) with
 * row_token[m] == r added in row order (0 where none), what moe_permute_backward(dx,
 * NULL, dout, row_token, M, D, slot_row, R, K, NULL) writes, without dx in memory.
 * slot_row (R, K), optional: as for moe_permute_backward. */
void moe_pack_grad_rows(real *rows, const real *dout, const int32_t *row_token, int M,
                        const int32_t *slot_row, const real *dw, int R, int D, int K);
/* dx (N,D) = base + the dx parts and dw (N,K) = the dw parts of rows (n, D+K) (written:
 * 0 for a token without rows), row r for token send_token[r] (several rows may name one
 * token), a token's rows in row order; base as for moe_permute_backward. token_rows
 * (N,P), optional (NULL: not known; then P is not read): the inverse of send_token from
 * moe_pack_dispatch, which lets a backend gather each token's rows instead of sorting
 * the rows by token (the same sums). */
void moe_scatter_grad_rows(real *dx, real *dw, const real *base, const real *rows,
                           const int32_t *send_token, int n, int D, int K,
                           const int32_t *token_rows, int N, int P);

/* ---- loss ----------------------------------------------------------------------------- */
/* losses (N) = lse_n - logits[n, targets[n]], lse (N) saved. logits (N,V). */
void cross_entropy_forward(real *losses, real *lse, const real *logits, const int32_t *targets,
                           int N, int V);
/* dlogits (N,V) = dloss * (softmax(logits) - onehot(target)), softmax from the saved lse;
 * dloss is the same scale for every token (1/(tokens in the global batch)). Overwrites
 * dlogits (it does not accumulate); dlogits may be logits (in place). */
void cross_entropy_backward(real *dlogits, const real *logits, const real *lse,
                            const int32_t *targets, real dloss, int N, int V);
/* cross_entropy_forward, then cross_entropy_backward from the lse it saved, over the
 * same rows in one op (where the backward follows at once: the fused LM head): the same
 * losses, lse and dlogits, bit for bit. dlogits must not be logits (a backend may read
 * each row twice). */
void cross_entropy_fused(real *losses, real *lse, real *dlogits, const real *logits,
                         const int32_t *targets, real dloss, int N, int V);

/* ---- optimizer ------------------------------------------------------------------------ */
/* Sum of x (n), accumulated in double. */
double sum_values(const real *x, size_t n);
/* Sum of squares of x (n), accumulated in double. */
double sum_squares(const real *x, size_t n);
/* *acc += the sum of x (n) (square 0) or of its squares (square 1), in double, in
 * the backend's memory: no value returns to the host (the same additions as adding
 * sum_values / sum_squares on the host in the same order). */
void sum_into(double *acc, const real *x, size_t n, int square);
/* x *= s. */
void scale_inplace(real *x, real s, size_t n);
/* 1 if every element is finite. */
int all_finite(const real *x, size_t n);
/* One AdamW step (decoupled weight decay: p -= lr*wd*p) with bias correction for
 * step t (t >= 1). m, v: first and second moments, updated in place. */
void adamw_update(real *p, const real *g, real *m, real *v, size_t n, real lr, real beta1,
                  real beta2, real eps, real wd, int t);
/* The factor every gradient is multiplied by before AdamW, from the sums of squares of
 * the gradients sq[0] + sq[1] (they carry the loss scale): with the global norm
 * norm = sqrt(sq[0] + sq[1]) / loss_scale, min(1, clip / norm) / loss_scale (clip 0: no
 * clipping), rounded to float. -1 when the norm is not finite: the step is skipped. The
 * same function on the host and on the device, so both decide alike. */
MOE_HD static inline double moe_adamw_factor(const double *sq, double clip, double loss_scale)
{
    const double norm = sqrt(sq[0] + sq[1]) / loss_scale;
    if (!isfinite(norm))
        return -1.0;
    const double c = clip <= 0 || norm <= clip ? 1.0 : clip / norm;
    return (double)(float)(c / loss_scale);
}

/* AdamW's constants for step t, computed once on the host (in double, then rounded to
 * `real`): b1, 1 - b1, b2, 1 - b2, lr / (1 - b1^t), sqrt(1 - b2^t), lr and eps. */
typedef struct {
    real b1, omb1, b2, omb2, step, sqrt_bc2, lr, eps;
} moe_adamw_consts;

static inline moe_adamw_consts moe_adamw_setup(real lr, real beta1, real beta2, real eps, int t)
{
    const double b1 = beta1, b2 = beta2;
    const moe_adamw_consts c = {beta1,
                                (real)(1.0 - b1),
                                beta2,
                                (real)(1.0 - b2),
                                (real)((double)lr / (1.0 - pow(b1, t))),
                                (real)sqrt(1.0 - pow(b2, t)),
                                lr,
                                eps};
    return c;
}

/* fma of `real` (fmaf for float): the host and the device round alike only where the
 * step says which products fuse, since CUDA fuses a*b + c on its own and the host does
 * not. */
#ifdef MOE_REAL_DOUBLE
#define MOE_FMA fma
#define MOE_SQRT sqrt
#else
#define MOE_FMA fmaf
#define MOE_SQRT sqrtf
#endif

/* 1 - lr*wd, the decoupled weight decay's factor of a tensor. */
MOE_HD static inline real moe_adamw_decay(const moe_adamw_consts *c, real wd)
{
    return MOE_FMA(-c->lr, wd, (real)1);
}

/* One element of the step, in `real` (float) arithmetic as torch.optim.AdamW's: g is
 * multiplied by scale (moe_adamw_factor), m and v are updated in place, and the new
 * parameter is returned: p*decay - step * m / (sqrt(v)/sqrt_bc2 + eps). Every fused
 * product is an explicit MOE_FMA and nothing else is a multiply feeding an add, so the
 * host and the device give the same bits. */
MOE_HD static inline real moe_adamw_elem(real p, real g, real *m, real *v, real decay, real scale,
                                         const moe_adamw_consts *c)
{
    const real gi = g * scale;
    const real mi = MOE_FMA(c->b1, *m, c->omb1 * gi);
    const real vi = MOE_FMA(c->b2, *v, (c->omb2 * gi) * gi);
    *m = mi;
    *v = vi;
    const real denom = MOE_SQRT(vi) / c->sqrt_bc2 + c->eps;
    return MOE_FMA(-c->step, mi / denom, p * decay);
}

/* bf16 of a float, rounded to nearest even (a NaN stays a NaN), and back (exact): the
 * optimizer's moments in bf16, the same bits on the host and the device. */
MOE_HD static inline uint16_t moe_bf16_round(float f)
{
    union {
        float f;
        uint32_t u;
    } c = {f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((c.u >> 16) | 0x40u);
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

MOE_HD static inline float moe_bf16_widen(uint16_t b)
{
    union {
        uint32_t u;
        float f;
    } c = {(uint32_t)b << 16};
    return c.f;
}

/* IEEE half of a float, rounded to nearest even (overflow to infinity, subnormals kept, a
 * NaN stays a NaN), and back (exact): the host's form of what the device's
 * __float2half_rn and __half2float do (tests/gpu compares them bit for bit). */
MOE_HD static inline uint16_t moe_fp16_round(float f)
{
    union {
        float f;
        uint32_t u;
    } c = {f};
    const uint32_t sign = (c.u >> 16) & 0x8000u, a = c.u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN */
        return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) /* 65520 and up round to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) { /* a normal half (2^-14 and up): rebias, round 13 bits off */
        const uint32_t r = a - 0x38000000u;
        return (uint16_t)(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
    }
    if (a < 0x33000000u) /* below 2^-25: zero */
        return (uint16_t)sign;
    /* a subnormal half: the value in units of 2^-24 is mant * 2^(e - 126), e <= 112 */
    const uint32_t e = a >> 23, mant = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u)))
        q++; /* may carry into the smallest normal, which is its right encoding */
    return (uint16_t)(sign | q);
}

MOE_HD static inline float moe_fp16_widen(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    union {
        uint32_t u;
        float f;
    } c;
    if (e == 31)
        c.u = sign | 0x7f800000u | (m << 13);
    else if (e != 0)
        c.u = sign | ((e + 112u) << 23) | (m << 13);
    else { /* zero or subnormal: m * 2^-24, exact in a float */
        c.f = (float)m * 5.9604644775390625e-8f;
        c.u |= sign;
    }
    return c.f;
}

/* The same step over a whole arena of n elements in one pass (multi-tensor): segment s
 * is the range [offsets[s], offsets[s+1]) with weight decay wd[s], offsets[0] = 0 and
 * offsets[n_segs] = n; every gradient is multiplied by moe_adamw_factor(norm_sq, clip,
 * loss_scale) first (clipping, removal of the loss scale), and when that says skip,
 * nothing changes. norm_sq NULL: the factor is 1 / loss_scale rounded to float (no
 * clipping, never skipped). offsets (n_segs + 1), wd (n_segs) and norm_sq (2) live in the
 * backend's memory: the decision needs no value on the host. m and v are real, or with
 * moments16 bf16 (uint16_t, moe_bf16_round): the step computes from their widened values
 * as from real ones and stores them rounded. sq_out (2 doubles in the backend's memory,
 * or NULL): overwritten with the sums of squares, in double, of the gradients as read
 * (before the factor), [0] of elements [0, n_split) and [1] of [n_split, n), 0 when the
 * step is skipped; the same sums as sum_into up to the order of the additions, without a
 * pass of their own where the backend fuses them (the gradient norm when nothing clips).
 * Only the elements [lo, hi) (lo <= hi <= n) are stepped, read and summed: the arena's
 * update in pieces (the trainer updates a layer while the backward goes on), every
 * element as the whole arena's pass steps it (the same bits, the same stochastic
 * rounding); segments, n_split and the bf16 master weights' start stay the arena's. */
void adamw_update_multi(real *p, const real *g, void *m, void *v, int moments16, size_t n,
                        size_t lo, size_t hi, const int64_t *offsets, const real *wd, int n_segs,
                        real lr, real beta1, real beta2, real eps, const double *norm_sq,
                        double clip, double loss_scale, int t, double *sq_out, size_t n_split);

#ifdef __cplusplus
}
#endif
#endif
