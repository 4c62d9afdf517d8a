/* tests/unit/test_bind.c: the binding decision and its helpers (launcher/bind.h).
 *
 * Topologies: hwloc XML files of GPU servers under tests/data/topo/ (written by
 * make-topo.py there): a DGX-H100-like 2 sockets x 4 GPUs, a 2-socket server with 4 T4 all
 * on socket 0, an EPYC in NPS4 (4 NUMA nodes in one package, 2 GPUs each); and synthetic
 * topologies (hwloc_topology_set_synthetic) for CPU-only runs and for no NUMA information.
 * Every plan is checked for the rules: whole cores, no core shared between ranks (unless
 * the fallback says so), cores and memory in the GPU's NUMA node. Also: unknown and
 * malformed bus ids, the launcher-binding detection, describing, and applying a binding
 * on this machine. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launcher/bind.h"

#define TOPO_DIR MOE_SOURCE_DIR "/tests/data/topo/"
#define MAXR 32

/* ---- helpers ---- */

static hwloc_topology_t load_xml(const char *name)
{
    hwloc_topology_t t;
    char path[1024];
    snprintf(path, sizeof path, "%s%s", TOPO_DIR, name);
    assert_int_equal(hwloc_topology_init(&t), 0);
    if (hwloc_topology_set_xml(t, path) != 0)
        fail_msg("hwloc cannot read %s", path);
    assert_int_equal(hwloc_topology_set_io_types_filter(t, HWLOC_TYPE_FILTER_KEEP_ALL), 0);
    if (hwloc_topology_load(t) != 0)
        fail_msg("hwloc cannot load %s", path);
    return t;
}

static hwloc_topology_t load_synthetic(const char *desc)
{
    hwloc_topology_t t;
    assert_int_equal(hwloc_topology_init(&t), 0);
    if (hwloc_topology_set_synthetic(t, desc) != 0)
        fail_msg("hwloc rejects the synthetic topology '%s'", desc);
    assert_int_equal(hwloc_topology_load(t), 0);
    return t;
}

/* Computes the plans of all k local ranks; each must succeed. */
static void plan_all(hwloc_topology_t t, moe_bind_mode mode, int k, const char *const *busids,
                     moe_bind_plan *plans)
{
    for (int j = 0; j < k; j++) {
        moe_status st = moe_bind_plan_compute(t, mode, j, k, busids, &plans[j]);
        if (st != MOE_OK)
            fail_msg("plan of local rank %d of %d: status %d", j, k, (int)st);
        assert_non_null(plans[j].cpuset);
        assert_non_null(plans[j].nodeset);
        assert_false(hwloc_bitmap_iszero(plans[j].cpuset));
    }
}

static void free_all(moe_bind_plan *plans, int k)
{
    for (int j = 0; j < k; j++)
        moe_bind_plan_free(&plans[j]);
}

static void expect_list(hwloc_const_bitmap_t set, const char *want, const char *what, int j)
{
    char got[512];
    hwloc_bitmap_list_snprintf(got, sizeof got, set);
    if (strcmp(got, want) != 0)
        fail_msg("local rank %d: %s %s, want %s", j, what, got, want);
}

/* Cores whose PUs are all in set; fails if set holds part of a core. */
static int whole_cores(hwloc_topology_t t, hwloc_const_cpuset_t set, int j)
{
    int n = 0;
    hwloc_obj_t c = NULL;
    while ((c = hwloc_get_next_obj_by_type(t, HWLOC_OBJ_CORE, c)) != NULL) {
        if (!hwloc_bitmap_intersects(c->cpuset, set))
            continue;
        if (!hwloc_bitmap_isincluded(c->cpuset, set))
            fail_msg("local rank %d holds part of core L#%u", j, c->logical_index);
        n++;
    }
    return n;
}

