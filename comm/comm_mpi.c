/* comm/comm_mpi.c: the "mpi" backend of comm.h, for CPU runs. Every MPI call is
 * checked; a failure logs the operation and MPI's message and returns MOE_ERR_COMM.
 * Requests live in a fixed pool sized at create: nothing is allocated per call. */
#include "comm/comm.h"

#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#define POOL_HANDLES 256

struct moe_comm {
    MPI_Comm groups[3]; /* world, ep, edp */
    int rank[3], size[3];
    int ep_size;
    MPI_Request *req; /* POOL_HANDLES * reqs_per_handle */
    int *n_req;       /* requests in use per handle; -1 when the handle is free */
    int reqs_per_handle;
    int next; /* where the search for a free handle starts */
};

#define MPI_TRY(call, what)                                                                        \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_ != MPI_SUCCESS) {                                                                  \
            char msg_[MPI_MAX_ERROR_STRING];                                                       \
            int len_ = 0;                                                                          \
            MPI_Error_string(rc_, msg_, &len_);                                                    \
            MOE_FAIL(MOE_ERR_COMM, "%s: %s failed: %.*s", what, #call, len_, msg_);                \
        }                                                                                          \
    } while (0)

static MPI_Datatype real_type(size_t elem_bytes)
{
    return elem_bytes == 8 ? MPI_DOUBLE : MPI_FLOAT;
}

moe_status moe_comm_create(moe_comm **out, int ep)
{
    *out = NULL;
    int world_size = 0, world_rank = 0;
    MPI_TRY(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "comm create");
    MPI_TRY(MPI_Comm_size(MPI_COMM_WORLD, &world_size), "comm create");
    MPI_TRY(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "comm create");
    if (ep < 1 || world_size % ep != 0)
        MOE_FAIL(MOE_ERR_INVALID, "[parallel] ep = %d must divide the world size %d", ep,
                 world_size);
    moe_comm *c = calloc(1, sizeof *c);
    if (!c)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate the communicator");
    c->ep_size = ep;
    c->groups[MOE_GROUP_WORLD] = MPI_COMM_WORLD;
    c->groups[MOE_GROUP_EP] = MPI_COMM_NULL;
    c->groups[MOE_GROUP_EDP] = MPI_COMM_NULL;
    moe_status st = MOE_OK;
    int rc =
        MPI_Comm_split(MPI_COMM_WORLD, world_rank / ep, world_rank % ep, &c->groups[MOE_GROUP_EP]);
    if (rc == MPI_SUCCESS)
        rc = MPI_Comm_split(MPI_COMM_WORLD, world_rank % ep, world_rank / ep,
                            &c->groups[MOE_GROUP_EDP]);
    if (rc != MPI_SUCCESS) {
        moe_log_at(__FILE__, __LINE__, "comm create: MPI_Comm_split failed (code %d)", rc);
        st = MOE_ERR_COMM;
        goto fail;
    }
    for (int g = 0; g < 3; g++) {
        MPI_Comm_set_errhandler(c->groups[g], MPI_ERRORS_RETURN);
        MPI_Comm_rank(c->groups[g], &c->rank[g]);
        MPI_Comm_size(c->groups[g], &c->size[g]);
    }
    c->reqs_per_handle = 2 * ep > 1 ? 2 * ep : 1;
    c->req = malloc(sizeof(MPI_Request) * POOL_HANDLES * (size_t)c->reqs_per_handle);
    c->n_req = malloc(sizeof(int) * POOL_HANDLES);
    if (!c->req || !c->n_req) {
        st = MOE_ERR_NOMEM;
        moe_log_at(__FILE__, __LINE__, "cannot allocate the request pool");
        goto fail;
    }
    for (int i = 0; i < POOL_HANDLES; i++)
        c->n_req[i] = -1;
    *out = c;
    return MOE_OK;
fail:
    moe_comm_destroy(c);
    return st;
}

void moe_comm_destroy(moe_comm *c)
{
    if (!c)
        return;
    for (int g = MOE_GROUP_EP; g <= MOE_GROUP_EDP; g++)
        if (c->groups[g] != MPI_COMM_NULL)
            MPI_Comm_free(&c->groups[g]);
    free(c->req);
    free(c->n_req);
    free(c);
}

int moe_comm_rank(const moe_comm *c, moe_group g) { return c->rank[g]; }
int moe_comm_size(const moe_comm *c, moe_group g) { return c->size[g]; }
const char *moe_comm_backend(const moe_comm *c)
{
    (void)c;
    return "mpi";
}

static moe_status take_handle(moe_comm *c, moe_comm_handle *h)
{
    for (int i = 0; i < POOL_HANDLES; i++) {
        int j = (c->next + i) % POOL_HANDLES;
        if (c->n_req[j] < 0) {
            c->n_req[j] = 0;
            c->next = (j + 1) % POOL_HANDLES;
            *h = j;
            return MOE_OK;
        }
    }
    MOE_FAIL(MOE_ERR_COMM, "more than %d communication handles outstanding (a missing wait?)",
             POOL_HANDLES);
}

