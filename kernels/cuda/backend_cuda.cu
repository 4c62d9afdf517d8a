/* kernels/cuda/backend_cuda.cu: the "cuda" backend: its state (device, the one stream,
 * the cuBLASLt handle and workspace, device and pinned scratch, the sticky error), the
 * memory functions, and the table of every cuda_<op>.
 *
 * The device is the one current at the first call of moe_backend_cuda (the launcher sets
 * it before choosing the backend); the state lives until the process ends. One thread
 * uses the backend at a time. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"

#define WORKSPACE_BYTES ((size_t)32 << 20)
#define MAX_LOGGED 16 /* failures logged in full; later ones are counted */

static struct {
    int device;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *workspace;
    void *scratch; /* device */
    size_t scratch_bytes;
    void *host; /* pinned */
    size_t host_bytes;
    int capability;    /* major * 10 + minor */
    moe_status status; /* the first failure, reported by sync */
    char first[256];   /* its message */
    int failures;
} g;

/* ---- errors -------------------------------------------------------------------------- */

static void record(const char *file, int line, const char *msg)
{
    if (g.failures++ < MAX_LOGGED)
        moe_log_at(file, line, "cuda: %s", msg);
    else if (g.failures == MAX_LOGGED + 1)
        moe_log_at(file, line, "cuda: more failures follow; not logging them");
    if (g.status == MOE_OK) {
        g.status = MOE_ERR_DEVICE;
        snprintf(g.first, sizeof g.first, "%s:%d: %s", file, line, msg);
    }
}

int moe_cuda_check_at(cudaError_t err, const char *file, int line, const char *what)
{
    if (err == cudaSuccess)
        return 1;
    char msg[256];
    snprintf(msg, sizeof msg, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
    record(file, line, msg);
    return 0;
}

int moe_cuda_lt_check_at(cublasStatus_t st, const char *file, int line, const char *what)
{
    if (st == CUBLAS_STATUS_SUCCESS)
        return 1;
    char msg[256];
    snprintf(msg, sizeof msg, "%s: %s (%s)", what, cublasLtGetStatusString(st),
             cublasLtGetStatusName(st));
    record(file, line, msg);
    return 0;
}

void moe_cuda_fail_at(const char *file, int line, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    record(file, line, msg);
}

/* ---- state --------------------------------------------------------------------------- */

cudaStream_t moe_cuda_stream(void) { return g.stream; }
cublasLtHandle_t moe_cuda_lt(void) { return g.lt; }

void *moe_cuda_workspace(size_t *nbytes)
{
    *nbytes = WORKSPACE_BYTES;
    return g.workspace;
}

static size_t grown(size_t have, size_t need)
{
    size_t want = have + have / 2;
    if (want < need)
        want = need;
    return (want + ((size_t)1 << 20) - 1) & ~(((size_t)1 << 20) - 1); /* whole MiB */
}

void *moe_cuda_scratch(size_t nbytes)
{
    if (nbytes <= g.scratch_bytes && g.scratch)
        return g.scratch;
    size_t want = grown(g.scratch_bytes, nbytes);
    /* earlier kernels may still use the old block */
    MOE_CUDA_OK(cudaStreamSynchronize(g.stream));
    if (g.scratch)
        MOE_CUDA_OK(cudaFree(g.scratch));
    g.scratch = NULL;
    g.scratch_bytes = 0;
    if (!MOE_CUDA_OK(cudaMalloc(&g.scratch, want))) {
        g.scratch = NULL;
        return NULL;
    }
    g.scratch_bytes = want;
    return g.scratch;
}

void *moe_cuda_host_scratch(size_t nbytes)
{
    if (nbytes <= g.host_bytes && g.host)
        return g.host;
    size_t want = grown(g.host_bytes, nbytes);
    MOE_CUDA_OK(cudaStreamSynchronize(g.stream));
    if (g.host)
        MOE_CUDA_OK(cudaFreeHost(g.host));
    g.host = NULL;
    g.host_bytes = 0;
    if (!MOE_CUDA_OK(cudaMallocHost(&g.host, want))) {
        g.host = NULL;
        return NULL;
    }
    g.host_bytes = want;
    return g.host;
}

void *moe_cuda_fetch(const void *dev, size_t nbytes)
{
    void *host = moe_cuda_host_scratch(nbytes);
    if (!host)
        return NULL;
    if (!MOE_CUDA_OK(cudaMemcpyAsync(host, dev, nbytes, cudaMemcpyDeviceToHost, g.stream)))
        return NULL;
    if (!MOE_CUDA_OK(cudaStreamSynchronize(g.stream)))
        return NULL;
    return host;
}

/* ---- memory functions of the table --------------------------------------------------- */

/* An allocation failure is the caller's to report (NULL): it is logged but does not
 * make the backend fail. */
static void *cuda_alloc(size_t nbytes)
{
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, nbytes ? nbytes : 1);
    if (err != cudaSuccess) {
        (void)cudaGetLastError(); /* not sticky: clear it for the next launch check */
        moe_log_at(__FILE__, __LINE__, "cuda: cudaMalloc(%zu bytes): %s", nbytes,
                   cudaGetErrorString(err));
        return NULL;
    }
    if (!MOE_CUDA_OK(cudaMemsetAsync(p, 0, nbytes, g.stream))) {
        MOE_CUDA_OK(cudaFree(p));
        return NULL;
    }
    return p;
}