/* No PU in two plans. */
static void expect_disjoint(const moe_bind_plan *plans, int k)
{
    for (int a = 0; a < k; a++)
        for (int b = a + 1; b < k; b++)
            if (hwloc_bitmap_intersects(plans[a].cpuset, plans[b].cpuset))
                fail_msg("local ranks %d and %d share cores", a, b);
}

static hwloc_obj_t gpu_locality(hwloc_topology_t t, const char *busid)
{
    unsigned d, b, v, f;
    assert_int_equal(sscanf(busid, "%x:%x:%x.%x", &d, &b, &v, &f), 4);
    hwloc_obj_t dev = hwloc_get_pcidev_by_busid(t, d, b, v, f);
    if (!dev)
        fail_msg("the fixture has no PCI device %s", busid);
    return hwloc_get_non_io_ancestor_obj(t, dev);
}

/* The GPU rule: cores in the GPU's locality, memory on its NUMA node(s), whole cores. */
static void expect_gpu_local(hwloc_topology_t t, const moe_bind_plan *plans, int k,
                             const char *const *busids, int want_cores)
{
    for (int j = 0; j < k; j++) {
        hwloc_obj_t anc = gpu_locality(t, busids[j]);
        assert_int_equal(plans[j].apply, 1);
        assert_int_equal(plans[j].gpu_local, 1);
        assert_int_equal(plans[j].shared, 0);
        if (!hwloc_bitmap_isincluded(plans[j].cpuset, anc->cpuset))
            fail_msg("local rank %d: cores outside its GPU's NUMA node", j);
        if (!hwloc_bitmap_isequal(plans[j].nodeset, anc->nodeset))
            fail_msg("local rank %d: memory not on its GPU's NUMA node", j);
        int n = whole_cores(t, plans[j].cpuset, j);
        if (n != want_cores || plans[j].n_cores != want_cores)
            fail_msg("local rank %d: %d cores (plan says %d), want %d", j, n, plans[j].n_cores,
                     want_cores);
    }
    expect_disjoint(plans, k);
}

static const char *const dgx_gpus[8] = {"0000:1b:00.0", "0000:43:00.0", "0000:52:00.0",
                                        "0000:61:00.0", "0000:9d:00.0", "0000:c3:00.0",
                                        "0000:d1:00.0", "0000:df:00.0"};

static int count_gpus(hwloc_topology_t t)
{
    int n = 0;
    hwloc_obj_t o = NULL;
    while ((o = hwloc_get_next_pcidev(t, o)) != NULL)
        n += o->attr->pcidev.class_id == 0x0302 || o->attr->pcidev.class_id == 0x0300;
    return n;
}

/* ---- the fixtures load as the servers they describe ---- */

static void test_fixtures_load(void **state)
{
    (void)state;
    struct {
        const char *file;
        int packages, numa, cores, pus, gpus;
    } want[] = {{"dgx-h100-2s8g.xml", 2, 2, 112, 224, 8},
                {"vm-2s-nested.xml", 2, 2, 16, 16, 2},
                {"t4x4-2s.xml", 2, 2, 24, 48, 4},
                {"epyc-nps4-8g.xml", 1, 4, 64, 128, 8}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        hwloc_topology_t t = load_xml(want[i].file);
        assert_int_equal(hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PACKAGE), want[i].packages);
        assert_int_equal(hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE), want[i].numa);
        assert_int_equal(hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE), want[i].cores);
        assert_int_equal(hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PU), want[i].pus);
        if (count_gpus(t) != want[i].gpus)
            fail_msg("%s: %d GPUs, want %d", want[i].file, count_gpus(t), want[i].gpus);
        hwloc_topology_destroy(t);
    }
}

/* ---- (a) 2 sockets x 4 GPUs ---- */

