/* kernels/backend_cpu.c: the "cpu" backend: the reference ops on host memory, and the
 * backend choice. */
#include "kernels/backend.h"

#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "util/clock.h"

static void *cpu_alloc(size_t nbytes) { return calloc(1, nbytes ? nbytes : 1); }
static void cpu_release(void *p) { free(p); }
static void cpu_zero(void *p, size_t nbytes) { memset(p, 0, nbytes); }
static void cpu_copy(void *dst, const void *src, size_t nbytes, moe_copy_kind kind)
{
    (void)kind;
    memmove(dst, src, nbytes);
}
static moe_status cpu_sync(void) { return MOE_OK; }
static long cpu_mark(void) { return 0; }
static moe_status cpu_wait(long mark, moe_status (*watch)(void *ctx), void *ctx)
{
    (void)mark; /* nothing is queued: nothing to watch */
    (void)watch;
    (void)ctx;
    return MOE_OK;
}
static int cpu_capability(void) { return 0; }
static int cpu_attention_operands16(int Hd)
{
    (void)Hd;
    return 0;
}
static void *cpu_stream(void) { return NULL; }
static moe_status cpu_set_precision(moe_precision p, const real *params, size_t n, size_t max)
{
    (void)params;
    (void)n;
    (void)max;
    if (p != MOE_PREC_FP32)
        MOE_FAIL(MOE_ERR_INVALID, "[precision] mode: the cpu backend computes in fp32 only");
    return MOE_OK;
}
static moe_status cpu_refresh_shadow(void) { return MOE_OK; }
static moe_status cpu_master_in_shadow(size_t from)
{
    (void)from;
    MOE_FAIL(MOE_ERR_INVALID, "[precision] master_weights = bf16: the cpu backend keeps fp32 "
                              "weights only (it has no bf16 copy to update)");
}
static moe_status cpu_grads_in_shadow(const real *grads)
{
    (void)grads;
    MOE_FAIL(MOE_ERR_INVALID, "bf16 gradients: the cpu backend keeps fp32 gradients only");
}
static moe_status cpu_sync_master(void) { return MOE_OK; }
static moe_status cpu_mark_operand(const void *p, size_t n)
{
    (void)p; /* fp32 only: every operand is its own buffer */
    (void)n;
    return MOE_OK;
}

static double cpu_gemm_rate(int n)
{
    const size_t nn = (size_t)n * n;
    real *x = malloc(sizeof(real) * nn), *w = malloc(sizeof(real) * nn),
         *out = malloc(sizeof(real) * nn);
    double rate = 0.0;
    if (x && w && out && n > 0) {
        for (size_t i = 0; i < nn; i++) {
            x[i] = (real)((double)(i % 17) / 17 - 0.5);
            w[i] = (real)((double)(i % 13) / 13 - 0.5);
        }
        matmul_forward(out, x, w, n, n, n); /* warm */
        const double t0 = moe_clock_seconds();
        int reps = 0;
        do
            matmul_forward(out, x, w, n, n, n);
        while (++reps < 3 || moe_clock_seconds() - t0 < 0.2);
        rate = 2.0 * n * nn * reps / (moe_clock_seconds() - t0);
    }
    free(x);
    free(w);
    free(out);
    return rate;
}

static moe_status cpu_reserve(size_t device_bytes, size_t host_bytes)
{
    (void)device_bytes;
    (void)host_bytes;
    return MOE_OK;
}
static long cpu_allocations(void) { return 0; }
static void cpu_fetch(void *host, const void *src, size_t nbytes) { memcpy(host, src, nbytes); }
static void cpu_background(int on) { (void)on; }
static void cpu_background_join(void) {}
static void cpu_background_mark(int id) { (void)id; }

static size_t cpu_mem_in_use(void)
{
    struct rusage ru;
    return getrusage(RUSAGE_SELF, &ru) == 0 ? (size_t)ru.ru_maxrss * 1024 : 0;
}

#define MOE_OP_INIT(fn) .fn = fn,
const moe_backend moe_backend_cpu = {.name = "cpu",
                                     .on_device = 0,
                                     .alloc = cpu_alloc,
                                     .release = cpu_release,
                                     .zero = cpu_zero,
                                     .copy = cpu_copy,
                                     .sync = cpu_sync,
                                     .alloc_host = cpu_alloc,
                                     .release_host = cpu_release,
                                     .fetch = cpu_fetch,
                                     .queue_mark = cpu_mark,
                                     .queue_wait = cpu_wait,
                                     .background = cpu_background,
                                     .background_join = cpu_background_join,
                                     .background_mark = cpu_background_mark,
                                     .background_await = cpu_background_mark,
                                     .native_stream = cpu_stream,
                                     .compute_capability = cpu_capability,
                                     .set_precision = cpu_set_precision,
                                     .refresh_shadow = cpu_refresh_shadow,
                                     .master_in_shadow = cpu_master_in_shadow,
                                     .grads_in_shadow = cpu_grads_in_shadow,
                                     .sync_master = cpu_sync_master,
                                     .mark_operand = cpu_mark_operand,
                                     .attention_operands16 = cpu_attention_operands16,
                                     .gemm_rate = cpu_gemm_rate,
                                     .mem_in_use = cpu_mem_in_use,
                                     .reserve = cpu_reserve,
                                     .allocations = cpu_allocations,
                                     MOE_OPS_LIST(MOE_OP_INIT)};
#undef MOE_OP_INIT

#if !defined(MOE_HAVE_CUDA) || defined(MOE_REAL_DOUBLE)
const moe_backend *moe_backend_cuda(const char **why)
{
    *why = "this build has no CUDA (configure with the CUDA toolkit installed)";
    return NULL;
}

moe_status moe_cuda_pick_device(int local_rank, char *bus_id, size_t cap)
{
    (void)local_rank;
    if (cap)
        bus_id[0] = '\0';
    return MOE_ERR_INVALID;
}
#endif

moe_status moe_backend_select(const char *request, const moe_backend **out)
{
    const char *why = NULL;
    const moe_backend *cuda = NULL;
    *out = NULL;
    if (strcmp(request, "cpu") == 0) {
        *out = &moe_backend_cpu;
        return MOE_OK;
    }
    cuda = moe_backend_cuda(&why);
    if (strcmp(request, "cuda") == 0 && !cuda)
        MOE_FAIL(MOE_ERR_INVALID, "[parallel] backend = cuda, but CUDA is not usable: %s", why);
    *out = cuda ? cuda : &moe_backend_cpu;
    return MOE_OK;
}
