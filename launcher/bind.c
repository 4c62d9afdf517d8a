/* launcher/bind.c: CPU and memory binding of each rank with hwloc: the decision (pure, on
 * any topology), detecting a launcher's binding, applying it, and the banner lines.
 * The rules are in bind.h; docs/launch.md explains them to users. */
#include "launcher/bind.h"

#include <errno.h>
#include <mpi.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUSID_LEN 32 /* "00000000:00:00.0" and a margin */
#define LINE_LEN 320 /* one rank's banner line */

static const char *const mode_names[] = {"auto", "numa", "core", "none"};

moe_status moe_bind_mode_parse(const char *text, moe_bind_mode *mode)
{
    for (int i = 0; text && i < (int)(sizeof mode_names / sizeof mode_names[0]); i++) {
        if (strcmp(text, mode_names[i]) == 0) {
            *mode = (moe_bind_mode)i;
            return MOE_OK;
        }
    }
    MOE_FAIL(MOE_ERR_INVALID, "bind = '%s': expected auto, numa, core or none",
             text ? text : "(null)");
}

const char *moe_bind_mode_name(moe_bind_mode mode)
{
    return mode >= MOE_BIND_AUTO && mode <= MOE_BIND_NONE ? mode_names[mode] : "?";
}

void moe_bind_plan_free(moe_bind_plan *plan)
{
    if (!plan)
        return;
    hwloc_bitmap_free(plan->cpuset);
    hwloc_bitmap_free(plan->nodeset);
    plan->cpuset = plan->nodeset = NULL;
}

/* ---- bus ids ---- */

/* Reads 1..max_digits hex digits at *p, then expects `end`; advances *p past it. */
static int hex_field(const char **p, int max_digits, char end, unsigned *out)
{
    unsigned v = 0;
    int n = 0;
    const char *s = *p;
    for (; n < max_digits; n++, s++) {
        int c = *s, d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if (c >= 'a' && c <= 'f')
            d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F')
            d = c - 'A' + 10;
        else
            break;
        v = v * 16 + (unsigned)d;
    }
    if (n == 0 || *s != end)
        return 0;
    *p = end ? s + 1 : s;
    *out = v;
    return 1;
}

/* "[domain:]bus:dev.func" in hex (CUDA writes "0000:1b:00.0", nvidia-smi
 * "00000000:1B:00.0"). Returns 1 and the fields, or 0. */
static int parse_busid(const char *text, unsigned *domain, unsigned *bus, unsigned *dev,
                       unsigned *func)
{
    const char *p = text;
    int colons = 0;
    for (const char *s = text; *s; s++)
        colons += *s == ':';
    *domain = 0;
    if (colons == 2 && !hex_field(&p, 8, ':', domain))
        return 0;
    if (colons != 1 && colons != 2)
        return 0;
    return hex_field(&p, 2, ':', bus) && hex_field(&p, 2, '.', dev) && *dev < 32 &&
           hex_field(&p, 1, '\0', func) && *func < 8;
}

/* ---- the decision ---- */

/* Cores, or PUs on a topology without Core objects. */
static hwloc_obj_type_t unit_type(hwloc_topology_t topo)
{
    return hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE) > 0 ? HWLOC_OBJ_CORE : HWLOC_OBJ_PU;
}

/* The units inside `set` that do not intersect `exclude` (may be NULL), in logical
 * order, into units[] (capacity max). Returns how many. */
static int units_inside(hwloc_topology_t topo, hwloc_const_cpuset_t set,
                        hwloc_const_cpuset_t exclude, hwloc_obj_t *units, int max)
{
    hwloc_obj_type_t type = unit_type(topo);
    int n = 0;
    hwloc_obj_t o = NULL;
    while ((o = hwloc_get_next_obj_inside_cpuset_by_type(topo, set, type, o)) != NULL) {
        if (exclude && hwloc_bitmap_intersects(o->cpuset, exclude))
            continue;
        if (n < max)
            units[n] = o;
        n++;
    }
    return n;
}