static void test_dgx_8_ranks(void **state)
{
    (void)state;
    hwloc_topology_t t = load_xml("dgx-h100-2s8g.xml");
    moe_bind_plan p[8];
    plan_all(t, MOE_BIND_AUTO, 8, dgx_gpus, p);
    expect_gpu_local(t, p, 8, dgx_gpus, 14); /* 56 cores per socket / 4 GPUs */
    expect_list(p[0].cpuset, "0-13,112-125", "cpus", 0);
    expect_list(p[3].cpuset, "42-55,154-167", "cpus", 3);
    expect_list(p[4].cpuset, "56-69,168-181", "cpus", 4);
    expect_list(p[4].nodeset, "1", "numa", 4);
    char line[256];
    moe_bind_describe(t, p[0].cpuset, p[0].nodeset, line, sizeof line);
    assert_string_equal(line, "cpus 0-13,112-125 (14 cores), numa 0");
    free_all(p, 8);
    hwloc_topology_destroy(t);
}

/* Local ranks need not follow the GPUs' order; nvidia-smi's spelling works too. */
static void test_dgx_shuffled_and_spelling(void **state)
{
    (void)state;
    hwloc_topology_t t = load_xml("dgx-h100-2s8g.xml");
    const char *const ids[8] = {"00000000:DF:00.0", "1b:00.0",      "0000:c3:00.0", "0000:43:00.0",
                                "0000:d1:00.0",     "0000:52:00.0", "0000:9d:00.0", "0000:61:00.0"};
    moe_bind_plan p[8];
    plan_all(t, MOE_BIND_AUTO, 8, ids, p);
    expect_gpu_local(t, p, 8,
                     (const char *const[]){"0000:df:00.0", "0000:1b:00.0", "0000:c3:00.0",
                                           "0000:43:00.0", "0000:d1:00.0", "0000:52:00.0",
                                           "0000:9d:00.0", "0000:61:00.0"},
                     14);
    /* socket 1 holds local ranks 0, 2, 4, 6: they split it in local-rank order */
    expect_list(p[0].cpuset, "56-69,168-181", "cpus", 0);
    expect_list(p[6].cpuset, "98-111,210-223", "cpus", 6);
    free_all(p, 8);
    hwloc_topology_destroy(t);
}

/* Two ranks per GPU (16 on 8 GPUs): 7 cores each; core mode: one core each; numa mode:
 * the whole socket, shared on purpose. */
static void test_dgx_modes(void **state)
{
    (void)state;
    hwloc_topology_t t = load_xml("dgx-h100-2s8g.xml");
    const char *ids[16];
    for (int j = 0; j < 16; j++)
        ids[j] = dgx_gpus[j / 2];
    moe_bind_plan p[16];
    plan_all(t, MOE_BIND_AUTO, 16, ids, p);
    expect_gpu_local(t, p, 16, ids, 7);
    free_all(p, 16);

    plan_all(t, MOE_BIND_CORE, 8, dgx_gpus, p);
    expect_gpu_local(t, p, 8, dgx_gpus, 1);
    expect_list(p[1].cpuset, "14,126", "cpus", 1); /* the first core of rank 1's block */
    free_all(p, 8);

    plan_all(t, MOE_BIND_NUMA, 8, dgx_gpus, p);
    for (int j = 0; j < 8; j++) {
        expect_list(p[j].cpuset, j < 4 ? "0-55,112-167" : "56-111,168-223", "cpus", j);
        expect_list(p[j].nodeset, j < 4 ? "0" : "1", "numa", j);
        assert_int_equal(p[j].n_cores, 56);
    }
    free_all(p, 8);

    plan_all(t, MOE_BIND_NONE, 2, dgx_gpus, p);
    for (int j = 0; j < 2; j++) {
        assert_int_equal(p[j].apply, 0);
        expect_list(p[j].cpuset, "0-223", "cpus", j);
    }
    free_all(p, 2);
    hwloc_topology_destroy(t);
}

/* ---- (b) 4 x T4, all on socket 0 of 2 ---- */

