/* bench/gemm_algos_probe.cu: a probe, not part of the build (scripts/gpu-gemm-algos.sh
 * compiles it with nvcc on the GPU host). The question it answers: would timing
 * cuBLASLt's candidate algorithms of each dense GEMM shape of the model, instead of
 * taking the heuristic's first (kernels/cuda/matmul.cu plan_build), make the step faster?
 *
 * Input (standard input), a line a shape, as the script writes them from the kernel
 * profile of `MOE_PROFILE_GEMM_SHAPES=1 moe-dist bench`:
 *   m n k ta tb out16 accumulate batch calls model_us
 * (column-major m n k as matmul.cu's gemm_on gets them; ta, tb 0/1; out16 1 for a 16-bit
 * output; accumulate 1 for beta 1; batch the strided batch's count; calls and the mean us
 * a call in the profile's two steps). Operands are bf16, compute and scale fp32, C fp32 or
 * bf16, every matrix contiguous (lda = ta ? k : m, ldb = tb ? n : k, ldc = m; a batch's
 * matrices one after another), pointers 256-byte aligned, the backend's 32 MiB workspace.
 *
 * For each shape: up to MAX_ALGOS heuristic results; each timed (3 warm-up calls, then
 * REPS calls between events, alone on the device); each one's output compared with the
 * first's (max |difference| over max |first|: a sanity check that the candidates compute
 * the same product). Printed: the first's and the fastest's us and TFLOP/s, their
 * configurations (tile, split-k, stages, cluster), and the time a step the fastest would
 * save at the profile's calls a step. The inputs are random (a hash of the index), so
 * the times are those of real data, not zeros. */
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>

#include "../kernels/cuda/fill_random.cuh"
#include "probe_check.h"

#define MAX_ALGOS 16
#define REPS 20
#define WS_BYTES ((size_t)32 << 20) /* the backend's WORKSPACE_BYTES */

/* max |a - b| over max |b|, for n values of C's type */
static __global__ void diff_kernel(const void *a, const void *b, size_t n, int out16, float *res)
{
    float d = 0.0f, m = 0.0f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float x, y;
        if (out16) {
            x = __bfloat162float(((const __nv_bfloat16 *)a)[i]);
            y = __bfloat162float(((const __nv_bfloat16 *)b)[i]);
        } else {
            x = ((const float *)a)[i];
            y = ((const float *)b)[i];
        }
        d = fmaxf(d, fabsf(x - y));
        m = fmaxf(m, fabsf(y));
    }
    atomicMax((int *)&res[0], __float_as_int(d)); /* non-negative floats order as ints */
    atomicMax((int *)&res[1], __float_as_int(m));
}

static int cfg(const cublasLtMatmulAlgo_t *a, cublasLtMatmulAlgoConfigAttributes_t attr)
{
    uint32_t v = 0;
    size_t got = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(a, attr, &v, sizeof v, &got) != CUBLAS_STATUS_SUCCESS)
        return -1;
    return (int)v;
}

