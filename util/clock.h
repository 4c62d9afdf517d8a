/* util/clock.h: the monotonic clock every timing in moe-dist reads. */
#ifndef MOE_UTIL_CLOCK_H
#define MOE_UTIL_CLOCK_H

#include <sched.h>
#include <time.h>

/* Seconds on CLOCK_MONOTONIC. */
static inline double moe_clock_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The pause between two polls of a wait that began at t0 (moe_clock_seconds()): for its
 * first MOE_POLL_YIELD_S it only yields the core, so that what ends within microseconds is
 * seen at once (a nap sleeps Linux's timer slack, 50 us by default, beyond what it asks;
 * the waits for NCCL's non-blocking calls, whose launch thread is done in tens of
 * microseconds, napped 100 us a poll until the fifty-sixth session), then it naps 20 us a
 * poll, so that a long wait leaves the core to the rest of the process. Either call only
 * pauses, so neither's result matters. */
#define MOE_POLL_YIELD_S 500e-6

static inline void moe_poll_pause(double t0)
{
    if (moe_clock_seconds() - t0 < MOE_POLL_YIELD_S) {
        (void)sched_yield();
        return;
    }
    struct timespec nap = {0, 20000};
    (void)nanosleep(&nap, NULL);
}

#endif
