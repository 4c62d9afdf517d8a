/* comm/nccl/comm_nccl.c: NCCL communicators and GPU collectives (see comm_nccl.h). */
#include "comm/nccl/comm_nccl.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>

#include "util/clock.h"

/* Streams: the token exchange runs on `xstream`, the gradient reduction on `gstream`,
 * each after an event (`ready`) recorded on the compute stream when the operation is
 * queued; its handle is the event `events[h]` recorded after it. Waiting makes the
 * compute stream wait for that event and returns at once: the host goes on queueing
 * work. The waited-for events are watched (moe_nccl_watch, called by every host wait
 * of the step: the counts' and the backend's queue waits), so an operation not done by
 * its deadline, or an asynchronous NCCL error, still ends the job. `arrive[h]` is recorded on
 * the compute stream when the wait begins; exposed time = done - arrive when positive
 * (the compute stream had nothing left to do), total = done - start. The times are read
 * later (moe_nccl_times), once the compute stream has passed `arrive`: reading them at
 * the wait would stall the host until the compute stream drained.
 *
 * The communicators are non-blocking (ncclConfig_t.blocking = 0), so that neither their
 * setup nor a call that connects peers lazily can block the host past the deadline: a
 * call may answer ncclInProgress, and settle() polls the communicator until it is done. */
struct moe_nccl {
    ncclComm_t comm[3];
    int ranks[3];
    cudaStream_t stream;           /* compute */
    cudaStream_t xstream, gstream; /* token exchange, gradient reduction */
    cudaEvent_t *events, *ready, *start, *arrive;
    int n_events;
    double timeout_s;
    /* the waited-for events not seen complete yet: deadline and what, per event */
    unsigned char *watched;
    double *deadline;
    char (*what)[192];
    int n_watched;
    int aborted; /* a watch failed: every later watch fails too */
    /* host waits (the count exchanges): events on the compute stream before and after
     * each, so the time the stream sat idle in it can be read later */
    cudaEvent_t gap_before[MOE_NCCL_GAPS], gap_after[MOE_NCCL_GAPS];
    int n_gaps;
};

/* After a call on a non-blocking communicator answered r: polls until the communicator
 * is no longer in progress, at most timeout_s. MOE_OK when it ended in ncclSuccess. */
static moe_status settle(ncclComm_t comm, ncclResult_t r, double timeout_s, const char *what)
{
    const double t0 = moe_clock_seconds(), deadline = t0 + timeout_s;
    while (r == ncclInProgress) {
        if (moe_clock_seconds() > deadline) {
            ncclCommAbort(comm);
            MOE_FAIL(MOE_ERR_COMM, "%s: NCCL did not finish within %.0f s (a peer is missing?)",
                     what, timeout_s);
        }
        moe_poll_pause(t0);
        if (ncclCommGetAsyncError(comm, &r) != ncclSuccess)
            MOE_FAIL(MOE_ERR_COMM, "%s: ncclCommGetAsyncError failed", what);
    }
    if (r != ncclSuccess)
        MOE_FAIL(MOE_ERR_COMM, "%s: %s", what, ncclGetErrorString(r));
    return MOE_OK;
}

#define NCCL_TRY(call, what)                                                                       \
    do {                                                                                           \
        ncclResult_t r_ = (call);                                                                  \
        if (r_ != ncclSuccess && r_ != ncclInProgress)                                             \
            MOE_FAIL(MOE_ERR_COMM, "%s: %s failed: %s", what, #call, ncclGetErrorString(r_));      \
    } while (0)

/* A group call ended: the communicator may still be enqueueing (non-blocking). */
#define NCCL_END(comm, n, what)                                                                    \
    do {                                                                                           \
        ncclResult_t r_ = ncclGroupEnd();                                                          \
        if (r_ == ncclInProgress)                                                                  \
            MOE_CHECK(settle((comm), r_, (n)->timeout_s, what));                                   \
        else if (r_ != ncclSuccess)                                                                \
            MOE_FAIL(MOE_ERR_COMM, "%s: ncclGroupEnd failed: %s", what, ncclGetErrorString(r_));   \
    } while (0)

#define CUDA_TRY(call, what)                                                                       \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            MOE_FAIL(MOE_ERR_DEVICE, "%s: %s failed: %s", what, #call, cudaGetErrorString(e_));    \
    } while (0)