static void describe(char *s, size_t n, const cublasLtMatmulAlgo_t *a)
{
    snprintf(s, n, "id %d tile %d splitk %d stages %d cluster %d", cfg(a, CUBLASLT_ALGO_CONFIG_ID),
             cfg(a, CUBLASLT_ALGO_CONFIG_TILE_ID), cfg(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
             cfg(a, CUBLASLT_ALGO_CONFIG_STAGES_ID), cfg(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
}

int main(void)
{
    cublasLtHandle_t lt;
    CB(cublasLtCreate(&lt));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    void *ws;
    CK(cudaMalloc(&ws, WS_BYTES));
    float *res;
    CK(cudaMalloc(&res, 2 * sizeof(float)));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double save_all = 0.0, first_all = 0.0, model_all = 0.0;
    int m, n, k, ta, tb, out16, acc, batch, calls;
    double model_us;
    printf("%-34s %5s %9s %9s %9s %7s %7s %9s  %s\n", "shape (m n k, ops, out, +=, batch)", "algos",
           "model us", "first us", "best us", "first", "best", "save/step",
           "first | best configuration, worst output difference");
    while (scanf("%d %d %d %d %d %d %d %d %d %lf", &m, &n, &k, &ta, &tb, &out16, &acc, &batch,
                 &calls, &model_us) == 10) {
        const size_t na = (size_t)m * k * batch, nb = (size_t)k * n * batch,
                     nc = (size_t)m * n * batch, cbytes = out16 ? 2 : 4;
        __nv_bfloat16 *A, *B;
        void *C, *C0, *Cin;
        CK(cudaMalloc(&A, na * 2));
        CK(cudaMalloc(&B, nb * 2));
        CK(cudaMalloc(&C, nc * cbytes));
        CK(cudaMalloc(&C0, nc * cbytes));
        CK(cudaMalloc(&Cin, nc * cbytes));
        moe_fill_random_kernel<<<1024, 256, 0, st>>>(A, na, 1u, CUDA_R_16BF, 1.0f);
        moe_fill_random_kernel<<<1024, 256, 0, st>>>(B, nb, 2u, CUDA_R_16BF, 1.0f);
        moe_fill_random_kernel<<<1024, 256, 0, st>>>(Cin, nc, 3u, out16 ? CUDA_R_16BF : CUDA_R_32F,
                                                     1.0f);
        CK(cudaGetLastError());
        cublasLtMatmulDesc_t op;
        cublasLtMatrixLayout_t la, lb, lc;
        const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
        CB(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
        CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
        CB(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, ta ? k : m, ta ? m : k, ta ? k : m));
        CB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, tb ? n : k, tb ? k : n, tb ? n : k));
        CB(cublasLtMatrixLayoutCreate(&lc, out16 ? CUDA_R_16BF : CUDA_R_32F, m, n, m));
        if (batch > 1) {
            const int32_t c = batch;
            const int64_t s[3] = {(int64_t)m * k, (int64_t)k * n, (int64_t)m * n};
            cublasLtMatrixLayout_t l[3] = {la, lb, lc};
            for (int i = 0; i < 3; i++) {
                CB(cublasLtMatrixLayoutSetAttribute(l[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &c,
                                                    sizeof c));
                CB(cublasLtMatrixLayoutSetAttribute(
                    l[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &s[i], sizeof s[i]));
            }
        }
        cublasLtMatmulPreference_t pref;
        const uint64_t wsl = WS_BYTES;
        CB(cublasLtMatmulPreferenceCreate(&pref));
        CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &wsl, sizeof wsl));
        cublasLtMatmulHeuristicResult_t r[MAX_ALGOS];
        int found = 0;
        CB(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, MAX_ALGOS, r, &found));
        const float alpha = 1.0f, beta = acc ? 1.0f : 0.0f;
        double first = -1.0, best = 1e30, worst_diff = 0.0;
        int best_i = -1, timed = 0;
        for (int i = 0; i < found; i++) {
            if (r[i].state != CUBLAS_STATUS_SUCCESS || r[i].workspaceSize > WS_BYTES)
                continue;
            /* C = Cin (+) A B into C: Cin is never written, so every call sees the same base */
            cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
            for (int w = 0; w < 3 && s == CUBLAS_STATUS_SUCCESS; w++)
                s = cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, Cin, lc, C, lc, &r[i].algo,
                                   ws, WS_BYTES, st);
            if (s != CUBLAS_STATUS_SUCCESS)
                continue; /* a candidate that refuses the call: skipped */
            CK(cudaEventRecord(e0, st));
            for (int w = 0; w < REPS; w++)
                CB(cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, Cin, lc, C, lc, &r[i].algo,
                                  ws, WS_BYTES, st));
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            const double us = 1000.0 * ms / REPS;
            if (first < 0) {
                first = us;
                CK(cudaMemcpyAsync(C0, C, nc * cbytes, cudaMemcpyDeviceToDevice, st));
            } else {
                CK(cudaMemsetAsync(res, 0, 2 * sizeof(float), st));
                diff_kernel<<<512, 256, 0, st>>>(C, C0, nc, out16, res);
                CK(cudaGetLastError());
                float h[2];
                CK(cudaMemcpyAsync(h, res, sizeof h, cudaMemcpyDeviceToHost, st));
                CK(cudaStreamSynchronize(st));
                const double rel = h[1] > 0 ? h[0] / h[1] : h[0];
                if (rel > worst_diff)
                    worst_diff = rel;
            }
            if (us < best) {
                best = us;
                best_i = i;
            }
            timed++;
        }
        char name[64], d0[96] = "-", d1[96] = "-";
        snprintf(name, sizeof name, "%d %d %d %c%c %s%s x%d", m, n, k, ta ? 'T' : 'N',
                 tb ? 'T' : 'N', out16 ? "16" : "32", acc ? " +=" : "", batch);
        if (timed) {
            int fi = 0;
            while (r[fi].state != CUBLAS_STATUS_SUCCESS)
                fi++;
            describe(d0, sizeof d0, &r[fi].algo);
            describe(d1, sizeof d1, &r[best_i].algo);
            const double fl = 2.0 * m * n * (double)k * batch;
            const double per_step = calls / 2.0; /* the profile covers two steps */
            const double save = per_step * (first - best);
            save_all += save;
            first_all += per_step * first;
            model_all += per_step * model_us;
            printf("%-34s %5d %9.1f %9.1f %9.1f %7.0f %7.0f %9.1f  %s | %s, %.2e\n", name, timed,
                   model_us, first, best, fl / first / 1e6, fl / best / 1e6, save, d0, d1,
                   worst_diff);
        } else {
            printf("%-34s no algorithm ran\n", name);
        }
        fflush(stdout);
        CB(cublasLtMatmulPreferenceDestroy(pref));
        CB(cublasLtMatrixLayoutDestroy(la));
        CB(cublasLtMatrixLayoutDestroy(lb));
        CB(cublasLtMatrixLayoutDestroy(lc));
        CB(cublasLtMatmulDescDestroy(op));
        CK(cudaFree(A));
        CK(cudaFree(B));
        CK(cudaFree(C));
        CK(cudaFree(C0));
        CK(cudaFree(Cin));
    }
    printf("a step: the model's %.1f us, the first algorithms alone %.1f us, the fastest "
           "would save %.1f us (TFLOP/s columns: the first's, the fastest's)\n",
           model_all, first_all, save_all);
    return 0;
}
