/* util/fault.c: MOE_FAULT parsing and triggering (see fault.h). */
#include "util/fault.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

moe_status moe_fault_from_env(moe_fault *f)
{
    memset(f, 0, sizeof *f);
    const char *v = getenv("MOE_FAULT");
    if (!v || !*v)
        return MOE_OK;
    char kind[16];
    int rank, step, used = 0;
    if (sscanf(v, "%15[a-z]@%d:%d%n", kind, &rank, &step, &used) != 3 || v[used] != '\0' ||
        rank < 0 || step < 0)
        MOE_FAIL(MOE_ERR_INVALID, "MOE_FAULT='%s': expected KIND@RANK:STEP, e.g. fail@1:3", v);
    if (strcmp(kind, "fail") == 0)
        f->kind = MOE_FAULT_FAIL;
    else if (strcmp(kind, "exit") == 0)
        f->kind = MOE_FAULT_EXIT;
    else if (strcmp(kind, "hang") == 0)
        f->kind = MOE_FAULT_HANG;
    else if (strcmp(kind, "ckptcrash") == 0)
        f->kind = MOE_FAULT_CKPTCRASH;
    else if (strcmp(kind, "nan") == 0)
        f->kind = MOE_FAULT_NAN;
    else
        MOE_FAIL(MOE_ERR_INVALID,
                 "MOE_FAULT='%s': unknown kind '%s' (fail, exit, hang, ckptcrash, nan)", v, kind);
    f->rank = rank;
    f->step = step;
    return MOE_OK;
}

moe_status moe_fault_check(const moe_fault *f, int rank, int step)
{
    if (f->kind == MOE_FAULT_NONE || f->rank != rank || f->step != step)
        return MOE_OK;
    switch (f->kind) {
    case MOE_FAULT_FAIL: MOE_FAIL(MOE_ERR_INVALID, "MOE_FAULT: injected failure at step %d", step);
    case MOE_FAULT_EXIT: moe_log("MOE_FAULT: injected exit at step %d", step); _exit(9);
    case MOE_FAULT_HANG:
        moe_log("MOE_FAULT: injected hang at step %d", step);
        for (;;)
            pause();
    case MOE_FAULT_NONE:
    case MOE_FAULT_CKPTCRASH:
    case MOE_FAULT_NAN: break;
    }
    return MOE_OK;
}

void moe_fault_ckpt_point(const moe_fault *f, int rank, int step)
{
    if (f->kind != MOE_FAULT_CKPTCRASH || f->rank != rank || f->step != step)
        return;
    moe_log("MOE_FAULT: injected crash halfway through writing the checkpoint of step %d", step);
    _exit(9);
}

int moe_fault_nan_due(const moe_fault *f, int rank, int step)
{
    return f->kind == MOE_FAULT_NAN && f->rank == rank && f->step == step;
}
