/* launcher/ranks.c: MPI start-up and rank discovery. */
#include "launcher/ranks.h"

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm.h"
#include "util/status.h"

/* The local rank the launcher announced, or -1: Open MPI, then Slurm. */
static int env_local_rank(const char **which)
{
    static const char *vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) {
            *which = vars[i];
            return atoi(v);
        }
    }
    return -1;
}

int moe_ranks_init(int *argc, char ***argv, moe_ranks *r)
{
    int provided = 0;
    memset(r, 0, sizeof *r);
    if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
        fprintf(stderr, "moe-dist: MPI_Init_thread failed\n");
        return 1;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &r->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &r->world);
    moe_log_set_rank(r->rank);
    if (gethostname(r->host, sizeof r->host - 1) != 0)
        strcpy(r->host, "?");

    MPI_Comm node;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, r->rank, MPI_INFO_NULL, &node) !=
        MPI_SUCCESS) {
        moe_log("MPI_Comm_split_type failed: cannot find the ranks of this node");
        return 1;
    }
    MPI_Comm_rank(node, &r->local_rank);
    MPI_Comm_size(node, &r->local_size);
    MPI_Comm_free(&node);

    const char *which = NULL;
    int env = env_local_rank(&which);
    if (env >= 0 && env != r->local_rank) {
        moe_log("local rank %d from MPI_Comm_split_type but %s=%d: the launcher and MPI "
                "disagree on which process is which on this node",
                r->local_rank, which, env);
        return 1;
    }
    return 0;
}

void moe_ranks_hosts(const moe_ranks *r, char *buf, size_t cap)
{
    enum { HOST = 64 };
    char *all = r->rank == 0 ? calloc((size_t)r->world, HOST) : NULL;
    buf[0] = '\0';
    if (r->rank == 0 && !all) {
        snprintf(buf, cap, "(hosts unknown: out of memory)");
        return;
    }
    char mine[HOST] = {0};
    snprintf(mine, sizeof mine, "%s", r->host);
    if (MPI_Gather(mine, HOST, MPI_CHAR, all, HOST, MPI_CHAR, 0, MPI_COMM_WORLD) != MPI_SUCCESS) {
        snprintf(buf, cap, "(hosts unknown: MPI_Gather failed)");
        free(all);
        return;
    }
    if (r->rank != 0)
        return;
    int hosts = 0;
    size_t used = 0;
    for (int i = 0; i < r->world; i++) {
        if (i > 0 && strcmp(all + (size_t)i * HOST, all + (size_t)(i - 1) * HOST) == 0)
            continue;
        int j = i;
        while (j + 1 < r->world &&
               strcmp(all + (size_t)(j + 1) * HOST, all + (size_t)i * HOST) == 0)
            j++;
        hosts++;
        if (used < cap)
            used += (size_t)snprintf(buf + used, cap - used, "%s%s (ranks %d-%d)", used ? ", " : "",
                                     all + (size_t)i * HOST, i, j);
    }
    char tmp[1024];
    snprintf(tmp, sizeof tmp, "%d host%s: %s", hosts, hosts == 1 ? "" : "s", buf);
    snprintf(buf, cap, "%s", tmp);
    free(all);
}

void moe_ranks_finalize(void) { MPI_Finalize(); }

void moe_ranks_abort(int code) { moe_comm_abort(code); }
