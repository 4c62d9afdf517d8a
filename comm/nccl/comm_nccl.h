/* comm/nccl/comm_nccl.h: the device half of comm/ for GPU runs: NCCL communicators of the
 * world, EP and EDP groups (bootstrapped over their MPI communicators), and the two
 * collectives whose buffers live on the GPU (gradient allreduce, token exchange), each on
 * its own stream after an event of the compute stream, so they follow the kernels that
 * produced their inputs and the reduction runs beside the rest of backward. A handle is
 * a CUDA event recorded after the operation; waiting polls it and
 * ncclCommGetAsyncError with the comm timeout, and a failure or timeout aborts the NCCL
 * communicators so the job can end (launcher/ calls MPI_Abort). Internal to comm/. */
#ifndef MOE_COMM_NCCL_H
#define MOE_COMM_NCCL_H

#include <mpi.h>
#include <stddef.h>

#include "util/status.h"

typedef struct moe_nccl moe_nccl;

/* Collective over the world: one NCCL communicator per MPI communicator in groups[3],
 * non-blocking, each set up within timeout_s (else the setup is aborted and named). */
moe_status moe_nccl_create(moe_nccl **out, MPI_Comm groups[3], void *stream, int n_events,
                           double timeout_s);
void moe_nccl_destroy(moe_nccl *n);
moe_status moe_nccl_allreduce(moe_nccl *n, int group, void *buf, size_t count, size_t elem_bytes,
                              int event);
/* Byte counts per EP peer, as moe_comm_exchange_start; sent `repeat` times in a row
 * (the benchmark's slower network, [parallel] exchange_repeat; 1 normally). */
moe_status moe_nccl_exchange(moe_nccl *n, int peers, const void *send, const size_t *send_counts,
                             const size_t *send_displs, void *recv, const size_t *recv_counts,
                             const size_t *recv_displs, int repeat, int event);
/* The compute stream waits for the event of a handle; the host does not. The event is
 * watched from now on: not done within timeout_s, it fails naming `what` (at the next
 * moe_nccl_watch, or at once when a watch finds it late). Its times are read by
 * moe_nccl_times, which the handle's slot must get before it is reused. */
moe_status moe_nccl_wait(moe_nccl *n, int event, double timeout_s, const char *what);
/* Checks the watched events (done, or past their deadline: then every communicator is
 * aborted and the operation named) and the communicators' asynchronous errors. Cheap:
 * for every host wait's loop. */
moe_status moe_nccl_watch(moe_nccl *n);
/* Times of a waited-for handle; waits (watching) until the operation is done and the
 * compute stream reached the wait.
 * total_s: the operation's time on its stream; exposed_s: how long the compute stream,
 * having run out of work, waited for it. */
moe_status moe_nccl_times(moe_nccl *n, int event, double *total_s, double *exposed_s);

/* A wait of the host (the blocking count exchange) between two events on the compute
 * stream: begin before it, end after it (slot -1 when MOE_NCCL_GAPS are unread: not
 * timed). moe_nccl_gaps adds the time the stream sat idle between each pair (what the
 * host's wait cost the GPU: 0 when the stream still had work queued) and frees them. */
#define MOE_NCCL_GAPS 256
moe_status moe_nccl_gap_begin(moe_nccl *n, int *slot);
moe_status moe_nccl_gap_end(moe_nccl *n, int slot);
moe_status moe_nccl_gaps(moe_nccl *n, double *idle_s);

#endif