moe_status moe_nccl_create(moe_nccl **out, MPI_Comm groups[3], void *stream, int n_events,
                           double timeout_s)
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
    n->timeout_s = timeout_s;
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
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        ncclResult_t r = ncclCommInitRankConfig(&n->comm[g], size, id, rank, &config);
        if (r != ncclSuccess && r != ncclInProgress) {
            moe_log_at(__FILE__, __LINE__, "ncclCommInitRankConfig (group %d, %d ranks): %s", g,
                       size, ncclGetErrorString(r));
            st = MOE_ERR_COMM;
        } else {
            static const char *names[3] = {"NCCL setup of the world communicator",
                                           "NCCL setup of the expert-parallel communicator",
                                           "NCCL setup of the expert-data-parallel communicator"};
            st = settle(n->comm[g], r, timeout_s, names[g]);
            if (st != MOE_OK)
                n->comm[g] = NULL; /* aborted by settle */
        }
    }
    n->ready = calloc((size_t)n_events, sizeof *ev);
    n->start = calloc((size_t)n_events, sizeof *ev);
    n->arrive = calloc((size_t)n_events, sizeof *ev);
    n->watched = calloc((size_t)n_events, sizeof *n->watched);
    n->deadline = calloc((size_t)n_events, sizeof *n->deadline);
    n->what = calloc((size_t)n_events, sizeof *n->what);
    if (st == MOE_OK &&
        (!n->ready || !n->start || !n->arrive || !n->watched || !n->deadline || !n->what)) {
        moe_log_at(__FILE__, __LINE__, "cannot allocate the NCCL events");
        st = MOE_ERR_NOMEM;
    }
    for (int i = 0; i < MOE_NCCL_GAPS && st == MOE_OK; i++)
        if (cudaEventCreate(&n->gap_before[i]) != cudaSuccess ||
            cudaEventCreate(&n->gap_after[i]) != cudaSuccess) {
            moe_log_at(__FILE__, __LINE__, "cudaEventCreate failed");
            st = MOE_ERR_DEVICE;
        }
    /* the compute stream's priority (the greatest, unless MOE_QUEUE_PRIORITY=0): only the
     * backend's background queue (the optimizer's updates) yields to them */
    int prio = 0;
    if (st == MOE_OK && cudaStreamGetPriority(n->stream, &prio) != cudaSuccess) {
        moe_log_at(__FILE__, __LINE__, "cannot read the compute stream's priority");
        st = MOE_ERR_DEVICE;
    }
    if (st == MOE_OK &&
        (cudaStreamCreateWithPriority(&n->xstream, cudaStreamNonBlocking, prio) != cudaSuccess ||
         cudaStreamCreateWithPriority(&n->gstream, cudaStreamNonBlocking, prio) != cudaSuccess)) {
        moe_log_at(__FILE__, __LINE__, "cannot create the communication streams");
        st = MOE_ERR_DEVICE;
    }
    for (int i = 0; i < n_events && st == MOE_OK; i++) {
        if (cudaEventCreate(&ev[i]) != cudaSuccess ||
            cudaEventCreate(&n->ready[i]) != cudaSuccess ||
            cudaEventCreate(&n->start[i]) != cudaSuccess ||
            cudaEventCreate(&n->arrive[i]) != cudaSuccess) {
            moe_log_at(__FILE__, __LINE__, "cudaEventCreate failed");
            st = MOE_ERR_DEVICE;
        }
        n->n_events = i + 1; /* destroy releases whatever was made */
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
    for (int i = 0; i < n->n_events; i++) {
        cudaEvent_t *all[4] = {n->events, n->ready, n->start, n->arrive};
        for (int k = 0; k < 4; k++)
            if (all[k] && all[k][i])
                cudaEventDestroy(all[k][i]);
    }
    for (int i = 0; i < MOE_NCCL_GAPS; i++) {
        if (n->gap_before[i])
            cudaEventDestroy(n->gap_before[i]);
        if (n->gap_after[i])
            cudaEventDestroy(n->gap_after[i]);
    }
    if (n->xstream)
        cudaStreamDestroy(n->xstream);
    if (n->gstream)
        cudaStreamDestroy(n->gstream);
    free(n->events);
    free(n->ready);
    free(n->start);
    free(n->arrive);
    free(n->watched);
    free(n->deadline);
    free(n->what);
    free(n);
}

