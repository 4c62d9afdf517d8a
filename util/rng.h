/* util/rng.h: counter-based random numbers. A value depends only on (seed, stream,
 * index), never on call order, so the same weights and data arise at any world size,
 * expert-parallel degree or thread count. */
#ifndef MOE_UTIL_RNG_H
#define MOE_UTIL_RNG_H

#include <stdint.h>

/* A well-mixed 64-bit hash (splitmix64 finaliser). */
static inline uint64_t moe_mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static inline uint64_t moe_rng_u64(uint64_t seed, uint64_t stream, uint64_t index)
{
    return moe_mix64(moe_mix64(moe_mix64(seed) ^ stream) ^ index);
}

/* Uniform in [0, 1), 53 bits. */
static inline double moe_rng_uniform(uint64_t seed, uint64_t stream, uint64_t index)
{
    return (double)(moe_rng_u64(seed, stream, index) >> 11) * 0x1.0p-53;
}

/* Standard normal (Box-Muller on two uniforms of the same counter). */
double moe_rng_normal(uint64_t seed, uint64_t stream, uint64_t index);

/* Stream id from a name ("layers.3.moe.expert.5.w1"), so tensors get distinct streams. */
uint64_t moe_rng_stream(const char *name);

#endif
