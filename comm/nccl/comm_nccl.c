/* comm/nccl/comm_nccl.c: NCCL communicators and GPU collectives (see comm_nccl.h). */
#include "comm/nccl/comm_nccl.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdlib.h>
#include <time.h>

struct moe_nccl {
    ncclComm_t comm[3];
    int ranks[3];
    cudaStream_t stream;
    cudaEvent_t *events;
    int n_events;
};

#define NCCL_TRY(call, what)                                                                       \
    do {                                                                                           \
        ncclResult_t r_ = (call);                                                                  \
        if (r_ != ncclSuccess)                                                                     \
            MOE_FAIL(MOE_ERR_COMM, "%s: %s failed: %s", what, #call, ncclGetErrorString(r_));      \
    } while (0)

#define CUDA_TRY(call, what)                                                                       \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            MOE_FAIL(MOE_ERR_DEVICE, "%s: %s failed: %s", what, #call, cudaGetErrorString(e_));    \
    } while (0)

moe_status moe_nccl_create(moe_nccl **out, MPI_Comm groups[3], void *stream, int n_events)
{
    *out = NULL;
    moe_nccl *n = calloc(1, sizeof *n);
    cudaEvent_t *ev = calloc((size_t)n_events, sizeof *ev);
    if (!n || !ev) {
        free(n);
        free(ev);
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate the NCCL state");
    }
    n->events = ev;
    n->stream = (cudaStream_t)stream;
    moe_status st = MOE_OK;
    for (int g = 0; g < 3 && st == MOE_OK; g++) {
        int rank = 0, size = 0;
        ncclUniqueId id;
        MPI_Comm_rank(groups[g], &rank);
        MPI_Comm_size(groups[g], &size);
        n->ranks[g] = size;
        if (rank == 0 && ncclGetUniqueId(&id) != ncclSuccess) {
            moe_log_at(__FILE__, __LINE__, "ncclGetUniqueId failed");
            st = MOE_ERR_COMM; /* the others wait in the broadcast: the launcher aborts */
            break;
        }
        if (MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, groups[g]) != MPI_SUCCESS) {
            moe_log_at(__FILE__, __LINE__, "MPI_Bcast of the NCCL id failed");
            st = MOE_ERR_COMM;
            break;
        }
        ncclResult_t r = ncclCommInitRank(&n->comm[g], size, id, rank);
        if (r != ncclSuccess) {
            moe_log_at(__FILE__, __LINE__, "ncclCommInitRank (group %d, %d ranks): %s", g, size,
                       ncclGetErrorString(r));
            st = MOE_ERR_COMM;
        }
    }
    for (int i = 0; i < n_events && st == MOE_OK; i++) {
        if (cudaEventCreateWithFlags(&ev[i], cudaEventDisableTiming) != cudaSuccess) {
            moe_log_at(__FILE__, __LINE__, "cudaEventCreate failed");
            st = MOE_ERR_DEVICE;
        } else {
            n->n_events = i + 1;
        }
    }
    if (st != MOE_OK) {
        moe_nccl_destroy(n);
        return st;
    }
    *out = n;
    return MOE_OK;
}

void moe_nccl_destroy(moe_nccl *n)
{
    if (!n)
        return;
    for (int g = 0; g < 3; g++)
        if (n->comm[g])
            ncclCommDestroy(n->comm[g]);
    for (int i = 0; i < n->n_events; i++)
        cudaEventDestroy(n->events[i]);
    free(n->events);
    free(n);
}

static moe_status record(moe_nccl *n, int event)
{
    CUDA_TRY(cudaEventRecord(n->events[event], n->stream), "recording a communication event");
    return MOE_OK;
}

moe_status moe_nccl_allreduce(moe_nccl *n, int group, void *buf, size_t count, size_t elem_bytes,
                              int event)
{
    NCCL_TRY(ncclAllReduce(buf, buf, count, elem_bytes == 8 ? ncclFloat64 : ncclFloat32, ncclSum,
                           n->comm[group], n->stream),
             "gradient allreduce");
    return record(n, event);
}

moe_status moe_nccl_exchange(moe_nccl *n, int peers, const void *send, const size_t *send_counts,
                             const size_t *send_displs, void *recv, const size_t *recv_counts,
                             const size_t *recv_displs, int event)
{
    NCCL_TRY(ncclGroupStart(), "token exchange");
    for (int p = 0; p < peers; p++) {
        if (send_counts[p])
            NCCL_TRY(ncclSend((const char *)send + send_displs[p], send_counts[p], ncclUint8, p,
                              n->comm[1], n->stream),
                     "token exchange");
        if (recv_counts[p])
            NCCL_TRY(ncclRecv((char *)recv + recv_displs[p], recv_counts[p], ncclUint8, p,
                              n->comm[1], n->stream),
                     "token exchange");
    }
    NCCL_TRY(ncclGroupEnd(), "token exchange");
    return record(n, event);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

moe_status moe_nccl_wait(moe_nccl *n, int event, double timeout_s, const char *what)
{
    const double deadline = now_s() + timeout_s;
    for (;;) {
        cudaError_t q = cudaEventQuery(n->events[event]);
        if (q == cudaSuccess)
            return MOE_OK;
        if (q != cudaErrorNotReady)
            MOE_FAIL(MOE_ERR_DEVICE, "%s: %s", what, cudaGetErrorString(q));
        for (int g = 0; g < 3; g++) {
            ncclResult_t async = ncclSuccess;
            if (ncclCommGetAsyncError(n->comm[g], &async) == ncclSuccess && async != ncclSuccess) {
                for (int h = 0; h < 3; h++)
                    ncclCommAbort(n->comm[h]), n->comm[h] = NULL;
                MOE_FAIL(MOE_ERR_COMM, "%s: NCCL reported %s", what, ncclGetErrorString(async));
            }
        }
        if (now_s() > deadline) {
            for (int h = 0; h < 3; h++)
                ncclCommAbort(n->comm[h]), n->comm[h] = NULL;
            MOE_FAIL(MOE_ERR_COMM, "timeout after %.0f s in the %s (NCCL): a peer did not answer",
                     timeout_s, what);
        }
        struct timespec nap = {0, 20000};
        nanosleep(&nap, NULL);
    }
}
