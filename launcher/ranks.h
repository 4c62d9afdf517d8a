/* launcher/ranks.h: who this process is in the job: MPI start-up, world rank and size,
 * local rank (from MPI_Comm_split_type, cross-checked with the launcher's variables). */
#ifndef MOE_LAUNCHER_RANKS_H
#define MOE_LAUNCHER_RANKS_H

#include <stddef.h>

typedef struct {
    int rank, world;
    int local_rank, local_size;
    char host[64];
} moe_ranks;

/* Initialises MPI and fills r. Returns 0, or non-zero after printing why (a mismatch
 * between MPI's local rank and OMPI_COMM_WORLD_LOCAL_RANK / SLURM_LOCALID is an error:
 * it means the GPU choice would be wrong). */
int moe_ranks_init(int *argc, char ***argv, moe_ranks *r);

/* Collective: on rank 0, writes "N hosts: a (ranks 0-3), b (ranks 4-7)" (the hosts in
 * rank order with their ranks) into buf; other ranks get "". */
void moe_ranks_hosts(const moe_ranks *r, char *buf, size_t cap);

/* Finalizes MPI. */
void moe_ranks_finalize(void);

/* Ends the whole job with `code` (MPI_Abort): never one rank alone. */
void moe_ranks_abort(int code) __attribute__((noreturn));

#endif