/* CPU-only domains: NUMA nodes that have cores, dealt out to the k local ranks. */
static moe_status cpu_domains(hwloc_topology_t topo, int k, hwloc_bitmap_t *dom)
{
    int total = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
    hwloc_obj_t *nodes = calloc(total > 0 ? (size_t)total : 1, sizeof *nodes);
    if (!nodes)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate %d NUMA node entries", total);
    int n = 0;
    for (int i = 0; i < total; i++) {
        hwloc_obj_t o = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, (unsigned)i);
        if (o && o->cpuset && !hwloc_bitmap_iszero(o->cpuset))
            nodes[n++] = o; /* memory-only nodes (HBM, CXL) hold no cores */
    }
    hwloc_const_cpuset_t all = hwloc_topology_get_topology_cpuset(topo);
    for (int j = 0; j < k; j++) {
        if (n == 0) {
            if (hwloc_bitmap_copy(dom[j], all) != 0)
                goto nomem;
            continue;
        }
        int first = (int)((long long)j * n / k);
        int last = k >= n ? first : (int)((long long)(j + 1) * n / k) - 1;
        hwloc_bitmap_zero(dom[j]);
        for (int i = first; i <= last; i++)
            if (hwloc_bitmap_or(dom[j], dom[j], nodes[i]->cpuset) != 0)
                goto nomem;
    }
    free(nodes);
    return MOE_OK;
nomem:
    free(nodes);
    MOE_FAIL(MOE_ERR_NOMEM, "cannot build the CPU-only domains");
}

/* GPU domains: the first non-I/O ancestor of each local rank's GPU. Returns MOE_OK with
 * *found 0 (and a note) when some bus id is not in the topology. */
static moe_status gpu_domains(hwloc_topology_t topo, int k, const char *const *busids,
                              hwloc_bitmap_t *dom, int *found, char *note, size_t cap)
{
    unsigned d[4];
    for (int j = 0; j < k; j++) {
        if (!busids[j] || !parse_busid(busids[j], &d[0], &d[1], &d[2], &d[3]))
            MOE_FAIL(MOE_ERR_INVALID,
                     "GPU PCI bus id '%s' of local rank %d: expected [dddd:]bb:dd.f",
                     busids[j] ? busids[j] : "(null)", j);
    }
    *found = 1;
    for (int j = 0; j < k; j++) {
        parse_busid(busids[j], &d[0], &d[1], &d[2], &d[3]);
        hwloc_obj_t dev = hwloc_get_pcidev_by_busid(topo, d[0], d[1], d[2], d[3]);
        hwloc_obj_t anc = dev ? hwloc_get_non_io_ancestor_obj(topo, dev) : NULL;
        if (!anc || !anc->cpuset || hwloc_bitmap_iszero(anc->cpuset)) {
            snprintf(note, cap,
                     "GPU %s of local rank %d is not in the topology (no PCI information?): "
                     "placed as a CPU-only run",
                     busids[j], j);
            *found = 0;
            return MOE_OK;
        }
        if (hwloc_bitmap_copy(dom[j], anc->cpuset) != 0)
            MOE_FAIL(MOE_ERR_NOMEM, "cannot copy a cpuset");
    }
    return MOE_OK;
}

/* Sets plan->cpuset to the union of units[from, from + count). */
static int take_units(moe_bind_plan *plan, hwloc_obj_t *units, int from, int count)
{
    hwloc_bitmap_zero(plan->cpuset);
    for (int i = from; i < from + count; i++)
        if (hwloc_bitmap_or(plan->cpuset, plan->cpuset, units[i]->cpuset) != 0)
            return -1;
    plan->n_cores = count;
    return 0;
}

/* The group of ranks whose domain equals dom[j]: its leader is its lowest member. */
static int leader_of(hwloc_bitmap_t *dom, int j)
{
    for (int i = 0; i < j; i++)
        if (hwloc_bitmap_isequal(dom[i], dom[j]))
            return i;
    return j;
}

