/* launcher/plan.h: `moe-dist plan-experts STATS --ranks R [--nodes N] [--out PLAN]`: plans
 * an expert placement from a routing_stats file and prints the predicted traffic against
 * the contiguous placement, so a user can decide before a long run. */
#ifndef MOE_LAUNCHER_PLAN_H
#define MOE_LAUNCHER_PLAN_H

/* Returns the exit status: 0 done, 1 a file could not be read or written, 2 bad usage. */
int moe_cmd_plan_experts(const char *stats_path, int ranks, int nodes, const char *out_path);

#endif
