/* comm/comm_mpi.c: the "mpi" backend of comm.h, for CPU runs. Every MPI call is
 * checked; a failure logs the operation and MPI's message and returns MOE_ERR_COMM.
 * Requests live in a fixed pool sized at create: nothing is allocated per call (except
 * the gather of checkpoint manifests).
 *
 * Waiting: no call blocks inside MPI. Blocking collectives are their non-blocking forms
 * followed by poll_requests(), which tests each request, sleeps briefly between rounds
 * (so oversubscribed ranks leave the cores to those that compute) and gives up at the
 * deadline, naming the peers of the point-to-point requests still open. */
#include "comm/comm.h"

#ifdef MOE_HAVE_CUDA
#include "comm/nccl/comm_nccl.h"
#endif

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/clock.h"

#define POOL_HANDLES 256
#define PEER_COLLECTIVE (-1) /* a request of a collective: no single peer */
#define TAG_COUNTS 16
#define TAG_ROWS 17

struct moe_comm {
    MPI_Comm groups[3]; /* world, ep, edp */
    int rank[3], size[3];
    int ep_size;
    MPI_Request *req;         /* POOL_HANDLES * reqs_per_handle */
    int *req_peer;            /* same shape: EP peer of a p2p request (recv: >= 0), or -1 - peer
                                 for a send, or PEER_COLLECTIVE - ... see peer_of() */
    int *n_req;               /* requests in use per handle; -1 when the handle is free */
    const char **what;        /* per handle: the operation, for timeout messages */
    moe_group *group;         /* per handle: the group of a collective */
    unsigned char *reduction; /* per handle: 1 for an allreduce, timed as reduction (also the
                                 norm's over the EP group), 0 for a token exchange */
    int reqs_per_handle;
    int next; /* where the search for a free handle starts */
    double timeout_s;
    const char *ctx_phase; /* moe_comm_set_context */
    int ctx_layer;
    MPI_Request *scratch; /* 2 * ep requests for the count exchange */
    int *scratch_peer;
    struct moe_nccl *nccl; /* GPU runs: device-memory collectives go through NCCL */
    char *is_device;       /* per handle: DEVICE_* */
    int exchange_repeat;   /* moe_comm_set_exchange_repeat */
    int ep_hosts;          /* hosts the EP group spans */
    moe_comm_times times;  /* since the last moe_comm_take_times */
    /* per handle: the context of its wait, where its times are counted */
    const char **wait_phase;
    int *wait_layer;
    struct {
        const char *phase;
        int layer;
        double total, exposed;
        long count;
    } sites[MOE_COMM_SITES]; /* since the last moe_comm_take_sites */
    int n_sites;
};

/* is_device: an NCCL operation in flight, or waited for with its times still to read
 * (its slot stays taken until then: see read_device_times). */
#define DEVICE_NONE 0
#define DEVICE_IN_FLIGHT 1
#define DEVICE_TIMES_DUE 2

/* req_peer encoding: recv from EP peer p = p; send to p = -2 - p; collective = -1. */
static int send_peer(int p) { return -2 - p; }

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

static const char *group_name(moe_group g)
{
    return g == MOE_GROUP_WORLD ? "world"
           : g == MOE_GROUP_EP  ? "expert-parallel"
                                : "expert-data-parallel";
}

/* World rank of EP peer p of this rank. */
static int ep_world_rank(const moe_comm *c, int p)
{
    return c->rank[MOE_GROUP_WORLD] / c->ep_size * c->ep_size + p;
}

/* " of layer 1 (forward)" / " (checkpoint)" / "" from the caller's context. */
static void context_text(const moe_comm *c, char *buf, size_t cap)
{
    if (c->ctx_phase && c->ctx_layer >= 0)
        snprintf(buf, cap, " of layer %d (%s)", c->ctx_layer, c->ctx_phase);
    else if (c->ctx_phase)
        snprintf(buf, cap, " (%s)", c->ctx_phase);
    else
        buf[0] = '\0';
}

