/* launcher/bind.h: where each rank's threads run and its memory lives (hwloc).
 *
 * Owns: the binding decision (a pure function of a topology, the GPU PCI bus id of every
 * local rank, the local rank and size, and the mode), the detection of a binding the
 * launcher already made, applying a decision (hwloc_set_cpubind, hwloc_set_membind), and
 * the per-rank binding lines of the banner.
 * Does not own: choosing the GPU (its bus id comes in), the topology's discovery options
 * beyond I/O filtering, threads (they inherit the process binding when created).
 *
 * Rules (docs/launch.md says the same for users). A "core" is a Core object of the
 * topology with all its PUs (hyper-threads); a topology without Core objects uses PUs.
 *
 * 1. Domain of a rank. With GPUs: the PCI device with the rank's bus id, walked up to its
 *    first non-I/O ancestor (a Package, NUMA Group or the Machine): that ancestor's cpuset
 *    and nodeset. CPU-only (no bus ids), or when any local rank's bus id is not in the
 *    topology (no PCI information, say): the NUMA nodes that have cores are dealt out in
 *    order, local rank j taking node floor(j * N / k) when k >= N ranks share N nodes,
 *    else nodes [floor(j * N / k), floor((j + 1) * N / k)). No NUMA information reads as
 *    one node holding every core.
 * 2. Split. Ranks with the same domain form a group; groups are served smallest domain
 *    first, each taking the cores of its domain that no earlier group took. A group of m
 *    ranks with n >= m free cores splits them into m contiguous blocks in core order, the
 *    first n % m ranks one core larger, in local-rank order: no two ranks share a core.
 * 3. Modes. auto: the rank's block. core: the first core of that block (exactly one
 *    core). numa: every core of the domain, shared by the ranks of the group (threads of
 *    a rank may use the whole socket). none: no binding at all.
 * 4. Sharing fallback. A group with fewer free cores than ranks (n < m; more ranks than
 *    cores): in auto and numa every rank of it gets all n free cores (or, with none free,
 *    all of its domain's cores) and shares them; in core mode rank p of the group gets
 *    free core p mod n. The plan says so (`shared`, `note`).
 * 5. Memory: the NUMA nodes of the chosen cores (hwloc_cpuset_to_nodeset); bound with
 *    HWLOC_MEMBIND_BIND unless that is every node of the machine (nothing to restrict).
 * 6. Launcher binding wins: unless the mode is none, a process the launcher already
 *    bound (see moe_bind_launcher_bound) keeps its CPU binding and memory policy.
 *
 * A bus id that does not parse (not "[dddd:]bb:dd.f" in hex) is an error. */
#ifndef MOE_LAUNCHER_BIND_H
#define MOE_LAUNCHER_BIND_H

#include <hwloc.h>
#include <stddef.h>
#include <stdio.h>

#include "launcher/ranks.h"
#include "util/status.h"

typedef enum { MOE_BIND_AUTO, MOE_BIND_NUMA, MOE_BIND_CORE, MOE_BIND_NONE } moe_bind_mode;

/* The binding decided for one rank. */
typedef struct {
    hwloc_bitmap_t cpuset;  /* PUs to run on; every PU of the machine for bind = none */
    hwloc_bitmap_t nodeset; /* NUMA nodes for memory */
    int apply;              /* 0 for bind = none: leave the process alone */
    int gpu_local;          /* 1: placed by its GPU's PCI locality */
    int n_cores;            /* cores in cpuset */
    int shared;             /* 1: sharing fallback (more ranks than cores in the domain) */
    char note[192];         /* why a fallback was taken; "" when none */
} moe_bind_plan;

/* "auto" | "numa" | "core" | "none" -> *mode. MOE_ERR_INVALID (logged) otherwise. */
moe_status moe_bind_mode_parse(const char *text, moe_bind_mode *mode);

/* The name of a mode ("auto", ...). Never NULL. */
const char *moe_bind_mode_name(moe_bind_mode mode);

/* Decides the binding of local rank `local_rank` of `local_size` on `topo` (loaded; with
 * I/O objects kept when busids is given) by the rules above. busids: NULL for a CPU-only
 * run, else local_size strings (the GPU of each local rank, "0000:1b:00.0"). Pure: reads
 * topo, never binds. On success the caller owns plan (moe_bind_plan_free). Errors:
 * MOE_ERR_INVALID for a bad argument or an unparsable bus id, MOE_ERR_NOMEM; the message
 * is logged and plan is left empty (freeing it is still safe). */
moe_status moe_bind_plan_compute(hwloc_topology_t topo, moe_bind_mode mode, int local_rank,
                                 int local_size, const char *const *busids, moe_bind_plan *plan);

/* Frees plan's sets; safe on a zeroed or already freed plan. */
void moe_bind_plan_free(moe_bind_plan *plan);

/* Whether the launcher already bound this process, from `current` (this process's CPU
 * binding) and the environment: current is a strict subset of the topology's allowed
 * cpuset, or OMPI_MCA_orte_bound_at_launch=1 (Open MPI 4 bound it), or
 * OMPI_MCA_hwloc_base_binding_policy is set and not "none" (mpirun --bind-to), or
 * SLURM_CPU_BIND_TYPE is set and is not "none" (srun --cpu-bind). Returns 1 and writes the
 * reason to why (cap bytes), else 0. */
int moe_bind_launcher_bound(hwloc_topology_t topo, hwloc_const_cpuset_t current, char *why,
                            size_t cap);

/* Writes "cpus LIST (N cores), numa LIST" for a cpuset/nodeset pair. */
void moe_bind_describe(hwloc_topology_t topo, hwloc_const_cpuset_t cpuset,
                       hwloc_const_nodeset_t nodeset, char *buf, size_t cap);

/* Binds this process (all its threads; threads created later inherit it) to plan's
 * cpuset (hwloc_set_cpubind, HWLOC_CPUBIND_PROCESS) and its memory to plan's nodeset
 * (hwloc_set_membind, HWLOC_MEMBIND_BIND, by nodeset; skipped when that is every node).
 * When the system refuses (no binding support, EPERM in a container) and `strict` is 0,
 * returns MOE_OK and writes the reason to why; with strict 1 that is MOE_ERR_INVALID.
 * *mem_bound says whether the memory policy was set. */
moe_status moe_bind_apply(hwloc_topology_t topo, const moe_bind_plan *plan, int strict,
                          int *mem_bound, char *why, size_t cap);

/* The launcher's entry point. Collective over MPI_COMM_WORLD: every rank calls it once,
 * after MPI start-up and before the runtime allocates or starts threads. Loads this
 * machine's topology (PCI devices only when gpu_busid is given), gathers the bus ids of
 * the node's ranks, decides (moe_bind_plan_compute), applies it unless the mode is none
 * or the launcher bound the process, and gathers every rank's binding line for
 * moe_bind_print. mode: "auto" | "numa" | "core" | "none" ([parallel] bind). gpu_busid:
 * this rank's GPU, or NULL for a CPU-only run (a node whose ranks disagree is placed as a
 * CPU-only run). Errors: MOE_ERR_COMM (MPI), MOE_ERR_INVALID (topology, bus id, or a
 * refused binding in numa/core mode), MOE_ERR_NOMEM; the message names the cause. */
moe_status moe_bind_rank(const moe_ranks *ranks, const char *mode, const char *gpu_busid);

/* Prints every rank's binding line ("  bind host:rank local L: ...") on rank 0, after
 * moe_bind_rank; prints nothing on other ranks or before. */
void moe_bind_print(FILE *out);

#endif
