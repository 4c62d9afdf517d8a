/* util/clock.h: the monotonic clock every timing in moe-dist reads. */
#ifndef MOE_UTIL_CLOCK_H
#define MOE_UTIL_CLOCK_H

#include <time.h>

/* Seconds on CLOCK_MONOTONIC. */
static inline double moe_clock_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif
