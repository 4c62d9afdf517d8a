/* launcher/bench.h: `moe-dist bench CONFIG`: warm-up steps, timed steps, then a few steps
 * with every phase timed, then 2 with every kernel timed (GPU); prints tokens/s, step
 * time, model TFLOP/s, MFU against the backend's own GEMM timed in the same process, the
 * phase breakdown, memory and the kernel profile. */
#ifndef MOE_LAUNCHER_BENCH_H
#define MOE_LAUNCHER_BENCH_H

#include <stdio.h>

#include "runtime/trainer.h"

/* Model FLOPs per token of one training step (forward and backward): 3 x (2 x the
 * non-embedding parameters a token uses, LM head included, + causal attention 2*T*D per
 * layer). */
double moe_bench_flops_per_token(const moe_config *cfg);

/* Runs the benchmark on a created trainer (collective: every rank calls it); rank 0
 * prints. Training state advances as in `train`. profile_steps: more steps with the
 * backend's kernel profile on (where it has one), printed by name. */
moe_status moe_bench_run(moe_trainer *tr, int warmup, int phase_steps, int profile_steps,
                         FILE *out);

#endif