/* Splits the local rank's group as rules 2-4 of bind.h say; sets plan->cpuset. */
static moe_status split(hwloc_topology_t topo, moe_bind_mode mode, int me, int k,
                        hwloc_bitmap_t *dom, moe_bind_plan *plan)
{
    moe_status st = MOE_OK;
    int n_units = hwloc_get_nbobjs_by_type(topo, unit_type(topo));
    int *order = malloc(sizeof(int) * (size_t)k);
    int *size = malloc(sizeof(int) * (size_t)k);
    hwloc_obj_t *units = malloc(sizeof(hwloc_obj_t) * (size_t)(n_units > 0 ? n_units : 1));
    hwloc_bitmap_t used = hwloc_bitmap_alloc();
    if (!order || !size || !units || !used) {
        st = MOE_ERR_NOMEM;
        moe_log_at(__FILE__, __LINE__, "cannot allocate the split of %d ranks", k);
        goto out;
    }
    /* groups (by leader), smallest domain first, then lowest first PU, then leader */
    int n_groups = 0;
    for (int j = 0; j < k; j++) {
        if (leader_of(dom, j) != j)
            continue;
        size[j] = units_inside(topo, dom[j], NULL, units, 0);
        int at = n_groups++;
        while (at > 0) {
            int o = order[at - 1];
            int before =
                size[o] < size[j] ||
                (size[o] == size[j] && hwloc_bitmap_first(dom[o]) <= hwloc_bitmap_first(dom[j]));
            if (before)
                break;
            order[at] = o;
            at--;
        }
        order[at] = j;
    }
    int mine = leader_of(dom, me);
    for (int g = 0; g < n_groups; g++) {
        int lead = order[g];
        int free_n = units_inside(topo, dom[lead], used, units, n_units);
        if (lead != mine) {
            for (int i = 0; i < free_n; i++) {
                if (hwloc_bitmap_or(used, used, units[i]->cpuset) != 0) {
                    st = MOE_ERR_NOMEM;
                    moe_log_at(__FILE__, __LINE__, "cannot build a cpuset");
                    goto out;
                }
            }
            continue;
        }
        int m = 0, p = 0;
        for (int j = 0; j < k; j++) {
            if (leader_of(dom, j) == lead) {
                if (j == me)
                    p = m;
                m++;
            }
        }
        char where[96];
        hwloc_bitmap_list_snprintf(where, sizeof where, dom[lead]);
        int rc = 0;
        if (mode == MOE_BIND_NUMA) {
            rc = take_units(plan, units, 0, units_inside(topo, dom[lead], NULL, units, n_units));
        } else if (free_n >= m) {
            int base = free_n / m, extra = free_n % m;
            int start = p * base + (p < extra ? p : extra);
            int count = base + (p < extra);
            rc = take_units(plan, units, start, mode == MOE_BIND_CORE ? 1 : count);
        } else {
            if (free_n == 0)
                free_n = units_inside(topo, dom[lead], NULL, units, n_units);
            plan->shared = 1;
            snprintf(plan->note, sizeof plan->note, "shared: %d ranks on %d cores of cpus %s", m,
                     free_n, where);
            if (free_n == 0) /* a domain smaller than one core: take its PUs */
                rc = hwloc_bitmap_copy(plan->cpuset, dom[lead]);
            else if (mode == MOE_BIND_CORE)
                rc = take_units(plan, units, p % free_n, 1);
            else
                rc = take_units(plan, units, 0, free_n);
        }
        if (rc != 0) {
            st = MOE_ERR_NOMEM;
            moe_log_at(__FILE__, __LINE__, "cannot build a cpuset");
        }
        break;
    }
out:
    free(order);
    free(size);
    free(units);
    hwloc_bitmap_free(used);
    return st;
}

moe_status moe_bind_plan_compute(hwloc_topology_t topo, moe_bind_mode mode, int local_rank,
                                 int local_size, const char *const *busids, moe_bind_plan *plan)
{
    moe_status st = MOE_OK;
    hwloc_bitmap_t *dom = NULL;
    memset(plan, 0, sizeof *plan);
    if (!topo || local_size < 1 || local_rank < 0 || local_rank >= local_size ||
        mode < MOE_BIND_AUTO || mode > MOE_BIND_NONE)
        MOE_FAIL(MOE_ERR_INVALID, "bind: bad arguments (local rank %d of %d, mode %d)", local_rank,
                 local_size, (int)mode);
    plan->cpuset = hwloc_bitmap_alloc();
    plan->nodeset = hwloc_bitmap_alloc();
    dom = calloc((size_t)local_size, sizeof *dom);
    if (!plan->cpuset || !plan->nodeset || !dom)
        goto nomem;
    if (mode == MOE_BIND_NONE) {
        if (hwloc_bitmap_copy(plan->cpuset, hwloc_topology_get_topology_cpuset(topo)) != 0 ||
            hwloc_bitmap_copy(plan->nodeset, hwloc_topology_get_topology_nodeset(topo)) != 0)
            goto nomem;
        plan->n_cores = units_inside(topo, plan->cpuset, NULL, NULL, 0);
        free(dom);
        return MOE_OK;
    }
    for (int j = 0; j < local_size; j++)
        if (!(dom[j] = hwloc_bitmap_alloc()))
            goto nomem;
    int gpu = 0;
    if (busids)
        MOE_CHECK_GOTO(
            st, gpu_domains(topo, local_size, busids, dom, &gpu, plan->note, sizeof plan->note));
    if (!gpu)
        MOE_CHECK_GOTO(st, cpu_domains(topo, local_size, dom));
    char note[sizeof plan->note];
    memcpy(note, plan->note, sizeof note);
    plan->note[0] = '\0';
    MOE_CHECK_GOTO(st, split(topo, mode, local_rank, local_size, dom, plan));
    if (note[0] && plan->note[0]) { /* keep both reasons */
        char both[sizeof plan->note];
        snprintf(both, sizeof both, "%.90s; %.90s", note, plan->note);
        memcpy(plan->note, both, sizeof both);
    } else if (note[0]) {
        memcpy(plan->note, note, sizeof note);
    }
    if (hwloc_cpuset_to_nodeset(topo, plan->cpuset, plan->nodeset) != 0)
        goto nomem;
    plan->apply = 1;
    plan->gpu_local = gpu;
    for (int j = 0; j < local_size; j++)
        hwloc_bitmap_free(dom[j]);
    free(dom);
    return MOE_OK;
nomem:
    st = MOE_ERR_NOMEM;
    moe_log_at(__FILE__, __LINE__, "bind: out of memory");
fail:
    for (int j = 0; dom && j < local_size; j++)
        hwloc_bitmap_free(dom[j]);
    free(dom);
    moe_bind_plan_free(plan);
    return st;
}