static void test_t4_one_socket(void **state)
{
    (void)state;
    hwloc_topology_t t = load_xml("t4x4-2s.xml");
    const char *const ids[4] = {"0000:18:00.0", "0000:19:00.0", "0000:5e:00.0", "0000:5f:00.0"};
    moe_bind_plan p[4];
    plan_all(t, MOE_BIND_AUTO, 4, ids, p);
    expect_gpu_local(t, p, 4, ids, 3); /* 12 cores of socket 0 / 4 ranks */
    for (int j = 0; j < 4; j++)
        expect_list(p[j].nodeset, "0", "numa", j);
    expect_list(p[0].cpuset, "0-2,24-26", "cpus", 0);
    expect_list(p[3].cpuset, "9-11,33-35", "cpus", 3);
    free_all(p, 4);
    /* 5 ranks on 4 GPUs' 12 cores is not possible here; 8 ranks (2 per T4): 12 / 8 */
    const char *ids8[8];
    for (int j = 0; j < 8; j++)
        ids8[j] = ids[j / 2];
    moe_bind_plan q[8];
    plan_all(t, MOE_BIND_AUTO, 8, ids8, q);
    expect_disjoint(q, 8);
    for (int j = 0; j < 8; j++) { /* 12 = 2 + 2 + 2 + 2 + 1 + 1 + 1 + 1 */
        int n = whole_cores(t, q[j].cpuset, j);
        if (n != (j < 4 ? 2 : 1))
            fail_msg("local rank %d: %d cores, want %d", j, n, j < 4 ? 2 : 1);
        expect_list(q[j].nodeset, "0", "numa", j);
    }
    free_all(q, 8);
    hwloc_topology_destroy(t);
}

/* NPS4: the nearest NUMA node is one of four in the package. */
static void test_epyc_nps4(void **state)
{
    (void)state;
    hwloc_topology_t t = load_xml("epyc-nps4-8g.xml");
    const char *const ids[8] = {"0000:01:00.0", "0000:21:00.0", "0000:41:00.0", "0000:61:00.0",
                                "0000:81:00.0", "0000:a1:00.0", "0000:c1:00.0", "0000:e1:00.0"};
    moe_bind_plan p[8];
    plan_all(t, MOE_BIND_AUTO, 8, ids, p);
    expect_gpu_local(t, p, 8, ids, 8);
    for (int j = 0; j < 8; j++) {
        char want[16];
        snprintf(want, sizeof want, "%d", j / 2);
        expect_list(p[j].nodeset, want, "numa", j);
    }
    expect_list(p[5].cpuset, "40-47,104-111", "cpus", 5);
    free_all(p, 8);
    hwloc_topology_destroy(t);
}

/* Nested domains: a GPU without locality (the whole machine) and one on socket 1. The
 * smaller domain is served first; the other takes what is left, so no core is shared. */
static void test_nested_domains(void **state)
{
    (void)state;
    hwloc_topology_t t = load_xml("vm-2s-nested.xml");
    const char *const root = "0000:00:04.0", *const sock1 = "0000:81:00.0";
    struct {
        int k;
        const char *ids[3];
        const char *cpus[3], *nodes[3];
    } cases[] = {{2, {root, sock1}, {"0-7", "8-15"}, {"0", "1"}},
                 {3, {root, sock1, sock1}, {"0-7", "8-11", "12-15"}, {"0", "1", "1"}},
                 {3, {sock1, root, root}, {"8-15", "0-3", "4-7"}, {"1", "0", "0"}}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        moe_bind_plan p[3];
        plan_all(t, MOE_BIND_AUTO, cases[c].k, cases[c].ids, p);
        expect_disjoint(p, cases[c].k);
        for (int j = 0; j < cases[c].k; j++) {
            expect_list(p[j].cpuset, cases[c].cpus[j], "cpus", j);
            expect_list(p[j].nodeset, cases[c].nodes[j], "numa", j);
            assert_int_equal(p[j].gpu_local, 1);
        }
        free_all(p, cases[c].k);
    }
    moe_bind_plan p[2];
    plan_all(t, MOE_BIND_NUMA, 2, (const char *const[]){root, sock1}, p);
    expect_list(p[0].cpuset, "0-15", "cpus", 0);
    expect_list(p[1].cpuset, "8-15", "cpus", 1);
    free_all(p, 2);
    hwloc_topology_destroy(t);
}