/* Logs the timeout of `what`: the peers whose messages never came (open receives),
 * else those that never took ours (open sends), else the group of a collective. */
static moe_status report_timeout(const moe_comm *c, const MPI_Request *reqs, const int *peers,
                                 int n, const char *what, moe_group g)
{
    char ctx[96], who[512];
    size_t len = 0;
    context_text(c, ctx, sizeof ctx);
    who[0] = '\0';
    for (int pass = 0; pass < 2 && len == 0; pass++) {
        for (int i = 0; i < n; i++) {
            if (reqs[i] == MPI_REQUEST_NULL || peers[i] == PEER_COLLECTIVE)
                continue;
            int is_recv = peers[i] >= 0;
            if (is_recv != (pass == 0))
                continue;
            int p = is_recv ? peers[i] : -2 - peers[i];
            int wrote =
                snprintf(who + len, sizeof who - len, "%s%d", len ? ", " : "", ep_world_rank(c, p));
            if (wrote > 0 && (size_t)wrote < sizeof who - len)
                len += (size_t)wrote;
        }
        if (len)
            MOE_FAIL(MOE_ERR_COMM, "timeout after %.0f s in the %s%s: %s rank %s", c->timeout_s,
                     what, ctx, pass == 0 ? "no message from" : "no receive posted by", who);
    }
    MOE_FAIL(MOE_ERR_COMM,
             "timeout after %.0f s in the %s%s: some rank of the %s group (%d ranks) did not "
             "answer",
             c->timeout_s, what, ctx, group_name(g), c->size[g]);
}