/* The side stream waits for what the compute stream has queued so far. */
static moe_status begin_on(moe_nccl *n, cudaStream_t side, int event)
{
    CUDA_TRY(cudaEventRecord(n->ready[event], n->stream), "recording a communication event");
    CUDA_TRY(cudaStreamWaitEvent(side, n->ready[event], 0), "ordering a communication stream");
    CUDA_TRY(cudaEventRecord(n->start[event], side), "recording a communication event");
    return MOE_OK;
}

moe_status moe_nccl_allreduce(moe_nccl *n, int group, void *buf, size_t count, size_t elem_bytes,
                              int event)
{
    MOE_CHECK(begin_on(n, n->gstream, event));
    ncclResult_t r = ncclAllReduce(buf, buf, count, elem_bytes == 8 ? ncclFloat64 : ncclFloat32,
                                   ncclSum, n->comm[group], n->gstream);
    MOE_CHECK(settle(n->comm[group], r, n->timeout_s, "gradient allreduce"));
    CUDA_TRY(cudaEventRecord(n->events[event], n->gstream), "recording a communication event");
    return MOE_OK;
}

moe_status moe_nccl_exchange(moe_nccl *n, int peers, const void *send, const size_t *send_counts,
                             const size_t *send_displs, void *recv, const size_t *recv_counts,
                             const size_t *recv_displs, int repeat, int event)
{
    MOE_CHECK(begin_on(n, n->xstream, event));
    for (int k = 0; k < repeat; k++) {
        NCCL_TRY(ncclGroupStart(), "token exchange");
        for (int p = 0; p < peers; p++) {
            if (send_counts[p])
                NCCL_TRY(ncclSend((const char *)send + send_displs[p], send_counts[p], ncclUint8, p,
                                  n->comm[1], n->xstream),
                         "token exchange");
            if (recv_counts[p])
                NCCL_TRY(ncclRecv((char *)recv + recv_displs[p], recv_counts[p], ncclUint8, p,
                                  n->comm[1], n->xstream),
                         "token exchange");
        }
        NCCL_END(n->comm[1], n, "token exchange");
    }
    CUDA_TRY(cudaEventRecord(n->events[event], n->xstream), "recording a communication event");
    return MOE_OK;
}

/* Milliseconds from event a to event b, both complete; 0 if unreadable. */
static double elapsed_ms(cudaEvent_t a, cudaEvent_t b)
{
    float ms = 0;
    return cudaEventElapsedTime(&ms, a, b) == cudaSuccess ? ms : 0.0;
}

/* Aborts every communicator (their operations then end, so no stream waits forever). */
static void abort_all(moe_nccl *n)
{
    for (int h = 0; h < 3; h++)
        if (n->comm[h])
            ncclCommAbort(n->comm[h]), n->comm[h] = NULL;
    n->n_watched = 0;
    n->aborted = 1;
}

moe_status moe_nccl_wait(moe_nccl *n, int event, double timeout_s, const char *what)
{
    CUDA_TRY(cudaEventRecord(n->arrive[event], n->stream), "recording a communication event");
    CUDA_TRY(cudaStreamWaitEvent(n->stream, n->events[event], 0),
             "ordering the compute stream after communication");
    if (!n->watched[event])
        n->n_watched++;
    n->watched[event] = 1;
    n->deadline[event] = moe_clock_seconds() + timeout_s;
    n->timeout_s = timeout_s; /* the message's figure (every wait passes the same) */
    snprintf(n->what[event], sizeof n->what[event], "%s", what);
    return moe_nccl_watch(n);
}

