/* bench/update_sms_probe.cu: a probe, not part of the build (scripts/gpu-update-sms.sh
 * compiles it with nvcc for sm_90a on the GPU host). The question it answers: can the
 * update's pass run on a few SMs kept from the GEMMs, fast enough to hide beside them?
 *
 * 1. Bytes a second of an AdamW-like pass (bf16 p, g, m, v read; p, m, v written: 14
 *    bytes an element, the bench's expert update) on k SMs: with plain 16-byte loads (2
 *    or 4 groups in flight a thread) and with bulk copies (cp.async.bulk, one block an SM)
 *    through a ring of S stages of C elements of each array in shared memory, stored back
 *    by bulk copies too. The update's own kernel keeps about 64 KB in flight an SM (4
 *    blocks of 256 threads, one 16-byte load of each array), which the twenty-seventh
 *    session found too little on a few SMs.
 * 2. A loop of 8192^3 bf16 cuBLASLt GEMMs targeting n - k SMs
 *    (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET) alone, and with the bulk pass resident on k
 *    SMs beside it (launched first, on a stream of the least priority).
 * The arithmetic is AdamW's shape, not the runtime's bits: the figures are rates only. */
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <vector>
#include "probe_check.h"

__device__ __forceinline__ void adam8(uint4 &p, uint4 g, uint4 &m, uint4 &v)
{
    __nv_bfloat162 *pp = (__nv_bfloat162 *)&p, *mm = (__nv_bfloat162 *)&m,
                   *vv = (__nv_bfloat162 *)&v;
    const __nv_bfloat162 *gg = (const __nv_bfloat162 *)&g;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 P = __bfloat1622float2(pp[i]), G = __bfloat1622float2(gg[i]),
               M = __bfloat1622float2(mm[i]), V = __bfloat1622float2(vv[i]);
        M.x = 0.9f * M.x + 0.1f * G.x;
        M.y = 0.9f * M.y + 0.1f * G.y;
        V.x = 0.999f * V.x + 0.001f * G.x * G.x;
        V.y = 0.999f * V.y + 0.001f * G.y * G.y;
        P.x -= 1e-4f * (M.x / (sqrtf(V.x) + 1e-8f) + 0.01f * P.x);
        P.y -= 1e-4f * (M.y / (sqrtf(V.y) + 1e-8f) + 0.01f * P.y);
        pp[i] = __float22bfloat162_rn(P);
        mm[i] = __float22bfloat162_rn(M);
        vv[i] = __float22bfloat162_rn(V);
    }
}

// plain: each thread U uint4 of each array per iteration, grid-stride
template <int U>
__global__ void __launch_bounds__(512)
    plain(uint4 *p, const uint4 *g, uint4 *m, uint4 *v, size_t n8)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x * U;
    for (size_t i0 = (size_t)blockIdx.x * blockDim.x * U + threadIdx.x; i0 < n8; i0 += stride) {
        uint4 P[U], G[U], M[U], V[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            size_t i = i0 + (size_t)u * blockDim.x;
            if (i < n8) {
                P[u] = __ldcs(p + i);
                G[u] = __ldcs(g + i);
                M[u] = __ldcs(m + i);
                V[u] = __ldcs(v + i);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            size_t i = i0 + (size_t)u * blockDim.x;
            if (i < n8) {
                adam8(P[u], G[u], M[u], V[u]);
                __stcs(p + i, P[u]);
                __stcs(m + i, M[u]);
                __stcs(v + i, V[u]);
            }
        }
    }
}

__device__ __forceinline__ void bar_init(unsigned b)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(b) : "memory");
}
__device__ __forceinline__ void bar_expect(unsigned b, unsigned bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(b), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bar_wait(unsigned b, unsigned par)
{
    asm volatile("{\n.reg .pred done;\nW_%=:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], "
                 "%1;\n@!done bra W_%=;\n}\n" ::"r"(b),
                 "r"(par)
                 : "memory");
}
__device__ __forceinline__ void bulk_load(unsigned dst, const void *src, unsigned bytes, unsigned b)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                 "%2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(b)
                 : "memory");
}
__device__ __forceinline__ void bulk_store(void *dst, unsigned src, unsigned bytes)
{
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst),
                 "r"(src), "r"(bytes)
                 : "memory");
}