/* Waits for n requests with the deadline; completed ones become MPI_REQUEST_NULL. */
static moe_status poll_requests(moe_comm *c, MPI_Request *reqs, const int *peers, int n,
                                const char *what, moe_group g)
{
    const double t0 = moe_clock_seconds(), deadline = t0 + c->timeout_s;
    for (long round = 0;; round++) {
        int open = 0;
        for (int i = 0; i < n; i++) {
            if (reqs[i] == MPI_REQUEST_NULL)
                continue;
            int done = 0;
            int rc = MPI_Test(&reqs[i], &done, MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS) {
                char msg[MPI_MAX_ERROR_STRING], ctx[96];
                int mlen = 0;
                MPI_Error_string(rc, msg, &mlen);
                context_text(c, ctx, sizeof ctx);
                if (peers[i] != PEER_COLLECTIVE)
                    MOE_FAIL(MOE_ERR_COMM, "%s%s with rank %d failed: %.*s", what, ctx,
                             ep_world_rank(c, peers[i] >= 0 ? peers[i] : -2 - peers[i]), mlen, msg);
                MOE_FAIL(MOE_ERR_COMM, "%s%s over the %s group failed: %.*s", what, ctx,
                         group_name(g), mlen, msg);
            }
            open += !done;
        }
        if (!open)
            return MOE_OK;
        if (round < 64)
            continue; /* short waits: spin */
        if (moe_clock_seconds() > deadline)
            return report_timeout(c, reqs, peers, n, what, g);
#ifdef MOE_HAVE_CUDA
        if (c->nccl) /* the device operations waited for earlier keep their deadlines */
            MOE_CHECK(moe_nccl_watch(c->nccl));
#endif
        moe_poll_pause(t0);
    }
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
    c->timeout_s = 600;
    c->exchange_repeat = 1;
    c->ctx_layer = -1;
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
    { /* hosts of the EP group: the ranks that lead a shared-memory part of it */
        MPI_Comm shm = MPI_COMM_NULL;
        int shm_rank = 0;
        rc = MPI_Comm_split_type(c->groups[MOE_GROUP_EP], MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL,
                                 &shm);
        if (rc == MPI_SUCCESS)
            rc = MPI_Comm_rank(shm, &shm_rank);
        int leader = shm_rank == 0;
        if (rc == MPI_SUCCESS)
            rc = MPI_Allreduce(&leader, &c->ep_hosts, 1, MPI_INT, MPI_SUM, c->groups[MOE_GROUP_EP]);
        if (shm != MPI_COMM_NULL)
            MPI_Comm_free(&shm);
        if (rc != MPI_SUCCESS) {
            moe_log_at(__FILE__, __LINE__,
                       "comm create: finding the hosts of the EP group failed (code %d)", rc);
            st = MOE_ERR_COMM;
            goto fail;
        }
    }
    for (int g = 0; g < 3; g++) {
        if (MPI_Comm_set_errhandler(c->groups[g], MPI_ERRORS_RETURN) != MPI_SUCCESS ||
            MPI_Comm_rank(c->groups[g], &c->rank[g]) != MPI_SUCCESS ||
            MPI_Comm_size(c->groups[g], &c->size[g]) != MPI_SUCCESS) {
            moe_log_at(__FILE__, __LINE__, "comm create: cannot query the %s group",
                       group_name((moe_group)g));
            st = MOE_ERR_COMM;
            goto fail;
        }
    }
    c->reqs_per_handle = 2 * ep > 1 ? 2 * ep : 1;
    size_t pool = POOL_HANDLES * (size_t)c->reqs_per_handle;
    c->req = malloc(sizeof(MPI_Request) * pool);
    c->req_peer = malloc(sizeof(int) * pool);
    c->n_req = malloc(sizeof(int) * POOL_HANDLES);
    c->what = calloc(POOL_HANDLES, sizeof *c->what);
    c->wait_phase = calloc(POOL_HANDLES, sizeof *c->wait_phase);
    c->wait_layer = calloc(POOL_HANDLES, sizeof *c->wait_layer);
    c->group = calloc(POOL_HANDLES, sizeof *c->group);
    c->reduction = calloc(POOL_HANDLES, 1);
    c->scratch = malloc(sizeof(MPI_Request) * 2 * (size_t)ep);
    c->scratch_peer = malloc(sizeof(int) * 2 * (size_t)ep);
    c->is_device = calloc(POOL_HANDLES, 1);
    if (!c->req || !c->req_peer || !c->n_req || !c->what || !c->wait_phase || !c->wait_layer ||
        !c->group || !c->reduction || !c->scratch || !c->scratch_peer || !c->is_device) {
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
#ifdef MOE_HAVE_CUDA
    moe_nccl_destroy(c->nccl);
#endif
    for (int g = MOE_GROUP_EP; g <= MOE_GROUP_EDP; g++)
        if (c->groups[g] != MPI_COMM_NULL)
            MPI_Comm_free(&c->groups[g]);
    free(c->req);
    free(c->req_peer);
    free(c->n_req);
    free(c->what);
    free(c->wait_phase);
    free(c->wait_layer);
    free(c->group);
    free(c->reduction);
    free(c->scratch);
    free(c->scratch_peer);
    free(c->is_device);
    free(c);
}

int moe_comm_rank(const moe_comm *c, moe_group g) { return c->rank[g]; }
int moe_comm_ep_hosts(const moe_comm *c) { return c ? c->ep_hosts : 1; }
int moe_comm_size(const moe_comm *c, moe_group g) { return c->size[g]; }
const char *moe_comm_backend(const moe_comm *c)
{
    (void)c;
    return "mpi";
}

void moe_comm_set_timeout(moe_comm *c, double seconds)
{
    if (c && seconds > 0)
        c->timeout_s = seconds;
}

void moe_comm_set_context(moe_comm *c, const char *phase, int layer)
{
    if (!c)
        return;
    c->ctx_phase = phase;
    c->ctx_layer = layer;
}

/* Adds n operations' times to their place (phase and layer of their wait). */
static void site_add(moe_comm *c, const char *phase, int layer, double total, double exposed,
                     long n)
{
    int i = 0;
    while (i < c->n_sites && !(c->sites[i].layer == layer &&
                               (c->sites[i].phase == phase ||
                                (c->sites[i].phase && phase && !strcmp(c->sites[i].phase, phase)))))
        i++;
    if (i == c->n_sites) {
        if (c->n_sites == MOE_COMM_SITES)
            i = MOE_COMM_SITES - 1; /* full: the last place takes the rest */
        else {
            c->n_sites++;
            c->sites[i].phase = phase;
            c->sites[i].layer = layer;
            c->sites[i].total = c->sites[i].exposed = 0;
            c->sites[i].count = 0;
        }
    }
    c->sites[i].total += total;
    c->sites[i].exposed += exposed;
    c->sites[i].count += n;
}

static const char counts_site[] = "token-count exchanges (every layer)";

static moe_status read_device_times(moe_comm *c);

int moe_comm_take_sites(moe_comm *c, moe_comm_site *out, int cap)
{
    if (!c)
        return 0;
    if (read_device_times(c) != MOE_OK) /* the device times due, into the sites (and the
                                           step's totals); logged, the step's sync reports it */
        return 0;
    const int n = c->n_sites;
    for (int i = 0; i < n && i < cap; i++) {
        if (c->sites[i].layer >= 0)
            snprintf(out[i].name, sizeof out[i].name, "%s of layer %d",
                     c->sites[i].phase ? c->sites[i].phase : "?", c->sites[i].layer);
        else
            snprintf(out[i].name, sizeof out[i].name, "%s",
                     c->sites[i].phase ? c->sites[i].phase : "outside a phase");
        out[i].total_s = c->sites[i].total;
        out[i].exposed_s = c->sites[i].exposed;
        out[i].count = c->sites[i].count;
    }
    c->n_sites = 0;
    return n;
}

/* Adds the times of every waited-for NCCL operation and frees their slots. */
static moe_status read_device_times(moe_comm *c)
{
#ifdef MOE_HAVE_CUDA
    if (c->nccl) {
        double idle = 0;
        MOE_CHECK(moe_nccl_gaps(c->nccl, &idle));
        c->times.exchange_exposed_s += idle;
        c->times.counts_exposed_s += idle;
        if (idle > 0)
            site_add(c, counts_site, -1, 0, idle, 0);
    }
    for (int h = 0; h < POOL_HANDLES; h++) {
        if (c->is_device[h] != DEVICE_TIMES_DUE)
            continue;
        double total = 0, exposed = 0;
        c->is_device[h] = DEVICE_NONE;
        MOE_CHECK(moe_nccl_times(c->nccl, h, &total, &exposed));
        site_add(c, c->wait_phase[h], c->wait_layer[h], total, exposed, 1);
        if (c->reduction[h]) {
            c->times.reduction_s += total;
            c->times.reduction_exposed_s += exposed;
        } else {
            c->times.exchange_s += total;
            c->times.exchange_exposed_s += exposed;
        }
    }
#else
    (void)c;
#endif
    return MOE_OK;
}

static moe_status take_handle(moe_comm *c, const char *what, moe_group g, int reduction,
                              moe_comm_handle *h)
{
    for (int i = 0; i < 2 * POOL_HANDLES; i++) {
        if (i == POOL_HANDLES) /* full: free the slots whose times are due */
            MOE_CHECK(read_device_times(c));
        int j = (c->next + i) % POOL_HANDLES;
        if (c->n_req[j] < 0 && c->is_device[j] == DEVICE_NONE) {
            c->n_req[j] = 0;
            c->what[j] = what;
            c->group[j] = g;
            c->reduction[j] = (unsigned char)reduction;
            c->next = (j + 1) % POOL_HANDLES;
            *h = j;
            return MOE_OK;
        }
    }
    MOE_FAIL(MOE_ERR_COMM, "more than %d communication handles outstanding (a missing wait?)",
             POOL_HANDLES);
}

moe_status moe_comm_watch(void *comm)
{
#ifdef MOE_HAVE_CUDA
    moe_comm *c = comm;
    if (c && c->nccl)
        return moe_nccl_watch(c->nccl);
#else
    (void)comm;
#endif
    return MOE_OK;
}

moe_status moe_comm_wait(moe_comm *c, moe_comm_handle h)
{
    if (h == MOE_COMM_NONE)
        return MOE_OK;
    if (h < 0 || h >= POOL_HANDLES || c->n_req[h] < 0)
        MOE_FAIL(MOE_ERR_INVALID, "wait on an invalid communication handle %d", h);
    int n = c->n_req[h];
    c->n_req[h] = -1;
    /* a reduction (world or EDP) or a token exchange (EP) */
    const int reduction = c->reduction[h];
    double total = 0, exposed = 0;
#ifdef MOE_HAVE_CUDA
    if (c->is_device[h] == DEVICE_IN_FLIGHT) {
        char what[192], ctx[96];
        context_text(c, ctx, sizeof ctx);
        snprintf(what, sizeof what, "%s%s", c->what[h], ctx);
        c->is_device[h] = DEVICE_NONE;
        MOE_CHECK(moe_nccl_wait(c->nccl, h, c->timeout_s, what));
        c->is_device[h] = DEVICE_TIMES_DUE; /* read by read_device_times */
        c->wait_phase[h] = c->ctx_phase;
        c->wait_layer[h] = c->ctx_layer;
    }
#endif
    if (n > 0) { /* MPI requests: what the host spends in the wait (MPI may move the data
                    only there), counted as both total and exposed: no claim of overlap */
        size_t at = (size_t)h * c->reqs_per_handle;
        const double t0 = moe_clock_seconds();
        MOE_CHECK(poll_requests(c, c->req + at, c->req_peer + at, n, c->what[h], c->group[h]));
        exposed = total = moe_clock_seconds() - t0;
        site_add(c, c->ctx_phase, c->ctx_layer, total, exposed, 1);
    }
    if (reduction) {
        c->times.reduction_s += total;
        c->times.reduction_exposed_s += exposed;
    } else {
        c->times.exchange_s += total;
        c->times.exchange_exposed_s += exposed;
    }
    return MOE_OK;
}

moe_status moe_comm_allreduce_start(moe_comm *c, moe_group g, void *buf, size_t count,
                                    size_t elem_bytes, moe_comm_handle after, moe_comm_handle *done)
{
    MOE_CHECK(moe_comm_wait(c, after));
    if (count > (size_t)INT32_MAX)
        MOE_FAIL(MOE_ERR_INVALID, "allreduce of %zu elements exceeds MPI's int count", count);
    MOE_CHECK(take_handle(
        c, g == MOE_GROUP_WORLD ? "gradient allreduce over the world" : "expert gradient allreduce",
        g, 1, done));
#ifdef MOE_HAVE_CUDA
    if (c->nccl) {
        moe_status st = moe_nccl_allreduce(c->nccl, g, buf, count, elem_bytes, *done);
        c->is_device[*done] = st == MOE_OK ? DEVICE_IN_FLIGHT : DEVICE_NONE;
        if (st != MOE_OK) {
            c->n_req[*done] = -1;
            *done = MOE_COMM_NONE;
        }
        return st;
    }
#endif
    size_t at = (size_t)*done * c->reqs_per_handle;
    c->req_peer[at] = PEER_COLLECTIVE;
    int rc = MPI_Iallreduce(MPI_IN_PLACE, buf, (int)count, real_type(elem_bytes), MPI_SUM,
                            c->groups[g], &c->req[at]);
    if (rc != MPI_SUCCESS) {
        c->n_req[*done] = -1;
        *done = MOE_COMM_NONE;
        MPI_TRY(rc, "gradient allreduce");
    }
    c->n_req[*done] = 1;
    return MOE_OK;
}

moe_status moe_comm_exchange_start(moe_comm *c, const void *send, const size_t *send_counts,
                                   const size_t *send_displs, void *recv, const size_t *recv_counts,
                                   const size_t *recv_displs, moe_comm_handle after,
                                   moe_comm_handle *done)
{
#ifdef MOE_HAVE_CUDA
    if (c->nccl) {
        MOE_CHECK(moe_comm_wait(c, after));
        MOE_CHECK(take_handle(c, "token exchange", MOE_GROUP_EP, 0, done));
        moe_status st = moe_nccl_exchange(c->nccl, c->ep_size, send, send_counts, send_displs, recv,
                                          recv_counts, recv_displs, c->exchange_repeat, *done);
        c->is_device[*done] = st == MOE_OK ? DEVICE_IN_FLIGHT : DEVICE_NONE;
        if (st != MOE_OK) {
            c->n_req[*done] = -1;
            *done = MOE_COMM_NONE;
        }
        return st;
    }
#endif
    for (int k = 1; k < c->exchange_repeat; k++) { /* the benchmark's slower network */
        moe_comm_handle h = MOE_COMM_NONE;
        MOE_CHECK(moe_comm_exchange_host_start(c, send, send_counts, send_displs, recv, recv_counts,
                                               recv_displs, after, &h));
        MOE_CHECK(moe_comm_wait(c, h));
        after = MOE_COMM_NONE;
    }
    return moe_comm_exchange_host_start(c, send, send_counts, send_displs, recv, recv_counts,
                                        recv_displs, after, done);
}

void moe_comm_set_exchange_repeat(moe_comm *c, int repeat)
{
    if (c && repeat >= 1)
        c->exchange_repeat = repeat;
}

moe_status moe_comm_exchange_host_start(moe_comm *c, const void *send, const size_t *send_counts,
                                        const size_t *send_displs, void *recv,
                                        const size_t *recv_counts, const size_t *recv_displs,
                                        moe_comm_handle after, moe_comm_handle *done)
{
    MOE_CHECK(moe_comm_wait(c, after));
    for (int p = 0; p < c->ep_size; p++)
        if (recv_counts[p] > (size_t)INT32_MAX || send_counts[p] > (size_t)INT32_MAX)
            MOE_FAIL(MOE_ERR_INVALID, "token exchange of more than 2 GiB with one peer");
    MOE_CHECK(take_handle(c, "token exchange", MOE_GROUP_EP, 0, done));
    MPI_Comm comm = c->groups[MOE_GROUP_EP];
    size_t at = (size_t)*done * c->reqs_per_handle;
    MPI_Request *r = c->req + at;
    int *peer = c->req_peer + at;
    int n = 0, rc = MPI_SUCCESS;
    for (int p = 0; p < c->ep_size && rc == MPI_SUCCESS; p++) {
        if (recv_counts[p] == 0)
            continue;
        rc = MPI_Irecv((char *)recv + recv_displs[p], (int)recv_counts[p], MPI_BYTE, p, TAG_ROWS,
                       comm, &r[n]);
        peer[n++] = p;
    }
    for (int p = 0; p < c->ep_size && rc == MPI_SUCCESS; p++) {
        if (send_counts[p] == 0)
            continue;
        rc = MPI_Isend((const char *)send + send_displs[p], (int)send_counts[p], MPI_BYTE, p,
                       TAG_ROWS, comm, &r[n]);
        peer[n++] = send_peer(p);
    }
    c->n_req[*done] = n;
    MPI_TRY(rc, "token exchange");
    return MOE_OK;
}

moe_status moe_comm_exchange_counts(moe_comm *c, const int64_t *send, int64_t *recv, int per)
{
    MPI_Comm comm = c->groups[MOE_GROUP_EP];
    const int me = c->rank[MOE_GROUP_EP];
    int n = 0, rc = MPI_SUCCESS;
    memcpy(recv + (size_t)me * per, send + (size_t)me * per, sizeof(int64_t) * (size_t)per);
    for (int p = 0; p < c->ep_size && rc == MPI_SUCCESS; p++) {
        if (p == me)
            continue;
        rc = MPI_Irecv(recv + (size_t)p * per, per, MPI_INT64_T, p, TAG_COUNTS, comm,
                       &c->scratch[n]);
        c->scratch_peer[n++] = p;
    }
    for (int p = 0; p < c->ep_size && rc == MPI_SUCCESS; p++) {
        if (p == me)
            continue;
        rc = MPI_Isend(send + (size_t)p * per, per, MPI_INT64_T, p, TAG_COUNTS, comm,
                       &c->scratch[n]);
        c->scratch_peer[n++] = send_peer(p);
    }
    MPI_TRY(rc, "token-count exchange");
    const double t0 = moe_clock_seconds();
#ifdef MOE_HAVE_CUDA
    int gap = -1;
    if (c->nccl)
        MOE_CHECK(moe_nccl_gap_begin(c->nccl, &gap));
#endif
    MOE_CHECK(
        poll_requests(c, c->scratch, c->scratch_peer, n, "token-count exchange", MOE_GROUP_EP));
    const double took = moe_clock_seconds() - t0;
    c->times.exchange_s += took;
    c->times.counts_s += took;
#ifdef MOE_HAVE_CUDA
    if (c->nccl) { /* exposed: what the compute stream sat idle meanwhile (read later) */
        MOE_CHECK(moe_nccl_gap_end(c->nccl, gap));
        site_add(c, counts_site, -1, took, 0, 1);
    } else
#endif
    { /* the host computes: all of it is exposed */
        c->times.exchange_exposed_s += took;
        c->times.counts_exposed_s += took;
        site_add(c, counts_site, -1, took, took, 1);
    }
    return MOE_OK;
}

/* One collective request, waited for with the deadline. */
static moe_status wait_one(moe_comm *c, MPI_Request *r, const char *what, moe_group g)
{
    int peer = PEER_COLLECTIVE;
    return poll_requests(c, r, &peer, 1, what, g);
}

moe_status moe_comm_sum_doubles(moe_comm *c, moe_group g, double *vals, int n)
{
    MPI_Request r;
    MPI_TRY(MPI_Iallreduce(MPI_IN_PLACE, vals, n, MPI_DOUBLE, MPI_SUM, c->groups[g], &r), "sum");
    MOE_CHECK(wait_one(c, &r, "sum of statistics", g));
    return MOE_OK;
}

moe_status moe_comm_max_doubles(moe_comm *c, moe_group g, double *vals, int n)
{
    MPI_Request r;
    MPI_TRY(MPI_Iallreduce(MPI_IN_PLACE, vals, n, MPI_DOUBLE, MPI_MAX, c->groups[g], &r), "max");
    MOE_CHECK(wait_one(c, &r, "maximum of statistics", g));
    return MOE_OK;
}

moe_status moe_comm_sum_int64(moe_comm *c, moe_group g, int64_t *vals, int n)
{
    MPI_Request r;
    MPI_TRY(MPI_Iallreduce(MPI_IN_PLACE, vals, n, MPI_INT64_T, MPI_SUM, c->groups[g], &r), "sum");
    MOE_CHECK(wait_one(c, &r, "sum of counters", g));
    return MOE_OK;
}

moe_status moe_comm_gather_bytes(moe_comm *c, const void *data, size_t nbytes, void **out,
                                 size_t *sizes)
{
    const int world = c->size[MOE_GROUP_WORLD], root = c->rank[MOE_GROUP_WORLD] == 0;
    MPI_Comm comm = c->groups[MOE_GROUP_WORLD];
    moe_status st = MOE_OK;
    int *counts = NULL, *displs = NULL;
    char *buf = NULL;
    *out = NULL;
    if (nbytes > (size_t)INT32_MAX)
        MOE_FAIL(MOE_ERR_INVALID, "gather of %zu bytes exceeds MPI's int count", nbytes);
    int mine = (int)nbytes;
    if (root) {
        counts = malloc(sizeof(int) * (size_t)world);
        displs = malloc(sizeof(int) * (size_t)world);
        if (!counts || !displs) {
            moe_log_at(__FILE__, __LINE__, "cannot allocate the gather counts");
            st = MOE_ERR_NOMEM;
        }
    }
    /* every rank takes part even after a local failure, then all agree below */
    MPI_Request r;
    int rc = MPI_Igather(&mine, 1, MPI_INT, counts, 1, MPI_INT, 0, comm, &r);
    if (rc != MPI_SUCCESS) {
        free(counts);
        free(displs);
        MPI_TRY(rc, "gather of sizes");
    }
    MOE_CHECK_GOTO(st, wait_one(c, &r, "gather of checkpoint manifests", MOE_GROUP_WORLD));
    int64_t total = 0;
    if (root && counts && displs) {
        for (int i = 0; i < world; i++) {
            displs[i] = (int)total;
            total += counts[i];
        }
        if (total > INT32_MAX) {
            moe_log_at(__FILE__, __LINE__, "gather of %lld bytes exceeds MPI's int count",
                       (long long)total);
            st = MOE_ERR_INVALID;
        } else if (!(buf = malloc(total > 0 ? (size_t)total : 1))) {
            moe_log_at(__FILE__, __LINE__, "cannot allocate %lld bytes", (long long)total);
            st = MOE_ERR_NOMEM;
        }
    }
    int64_t bad = st != MOE_OK;
    MOE_CHECK_GOTO(st, moe_comm_sum_int64(c, MOE_GROUP_WORLD, &bad, 1));
    if (bad) {
        st = st != MOE_OK ? st : MOE_ERR_COMM;
        goto fail;
    }
    rc = MPI_Igatherv(data, mine, MPI_BYTE, buf, counts, displs, MPI_BYTE, 0, comm, &r);
    if (rc != MPI_SUCCESS) {
        moe_log_at(__FILE__, __LINE__, "gather of checkpoint manifests: MPI_Igatherv failed");
        st = MOE_ERR_COMM;
        goto fail;
    }
    MOE_CHECK_GOTO(st, wait_one(c, &r, "gather of checkpoint manifests", MOE_GROUP_WORLD));
    if (root) {
        for (int i = 0; i < world; i++)
            sizes[i] = (size_t)counts[i];
        *out = buf;
        buf = NULL;
    }
fail:
    free(buf);
    free(counts);
    free(displs);
    return st;
}

void moe_comm_take_times(moe_comm *c, moe_comm_times *out)
{
    if (!c) {
        memset(out, 0, sizeof *out);
        return;
    }
    if (read_device_times(c) != MOE_OK) /* logged; the step's own sync reports the error */
        memset(&c->times, 0, sizeof c->times);
    *out = c->times;
    memset(&c->times, 0, sizeof c->times);
}

moe_status moe_comm_enable_device(moe_comm *c, void *stream)
{
#ifdef MOE_HAVE_CUDA
    if (c->nccl)
        return MOE_OK;
    MOE_CHECK(moe_nccl_create(&c->nccl, c->groups, stream, POOL_HANDLES, c->timeout_s));
    return MOE_OK;
#else
    (void)c;
    (void)stream;
    MOE_FAIL(MOE_ERR_INVALID, "this build has no CUDA, so no NCCL");
#endif
}

void moe_comm_abort(int code)
{
    MPI_Abort(MPI_COMM_WORLD, code);
    abort(); /* MPI_Abort does not return; be sure */
}
