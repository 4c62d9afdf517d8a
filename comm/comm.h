/* comm/comm.h: process groups and the collectives the runtime needs.
 *
 * Owns: the world, expert-parallel (EP) and expert-data-parallel (EDP) groups, the
 * exchange of tokens with variable counts, asynchronous gradient reduction, error
 * checking of every MPI call. Knows nothing of the model.
 * Does not own: ending the job (moe_comm_abort is for launcher/ only).
 *
 * Groups for world size P and expert-parallel degree ep (ep divides P):
 *   EP group g  = ranks [g*ep, (g+1)*ep): together they hold every expert once; tokens
 *                 are exchanged inside it.
 *   EDP group j = ranks {j, j+ep, j+2ep, ...}: they hold the same experts; expert
 *                 gradients are reduced inside it. Dense gradients over the world.
 *
 * Asynchrony: every call that may run in the background takes the handle it must wait
 * for (`after`, MOE_COMM_NONE for nothing) and gives back a handle that marks its
 * completion; moe_comm_wait() waits for one. On the CPU a handle is a set of MPI
 * requests; the GPU backend will use CUDA events at the same call sites.
 *
 * Backends are named tables chosen once at create; "mpi" is the CPU backend.
 *
 * Timeouts: every wait polls with a deadline of moe_comm_set_timeout() seconds (default
 * 600, [parallel] comm_timeout_s) from its start. A wait that passes it returns
 * MOE_ERR_COMM after logging what it waited for, the context the caller set
 * (moe_comm_set_context: "forward", layer 1) and, where the operation is point to point
 * (token counts, token rows), the ranks that sent nothing: "timeout after 5 s in the
 * token-count exchange of layer 1 (forward): no message from rank 2". Collectives
 * (sums, gradient reductions, barrier) cannot tell which peer is missing; they name the
 * group. The launcher then ends the job (MPI_Abort). */
#ifndef MOE_COMM_COMM_H
#define MOE_COMM_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "util/status.h"

typedef enum { MOE_GROUP_WORLD = 0, MOE_GROUP_EP = 1, MOE_GROUP_EDP = 2 } moe_group;

typedef int moe_comm_handle;
#define MOE_COMM_NONE (-1)

typedef struct moe_comm moe_comm;

/* Collective over the world: builds the groups for expert-parallel degree ep.
 * Errors: ep does not divide the world size (message names [parallel] ep). */
moe_status moe_comm_create(moe_comm **out, int ep);

/* Collective. Destroying NULL does nothing. Does not finalize MPI. */
void moe_comm_destroy(moe_comm *c);

/* This process's rank and the size of a group. */
int moe_comm_rank(const moe_comm *c, moe_group g);
int moe_comm_size(const moe_comm *c, moe_group g);

/* Hosts (shared-memory nodes) the EP group spans: 1 when its token exchanges stay inside
 * one machine. c NULL: 1. */
int moe_comm_ep_hosts(const moe_comm *c);

/* Name of the backend ("mpi"). */
const char *moe_comm_backend(const moe_comm *c);

/* Seconds any wait may take before it fails (> 0). Local; call it on every rank. */
void moe_comm_set_timeout(moe_comm *c, double seconds);

/* Benchmark knob ([parallel] exchange_repeat): every token exchange is sent `repeat`
 * times in a row, as a slower network would take (default 1). Local; call it on every
 * rank of an EP group with the same value. */
void moe_comm_set_exchange_repeat(moe_comm *c, int repeat);

/* What the caller is doing, for timeout messages: a phase ("forward", "backward",
 * "gradient reduction", "checkpoint") and a layer (-1: none). phase must outlive the
 * calls that follow (a string literal). c NULL does nothing. Local. */
void moe_comm_set_context(moe_comm *c, const char *phase, int layer);

/* Starts an in-place sum of buf (count floats of the element type `real` of the
 * caller's build: elem_bytes 4 or 8) over group g. Collective over g. */
moe_status moe_comm_allreduce_start(moe_comm *c, moe_group g, void *buf, size_t count,
                                    size_t elem_bytes, moe_comm_handle after,
                                    moe_comm_handle *done);

/* Exchange inside the EP group: to each peer p, send_counts[p] bytes from
 * send + send_displs[p]; from each peer, recv_counts[p] bytes into recv + recv_displs[p].
 * Counts are in BYTES. Collective over the EP group. */
moe_status moe_comm_exchange_start(moe_comm *c, const void *send, const size_t *send_counts,
                                   const size_t *send_displs, void *recv, const size_t *recv_counts,
                                   const size_t *recv_displs, moe_comm_handle after,
                                   moe_comm_handle *done);

/* The counts and displacements of an exchange of whole rows of row_nbytes, packed by peer
 * in order on both sides: xc (4 * peers) becomes send counts, send displacements, receive
 * counts, receive displacements, as moe_comm_exchange_start takes them. Returns the bytes
 * sent. */