/* Event `event` is done (unwatched), or not yet (its deadline checked); 1 when done. */
static moe_status watch_one(moe_nccl *n, int event, double now, int *done)
{
    *done = 1;
    if (!n->watched[event])
        return MOE_OK;
    const cudaError_t q = cudaEventQuery(n->events[event]);
    if (q == cudaErrorNotReady) {
        *done = 0;
        if (now <= n->deadline[event])
            return MOE_OK;
        abort_all(n);
        MOE_FAIL(MOE_ERR_COMM, "timeout after %.0f s in the %s (NCCL): a peer did not answer",
                 n->timeout_s, n->what[event]);
    }
    n->watched[event] = 0;
    n->n_watched--;
    if (q != cudaSuccess) {
        abort_all(n);
        MOE_FAIL(MOE_ERR_DEVICE, "%s: %s", n->what[event], cudaGetErrorString(q));
    }
    return MOE_OK;
}

moe_status moe_nccl_watch(moe_nccl *n)
{
    if (n->aborted)
        MOE_FAIL(MOE_ERR_COMM, "the NCCL communicators were aborted after an earlier failure");
    const double now = moe_clock_seconds();
    for (int e = 0; e < n->n_events && n->n_watched > 0; e++) {
        int done = 0;
        MOE_CHECK(watch_one(n, e, now, &done));
    }
    for (int g = 0; g < 3; g++) {
        ncclResult_t async = ncclSuccess;
        if (n->comm[g] && ncclCommGetAsyncError(n->comm[g], &async) == ncclSuccess &&
            async != ncclSuccess && async != ncclInProgress) {
            const char *what = "a communication"; /* one of the operations waited for */
            for (int e = 0; e < n->n_events; e++)
                if (n->watched[e]) {
                    what = n->what[e];
                    break;
                }
            char msg[256];
            snprintf(msg, sizeof msg, "%s", what); /* abort_all forgets the watched events */
            abort_all(n);
            MOE_FAIL(MOE_ERR_COMM, "%s: NCCL reported %s", msg, ncclGetErrorString(async));
        }
    }
    return MOE_OK;
}

/* Polls until event is done, watching everything meanwhile (with the deadlines). */
static moe_status watch_until_done(moe_nccl *n, int event)
{
    const double t0 = moe_clock_seconds();
    for (;;) {
        int done = 0;
        MOE_CHECK(watch_one(n, event, moe_clock_seconds(), &done));
        if (done)
            return MOE_OK;
        MOE_CHECK(moe_nccl_watch(n));
        moe_poll_pause(t0);
    }
}

moe_status moe_nccl_times(moe_nccl *n, int event, double *total_s, double *exposed_s)
{
    MOE_CHECK(watch_until_done(n, event));
    CUDA_TRY(cudaEventSynchronize(n->arrive[event]), "timing communication");
    const double exposed = elapsed_ms(n->arrive[event], n->events[event]);
    *total_s = 1e-3 * elapsed_ms(n->start[event], n->events[event]);
    *exposed_s = exposed > 0 ? 1e-3 * exposed : 0.0;
    return MOE_OK;
}

moe_status moe_nccl_gap_begin(moe_nccl *n, int *slot)
{
    *slot = -1;
    if (n->n_gaps == MOE_NCCL_GAPS) /* full: free the slots by reading them */
        return MOE_OK;
    *slot = n->n_gaps++;
    CUDA_TRY(cudaEventRecord(n->gap_before[*slot], n->stream), "timing a host wait");
    return MOE_OK;
}

moe_status moe_nccl_gap_end(moe_nccl *n, int slot)
{
    if (slot >= 0)
        CUDA_TRY(cudaEventRecord(n->gap_after[slot], n->stream), "timing a host wait");
    return MOE_OK;
}

moe_status moe_nccl_gaps(moe_nccl *n, double *idle_s)
{
    *idle_s = 0;
    for (int i = 0; i < n->n_gaps; i++) {
        CUDA_TRY(cudaEventSynchronize(n->gap_after[i]), "timing a host wait");
        *idle_s += 1e-3 * elapsed_ms(n->gap_before[i], n->gap_after[i]);
    }
    n->n_gaps = 0;
    return MOE_OK;
}