// bulk: one block an SM, S stages of C elements of each array (8 C bytes a stage)
template <int S, int C>
__global__ void __launch_bounds__(512, 1)
    bulk(uint16_t *p, const uint16_t *g, uint16_t *m, uint16_t *v, size_t n)
{
    extern __shared__ __align__(128) unsigned char sm[];
    const unsigned s0 = (unsigned)__cvta_generic_to_shared(sm);
    const unsigned bars = s0 + S * 8 * C;
    const size_t chunks = n / C; // n a multiple of C here
    const size_t my = chunks > blockIdx.x ? (chunks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    auto load = [&](size_t i) { // chunk i of this block into stage i % S
        const int st = i % S;
        const size_t c = (blockIdx.x + i * gridDim.x) * C;
        const unsigned d = s0 + st * 8 * C, b = bars + 8 * st;
        bar_expect(b, 8 * C);
        bulk_load(d, p + c, 2 * C, b);
        bulk_load(d + 2 * C, g + c, 2 * C, b);
        bulk_load(d + 4 * C, m + c, 2 * C, b);
        bulk_load(d + 6 * C, v + c, 2 * C, b);
    };
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++)
            bar_init(bars + 8 * s);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        for (size_t i = 0; i < S && i < my; i++)
            load(i);
    }
    __syncthreads();
    for (size_t i = 0; i < my; i++) {
        const int st = i % S;
        bar_wait(bars + 8 * st, (i / S) & 1);
        uint4 *P = (uint4 *)(sm + st * 8 * C), *G = (uint4 *)(sm + st * 8 * C + 2 * C),
              *M = (uint4 *)(sm + st * 8 * C + 4 * C), *V = (uint4 *)(sm + st * 8 * C + 6 * C);
        for (int j = threadIdx.x; j < C / 8; j += blockDim.x) {
            uint4 a = P[j], b = G[j], c = M[j], d = V[j];
            adam8(a, b, c, d);
            P[j] = a;
            M[j] = c;
            V[j] = d;
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        if (threadIdx.x == 0) {
            const size_t c = (blockIdx.x + i * gridDim.x) * C;
            const unsigned d = s0 + st * 8 * C;
            bulk_store(p + c, d, 2 * C);
            bulk_store(m + c, d + 4 * C, 2 * C);
            bulk_store(v + c, d + 6 * C, 2 * C);
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
            if (i >= 1 && i - 1 + S < my) { // refill the previous stage once its store has read it
                asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
                load(i - 1 + S);
            }
        }
    }
    if (threadIdx.x == 0)
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

struct Gemm {
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
    void *A, *B, *Cm, *ws;
    size_t wss = 64 << 20;
    int n;
    void init(int n_, int sms)
    {
        n = n_;
        CB(cublasLtCreate(&lt));
        CK(cudaMalloc(&A, (size_t)n * n * 2));
        CK(cudaMalloc(&B, (size_t)n * n * 2));
        CK(cudaMalloc(&Cm, (size_t)n * n * 2));
        CK(cudaMalloc(&ws, wss));
        CK(cudaMemset(A, 0x3c, (size_t)n * n * 2));
        CK(cudaMemset(B, 0x3c, (size_t)n * n * 2));
        CB(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t t = CUBLAS_OP_T;
        CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
        if (sms > 0)
            CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms,
                                              sizeof sms));
        CB(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, n, n, n));
        CB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, n, n, n));
        CB(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, n, n, n));
        cublasLtMatmulPreference_t pref;
        CB(cublasLtMatmulPreferenceCreate(&pref));
        CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &wss, sizeof wss));
        cublasLtMatmulHeuristicResult_t r;
        int got = 0;
        CB(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &r, &got));
        CB(cublasLtMatmulPreferenceDestroy(pref));
        if (!got) {
            printf("no algo\n");
            exit(1);
        }
        algo = r.algo;
    }
    void run(cudaStream_t s)
    {
        float a = 1, b = 0;
        CB(cublasLtMatmul(lt, op, &a, A, la, B, lb, &b, Cm, lc, Cm, lc, &algo, ws, wss, s));
    }
    /* ms for reps products on s, after 3 to warm up */
    float timed(cudaStream_t s, int reps, cudaEvent_t e0, cudaEvent_t e1)
    {
        for (int i = 0; i < 3; i++)
            run(s);
        CK(cudaEventRecord(e0, s));
        for (int i = 0; i < reps; i++)
            run(s);
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        return ms;
    }
    void fini()
    {
        CB(cublasLtMatrixLayoutDestroy(la));
        CB(cublasLtMatrixLayoutDestroy(lb));
        CB(cublasLtMatrixLayoutDestroy(lc));
        CB(cublasLtMatmulDescDestroy(op));
        CB(cublasLtDestroy(lt));
        CK(cudaFree(A));
        CK(cudaFree(B));
        CK(cudaFree(Cm));
        CK(cudaFree(ws));
    }
};