static inline size_t moe_comm_row_layout(int peers, const int *send_rows, const int *recv_rows,
                                         size_t row_nbytes, size_t *xc)
{
    size_t *sc = xc, *sd = sc + peers, *rc = sd + peers, *rd = rc + peers;
    size_t so = 0, ro = 0;
    for (int p = 0; p < peers; p++) {
        sc[p] = (size_t)send_rows[p] * row_nbytes;
        sd[p] = so;
        so += sc[p];
        rc[p] = (size_t)recv_rows[p] * row_nbytes;
        rd[p] = ro;
        ro += rc[p];
    }
    return so;
}

/* The same for host buffers, always through MPI (e.g. expert weights staged on the host
 * when re-planning), also on GPU runs. */
moe_status moe_comm_exchange_host_start(moe_comm *c, const void *send, const size_t *send_counts,
                                        const size_t *send_displs, void *recv,
                                        const size_t *recv_counts, const size_t *recv_displs,
                                        moe_comm_handle after, moe_comm_handle *done);

/* Collective: from now on the gradient allreduce and the token exchange take device
 * buffers and go through NCCL, each on a stream of its own ordered after `stream` (a
 * cudaStream_t, the compute stream) by events, so they follow the kernels that produced
 * their inputs; a wait makes the compute stream wait for the operation (the reduction
 * runs beside the rest of backward). Communicators are bootstrapped over MPI.
 * Host collectives (counts, sums, gathers) stay on MPI. Builds without CUDA: an error. */
moe_status moe_comm_enable_device(moe_comm *c, void *stream);

/* Blocking exchange of n int64 per peer inside the EP group (the counts before a token
 * exchange): recv[p*n .. p*n+n) = what peer p put in its send[this rank * n ...]. Point
 * to point (one message per peer), so a timeout names the peers that sent nothing. */
moe_status moe_comm_exchange_counts(moe_comm *c, const int64_t *send, int64_t *recv, int n);

/* Waits for a handle (MOE_COMM_NONE returns at once) and releases it. Device
 * operations (NCCL): the compute stream waits for them, the host does not; their
 * deadline ([parallel] comm_timeout_s) and NCCL's asynchronous errors are checked by
 * moe_comm_watch, which every host wait of the step calls. */
moe_status moe_comm_wait(moe_comm *c, moe_comm_handle h);

/* For the backend's queue_wait (ctx: a moe_comm, or NULL): checks the device operations
 * waited for so far against their deadline and NCCL's asynchronous errors; a failure
 * aborts the communicators and names the operation. MPI alone: nothing to check. */
moe_status moe_comm_watch(void *comm);

/* Blocking sum of n doubles / int64s over group g, in place. */
moe_status moe_comm_sum_doubles(moe_comm *c, moe_group g, double *vals, int n);
moe_status moe_comm_sum_int64(moe_comm *c, moe_group g, int64_t *vals, int n);
/* Time spent communicating, per kind, since the last call (which zeroes it): the token
 * exchange (its counts included) and the reductions (every allreduce: the gradients', and
 * the gradient norm's over the EP group). total: the operations'
 * own time on their streams (GPU); exposed: how long the compute stream, out of work,
 * waited for them (GPU). With MPI both are the host's time inside the wait (MPI may move
 * the data only there, so no overlap is claimed). On a GPU the times are read here, after
 * the compute stream passed the waits: call it after the step's last synchronisation.
 * Local. */
typedef struct {
    double exchange_s, exchange_exposed_s;
    double reduction_s, reduction_exposed_s;
    /* of the exchange: the host's time in the count exchanges (it includes waiting for
     * the slowest peer), and of its exposed time the part they caused: on the CPU all of
     * it; on a GPU the time the compute stream sat idle meanwhile */
    double counts_s, counts_exposed_s;
} moe_comm_times;
void moe_comm_take_times(moe_comm *c, moe_comm_times *out);

/* The same times by where the compute stream (on the CPU, the host) waited: the context
 * of the wait (moe_comm_set_context: phase and layer), e.g. "forward combine of layer
 * 2". Accumulated over every wait since the last moe_comm_take_sites, which copies up to
 * cap of them into out (in the order they first occurred: the same on every rank of a
 * step), empties the table and returns how many there were. Times are read as
 * moe_comm_take_times reads them: call it after a step's last synchronisation. At most
 * MOE_COMM_SITES places (the count returned never exceeds it); later new ones are counted
 * under the last. Local. */
#define MOE_COMM_SITES 64
typedef struct {
    char name[64];
    double total_s, exposed_s;
    long count;
} moe_comm_site;
int moe_comm_take_sites(moe_comm *c, moe_comm_site *out, int cap);

/* Blocking element-wise maximum of n doubles over group g, in place. */
moe_status moe_comm_max_doubles(moe_comm *c, moe_group g, double *vals, int n);

/* Gathers nbytes from every rank of the world at world rank 0. On rank 0, *out receives
 * a malloc'ed buffer with every rank's bytes in rank order (the caller frees it) and
 * sizes[r] (world entries, caller-sized) the bytes of rank r; elsewhere *out is NULL
 * and sizes is not touched (may be NULL). Collective over the world. */
moe_status moe_comm_gather_bytes(moe_comm *c, const void *data, size_t nbytes, void **out,
                                 size_t *sizes);

/* Ends every process of the job with `code`. For launcher/ only. Never returns. */
void moe_comm_abort(int code) __attribute__((noreturn));

#endif