static void cuda_release(void *p)
{
    if (p)
        MOE_CUDA_OK(cudaFree(p));
}

static void cuda_zero(void *p, size_t nbytes)
{
    if (nbytes)
        MOE_CUDA_OK(cudaMemsetAsync(p, 0, nbytes, g.stream));
}

/* H2D from pageable memory returns once the source is staged (it may be reused); from
 * pinned memory the copy is asynchronous. D2H waits, so the host can read dst. */
static void cuda_copy(void *dst, const void *src, size_t nbytes, moe_copy_kind kind)
{
    if (!nbytes)
        return;
    cudaMemcpyKind k = kind == MOE_COPY_H2D   ? cudaMemcpyHostToDevice
                       : kind == MOE_COPY_D2H ? cudaMemcpyDeviceToHost
                                              : cudaMemcpyDeviceToDevice;
    MOE_CUDA_OK(cudaMemcpyAsync(dst, src, nbytes, k, g.stream));
    if (kind == MOE_COPY_D2H)
        MOE_CUDA_OK(cudaStreamSynchronize(g.stream));
}

static moe_status cuda_sync(void)
{
    MOE_CUDA_OK(cudaStreamSynchronize(g.stream));
    MOE_CUDA_OK(cudaGetLastError());
    if (g.status != MOE_OK)
        moe_log_at(__FILE__, __LINE__, "cuda backend failed (%d failures), first: %s", g.failures,
                   g.first);
    return g.status;
}

/* ---- the table ----------------------------------------------------------------------- */

static int cuda_compute_capability(void) { return g.capability; }
static void *cuda_native_stream(void) { return (void *)g.stream; }

/* The GEMM precision and its parameter shadow live with the GEMMs (matmul.cu). */
extern "C" moe_status cuda_gemm_set_precision(moe_precision p, const real *params, size_t n,
                                              size_t max_operand);
extern "C" moe_status cuda_gemm_refresh_shadow(void);

static moe_status cuda_set_precision(moe_precision p, const real *params, size_t n_params,
                                     size_t max_operand)
{
    if (p == MOE_PREC_BF16 && g.capability < 80)
        MOE_FAIL(MOE_ERR_INVALID, "bf16 GEMMs need sm_80 or later; this GPU is sm_%d",
                 g.capability);
    MOE_CHECK(cuda_gemm_set_precision(p, params, n_params, max_operand));
    return cuda_sync();
}

extern "C" double cuda_gemm_rate(int n);

static size_t cuda_mem_in_use(void)
{
    size_t free_b = 0, total_b = 0;
    if (!MOE_CUDA_OK(cudaMemGetInfo(&free_b, &total_b)))
        return 0;
    return total_b - free_b;
}

static moe_status cuda_refresh_shadow(void)
{
    MOE_CHECK(cuda_gemm_refresh_shadow());
    return g.status;
}

/* Filled by field name at init, so the table does not depend on the field order. */
static moe_backend cuda_backend;