/* ---- (c) CPU-only runs on synthetic topologies ---- */

static void test_cpu_only_spread(void **state)
{
    (void)state;
    hwloc_topology_t t = load_synthetic("pack:2 numa:1 core:8 pu:2");
    struct {
        int k;
        const char *cpus[4];
        const char *nodes[4];
    } cases[] = {
        {1, {"0-31"}, {"0-1"}},
        {2, {"0-15", "16-31"}, {"0", "1"}},
        {3, {"0-7", "8-15", "16-31"}, {"0", "0", "1"}},
        {4, {"0-7", "8-15", "16-23", "24-31"}, {"0", "0", "1", "1"}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        moe_bind_plan p[4];
        int k = cases[c].k;
        plan_all(t, MOE_BIND_AUTO, k, NULL, p);
        expect_disjoint(p, k);
        for (int j = 0; j < k; j++) {
            expect_list(p[j].cpuset, cases[c].cpus[j], "cpus", j);
            expect_list(p[j].nodeset, cases[c].nodes[j], "numa", j);
            assert_int_equal(p[j].gpu_local, 0);
            assert_int_equal(p[j].shared, 0);
            whole_cores(t, p[j].cpuset, j);
        }
        free_all(p, k);
    }
    /* 16 ranks: one core each, eight per node */
    moe_bind_plan q[16];
    plan_all(t, MOE_BIND_AUTO, 16, NULL, q);
    expect_disjoint(q, 16);
    for (int j = 0; j < 16; j++) {
        assert_int_equal(whole_cores(t, q[j].cpuset, j), 1);
        expect_list(q[j].nodeset, j < 8 ? "0" : "1", "numa", j);
    }
    free_all(q, 16);
    hwloc_topology_destroy(t);

    /* fewer ranks than nodes: each rank takes whole nodes */
    t = load_synthetic("pack:4 numa:1 core:4 pu:1");
    moe_bind_plan r[2];
    plan_all(t, MOE_BIND_AUTO, 2, NULL, r);
    expect_list(r[0].cpuset, "0-7", "cpus", 0);
    expect_list(r[0].nodeset, "0-1", "numa", 0);
    expect_list(r[1].nodeset, "2-3", "numa", 1);
    free_all(r, 2);
    hwloc_topology_destroy(t);
}

/* ---- (d) no NUMA information, and more ranks than cores ---- */

static void test_no_numa_and_oversubscribed(void **state)
{
    (void)state;
    hwloc_topology_t t = load_synthetic("pack:1 core:3 pu:2");
    assert_int_equal(hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE), 1); /* hwloc's stand-in */
    moe_bind_plan p[8];
    /* 2 ranks on 3 cores: the first rank one core larger */
    plan_all(t, MOE_BIND_AUTO, 2, NULL, p);
    expect_list(p[0].cpuset, "0-3", "cpus", 0);
    expect_list(p[1].cpuset, "4-5", "cpus", 1);
    free_all(p, 2);
    /* 5 ranks on 3 cores: every rank shares all three, and says so */
    plan_all(t, MOE_BIND_AUTO, 5, NULL, p);
    for (int j = 0; j < 5; j++) {
        expect_list(p[j].cpuset, "0-5", "cpus", j);
        assert_int_equal(p[j].shared, 1);
        if (!strstr(p[j].note, "shared: 5 ranks on 3 cores"))
            fail_msg("local rank %d: note '%s'", j, p[j].note);
    }
    free_all(p, 5);
    /* core mode: one core each, round robin */
    plan_all(t, MOE_BIND_CORE, 5, NULL, p);
    const char *want[5] = {"0-1", "2-3", "4-5", "0-1", "2-3"};
    for (int j = 0; j < 5; j++) {
        expect_list(p[j].cpuset, want[j], "cpus", j);
        assert_int_equal(p[j].shared, 1);
    }
    free_all(p, 5);
    hwloc_topology_destroy(t);

    /* a topology without Core objects: PUs stand for cores */
    t = load_synthetic("pu:4");
    plan_all(t, MOE_BIND_AUTO, 2, NULL, p);
    expect_list(p[0].cpuset, "0-1", "cpus", 0);
    expect_list(p[1].cpuset, "2-3", "cpus", 1);
    free_all(p, 2);
    hwloc_topology_destroy(t);

    /* GPUs sharing a node with more ranks than its cores (4 T4 ranks x 4 on 12 cores) */
    t = load_xml("t4x4-2s.xml");
    const char *ids[16];
    const char *const t4[4] = {"0000:18:00.0", "0000:19:00.0", "0000:5e:00.0", "0000:5f:00.0"};
    for (int j = 0; j < 16; j++)
        ids[j] = t4[j % 4];
    moe_bind_plan q[16];
    plan_all(t, MOE_BIND_AUTO, 16, ids, q);
    for (int j = 0; j < 16; j++) {
        expect_list(q[j].cpuset, "0-11,24-35", "cpus", j);
        expect_list(q[j].nodeset, "0", "numa", j);
        assert_int_equal(q[j].shared, 1);
    }
    free_all(q, 16);
    hwloc_topology_destroy(t);
}

