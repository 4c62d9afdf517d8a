/* launcher/bench.c: `moe-dist bench CONFIG` (launcher/bench.h, docs/bench.md).
 *
 * Three runs of the same training loop: `warmup` steps (first-use costs: plan caches,
 * scratch), [train] steps timed as a whole with one backend sync at the end (the step
 * time and tokens/s), then `phase_steps` with m->timing on (every phase boundary waits
 * for the backend, so the phases add up; they cost the host/device overlap, which is why
 * the step time comes from the untimed run). */
#include "launcher/bench.h"

#include <math.h>
#include <string.h>

#include "comm/comm.h"
#include "kernels/backend.h"
#include "util/clock.h"

double moe_bench_flops_per_token(const moe_config *cfg)
{
    const double D = cfg->d_model, T = cfg->seq_len, L = cfg->n_layers;
    const double Ld = cfg->dense_layers, Lm = L - Ld;
    const double F = cfg->expert_hidden, Fs = (double)cfg->shared_experts * F;
    double params = L * 4 * D * D;                              /* q, k, v, o */
    params += Ld * 3 * D * cfg->dense_hidden;                   /* dense SwiGLU */
    params += Lm * (D * cfg->experts + cfg->top_k * 3 * D * F); /* router, K experts */
    params += Lm * 3 * D * Fs;                                  /* shared experts */
    params += (double)cfg->vocab_size * D;                      /* LM head */
    return 3.0 * (2.0 * params + L * 2.0 * T * D);
}

/* A finished step's result (r->ready) into *last, its communication times added to comm
 * (may be NULL; 6 values as moe_step_result) and its expert rows to rows (may be NULL). */
static void take(const moe_step_result *r, moe_step_result *last, double *comm, double *rows)
{
    if (!r->ready)
        return;
    *last = *r;
    if (comm) {
        comm[0] += r->exchange_s;
        comm[1] += r->exchange_exposed_s;
        comm[2] += r->reduction_s;
        comm[3] += r->reduction_exposed_s;
        comm[4] += r->counts_s;
        comm[5] += r->counts_exposed_s;
    }
    if (rows)
        *rows += (double)r->expert_rows;
}

/* n steps, then the update that may still run beside nothing (moe_trainer_settle); the
 * last step's result into *last, and the steps' comm and rows as take */
static moe_status steps(moe_trainer *tr, int n, moe_step_result *last, double *comm, double *rows)
{
    moe_step_result r;
    for (int i = 0; i < n; i++) {
        MOE_CHECK(moe_trainer_accumulate(tr, &r));
        MOE_CHECK(moe_trainer_apply(tr, &r));
        take(&r, last, comm, rows);
    }
    MOE_CHECK(moe_trainer_settle(tr, &r));
    take(&r, last, comm, rows);
    return tr->model->be->sync();
}

static void print_report(const moe_trainer *tr, double step_s, double host_wait, const double *ph,
                         const double *comm, const double *spread, const moe_comm_site *sites,
                         int n_sites, double rate, double mem_max, long allocs,
                         const moe_step_result *last, int warmup, int phase_steps, FILE *out);
static void print_sites(const moe_comm_site *sites, int n, FILE *out);

/* Per step, and per place the largest over the ranks (the places come in the same order
 * on every rank; where their number differs, each rank keeps its own). */
static moe_status sites_slowest(moe_trainer *tr, moe_comm_site *sites, int *n_sites, int steps)
{
    double v[2 * MOE_COMM_SITES], nn[2] = {*n_sites, -*n_sites};
    if (tr->comm)
        MOE_CHECK(moe_comm_max_doubles(tr->comm, MOE_GROUP_WORLD, nn, 2));
    const int same = tr->comm && nn[0] == -nn[1];
    for (int i = 0; i < *n_sites; i++) {
        v[2 * i] = sites[i].total_s / steps;
        v[2 * i + 1] = sites[i].exposed_s / steps;
    }
    if (same && *n_sites > 0)
        MOE_CHECK(moe_comm_max_doubles(tr->comm, MOE_GROUP_WORLD, v, 2 * *n_sites));
    for (int i = 0; i < *n_sites; i++) {
        sites[i].total_s = v[2 * i];
        sites[i].exposed_s = v[2 * i + 1];
        sites[i].count /= steps;
    }
    return MOE_OK;
}

