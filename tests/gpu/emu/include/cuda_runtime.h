/* tests/gpu/emu/include/cuda_runtime.h: a small CPU emulation of the CUDA runtime and of
 * the device intrinsics kernels/cuda uses, to run the cuda backend's kernels on a machine
 * without a GPU (tests/gpu/emu/run.sh). Each CUDA thread is a fiber (ucontext);
 * __syncthreads and the warp intrinsics are barriers of the block or the warp; blocks run
 * one after another, so __shared__ variables are plain statics. It checks indexing and
 * synchronisation structure, not GPU numerics, memory ordering or speed. */
#pragma once
#include <functional>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
extern dim3 emu_threadIdx, emu_blockIdx, emu_blockDim, emu_gridDim;
#define threadIdx emu_threadIdx
#define blockIdx emu_blockIdx
#define blockDim emu_blockDim
#define gridDim emu_gridDim
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

extern void *emu_dyn_smem;
void emu_launch(dim3 grid, dim3 block, size_t smem, std::function<void()> body);
void emu_barrier_block(void);
void emu_barrier_warp(void);
int emu_lane(void);
uint64_t *emu_warp_slots(void);

typedef enum {
    cudaSuccess = 0,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidValue = 1
} cudaError_t;
typedef enum {
    cudaMemcpyHostToHost,
    cudaMemcpyHostToDevice,
    cudaMemcpyDeviceToHost,
    cudaMemcpyDeviceToDevice
} cudaMemcpyKind;
typedef void *cudaStream_t;
#define cudaStreamNonBlocking 1
typedef enum {
    cudaDevAttrComputeCapabilityMajor,
    cudaDevAttrComputeCapabilityMinor
} cudaDeviceAttr;
struct cudaFuncAttributes {
    int dummy;
};

static inline const char *cudaGetErrorString(cudaError_t e)
{
    return e ? "emulated error" : "no error";
}
static inline const char *cudaGetErrorName(cudaError_t e)
{
    return e ? "cudaErrorEmu" : "cudaSuccess";
}
static inline cudaError_t cudaGetDeviceCount(int *c)
{
    *c = 1;
    return cudaSuccess;
}
static inline cudaError_t cudaGetDevice(int *d)
{
    *d = 0;
    return cudaSuccess;
}
static inline cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int)
{
    *v = a == cudaDevAttrComputeCapabilityMajor ? 7 : 5;
    return cudaSuccess;
}
template <class F> static inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *, F)
{
    return cudaSuccess;
}
static inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, int)
{
    *s = (void *)1;
    return cudaSuccess;
}
static inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaMalloc(void **p, size_t n);
template <class T> static inline cudaError_t cudaMalloc(T **p, size_t n)
{
    return cudaMalloc((void **)p, n);
}
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t n);
template <class T> static inline cudaError_t cudaMallocHost(T **p, size_t n)
{
    return cudaMallocHost((void **)p, n);
}
cudaError_t cudaFreeHost(void *p);
static inline cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t)
{
    memset(p, v, n);
    return cudaSuccess;
}
static inline cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind,
                                          cudaStream_t)
{
    memmove(d, s, n);
    return cudaSuccess;
}
static inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
static inline cudaError_t cudaGetLastError(void) { return cudaSuccess; }

/* ---- device intrinsics ---- */
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline float __fadd_rn(float a, float b)
{
    volatile float r = a + b;
    return r;
}
static inline float __fsub_rn(float a, float b)
{
    volatile float r = a - b;
    return r;
}
static inline float __fmul_rn(float a, float b)
{
    volatile float r = a * b;
    return r;
}
static inline double __dadd_rn(double a, double b)
{
    volatile double r = a + b;
    return r;
}
static inline double __dsub_rn(double a, double b)
{
    volatile double r = a - b;
    return r;
}
static inline double __dmul_rn(double a, double b)
{
    volatile double r = a * b;
    return r;
}
static inline double __ddiv_rn(double a, double b)
{
    volatile double r = a / b;
    return r;
}
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline int atomicAdd(int *p, int v)
{
    int o = *p;
    *p = o + v;
    return o;
}
static inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v)
{
    unsigned long long o = *p;
    *p = o + v;
    return o;
}
static inline void __syncthreads(void) { emu_barrier_block(); }
static inline void __syncwarp(unsigned mask = 0xffffffffu)
{
    (void)mask;
    emu_barrier_warp();
}

template <class T> static inline T emu_shfl_from(T v, int src, int use_own_if_invalid)
{
    uint64_t *slots = emu_warp_slots();
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof v);
    slots[emu_lane()] = bits;
    emu_barrier_warp();
    T r = v;
    if (src >= 0 && src < 32)
        memcpy(&r, &slots[src], sizeof r);
    else if (!use_own_if_invalid)
        abort();
    emu_barrier_warp();
    return r;
}
template <class T> static inline T __shfl_sync(unsigned, T v, int src)
{
    return emu_shfl_from(v, src & 31, 0);
}
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int o)
{
    return emu_shfl_from(v, emu_lane() ^ o, 0);
}
template <class T> static inline T __shfl_up_sync(unsigned, T v, unsigned d)
{
    return emu_shfl_from(v, emu_lane() - (int)d, 1);
}
static inline unsigned __match_any_sync(unsigned, int v)
{
    uint64_t *slots = emu_warp_slots();
    slots[emu_lane()] = (uint64_t)(uint32_t)v;
    emu_barrier_warp();
    unsigned m = 0;
    for (int l = 0; l < 32; l++)
        if (slots[l] == (uint64_t)(uint32_t)v)
            m |= 1u << l;
    emu_barrier_warp();
    return m;
}