/* ---- (e) bus ids: unknown -> CPU-only placement with a note; malformed -> error ---- */

static void test_busid_not_found(void **state)
{
    (void)state;
    hwloc_topology_t t = load_xml("dgx-h100-2s8g.xml");
    /* both GPUs on socket 0 would put both ranks there; one unknown id: CPU-only spread */
    const char *const ids[2] = {"0000:1b:00.0", "0000:ee:00.0"};
    moe_bind_plan p[2];
    plan_all(t, MOE_BIND_AUTO, 2, ids, p);
    for (int j = 0; j < 2; j++) {
        assert_int_equal(p[j].gpu_local, 0);
        if (!strstr(p[j].note, "GPU 0000:ee:00.0 of local rank 1 is not in the topology"))
            fail_msg("local rank %d: note '%s'", j, p[j].note);
    }
    expect_list(p[0].nodeset, "0", "numa", 0);
    expect_list(p[1].nodeset, "1", "numa", 1);
    expect_disjoint(p, 2);
    free_all(p, 2);
    hwloc_topology_destroy(t);

    /* a topology without PCI information (synthetic): the same fallback */
    t = load_synthetic("pack:2 numa:1 core:2 pu:1");
    const char *const one[1] = {"0000:1b:00.0"};
    plan_all(t, MOE_BIND_AUTO, 1, one, p);
    assert_int_equal(p[0].gpu_local, 0);
    assert_non_null(strstr(p[0].note, "not in the topology"));
    free_all(p, 1);
    hwloc_topology_destroy(t);
}

