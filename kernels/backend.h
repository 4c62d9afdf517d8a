/* kernels/backend.h: a backend is a named table of every op of ops.h plus the memory
 * operations the runtime needs, chosen once at start ("cpu" or "cuda"). The runtime calls
 * ops only through the table, so one model and trainer run on either.
 *
 * Memory: buffers from alloc live where the backend computes (host for cpu, device for
 * cuda). Host memory is required where ops.h says so: moe_route_plan's offsets and
 * return value, grouped_matmul's offsets, router_aux_partials' counts and psum,
 * moe_pack_dispatch's counts (memory from alloc_host); every value an op returns
 * is on the host (the cuda backend synchronises to return it, which is why the runtime
 * asks for as few as it can: fetch queues a copy that a later return brings along). */
#ifndef MOE_KERNELS_BACKEND_H
#define MOE_KERNELS_BACKEND_H

#include <stddef.h>
#include <stdio.h>

#include "kernels/ops.h"
#include "util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every op of ops.h, for tables and for declaring a backend's implementations. */
#define MOE_OPS_LIST(X)                                                                            \
    X(embedding_forward)                                                                           \
    X(embedding_backward)                                                                          \
    X(add_inplace)                                                                                 \
    X(rmsnorm_forward)                                                                             \
    X(rmsnorm_backward)                                                                            \
    X(matmul_forward)                                                                              \
    X(matmul_forward_add)                                                                          \
    X(matmul_forward_batch)                                                                        \
    X(matmul_backward)                                                                             \
    X(grouped_matmul_forward)                                                                      \
    X(grouped_matmul_backward)                                                                     \
    X(grouped_matmul_forward_pair)                                                                 \
    X(grouped_matmul_forward_pair_swiglu)                                                          \
    X(grouped_matmul_backward_pair)                                                                \
    X(swiglu_forward)                                                                              \
    X(swiglu_backward)                                                                             \
    X(rope_tables)                                                                                 \
    X(rope_forward)                                                                                \
    X(rope_backward)                                                                               \
    X(rope_backward_qkv)                                                                           \
    X(attention_forward)                                                                           \
    X(attention_backward)                                                                          \
    X(attention_backward_qkv)                                                                      \
    X(router_forward)                                                                              \
    X(router_topk_backward)                                                                        \
    X(softmax_backward)                                                                            \
    X(router_aux_partials)                                                                         \
    X(router_aux_backward)                                                                         \
    X(router_backward)                                                                             \
    X(moe_route_plan)                                                                              \
    X(moe_permute)                                                                                 \
    X(moe_permute_rows)                                                                            \
    X(moe_permute_backward)                                                                        \
    X(moe_combine_forward)                                                                         \
    X(moe_combine_backward)                                                                        \
    X(routing_stats_count)                                                                         \
    X(moe_pack_dispatch)                                                                           \
    X(moe_unpack_dispatch)                                                                         \
    X(moe_pack_grad_rows)                                                                          \
    X(moe_scatter_grad_rows)                                                                       \
    X(cross_entropy_forward)                                                                       \
    X(cross_entropy_backward)                                                                      \
    X(cross_entropy_fused)                                                                         \
    X(sum_values)                                                                                  \
    X(sum_squares)                                                                                 \
    X(sum_into)                                                                                    \
    X(scale_inplace)                                                                               \
    X(all_finite)                                                                                  \
    X(adamw_update)                                                                                \
    X(adamw_update_multi)

typedef enum { MOE_COPY_H2D, MOE_COPY_D2H, MOE_COPY_D2D } moe_copy_kind;

/* Precision of the matrix products. fp32: everything fp32. bf16 / fp16: the operands of
 * every GEMM (matmul and grouped matmul, forward and backward) are rounded to 16 bits,
 * products accumulate in fp32 and outputs are fp32, except the outputs the model marks
 * as 16-bit (mark_operand; the list: docs/cuda.md, Precision); the master weights, the
 * optimizer state (unless [precision] optimizer_state = bf16), router logits, norms,
 * softmax statistics and all reductions stay fp32. */
typedef enum { MOE_PREC_FP32 = 0, MOE_PREC_BF16 = 1, MOE_PREC_FP16 = 2 } moe_precision;

