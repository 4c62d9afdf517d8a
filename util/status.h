/* util/status.h: the status every library function returns, and the macros that
 * propagate it. Library code (comm/, runtime/, kernels/, sched/) never exits: it
 * returns a moe_status and logs "host:rank file:line" at each level it passes, so a
 * failure prints its path. Only launcher/ ends the job.
 *
 * Owns: moe_status, MOE_CHECK/MOE_FAIL, the log prefix, moe_log.
 * Does not own: what to do about a failure (launcher/ decides). */
#ifndef MOE_UTIL_STATUS_H
#define MOE_UTIL_STATUS_H

#include <stddef.h>

typedef enum {
    MOE_OK = 0,
    MOE_ERR_INVALID = 1, /* bad argument or user input (config, data, command line) */
    MOE_ERR_IO = 2,      /* a file could not be read or written */
    MOE_ERR_NOMEM = 3,   /* an allocation failed */
    MOE_ERR_COMM = 4,    /* MPI or NCCL failure, timeout, lost peer */
    MOE_ERR_DEVICE = 5,  /* CUDA / cuBLAS failure */
    MOE_ERR_NUMERIC = 6, /* non-finite values where none are allowed */
} moe_status;

/* Name of a status, for messages ("invalid input", ...). Never NULL. */
const char *moe_status_str(moe_status st);

/* Sets the "host:rank" prefix used by every message. Called once by the launcher;
 * before that, messages start with "host:?". */
void moe_log_set_rank(int rank);

/* Prints "host:rank: " + the formatted message + newline to stderr. */
void moe_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Prints "host:rank: file:line: " + message to stderr (one link of a failure path). */
void moe_log_at(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Evaluate a moe_status expression; on failure log this file:line and return it. */
#define MOE_CHECK(expr)                                                                            \
    do {                                                                                           \
        moe_status moe_st_ = (expr);                                                               \
        if (moe_st_ != MOE_OK) {                                                                   \
            moe_log_at(__FILE__, __LINE__, "%s <- %s", moe_status_str(moe_st_), #expr);            \
            return moe_st_;                                                                        \
        }                                                                                          \
    } while (0)

/* Same, but jump to the function's cleanup label `fail` with `st` set. */
#define MOE_CHECK_GOTO(st, expr)                                                                   \
    do {                                                                                           \
        (st) = (expr);                                                                             \
        if ((st) != MOE_OK) {                                                                      \
            moe_log_at(__FILE__, __LINE__, "%s <- %s", moe_status_str(st), #expr);                 \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

/* Log a message at this file:line and return `code`. */
#define MOE_FAIL(code, ...)                                                                        \
    do {                                                                                           \
        moe_log_at(__FILE__, __LINE__, __VA_ARGS__);                                               \
        return (code);                                                                             \
    } while (0)

#endif
