/* launcher/ranks.h: who this process is in the job: MPI start-up, world rank and size,
 * local rank (from MPI_Comm_split_type, cross-checked with the launcher's variables). */
#ifndef MOE_LAUNCHER_RANKS_H
#define MOE_LAUNCHER_RANKS_H

typedef struct {
    int rank, world;
    int local_rank, local_size;
    char host[64];
} moe_ranks;

/* Initialises MPI and fills r. Returns 0, or non-zero after printing why (a mismatch
 * between MPI's local rank and OMPI_COMM_WORLD_LOCAL_RANK / SLURM_LOCALID is an error:
 * it means the GPU choice would be wrong). */
int moe_ranks_init(int *argc, char ***argv, moe_ranks *r);

/* Finalizes MPI. */
void moe_ranks_finalize(void);

/* Ends the whole job with `code` (MPI_Abort): never one rank alone. */
void moe_ranks_abort(int code) __attribute__((noreturn));

#endif