static void fill_table(moe_backend *b)
{
    b->name = "cuda";
    b->on_device = 1;
    b->alloc = cuda_alloc;
    b->release = cuda_release;
    b->zero = cuda_zero;
    b->copy = cuda_copy;
    b->sync = cuda_sync;
    b->native_stream = cuda_native_stream;
    b->compute_capability = cuda_compute_capability;
    b->set_precision = cuda_set_precision;
    b->refresh_shadow = cuda_refresh_shadow;
    b->gemm_rate = cuda_gemm_rate;
    b->mem_in_use = cuda_mem_in_use;
#define MOE_OP_SET(fn) b->fn = cuda_##fn;
    MOE_OPS_LIST(MOE_OP_SET)
#undef MOE_OP_SET
}

static __global__ void probe_kernel(int *p)
{
    if (p)
        *p = 0;
}

static char why_buf[320];

/* Creates the state on the current device; returns NULL, or why it cannot. */
static const char *cuda_init(void)
{
    int count = 0, major = 0, minor = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(why_buf, sizeof why_buf, "cudaGetDeviceCount: %s", cudaGetErrorString(err));
        return why_buf;
    }
    if (count == 0)
        return "no CUDA device is visible (cudaGetDeviceCount returned 0)";
    if (!MOE_CUDA_OK(cudaGetDevice(&g.device)) ||
        !MOE_CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, g.device)) ||
        !MOE_CUDA_OK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, g.device)))
        return "cannot query the current CUDA device (see the log)";
    g.capability = major * 10 + minor;
    if (g.capability < 75) {
        snprintf(why_buf, sizeof why_buf,
                 "device %d has compute capability %d.%d; the cuda backend needs 7.5 or newer",
                 g.device, major, minor);
        return why_buf;
    }
    cudaFuncAttributes attr;
    err = cudaFuncGetAttributes(&attr, probe_kernel);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(why_buf, sizeof why_buf,
                 "this build has no kernels for device %d (compute capability %d.%d): %s; "
                 "rebuild with CMAKE_CUDA_ARCHITECTURES including %d%d",
                 g.device, major, minor, cudaGetErrorString(err), major, minor);
        return why_buf;
    }
    const char *why = NULL;
    if (!MOE_CUDA_OK(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking))) {
        why = "cannot create a CUDA stream (see the log)";
        goto fail;
    }
    if (!MOE_LT_OK(cublasLtCreate(&g.lt))) {
        why = "cannot create the cuBLASLt handle (see the log)";
        goto fail;
    }
    if (!MOE_CUDA_OK(cudaMalloc(&g.workspace, WORKSPACE_BYTES))) {
        why = "cannot allocate the cuBLASLt workspace (see the log)";
        goto fail;
    }
    return NULL;
fail:
    if (g.lt)
        MOE_LT_OK(cublasLtDestroy(g.lt));
    if (g.stream)
        MOE_CUDA_OK(cudaStreamDestroy(g.stream));
    g.lt = NULL;
    g.stream = NULL;
    return why;
}

extern "C" const moe_backend *moe_backend_cuda(const char **why)
{
    static int tried;
    static const char *reason;
    if (!tried) {
        tried = 1;
        reason = cuda_init();
        fill_table(&cuda_backend);
        if (reason) {
            /* an init failure is not a failure of a usable backend */
            g.status = MOE_OK;
            g.failures = 0;
        }
    }
    if (why)
        *why = reason;
    return reason ? NULL : &cuda_backend;
}

extern "C" moe_status moe_cuda_pick_device(int local_rank, char *bus_id, size_t cap)
{
    int count = 0;
    if (cap)
        bus_id[0] = '\0';
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) {
        cudaGetLastError(); /* clear it: the CPU path may follow */
        return MOE_ERR_INVALID;
    }
    int dev = local_rank % count;
    if (cudaSetDevice(dev) != cudaSuccess ||
        cudaDeviceGetPCIBusId(bus_id, (int)cap, dev) != cudaSuccess)
        MOE_FAIL(MOE_ERR_DEVICE, "cannot select GPU %d of %d for local rank %d", dev, count,
                 local_rank);
    return MOE_OK;
}