static void test_busid_malformed(void **state)
{
    (void)state;
    hwloc_topology_t t = load_xml("t4x4-2s.xml");
    const char *bad[] = {"",        "zz:00.0", "0000:18:00",        "18:00.0x", "0000:018:00.0",
                         "18:20.0", "18:00.8", "0000:0000:18:00.0", "gpu0"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *ids[2] = {"0000:18:00.0", bad[i]};
        moe_bind_plan p;
        moe_status st = moe_bind_plan_compute(t, MOE_BIND_AUTO, 0, 2, ids, &p);
        if (st != MOE_ERR_INVALID)
            fail_msg("bus id '%s' accepted (status %d)", bad[i], (int)st);
        assert_null(p.cpuset);
        moe_bind_plan_free(&p);
    }
    /* bad arguments */
    moe_bind_plan p;
    assert_int_equal(moe_bind_plan_compute(t, MOE_BIND_AUTO, 2, 2, NULL, &p), MOE_ERR_INVALID);
    assert_int_equal(moe_bind_plan_compute(t, MOE_BIND_AUTO, 0, 0, NULL, &p), MOE_ERR_INVALID);
    assert_int_equal(moe_bind_plan_compute(NULL, MOE_BIND_AUTO, 0, 1, NULL, &p), MOE_ERR_INVALID);
    hwloc_topology_destroy(t);
}

/* ---- modes, the launcher's binding, applying ---- */

static void test_mode_parse(void **state)
{
    (void)state;
    const char *names[] = {"auto", "numa", "core", "none"};
    for (int i = 0; i < 4; i++) {
        moe_bind_mode m = MOE_BIND_NONE;
        assert_int_equal(moe_bind_mode_parse(names[i], &m), MOE_OK);
        assert_int_equal((int)m, i);
        assert_string_equal(moe_bind_mode_name(m), names[i]);
    }
    moe_bind_mode m;
    assert_int_equal(moe_bind_mode_parse("socket", &m), MOE_ERR_INVALID);
    assert_int_equal(moe_bind_mode_parse(NULL, &m), MOE_ERR_INVALID);
}

static void clear_launcher_env(void)
{
    unsetenv("OMPI_MCA_orte_bound_at_launch");
    unsetenv("OMPI_MCA_hwloc_base_binding_policy");
    unsetenv("SLURM_CPU_BIND_TYPE");
}

static void test_launcher_bound(void **state)
{
    (void)state;
    clear_launcher_env();
    hwloc_topology_t t = load_xml("t4x4-2s.xml");
    hwloc_bitmap_t cur = hwloc_bitmap_dup(hwloc_topology_get_allowed_cpuset(t));
    char why[160] = "";
    assert_int_equal(moe_bind_launcher_bound(t, cur, why, sizeof why), 0);
    hwloc_bitmap_only(cur, 5); /* mpirun --bind-to core, taskset -c 5 */
    assert_int_equal(moe_bind_launcher_bound(t, cur, why, sizeof why), 1);
    assert_string_equal(why, "started bound to cpus 5");
    hwloc_bitmap_copy(cur, hwloc_topology_get_allowed_cpuset(t));
    struct {
        const char *var, *value;
        int bound;
    } env[] = {{"OMPI_MCA_orte_bound_at_launch", "1", 1},
               {"OMPI_MCA_orte_bound_at_launch", "0", 0},
               {"OMPI_MCA_hwloc_base_binding_policy", "none", 0},
               {"OMPI_MCA_hwloc_base_binding_policy", "package", 1},
               {"SLURM_CPU_BIND_TYPE", "none", 0},
               {"SLURM_CPU_BIND_TYPE", "mask_cpu:", 1},
               {"SLURM_CPU_BIND_TYPE", "", 0}};
    for (size_t i = 0; i < sizeof env / sizeof env[0]; i++) {
        clear_launcher_env();
        setenv(env[i].var, env[i].value, 1);
        why[0] = '\0';
        int got = moe_bind_launcher_bound(t, cur, why, sizeof why);
        if (got != env[i].bound)
            fail_msg("%s=%s: bound %d, want %d", env[i].var, env[i].value, got, env[i].bound);
        if (got && !strstr(why, env[i].var))
            fail_msg("%s=%s: reason '%s'", env[i].var, env[i].value, why);
    }
    clear_launcher_env();
    hwloc_bitmap_free(cur);
    hwloc_topology_destroy(t);
}

