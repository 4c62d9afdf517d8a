/* util/fault.h: fault injection for tests, from the environment variable MOE_FAULT:
 *   MOE_FAULT=KIND@RANK:STEP   e.g. "fail@1:3"
 * KIND: fail (the rank returns an error at the start of that step: the library path a
 * real failure takes), exit (the process ends at once with status 9, as if killed),
 * hang (the rank stops answering: sleeps forever), ckptcrash (the process ends with
 * status 9 halfway through writing its file of the checkpoint of step STEP, as a crash
 * mid-save), nan (a NaN is written into the first gradient of the last layer on that
 * rank at step STEP, before the gradients are reduced).
 * Unset or empty: no fault. A malformed value is an error naming the variable. */
#ifndef MOE_UTIL_FAULT_H
#define MOE_UTIL_FAULT_H

#include "util/status.h"

typedef enum {
    MOE_FAULT_NONE,
    MOE_FAULT_FAIL,
    MOE_FAULT_EXIT,
    MOE_FAULT_HANG,
    MOE_FAULT_CKPTCRASH,
    MOE_FAULT_NAN
} moe_fault_kind;

typedef struct {
    moe_fault_kind kind;
    int rank, step;
} moe_fault;

/* Parses MOE_FAULT into f. */
moe_status moe_fault_from_env(moe_fault *f);

/* Triggers the fault if it is for (rank, step): returns MOE_ERR_INVALID for "fail"
 * (after logging), never returns for "exit" and "hang"; MOE_OK otherwise. */
moe_status moe_fault_check(const moe_fault *f, int rank, int step);

/* Called by the checkpoint writer halfway through its file: ends the process at once
 * (status 9) for ckptcrash at (rank, step); returns otherwise. */
void moe_fault_ckpt_point(const moe_fault *f, int rank, int step);

/* Whether a NaN is to be injected into this rank's gradients at this step. */
int moe_fault_nan_due(const moe_fault *f, int rank, int step);

#endif
