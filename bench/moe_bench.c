/* bench/moe_bench.c: micro-benchmarks of the "cuda" backend, op by op, through the backend
 * table (kernels/backend.h), at the bench shape of configs/bench-h200.ini by default.
 *
 * Each line: the op, its shape, the median time of N runs after a warm-up, the achieved
 * rate and the ceiling it is held against, both measured in this process:
 *   - memory-bound ops: GB/s counting the bytes the op must read and write (each input
 *     read once, each output written once, an accumulated (+=) output read and written),
 *     against a device-to-device copy of a large buffer counted the same way (2 bytes
 *     moved per byte copied);
 *   - GEMM-like ops: TFLOP/s against the backend's own dense matmul at a shape of equal
 *     FLOPs, in the same precision (--precision, set through set_precision as the runtime
 *     does);
 *   - `moe-bench a2a` (under mpirun, one GPU per rank): the comm layer's token exchange
 *     (comm/comm.h over NCCL, as runtime/model.c calls it) against grouped
 *     ncclSend/ncclRecv of the same bytes on a communicator of its own, plus the pack and
 *     unpack kernels around it; on one rank, each exchange is with itself (a copy on the
 *     GPU: the comm layer's own cost per exchange, with no link in it).
 * Times come from CUDA events on the backend's stream (host clock with a barrier per run
 * for communication). Without a usable GPU: "SKIP: no CUDA device", exit 77.
 *
 * Dimension letters as kernels/ops.h: B sequences, T length, D d_model, H heads, Hd head
 * dim, E experts, K top-k, F expert hidden, V vocabulary, L layers, N = B*T tokens,
 * M = N*K routed rows, P ranks.
 *
 * Owns: nothing of the library; a program (it exits on failure, MPI_Abort under MPI). */
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include "comm/comm.h"
#include "kernels/backend.h"
#include "util/rng.h"
#include "util/status.h"

#define EXIT_SKIP 77
#define EXIT_USAGE 2
#define SEED 20250101u
#define PATTERN (1 << 20) /* random values tiled into device buffers */
#define MAX_CEILINGS 32
#define MAX_BLOCKS 64

/* ---- options ----------------------------------------------------------------------------- */

typedef struct {
    int B, T, D, H, E, K, F, V, L;
    int reps, warmup;
    moe_precision prec;
    const char *op; /* NULL: every op */
    int copy_mib;
    int rows_ratio; /* the grouped ops: largest expert's rows over the smallest's (1: even) */
    int out16;      /* the grouped forwards write 16-bit outputs, as the model's */
    int grads16;    /* the grouped backwards write bf16 weight gradients, as the model's */
    int copy_equal; /* each memory-bound line also against a copy of its own bytes */
} bench_opts;

static bench_opts opt = {
    .B = 8,
    .T = 2048,
    .D = 1024,
    .H = 16,
    .E = 32,
    .K = 2,
    .F = 2816,
    .V = 32768,
    .L = 4,
    .reps = 20,
    .warmup = 3,
    .prec = MOE_PREC_BF16,
    .op = NULL,
    .copy_mib = 1024,
    .rows_ratio = 1,
    .out16 = 0,
    .grads16 = 0,
};

static const char *prec_name(moe_precision p)
{
    return p == MOE_PREC_BF16 ? "bf16" : p == MOE_PREC_FP16 ? "fp16" : "fp32";
}

/* ---- failure: the whole job ends (every rank under MPI) ------------------------------------ */

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

static void die(const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    moe_log("moe-bench: %s", msg);
    int mpi = 0;
    if (MPI_Initialized(&mpi) == MPI_SUCCESS && mpi)
        MPI_Abort(MPI_COMM_WORLD, 1);
    exit(1);
}

#define CUDA_CK(call)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            die("%s:%d: %s: %s", __FILE__, __LINE__, #call, cudaGetErrorString(e_));               \
    } while (0)