/* Binds this test process to one core of this machine, checks, and restores. */
static void test_apply_here(void **state)
{
    (void)state;
    hwloc_topology_t t;
    assert_int_equal(hwloc_topology_init(&t), 0);
    assert_int_equal(hwloc_topology_load(t), 0);
    hwloc_bitmap_t before = hwloc_bitmap_alloc(), after = hwloc_bitmap_alloc();
    assert_int_equal(hwloc_get_cpubind(t, before, HWLOC_CPUBIND_PROCESS), 0);
    int cores = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE);
    if (cores < 2 || !hwloc_bitmap_isequal(before, hwloc_topology_get_allowed_cpuset(t))) {
        hwloc_bitmap_free(before);
        hwloc_bitmap_free(after);
        hwloc_topology_destroy(t);
        skip(); /* one core, or already bound by whoever started the test */
    }
    moe_bind_plan p;
    assert_int_equal(moe_bind_plan_compute(t, MOE_BIND_CORE, 1, 2, NULL, &p), MOE_OK);
    int mem = -1;
    char why[160];
    assert_int_equal(moe_bind_apply(t, &p, 0, &mem, why, sizeof why), MOE_OK);
    if (why[0] && strncmp(why, "cpus", 4) == 0) /* refused here (a container): reported */
        print_message("binding refused on this machine: %s\n", why);
    else {
        assert_int_equal(hwloc_get_cpubind(t, after, HWLOC_CPUBIND_PROCESS), 0);
        assert_true(hwloc_bitmap_isequal(after, p.cpuset));
    }
    moe_bind_plan_free(&p);
    assert_int_equal(hwloc_set_cpubind(t, before, HWLOC_CPUBIND_PROCESS), 0);
    /* none never binds */
    assert_int_equal(moe_bind_plan_compute(t, MOE_BIND_NONE, 0, 2, NULL, &p), MOE_OK);
    assert_int_equal(moe_bind_apply(t, &p, 1, &mem, why, sizeof why), MOE_OK);
    assert_int_equal(mem, 0);
    moe_bind_plan_free(&p);
    moe_bind_plan_free(&p); /* freeing twice is safe */
    hwloc_bitmap_free(before);
    hwloc_bitmap_free(after);
    hwloc_topology_destroy(t);
}

/* A topology that is not this system (XML) reports no binding support: auto reports it
 * and goes on; numa and core (strict) make it an error. */
static void test_apply_refused(void **state)
{
    (void)state;
    hwloc_topology_t t = load_xml("dgx-h100-2s8g.xml");
    moe_bind_plan p;
    assert_int_equal(moe_bind_plan_compute(t, MOE_BIND_AUTO, 5, 8, dgx_gpus, &p), MOE_OK);
    int mem = -1;
    char why[160];
    assert_int_equal(moe_bind_apply(t, &p, 0, &mem, why, sizeof why), MOE_OK);
    assert_string_equal(why, "cpus not bound: this system does not support CPU binding");
    assert_int_equal(mem, 0);
    assert_int_equal(moe_bind_apply(t, &p, 1, &mem, why, sizeof why), MOE_ERR_INVALID);
    moe_bind_plan_free(&p);
    hwloc_topology_destroy(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixtures_load),
        cmocka_unit_test(test_dgx_8_ranks),
        cmocka_unit_test(test_dgx_shuffled_and_spelling),
        cmocka_unit_test(test_dgx_modes),
        cmocka_unit_test(test_t4_one_socket),
        cmocka_unit_test(test_epyc_nps4),
        cmocka_unit_test(test_nested_domains),
        cmocka_unit_test(test_cpu_only_spread),
        cmocka_unit_test(test_no_numa_and_oversubscribed),
        cmocka_unit_test(test_busid_not_found),
        cmocka_unit_test(test_busid_malformed),
        cmocka_unit_test(test_mode_parse),
        cmocka_unit_test(test_launcher_bound),
        cmocka_unit_test(test_apply_here),
        cmocka_unit_test(test_apply_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
