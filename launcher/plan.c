/* launcher/plan.c: the plan-experts verb (see plan.h). No MPI. */
#include "launcher/plan.h"

#include <stdio.h>

#include "sched/cost.h"
#include "sched/placement.h"
#include "sched/stats.h"

int moe_cmd_plan_experts(const char *stats_path, int ranks, int nodes, const char *out_path)
{
    if (ranks < 1 || nodes < 1 || ranks % nodes != 0) {
        fprintf(stderr, "moe-dist: plan-experts needs --ranks R (>= 1) and --nodes N dividing R\n");
        return 2;
    }
    moe_routing_stats *s = NULL;
    moe_placement *plan = NULL, *contiguous = NULL;
    moe_plan_report report;
    moe_plan_params params = moe_plan_params_default();
    int rc = 1;
    if (moe_routing_stats_load(&s, stats_path) != MOE_OK)
        return 1;
    if (s->experts % ranks != 0) {
        fprintf(stderr, "moe-dist: %s has %d experts per layer, not divisible by --ranks %d\n",
                stats_path, s->experts, ranks);
        moe_routing_stats_destroy(s);
        return 2;
    }
    if (moe_plan_experts(&plan, s, ranks, ranks / nodes, &params, &report) != MOE_OK ||
        moe_placement_create(&contiguous, s->layers, s->experts, ranks, ranks / nodes) != MOE_OK)
        goto done;
    printf("plan for %d MoE layers, %d experts, %d ranks on %d node%s (%lld steps of "
           "statistics); load max/mean %.2f\n",
           s->layers, s->experts, ranks, nodes, nodes == 1 ? "" : "s", (long long)s->steps,
           report.worst_balance);
    /* per token row: one unit (the ratio matters, not the row size) */
    moe_traffic base = {0}, planned = {0};
    for (int l = 0; l < s->layers; l++) {
        moe_traffic tb, tp;
        if (moe_cost_stats(contiguous, s, l, 1, &tb) != MOE_OK ||
            moe_cost_stats(plan, s, l, 1, &tp) != MOE_OK)
            goto done;
        moe_traffic_add(&base, &tb);
        moe_traffic_add(&planned, &tp);
    }
    moe_traffic_print(stdout, "contiguous", &base, NULL);
    moe_traffic_print(stdout, "planned", &planned, &base);
    double b = moe_traffic_cross_rank(&base), p = moe_traffic_cross_rank(&planned);
    printf("predicted cross-rank token rows: %.0f -> %.0f (%.1f%% fewer)\n", b, p,
           b > 0 ? 100.0 * (1.0 - p / b) : 0.0);
    if (out_path) {
        if (moe_placement_save(plan, out_path, "moe-dist plan-experts") != MOE_OK)
            goto done;
        printf("plan written to %s ([parallel] placement = %s)\n", out_path, out_path);
    } else {
        moe_placement_write(plan, stdout, "moe-dist plan-experts");
    }
    rc = 0;
done:
    moe_placement_destroy(plan);
    moe_placement_destroy(contiguous);
    moe_routing_stats_destroy(s);
    return rc;
}