int main(void)
{
    int nsm;
    CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    const size_t n = (size_t)256 << 20; // elements an array: 512 MB each, 3.5 GB moved a pass
    uint16_t *p, *g, *m, *v;
    CK(cudaMalloc(&p, n * 2));
    CK(cudaMalloc(&g, n * 2));
    CK(cudaMalloc(&m, n * 2));
    CK(cudaMalloc(&v, n * 2));
    CK(cudaMemset(p, 0x3c, n * 2));
    CK(cudaMemset(g, 0x3a, n * 2));
    CK(cudaMemset(m, 0x30, n * 2));
    CK(cudaMemset(v, 0x30, n * 2));
    const double bytes = 14.0 * n;
    cudaEvent_t e0, e1, e2, e3;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventCreate(&e2));
    CK(cudaEventCreate(&e3));
    constexpr int S = 5, C = 4096;
    const int smem = S * 8 * C + 8 * S, smem6 = 6 * 8 * 4096 + 48, smem3 = 3 * 8 * 8192 + 24;
    CK(cudaFuncSetAttribute(bulk<S, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaFuncSetAttribute(bulk<6, 4096>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem6));
    CK(cudaFuncSetAttribute(bulk<3, 8192>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem3));
    // copy ceiling
    CK(cudaMemcpy(m, p, n * 2, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e0));
    CK(cudaMemcpy(m, p, n * 2, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    printf("SMs %d; copy %.0f GB/s\n", nsm, 2.0 * n * 2 / ms / 1e6);
    int ks[] = {1, 2, 4, 8, 16, 32, 132};
    printf("%6s %14s %14s %14s %14s %14s\n", "SMs", "plain U2 GB/s", "plain U4 GB/s", "bulk 5x32K",
           "bulk 6x32K", "bulk 3x64K");
    for (int k : ks) {
        if (k > nsm)
            k = nsm;
        float t[5];
        for (int w = 0; w < 5; w++) {
            for (int rep = 0; rep < 2; rep++) {
                CK(cudaEventRecord(e0));
                if (w == 0)
                    plain<2><<<k * 2, 512>>>((uint4 *)p, (const uint4 *)g, (uint4 *)m, (uint4 *)v,
                                             n / 8);
                if (w == 1)
                    plain<4><<<k * 2, 512>>>((uint4 *)p, (const uint4 *)g, (uint4 *)m, (uint4 *)v,
                                             n / 8);
                if (w == 2)
                    bulk<S, C><<<k, 512, smem>>>(p, g, m, v, n);
                if (w == 3)
                    bulk<6, 4096><<<k, 512, smem6>>>(p, g, m, v, n);
                if (w == 4)
                    bulk<3, 8192><<<k, 512, smem3>>>(p, g, m, v, n);
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                CK(cudaGetLastError());
                CK(cudaEventElapsedTime(&t[w], e0, e1));
            }
        }
        printf("%6d %14.0f %14.0f %14.0f %14.0f %14.0f\n", k, bytes / t[0] / 1e6,
               bytes / t[1] / 1e6, bytes / t[2] / 1e6, bytes / t[3] / 1e6, bytes / t[4] / 1e6);
    }
    // beside a GEMM loop: k bulk blocks launched first on a low-priority stream, then GEMMs
    // targeting nsm - k SMs on the other; GEMMs alone on nsm and on nsm - k SMs for reference
    int lo, hi;
    CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    cudaStream_t sg, sa;
    CK(cudaStreamCreateWithPriority(&sg, cudaStreamNonBlocking, hi));
    CK(cudaStreamCreateWithPriority(&sa, cudaStreamNonBlocking, lo));
    const int N = 8192, reps = 20;
    Gemm full;
    full.init(N, 0);
    const float tfull = full.timed(sg, reps, e0, e1);
    full.fini();
    // the whole pass alone at full width (plain U2, 2 blocks an SM x many)
    CK(cudaEventRecord(e0, sa));
    plain<2><<<nsm * 8, 512, 0, sa>>>((uint4 *)p, (const uint4 *)g, (uint4 *)m, (uint4 *)v, n / 8);
    CK(cudaEventRecord(e1, sa));
    CK(cudaEventSynchronize(e1));
    float tpass;
    CK(cudaEventElapsedTime(&tpass, e0, e1));
    printf("GEMM %d^3 x %d on all SMs: %.2f ms (%.0f TFLOP/s); the pass alone, all SMs: %.2f ms\n",
           N, reps, tfull, 2.0 * N * N * (double)N * reps / tfull / 1e9, tpass);
    printf("%4s %12s %12s %12s %12s %14s\n", "k", "gemm alone", "gemm beside", "pass beside",
           "pass GB/s", "alone+pass");
    for (int k : {4, 8, 12, 16}) {
        Gemm gk;
        gk.init(N, nsm - k);
        const float talone = gk.timed(sg, reps, e0, e1);
        CK(cudaEventRecord(e2, sa));
        bulk<S, C><<<k, 512, smem, sa>>>(p, g, m, v, n);
        CK(cudaEventRecord(e3, sa));
        CK(cudaEventRecord(e0, sg));
        for (int i = 0; i < reps; i++)
            gk.run(sg);
        CK(cudaEventRecord(e1, sg));
        CK(cudaDeviceSynchronize());
        CK(cudaGetLastError());
        float tb, tp;
        CK(cudaEventElapsedTime(&tb, e0, e1));
        CK(cudaEventElapsedTime(&tp, e2, e3));
        printf("%4d %12.2f %12.2f %12.2f %12.0f %14.2f\n", k, talone, tb, tp, bytes / tp / 1e6,
               tfull + tpass);
        gk.fini();
    }
    return 0;
}