/* ---- the launcher's binding, describing and applying ---- */

/* 1 if the environment variable is set, non-empty and does not start with "none". */
static int env_binds(const char *name, char *why, size_t cap)
{
    const char *v = getenv(name);
    if (!v || !*v || strncmp(v, "none", 4) == 0)
        return 0;
    snprintf(why, cap, "%s=%s", name, v);
    return 1;
}

int moe_bind_launcher_bound(hwloc_topology_t topo, hwloc_const_cpuset_t current, char *why,
                            size_t cap)
{
    hwloc_const_cpuset_t allowed = hwloc_topology_get_allowed_cpuset(topo);
    if (current && !hwloc_bitmap_iszero(current) && !hwloc_bitmap_isincluded(allowed, current)) {
        char list[128];
        hwloc_bitmap_list_snprintf(list, sizeof list, current);
        snprintf(why, cap, "started bound to cpus %s", list);
        return 1;
    }
    const char *v = getenv("OMPI_MCA_orte_bound_at_launch");
    if (v && strcmp(v, "1") == 0) {
        snprintf(why, cap, "OMPI_MCA_orte_bound_at_launch=1");
        return 1;
    }
    return env_binds("OMPI_MCA_hwloc_base_binding_policy", why, cap) ||
           env_binds("SLURM_CPU_BIND_TYPE", why, cap);
}

void moe_bind_describe(hwloc_topology_t topo, hwloc_const_cpuset_t cpuset,
                       hwloc_const_nodeset_t nodeset, char *buf, size_t cap)
{
    char cpus[160], nodes[64];
    hwloc_bitmap_list_snprintf(cpus, sizeof cpus, cpuset);
    hwloc_bitmap_list_snprintf(nodes, sizeof nodes, nodeset);
    int n = units_inside(topo, cpuset, NULL, NULL, 0);
    snprintf(buf, cap, "cpus %s (%d %s%s), numa %s", cpus, n,
             unit_type(topo) == HWLOC_OBJ_CORE ? "core" : "pu", n == 1 ? "" : "s", nodes);
}

/* A refused binding: an error when strict, else the reason in why. */
static moe_status refused(int strict, char *why, size_t cap, const char *what, const char *reason)
{
    if (strict)
        MOE_FAIL(MOE_ERR_INVALID, "cannot bind %s: %s", what, reason);
    snprintf(why, cap, "%s not bound: %s", what, reason);
    return MOE_OK;
}

moe_status moe_bind_apply(hwloc_topology_t topo, const moe_bind_plan *plan, int strict,
                          int *mem_bound, char *why, size_t cap)
{
    *mem_bound = 0;
    if (cap)
        why[0] = '\0';
    if (!plan->apply)
        return MOE_OK;
    const struct hwloc_topology_support *sup = hwloc_topology_get_support(topo);
    if (!sup || !sup->cpubind || !sup->cpubind->set_thisproc_cpubind)
        return refused(strict, why, cap, "cpus", "this system does not support CPU binding");
    if (hwloc_set_cpubind(topo, plan->cpuset, HWLOC_CPUBIND_PROCESS) != 0)
        return refused(strict, why, cap, "cpus", strerror(errno));
    if (hwloc_bitmap_isincluded(hwloc_topology_get_allowed_nodeset(topo), plan->nodeset))
        return MOE_OK; /* every node: nothing to restrict */
    if (!sup->membind || !sup->membind->set_thisthread_membind || !sup->membind->bind_membind)
        return refused(strict, why, cap, "memory", "this system does not support memory binding");
    if (hwloc_set_membind(topo, plan->nodeset, HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET) != 0)
        return refused(strict, why, cap, "memory", strerror(errno));
    *mem_bound = 1;
    return MOE_OK;
}