moe_status moe_comm_wait(moe_comm *c, moe_comm_handle h)
{
    if (h == MOE_COMM_NONE)
        return MOE_OK;
    if (h < 0 || h >= POOL_HANDLES || c->n_req[h] < 0)
        MOE_FAIL(MOE_ERR_INVALID, "wait on an invalid communication handle %d", h);
    int n = c->n_req[h];
    c->n_req[h] = -1;
    if (n > 0)
        MPI_TRY(MPI_Waitall(n, c->req + (size_t)h * c->reqs_per_handle, MPI_STATUSES_IGNORE),
                "wait");
    return MOE_OK;
}

void moe_comm_progress(moe_comm *c)
{
    int flag;
    for (int h = 0; h < POOL_HANDLES; h++)
        if (c->n_req[h] > 0)
            MPI_Testall(c->n_req[h], c->req + (size_t)h * c->reqs_per_handle, &flag,
                        MPI_STATUSES_IGNORE);
}

moe_status moe_comm_allreduce_start(moe_comm *c, moe_group g, void *buf, size_t count,
                                    size_t elem_bytes, moe_comm_handle after, moe_comm_handle *done)
{
    MOE_CHECK(moe_comm_wait(c, after));
    MOE_CHECK(take_handle(c, done));
    if (count > (size_t)INT32_MAX)
        MOE_FAIL(MOE_ERR_INVALID, "allreduce of %zu elements exceeds MPI's int count", count);
    MPI_Request *r = c->req + (size_t)*done * c->reqs_per_handle;
    MPI_TRY(MPI_Iallreduce(MPI_IN_PLACE, buf, (int)count, real_type(elem_bytes), MPI_SUM,
                           c->groups[g], r),
            "gradient allreduce");
    c->n_req[*done] = 1;
    return MOE_OK;
}

moe_status moe_comm_exchange_start(moe_comm *c, const void *send, const size_t *send_counts,
                                   const size_t *send_displs, void *recv, const size_t *recv_counts,
                                   const size_t *recv_displs, moe_comm_handle after,
                                   moe_comm_handle *done)
{
    MOE_CHECK(moe_comm_wait(c, after));
    MOE_CHECK(take_handle(c, done));
    MPI_Comm comm = c->groups[MOE_GROUP_EP];
    MPI_Request *r = c->req + (size_t)*done * c->reqs_per_handle;
    int n = 0;
    for (int p = 0; p < c->ep_size; p++) {
        if (recv_counts[p] > (size_t)INT32_MAX || send_counts[p] > (size_t)INT32_MAX)
            MOE_FAIL(MOE_ERR_INVALID, "token exchange of more than 2 GiB with one peer");
        if (recv_counts[p] == 0)
            continue;
        MPI_TRY(MPI_Irecv((char *)recv + recv_displs[p], (int)recv_counts[p], MPI_BYTE, p, 17, comm,
                          &r[n]),
                "token exchange");
        n++;
    }
    for (int p = 0; p < c->ep_size; p++) {
        if (send_counts[p] == 0)
            continue;
        MPI_TRY(MPI_Isend((const char *)send + send_displs[p], (int)send_counts[p], MPI_BYTE, p, 17,
                          comm, &r[n]),
                "token exchange");
        n++;
    }
    c->n_req[*done] = n;
    return MOE_OK;
}

moe_status moe_comm_exchange_counts(moe_comm *c, const int64_t *send, int64_t *recv)
{
    MPI_TRY(MPI_Alltoall(send, 1, MPI_INT64_T, recv, 1, MPI_INT64_T, c->groups[MOE_GROUP_EP]),
            "count exchange");
    return MOE_OK;
}

moe_status moe_comm_sum_doubles(moe_comm *c, moe_group g, double *vals, int n)
{
    MPI_TRY(MPI_Allreduce(MPI_IN_PLACE, vals, n, MPI_DOUBLE, MPI_SUM, c->groups[g]), "sum");
    return MOE_OK;
}

moe_status moe_comm_sum_int64(moe_comm *c, moe_group g, int64_t *vals, int n)
{
    MPI_TRY(MPI_Allreduce(MPI_IN_PLACE, vals, n, MPI_INT64_T, MPI_SUM, c->groups[g]), "sum");
    return MOE_OK;
}

moe_status moe_comm_barrier(moe_comm *c)
{
    MPI_TRY(MPI_Barrier(c->groups[MOE_GROUP_WORLD]), "barrier");
    return MOE_OK;
}

void moe_comm_abort(int code)
{
    MPI_Abort(MPI_COMM_WORLD, code);
    abort(); /* MPI_Abort does not return; be sure */
}
