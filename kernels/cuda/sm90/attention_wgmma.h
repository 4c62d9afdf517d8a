/* kernels/cuda/sm90/attention_wgmma.h: the entry points of the wgmma attention kernels
 * (attention_wgmma.cu, built where the architectures include 90: MOE_HAVE_SM90A), as
 * attention.cu calls them on compute capability 9.0 for head dim 64. Each returns 0
 * (recorded) when a kernel cannot take its shared memory. */
#pragma once
#include <stdint.h>

#include "kernels/real.h"

/* The forward from 16-bit q, k, v (B, T, H, 64; 16-byte aligned): bf16 or fp16 values;
 * out, lse as attention.cu's forward (o16: out holds 16-bit values); wg warpgroups a
 * block (1 or 2). */
extern "C" int cuda_wgmma_attention_forward(int bf16, real *out, real *lse, const uint16_t *q,
                                            const uint16_t *k, const uint16_t *v, int B, int T,
                                            int H, int o16, int wg);

/* The backward from 16-bit q, k, v and dout, after dsum (Di = dout_i . out_i): dq if dq,
 * dk and dv if either (dq16, dk16, dv16: 16-bit outputs); dq_wg, dkv_wg warpgroups a
 * block of each (1 or 2), dkv_stages the buffers of dk/dv's walk (2 or 3). dqkv non-NULL:
 * dq, dk and dv go into the rows of [dq | dk | dv] instead, dq and dk rotated back by rope
 * (cos_t, sin_t: (T, 32) tables). */
extern "C" int cuda_wgmma_attention_backward(int bf16, real *dq, real *dk, real *dv,
                                             const uint16_t *dout, const real *lse,
                                             const float *dsum, const uint16_t *q,
                                             const uint16_t *k, const uint16_t *v, int B, int T,
                                             int H, int dq16, int dk16, int dv16, int dq_wg,
                                             int dkv_wg, int dkv_stages, uint16_t *dqkv,
                                             const real *cos_t, const real *sin_t);
