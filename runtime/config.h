/* runtime/config.h: the run configuration, read from an INI file plus --set overrides.
 *
 * Owns: the config struct, its defaults, parsing (inih), validation, and the table of
 * every key (docs/config.md documents each, and a test checks it does).
 * Does not own: what the keys mean at run time (the runtime modules read the struct).
 *
 * Errors name the place: "FILE:LINE: [section] key: reason", or "--set section.key:
 * reason" for overrides; consistency errors name the line of the key they blame. */
#ifndef MOE_RUNTIME_CONFIG_H
#define MOE_RUNTIME_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "util/status.h"

#define MOE_MAX_ACCUM_PHASES 16
#define MOE_PATH_MAX 1024
#define MOE_CONFIG_MAX_KEYS 96

typedef struct {
    int from_step; /* first optimizer step of this phase */
    int micro_batches;
} moe_accum_phase;

typedef struct {
    /* [model] */
    int vocab_size;         /* V */
    int d_model;            /* D */
    int n_layers;           /* L */
    int n_heads;            /* H, divides D */
    int seq_len;            /* T */
    int experts;            /* E, per MoE layer */
    int top_k;              /* K, 1 <= K <= E */
    int expert_hidden;      /* F, hidden width of one expert */
    int dense_layers;       /* the first dense_layers layers use a dense SwiGLU FFN */
    int dense_hidden;       /* hidden width of the dense FFN */
    int shared_experts;     /* shared experts added to every token, each of width F */
    int renorm_topk;        /* divide the k weights by their sum */
    double capacity_factor; /* 0: dropless; else capacity = ceil(cf * N*K / E) per expert */
    double aux_loss_coef;
    double z_loss_coef;
    double rope_theta;
    double norm_eps;
    double init_std;
    double router_init_std;

    /* [train] */
    int steps;                                   /* optimizer steps */
    int micro_batch;                             /* sequences per rank per micro-batch */
    moe_accum_phase accum[MOE_MAX_ACCUM_PHASES]; /* grad_accum schedule, e.g. "8@0,4@1000" */
    int n_accum;
    double lr;
    double min_lr;
    int warmup_steps;
    double weight_decay;
    double beta1, beta2, adam_eps;
    double grad_clip; /* max global norm; 0 disables */
    uint64_t seed;

    /* [parallel] */
    int ep;                /* expert-parallel degree */
    char backend[16];      /* auto | cpu | cuda */
    char bind[8];          /* auto | numa | core | none: CPU and memory binding (launcher/bind.h) */
    double comm_timeout_s; /* a communication wait longer than this ends the job */
    char placement[MOE_PATH_MAX]; /* contiguous | auto | plan file */
    int replan_interval;          /* steps between re-plans with placement = auto */
    char a2a_chunks[16];          /* auto | n: chunks of a micro-batch (moe_config_chunks) */
    int exchange_repeat;          /* benchmark: every token exchange is sent this many times */

    /* [data] */
    char data_source[16];         /* synthetic | shards */
    char data_path[MOE_PATH_MAX]; /* llm.c shard file(s), comma-separated */
    char synthetic[16];           /* processes | topics: which synthetic corpus */
    int synthetic_processes;      /* distinct token-generating processes (or topics) */
    uint64_t data_seed;

    /* [precision] */
    char precision[8];              /* fp32 | bf16 | fp16 | auto */
    char optimizer_state[8];        /* fp32 | bf16: AdamW's moments */
    char master_weights[8];         /* fp32 | bf16: the experts' master weights */
    char expert_grads[8];           /* fp32 | bf16: their weight gradients */
    double loss_scale_init;         /* fp16 dynamic loss scaling: start */
    int loss_scale_growth_interval; /* clean steps before growing */
    double loss_scale_growth;       /* growth factor */
    double loss_scale_backoff;      /* factor on overflow */

    /* [checkpoint] */
    char ckpt_dir[MOE_PATH_MAX];
    int ckpt_interval;            /* steps; 0 disables */
    double ckpt_interval_minutes; /* minutes of wall time (rank 0's clock); 0 disables */
    int ckpt_keep;                /* committed checkpoints kept, >= 2 */

    /* [log] */
    int log_interval;              /* progress line every N steps */
    int expert_load_interval;      /* per-layer expert-load summary every N steps; 0 disables */
    char jsonl_path[MOE_PATH_MAX]; /* "" disables */
    char routing_stats_path[MOE_PATH_MAX]; /* "" disables */

    /* where each key was last set, for messages: config.c's key table indexes these */
    char source_path[MOE_PATH_MAX];    /* the INI file loaded, "" if none */
    int key_line[MOE_CONFIG_MAX_KEYS]; /* 0: default, > 0: line in source_path, -1: --set */
} moe_config;

/* Fills cfg with every default. */
void moe_config_defaults(moe_config *cfg);

/* Reads `path` over the values already in cfg (defaults, usually), checking each value's
 * type and range but no rule between keys yet (overrides may follow: validate after
 * them). Sets source_path and key_line. Stops at the first error: logs
 * "path:line: [section] key = value: reason" and returns MOE_ERR_INVALID (MOE_ERR_IO,
 * with the path and the system's reason, if the file cannot be read); cfg is then
 * unchanged. Loading a second file forgets the lines of the first (they read as 0). */
moe_status moe_config_load(moe_config *cfg, const char *path);

/* Same as moe_config_load, from INI text in memory (the embedded default, say); `name`
 * stands for the file in messages and source_path. */
moe_status moe_config_load_string(moe_config *cfg, const char *text, const char *name);

/* Applies one "section.key=value" override (key_line -1). Errors log
 * "--set section.key=value: reason" and return MOE_ERR_INVALID; cfg is then unchanged. */
moe_status moe_config_set(moe_config *cfg, const char *assignment);

/* Checks ranges and consistency (top_k <= experts, d_model % n_heads == 0, ...), logging
 * every failure; returns MOE_ERR_INVALID if any. A message names the file:line (or --set)
 * where the blamed key was last set; a rule between two keys blames the one set last
 * and names the other. Ep dividing the number of ranks is the launcher's check. */
moe_status moe_config_validate(const moe_config *cfg);

/* Micro-batches per optimizer step at `step` (0-based) from the grad_accum schedule. */
int moe_config_accum_at(const moe_config *cfg, int step);

/* Chunks a micro-batch runs as ([parallel] a2a_chunks): the number given, or for auto 2
 * when the token exchange crosses hosts (ep_hosts > 1: the EP group spans that many
 * machines), micro_batch is even and no capacity drops tokens (a capacity applies per
 * chunk), else 1. Inside one machine (NVLink, PCIe) the exchange is short next to the
 * experts, and chunks cost more than they hide (docs/results.md). Valid after
 * moe_config_validate. */
int moe_config_chunks(const moe_config *cfg, int ep_hosts);

/* Writes the config as INI text (every key, current values) to buf; returns the
 * length it needed (like snprintf). */
size_t moe_config_to_ini(const moe_config *cfg, char *buf, size_t cap);

/* The key table, for docs and tests: number of keys and the i-th "section.key". */
int moe_config_key_count(void);
const char *moe_config_key_name(int i);

/* The embedded default config (configs/tiny.ini compiled in). */
extern const char moe_config_tiny_ini[];

#endif