moe_status moe_bench_run(moe_trainer *tr, int warmup, int phase_steps, int profile_steps, FILE *out)
{
    moe_model *m = tr->model;
    const moe_config *cfg = &tr->cfg;
    moe_step_result r;
    memset(&r, 0, sizeof r);
    double sync = 0; /* a maximum over the world: every rank leaves it together */
    MOE_CHECK(steps(tr, warmup, &r, NULL, NULL));
    /* placement = auto: one re-plan from the warm-up's routing, so the timed steps run
     * with the experts grouped and the ranks' loads balanced */
    if (tr->routing && strcmp(cfg->placement, "auto") == 0 && m->ep > 1)
        MOE_CHECK(moe_trainer_replan(tr, out)); /* rank 0 prints */
    if (tr->comm)
        MOE_CHECK(moe_comm_max_doubles(tr->comm, MOE_GROUP_WORLD, &sync, 1));
    moe_comm_take_sites(tr->comm, NULL, 0); /* from the timed steps on */
    const long allocs0 = m->be->allocations();
    m->host_wait_s = 0;
    const double t0 = moe_clock_seconds();
    double comm[6] = {0}, rows = 0;
    MOE_CHECK(steps(tr, cfg->steps, &r, comm, &rows));
    if (tr->comm)
        MOE_CHECK(moe_comm_max_doubles(tr->comm, MOE_GROUP_WORLD, &sync, 1));
    const double step_s = (moe_clock_seconds() - t0) / cfg->steps;
    const double host_wait = m->host_wait_s / cfg->steps;
    moe_comm_site sites[MOE_COMM_SITES];
    int n_sites = moe_comm_take_sites(tr->comm, sites, MOE_COMM_SITES);
    MOE_CHECK(sites_slowest(tr, sites, &n_sites, cfg->steps));
    const long allocs = m->be->allocations() - allocs0; /* in the timed steps */

    memset(m->phase_s, 0, sizeof m->phase_s);
    m->timing = 1;
    MOE_CHECK(steps(tr, phase_steps, &r, NULL, NULL));
    m->timing = 0;
    double ph[MOE_PHASES];
    for (int p = 0; p < MOE_PHASES; p++)
        ph[p] = m->phase_s[p] / phase_steps;
    if (tr->comm) /* the slowest rank's phases */
        MOE_CHECK(moe_comm_max_doubles(tr->comm, MOE_GROUP_WORLD, ph, MOE_PHASES));

    const double rate = m->be->gemm_rate(m->be->on_device ? 8192 : 512);
    MOE_CHECK(m->be->sync());
    const double mem = (double)m->be->mem_in_use();
    double mem_max = mem;
    if (tr->comm)
        MOE_CHECK(moe_comm_max_doubles(tr->comm, MOE_GROUP_WORLD, &mem_max, 1));
    for (int i = 0; i < 6; i++)
        comm[i] /= cfg->steps;
    /* the spread over ranks of the expert rows computed and of the exposed exchange:
     * min, max (as max of the negated) and sum; a rank with more rows keeps the others
     * waiting in the exchanges */
    const double rows_step = rows / cfg->steps;
    double spread[6] = {-rows_step, rows_step, -comm[1], comm[1], rows_step, comm[1]};
    if (tr->comm) {
        MOE_CHECK(moe_comm_max_doubles(tr->comm, MOE_GROUP_WORLD, spread, 4));
        MOE_CHECK(moe_comm_sum_doubles(tr->comm, MOE_GROUP_WORLD, spread + 4, 2));
    }
    if (tr->comm) /* the slowest rank's */
        MOE_CHECK(moe_comm_max_doubles(tr->comm, MOE_GROUP_WORLD, comm, 6));
    if (tr->rank == 0)
        print_report(tr, step_s, host_wait, ph, comm, spread, sites, n_sites, rate, mem_max, allocs,
                     &r, warmup, phase_steps, out);
    /* more steps with every kernel timed; rank 0 prints the table */
    if (m->be->profile && profile_steps > 0) {
        m->be->profile(1, NULL);
        MOE_CHECK(steps(tr, profile_steps, &r, NULL, NULL));
        if (tr->rank == 0)
            fprintf(out, "kernels of %d more steps (each piece of stream work between events):\n",
                    profile_steps);
        m->be->profile(0, tr->rank == 0 ? out : NULL);
    }
    return MOE_OK;
}

