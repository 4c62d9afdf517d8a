/* util/rng.c: counter-based normal variates and name-derived streams. */
#include "util/rng.h"

#include <math.h>

double moe_rng_normal(uint64_t seed, uint64_t stream, uint64_t index)
{
    uint64_t a = moe_rng_u64(seed, stream, 2 * index);
    uint64_t b = moe_rng_u64(seed, stream, 2 * index + 1);
    double u1 = ((double)(a >> 11) + 1.0) * 0x1.0p-53; /* (0, 1] */
    double u2 = (double)(b >> 11) * 0x1.0p-53;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

uint64_t moe_rng_stream(const char *name)
{
    uint64_t h = 1469598103934665603ULL; /* FNV-1a, then mixed */
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
        h ^= *p;
        h *= 1099511628211ULL;
    }
    return moe_mix64(h);
}