/* ---- the launcher's entry point ---- */

static char *report;     /* rank 0: world lines of LINE_LEN, from moe_bind_rank */
static int report_lines; /* how many */

#define MPI_TRY(call)                                                                              \
    do {                                                                                           \
        int mpi_rc_ = (call);                                                                      \
        if (mpi_rc_ != MPI_SUCCESS) {                                                              \
            char mpi_msg_[MPI_MAX_ERROR_STRING];                                                   \
            int mpi_len_ = 0;                                                                      \
            MPI_Error_string(mpi_rc_, mpi_msg_, &mpi_len_);                                        \
            moe_log_at(__FILE__, __LINE__, "%s: %s", #call, mpi_msg_);                             \
            st = MOE_ERR_COMM;                                                                     \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

/* Loads this machine's topology; with I/O objects (GPUs) when `io`. */
static moe_status load_topology(hwloc_topology_t *out, int io)
{
    hwloc_topology_t topo;
    *out = NULL;
    if (hwloc_topology_init(&topo) != 0)
        MOE_FAIL(MOE_ERR_NOMEM, "hwloc_topology_init: %s", strerror(errno));
    if (io && hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT) != 0) {
        hwloc_topology_destroy(topo);
        MOE_FAIL(MOE_ERR_INVALID, "hwloc_topology_set_io_types_filter: %s", strerror(errno));
    }
    if (hwloc_topology_load(topo) != 0) {
        int e = errno;
        hwloc_topology_destroy(topo);
        MOE_FAIL(MOE_ERR_INVALID, "hwloc_topology_load: cannot read this machine's topology: %s",
                 strerror(e));
    }
    *out = topo;
    return MOE_OK;
}

/* Appends to the string in buf (cap bytes), truncating. */
static void append(char *buf, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void append(char *buf, size_t cap, const char *fmt, ...)
{
    size_t len = strnlen(buf, cap);
    if (len + 1 >= cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + len, cap - len, fmt, ap);
    va_end(ap);
}

/* Decides and applies this rank's binding; writes its banner text (after the prefix). */
static moe_status bind_here(const moe_ranks *r, moe_bind_mode mode, const char *const *busids,
                            const char *mixed, char *text, size_t cap)
{
    moe_status st = MOE_OK;
    hwloc_topology_t topo = NULL;
    hwloc_bitmap_t current = NULL, nodes = NULL;
    moe_bind_plan plan = {0};
    char why[160] = "", desc[224];
    text[0] = '\0';
    MOE_CHECK(load_topology(&topo, busids != NULL));
    current = hwloc_bitmap_alloc();
    nodes = hwloc_bitmap_alloc();
    if (!current || !nodes) {
        st = MOE_ERR_NOMEM;
        moe_log_at(__FILE__, __LINE__, "cannot allocate two bitmaps");
        goto fail;
    }
    /* this process's binding; unknown (no support) reads as unbound */
    int known = hwloc_get_cpubind(topo, current, HWLOC_CPUBIND_PROCESS) == 0;
    if (moe_bind_launcher_bound(topo, known ? current : NULL, why, sizeof why)) {
        if ((!known && hwloc_bitmap_copy(current, hwloc_topology_get_allowed_cpuset(topo)) != 0) ||
            hwloc_cpuset_to_nodeset(topo, current, nodes) != 0) {
            st = MOE_ERR_NOMEM;
            moe_log_at(__FILE__, __LINE__, "cannot describe the launcher's binding");
            goto fail;
        }
        moe_bind_describe(topo, current, nodes, desc, sizeof desc);
        append(text, cap, "%s [kept the launcher's binding: %s]", desc, why);
        goto fail; /* cleanup only: st is MOE_OK */
    }
    MOE_CHECK_GOTO(st,
                   moe_bind_plan_compute(topo, mode, r->local_rank, r->local_size, busids, &plan));
    int mem_bound = 0;
    MOE_CHECK_GOTO(st,
                   moe_bind_apply(topo, &plan, mode != MOE_BIND_AUTO, &mem_bound, why, sizeof why));
    moe_bind_describe(topo, plan.cpuset, plan.nodeset, desc, sizeof desc);
    int cpus_refused = strncmp(why, "cpus", 4) == 0;
    append(text, cap, "%s", cpus_refused ? why : desc);
    if (busids)
        append(text, cap, ", GPU %s", busids[r->local_rank]);
    append(text, cap, " [%s%s]", moe_bind_mode_name(mode), mem_bound ? ", memory bound" : "");
    if (why[0] && !cpus_refused)
        append(text, cap, "; %s", why);
    if (plan.note[0] || mixed)
        append(text, cap, "; %s", plan.note[0] ? plan.note : mixed);
fail:
    moe_bind_plan_free(&plan);
    hwloc_bitmap_free(current);
    hwloc_bitmap_free(nodes);
    if (topo)
        hwloc_topology_destroy(topo);
    return st;
}

moe_status moe_bind_rank(const moe_ranks *r, const char *mode_text, const char *gpu_busid)
{
    moe_status st = MOE_OK;
    moe_bind_mode mode;
    MPI_Comm node = MPI_COMM_NULL;
    char *ids = NULL, *lines = NULL;
    const char **busids = NULL;
    char line[LINE_LEN], text[LINE_LEN - 64];
    MOE_CHECK(moe_bind_mode_parse(mode_text, &mode));
    if (gpu_busid && strlen(gpu_busid) >= BUSID_LEN)
        MOE_FAIL(MOE_ERR_INVALID, "GPU PCI bus id '%s' is too long", gpu_busid);

    const char *mixed = NULL;
    if (mode == MOE_BIND_NONE) {
        snprintf(text, sizeof text, "not bound [none]");
    } else {
        /* every rank of the node needs every bus id of the node */
        MPI_TRY(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, r->rank, MPI_INFO_NULL,
                                    &node));
        ids = calloc((size_t)r->local_size, BUSID_LEN);
        busids = calloc((size_t)r->local_size, sizeof *busids);
        if (!ids || !busids) {
            st = MOE_ERR_NOMEM;
            moe_log_at(__FILE__, __LINE__, "cannot allocate %d bus ids", r->local_size);
            goto fail;
        }
        char mine[BUSID_LEN] = "";
        if (gpu_busid)
            snprintf(mine, sizeof mine, "%s", gpu_busid);
        MPI_TRY(MPI_Allgather(mine, BUSID_LEN, MPI_CHAR, ids, BUSID_LEN, MPI_CHAR, node));
        int with_gpu = 0;
        for (int j = 0; j < r->local_size; j++) {
            busids[j] = ids + (size_t)j * BUSID_LEN;
            with_gpu += busids[j][0] != '\0';
        }
        if (with_gpu > 0 && with_gpu < r->local_size)
            mixed = "some ranks of this node have no GPU: placed as a CPU-only run";
        MOE_CHECK_GOTO(st, bind_here(r, mode, with_gpu == r->local_size ? busids : NULL, mixed,
                                     text, sizeof text));
    }
    line[0] = '\0';
    append(line, sizeof line, "%s:%d local %d/%d: %s", r->host, r->rank, r->local_rank,
           r->local_size, text);
    if (r->rank == 0) {
        lines = malloc((size_t)r->world * LINE_LEN);
        if (!lines) {
            st = MOE_ERR_NOMEM;
            moe_log_at(__FILE__, __LINE__, "cannot allocate %d banner lines", r->world);
            goto fail;
        }
    }
    MPI_TRY(MPI_Gather(line, LINE_LEN, MPI_CHAR, lines, LINE_LEN, MPI_CHAR, 0, MPI_COMM_WORLD));
    free(report);
    report = lines;
    report_lines = r->rank == 0 ? r->world : 0;
    lines = NULL;
fail:
    if (node != MPI_COMM_NULL)
        MPI_Comm_free(&node);
    free(ids);
    free(busids);
    free(lines);
    return st;
}

void moe_bind_print(FILE *out)
{
    if (!report)
        return;
    fprintf(out, "bind:\n");
    for (int i = 0; i < report_lines; i++)
        fprintf(out, "  %.*s\n", LINE_LEN, report + (size_t)i * LINE_LEN);
    free(report);
    report = NULL;
    report_lines = 0;
}