static void print_report(const moe_trainer *tr, double step_s, double host_wait, const double *ph,
                         const double *comm, const double *spread, const moe_comm_site *sites,
                         int n_sites, double rate, double mem_max, long allocs,
                         const moe_step_result *last, int warmup, int phase_steps, FILE *out)
{
    const moe_model *m = tr->model;
    const moe_config *cfg = &tr->cfg;
    const moe_step_result r = *last;
    const double tokens = (double)r.sequences * cfg->seq_len; /* per step, all ranks */
    const double tps = tokens / step_s, tps_gpu = tps / tr->world;
    const double flops = moe_bench_flops_per_token(cfg) * tps_gpu;
    fprintf(out,
            "bench: %d warm-up, %d timed, %d phase-timed steps; world %d, ep %d, %d chunk%s per "
            "micro-batch, exchange sent %dx, %s, %s\n",
            warmup, cfg->steps, phase_steps, tr->world, cfg->ep, m->C, m->C > 1 ? "s" : "",
            cfg->exchange_repeat, m->be->name, moe_trainer_precision(tr));
    fprintf(out, "  tokens/s              %.0f (%.0f per %s)\n", tps, tps_gpu,
            m->be->on_device ? "GPU" : "rank");
    fprintf(out, "  step time             %.2f ms (%.0f tokens per step, final loss %.4f)\n",
            1e3 * step_s, tokens, r.loss);
    fprintf(out, "  model TFLOP/s         %.3g per %s (%.6g GFLOP per token)\n", flops / 1e12,
            m->be->on_device ? "GPU" : "rank", moe_bench_flops_per_token(cfg) / 1e9);
    if (rate > 0)
        fprintf(out,
                "  MFU                   %.1f%% of the backend's %s GEMM at n=%d: %.3g TFLOP/s\n",
                100.0 * flops / rate,
                tr->precision == MOE_PREC_BF16   ? "bf16"
                : tr->precision == MOE_PREC_FP16 ? "fp16"
                                                 : "fp32",
                m->be->on_device ? 8192 : 512, rate / 1e12);
    else
        fprintf(out, "  MFU                   n/a (the GEMM rate could not be measured)\n");
    static const char *names[MOE_PHASES] = {
        "data", "forward", "backward", "exchange", "gradient reduction", "optimizer"};
    double sum = 0;
    for (int p = 0; p < MOE_PHASES; p++)
        sum += ph[p];
    fprintf(out,
            "  host                  %.2f ms per step blocked on the device (counts, losses), "
            "%.2f ms issuing work (rank 0; were it blocked little, the host would bound the "
            "step)\n",
            1e3 * host_wait, 1e3 * (step_s - host_wait));
    fprintf(out, "  phases (ms per step, each boundary synchronised; the slowest rank):\n");
    for (int p = 0; p < MOE_PHASES; p++)
        fprintf(out, "    %-20s %9.2f  %5.1f%%\n", names[p], 1e3 * ph[p],
                sum > 0 ? 100.0 * ph[p] / sum : 0.0);
    fprintf(out, "    %-20s %9.2f\n", "sum", 1e3 * sum);
    fprintf(out,
            "  exposed communication %.2f ms per step (exchange + reduction, not overlapped)\n",
            1e3 * (ph[MOE_PHASE_EXCHANGE] + ph[MOE_PHASE_REDUCTION]));
    const double ctot = comm[0] + comm[2], cexp = comm[1] + comm[3];
    fprintf(out,
            "  communication         %.2f ms per step, %.2f ms exposed (%.1f%% hidden): exchange "
            "%.2f (exposed %.2f; of these the count exchanges %.2f, exposed %.2f), gradient "
            "reduction %.2f (exposed %.2f); untimed steps, slowest rank\n",
            1e3 * ctot, 1e3 * cexp, ctot > 0 ? fmax(0.0, 100.0 * (1.0 - cexp / ctot)) : 100.0,
            1e3 * comm[0], 1e3 * comm[1], 1e3 * comm[4], 1e3 * comm[5], 1e3 * comm[2],
            1e3 * comm[3]);
    if (tr->world > 1) {
        const double mean = spread[4] / tr->world;
        fprintf(out,
                "  ranks                 expert rows per step min %.0f max %.0f (max/mean %.3f); "
                "exposed exchange min %.2f max %.2f mean %.2f ms\n",
                -spread[0], spread[1], mean > 0 ? spread[1] / mean : 0.0, -1e3 * spread[2],
                1e3 * spread[3], 1e3 * spread[5] / tr->world);
    }
    print_sites(sites, n_sites, out);
    fprintf(out, "  allocations           %ld by the backend during the timed steps (rank 0)\n",
            allocs);
    fprintf(out, "  memory                %.2f GiB %s (largest rank)\n", mem_max / 1073741824.0,
            m->be->on_device ? "of device memory in use" : "peak resident");
    fprintf(out,
            "bench-result tokens_per_s=%.0f tokens_per_s_per_gpu=%.0f step_ms=%.3f "
            "flops_per_token=%.6g tflops=%.4g mfu=%.4f phase_sum_ms=%.3f exposed_comm_ms=%.3f "
            "comm_ms=%.3f comm_exposed_ms=%.3f\n",
            tps, tps_gpu, 1e3 * step_s, moe_bench_flops_per_token(cfg), flops / 1e12,
            rate > 0 ? flops / rate : 0.0, 1e3 * sum,
            1e3 * (ph[MOE_PHASE_EXCHANGE] + ph[MOE_PHASE_REDUCTION]), 1e3 * ctot, 1e3 * cexp);
}

/* The places where communication was exposed, the largest first (at most 8 and those of
 * at least 1% of the exposed total). */
static void print_sites(const moe_comm_site *sites, int n, FILE *out)
{
    int order[MOE_COMM_SITES];
    double all = 0;
    for (int i = 0; i < n; i++) {
        order[i] = i;
        all += sites[i].exposed_s;
    }
    if (n == 0 || all <= 0)
        return;
    for (int i = 1; i < n; i++) /* insertion sort by exposed time, descending */
        for (int j = i; j > 0 && sites[order[j]].exposed_s > sites[order[j - 1]].exposed_s; j--) {
            const int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    fprintf(out, "  exposed by place (ms per step, the slowest rank per place; total, exposed, "
                 "operations):\n");
    for (int i = 0; i < n && i < 8 && sites[order[i]].exposed_s >= 0.01 * all; i++) {
        const moe_comm_site *s = &sites[order[i]];
        fprintf(out, "    %-42s %8.2f %8.2f %5ld\n", s->name, 1e3 * s->total_s, 1e3 * s->exposed_s,
                s->count);
    }
}