typedef struct moe_backend {
    const char *name; /* "cpu", "cuda" */
    int on_device;    /* buffers are device memory */
    /* zeroed memory, or NULL */
    void *(*alloc)(size_t nbytes);
    /* freeing NULL does nothing */
    void (*release)(void *p);
    void (*zero)(void *p, size_t nbytes);
    void (*copy)(void *dst, const void *src, size_t nbytes, moe_copy_kind kind);
    /* waits for queued work; reports an asynchronous failure with its message */
    moe_status (*sync)(void);
    /* Host memory that fetch copies into without the host waiting (pinned for cuda),
     * zeroed, or NULL; release_host frees it (NULL does nothing). */
    void *(*alloc_host)(size_t nbytes);
    void (*release_host)(void *p);
    /* Queues a copy of nbytes of backend memory into host memory from alloc_host, after
     * the ops queued before it. The host may read it once a later op has returned a host
     * value (which waits for the queue) or sync has returned. */
    void (*fetch)(void *host, const void *src, size_t nbytes);
    /* A mark in the queue after the work queued so far; queue_wait(mark) waits until the
     * queue has passed it (copies to the host before it have landed), not for the work
     * queued after it; a later mark is never less than an earlier one, so a wait for it
     * passes those too. The cpu runs everything at once: marks are 0, waits return.
     * watch (may be NULL) is called with ctx now and then while the wait lasts, and a
     * failure it returns ends the wait with that failure: the queue may wait on other
     * streams (communication) that only their owner can time out (moe_comm_watch). */
    long (*queue_mark)(void);
    moe_status (*queue_wait)(long mark, moe_status (*watch)(void *ctx), void *ctx);
    /* Background lanes, for work that may run beside the queue's later work (the
     * trainer's AdamW over a layer whose gradients are final while the backward goes on,
     * or over the first layers while the next step's forward begins): background(1) or
     * background(2) makes the ops queued from then on run on that lane, after everything
     * queued on the queue so far; background(0) queues on the queue again, which does not
     * wait for them; background_join() makes the queue's later work (and so its marks,
     * syncs and fetches) wait for everything queued on both lanes so far.
     * background_mark(id), on a lane, marks the point it has reached (id in [0, 64); a
     * mark made again moves); background_await(id) makes the queue's later work wait for
     * that point only. Only adamw_update_multi and zero may be queued on a lane: they
     * use no scratch of the backend's. The cpu runs everything at once: these do nothing. */
    void (*background)(int lane);
    void (*background_join)(void);
    void (*background_mark)(int id);
    void (*background_await)(int id);
    /* the stream every op runs on (a cudaStream_t; NULL on the cpu), for NCCL */
    void *(*native_stream)(void);
    /* compute capability of the device, major*10 + minor (0 on the cpu) */
    int (*compute_capability)(void);
    /* Sets the GEMM precision. For bf16/fp16 the backend keeps a 16-bit shadow of the
     * parameter arena [params, params + n_params): a GEMM whose weight operand lies in the
     * arena reads the shadow; other operands (activations, gradients) are rounded into one
     * workspace of max_operand elements allocated here. The cpu backend takes fp32 only. */
    moe_status (*set_precision)(moe_precision p, const real *params, size_t n_params,
                                size_t max_operand);
    /* Re-rounds the shadow from the parameters: after every change of the parameters in
     * the arena (which then holds them all, bf16 master weights included). */
    moe_status (*refresh_shadow)(void);
    /* bf16 only ([precision] master_weights = bf16): from now on the parameters
     * [params + from, params + n_params) live in the shadow: adamw_update_multi over the
     * arena reads and writes them there (bf16 master weights, as the peer keeps), and
     * their fp32 copies in the arena are stale until sync_master. Fails on the cpu and
     * in any other precision. Set again after each set_precision. */
    moe_status (*master_in_shadow)(size_t from);
    /* bf16 master weights only (after master_in_shadow(from)): from now on the gradients
     * of those parameters, [grads + from, grads + n_params), live in a bf16 copy (as the
     * peer's bf16 parameters have bf16 gradients): the GEMMs write and add to them there
     * (an addition rounds to bf16 again), adamw_update_multi(params, grads, ...) reads
     * them there, and sum_into, sum_squares, sum_values and all_finite over them read
     * them there. Their fp32 copies in grads are never written; no other op may read
     * them (the trainer keeps fp32 gradients where they are reduced across ranks).
     * grads NULL: back to fp32 gradients. Set again after each set_precision (which
     * ends it). Fails on the cpu. */
    moe_status (*grads_in_shadow)(const real *grads);
    /* Makes the arena hold every parameter again, widening the bf16 master weights into
     * it (exact): before the host reads the arena or parameters are moved. Nothing to do
     * when nothing is stale. With bf16 gradients (grads_in_shadow) it also widens them
     * into their fp32 copies, for a reader on the host (dump). */
    moe_status (*sync_master)(void);
    /* Declares that the buffer p of n elements holds 16-bit values: in a 16-bit precision
     * its writers store the 16-bit value (the GEMM operand's rounding) into its first 2n
     * bytes instead of fp32, a GEMM given p (the whole buffer, as x or dout) reads it as
     * is instead of rounding it, and a GEMM whose output (out, or a dx it writes) is
     * marked writes it in 16 bits (never adding to it: that is a failure). Only the ops
     * the backend has taught to read 16-bit inputs may read it then (SwiGLU, the
     * cross-entropy, rope, the attention, the dispatch's packing, the permutation, the
     * combine; docs/cuda.md, Precision, lists the buffers the model marks and their
     * readers). n = 0 removes the mark (before p is freed). The cpu
     * (fp32 only) ignores it; in fp32 the marks change nothing. Fails when the backend's
     * table of marks is full. */
    moe_status (*mark_operand)(const void *p, size_t n);
    /* Whether attention_forward and attention_backward take q, k, v marked as 16-bit
     * (mark_operand) as they are, for heads of Hd: then, in a 16-bit precision, the GEMMs
     * write q, k, v in 16 bits, rope_forward rotates marked ones in 16 bits and the
     * attention reads them without making 16-bit copies. 0 on the cpu. */
    int (*attention_operands16)(int Hd);
    /* The rate of the backend's own GEMM on an n x n x n product in the precision set
     * (16-bit operands for bf16/fp16, fp32 out), in FLOP/s, timed now (the bench's MFU
     * denominator); 0 when it cannot be measured (recorded for sync on a device). */
    double (*gemm_rate)(int n);
    /* Memory the process holds where the backend computes, in bytes: device memory in
     * use (cudaMemGetInfo) for cuda, the peak resident set for cpu. */
    size_t (*mem_in_use)(void);
    /* Kernel profile: on != 0 starts timing every piece of stream work (kernels, library
     * calls, copies) with events; on == 0 stops and prints the times by name to report
     * (NULL: discard). NULL on the cpu. */
    void (*profile)(int on, FILE *report);
    /* Grows the backend's scratch (device, and pinned host for values copied back) to at
     * least these sizes now, so that the ops of a step allocate nothing (cuda; a no-op on
     * the cpu). */
    moe_status (*reserve)(size_t device_bytes, size_t host_bytes);
    /* Allocations the backend has made so far (alloc, scratch growth): a step that adds
     * none allocated nothing. 0 on the cpu. */
    long (*allocations)(void);
#ifdef __cplusplus
#define MOE_OP_FIELD(fn) decltype(&::fn) fn;
#else
#define MOE_OP_FIELD(fn) __typeof__(fn) *fn;
#endif
    MOE_OPS_LIST(MOE_OP_FIELD)
#undef MOE_OP_FIELD
} moe_backend;

/* The CPU reference. */
extern const moe_backend moe_backend_cpu;

/* The CUDA backend when this build has it and a GPU is usable, else NULL with the reason
 * in why (a static string). */
const moe_backend *moe_backend_cuda(const char **why);

/* One GPU per rank: makes device (local_rank mod visible devices) current, before the
 * cuda backend first starts, and writes its PCI bus id ("0000:1b:00.0") into bus_id for
 * the CPU binding. CUDA_VISIBLE_DEVICES is respected (it decides what is visible).
 * MOE_ERR_INVALID with the reason when no GPU is usable (the caller then runs on the
 * CPU, or fails if CUDA was asked for). */
moe_status moe_cuda_pick_device(int local_rank, char *bus_id, size_t cap);

/* Picks the backend for `request` ("auto", "cpu", "cuda"): auto takes cuda when usable.
 * Asking cuda without one is an error that says why. */
moe_status moe_backend_select(const char *request, const moe_backend **out);

#ifdef __cplusplus
}
#endif
#endif
