/* tests/gpu/emu/emu.cpp: the fiber scheduler behind the emulated launches, device memory
 * (poisoned with 0xA5 so reads of unwritten memory show) and the naive cuBLASLt. A launch
 * with an empty grid, a block that is not a whole number of warps, more than 48 KiB of
 * dynamic shared memory, a deadlock, or a warp intrinsic some of whose lanes have exited
 * aborts with a message. */
#include <stdio.h>
#include <ucontext.h>
#include <vector>

#include "cublasLt.h"
#include "cuda_runtime.h"

dim3 emu_threadIdx, emu_blockIdx, emu_blockDim, emu_gridDim;
void *emu_dyn_smem;
long emu_launches, emu_switches;

enum { READY, AT_BLOCK, AT_WARP, DONE };
struct Fiber {
    ucontext_t ctx;
    int state;
    dim3 tid;
    int linear;
};
static ucontext_t sched_ctx;
static Fiber *fibers;
static char *stacks;
static int cap_threads;
static Fiber *cur;
static std::function<void()> *body;
static uint64_t warp_slots[32][32];
static const size_t STACK = 128 * 1024;

static void entry(void)
{
    (*body)();
    cur->state = DONE;
    swapcontext(&cur->ctx, &sched_ctx);
}

void emu_barrier_block()
{
    cur->state = AT_BLOCK;
    swapcontext(&cur->ctx, &sched_ctx);
}
void emu_barrier_warp()
{
    cur->state = AT_WARP;
    swapcontext(&cur->ctx, &sched_ctx);
}
int emu_lane() { return cur->linear & 31; }
uint64_t *emu_warp_slots() { return warp_slots[cur->linear >> 5]; }

void emu_launch(dim3 grid, dim3 block, size_t smem, std::function<void()> fn)
{
    const int nt = block.x * block.y * block.z;
    emu_launches++;
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || nt == 0 || nt > 1024 || nt % 32) {
        fprintf(stderr, "EMU: bad launch grid (%u,%u,%u) block (%u,%u,%u)\n", grid.x, grid.y,
                grid.z, block.x, block.y, block.z);
        abort();
    }
    if (smem > 48 * 1024) {
        fprintf(stderr, "EMU: dynamic shared memory %zu > 48 KiB\n", smem);
        abort();
    }
    if (nt > cap_threads) {
        free(fibers);
        free(stacks);
        fibers = (Fiber *)calloc(nt, sizeof(Fiber));
        stacks = (char *)malloc((size_t)nt * STACK);
        cap_threads = nt;
    }
    body = &fn;
    emu_blockDim = block;
    emu_gridDim = grid;
    void *sm = malloc(smem ? smem : 1);
    emu_dyn_smem = sm;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                memset(sm, 0x7f, smem ? smem : 1);
                emu_blockIdx = dim3(bx, by, bz);
                for (int t = 0; t < nt; t++) {
                    Fiber *f = &fibers[t];
                    getcontext(&f->ctx);
                    f->ctx.uc_stack.ss_sp = stacks + (size_t)t * STACK;
                    f->ctx.uc_stack.ss_size = STACK;
                    f->ctx.uc_link = NULL;
                    makecontext(&f->ctx, entry, 0);
                    f->state = READY;
                    f->tid = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
                    f->linear = t;
                }
                for (;;) {
                    for (int t = 0; t < nt; t++)
                        if (fibers[t].state == READY) {
                            cur = &fibers[t];
                            emu_threadIdx = cur->tid;
                            emu_switches++;
                            swapcontext(&sched_ctx, &cur->ctx);
                        }
                    int alive = 0, at_block = 0, released = 0;
                    for (int t = 0; t < nt; t++) {
                        alive += fibers[t].state != DONE;
                        at_block += fibers[t].state == AT_BLOCK;
                    }
                    if (!alive)
                        break;
                    if (at_block == alive) {
                        for (int t = 0; t < nt; t++)
                            if (fibers[t].state == AT_BLOCK)
                                fibers[t].state = READY;
                        continue;
                    }
                    for (int w = 0; w < nt / 32; w++) {
                        int at = 0, done = 0;
                        for (int l = 0; l < 32; l++) {
                            at += fibers[w * 32 + l].state == AT_WARP;
                            done += fibers[w * 32 + l].state == DONE;
                        }
                        if (at == 32) {
                            for (int l = 0; l < 32; l++)
                                fibers[w * 32 + l].state = READY;
                            released = 1;
                        } else if (at > 0 && at + done == 32) {
                            fprintf(stderr, "EMU: warp op with exited lanes\n");
                            abort();
                        }
                    }
                    if (!released) {
                        fprintf(stderr, "EMU: deadlock in block (%u,%u,%u): alive %d at_block %d\n",
                                bx, by, bz, alive, at_block);
                        abort();
                    }
                }
            }
    free(sm);
}

cudaError_t cudaMalloc(void **p, size_t n)
{
    *p = malloc(n ? n : 1);
    memset(*p, 0xA5, n);
    return cudaSuccess;
}
cudaError_t cudaFree(void *p)
{
    free(p);
    return cudaSuccess;
}
cudaError_t cudaMallocHost(void **p, size_t n) { return cudaMalloc(p, n); }
cudaError_t cudaFreeHost(void *p)
{
    free(p);
    return cudaSuccess;
}