#define NCCL_CK(call)                                                                              \
    do {                                                                                           \
        ncclResult_t r_ = (call);                                                                  \
        if (r_ != ncclSuccess)                                                                     \
            die("%s:%d: %s: %s", __FILE__, __LINE__, #call, ncclGetErrorString(r_));               \
    } while (0)

#define MPI_CK(call)                                                                               \
    do {                                                                                           \
        if ((call) != MPI_SUCCESS)                                                                 \
            die("%s:%d: %s failed", __FILE__, __LINE__, #call);                                    \
    } while (0)

#define MOE_CK(call)                                                                               \
    do {                                                                                           \
        moe_status s_ = (call);                                                                    \
        if (s_ != MOE_OK)                                                                          \
            die("%s:%d: %s: %s", __FILE__, __LINE__, #call, moe_status_str(s_));                   \
    } while (0)

/* ---- the backend, its memory, random contents ----------------------------------------------- */

static const moe_backend *gpu;
static cudaStream_t stream;
static cudaEvent_t *ev_start, *ev_end; /* opt.reps each */
static int rank, world = 1;            /* a2a mode: MPI world */
static real *pat_normal, *pat_pos;     /* host, PATTERN each */

static void *blocks[MAX_BLOCKS];
static int n_blocks;

/* Zeroed device memory, freed by free_all. */
static void *dmem(size_t nbytes)
{
    if (n_blocks == MAX_BLOCKS)
        die("more than %d device blocks in one benchmark", MAX_BLOCKS);
    void *p = gpu->alloc(nbytes ? nbytes : 1);
    if (!p)
        die("cannot allocate %zu bytes (%.2f GiB) on the GPU: try a smaller shape", nbytes,
            (double)nbytes / (1 << 30));
    return blocks[n_blocks++] = p;
}

static real *dreal(size_t n) { return dmem(sizeof(real) * n); }

static void sync_or_die(const char *what)
{
    if (gpu->sync() != MOE_OK)
        die("the backend reported a failure during %s", what);
}

/* Buffers marked as holding their GEMM operand (backend.h mark_operand), as the model
 * marks its SwiGLU outputs; unmarked by free_all. */
#define MAX_MARKS 16
static void *marked[MAX_MARKS];
static int n_marked;

static void mark(void *p, size_t n)
{
    if (n_marked == MAX_MARKS)
        die("more than %d marked buffers in one benchmark", MAX_MARKS);
    MOE_CK(gpu->mark_operand(p, n));
    marked[n_marked++] = p;
}

/* Releases every block (unmarked first), and the 16-bit shadow of the last GEMM
 * benchmark. */
static void free_all(void)
{
    sync_or_die("a benchmark");
    for (int i = 0; i < n_marked; i++)
        MOE_CK(gpu->mark_operand(marked[i], 0));
    n_marked = 0;
    MOE_CK(gpu->set_precision(MOE_PREC_FP32, NULL, 0, 0));
    for (int i = 0; i < n_blocks; i++)
        gpu->release(blocks[i]);
    n_blocks = 0;
}

/* n elements of elem bytes each, tiled from the host pattern pat (PATTERN elements): one
 * upload, then device copies that double the filled part. */
static void *dtile(const void *pat, size_t elem, size_t n)
{
    char *d = dmem(elem * n);
    size_t done = n < PATTERN ? n : PATTERN;
    gpu->copy(d, pat, elem * done, MOE_COPY_H2D);
    while (done < n) {
        size_t chunk = done < n - done ? done : n - done;
        gpu->copy(d + elem * done, d, elem * chunk, MOE_COPY_D2D);
        done += chunk;
    }
    return d;
}

/* n values of the host pattern (normal, or uniform in [0.1, 1.1) when positive) times
 * scale, tiled. */
static real *dfill(size_t n, double scale, int positive)
{
    real *d = dtile(positive ? pat_pos : pat_normal, sizeof(real), n);
    if (scale != 1.0)
        gpu->scale_inplace(d, (real)scale, n);
    return d;
}

/* The same values in 16 bits (bf16 where bf16, else fp16), the pattern read from its
 * element `from` on (so that buffers differ). */
static void *dfill16_as(size_t n, double scale, int positive, int bf16, size_t from)
{
    uint16_t *h = malloc(sizeof(uint16_t) * PATTERN);
    if (!h)
        die("out of host memory");
    for (size_t i = 0; i < PATTERN; i++) {
        const float v = (float)((positive ? pat_pos : pat_normal)[(i + from) % PATTERN] * scale);
        h[i] = bf16 ? moe_bf16_round(v) : moe_fp16_round(v);
    }
    void *d = dtile(h, sizeof(uint16_t), n);
    free(h);
    return d;
}

/* In bf16 (the optimizer's 16-bit moments). */
static void *dfill16(size_t n, double scale, int positive)
{
    return dfill16_as(n, scale, positive, 1, 0);
}

static void *dupload(const void *h, size_t nbytes)
{
    void *d = dmem(nbytes);
    gpu->copy(d, h, nbytes, MOE_COPY_H2D);
    return d;
}

/* The GEMM precision for the weights [w, w + nw) (the "parameter arena" of the benchmark)
 * and activation operands of at most max_operand elements. */
static void use_precision(const real *w, size_t nw, size_t max_operand)
{
    MOE_CK(gpu->set_precision(opt.prec, w, nw, max_operand));
    MOE_CK(gpu->refresh_shadow());
    sync_or_die("set_precision");
}

/* --grads16 1: the weights w are bf16 master weights and their gradients dw (as many)
 * live in bf16, which the grouped backwards write, as the model's with [precision]
 * expert_grads = bf16 (after use_precision, which ends it). */
static void use_grads16(real *dw)
{
    if (!opt.grads16)
        return;
    MOE_CK(gpu->master_in_shadow(0));
    MOE_CK(gpu->grads_in_shadow(dw));
}

/* ---- timing --------------------------------------------------------------------------------- */

typedef void (*op_fn)(void);

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static double median(float *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_float);
    return n % 2 ? v[n / 2] : 0.5 * ((double)v[n / 2 - 1] + v[n / 2]);
}

/* Median milliseconds of fn over opt.reps runs after opt.warmup, from CUDA events on the
 * backend's stream around each run. Under MPI: the slowest rank's median. */
static double time_gpu(op_fn fn)
{
    float ms[opt.reps];
    for (int i = 0; i < opt.warmup; i++)
        fn();
    sync_or_die("the warm-up");
    for (int i = 0; i < opt.reps; i++) {
        CUDA_CK(cudaEventRecord(ev_start[i], stream));
        fn();
        CUDA_CK(cudaEventRecord(ev_end[i], stream));
    }
    sync_or_die("the timed runs");
    for (int i = 0; i < opt.reps; i++)
        CUDA_CK(cudaEventElapsedTime(&ms[i], ev_start[i], ev_end[i]));
    double med = median(ms, opt.reps);
    if (world > 1)
        MPI_CK(MPI_Allreduce(MPI_IN_PLACE, &med, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
    return med;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

/* The same for communication: every rank starts each run after a barrier and stops it once
 * its stream is idle (monotonic clock); the slowest rank's median. */
static double time_comm(op_fn fn)
{
    float ms[opt.reps];
    for (int i = 0; i < opt.warmup + opt.reps; i++) {
        MPI_CK(MPI_Barrier(MPI_COMM_WORLD));
        double t0 = now_ms();
        fn();
        sync_or_die("an exchange");
        double t1 = now_ms();
        if (i >= opt.warmup)
            ms[i - opt.warmup] = (float)(t1 - t0);
    }
    double med = median(ms, opt.reps);
    MPI_CK(MPI_Allreduce(MPI_IN_PLACE, &med, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
    return med;
}

/* ---- the table ------------------------------------------------------------------------------ */

typedef enum { RATE_NONE, RATE_GBS, RATE_TFS } rate_kind;

typedef struct {
    double rate;  /* GB/s or TFLOP/s; 0: none */
    char by[64];  /* what gave it */
    char key[64]; /* cache key */
} ceiling;

static ceiling ceilings[MAX_CEILINGS];
static int n_ceilings;

static void header(void)
{
    if (rank != 0)
        return;
    printf("%-18s %-44s %10s %10s %-5s %10s %7s  %s\n", "op", "shape", "ms", "rate", "unit",
           "ceiling", "%ceil", "ceiling by");
}

/* One line: amount is bytes (GB/s) or FLOPs (TFLOP/s); c NULL or rate 0: no ceiling. */
static void report_equal_copy(double amount, double rate);

static void report(const char *op, const char *shape, double ms, double amount, rate_kind kind,
                   const ceiling *c)
{
    if (rank != 0)
        return;
    double rate = 0;
    const char *unit = "-";
    if (kind == RATE_GBS) {
        rate = amount / (ms * 1e-3) / 1e9;
        unit = "GB/s";
    } else if (kind == RATE_TFS) {
        rate = amount / (ms * 1e-3) / 1e12;
        unit = "TF/s";
    }
    char rate_s[32] = "-", ceil_s[32] = "-", pct_s[32] = "-";
    if (kind != RATE_NONE)
        snprintf(rate_s, sizeof rate_s, "%.1f", rate);
    if (c && c->rate > 0) {
        snprintf(ceil_s, sizeof ceil_s, "%.1f", c->rate);
        snprintf(pct_s, sizeof pct_s, "%.1f", 100.0 * rate / c->rate);
    }
    printf("%-18s %-44s %10.4f %10s %-5s %10s %7s  %s\n", op, shape, ms, rate_s, unit, ceil_s,
           pct_s, c && c->rate > 0 ? c->by : "-");
    fflush(stdout);
    if (opt.copy_equal && world == 1 && kind == RATE_GBS && c && strcmp(c->key, "copy") == 0)
        report_equal_copy(amount, rate);
}

static const ceiling *ceiling_find(const char *key)
{
    for (int i = 0; i < n_ceilings; i++)
        if (strcmp(ceilings[i].key, key) == 0)
            return &ceilings[i];
    return NULL;
}

static const ceiling *ceiling_add(const char *key, double rate, const char *by)
{
    if (n_ceilings == MAX_CEILINGS)
        die("more than %d ceilings", MAX_CEILINGS);
    ceiling *c = &ceilings[n_ceilings++];
    snprintf(c->key, sizeof c->key, "%s", key);
    snprintf(c->by, sizeof c->by, "%s", by);
    c->rate = rate;
    return c;
}

/* ---- ceilings, measured once on first use and printed as lines of their own ---------------- */

static struct {
    real *x, *w, *out, *dout, *dx, *dw;
    int N, I, O;
    const void *src;
    void *dst;
    size_t nbytes;
} cl;

static void run_copy(void) { gpu->copy(cl.dst, cl.src, cl.nbytes, MOE_COPY_D2D); }
static void run_dense(void) { gpu->matmul_forward(cl.out, cl.x, cl.w, cl.N, cl.I, cl.O); }
static void run_dense_bwd(void)
{
    gpu->matmul_backward(cl.dx, cl.dw, cl.dout, cl.x, cl.w, cl.N, cl.I, cl.O, 0);
}

/* Device copy bandwidth, counting read + write (2 bytes per byte copied), as every
 * memory-bound line does. Frees what it takes only when no benchmark holds blocks. */
static const ceiling *copy_ceiling(void)
{
    const ceiling *c = ceiling_find("copy");
    if (c)
        return c;
    int mark = n_blocks;
    cl.nbytes = (size_t)opt.copy_mib << 20;
    cl.src = dmem(cl.nbytes);
    cl.dst = dmem(cl.nbytes);
    double ms = time_gpu(run_copy);
    char shape[64];
    snprintf(shape, sizeof shape, "%d MiB d2d (read+write counted)", opt.copy_mib);
    double bytes = 2.0 * (double)cl.nbytes;
    report("copy", shape, ms, bytes, RATE_GBS, NULL);
    gpu->release((void *)cl.src);
    gpu->release(cl.dst);
    n_blocks = mark;
    return ceiling_add("copy", bytes / (ms * 1e-3) / 1e9, "d2d copy");
}

/* --copy-equal 1: after a memory-bound line, a copy of its own bytes (amount counted as
 * the copy line counts, read + write: amount / 2 bytes copied), timed now, and the op's
 * rate against it: how far a short op's gap to the large copy is its size's (launch,
 * ramp and tail), not its kernel's. Buffers of its own, released at once; skipped above
 * 4 GiB copied. */
static void report_equal_copy(double amount, double rate)
{
    const size_t nbytes = (size_t)(amount / 2.0) / 16 * 16;
    if (nbytes == 0 || nbytes > ((size_t)4 << 30)) {
        printf("%-18s %-44s %10s\n", "  equal copy", "(skipped: above 4 GiB)", "-");
        return;
    }
    const int mark = n_blocks;
    cl.nbytes = nbytes; /* the copy ceiling's buffers, long released (copy_ceiling) */
    cl.src = dmem(nbytes);
    cl.dst = dmem(nbytes);
    const double ms = time_gpu(run_copy);
    gpu->release((void *)cl.src);
    gpu->release(cl.dst);
    n_blocks = mark;
    const double copy_rate = 2.0 * (double)nbytes / (ms * 1e-3) / 1e9;
    char shape[64];
    snprintf(shape, sizeof shape, "%.1f MiB d2d, the line's bytes", (double)nbytes / (1 << 20));
    printf("%-18s %-44s %10.4f %10.1f %-5s %10s %7.1f  %s\n", "  equal copy", shape, ms, copy_rate,
           "GB/s", "-", 100.0 * rate / copy_rate, "the line above against it");
    fflush(stdout);
}

/* The backend's dense matmul (forward, or backward with dx and dw: twice the FLOPs) at
 * out (N,O) = x (N,I) W^T, in the benchmark precision. Measured before the caller
 * allocates its own buffers (it sets the precision for its own weight). */
static const ceiling *gemm_ceiling(int N, int I, int O, int bwd)
{
    char key[64], by[64];
    snprintf(key, sizeof key, "gemm%s %dx%dx%d", bwd ? "_bwd" : "", N, I, O);
    const ceiling *c = ceiling_find(key);
    if (c)
        return c;
    int mark = n_blocks;
    cl.N = N;
    cl.I = I;
    cl.O = O;
    cl.x = dfill((size_t)N * I, 1.0, 0);
    cl.w = dfill((size_t)O * I, 0.02, 0);
    if (bwd) {
        cl.dout = dfill((size_t)N * O, 1.0, 0);
        cl.dx = dreal((size_t)N * I);
        cl.dw = dreal((size_t)O * I);
    } else {
        cl.out = dreal((size_t)N * O);
    }
    use_precision(cl.w, (size_t)O * I, (size_t)N * (I > O ? I : O));
    double ms = time_gpu(bwd ? run_dense_bwd : run_dense);
    double flops = (bwd ? 4.0 : 2.0) * N * (double)I * O;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d I=%d O=%d %s", N, I, O, prec_name(opt.prec));
    report(bwd ? "dense_gemm_bwd" : "dense_gemm", shape, ms, flops, RATE_TFS, NULL);
    sync_or_die("the dense GEMM");
    MOE_CK(gpu->set_precision(MOE_PREC_FP32, NULL, 0, 0));
    for (int i = mark; i < n_blocks; i++)
        gpu->release(blocks[i]);
    n_blocks = mark;
    snprintf(by, sizeof by, "%s", key);
    return ceiling_add(key, flops / (ms * 1e-3) / 1e12, by);
}

/* A dense GEMM of the given FLOPs with N rows and I inputs: O rounded to a multiple of 64. */
static const ceiling *gemm_ceiling_flops(double flops, int N, int I)
{
    double o = flops / (2.0 * N * (double)I);
    long O = lround(o / 64.0) * 64;
    if (O < 64)
        O = 64;
    if (O > INT_MAX / 2)
        O = INT_MAX / 2;
    return gemm_ceiling(N, I, (int)O, 0);
}

/* ---- shapes --------------------------------------------------------------------------------- */

static int N_, M_, Hd_; /* tokens, routed rows, head dim */

static int *uniform_offsets(int G, int rows)
{
    static int off[4097];
    if (G > 4096)
        die("at most 4096 experts");
    for (int g = 0; g <= G; g++)
        off[g] = (int)((long long)rows * g / G);
    return off;
}

/* The grouped ops' expert offsets: even (uniform_offsets) unless --rows-ratio R > 1 spreads
 * the rows geometrically, expert g's share R^(g / (G - 1)) of the total, so that the last
 * has R times the first's (the model's experts took about 256 to 4864 rows a layer at the
 * bench shape, a ratio of 19; the geometric spread is a stand-in, not its histogram). */
static int *expert_offsets(int G, int rows)
{
    if (opt.rows_ratio <= 1 || G < 2)
        return uniform_offsets(G, rows);
    static int off[4097];
    static double share[4096];
    double sum = 0.0, acc = 0.0;
    for (int g = 0; g < G; g++)
        sum += share[g] = pow((double)opt.rows_ratio, (double)g / (G - 1));
    off[0] = 0;
    for (int g = 0; g < G; g++) {
        acc += share[g];
        off[g + 1] = (int)llround((double)rows * acc / sum);
    }
    off[G] = rows;
    return off;
}

/* The grouped benchmarks' shape: "G=32 rows=1024 D=1024 F=2816 bf16" and the spread and
 * 16-bit outputs where asked. */
static void grouped_shape(char *buf, size_t cap, int M)
{
    char spread[32] = "";
    if (opt.rows_ratio > 1)
        snprintf(spread, sizeof spread, " spread x%d", opt.rows_ratio);
    snprintf(buf, cap, "G=%d rows=%d D=%d F=%d %s%s%s%s", opt.E, M / opt.E, opt.D, opt.F,
             prec_name(opt.prec), spread, opt.out16 ? " out16" : "", opt.grads16 ? " grads16" : "");
}

/* ---- the single-GPU benchmarks: buffers of the one running ------------------------------------
 */

static struct {
    real *x, *y, *w, *out, *dout, *dx, *dw, *a, *b, *h, *da, *db, *dh;
    real *q, *k, *v, *dq, *dk, *dv, *lse, *rstd, *cos_t, *sin_t;
    real *logits, *probs, *wts, *dwts, *m1, *m2, *wd;
    int32_t *idx, *row_token, *row_slot, *slot_row;
    int *scratch, *offsets; /* offsets: host */
    int64_t *segs;
    double *aux;     /* router aux-loss partials */
    double *norm_sq; /* the gradient norm's two sums of squares */
    double *sq_out;  /* adamw16_norm: the sums the update writes */
    int moments16;   /* adamw16: the moments in bf16 */
    size_t n;
    int n_segs, rows;
} bf;

static void run_router_gemm(void) { gpu->matmul_forward(bf.logits, bf.x, bf.w, N_, opt.D, opt.E); }

/* The router GEMM. x16 = 0: from an fp32 x that the GEMM first rounds into its workspace
 * (a pass its bytes do not count; the model never runs this form). x16 = 1: the model's
 * form: x (h2, the FFN norm's output) already holds its 16-bit operand (the model marks
 * it), so the GEMM reads it as is. */
static void bench_router(int x16)
{
    const char *name = x16 ? "router_gemm16" : "router_gemm";
    if (x16 && opt.prec == MOE_PREC_FP32) {
        printf("%-18s (fp32 precision: no 16-bit buffers; see router_gemm)\n", name);
        return;
    }
    const ceiling *c = copy_ceiling();
    const int N = N_, D = opt.D, E = opt.E;
    if (!x16)
        bf.x = dfill((size_t)N * D, 1.0, 0);
    bf.w = dfill((size_t)E * D, 0.02, 0);
    bf.logits = dreal((size_t)N * E);
    use_precision(bf.w, (size_t)E * D, (size_t)N * D);
    if (x16) {
        bf.x = dfill16_as((size_t)N * D, 1.0, 0, opt.prec == MOE_PREC_BF16, 0);
        mark(bf.x, (size_t)N * D);
    }
    double ms = time_gpu(run_router_gemm);
    const double xw = x16 ? 2.0 : (double)sizeof(real);
    double bytes = xw * ((double)N * D + (double)E * D) + sizeof(real) * (double)N * E;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d D=%d E=%d %s%s", N, D, E, prec_name(opt.prec),
             x16 ? ", x marked" : "");
    report(name, shape, ms, bytes, RATE_GBS, c);
    free_all();
}

static void bench_router_gemm(void) { bench_router(0); }
static void bench_router_gemm16(void) { bench_router(1); }

static void run_router_topk(void)
{
    gpu->router_forward(bf.probs, bf.lse, bf.idx, bf.wts, bf.aux, bf.logits, N_, opt.E, opt.K, 1);
}

static void bench_router_topk(void)
{
    const ceiling *c = copy_ceiling();
    const int N = N_, E = opt.E, K = opt.K;
    bf.logits = dfill((size_t)N * E, 1.0, 0);
    bf.probs = dreal((size_t)N * E);
    bf.lse = dreal((size_t)N);
    bf.idx = dmem(sizeof(int32_t) * N * K);
    bf.wts = dreal((size_t)N * K);
    const size_t n_aux = router_aux_part_len(N, E);
    bf.aux = dmem(sizeof(double) * n_aux); /* as the runtime: the aux partials in the pass */
    double ms = time_gpu(run_router_topk);
    /* logits read; probs, lse, idx, w and the partials written */
    double bytes = 4.0 * (2.0 * N * E + N + 2.0 * N * K) + 8.0 * (double)n_aux;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d E=%d K=%d +aux partials", N, E, K);
    report("router_topk", shape, ms, bytes, RATE_GBS, c);
    free_all();
}

/* A dropless routing plan of random router logits (roughly N*K/E rows per expert), on the
 * device: idx, wts, row_token, row_slot, slot_row; returns M. */
static int make_plan(void)
{
    const int N = N_, E = opt.E, K = opt.K;
    bf.logits = dfill((size_t)N * E, 1.0, 0);
    bf.probs = dreal((size_t)N * E);
    bf.lse = dreal((size_t)N);
    bf.idx = dmem(sizeof(int32_t) * N * K);
    bf.wts = dreal((size_t)N * K);
    bf.row_token = dmem(sizeof(int32_t) * N * K);
    bf.row_slot = dmem(sizeof(int32_t) * N * K);
    bf.slot_row = dmem(sizeof(int32_t) * N * K);
    bf.scratch = dmem(sizeof(int) * N * K);
    bf.offsets = uniform_offsets(E, 0);
    gpu->router_forward(bf.probs, bf.lse, bf.idx, bf.wts, NULL, bf.logits, N, E, K, 1);
    int M = gpu->moe_route_plan(bf.offsets, bf.row_token, bf.row_slot, bf.slot_row, bf.scratch,
                                bf.idx, bf.wts, N, E, K, N, -1);
    sync_or_die("the routing plan");
    if (M != N * K)
        die("the dropless plan kept %d of %d rows", M, N * K);
    return M;
}

static void run_route_plan(void)
{
    gpu->moe_route_plan(bf.offsets, bf.row_token, bf.row_slot, bf.slot_row, bf.scratch, bf.idx,
                        bf.wts, N_, opt.E, opt.K, N_, -1);
}

static void bench_route_plan(void)
{
    const ceiling *c = copy_ceiling();
    int M = make_plan();
    double ms = time_gpu(run_route_plan);
    /* reads idx, w; writes row_token, row_slot, slot_row, offsets */
    double bytes = 4.0 * (2.0 * N_ * opt.K + 2.0 * M + (double)N_ * opt.K + opt.E + 1);
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d E=%d K=%d dropless", N_, opt.E, opt.K);
    report("route_plan", shape, ms, bytes, RATE_GBS, c);
    free_all();
}

static void run_permute(void) { gpu->moe_permute(bf.out, bf.x, bf.row_token, bf.rows, opt.D); }
static void run_permute_bwd(void)
{
    /* as the runtime on the experts' side: the token's rows gathered through slot_row,
     * written (no base) */
    gpu->moe_permute_backward(bf.dx, NULL, bf.dout, bf.row_token, bf.rows, opt.D, bf.slot_row, N_,
                              opt.K, NULL);
}

static void bench_permute(int bwd)
{
    const ceiling *c = copy_ceiling();
    const int N = N_, D = opt.D;
    int M = bf.rows = make_plan();
    double bytes;
    if (!bwd) {
        bf.x = dfill((size_t)N * D, 1.0, 0);
        bf.out = dreal((size_t)M * D);
        bytes = 4.0 * (2.0 * M * D + M);
    } else {
        bf.dout = dfill((size_t)M * D, 1.0, 0);
        bf.dx = dreal((size_t)N * D);
        bytes = 4.0 * ((double)M * D + (double)N * D + M); /* rows read, dx written */
    }
    double ms = time_gpu(bwd ? run_permute_bwd : run_permute);
    char shape[64];
    snprintf(shape, sizeof shape, "M=%d D=%d (N=%d E=%d)", M, D, N, opt.E);
    report(bwd ? "permute_bwd" : "permute", shape, ms, bytes, RATE_GBS, c);
    free_all();
}

static void bench_permute_fwd(void) { bench_permute(0); }
static void bench_permute_bwd(void) { bench_permute(1); }

/* As runtime/model.c's experts' backward at ep > 1, the tokens as the received rows: each
 * one's gradient row sent back, [the sum of its expert rows' input gradients | its slot
 * weights' gradient], gathered through slot_row. */
static void run_grad_rows(void)
{
    gpu->moe_pack_grad_rows(bf.y, bf.dout, bf.row_token, bf.rows, bf.slot_row, bf.dwts, N_, opt.D,
                            opt.K);
}

static void bench_grad_rows(void)
{
    const ceiling *c = copy_ceiling();
    const int N = N_, D = opt.D, K = opt.K;
    int M = bf.rows = make_plan();
    bf.dout = dfill((size_t)M * D, 1.0, 0);
    bf.dwts = dfill((size_t)N * K, 1.0, 0);
    bf.y = dreal((size_t)N * (D + K));
    double ms = time_gpu(run_grad_rows);
    /* the expert rows, dw and slot_row read, the rows written */
    double bytes = 4.0 * ((double)M * D + (double)N * (D + K) + 2.0 * N * K);
    char shape[64];
    snprintf(shape, sizeof shape, "M=%d D=%d K=%d (R=%d)", M, D, K, N);
    report("grad_rows", shape, ms, bytes, RATE_GBS, c);
    free_all();
}

static void run_combine(void)
{
    /* as the runtime: written (no base) */
    gpu->moe_combine_forward(bf.y, NULL, bf.out, bf.wts, bf.row_token, bf.row_slot, bf.rows, opt.D,
                             opt.K, bf.slot_row, N_);
}

static void run_combine_bwd(void)
{
    gpu->moe_combine_backward(bf.dout, bf.dwts, bf.dx, bf.out, bf.wts, bf.row_token, bf.row_slot,
                              bf.rows, opt.D, opt.K);
}

static void bench_combine(int bwd)
{
    const ceiling *c = copy_ceiling();
    const int N = N_, D = opt.D, K = opt.K;
    int M = bf.rows = make_plan();
    double bytes;
    bf.out = dfill((size_t)M * D, 1.0, 0); /* the experts' outputs */
    if (!bwd) {
        bf.y = dfill((size_t)N * D, 1.0, 0);
        /* expert rows, y written, weights, row_token, row_slot */
        bytes = 4.0 * ((double)M * D + (double)N * D + (double)N * K + 2.0 * M);
    } else {
        bf.dx = dfill((size_t)N * D, 1.0, 0); /* dy */
        bf.dout = dreal((size_t)M * D);       /* dexpert_out = */
        bf.dwts = dreal((size_t)N * K);       /* dw += */
        /* dexpert_out written, expert rows, dy, w, dw read and written, row maps */
        bytes = 4.0 * (2.0 * M * D + (double)N * D + 3.0 * N * K + 2.0 * M);
    }
    double ms = time_gpu(bwd ? run_combine_bwd : run_combine);
    char shape[64];
    snprintf(shape, sizeof shape, "M=%d D=%d K=%d (N=%d)", M, D, K, N);
    report(bwd ? "combine_bwd" : "combine", shape, ms, bytes, RATE_GBS, c);
    free_all();
}

static void bench_combine_fwd(void) { bench_combine(0); }
static void bench_combine_bwd(void) { bench_combine(1); }

/* One expert's SwiGLU FFN on its share of rows: gate and up (rows, D) -> (rows, F), SwiGLU,
 * down (rows, F) -> (rows, D); the three weights are one block (w1 | w3 | w2). */
static void run_expert(void)
{
    const int R = bf.rows, D = opt.D, F = opt.F;
    const size_t FD = (size_t)F * D;
    gpu->matmul_forward(bf.a, bf.x, bf.w, R, D, F);
    gpu->matmul_forward(bf.b, bf.x, bf.w + FD, R, D, F);
    gpu->swiglu_forward(bf.h, bf.a, bf.b, (size_t)R * F);
    gpu->matmul_forward(bf.out, bf.h, bf.w + 2 * FD, R, F, D);
}

static void bench_expert(void)
{
    const int R = bf.rows = M_ / opt.E, D = opt.D, F = opt.F;
    const size_t FD = (size_t)F * D;
    const ceiling *c = gemm_ceiling(R, D, 3 * F, 0);
    bf.x = dfill((size_t)R * D, 1.0, 0);
    bf.w = dfill(3 * FD, 0.02, 0);
    bf.a = dreal((size_t)R * F);
    bf.b = dreal((size_t)R * F);
    bf.h = dreal((size_t)R * F);
    bf.out = dreal((size_t)R * D);
    use_precision(bf.w, 3 * FD, (size_t)R * (D > F ? D : F));
    double ms = time_gpu(run_expert);
    double flops = 6.0 * R * (double)D * F;
    char shape[64];
    snprintf(shape, sizeof shape, "rows=%d D=%d F=%d %s", R, D, F, prec_name(opt.prec));
    report("expert", shape, ms, flops, RATE_TFS, c);
    free_all();
}

/* Grouped GEMMs over E experts of M/E rows each (the issue's: 16384*2 routed rows / 32). */
static void run_grouped(void)
{
    gpu->grouped_matmul_forward(bf.out, bf.x, bf.w, bf.offsets, opt.E, opt.D, opt.F);
}

/* As in a step's first backward: the weight gradients written; with --out16 1 the input
 * gradient too, 16-bit, as the model's down projection writes deh (else added to, fp32) */
static void run_grouped_bwd(void)
{
    gpu->grouped_matmul_backward(bf.dx, bf.dw, bf.dout, bf.x, bf.w, bf.offsets, opt.E, opt.D, opt.F,
                                 MOE_WRITE_DW | (opt.out16 ? MOE_WRITE_DX : 0));
}

static void bench_grouped(int bwd)
{
    const int M = M_, D = opt.D, F = opt.F, E = opt.E;
    const size_t W = (size_t)E * F * D;
    const ceiling *c = gemm_ceiling(M, D, F, bwd);
    bf.offsets = expert_offsets(E, M);
    bf.x = dfill((size_t)M * D, 1.0, 0);
    bf.w = dfill(W, 0.02, 0);
    if (!bwd) {
        bf.out = dreal((size_t)M * F);
        if (opt.out16)
            mark(bf.out, (size_t)M * F);
    } else {
        bf.dout = dfill((size_t)M * F, 1.0, 0);
        bf.dx = dreal((size_t)M * D);
        bf.dw = dreal(W);
        if (opt.out16)
            mark(bf.dx, (size_t)M * D);
    }
    use_precision(bf.w, W, (size_t)M * (D > F ? D : F));
    if (bwd)
        use_grads16(bf.dw);
    double ms = time_gpu(bwd ? run_grouped_bwd : run_grouped);
    double flops = (bwd ? 4.0 : 2.0) * M * (double)D * F;
    char shape[96];
    grouped_shape(shape, sizeof shape, M);
    report(bwd ? "grouped_gemm_bwd" : "grouped_gemm", shape, ms, flops, RATE_TFS, c);
    free_all();
}

/* The experts' gate and up projections (two weights of (E, F, D) one after the other):
 * as one pair op (each expert's two products one strided batch) and as two grouped ops,
 * forward and backward, in the same run. The output gradients are marked (written by
 * SwiGLU's backward, as the model's), so that neither op rounds them. */
static int pair_one; /* 1: the pair op, 0: two grouped ops */

static void run_pair(void)
{
    const size_t W = (size_t)opt.E * opt.F * opt.D, MF = (size_t)M_ * opt.F;
    if (pair_one) {
        gpu->grouped_matmul_forward_pair(bf.out, bf.out + MF, bf.x, bf.w, bf.w + W, bf.offsets,
                                         opt.E, opt.D, opt.F);
    } else {
        gpu->grouped_matmul_forward(bf.out, bf.x, bf.w, bf.offsets, opt.E, opt.D, opt.F);
        gpu->grouped_matmul_forward(bf.out + MF, bf.x, bf.w + W, bf.offsets, opt.E, opt.D, opt.F);
    }
}

static void run_pair_bwd(void)
{
    const size_t W = (size_t)opt.E * opt.F * opt.D;
    const int wr = MOE_WRITE_DW | MOE_WRITE_DX;
    if (pair_one) {
        gpu->grouped_matmul_backward_pair(bf.dx, bf.dw, bf.dw + W, bf.da, bf.db, bf.x, bf.w,
                                          bf.w + W, bf.offsets, opt.E, opt.D, opt.F, wr);
    } else {
        gpu->grouped_matmul_backward(bf.dx, bf.dw, bf.da, bf.x, bf.w, bf.offsets, opt.E, opt.D,
                                     opt.F, wr);
        gpu->grouped_matmul_backward(bf.dx, bf.dw + W, bf.db, bf.x, bf.w + W, bf.offsets, opt.E,
                                     opt.D, opt.F, MOE_WRITE_DW);
    }
}

static void bench_grouped_pair(int bwd)
{
    const int M = M_, D = opt.D, F = opt.F, E = opt.E;
    const size_t W = (size_t)E * F * D, MF = (size_t)M * F;
    const ceiling *c = gemm_ceiling(M, D, 2 * F, bwd);
    bf.offsets = expert_offsets(E, M);
    bf.x = dfill((size_t)M * D, 1.0, 0);
    bf.w = dfill(2 * W, 0.02, 0);
    if (!bwd) {
        bf.out = dreal(2 * MF);
        if (opt.out16) {
            mark(bf.out, MF);
            mark(bf.out + MF, MF);
        }
    } else {
        bf.da = dreal(2 * MF); /* da, db one after the other, as the model's */
        bf.db = bf.da + MF;
        mark(bf.da, MF);
        mark(bf.db, MF);
        real *a = dfill(MF, 1.0, 0), *b = dfill(MF, 1.0, 0), *dh = dfill(MF, 1.0, 0);
        gpu->swiglu_backward(bf.da, bf.db, dh, a, b, MF);
        bf.dx = dreal((size_t)M * D);
        bf.dw = dreal(2 * W);
    }
    use_precision(bf.w, 2 * W, (size_t)M * (D > F ? D : F));
    if (bwd)
        use_grads16(bf.dw);
    const double flops = (bwd ? 8.0 : 4.0) * M * (double)D * F;
    char shape[160], base[96];
    grouped_shape(base, sizeof base, M);
    for (pair_one = 1; pair_one >= 0; pair_one--) {
        double ms = time_gpu(bwd ? run_pair_bwd : run_pair);
        snprintf(shape, sizeof shape, "%s, %s", base, pair_one ? "pair op" : "two grouped ops");
        report(bwd ? "grouped_pair_bwd" : "grouped_pair", shape, ms, flops, RATE_TFS, c);
    }
    free_all();
}

/* The experts' gate and up projections and SwiGLU of them, all three outputs marked
 * (16-bit, as the model's ea, eb, eh): grouped_matmul_forward_pair_swiglu as the two ops
 * (the pair, then SwiGLU's kernel), then with MOE_SWIGLU_EPILOGUE=1 (on sm_90 h computed
 * in the wgmma kernel's epilogue), two lines. The rate counts the GEMMs' FLOPs only. */
static int pair_epilogue;

static void run_pair_swiglu(void)
{
    const size_t W = (size_t)opt.E * opt.F * opt.D, MF = (size_t)M_ * opt.F;
    if (pair_epilogue)
        setenv("MOE_SWIGLU_EPILOGUE", "1", 1);
    gpu->grouped_matmul_forward_pair_swiglu(bf.h, bf.out, bf.out + MF, bf.x, bf.w, bf.w + W,
                                            bf.offsets, opt.E, opt.D, opt.F);
    unsetenv("MOE_SWIGLU_EPILOGUE");
}

static void bench_pair_swiglu(void)
{
    const int M = M_, D = opt.D, F = opt.F, E = opt.E;
    const size_t W = (size_t)E * F * D, MF = (size_t)M * F;
    const ceiling *c = gemm_ceiling(M, D, 2 * F, 0);
    bf.offsets = expert_offsets(E, M);
    bf.x = dfill((size_t)M * D, 1.0, 0);
    bf.w = dfill(2 * W, 0.02, 0);
    bf.out = dreal(2 * MF);
    bf.h = dreal(MF);
    mark(bf.out, MF);
    mark(bf.out + MF, MF);
    mark(bf.h, MF);
    use_precision(bf.w, 2 * W, (size_t)M * (D > F ? D : F));
    const double flops = 4.0 * M * (double)D * F;
    char shape[160], base[96];
    grouped_shape(base, sizeof base, M);
    for (pair_epilogue = 0; pair_epilogue < 2; pair_epilogue++) {
        double ms = time_gpu(run_pair_swiglu);
        snprintf(shape, sizeof shape, "%s, %s", base,
                 pair_epilogue ? "SwiGLU in the epilogue" : "pair then SwiGLU");
        report("pair_swiglu", shape, ms, flops, RATE_TFS, c);
    }
    free_all();
}

static void bench_grouped_fwd(void) { bench_grouped(0); }
static void bench_grouped_bwd(void) { bench_grouped(1); }
static void bench_grouped_pair_fwd(void) { bench_grouped_pair(0); }
static void bench_grouped_pair_bwd(void) { bench_grouped_pair(1); }

/* Every expert's SwiGLU FFN: grouped gate, grouped up, SwiGLU, grouped down; backward in
 * reverse. The model runs gate and up as one pair op (`grouped_pair` times that alone);
 * here they are two grouped calls, as at the figures recorded for this line. Weights: one block w1
 * (E,F,D) | w3 | w2 (E,D,F). h, da and db are marked as the model marks them. */
static void run_experts_ffn(void)
{
    const int M = M_, D = opt.D, F = opt.F, E = opt.E;
    const size_t W = (size_t)E * F * D;
    gpu->grouped_matmul_forward(bf.a, bf.x, bf.w, bf.offsets, E, D, F);
    gpu->grouped_matmul_forward(bf.b, bf.x, bf.w + W, bf.offsets, E, D, F);
    gpu->swiglu_forward(bf.h, bf.a, bf.b, (size_t)M * F);
    gpu->grouped_matmul_forward(bf.out, bf.h, bf.w + 2 * W, bf.offsets, E, F, D);
}

static void run_experts_ffn_bwd(void)
{
    const int M = M_, D = opt.D, F = opt.F, E = opt.E;
    const size_t W = (size_t)E * F * D;
    gpu->grouped_matmul_backward(bf.dh, bf.dw + 2 * W, bf.dout, bf.h, bf.w + 2 * W, bf.offsets, E,
                                 F, D, MOE_WRITE_DW | MOE_WRITE_DX); /* as the model */
    gpu->swiglu_backward(bf.da, bf.db, bf.dh, bf.a, bf.b, (size_t)M * F);
    gpu->grouped_matmul_backward(bf.dx, bf.dw, bf.da, bf.x, bf.w, bf.offsets, E, D, F,
                                 MOE_WRITE_DW | MOE_WRITE_DX);
    gpu->grouped_matmul_backward(bf.dx, bf.dw + W, bf.db, bf.x, bf.w + W, bf.offsets, E, D, F,
                                 MOE_WRITE_DW);
}

static void bench_experts_ffn(int bwd)
{
    const int M = M_, D = opt.D, F = opt.F, E = opt.E;
    const size_t W = (size_t)E * F * D, MF = (size_t)M * F;
    const ceiling *c = gemm_ceiling(M, D, 3 * F, bwd);
    bf.offsets = expert_offsets(E, M);
    bf.x = dfill((size_t)M * D, 1.0, 0);
    bf.w = dfill(3 * W, 0.02, 0);
    if (!bwd) {
        bf.a = dreal(MF);
        bf.b = dreal(MF);
        bf.h = dreal(MF);
        bf.out = dreal((size_t)M * D);
        if (opt.out16) { /* the gate and up outputs in 16 bits, as the model's ea, eb */
            mark(bf.a, MF);
            mark(bf.b, MF);
        }
    } else {
        bf.a = dfill(MF, 1.0, 0);
        bf.b = dfill(MF, 1.0, 0);
        bf.h = dfill(MF, 1.0, 0);
        bf.dout = dfill((size_t)M * D, 1.0, 0);
        bf.da = dreal(MF);
        bf.db = dreal(MF);
        bf.dh = dreal(MF);
        bf.dx = dreal((size_t)M * D);
        bf.dw = dreal(3 * W);
    }
    use_precision(bf.w, 3 * W, MF);
    if (bwd)
        use_grads16(bf.dw);
    mark(bf.h, MF);
    if (bwd) { /* h holds its operand, written as the forward writes it */
        mark(bf.da, MF);
        mark(bf.db, MF);
        gpu->swiglu_forward(bf.h, bf.a, bf.b, MF);
    }
    double ms = time_gpu(bwd ? run_experts_ffn_bwd : run_experts_ffn);
    double flops = (bwd ? 12.0 : 6.0) * M * (double)D * F; /* the GEMMs only */
    char shape[96];
    grouped_shape(shape, sizeof shape, M);
    report(bwd ? "experts_ffn_bwd" : "experts_ffn", shape, ms, flops, RATE_TFS, c);
    free_all();
}

static void bench_experts_ffn_fwd(void) { bench_experts_ffn(0); }
static void bench_experts_ffn_bwd(void) { bench_experts_ffn(1); }

/* Causal attention: T(T+1)/2 query-key pairs per (sequence, head), 4*Hd FLOPs each forward
 * (scores and the weighted sum of values), 10*Hd backward (scores recomputed, dP, dV, dQ,
 * dK). */
static double attention_pairs(void)
{
    return (double)opt.B * opt.H * (double)opt.T * (opt.T + 1) / 2.0;
}

static void run_attention(void)
{
    gpu->attention_forward(bf.out, bf.lse, bf.q, bf.k, bf.v, opt.B, opt.T, opt.H, Hd_);
}

static void run_attention_bwd(void)
{
    gpu->attention_backward(bf.dq, bf.dk, bf.dv, bf.dout, bf.out, bf.lse, bf.q, bf.k, bf.v, opt.B,
                            opt.T, opt.H, Hd_);
}

static void bench_attention(int bwd)
{
    const int N = N_, D = opt.D;
    const double flops = (bwd ? 10.0 : 4.0) * Hd_ * attention_pairs();
    const ceiling *c = gemm_ceiling_flops(flops, N, D);
    const size_t n = (size_t)N * D;
    bf.q = dfill(n, 1.0, 0);
    bf.k = dfill(n, 1.0, 0);
    bf.v = dfill(n, 1.0, 0);
    bf.out = dreal(n);
    bf.lse = dreal((size_t)opt.B * opt.H * opt.T);
    /* the attention kernels follow the GEMM precision (16-bit tiles on tensor cores where
     * the backend has them); no weights, no operand workspace */
    MOE_CK(gpu->set_precision(opt.prec, NULL, 0, 0));
    if (bwd) {
        bf.dout = dfill(n, 1.0, 0);
        bf.dq = dreal(n);
        bf.dk = dreal(n);
        bf.dv = dreal(n);
        run_attention(); /* out and lse for the backward */
    }
    double ms = time_gpu(bwd ? run_attention_bwd : run_attention);
    char shape[64];
    snprintf(shape, sizeof shape, "B=%d T=%d H=%d Hd=%d causal %s", opt.B, opt.T, opt.H, Hd_,
             prec_name(opt.prec));
    report(bwd ? "attention_bwd" : "attention", shape, ms, flops, RATE_TFS, c);
    free_all();
}

static void bench_attention_fwd(void) { bench_attention(0); }
static void bench_attention_bwd(void) { bench_attention(1); }

static void run_attention_bwd_qkv(void)
{
    gpu->attention_backward_qkv(bf.dx, bf.dq, bf.dk, bf.dv, bf.dout, bf.out, bf.lse, bf.q, bf.k,
                                bf.v, bf.cos_t, bf.sin_t, opt.B, opt.T, opt.H, Hd_);
}

/* The backward as the model runs it in a 16-bit precision: q, k, v, out, dout and the
 * gradients marked (16-bit), into [dq | dk | dv] with dq and dk rotated back (on an H200
 * the kernels write it; MOE_ATTENTION_ROPE=0: attention_backward, then rope_qkv). */
static void bench_attention_bwd_qkv(void)
{
    if (opt.prec == MOE_PREC_FP32 || !gpu->attention_operands16(Hd_)) {
        printf("%-18s (needs a 16-bit precision and the 16-bit attention operands)\n",
               "attention_bwd_qkv");
        return;
    }
    const int N = N_, D = opt.D;
    const double flops = 10.0 * Hd_ * attention_pairs();
    const ceiling *c = gemm_ceiling_flops(flops, N, D);
    const size_t n = (size_t)N * D, tab = (size_t)opt.T * (Hd_ / 2);
    const int b16 = opt.prec == MOE_PREC_BF16;
    bf.w = dfill((size_t)D, 0.02, 0); /* a parameter arena for set_precision */
    use_precision(bf.w, (size_t)D, (size_t)D);
    real **in[] = {&bf.q, &bf.k, &bf.v, &bf.dout};
    for (int i = 0; i < 4; i++) {
        *in[i] = dfill16_as(n, 1.0, 0, b16, 7919u * (i + 1));
        mark(*in[i], n);
    }
    real **outs[] = {&bf.out, &bf.dq, &bf.dk, &bf.dv};
    for (int i = 0; i < 4; i++) {
        *outs[i] = dmem(sizeof(uint16_t) * n);
        mark(*outs[i], n);
    }
    bf.lse = dreal((size_t)opt.B * opt.H * opt.T);
    bf.dx = dmem(sizeof(uint16_t) * 3 * n);
    mark(bf.dx, 3 * n);
    bf.cos_t = dreal(tab);
    bf.sin_t = dreal(tab);
    gpu->rope_tables(bf.cos_t, bf.sin_t, opt.T, Hd_, 10000.0);
    run_attention(); /* out and lse for the backward */
    double ms = time_gpu(run_attention_bwd_qkv);
    char shape[80];
    snprintf(shape, sizeof shape, "B=%d T=%d H=%d Hd=%d causal %s, marked", opt.B, opt.T, opt.H,
             Hd_, prec_name(opt.prec));
    report("attention_bwd_qkv", shape, ms, flops, RATE_TFS, c);
    free_all();
}

static void run_rmsnorm(void)
{
    gpu->rmsnorm_forward(bf.out, bf.rstd, bf.x, bf.w, N_, opt.D, (real)1e-5);
}

static void run_rmsnorm_bwd(void)
{
    gpu->rmsnorm_backward(bf.dx, bf.dw, bf.dout, bf.x, bf.w, bf.rstd, N_, opt.D, 0, NULL);
}

static void bench_rmsnorm(int bwd)
{
    const ceiling *c = copy_ceiling();
    const int N = N_, D = opt.D;
    bf.x = dfill((size_t)N * D, 1.0, 0);
    bf.w = dfill((size_t)D, 1.0, 1);
    bf.out = dreal((size_t)N * D);
    bf.rstd = dreal((size_t)N);
    double bytes;
    if (!bwd) {
        bytes = 4.0 * (2.0 * N * D + D + N);
    } else {
        bf.dout = dfill((size_t)N * D, 1.0, 0);
        bf.dx = dreal((size_t)N * D);
        bf.dw = dreal((size_t)D);
        run_rmsnorm(); /* rstd */
        /* dout, x, dx read and written, weight, rstd, dweight read and written */
        bytes = 4.0 * (4.0 * N * D + 3.0 * D + N);
    }
    double ms = time_gpu(bwd ? run_rmsnorm_bwd : run_rmsnorm);
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d D=%d", N, D);
    report(bwd ? "rmsnorm_bwd" : "rmsnorm", shape, ms, bytes, RATE_GBS, c);
    free_all();
}

static void bench_rmsnorm_fwd(void) { bench_rmsnorm(0); }
static void bench_rmsnorm_bwd(void) { bench_rmsnorm(1); }

static void run_rope(void)
{
    gpu->rope_forward(bf.q, bf.cos_t, bf.sin_t, opt.B, opt.T, opt.H, Hd_);
}

static void run_rope_bwd(void)
{
    gpu->rope_backward(bf.q, bf.cos_t, bf.sin_t, opt.B, opt.T, opt.H, Hd_);
}

static void bench_rope(int bwd)
{
    const ceiling *c = copy_ceiling();
    const size_t n = (size_t)N_ * opt.H * Hd_, tab = (size_t)opt.T * (Hd_ / 2);
    bf.q = dfill(n, 1.0, 0);
    bf.cos_t = dreal(tab);
    bf.sin_t = dreal(tab);
    gpu->rope_tables(bf.cos_t, bf.sin_t, opt.T, Hd_, 10000.0);
    double ms = time_gpu(bwd ? run_rope_bwd : run_rope);
    double bytes = 4.0 * (2.0 * (double)n + 2.0 * (double)tab); /* in place, and the tables */
    char shape[64];
    snprintf(shape, sizeof shape, "B=%d T=%d H=%d Hd=%d (one of q, k)", opt.B, opt.T, opt.H, Hd_);
    report(bwd ? "rope_bwd" : "rope", shape, ms, bytes, RATE_GBS, c);
    free_all();
}

static void bench_rope_fwd(void) { bench_rope(0); }
static void bench_rope_bwd(void) { bench_rope(1); }

static void run_rope_qkv(void)
{
    gpu->rope_backward_qkv(bf.dx, bf.dq, bf.dk, bf.dv, bf.cos_t, bf.sin_t, opt.B, opt.T, opt.H,
                           Hd_);
}

/* As the model runs them in a 16-bit precision (every buffer marked, 2 bytes an element):
 * rope16 rotates q in place (the forward), rope_qkv writes [dq | dk | dv] from dq, dk, dv
 * (the backward: dq and dk rotated back, dv copied). */
static void bench_rope16(int qkv)
{
    const char *name = qkv ? "rope_qkv" : "rope16";
    if (opt.prec == MOE_PREC_FP32) {
        printf("%-18s (fp32 precision: no 16-bit buffers; see rope%s)\n", name, qkv ? "_bwd" : "");
        return;
    }
    const ceiling *c = copy_ceiling();
    const size_t n = (size_t)N_ * opt.H * Hd_, tab = (size_t)opt.T * (Hd_ / 2);
    const int b16 = opt.prec == MOE_PREC_BF16;
    bf.w = dfill((size_t)opt.D, 0.02, 0); /* a parameter arena for set_precision */
    use_precision(bf.w, (size_t)opt.D, (size_t)opt.D);
    bf.cos_t = dreal(tab);
    bf.sin_t = dreal(tab);
    gpu->rope_tables(bf.cos_t, bf.sin_t, opt.T, Hd_, 10000.0);
    real **src[] = {&bf.q, &bf.dq, &bf.dk, &bf.dv};
    for (int i = qkv ? 1 : 0; i < (qkv ? 4 : 1); i++) {
        *src[i] = dfill16_as(n, 1.0, 0, b16, 7919u * i);
        mark(*src[i], n);
    }
    if (qkv) {
        bf.dx = dmem(sizeof(uint16_t) * 3 * n);
        mark(bf.dx, 3 * n);
    }
    double ms = time_gpu(qkv ? run_rope_qkv : run_rope);
    const double bytes = 2.0 * 2.0 * (qkv ? 3.0 : 1.0) * (double)n + 4.0 * 2.0 * (double)tab;
    char shape[80];
    snprintf(shape, sizeof shape, "B=%d T=%d H=%d Hd=%d %s%s", opt.B, opt.T, opt.H, Hd_,
             prec_name(opt.prec), qkv ? " (dq, dk, dv)" : " (one of q, k)");
    report(name, shape, ms, bytes, RATE_GBS, c);
    free_all();
}

static void bench_rope16_fwd(void) { bench_rope16(0); }
static void bench_rope16_qkv(void) { bench_rope16(1); }

static void run_swiglu(void) { gpu->swiglu_forward(bf.h, bf.a, bf.b, bf.n); }
static void run_swiglu_bwd(void) { gpu->swiglu_backward(bf.da, bf.db, bf.dh, bf.a, bf.b, bf.n); }

static void bench_swiglu(int bwd)
{
    const ceiling *c = copy_ceiling();
    const size_t n = bf.n = (size_t)M_ * opt.F;
    bf.a = dfill(n, 1.0, 0);
    bf.b = dfill(n, 1.0, 0);
    double bytes;
    if (!bwd) {
        bf.h = dreal(n);
        bytes = 4.0 * 3.0 * (double)n;
    } else {
        bf.dh = dfill(n, 1.0, 0);
        bf.da = dreal(n);
        bf.db = dreal(n);
        bytes = 4.0 * 5.0 * (double)n; /* dh, a, b read; da and db written (overwritten) */
    }
    double ms = time_gpu(bwd ? run_swiglu_bwd : run_swiglu);
    char shape[64];
    snprintf(shape, sizeof shape, "n=%zu (M=%d x F=%d)", n, M_, opt.F);
    report(bwd ? "swiglu_bwd" : "swiglu", shape, ms, bytes, RATE_GBS, c);
    free_all();
}

static void bench_swiglu_fwd(void) { bench_swiglu(0); }
static void bench_swiglu_bwd(void) { bench_swiglu(1); }

/* The same as the model runs it in a 16-bit precision: a, b (the experts' gate and up
 * outputs), h, dh, da and db all marked, 16-bit (2 bytes an element counted). */
static void bench_swiglu16(int bwd)
{
    if (opt.prec == MOE_PREC_FP32) {
        printf("%-18s (fp32 precision: no 16-bit buffers; see swiglu%s)\n",
               bwd ? "swiglu16_bwd" : "swiglu16", bwd ? "_bwd" : "");
        return;
    }
    const ceiling *c = copy_ceiling();
    const size_t n = bf.n = (size_t)M_ * opt.F;
    bf.w = dfill((size_t)opt.D, 0.02, 0); /* a parameter arena for set_precision */
    use_precision(bf.w, (size_t)opt.D, (size_t)opt.D);
    real **bufs[] = {&bf.a, &bf.b, &bf.h, &bf.dh, &bf.da, &bf.db};
    const int nb = bwd ? 6 : 3;
    for (int i = 0; i < nb; i++) {
        if (bufs[i] == &bf.h && bwd)
            continue; /* the backward reads dh, not h */
        *bufs[i] = dfill16_as(n, 1.0, 0, opt.prec == MOE_PREC_BF16, 7919u * i); /* its own */
        mark(*bufs[i], n);
    }
    double ms = time_gpu(bwd ? run_swiglu_bwd : run_swiglu);
    const double bytes = 2.0 * (bwd ? 5.0 : 3.0) * (double)n;
    char shape[64];
    snprintf(shape, sizeof shape, "n=%zu (M=%d x F=%d) %s", n, M_, opt.F, prec_name(opt.prec));
    report(bwd ? "swiglu16_bwd" : "swiglu16", shape, ms, bytes, RATE_GBS, c);
    free_all();
}

static void bench_swiglu16_fwd(void) { bench_swiglu16(0); }
static void bench_swiglu16_bwd(void) { bench_swiglu16(1); }

/* The fused cross-entropy of one LM-head chunk, as the model runs it: the rows of
 * MOE_HEAD_MIB's default 512 MiB of fp32 logits (4096 at V = 32768, at most N), in a
 * 16-bit precision 16-bit logits (as the head's GEMM writes them, marked) and 16-bit
 * dlogits (marked: the head's backward GEMMs read them), else fp32 both. */
static struct {
    int32_t *targets;
    int rows;
} ce;

static void run_cross_entropy(void)
{
    gpu->cross_entropy_fused(bf.probs, bf.lse, bf.dx, bf.logits, ce.targets, 1.0f / ce.rows,
                             ce.rows, opt.V);
}

static void bench_cross_entropy(void)
{
    const ceiling *c = copy_ceiling();
    const int V = opt.V;
    int rows = (int)((512.0 * 1024 * 1024 / 4) / V);
    rows = rows < 1 ? 1 : rows > N_ ? N_ : rows;
    ce.rows = rows;
    const size_t n = (size_t)rows * V;
    const int h16 = opt.prec != MOE_PREC_FP32;
    bf.w = dfill((size_t)opt.D, 0.02, 0); /* a parameter arena for set_precision */
    use_precision(bf.w, (size_t)opt.D, (size_t)opt.D);
    if (h16) { /* logits of a few units, as a trained head's */
        bf.logits = dfill16_as(n, 2.0, 0, opt.prec == MOE_PREC_BF16, 0);
        bf.dx = dmem(sizeof(uint16_t) * n);
        mark(bf.logits, n);
        mark(bf.dx, n);
    } else {
        bf.logits = dfill(n, 2.0, 0);
        bf.dx = dreal(n);
    }
    int32_t *t = malloc(sizeof(int32_t) * (size_t)rows);
    if (!t)
        die("out of host memory");
    for (int i = 0; i < rows; i++)
        t[i] = (int32_t)(((uint32_t)i * 2654435761u) % (uint32_t)V);
    ce.targets = dupload(t, sizeof(int32_t) * (size_t)rows);
    free(t);
    bf.probs = dreal((size_t)rows); /* the losses */
    bf.lse = dreal((size_t)rows);
    double ms = time_gpu(run_cross_entropy);
    const double eb = h16 ? 2.0 : 4.0; /* logits read, dlogits written; targets, losses, lse */
    double bytes = 2.0 * eb * (double)n + 12.0 * rows;
    char shape[64];
    snprintf(shape, sizeof shape, "rows=%d V=%d %s", rows, V, h16 ? prec_name(opt.prec) : "fp32");
    report("cross_entropy", shape, ms, bytes, RATE_GBS, c);
    free_all();
}

/* The parameter arena of the model (no dense or shared FFN layers): its segments (one per
 * tensor, in model order) and weight decay (0 for norms). Returns the element count. */
static size_t arena_layout(int64_t *offs, real *wd, int *n_segs)
{
    const size_t D = (size_t)opt.D, E = (size_t)opt.E, F = (size_t)opt.F, V = (size_t)opt.V;
    size_t n = 0;
    int s = 0;
#define SEG(count, decay)                                                                          \
    do {                                                                                           \
        if (offs) {                                                                                \
            offs[s] = (int64_t)n;                                                                  \
            wd[s] = (real)(decay);                                                                 \
        }                                                                                          \
        n += (count);                                                                              \
        s++;                                                                                       \
    } while (0)
    SEG(V * D, 0.1); /* embedding */
    for (int l = 0; l < opt.L; l++) {
        SEG(D, 0.0); /* attention norm */
        for (int i = 0; i < 4; i++)
            SEG(D * D, 0.1); /* wq, wk, wv, wo */
        SEG(D, 0.0);         /* ffn norm */
        SEG(E * D, 0.1);     /* router */
        for (int i = 0; i < 3; i++)
            SEG(E * F * D, 0.1); /* w1, w3, w2 */
    }
    SEG(D, 0.0);     /* final norm */
    SEG(V * D, 0.1); /* lm head */
#undef SEG
    if (offs)
        offs[s] = (int64_t)n;
    *n_segs = s;
    return n;
}

static void run_adamw(void)
{
    /* sums of squares 1 + 1 under a loss scale of 2, no clipping: gradients times 0.5; or
     * (sq_out) no norm read, the sums of squares written by the same pass */
    gpu->adamw_update_multi(bf.x, bf.dout, bf.m1, bf.m2, bf.moments16, bf.n, 0, bf.n, bf.segs,
                            bf.wd, bf.n_segs, (real)1e-4, (real)0.9, (real)0.95, (real)1e-8,
                            bf.sq_out ? NULL : bf.norm_sq, 0.0, 2.0, 10, bf.sq_out, bf.n / 2);
}

/* as the trainer: the sum of squares stays on the device */
static void run_grad_norm(void) { gpu->sum_into(bf.norm_sq, bf.dout, bf.n, 1); }

/* adamw: 0 the gradient norm, 1 AdamW, 2 AdamW with bf16 moments, 3 the same writing the
 * sums of squares of the gradients (the step when nothing clips: no norm pass), 4 that
 * with bf16 master weights (the bench config's experts: every parameter here, read and
 * written in the bf16 shadow only). */
static void bench_optimizer(int adamw)
{
    const ceiling *c = copy_ceiling();
    int n_segs = 0;
    arena_layout(NULL, NULL, &n_segs);
    int64_t *offs = malloc(sizeof(int64_t) * (n_segs + 1));
    real *wd = malloc(sizeof(real) * n_segs);
    if (!offs || !wd)
        die("out of host memory");
    const size_t n = bf.n = arena_layout(offs, wd, &bf.n_segs);
    bf.dout = dfill(n, 1e-3, 0); /* gradients */
    const double sq[2] = {1.0, 1.0};
    bf.norm_sq = dupload(sq, sizeof sq);
    double bytes;
    if (adamw) {
        bf.x = dfill(n, 0.02, 0); /* parameters */
        bf.moments16 = adamw >= 2;
        bf.sq_out = adamw >= 3 ? dupload(sq, sizeof sq) : NULL;
        bf.m1 = bf.moments16 ? dfill16(n, 1e-3, 0) : dfill(n, 1e-3, 0);
        bf.m2 = bf.moments16 ? dfill16(n, 1e-6, 1) : dfill(n, 1e-6, 1);
        bf.segs = dupload(offs, sizeof(int64_t) * (n_segs + 1));
        bf.wd = dupload(wd, sizeof(real) * n_segs);
        /* p, g, m, v read; p, m, v written: 4 bytes each, or 2 for bf16 moments; with bf16
         * masters p is the shadow's (2 bytes read, 2 written) */
        bytes = (adamw == 4   ? 4.0 + 2.0 * 6.0
                 : adamw >= 2 ? 4.0 * 3.0 + 2.0 * 4.0
                              : 4.0 * 7.0) *
                (double)n;
        if (adamw == 4) {
            MOE_CK(gpu->set_precision(MOE_PREC_BF16, bf.x, n, 0));
            MOE_CK(gpu->refresh_shadow());
            MOE_CK(gpu->master_in_shadow(0));
        }
    } else {
        bytes = 4.0 * (double)n;
    }
    free(offs);
    free(wd);
    double ms = time_gpu(adamw ? run_adamw : run_grad_norm);
    char shape[64];
    snprintf(shape, sizeof shape, "params=%zu (%d tensors, L=%d)", n, n_segs, opt.L);
    static const char *const names[] = {"grad_norm", "adamw", "adamw16", "adamw16_norm",
                                        "adamw16_master16"};
    report(names[adamw], shape, ms, bytes, RATE_GBS, c);
    free_all();
}

static void bench_adamw(void) { bench_optimizer(1); }
static void bench_adamw16(void) { bench_optimizer(2); }
static void bench_adamw16_norm(void) { bench_optimizer(3); }
static void bench_adamw16_master16(void) { bench_optimizer(4); }
static void bench_grad_norm(void) { bench_optimizer(0); }

static void bench_copy(void) { (void)copy_ceiling(); }

typedef struct {
    const char *name;
    void (*run)(void);
} bench_op;

static const bench_op single_ops[] = {
    {"copy", bench_copy},
    {"router_gemm", bench_router_gemm},
    {"router_gemm16", bench_router_gemm16},
    {"router_topk", bench_router_topk},
    {"route_plan", bench_route_plan},
    {"permute", bench_permute_fwd},
    {"permute_bwd", bench_permute_bwd},
    {"combine", bench_combine_fwd},
    {"combine_bwd", bench_combine_bwd},
    {"grad_rows", bench_grad_rows},
    {"expert", bench_expert},
    {"grouped_gemm", bench_grouped_fwd},
    {"grouped_gemm_bwd", bench_grouped_bwd},
    {"grouped_pair", bench_grouped_pair_fwd},
    {"grouped_pair_bwd", bench_grouped_pair_bwd},
    {"pair_swiglu", bench_pair_swiglu},
    {"experts_ffn", bench_experts_ffn_fwd},
    {"experts_ffn_bwd", bench_experts_ffn_bwd},
    {"attention", bench_attention_fwd},
    {"attention_bwd", bench_attention_bwd},
    {"attention_bwd_qkv", bench_attention_bwd_qkv},
    {"rmsnorm", bench_rmsnorm_fwd},
    {"rmsnorm_bwd", bench_rmsnorm_bwd},
    {"rope", bench_rope_fwd},
    {"rope_bwd", bench_rope_bwd},
    {"rope16", bench_rope16_fwd},
    {"rope_qkv", bench_rope16_qkv},
    {"swiglu", bench_swiglu_fwd},
    {"swiglu_bwd", bench_swiglu_bwd},
    {"swiglu16", bench_swiglu16_fwd},
    {"swiglu16_bwd", bench_swiglu16_bwd},
    {"cross_entropy", bench_cross_entropy},
    {"adamw", bench_adamw},
    {"adamw16", bench_adamw16},
    {"adamw16_norm", bench_adamw16_norm},
    {"adamw16_master16", bench_adamw16_master16},
    {"grad_norm", bench_grad_norm},
};

/* ---- a2a: dispatch and combine between ranks --------------------------------------------------
 */

static struct {
    moe_comm *comm;
    ncclComm_t nccl;
    real *x, *logits, *probs, *lse, *wts, *xr, *wr, *eout, *back, *y, *xmid;
    int32_t *idx, *row_token, *row_slot, *slot_row, *erank, *elocal, *send_token, *lidx;
    int32_t *token_rows; /* (N, P): the row of each (token, destination) or -1 */
    int32_t *xrow_token; /* the experts' plan of the received rows: (m_x) received row */
    real *xperm;         /* (m_x, D): their tokens in expert order */
    int m_x;
    int x16;                /* the rows' token format (MOE_ROW_*), the model's for --precision */
    int *scratch, *offsets; /* offsets: host */
    int *send_rows, *recv_rows; /* host (P) */
    int *counts;                /* pinned host (MOE_PACK_COUNTS(P, E/P)) */
    int64_t *cnt_send, *cnt_recv;
    char *rows, *recv;
    size_t row_bytes;
    size_t *xc; /* (4P): counts and displacements of the exchange running */
    const void *src;
    void *dst;
    int n_send, n_recv;
} a2;

static void run_pack(void)
{
    gpu->moe_pack_dispatch(a2.rows, a2.send_token, a2.token_rows, a2.counts, a2.x, a2.idx, a2.wts,
                           a2.slot_row, a2.erank, a2.elocal, N_, opt.D, opt.K, world, opt.E / world,
                           a2.row_bytes, a2.x16);
    MOE_CK(gpu->queue_wait(gpu->queue_mark(), NULL,
                           NULL)); /* the counts, as the runtime waits for them */
    for (int p = 0; p < world; p++)
        a2.send_rows[p] = a2.counts[p];
    a2.n_send = a2.counts[2 * world];
}

static void run_counts(void)
{
    for (int p = 0; p < world; p++)
        a2.cnt_send[p] = a2.send_rows[p];
    MOE_CK(moe_comm_exchange_counts(a2.comm, a2.cnt_send, a2.cnt_recv, 1));
}

/* Byte counts and displacements of an exchange: send srows[p] and receive rrows[p] rows of
 * row_nbytes to and from each peer; returns the bytes this rank sends. */
static double set_exchange(const void *src, const int *srows, void *dst, const int *rrows,
                           size_t row_nbytes)
{
    const size_t so = moe_comm_row_layout(world, srows, rrows, row_nbytes, a2.xc);
    a2.src = src;
    a2.dst = dst;
    return (double)so;
}

static void run_exchange_comm(void)
{
    size_t *sc = a2.xc, *sd = sc + world, *rc = sd + world, *rd = rc + world;
    moe_comm_handle done;
    MOE_CK(moe_comm_exchange_start(a2.comm, a2.src, sc, sd, a2.dst, rc, rd, MOE_COMM_NONE, &done));
    MOE_CK(moe_comm_wait(a2.comm, done));
}

static void run_exchange_nccl(void)
{
    size_t *sc = a2.xc, *sd = sc + world, *rc = sd + world, *rd = rc + world;
    NCCL_CK(ncclGroupStart());
    for (int p = 0; p < world; p++) {
        if (sc[p])
            NCCL_CK(ncclSend((const char *)a2.src + sd[p], sc[p], ncclUint8, p, a2.nccl, stream));
        if (rc[p])
            NCCL_CK(ncclRecv((char *)a2.dst + rd[p], rc[p], ncclUint8, p, a2.nccl, stream));
    }
    NCCL_CK(ncclGroupEnd());
}

static void run_unpack(void)
{
    gpu->moe_unpack_dispatch(a2.xr, a2.wr, a2.lidx, a2.recv, a2.n_recv, opt.D, opt.K, a2.row_bytes,
                             a2.x16);
}

/* As runtime/model.c's experts' side at ep > 1: the received rows' weights and ids, then
 * (after their plan, made once in the setup) their tokens into expert order from the rows
 * themselves. */
static void run_unpack_permute(void)
{
    gpu->moe_unpack_dispatch(NULL, a2.wr, a2.lidx, a2.recv, a2.n_recv, opt.D, opt.K, a2.row_bytes,
                             a2.x16);
    gpu->moe_permute_rows(a2.xperm, a2.recv, a2.row_bytes, a2.x16, a2.xrow_token, a2.m_x, opt.D);
}

/* As runtime/model.c's layer_forward_end at ep > 1 (no shared experts): the returned rows
 * of each token summed through token_rows (K = P), then xmid added (the op's last). */
static void run_unpermute(void)
{
    gpu->moe_permute_backward(a2.y, NULL, a2.back, a2.send_token, a2.n_send, opt.D, a2.token_rows,
                              N_, world, a2.xmid);
}

static int want(const char *name) { return !opt.op || strcmp(opt.op, name) == 0; }

/* The exchange through the comm layer, then raw NCCL of the same bytes (its ceiling). */
static void bench_exchange(const char *op, const char *what, double bytes)
{
    double sum = bytes;
    MPI_CK(MPI_Allreduce(MPI_IN_PLACE, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
    const double avg = sum / world; /* bytes sent per rank, self included */
    char shape[64], raw_op[32], key[64];
    snprintf(shape, sizeof shape, "P=%d %s %.1f MB/rank", world, what, avg / 1e6);
    snprintf(raw_op, sizeof raw_op, "nccl_%s", op);
    snprintf(key, sizeof key, "%s", raw_op);
    double raw_ms = time_comm(run_exchange_nccl);
    report(raw_op, shape, raw_ms, avg, RATE_GBS, NULL);
    const ceiling *c = ceiling_add(key, avg / (raw_ms * 1e-3) / 1e9, "ncclSend/Recv same bytes");
    double ms = time_comm(run_exchange_comm);
    report(op, shape, ms, avg, RATE_GBS, c);
}

static void a2a_setup(void)
{
    const int N = N_, D = opt.D, E = opt.E, K = opt.K, P = world;
    /* the model's form (runtime/model.c): at a 16-bit precision the FFN norm's output h2
     * (x here) holds its 16-bit values (marked), the rows carry 16-bit tokens and the
     * received tokens are unpacked into a marked buffer */
    a2.x16 = opt.prec == MOE_PREC_BF16   ? MOE_ROW_BF16
             : opt.prec == MOE_PREC_FP16 ? MOE_ROW_FP16
                                         : MOE_ROW_FP32;
    a2.row_bytes = moe_dispatch_row_bytes(D, K, a2.x16);
    a2.send_rows = calloc((size_t)P, sizeof(int));
    a2.recv_rows = calloc((size_t)P, sizeof(int));
    a2.counts = gpu->alloc_host(sizeof(int) * (size_t)MOE_PACK_COUNTS(P, E / P));
    a2.cnt_send = calloc((size_t)P, sizeof(int64_t));
    a2.cnt_recv = calloc((size_t)P, sizeof(int64_t));
    a2.xc = calloc((size_t)4 * P, sizeof(size_t));
    a2.offsets = calloc((size_t)E + 1, sizeof(int));
    int32_t *er = calloc((size_t)E, sizeof(int32_t)), *el = calloc((size_t)E, sizeof(int32_t));
    real *lg = malloc(sizeof(real) * N * E);
    if (!a2.send_rows || !a2.recv_rows || !a2.counts || !a2.cnt_send || !a2.cnt_recv || !a2.xc ||
        !a2.offsets || !er || !el || !lg)
        die("out of host memory");
    for (int e = 0; e < E; e++) {
        er[e] = e / (E / P);
        el[e] = e % (E / P);
    }
    /* router logits of this rank's tokens (its own random stream): a dropless plan */
    for (size_t i = 0; i < (size_t)N * E; i++)
        lg[i] = (real)moe_rng_normal(SEED, 100 + (uint64_t)rank, i);
    a2.erank = dupload(er, sizeof(int32_t) * E);
    a2.elocal = dupload(el, sizeof(int32_t) * E);
    a2.logits = dupload(lg, sizeof(real) * N * E);
    free(er);
    free(el);
    free(lg);
    if (a2.x16 != MOE_ROW_FP32) {
        real *arena = dfill((size_t)D, 0.02, 0); /* a parameter arena for set_precision */
        use_precision(arena, (size_t)D, (size_t)N * D);
        a2.x = dfill16_as((size_t)N * D, 1.0, 0, a2.x16 == MOE_ROW_BF16, 0);
        mark(a2.x, (size_t)N * D);
    } else {
        a2.x = dfill((size_t)N * D, 1.0, 0);
    }
    a2.xmid = dfill((size_t)N * D, 1.0, 0);
    a2.probs = dreal((size_t)N * E);
    a2.lse = dreal((size_t)N);
    a2.wts = dreal((size_t)N * K);
    a2.idx = dmem(sizeof(int32_t) * N * K);
    a2.row_token = dmem(sizeof(int32_t) * N * K);
    a2.row_slot = dmem(sizeof(int32_t) * N * K);
    a2.slot_row = dmem(sizeof(int32_t) * N * K);
    a2.scratch = dmem(sizeof(int) * N * K);
    const int max_rows = N * (K < P ? K : P);
    a2.rows = dmem(a2.row_bytes * max_rows);
    a2.send_token = dmem(sizeof(int32_t) * max_rows);
    a2.token_rows = dmem(sizeof(int32_t) * (size_t)N * P);
    a2.back = dreal((size_t)max_rows * D);
    a2.y = dreal((size_t)N * D);
    gpu->router_forward(a2.probs, a2.lse, a2.idx, a2.wts, NULL, a2.logits, N, E, K, 1);
    gpu->moe_route_plan(a2.offsets, a2.row_token, a2.row_slot, a2.slot_row, a2.scratch, a2.idx,
                        a2.wts, N, E, K, N, -1);
    run_pack();
    run_counts();
    a2.n_recv = 0;
    for (int p = 0; p < P; p++) {
        if (a2.cnt_recv[p] < 0 || a2.cnt_recv[p] > INT_MAX - a2.n_recv)
            die("peer %d announces %lld rows", p, (long long)a2.cnt_recv[p]);
        a2.recv_rows[p] = (int)a2.cnt_recv[p];
        a2.n_recv += a2.recv_rows[p];
    }
    a2.recv = dmem(a2.row_bytes * (size_t)(a2.n_recv ? a2.n_recv : 1));
    a2.xr = dreal((size_t)(a2.n_recv ? a2.n_recv : 1) * D);
    if (a2.x16 != MOE_ROW_FP32)
        mark(a2.xr, (size_t)(a2.n_recv ? a2.n_recv : 1) * D);
    a2.wr = dreal((size_t)(a2.n_recv ? a2.n_recv : 1) * K);
    a2.lidx = dmem(sizeof(int32_t) * (a2.n_recv ? a2.n_recv : 1) * K);
    a2.eout = dfill((size_t)(a2.n_recv ? a2.n_recv : 1) * D, 1.0, 0);
    /* the rows once across, unpacked, and the experts' plan of them */
    const int R1 = a2.n_recv ? a2.n_recv : 1, El = E / P;
    set_exchange(a2.rows, a2.send_rows, a2.recv, a2.recv_rows, a2.row_bytes);
    run_exchange_comm();
    run_unpack();
    int *xoff = calloc((size_t)El + 1, sizeof(int));
    if (!xoff)
        die("out of host memory");
    a2.xrow_token = dmem(sizeof(int32_t) * R1 * K);
    int32_t *xrow_slot = dmem(sizeof(int32_t) * R1 * K),
            *xslot_row = dmem(sizeof(int32_t) * R1 * K);
    int *xscratch = dmem(sizeof(int) * ((size_t)R1 * K + El + 1));
    a2.m_x = gpu->moe_route_plan(xoff, a2.xrow_token, xrow_slot, xslot_row, xscratch, a2.lidx,
                                 a2.wr, a2.n_recv, El, K, R1, -1);
    free(xoff);
    a2.xperm = dreal((size_t)(a2.m_x ? a2.m_x : 1) * D);
    if (a2.x16 != MOE_ROW_FP32)
        mark(a2.xperm, (size_t)(a2.m_x ? a2.m_x : 1) * D);
    sync_or_die("the a2a setup");
}

static const char *a2a_ops[] = {"copy",     "pack_dispatch", "a2a_counts",
                                "dispatch", "unpack",        "unpack_permute",
                                "combine",  "unpermute",     NULL};

static void a2a_run(void)
{
    const int D = opt.D, K = opt.K, N = N_;
    const ceiling *c = copy_ceiling();
    char shape[64];
    a2a_setup();
    if (want("pack_dispatch")) {
        double ms = time_gpu(run_pack);
        /* per row: its token read, the row and its token's id written; per slot: idx, w,
         * slot_row read; token_rows (N, P) written */
        const double xw = a2.x16 == MOE_ROW_FP32 ? 4.0 : 2.0;
        double bytes = (double)a2.n_send * (D * xw + (double)a2.row_bytes + 4.0) + 12.0 * N * K +
                       4.0 * N * world;
        snprintf(shape, sizeof shape, "N=%d K=%d P=%d rows=%d x %zu B %s", N, K, world, a2.n_send,
                 a2.row_bytes, prec_name(opt.prec));
        report("pack_dispatch", shape, ms, bytes, RATE_GBS, c);
    }
    if (want("a2a_counts")) {
        double ms = time_comm(run_counts);
        snprintf(shape, sizeof shape, "P=%d one int64 per peer (MPI)", world);
        report("a2a_counts", shape, ms, 0, RATE_NONE, NULL);
    }
    if (want("dispatch")) {
        double bytes = set_exchange(a2.rows, a2.send_rows, a2.recv, a2.recv_rows, a2.row_bytes);
        bench_exchange("dispatch", "token rows", bytes);
    }
    if (want("unpack")) {
        double ms = time_gpu(run_unpack);
        const double xw = a2.x16 == MOE_ROW_FP32 ? 4.0 : 2.0;
        double bytes = (double)a2.n_recv * ((double)a2.row_bytes + xw * D + 8.0 * K);
        snprintf(shape, sizeof shape, "rows=%d D=%d K=%d %s", a2.n_recv, D, K, prec_name(opt.prec));
        report("unpack", shape, ms, bytes, RATE_GBS, c);
    }
    if (want("unpack_permute")) {
        double ms = time_gpu(run_unpack_permute);
        const double xw = a2.x16 == MOE_ROW_FP32 ? 4.0 : 2.0;
        /* the rows' weights and ids read, w and lidx written; per expert row its token read
         * and written, its received row's number read */
        double bytes = (double)a2.n_recv * 16.0 * K + (double)a2.m_x * (2.0 * xw * D + 4.0);
        snprintf(shape, sizeof shape, "rows=%d -> %d D=%d %s", a2.n_recv, a2.m_x, D,
                 prec_name(opt.prec));
        report("unpack_permute", shape, ms, bytes, RATE_GBS, c);
    }
    if (want("combine")) {
        /* expert outputs (R, D) back to the tokens' ranks: the dispatch counts reversed */
        double bytes = set_exchange(a2.eout, a2.recv_rows, a2.back, a2.send_rows, sizeof(real) * D);
        bench_exchange("combine", "expert rows", bytes);
    }
    if (want("unpermute")) {
        double ms = time_gpu(run_unpermute);
        /* the rows and xmid read, the layer's output written, token_rows read */
        double bytes = 4.0 * ((double)a2.n_send * D + 2.0 * N * D + (double)N * world);
        snprintf(shape, sizeof shape, "rows=%d D=%d (N=%d) + xmid", a2.n_send, D, N);
        report("unpermute", shape, ms, bytes, RATE_GBS, c);
    }
    free_all();
}

/* ---- main -------------------------------------------------------------------------------------
 */

static void usage(FILE *f)
{
    fprintf(f, "usage: moe-bench [a2a] [--op NAME] [--precision fp32|bf16|fp16] [--reps N]\n"
               "                 [--warmup N] [--B n] [--T n] [--D n] [--H n] [--E n] [--K n]\n"
               "                 [--F n] [--V n] [--L n] [--copy-mib n] [--rows-ratio R]\n"
               "                 [--out16 0|1] [--grads16 0|1] [--copy-equal 0|1] [--list]\n"
               "Times each op of the cuda backend (median of --reps runs) at the shape of\n"
               "configs/bench-h200.ini, against a copy-bandwidth or dense-GEMM ceiling measured\n"
               "in the same process. 'a2a' (under mpirun, one GPU per rank; one rank exchanges\n"
               "with itself): dispatch and combine through comm/ against raw NCCL of equal\n"
               "bytes. See docs/bench.md.\n");
}

static void list_ops(void)
{
    printf("single GPU:");
    for (size_t i = 0; i < sizeof single_ops / sizeof *single_ops; i++)
        printf(" %s", single_ops[i].name);
    printf("\na2a:");
    for (int i = 0; a2a_ops[i]; i++)
        printf(" %s", a2a_ops[i]);
    printf("\n");
}

static int parse_int(const char *flag, const char *s, int lo, int hi)
{
    char *end = NULL;
    long v = s ? strtol(s, &end, 10) : 0;
    if (!s || !*s || *end || v < lo || v > hi) {
        fprintf(stderr, "moe-bench: %s wants an integer in [%d, %d], got '%s'\n", flag, lo, hi,
                s ? s : "");
        exit(EXIT_USAGE);
    }
    return (int)v;
}

/* Returns 1 for a2a mode. Exits on bad usage. */
static int parse_args(int argc, char **argv)
{
    int a2a = 0;
    struct {
        const char *flag;
        int *v;
        int lo, hi;
    } ints[] = {
        {"--B", &opt.B, 1, 1 << 20},
        {"--T", &opt.T, 1, 1 << 24},
        {"--D", &opt.D, 1, 1 << 20},
        {"--H", &opt.H, 1, 4096},
        {"--E", &opt.E, 1, 4096},
        {"--K", &opt.K, 1, 4096},
        {"--F", &opt.F, 1, 1 << 20},
        {"--V", &opt.V, 1, 1 << 24},
        {"--L", &opt.L, 1, 1024},
        {"--reps", &opt.reps, 1, 10000},
        {"--warmup", &opt.warmup, 0, 1000},
        {"--copy-mib", &opt.copy_mib, 1, 1 << 20},
        {"--rows-ratio", &opt.rows_ratio, 1, 1000},
        {"--out16", &opt.out16, 0, 1},
        {"--grads16", &opt.grads16, 0, 1},
        {"--copy-equal", &opt.copy_equal, 0, 1},
    };
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        int done = 0;
        if (i == 1 && strcmp(f, "a2a") == 0) {
            a2a = 1;
            continue;
        }
        if (strcmp(f, "--help") == 0 || strcmp(f, "-h") == 0) {
            usage(stdout);
            exit(0);
        }
        if (strcmp(f, "--list") == 0) {
            list_ops();
            exit(0);
        }
        for (size_t j = 0; j < sizeof ints / sizeof *ints && !done; j++)
            if (strcmp(f, ints[j].flag) == 0) {
                *ints[j].v = parse_int(f, val, ints[j].lo, ints[j].hi);
                done = 1;
            }
        if (!done && strcmp(f, "--op") == 0 && val) {
            opt.op = val;
            done = 1;
        } else if (!done && strcmp(f, "--precision") == 0 && val) {
            if (strcmp(val, "fp32") == 0)
                opt.prec = MOE_PREC_FP32;
            else if (strcmp(val, "bf16") == 0)
                opt.prec = MOE_PREC_BF16;
            else if (strcmp(val, "fp16") == 0)
                opt.prec = MOE_PREC_FP16;
            else {
                fprintf(stderr, "moe-bench: --precision is fp32, bf16 or fp16, not '%s'\n", val);
                exit(EXIT_USAGE);
            }
            done = 1;
        }
        if (!done) {
            fprintf(stderr, "moe-bench: unknown or incomplete option '%s'\n", f);
            usage(stderr);
            exit(EXIT_USAGE);
        }
        i++; /* the value */
    }
    /* the shape: what the ops need and what their int arguments can hold */
    const char *bad = NULL;
    if (opt.D % opt.H || (opt.D / opt.H) % 2)
        bad = "D must be H times an even head dim";
    else if (opt.K > opt.E)
        bad = "K must not exceed E";
    else if ((long long)opt.B * opt.T * opt.K > INT_MAX / 2)
        bad = "B*T*K is too large for the ops' int sizes";
    else if (opt.grads16 && opt.prec != MOE_PREC_BF16)
        bad = "--grads16 1 needs --precision bf16 (bf16 gradients are those of bf16 weights)";
    if (bad) {
        fprintf(stderr, "moe-bench: %s\n", bad);
        exit(EXIT_USAGE);
    }
    if (opt.op) {
        int found = 0;
        if (a2a)
            for (int i = 0; a2a_ops[i]; i++)
                found |= strcmp(a2a_ops[i], opt.op) == 0;
        else
            for (size_t i = 0; i < sizeof single_ops / sizeof *single_ops; i++)
                found |= strcmp(single_ops[i].name, opt.op) == 0;
        if (!found) {
            fprintf(stderr, "moe-bench: no op '%s' in %s mode; the ops:\n", opt.op,
                    a2a ? "a2a" : "single-GPU");
            list_ops();
            exit(EXIT_USAGE);
        }
    }
    N_ = opt.B * opt.T;
    M_ = N_ * opt.K;
    Hd_ = opt.D / opt.H;
    return a2a;
}

/* Events, host patterns and the header, once the backend runs. */
static void start(void)
{
    stream = (cudaStream_t)gpu->native_stream();
    ev_start = calloc((size_t)opt.reps, sizeof(cudaEvent_t));
    ev_end = calloc((size_t)opt.reps, sizeof(cudaEvent_t));
    pat_normal = malloc(sizeof(real) * PATTERN);
    pat_pos = malloc(sizeof(real) * PATTERN);
    if (!ev_start || !ev_end || !pat_normal || !pat_pos)
        die("out of host memory");
    for (int i = 0; i < opt.reps; i++) {
        CUDA_CK(cudaEventCreate(&ev_start[i]));
        CUDA_CK(cudaEventCreate(&ev_end[i]));
    }
    for (size_t i = 0; i < PATTERN; i++) {
        pat_normal[i] = (real)moe_rng_normal(SEED, 1, i);
        pat_pos[i] = (real)(0.1 + moe_rng_uniform(SEED, 2, i));
    }
    int dev = 0;
    struct cudaDeviceProp prop;
    CUDA_CK(cudaGetDevice(&dev));
    CUDA_CK(cudaGetDeviceProperties(&prop, dev));
    if (rank == 0) {
        printf("moe-bench: %s (sm_%d), %d rank(s), GEMM precision %s, median of %d runs after "
               "%d warm-up\n",
               prop.name, gpu->compute_capability(), world, prec_name(opt.prec), opt.reps,
               opt.warmup);
        printf("shape: B=%d T=%d D=%d H=%d Hd=%d E=%d K=%d F=%d V=%d L=%d (N=%d tokens, M=%d "
               "routed rows)\n",
               opt.B, opt.T, opt.D, opt.H, Hd_, opt.E, opt.K, opt.F, opt.V, opt.L, N_, M_);
    }
    header();
}

static void finish(void)
{
    for (int i = 0; i < opt.reps; i++) {
        CUDA_CK(cudaEventDestroy(ev_start[i]));
        CUDA_CK(cudaEventDestroy(ev_end[i]));
    }
    free(ev_start);
    free(ev_end);
    free(pat_normal);
    free(pat_pos);
}

static int main_single(void)
{
    const char *why = NULL;
    if (!moe_backend_cuda(&why)) {
        printf("SKIP: no CUDA device (%s)\n", why ? why : "unknown");
        return EXIT_SKIP;
    }
    MOE_CK(moe_backend_select("cuda", &gpu));
    if (opt.prec == MOE_PREC_BF16 && gpu->compute_capability() < 80) {
        fprintf(stderr,
                "moe-bench: bf16 needs sm_80 or later (this GPU: sm_%d); try "
                "--precision fp16\n",
                gpu->compute_capability());
        return EXIT_USAGE;
    }
    start();
    for (size_t i = 0; i < sizeof single_ops / sizeof *single_ops; i++)
        if (want(single_ops[i].name))
            single_ops[i].run();
    finish();
    return 0;
}

static int main_a2a(int argc, char **argv)
{
    int provided = 0, local = 0;
    if (MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
        fprintf(stderr, "moe-bench: MPI_Init_thread failed\n");
        return 1;
    }
    MPI_Comm node;
    MPI_CK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
    MPI_CK(MPI_Comm_size(MPI_COMM_WORLD, &world));
    moe_log_set_rank(rank);
    MPI_CK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
    MPI_CK(MPI_Comm_rank(node, &local));
    MPI_CK(MPI_Comm_free(&node));
    char bus[32];
    const char *why = "no GPU for this rank";
    int ok = moe_cuda_pick_device(local, bus, sizeof bus) == MOE_OK && moe_backend_cuda(&why);
    int all_ok = 0;
    MPI_CK(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    if (!all_ok) {
        if (rank == 0)
            printf("SKIP: no CUDA device (%s)\n", ok ? "on some rank" : why);
        MPI_Finalize();
        return EXIT_SKIP;
    }
    if (opt.E % world) {
        if (rank == 0)
            fprintf(stderr, "moe-bench a2a: E (%d) must be divisible by the ranks (%d)\n", opt.E,
                    world);
        MPI_Finalize();
        return EXIT_USAGE;
    }
    MOE_CK(moe_backend_select("cuda", &gpu));
    start();
    MOE_CK(moe_comm_create(&a2.comm, world));
    MOE_CK(moe_comm_enable_device(a2.comm, gpu->native_stream()));
    ncclUniqueId id;
    if (rank == 0)
        NCCL_CK(ncclGetUniqueId(&id));
    MPI_CK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD));
    NCCL_CK(ncclCommInitRank(&a2.nccl, world, id, rank));
    a2a_run();
    NCCL_CK(ncclCommDestroy(a2.nccl));
    moe_comm_destroy(a2.comm);
    finish();
    free(a2.send_rows);
    free(a2.recv_rows);
    gpu->release_host(a2.counts);
    free(a2.cnt_send);
    free(a2.cnt_recv);
    free(a2.xc);
    free(a2.offsets);
    MPI_CK(MPI_Finalize());
    return 0;
}

int main(int argc, char **argv)
{
    int a2a = parse_args(argc, argv);
    return a2a ? main_a2a(argc, argv) : main_single();
}
