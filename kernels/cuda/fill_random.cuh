/* kernels/cuda/fill_random.cuh: random operands on the device, for the GEMM timings
 * (matmul.cu's candidate timing and GEMM ceiling, bench/gemm_algos_probe.cu): n values
 * scale * [-1, 1) of type t (CUDA_R_32F, CUDA_R_16BF or CUDA_R_16F) at p, each a hash of
 * its index (all 64 bits) and the seed, so different seeds give different operands and
 * the times are those of real data, not zeros. Needs only the CUDA headers. */
#ifndef MOE_KERNELS_CUDA_FILL_RANDOM_CUH
#define MOE_KERNELS_CUDA_FILL_RANDOM_CUH
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <library_types.h>
#include <stdint.h>

static __global__ void moe_fill_random_kernel(void *p, size_t n, uint32_t seed, int t, float scale)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = ((uint32_t)i ^ (uint32_t)(i >> 32) * 668265263u) * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        const float v = scale * ((float)(h & 0xffffu) / 32768.0f - 1.0f);
        if (t == CUDA_R_32F)
            ((float *)p)[i] = v;
        else if (t == CUDA_R_16BF)
            ((__nv_bfloat16 *)p)[i] = __float2bfloat16(v);
        else
            ((__half *)p)[i] = __float2half(v);
    }
}
#endif