/* ---- cuBLASLt ---- */
cublasStatus_t cublasLtCreate(cublasLtHandle_t *h)
{
    *h = (void *)1;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t) { return CUBLAS_STATUS_SUCCESS; }
const char *cublasLtGetStatusString(cublasStatus_t s) { return s ? "emulated failure" : "success"; }
const char *cublasLtGetStatusName(cublasStatus_t s)
{
    return s ? "CUBLAS_STATUS_EMU" : "CUBLAS_STATUS_SUCCESS";
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t c,
                                        cudaDataType_t t)
{
    if (c != CUBLAS_COMPUTE_32F || t != CUDA_R_32F)
        return CUBLAS_STATUS_INVALID_VALUE;
    *d = new emu_lt_desc{0, 0};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d)
{
    delete d;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t a, const void *v,
                                              size_t n)
{
    if (n != sizeof(cublasOperation_t))
        return CUBLAS_STATUS_INVALID_VALUE;
    int op = *(const cublasOperation_t *)v;
    if (a == CUBLASLT_MATMUL_DESC_TRANSA)
        d->ta = op;
    else
        d->tb = op;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType_t, uint64_t rows,
                                          uint64_t cols, int64_t ld)
{
    if ((int64_t)rows > ld || rows == 0 || cols == 0) {
        fprintf(stderr, "EMU: bad layout %llu x %llu ld %lld\n", (unsigned long long)rows,
                (unsigned long long)cols, (long long)ld);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    *l = new emu_lt_layout{(int)rows, (int)cols, (int)ld};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l)
{
    delete l;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p)
{
    *p = (void *)1;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t)
{
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t,
                                                    cublasLtMatmulPreferenceAttributes_t a,
                                                    const void *, size_t n)
{
    if (a == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES ? n != 8 : n != 4)
        return CUBLAS_STATUS_INVALID_VALUE;
    return CUBLAS_STATUS_SUCCESS;
}
long emu_heuristics;
static int dims_ok(const emu_lt_desc *op, const emu_lt_layout *la, const emu_lt_layout *lb,
                   const emu_lt_layout *lc, int *k)
{
    const int m = lc->rows, n = lc->cols;
    *k = op->ta ? la->rows : la->cols;
    int okA = op->ta ? la->cols == m : la->rows == m;
    int okB = op->tb ? (lb->rows == n && lb->cols == *k) : (lb->rows == *k && lb->cols == n);
    if (!okA || !okB) {
        fprintf(stderr, "EMU: inconsistent GEMM layouts: A %dx%d B %dx%d C %dx%d ta %d tb %d\n",
                la->rows, la->cols, lb->rows, lb->cols, lc->rows, lc->cols, op->ta, op->tb);
        return 0;
    }
    return 1;
}
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t op,
                                              cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                                              cublasLtMatrixLayout_t lc, cublasLtMatrixLayout_t ld,
                                              cublasLtMatmulPreference_t, int req,
                                              cublasLtMatmulHeuristicResult_t *res, int *found)
{
    int k;
    emu_heuristics++;
    if (req < 1 || lc != ld || !dims_ok(op, la, lb, lc, &k))
        return CUBLAS_STATUS_INVALID_VALUE;
    memset(res, 0, sizeof *res);
    *found = 1;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t op, const void *alpha,
                              const void *A, cublasLtMatrixLayout_t la, const void *B,
                              cublasLtMatrixLayout_t lb, const void *beta, const void *C,
                              cublasLtMatrixLayout_t lc, void *D, cublasLtMatrixLayout_t ld,
                              const cublasLtMatmulAlgo_t *, void *, size_t, cudaStream_t)
{
    int k;
    if (!dims_ok(op, la, lb, lc, &k) || ld->rows != lc->rows || ld->cols != lc->cols)
        return CUBLAS_STATUS_INVALID_VALUE;
    const float *a = (const float *)A, *b = (const float *)B, *c = (const float *)C;
    float *d = (float *)D;
    const float al = *(const float *)alpha, be = *(const float *)beta;
    const int m = lc->rows, n = lc->cols;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            double s = 0;
            for (int p = 0; p < k; p++) {
                double x = op->ta ? a[p + (size_t)i * la->ld] : a[i + (size_t)p * la->ld];
                double y = op->tb ? b[j + (size_t)p * lb->ld] : b[p + (size_t)j * lb->ld];
                s += x * y;
            }
            double r = al * s;
            if (be != 0)
                r += be * c[i + (size_t)j * lc->ld];
            d[i + (size_t)j * ld->ld] = (float)r;
        }
    return CUBLAS_STATUS_SUCCESS;
}
extern long emu_heuristics;
__attribute__((destructor)) static void emu_report(void)
{
    fprintf(stderr, "EMU: %ld launches, %ld fiber switches, %ld GEMM heuristics\n", emu_launches,
            emu_switches, emu_heuristics);
}
