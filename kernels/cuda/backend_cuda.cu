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
#include <time.h>

#include "kernels/cuda/cuda_common.cuh"
#include "util/clock.h"

#define WORKSPACE_BYTES ((size_t)32 << 20)
#define MAX_LOGGED 16 /* failures logged in full; later ones are counted */
#define MARKS 64      /* queue marks alive at once (an older one waits a little longer) */
#define BG_MARKS 64   /* background marks (backend.h background_mark) */

static struct {
    int device;
    cudaStream_t stream; /* where ops are queued: the queue, or a background lane between
                          * background(1 or 2) and background(0) */
    cudaStream_t queue;  /* the backend's queue */
    cudaStream_t bg;     /* background lane 1 (made on first use) */
    cudaEvent_t bg_fork, bg_join;
    cudaStream_t bg2; /* background lane 2 (made on first use) */
    cudaEvent_t bg2_fork, bg2_join;
    cudaEvent_t bg_marks[BG_MARKS]; /* background_mark's events (made on first use) */
    cudaStream_t aside;             /* beside a lane, for its small tails (moe_cuda_aside_begin) */
    cudaEvent_t aside_fork, aside_join;
    int aside_queued; /* aside_join recorded since the last join */
    int priority;     /* the queue's priority (and the GEMM lanes'): moe_cuda_priority */
    cublasLtHandle_t lt;
    void *workspace;
    void *scratch; /* device */
    size_t scratch_bytes;
    void *host; /* pinned */
    size_t host_bytes;
    cudaEvent_t marks[MARKS]; /* queue_mark's events, reused in turn */
    long next_mark;
    int capability;    /* major * 10 + minor */
    long allocations;  /* cudaMalloc / cudaMallocHost calls of alloc and the scratch */
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

/* Grows a scratch block (device, or pinned host) to at least nbytes, after a stream
 * synchronisation: earlier kernels may still use the old block. NULL on failure. */
static void *grow_block(void **block, size_t *have, size_t nbytes, int pinned)
{
    if (nbytes <= *have && *block)
        return *block;
    size_t want = grown(*have, nbytes);
    MOE_CUDA_OK(cudaStreamSynchronize(g.stream));
    if (*block)
        MOE_CUDA_OK(pinned ? cudaFreeHost(*block) : cudaFree(*block));
    *block = NULL;
    *have = 0;
    g.allocations++;
    if (!MOE_CUDA_OK(pinned ? cudaMallocHost(block, want) : cudaMalloc(block, want))) {
        *block = NULL;
        return NULL;
    }
    *have = want;
    return *block;
}

void *moe_cuda_scratch(size_t nbytes)
{
    return grow_block(&g.scratch, &g.scratch_bytes, nbytes, 0);
}

void *moe_cuda_host_scratch(size_t nbytes) { return grow_block(&g.host, &g.host_bytes, nbytes, 1); }

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
    g.allocations++;
    cudaError_t err = cudaMalloc(&p, nbytes ? nbytes : 1);
    if (err != cudaSuccess) {
        (void)cudaGetLastError(); /* not sticky: clear it for the next launch check */
        moe_log_at(__FILE__, __LINE__, "cuda: cudaMalloc(%zu bytes): %s", nbytes,
                   cudaGetErrorString(err));
        return NULL;
    }
    MOE_CUDA_PROF_BEGIN("memset");
    const cudaError_t zst = cudaMemsetAsync(p, 0, nbytes, g.stream);
    MOE_CUDA_PROF_END();
    if (!MOE_CUDA_OK(zst)) {
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

static void *cuda_alloc_host(size_t nbytes)
{
    void *p = NULL;
    g.allocations++;
    cudaError_t err = cudaMallocHost(&p, nbytes ? nbytes : 1);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        moe_log_at(__FILE__, __LINE__, "cuda: cudaMallocHost(%zu bytes): %s", nbytes,
                   cudaGetErrorString(err));
        return NULL;
    }
    memset(p, 0, nbytes);
    return p;
}

static void cuda_release_host(void *p)
{
    if (p)
        MOE_CUDA_OK(cudaFreeHost(p));
}

/* Into pinned memory, so the copy is queued and the host goes on. */
void moe_cuda_fetch_async(void *host, const void *dev, size_t nbytes)
{
    if (!nbytes)
        return;
    MOE_CUDA_PROF_BEGIN("copy device to host");
    MOE_CUDA_OK(cudaMemcpyAsync(host, dev, nbytes, cudaMemcpyDeviceToHost, g.stream));
    MOE_CUDA_PROF_END();
}

static void cuda_fetch(void *host, const void *src, size_t nbytes)
{
    moe_cuda_fetch_async(host, src, nbytes);
}

/* A non-blocking stream at the device's greatest priority (greatest) or its least, and its
 * fork and join events, into *s, *fork, *join; 0 with *s NULL on failure (recorded). */
static int make_side_stream(cudaStream_t *s, cudaEvent_t *fork, cudaEvent_t *join, int greatest)
{
    int lo = 0, hi = 0;
    if (!MOE_CUDA_OK(cudaDeviceGetStreamPriorityRange(&lo, &hi)) ||
        !MOE_CUDA_OK(cudaStreamCreateWithPriority(s, cudaStreamNonBlocking, greatest ? hi : lo)) ||
        !MOE_CUDA_OK(cudaEventCreateWithFlags(fork, cudaEventDisableTiming)) ||
        !MOE_CUDA_OK(cudaEventCreateWithFlags(join, cudaEventDisableTiming))) {
        *s = NULL;
        return 0;
    }
    return 1;
}

/* The background lanes: streams of the least priority, so that the queue's work (at
 * moe_cuda_priority, higher by default) takes the SMs first and the lanes' blocks fill
 * what it leaves. */
static int on_lane(void) { return g.stream != g.queue && (g.stream == g.bg || g.stream == g.bg2); }

static void cuda_background(int lane)
{
    cudaStream_t *s = lane == 2 ? &g.bg2 : &g.bg;
    cudaEvent_t *fork = lane == 2 ? &g.bg2_fork : &g.bg_fork;
    cudaEvent_t *join = lane == 2 ? &g.bg2_join : &g.bg_join;
    if (lane && *s && g.stream == *s)
        return;
    if (on_lane()) { /* leave the lane queued on so far */
        MOE_CUDA_OK(cudaEventRecord(g.stream == g.bg2 ? g.bg2_join : g.bg_join, g.stream));
        g.stream = g.queue;
    }
    if (!lane)
        return;
    if (!*s && !make_side_stream(s, fork, join, 0))
        return; /* the failure is recorded; the ops stay on the queue */
    MOE_CUDA_OK(cudaEventRecord(*fork, g.queue));
    MOE_CUDA_OK(cudaStreamWaitEvent(*s, *fork, 0));
    g.stream = *s;
}

static void cuda_background_join(void)
{
    cuda_background(0);
    if (g.bg)
        MOE_CUDA_OK(cudaStreamWaitEvent(g.queue, g.bg_join, 0));
    if (g.bg2)
        MOE_CUDA_OK(cudaStreamWaitEvent(g.queue, g.bg2_join, 0));
    if (g.aside_queued) {
        MOE_CUDA_OK(cudaStreamWaitEvent(g.queue, g.aside_join, 0));
        g.aside_queued = 0;
    }
}

static void cuda_background_mark(int id)
{
    if (id < 0 || id >= BG_MARKS || !on_lane()) {
        MOE_CUDA_FAIL("background_mark(%d): not on a background lane, or not in [0, %d)", id,
                      BG_MARKS);
        return;
    }
    if (!g.bg_marks[id] &&
        !MOE_CUDA_OK(cudaEventCreateWithFlags(&g.bg_marks[id], cudaEventDisableTiming)))
        return;
    MOE_CUDA_OK(cudaEventRecord(g.bg_marks[id], g.stream));
}

static void cuda_background_await(int id)
{
    if (id < 0 || id >= BG_MARKS || !g.bg_marks[id]) {
        MOE_CUDA_FAIL("background_await(%d): no such mark recorded", id);
        return;
    }
    MOE_CUDA_OK(cudaStreamWaitEvent(g.queue, g.bg_marks[id], 0));
}

/* Between moe_cuda_aside_begin and _end the backend's stream is a stream beside the
 * background lane it was called on (of the greatest priority), which starts after what
 * that lane has queued so far; the next join (background_join) and every sync wait for
 * it too. Only while the stream is a lane (else 0, nothing changed). */
static cudaStream_t aside_from;
extern "C" int moe_cuda_aside_begin(void)
{
    if (!on_lane())
        return 0;
    if (!g.aside && !make_side_stream(&g.aside, &g.aside_fork, &g.aside_join, 1))
        return 0; /* the failure is recorded; the work stays on the background */
    if (!MOE_CUDA_OK(cudaEventRecord(g.aside_fork, g.stream)) ||
        !MOE_CUDA_OK(cudaStreamWaitEvent(g.aside, g.aside_fork, 0)))
        return 0;
    aside_from = g.stream;
    g.stream = g.aside;
    return 1;
}

extern "C" void moe_cuda_aside_end(void)
{
    if (g.stream != g.aside)
        return;
    if (MOE_CUDA_OK(cudaEventRecord(g.aside_join, g.aside)))
        g.aside_queued = 1;
    g.stream = aside_from;
}

int moe_cuda_priority(void) { return g.priority; }

static long cuda_queue_mark(void)
{
    const long mark = g.next_mark++;
    MOE_CUDA_OK(cudaEventRecord(g.marks[mark % MARKS], g.stream));
    return mark;
}

/* A mark whose event was recorded again since (MARKS marks later) waits for that later
 * point: longer, never too short. With a watch the host polls the event, calling the
 * watch every WATCH_EVERY_S of the wait (a short wait never calls it). */
#define WATCH_EVERY_S 1e-3
static moe_status cuda_queue_wait(long mark, moe_status (*watch)(void *ctx), void *ctx)
{
    if (mark < 0 || mark >= g.next_mark)
        MOE_FAIL(MOE_ERR_INVALID, "cuda: wait on a queue mark (%ld) never made", mark);
    cudaEvent_t ev = g.marks[mark % MARKS];
    if (!watch) {
        MOE_CUDA_OK(cudaEventSynchronize(ev));
        return g.status;
    }
    double next_watch = moe_clock_seconds() + WATCH_EVERY_S;
    for (;;) {
        const cudaError_t q = cudaEventQuery(ev);
        if (q == cudaSuccess)
            return g.status;
        if (q != cudaErrorNotReady) {
            MOE_CUDA_OK(q);
            return g.status;
        }
        const double now = moe_clock_seconds();
        if (now >= next_watch) {
            MOE_CHECK(watch(ctx));
            next_watch = now + WATCH_EVERY_S;
        }
    }
}

static void cuda_zero(void *p, size_t nbytes)
{
    if (!nbytes)
        return;
    MOE_CUDA_PROF_BEGIN("memset");
    const cudaError_t st = cudaMemsetAsync(p, 0, nbytes, g.stream);
    MOE_CUDA_PROF_END();
    MOE_CUDA_OK(st);
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
    MOE_CUDA_PROF_BEGIN(kind == MOE_COPY_H2D   ? "copy host to device"
                        : kind == MOE_COPY_D2H ? "copy device to host"
                                               : "copy device to device");
    MOE_CUDA_OK(cudaMemcpyAsync(dst, src, nbytes, k, g.stream));
    MOE_CUDA_PROF_END();
    if (kind == MOE_COPY_D2H)
        MOE_CUDA_OK(cudaStreamSynchronize(g.stream));
}

/* ---- the kernel profile ---------------------------------------------------------------
 * Each bracketed piece of work gets a pair of events from a pool; when the pool is full
 * (and at the report) the stream is drained and the elapsed times are added to a table
 * keyed by the name's address. The host time between launches shows as the gap between
 * the sum of the pieces and the wall time; each gap (from the end of a piece to the start
 * of the next, on the stream) is added to the next piece's name, so the report says
 * before which work the stream sat idle (the first piece of each drained batch has no
 * gap counted). A bracket opened inside another counts in the outermost: the GEMMs that
 * run on side streams (matmul.cu) count as one piece on the stream, from the fork to the
 * join (until the twelfth session the first inner GEMM's end closed the outer bracket, so
 * the other GEMMs' events on this stream timed nothing of theirs, and the side streams'
 * work showed as this stream's idle time before them). */
#define PROF_PAIRS 4096
#define PROF_NAMES 256

int moe_cuda_profiling;
static struct {
    cudaEvent_t ev[2 * PROF_PAIRS];
    const char *pending[PROF_PAIRS];
    int n_pending, open; /* open: brackets open (nested ones count in the outermost) */
    const char *name[PROF_NAMES];
    double ms[PROF_NAMES], gap_ms[PROF_NAMES];
    long calls[PROF_NAMES];
    int n_names;
    double t0;
} prof;

static void prof_drain(void)
{
    if (prof.n_pending == 0)
        return;
    /* the pieces may lie on the background queue too (an update queued there), which the
     * last one's completion does not imply */
    if ((g.bg && !MOE_CUDA_OK(cudaStreamSynchronize(g.bg))) ||
        (g.bg2 && !MOE_CUDA_OK(cudaStreamSynchronize(g.bg2))) ||
        (g.aside && !MOE_CUDA_OK(cudaStreamSynchronize(g.aside))) ||
        !MOE_CUDA_OK(cudaEventSynchronize(prof.ev[2 * prof.n_pending - 1]))) {
        prof.n_pending = 0;
        return;
    }
    for (int i = 0; i < prof.n_pending; i++) {
        float ms = 0, gap = 0;
        if (!MOE_CUDA_OK(cudaEventElapsedTime(&ms, prof.ev[2 * i], prof.ev[2 * i + 1])))
            continue;
        if (i > 0 && !MOE_CUDA_OK(cudaEventElapsedTime(&gap, prof.ev[2 * i - 1], prof.ev[2 * i])))
            continue;
        int k = 0;
        while (k < prof.n_names && prof.name[k] != prof.pending[i])
            k++;
        if (k == prof.n_names) {
            if (prof.n_names == PROF_NAMES)
                continue; /* the table is full: later names go uncounted */
            prof.name[prof.n_names++] = prof.pending[i];
            prof.ms[k] = prof.gap_ms[k] = 0;
            prof.calls[k] = 0;
        }
        prof.ms[k] += ms;
        prof.gap_ms[k] += gap > 0 ? gap : 0;
        prof.calls[k]++;
    }
    prof.n_pending = 0;
}

void moe_cuda_prof_begin(const char *name)
{
    if (prof.open++)
        return; /* nested (a library call inside a bracket): the outermost one counts */
    if (prof.n_pending == PROF_PAIRS)
        prof_drain();
    prof.pending[prof.n_pending] = name;
    MOE_CUDA_OK(cudaEventRecord(prof.ev[2 * prof.n_pending], g.stream));
}

void moe_cuda_prof_end(void)
{
    if (!prof.open || --prof.open)
        return; /* not open, or the end of a nested bracket: the outermost goes on */
    MOE_CUDA_OK(cudaEventRecord(prof.ev[2 * prof.n_pending + 1], g.stream));
    prof.n_pending++;
}

/* on: start (the events are made on first use); off: drain, print the table sorted by
 * time (every name) with the sum against the wall time since the start, and stop. */
static void cuda_profile(int on, FILE *report)
{
    if (on) {
        if (!prof.ev[0])
            for (int i = 0; i < 2 * PROF_PAIRS; i++)
                if (!MOE_CUDA_OK(cudaEventCreate(&prof.ev[i])))
                    return;
        MOE_CUDA_OK(cudaStreamSynchronize(g.stream));
        prof.n_pending = prof.n_names = prof.open = 0;
        prof.t0 = moe_clock_seconds();
        moe_cuda_profiling = 1;
        return;
    }
    if (!moe_cuda_profiling)
        return;
    moe_cuda_profiling = 0;
    prof_drain();
    MOE_CUDA_OK(cudaStreamSynchronize(g.stream));
    const double wall_ms = 1e3 * (moe_clock_seconds() - prof.t0);
    int order[PROF_NAMES];
    double total = 0;
    for (int i = 0; i < prof.n_names; i++) {
        order[i] = i;
        total += prof.ms[i];
    }
    for (int i = 1; i < prof.n_names; i++) /* insertion sort, largest first */
        for (int j = i; j > 0 && prof.ms[order[j]] > prof.ms[order[j - 1]]; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    if (!report)
        return;
    fprintf(report, "  kernel profile: %.2f ms of stream work in %.2f ms wall (%.1f%% busy)\n",
            total, wall_ms, wall_ms > 0 ? 100.0 * total / wall_ms : 0.0);
    fprintf(report, "    %-40s %8s %10s %9s %6s %10s\n", "work", "calls", "total ms", "mean us",
            "share", "idle before");
    double gaps = 0;
    for (int r = 0; r < prof.n_names; r++) {
        const int i = order[r];
        gaps += prof.gap_ms[i];
        fprintf(report, "    %-40.40s %8ld %10.3f %9.1f %5.1f%% %10.3f\n", prof.name[i],
                prof.calls[i], prof.ms[i], 1e3 * prof.ms[i] / (prof.calls[i] ? prof.calls[i] : 1),
                total > 0 ? 100.0 * prof.ms[i] / total : 0.0, prof.gap_ms[i]);
    }
    fprintf(report, "  idle between pieces: %.2f ms in all (the column 'idle before')\n", gaps);
}

static moe_status cuda_sync(void)
{
    MOE_CUDA_OK(cudaStreamSynchronize(g.queue));
    if (g.bg) /* and what was queued in the background, joined or not */
        MOE_CUDA_OK(cudaStreamSynchronize(g.bg));
    if (g.bg2)
        MOE_CUDA_OK(cudaStreamSynchronize(g.bg2));
    if (g.aside)
        MOE_CUDA_OK(cudaStreamSynchronize(g.aside));
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
extern "C" moe_status cuda_gemm_master_in_shadow(size_t from);
extern "C" moe_status cuda_gemm_grads_in_shadow(const real *grads);
extern "C" void cuda_gemm_sync_master(void);
extern "C" moe_status cuda_gemm_mark_operand(const void *p, size_t n);
extern "C" int cuda_attention_operands16(int Hd);

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

static moe_status cuda_reserve(size_t device_bytes, size_t host_bytes)
{
    if ((device_bytes && !moe_cuda_scratch(device_bytes)) ||
        (host_bytes && !moe_cuda_host_scratch(host_bytes)))
        MOE_FAIL(MOE_ERR_NOMEM, "cannot reserve %zu bytes of device and %zu of pinned scratch",
                 device_bytes, host_bytes);
    return g.status;
}

static long cuda_allocations(void) { return g.allocations; }

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

static moe_status cuda_master_in_shadow(size_t from) { return cuda_gemm_master_in_shadow(from); }
static moe_status cuda_grads_in_shadow(const real *grads)
{
    MOE_CHECK(cuda_gemm_grads_in_shadow(grads));
    return g.status;
}

static moe_status cuda_sync_master(void)
{
    cuda_gemm_sync_master();
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
    b->alloc_host = cuda_alloc_host;
    b->release_host = cuda_release_host;
    b->fetch = cuda_fetch;
    b->queue_mark = cuda_queue_mark;
    b->queue_wait = cuda_queue_wait;
    b->native_stream = cuda_native_stream;
    b->background = cuda_background;
    b->background_join = cuda_background_join;
    b->background_mark = cuda_background_mark;
    b->background_await = cuda_background_await;
    b->compute_capability = cuda_compute_capability;
    b->set_precision = cuda_set_precision;
    b->refresh_shadow = cuda_refresh_shadow;
    b->master_in_shadow = cuda_master_in_shadow;
    b->grads_in_shadow = cuda_grads_in_shadow;
    b->sync_master = cuda_sync_master;
    b->mark_operand = cuda_gemm_mark_operand;
    b->attention_operands16 = cuda_attention_operands16;
    b->gemm_rate = cuda_gemm_rate;
    b->mem_in_use = cuda_mem_in_use;
    b->profile = cuda_profile;
    b->reserve = cuda_reserve;
    b->allocations = cuda_allocations;
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
    {
        /* MOE_QUEUE_PRIORITY: 0 puts the queue at the background's priority (a knob to
         * measure the background's effect); unset, the greatest the device has */
        int least = 0, greatest = 0;
        const char *pe = getenv("MOE_QUEUE_PRIORITY");
        if (!MOE_CUDA_OK(cudaDeviceGetStreamPriorityRange(&least, &greatest))) {
            why = "cannot read the stream priorities (see the log)";
            goto fail;
        }
        g.priority = pe && atoi(pe) == 0 ? least : greatest;
        if (!MOE_CUDA_OK(
                cudaStreamCreateWithPriority(&g.stream, cudaStreamNonBlocking, g.priority))) {
            why = "cannot create a CUDA stream (see the log)";
            goto fail;
        }
        g.queue = g.stream;
    }
    if (!MOE_LT_OK(cublasLtCreate(&g.lt))) {
        why = "cannot create the cuBLASLt handle (see the log)";
        goto fail;
    }
    for (int i = 0; i < MARKS; i++)
        if (!MOE_CUDA_OK(cudaEventCreateWithFlags(&g.marks[i], cudaEventDisableTiming))) {
            why = "cannot create a CUDA event (see the log)";
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
