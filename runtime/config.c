/* runtime/config.c: the key table, defaults, INI and --set parsing, validation, INI output.
 *
 * Owns: one table with a row per key (section, name, type, field, range, default text,
 * one-line doc). Defaults, parsing, --set, validation of single keys, moe_config_to_ini
 * and the key listing all walk that table; a new key is one new row (plus its line in
 * docs/config.md, which test_config checks).
 * Does not own: what the keys mean at run time, nor the rules that need the world size
 * (ep dividing the number of ranks is the launcher's check).
 *
 * Files are read whole, then fed to inih line by line through our own reader, which
 * counts lines (for messages and key_line), strips leading blanks (so an indented line
 * is never taken as an inih continuation line), rejects unknown sections even when they
 * hold no key, and passes values longer than inih's fixed line buffer around it. */
#include "runtime/config.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ini.h>

/* ---- the key table ---- */

typedef enum { T_INT, T_DOUBLE, T_BOOL, T_U64, T_STRING, T_ENUM, T_ACCUM } key_type;

/* Range flags: which bounds apply, and whether they are open. */
enum { R_MIN = 1, R_MAX = 2, R_MIN_OPEN = 4, R_MAX_OPEN = 8 };

typedef struct {
    const char *section;
    const char *key;
    const char *full; /* "section.key" */
    key_type type;
    size_t offset; /* of the field in moe_config */
    size_t size;   /* of the field (strings: the buffer) */
    double min, max;
    int range;           /* R_* flags */
    const char *choices; /* T_ENUM: "a|b|c" */
    const char *def;     /* default, as INI text */
    const char *doc;
} key_def;

#define FIELD(f) offsetof(moe_config, f), sizeof(((moe_config *)0)->f)
#define NONE 0, 0, 0
#define GE(lo) (lo), 0, R_MIN
#define GT(lo) (lo), 0, R_MIN | R_MIN_OPEN
#define IN(lo, hi) (lo), (hi), R_MIN | R_MAX
#define IN_CO(lo, hi) (lo), (hi), R_MIN | R_MAX | R_MAX_OPEN
#define KEY(sec, name, type, field, range, def, doc)                                               \
    {                                                                                              \
        sec, name, sec "." name, type, FIELD(field), range, NULL, def, doc                         \
    }
#define KEY_ENUM(sec, name, field, choices, def, doc)                                              \
    {                                                                                              \
        sec, name, sec "." name, T_ENUM, FIELD(field), NONE, choices, def, doc                     \
    }

static const key_def keys[] = {
    KEY("model", "vocab_size", T_INT, vocab_size, GE(2), "256", "vocabulary size (V)"),
    KEY("model", "d_model", T_INT, d_model, GE(1), "64", "model width (D)"),
    KEY("model", "n_layers", T_INT, n_layers, GE(1), "2", "transformer blocks (L)"),
    KEY("model", "n_heads", T_INT, n_heads, GE(1), "4",
        "attention heads (H); divides d_model, head dimension even"),
    KEY("model", "seq_len", T_INT, seq_len, GE(1), "64", "tokens per sequence (T)"),
    KEY("model", "experts", T_INT, experts, GE(1), "8", "routed experts per MoE layer (E)"),
    KEY("model", "top_k", T_INT, top_k, GE(1), "2", "experts per token (K), at most experts"),
    KEY("model", "expert_hidden", T_INT, expert_hidden, GE(1), "128",
        "hidden width of one expert (F)"),
    KEY("model", "dense_layers", T_INT, dense_layers, GE(0), "0",
        "the first dense_layers blocks use a dense FFN, at most n_layers"),
    KEY("model", "dense_hidden", T_INT, dense_hidden, GE(1), "256",
        "hidden width of the dense FFN"),
    KEY("model", "shared_experts", T_INT, shared_experts, GE(0), "0",
        "shared experts every token passes through, each of width expert_hidden"),
    KEY("model", "renorm_topk", T_BOOL, renorm_topk, NONE, "true",
        "divide the k routing weights by their sum"),
    KEY("model", "capacity_factor", T_DOUBLE, capacity_factor, GE(0), "0",
        "0: dropless; else capacity ceil(cf * micro_batch * T * K / E) per expert"),
    KEY("model", "aux_loss_coef", T_DOUBLE, aux_loss_coef, GE(0), "0.01",
        "load-balancing loss weight (per micro-batch)"),
    KEY("model", "z_loss_coef", T_DOUBLE, z_loss_coef, GE(0), "0.001", "router z-loss weight"),
    KEY("model", "rope_theta", T_DOUBLE, rope_theta, GT(0), "10000", "RoPE base"),
    KEY("model", "norm_eps", T_DOUBLE, norm_eps, GT(0), "1e-5", "RMSNorm epsilon"),
    KEY("model", "init_std", T_DOUBLE, init_std, GT(0), "0.02",
        "standard deviation of the initial weights"),
    KEY("model", "router_init_std", T_DOUBLE, router_init_std, GE(0), "0.02",
        "standard deviation of the initial router weights; 0 routes every token to the first "
        "top_k experts at the start (a test of the extremes)"),

    KEY("train", "steps", T_INT, steps, GE(1), "100", "optimizer steps"),
    KEY("train", "micro_batch", T_INT, micro_batch, GE(1), "8",
        "sequences per rank per micro-batch"),
    KEY("train", "grad_accum", T_ACCUM, accum, NONE, "1",
        "micro-batches per step: N, or a schedule N@STEP,... such as 8@0,4@1000"),
    KEY("train", "lr", T_DOUBLE, lr, GT(0), "3e-4", "peak learning rate"),
    KEY("train", "min_lr", T_DOUBLE, min_lr, GE(0), "3e-5",
        "learning rate at the end of the cosine decay, at most lr"),
    KEY("train", "warmup_steps", T_INT, warmup_steps, GE(0), "10", "linear warmup steps"),
    KEY("train", "weight_decay", T_DOUBLE, weight_decay, GE(0), "0.1", "AdamW weight decay"),
    KEY("train", "beta1", T_DOUBLE, beta1, IN_CO(0, 1), "0.9", "AdamW beta1"),
    KEY("train", "beta2", T_DOUBLE, beta2, IN_CO(0, 1), "0.95", "AdamW beta2"),
    KEY("train", "adam_eps", T_DOUBLE, adam_eps, GT(0), "1e-8", "AdamW epsilon"),
    KEY("train", "grad_clip", T_DOUBLE, grad_clip, GE(0), "1.0",
        "maximum global gradient norm; 0 disables clipping"),
    KEY("train", "seed", T_U64, seed, NONE, "1234", "seed of the initial weights"),

    KEY("parallel", "ep", T_INT, ep, GE(1), "1", "expert-parallel degree; divides experts"),
    KEY_ENUM("parallel", "backend", backend, "auto|cpu|cuda", "auto",
             "where compute runs: auto (CUDA where a GPU is usable, else the CPU), cpu or cuda"),
    KEY_ENUM("parallel", "bind", bind, "auto|numa|core|none", "auto",
             "CPU and memory binding of each rank (docs/launch.md)"),
    KEY("parallel", "comm_timeout_s", T_DOUBLE, comm_timeout_s, GT(0), "600",
        "seconds a communication may wait before the job ends, naming the silent rank"),
    KEY("parallel", "placement", T_STRING, placement, NONE, "contiguous",
        "expert placement: contiguous, auto (re-plan from routing statistics every "
        "replan_interval steps) or a plan file (docs/scheduler.md)"),
    KEY("parallel", "replan_interval", T_INT, replan_interval, GE(0), "0",
        "steps between re-plans with placement = auto; 0 never re-plans"),
    KEY("parallel", "a2a_chunks", T_STRING, a2a_chunks, NONE, "auto",
        "chunks of sequences a micro-batch runs as, so that one chunk's token exchange "
        "overlaps another's compute: a divisor of micro_batch, or auto (2 when the EP group "
        "spans hosts, else 1)"),
    KEY("parallel", "exchange_repeat", T_INT, exchange_repeat, GE(1), "1",
        "benchmark knob: every token exchange is sent this many times (a slower network)"),

    KEY_ENUM("data", "source", data_source, "synthetic|shards", "synthetic",
             "built-in synthetic corpus, or llm.c token shards"),
    KEY("data", "path", T_STRING, data_path, NONE, "",
        "shard files, comma-separated; required when source = shards"),
    KEY_ENUM("data", "synthetic", synthetic, "processes|topics", "processes",
             "synthetic corpus: a mixture of rule-based processes, or of topics (each "
             "sequence uniform in its topic's band)"),
    KEY("data", "synthetic_processes", T_INT, synthetic_processes, IN(1, 64), "4",
        "token-generating processes (or topics) in the synthetic corpus"),
    KEY("data", "seed", T_U64, data_seed, NONE, "42", "seed of the synthetic corpus"),

    KEY_ENUM("precision", "mode", precision, "fp32|bf16|fp16|auto", "fp32",
             "GEMM precision: fp32, bf16 (sm_80+), fp16 (with loss scaling), auto"),
    KEY_ENUM("precision", "optimizer_state", optimizer_state, "fp32|bf16", "fp32",
             "AdamW's moments m and v: fp32, or bf16 (half their memory and traffic; "
             "master_weights sets the weights' own precision)"),
    KEY_ENUM("precision", "master_weights", master_weights, "fp32|bf16", "fp32",
             "the experts' master weights: fp32, or bf16 (mode = bf16 only: AdamW updates "
             "the GEMMs' bf16 copy in place, as the peer keeps bf16 parameters)"),
    KEY_ENUM("precision", "expert_grads", expert_grads, "fp32|bf16", "fp32",
             "the experts' weight gradients: fp32, or bf16 (master_weights = bf16 only: the "
             "GEMMs write them in bf16 and AdamW reads them so, as the peer's bf16 "
             "parameters have bf16 gradients)"),
    KEY("precision", "loss_scale_init", T_DOUBLE, loss_scale_init, GT(0), "65536",
        "fp16: the initial dynamic loss scale"),
    KEY("precision", "loss_scale_growth_interval", T_INT, loss_scale_growth_interval, GE(1), "1000",
        "fp16: clean steps before the scale grows"),
    KEY("precision", "loss_scale_growth", T_DOUBLE, loss_scale_growth, GT(1), "2",
        "fp16: factor applied after growth_interval clean steps"),
    KEY("precision", "loss_scale_backoff", T_DOUBLE, loss_scale_backoff, GT(0), "0.5",
        "fp16: factor applied on overflow (the step is skipped); below 1"),

    KEY("checkpoint", "dir", T_STRING, ckpt_dir, NONE, "runs/ckpt",
        "directory of the step-NNNNNNNN checkpoints"),
    KEY("checkpoint", "interval", T_INT, ckpt_interval, GE(0), "0",
        "steps between checkpoints; 0 disables"),
    KEY("checkpoint", "interval_minutes", T_DOUBLE, ckpt_interval_minutes, GE(0), "0",
        "minutes between checkpoints (rank 0's clock); 0 disables"),
    KEY("checkpoint", "keep", T_INT, ckpt_keep, GE(2), "2",
        "committed checkpoints kept on disk, the newest"),

    KEY("log", "interval", T_INT, log_interval, GE(1), "1", "progress line every N steps"),
    KEY("log", "expert_load_interval", T_INT, expert_load_interval, GE(0), "50",
        "expert-load summary every N steps; 0 disables"),
    KEY("log", "jsonl", T_STRING, jsonl_path, NONE, "", "JSONL metrics file; empty disables"),
    KEY("log", "routing_stats", T_STRING, routing_stats_path, NONE, "",
        "routing statistics file (summed over ranks), written at the end and at each "
        "re-plan; empty disables"),
};

#define N_KEYS ((int)(sizeof keys / sizeof keys[0]))
_Static_assert(sizeof keys / sizeof keys[0] <= MOE_CONFIG_MAX_KEYS,
               "raise MOE_CONFIG_MAX_KEYS in runtime/config.h");

static const char *const sections[] = {"model",     "train",      "parallel", "data",
                                       "precision", "checkpoint", "log"};
#define N_SECTIONS ((int)(sizeof sections / sizeof sections[0]))

/* ---- small helpers ---- */

static void *field(moe_config *cfg, int i) { return (char *)cfg + keys[i].offset; }

static const void *cfield(const moe_config *cfg, int i)
{
    return (const char *)cfg + keys[i].offset;
}

/* Trims blanks (and '\r') at both ends, in place; returns the new start. */
static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1]))
        s[--n] = '\0';
    return s;
}

/* Appends to buf like snprintf, tracking the length it would need. */
static void append(char *buf, size_t cap, size_t *len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void append(char *buf, size_t cap, size_t *len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    size_t room = *len < cap ? cap - *len : 0;
    int n = vsnprintf(room ? buf + *len : NULL, room, fmt, ap);
    va_end(ap);
    if (n > 0)
        *len += (size_t)n;
}

/* Levenshtein distance of two short names (longer ones count as far apart). */
static int edit_distance(const char *a, const char *b)
{
    enum { MAXN = 48 };
    size_t na = strlen(a), nb = strlen(b);
    if (na >= MAXN || nb >= MAXN)
        return INT_MAX;
    int prev[MAXN], cur[MAXN];
    for (size_t j = 0; j <= nb; j++)
        prev[j] = (int)j;
    for (size_t i = 1; i <= na; i++) {
        cur[0] = (int)i;
        for (size_t j = 1; j <= nb; j++) {
            int sub = prev[j - 1] + (a[i - 1] != b[j - 1]);
            int del = prev[j] + 1, ins = cur[j - 1] + 1;
            cur[j] = sub < del ? (sub < ins ? sub : ins) : (del < ins ? del : ins);
        }
        memcpy(prev, cur, sizeof prev);
    }
    return prev[nb];
}

static int find_section(const char *section)
{
    for (int s = 0; s < N_SECTIONS; s++)
        if (strcmp(sections[s], section) == 0)
            return s;
    return -1;
}

static int find_key(const char *section, const char *key)
{
    for (int i = 0; i < N_KEYS; i++)
        if (strcmp(keys[i].section, section) == 0 && strcmp(keys[i].key, key) == 0)
            return i;
    return -1;
}

/* " (did you mean [model]?)" for an unknown section, or "". */
static void suggest_section(const char *section, char *buf, size_t cap)
{
    buf[0] = '\0';
    int best = -1, best_d = 3;
    for (int s = 0; s < N_SECTIONS; s++) {
        int d = edit_distance(section, sections[s]);
        if (d < best_d && 2 * (size_t)d <= strlen(section))
            best = s, best_d = d;
    }
    if (best >= 0)
        snprintf(buf, cap, " (did you mean [%s]?)", sections[best]);
}

/* " (did you mean 'top_k'?)" for an unknown key: the same name in another section, else
 * the closest name of this section within edit distance 2 (and half its length); or "". */
static void suggest_key(const char *section, const char *key, char *buf, size_t cap)
{
    buf[0] = '\0';
    for (int i = 0; i < N_KEYS; i++)
        if (strcmp(keys[i].key, key) == 0) {
            snprintf(buf, cap, " (did you mean [%s] %s?)", keys[i].section, key);
            return;
        }
    int best = -1, best_d = 3;
    for (int i = 0; i < N_KEYS; i++) {
        if (strcmp(keys[i].section, section) != 0)
            continue;
        int d = edit_distance(key, keys[i].key);
        if (d < best_d && 2 * (size_t)d <= strlen(key))
            best = i, best_d = d;
    }
    if (best >= 0)
        snprintf(buf, cap, " (did you mean '%s'?)", keys[best].key);
}

/* ---- values: parse, check, format ---- */

static int parse_long(const char *s, long long lo, long long hi, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end != '\0' || isspace((unsigned char)*s))
        return 0;
    if (errno == ERANGE || v < lo || v > hi)
        return -1;
    *out = v;
    return 1;
}

/* grad_accum text -> phases (syntax only; check_accum judges the numbers). */
static int parse_accum(const char *text, moe_accum_phase *phases, int *count, char *why, size_t cap)
{
    int n = 0;
    const char *s = text;
    if (*s == '\0') {
        snprintf(why, cap, "expected N or a schedule N@STEP,... (such as 8@0,4@1000)");
        return 0;
    }
    for (;;) {
        const char *comma = strchr(s, ',');
        size_t len = comma ? (size_t)(comma - s) : strlen(s);
        char item[64];
        if (len >= sizeof item) {
            snprintf(why, cap, "phase %d is not N or N@STEP", n + 1);
            return 0;
        }
        memcpy(item, s, len);
        item[len] = '\0';
        char *it = trim(item);
        if (*it == '\0') {
            snprintf(why, cap, "empty phase %d (expected N@STEP between commas)", n + 1);
            return 0;
        }
        if (n == MOE_MAX_ACCUM_PHASES) {
            snprintf(why, cap, "more than %d phases", MOE_MAX_ACCUM_PHASES);
            return 0;
        }
        char *at = strchr(it, '@');
        long long mb, from = 0;
        if (at)
            *at = '\0';
        if (parse_long(trim(it), INT_MIN, INT_MAX, &mb) != 1 ||
            (at && parse_long(trim(at + 1), INT_MIN, INT_MAX, &from) != 1)) {
            if (at)
                *at = '@';
            snprintf(why, cap, "phase %d '%s' is not N or N@STEP (integers, such as 4@1000)", n + 1,
                     it);
            return 0;
        }
        phases[n].micro_batches = (int)mb;
        phases[n].from_step = (int)from;
        n++;
        if (!comma)
            break;
        s = comma + 1;
    }
    *count = n;
    return 1;
}

static int check_accum(const moe_accum_phase *ph, int n, char *why, size_t cap)
{
    if (n < 1 || n > MOE_MAX_ACCUM_PHASES) {
        snprintf(why, cap, "the schedule needs 1 to %d phases", MOE_MAX_ACCUM_PHASES);
        return 0;
    }
    for (int p = 0; p < n; p++) {
        if (ph[p].micro_batches < 1) {
            snprintf(why, cap, "phase %d (%d@%d): micro-batches must be >= 1", p + 1,
                     ph[p].micro_batches, ph[p].from_step);
            return 0;
        }
        if (p == 0 && ph[0].from_step != 0) {
            snprintf(why, cap, "the first phase must start at step 0 (got %d@%d)",
                     ph[0].micro_batches, ph[0].from_step);
            return 0;
        }
        if (p > 0 && ph[p].from_step <= ph[p - 1].from_step) {
            snprintf(why, cap, "phase %d (%d@%d) must start after phase %d (%d@%d)", p + 1,
                     ph[p].micro_batches, ph[p].from_step, p, ph[p - 1].micro_batches,
                     ph[p - 1].from_step);
            return 0;
        }
    }
    return 1;
}

static void range_text(const key_def *k, char *buf, size_t cap)
{
    int r = k->range;
    if ((r & R_MIN) && (r & R_MAX))
        snprintf(buf, cap, "must be in %c%g, %g%c", r & R_MIN_OPEN ? '(' : '[', k->min, k->max,
                 r & R_MAX_OPEN ? ')' : ']');
    else if (r & R_MIN)
        snprintf(buf, cap, "must be %s %g", r & R_MIN_OPEN ? ">" : ">=", k->min);
    else
        snprintf(buf, cap, "must be %s %g", r & R_MAX_OPEN ? "<" : "<=", k->max);
}

static int in_range(const key_def *k, double v)
{
    int r = k->range;
    if (r & R_MIN && (r & R_MIN_OPEN ? v <= k->min : v < k->min))
        return 0;
    if (r & R_MAX && (r & R_MAX_OPEN ? v >= k->max : v > k->max))
        return 0;
    return 1;
}

/* "expected one of auto, cpu, cuda" from "auto|cpu|cuda". */
static void choices_text(const char *choices, char *why, size_t cap)
{
    size_t len = 0;
    append(why, cap, &len, "expected one of ");
    for (const char *c = choices; *c; c++)
        if (*c == '|')
            append(why, cap, &len, ", ");
        else
            append(why, cap, &len, "%c", *c);
}

static int enum_has(const char *choices, const char *v)
{
    size_t n = strlen(v);
    for (const char *c = choices; *c;) {
        const char *bar = strchr(c, '|');
        size_t len = bar ? (size_t)(bar - c) : strlen(c);
        if (len == n && strncmp(c, v, n) == 0)
            return 1;
        c += len + (bar != NULL);
    }
    return 0;
}

/* Strings must survive to_ini -> load: no control characters, no " ;" (an inline
 * comment to inih), no blanks at the ends (inih trims them). */
static int check_string(const char *v, size_t size, char *why, size_t cap)
{
    size_t n = strlen(v);
    if (n >= size) {
        snprintf(why, cap, "too long (at most %zu characters)", size - 1);
        return 0;
    }
    for (size_t j = 0; j < n; j++) {
        if (iscntrl((unsigned char)v[j])) {
            snprintf(why, cap, "contains a control character");
            return 0;
        }
        if (v[j] == ';' && j > 0 && isspace((unsigned char)v[j - 1])) {
            snprintf(why, cap, "contains ' ;', which starts an INI comment");
            return 0;
        }
    }
    if (n > 0 && (isspace((unsigned char)v[0]) || isspace((unsigned char)v[n - 1]))) {
        snprintf(why, cap, "starts or ends with a blank");
        return 0;
    }
    return 1;
}

/* Checks key i's current value on its own (range, choices, schedule). */
static int check_key(const moe_config *cfg, int i, char *why, size_t cap)
{
    const key_def *k = &keys[i];
    const void *f = cfield(cfg, i);
    switch (k->type) {
    case T_INT:
    case T_DOUBLE: {
        double v = k->type == T_INT ? *(const int *)f : *(const double *)f;
        if (k->type == T_DOUBLE && !isfinite(v)) {
            snprintf(why, cap, "must be a finite number");
            return 0;
        }
        if (!in_range(k, v)) {
            range_text(k, why, cap);
            return 0;
        }
        return 1;
    }
    case T_BOOL:
        if (*(const int *)f != 0 && *(const int *)f != 1) {
            snprintf(why, cap, "must be true or false");
            return 0;
        }
        return 1;
    case T_U64: return 1;
    case T_STRING:
        if (memchr(f, '\0', k->size) == NULL) {
            snprintf(why, cap, "not terminated within %zu bytes", k->size);
            return 0;
        }
        return check_string(f, k->size, why, cap);
    case T_ENUM:
        if (memchr(f, '\0', k->size) == NULL || !enum_has(k->choices, f)) {
            choices_text(k->choices, why, cap);
            return 0;
        }
        return 1;
    case T_ACCUM: return check_accum(cfg->accum, cfg->n_accum, why, cap);
    }
    return 1;
}

/* Parses `text` into key i of cfg and checks it on its own. On failure writes the
 * reason to why and returns 0 (cfg may be half-changed: callers work on a copy). */
static int apply_value(moe_config *cfg, int i, const char *text, char *why, size_t cap)
{
    const key_def *k = &keys[i];
    void *f = field(cfg, i);
    switch (k->type) {
    case T_INT: {
        long long v;
        int r = parse_long(text, INT_MIN, INT_MAX, &v);
        if (r == 0) {
            snprintf(why, cap, "expected an integer");
            return 0;
        }
        if (r < 0) {
            char range[96];
            range_text(k, range, sizeof range);
            snprintf(why, cap, "out of range (%s and fit in 32 bits)", range);
            return 0;
        }
        *(int *)f = (int)v;
        break;
    }
    case T_DOUBLE: {
        char *end;
        errno = 0;
        double v = strtod(text, &end);
        if (end == text || *end != '\0' || isspace((unsigned char)*text)) {
            snprintf(why, cap, "expected a number");
            return 0;
        }
        if (errno == ERANGE || !isfinite(v)) {
            snprintf(why, cap, "expected a finite number of double range");
            return 0;
        }
        *(double *)f = v;
        break;
    }
    case T_BOOL: {
        static const char *const yes[] = {"true", "yes", "1"}, *const no[] = {"false", "no", "0"};
        int v = -1;
        for (int j = 0; j < 3; j++) {
            if (strcasecmp(text, yes[j]) == 0)
                v = 1;
            if (strcasecmp(text, no[j]) == 0)
                v = 0;
        }
        if (v < 0) {
            snprintf(why, cap, "expected true or false (or yes/no, 1/0)");
            return 0;
        }
        *(int *)f = v;
        break;
    }
    case T_U64: {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(text, &end, 10);
        if (end == text || *end != '\0' || !isdigit((unsigned char)text[text[0] == '+'])) {
            snprintf(why, cap, "expected an unsigned integer");
            return 0;
        }
        if (errno == ERANGE) {
            snprintf(why, cap, "out of range (must be < 2^64)");
            return 0;
        }
        *(uint64_t *)f = (uint64_t)v;
        break;
    }
    case T_ENUM:
        if (!enum_has(k->choices, text)) {
            choices_text(k->choices, why, cap);
            return 0;
        }
        memcpy(f, text, strlen(text) + 1); /* every choice fits its field */
        break;
    case T_STRING:
        if (!check_string(text, k->size, why, cap))
            return 0;
        memcpy(f, text, strlen(text) + 1);
        break;
    case T_ACCUM: {
        moe_accum_phase phases[MOE_MAX_ACCUM_PHASES];
        int n = 0;
        if (!parse_accum(text, phases, &n, why, cap))
            return 0;
        memcpy(cfg->accum, phases, sizeof phases[0] * (size_t)n);
        cfg->n_accum = n;
        break;
    }
    }
    return check_key(cfg, i, why, cap);
}

/* Writes key i's current value as INI text. */
static void format_value(const moe_config *cfg, int i, char *buf, size_t cap)
{
    const void *f = cfield(cfg, i);
    switch (keys[i].type) {
    case T_INT: snprintf(buf, cap, "%d", *(const int *)f); break;
    case T_BOOL: snprintf(buf, cap, "%s", *(const int *)f ? "true" : "false"); break;
    case T_U64: snprintf(buf, cap, "%" PRIu64, *(const uint64_t *)f); break;
    case T_DOUBLE: {
        double v = *(const double *)f;
        for (int prec = 15; prec <= 17; prec++) { /* shortest text that reads back exact */
            snprintf(buf, cap, "%.*g", prec, v);
            if (strtod(buf, NULL) == v)
                break;
        }
        break;
    }
    case T_STRING:
    case T_ENUM: snprintf(buf, cap, "%.*s", (int)keys[i].size, (const char *)f); break;
    case T_ACCUM: {
        size_t len = 0;
        buf[0] = '\0';
        if (cfg->n_accum == 1 && cfg->accum[0].from_step == 0) {
            append(buf, cap, &len, "%d", cfg->accum[0].micro_batches);
            break;
        }
        for (int p = 0; p < cfg->n_accum && p < MOE_MAX_ACCUM_PHASES; p++)
            append(buf, cap, &len, "%s%d@%d", p ? "," : "", cfg->accum[p].micro_batches,
                   cfg->accum[p].from_step);
        break;
    }
    }
}

/* ---- defaults ---- */

void moe_config_defaults(moe_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    char why[256];
    for (int i = 0; i < N_KEYS; i++)
        apply_value(cfg, i, keys[i].def, why, sizeof why); /* test_config checks these */
}

/* ---- INI files ---- */

typedef struct {
    moe_config *cfg;        /* the copy being filled */
    const char *name;       /* file name, for messages */
    char *pos;              /* next line of the text (ours, cut in place); NULL at end */
    int line;               /* the line inih is working on */
    const char *long_value; /* this line's value when the line is too long for inih */
    int failed;             /* an error was reported: stop */
} ini_state;

static int ini_fail(ini_state *st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int ini_fail(ini_state *st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *msg = malloc(n > 0 ? (size_t)n + 1 : 1);
    if (msg) {
        va_start(ap, fmt);
        vsnprintf(msg, (size_t)n + 1, fmt, ap);
        va_end(ap);
    }
    moe_log("%s:%d: %s", st->name, st->line, msg ? msg : fmt);
    free(msg);
    st->failed = 1;
    return 0;
}

/* A "[section]" line: known section, nothing after ']' but a comment. Writes "[name]"
 * to buf. */
static int section_line(ini_state *st, char *s, char *buf, int cap)
{
    char *close = strchr(s, ']');
    if (!close)
        return ini_fail(st, "'%s': expected [section]", s);
    *close = '\0';
    char *name = trim(s + 1), *rest = trim(close + 1);
    if (*rest && *rest != ';' && *rest != '#')
        return ini_fail(st, "[%s]: unexpected text '%s' after ']'", name, rest);
    if (find_section(name) < 0) {
        char hint[64];
        suggest_section(name, hint, sizeof hint);
        return ini_fail(st, "unknown section [%s]%s", name, hint);
    }
    snprintf(buf, (size_t)cap, "[%s]", name);
    return 1;
}

/* inih's reader: hands over one physical line per call, normalised (see the top). */
static char *ini_next_line(char *buf, int cap, void *stream)
{
    ini_state *st = stream;
    st->long_value = NULL;
    if (st->failed || st->pos == NULL || *st->pos == '\0')
        return NULL;
    char *s = st->pos, *nl = strchr(s, '\n');
    if (nl) {
        *nl = '\0';
        st->pos = nl + 1;
    } else {
        st->pos = NULL;
    }
    st->line++;
    if (st->line == 1 && strncmp(s, "\xEF\xBB\xBF", 3) == 0) /* UTF-8 byte-order mark */
        s += 3;
    s = trim(s);
    if (*s == '\0' || *s == ';' || *s == '#') {
        buf[0] = '\0';
        return buf;
    }
    if (*s == '[')
        return section_line(st, s, buf, cap) ? buf : NULL;
    char *sep = strpbrk(s, "=:");
    if (!sep) {
        ini_fail(st, "'%s': expected 'key = value' or '[section]'", s);
        return NULL;
    }
    if (strlen(s) + 3 < (size_t)cap) { /* inih wants room for "\r\n\0" */
        memcpy(buf, s, strlen(s) + 1);
        return buf;
    }
    /* Too long for inih's buffer: split here as inih would, hand it "key=" only. */
    *sep = '\0';
    char *key = trim(s), *value = sep + 1;
    for (char *c = value; *c; c++)
        if (*c == ';' && isspace((unsigned char)c[-1])) {
            *c = '\0';
            break;
        }
    value = trim(value);
    if (strlen(key) + 4 >= (size_t)cap) {
        ini_fail(st, "line too long for a key name");
        return NULL;
    }
    snprintf(buf, (size_t)cap, "%s=", key);
    st->long_value = value;
    return buf;
}

static int ini_on_key(void *user, const char *section, const char *name, const char *value)
{
    ini_state *st = user;
    if (st->failed)
        return 0;
    if (st->long_value)
        value = st->long_value;
    if (*section == '\0')
        return ini_fail(st, "'%s = %s' appears before any [section]", name, value);
    if (*name == '\0')
        return ini_fail(st, "[%s] missing key name before '= %s'", section, value);
    int i = find_key(section, name);
    if (i < 0) {
        char hint[96];
        suggest_key(section, name, hint, sizeof hint);
        return ini_fail(st, "[%s] unknown key '%s'%s", section, name, hint);
    }
    char why[256];
    if (!apply_value(st->cfg, i, value, why, sizeof why))
        return ini_fail(st, "[%s] %s = %s: %s", section, name, value, why);
    st->cfg->key_line[i] = st->line;
    return 1;
}

/* Parses INI text (`name` for messages) over cfg; cfg is changed only on success. */
static moe_status parse_text(moe_config *cfg, const char *text, const char *name)
{
    if (strlen(name) >= sizeof cfg->source_path) {
        moe_log("%.64s...: config file name too long (at most %zu characters)", name,
                sizeof cfg->source_path - 1);
        return MOE_ERR_INVALID;
    }
    moe_config *tmp = malloc(sizeof *tmp);
    char *copy = strdup(text);
    if (!tmp || !copy) {
        free(tmp);
        free(copy);
        moe_log("%s: out of memory reading the config", name);
        return MOE_ERR_NOMEM;
    }
    *tmp = *cfg;
    /* Lines recorded against an earlier file would now point into this one. */
    for (int i = 0; i < N_KEYS; i++)
        if (tmp->key_line[i] > 0)
            tmp->key_line[i] = 0;
    ini_state st = {.cfg = tmp, .name = name, .pos = copy};
    int rc = ini_parse_stream(ini_next_line, &st, ini_on_key, &st);
    moe_status status = MOE_OK;
    if (st.failed) {
        status = MOE_ERR_INVALID;
    } else if (rc > 0) { /* a line inih refused that our reader let through */
        moe_log("%s:%d: syntax error: expected 'key = value' or '[section]'", name, rc);
        status = MOE_ERR_INVALID;
    } else if (rc < 0) {
        moe_log("%s: out of memory reading the config", name);
        status = MOE_ERR_NOMEM;
    }
    if (status == MOE_OK) {
        snprintf(tmp->source_path, sizeof tmp->source_path, "%s", name);
        *cfg = *tmp;
    }
    free(copy);
    free(tmp);
    return status;
}

moe_status moe_config_load_string(moe_config *cfg, const char *text, const char *name)
{
    return parse_text(cfg, text, name);
}

moe_status moe_config_load(moe_config *cfg, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        moe_log("%s: cannot open config file: %s", path, strerror(errno));
        return MOE_ERR_IO;
    }
    char *text = NULL;
    size_t len = 0, cap = 0;
    moe_status status = MOE_OK;
    for (;;) {
        if (cap - len < 4096) {
            char *grown = realloc(text, cap * 2 + 4096);
            if (!grown) {
                moe_log("%s: out of memory reading the config", path);
                status = MOE_ERR_NOMEM;
                goto done;
            }
            text = grown;
            cap = cap * 2 + 4096;
        }
        size_t got = fread(text + len, 1, cap - len - 1, f);
        len += got;
        if (got == 0)
            break;
    }
    if (ferror(f)) {
        moe_log("%s: cannot read config file: %s", path, strerror(errno));
        status = MOE_ERR_IO;
        goto done;
    }
    text[len] = '\0';
    if (strlen(text) != len) {
        moe_log("%s: not a text file (contains a NUL byte)", path);
        status = MOE_ERR_INVALID;
        goto done;
    }
    status = parse_text(cfg, text, path);
done:
    free(text);
    fclose(f);
    return status;
}

/* ---- --set ---- */

moe_status moe_config_set(moe_config *cfg, const char *assignment)
{
    char *copy = strdup(assignment);
    if (!copy) {
        moe_log("--set %s: out of memory", assignment);
        return MOE_ERR_NOMEM;
    }
    moe_status status = MOE_ERR_INVALID;
    char *shown = trim(copy);
    char what[1200];
    snprintf(what, sizeof what, "%s", shown); /* the assignment as given, for messages */
    char *eq = strchr(shown, '=');
    char *dot = eq ? memchr(shown, '.', (size_t)(eq - shown)) : NULL;
    if (!eq || !dot) {
        moe_log("--set %s: expected section.key=value (such as model.top_k=2)", what);
        goto done;
    }
    *eq = '\0';
    *dot = '\0';
    char *section = trim(shown), *key = trim(dot + 1), *value = trim(eq + 1);
    if (find_section(section) < 0) {
        char hint[64];
        suggest_section(section, hint, sizeof hint);
        moe_log("--set %s: unknown section [%s]%s", what, section, hint);
        goto done;
    }
    int i = find_key(section, key);
    if (i < 0) {
        char hint[96];
        suggest_key(section, key, hint, sizeof hint);
        moe_log("--set %s: [%s] unknown key '%s'%s", what, section, key, hint);
        goto done;
    }
    moe_config *tmp = malloc(sizeof *tmp);
    if (!tmp) {
        moe_log("--set %s: out of memory", what);
        status = MOE_ERR_NOMEM;
        goto done;
    }
    *tmp = *cfg;
    char why[256];
    if (apply_value(tmp, i, value, why, sizeof why)) {
        tmp->key_line[i] = -1;
        *cfg = *tmp;
        status = MOE_OK;
    } else {
        moe_log("--set %s: %s", what, why);
    }
    free(tmp);
done:
    free(copy);
    return status;
}

/* ---- validation ---- */

/* "[model] experts = 8 (line 7)" for the other key of a rule. */
static void describe(const moe_config *cfg, int i, char *buf, size_t cap)
{
    char v[MOE_PATH_MAX];
    format_value(cfg, i, v, sizeof v);
    int line = cfg->key_line[i];
    char from[32];
    if (line > 0)
        snprintf(from, sizeof from, "line %d", line);
    else
        snprintf(from, sizeof from, "%s", line < 0 ? "--set" : "default");
    snprintf(buf, cap, "[%s] %s = %s (%s)", keys[i].section, keys[i].key, *v ? v : "\"\"", from);
}

/* Logs key i's failure where it was set: "path:line: [section] key = value: why",
 * "--set section.key=value: why", or without a place for a default (or a value the
 * program set itself). */
static void report(const moe_config *cfg, int i, const char *why)
{
    char v[MOE_PATH_MAX];
    format_value(cfg, i, v, sizeof v);
    int line = cfg->key_line[i];
    if (line < 0)
        moe_log("--set %s=%s: %s", keys[i].full, v, why);
    else if (line > 0)
        moe_log("%s:%d: [%s] %s = %s: %s", cfg->source_path, line, keys[i].section, keys[i].key,
                *v ? v : "\"\"", why);
    else
        moe_log("[%s] %s = %s: %s", keys[i].section, keys[i].key, *v ? v : "\"\"", why);
}

static int key_index(const char *full)
{
    for (int i = 0; i < N_KEYS; i++)
        if (strcmp(keys[i].full, full) == 0)
            return i;
    return -1;
}

/* A rule between keys a and b failed: blame the one set last (--set after any file
 * line, a later line after an earlier one; a tie blames a), naming the other. */
static void rule_failed(const moe_config *cfg, const char *a_name, const char *b_name,
                        const char *why_a, const char *why_b)
{
    int a = key_index(a_name), b = key_index(b_name);
    int la = cfg->key_line[a] < 0 ? INT_MAX : cfg->key_line[a];
    int lb = cfg->key_line[b] < 0 ? INT_MAX : cfg->key_line[b];
    int blame = lb > la ? b : a, other = blame == a ? b : a;
    char other_text[MOE_PATH_MAX + 64], why[MOE_PATH_MAX + 320];
    describe(cfg, other, other_text, sizeof other_text);
    snprintf(why, sizeof why, "%s %s", blame == a ? why_a : why_b, other_text);
    report(cfg, blame, why);
}

moe_status moe_config_validate(const moe_config *cfg)
{
    int bad = 0;
    char why[256];
    for (int i = 0; i < N_KEYS; i++)
        if (!check_key(cfg, i, why, sizeof why)) {
            report(cfg, i, why);
            bad++;
        }
    if (bad) /* the rules below divide by keys checked above */
        return MOE_ERR_INVALID;

    if (cfg->d_model % cfg->n_heads != 0) {
        rule_failed(cfg, "model.n_heads", "model.d_model", "does not divide",
                    "is not a multiple of");
        bad++;
    } else if ((cfg->d_model / cfg->n_heads) % 2 != 0) {
        snprintf(why, sizeof why, "gives an odd head dimension %d (RoPE needs it even) with",
                 cfg->d_model / cfg->n_heads);
        rule_failed(cfg, "model.n_heads", "model.d_model", why, why);
        bad++;
    }
    if (cfg->top_k > cfg->experts) {
        rule_failed(cfg, "model.top_k", "model.experts", "exceeds", "is less than");
        bad++;
    }
    if (cfg->dense_layers > cfg->n_layers) {
        rule_failed(cfg, "model.dense_layers", "model.n_layers", "exceeds", "is less than");
        bad++;
    }
    if (cfg->experts % cfg->ep != 0) {
        rule_failed(cfg, "parallel.ep", "model.experts", "does not divide", "is not a multiple of");
        bad++;
    }
    if (cfg->min_lr > cfg->lr) {
        rule_failed(cfg, "train.min_lr", "train.lr", "exceeds", "is less than");
        bad++;
    }
    if (strcmp(cfg->data_source, "shards") == 0 && cfg->data_path[0] == '\0') {
        rule_failed(cfg, "data.source", "data.path", "needs the shard files in",
                    "must name the shard files when");
        bad++;
    }
    if (strcmp(cfg->placement, "auto") == 0 && cfg->replan_interval == 0) {
        rule_failed(cfg, "parallel.placement", "parallel.replan_interval",
                    "= auto re-plans every replan_interval steps, so it needs", "must be > 0 with");
        bad++;
    }
    if (strcmp(cfg->a2a_chunks, "auto") != 0) {
        char *end = NULL;
        long n = strtol(cfg->a2a_chunks, &end, 10);
        if (end == cfg->a2a_chunks || *end != '\0' || n < 1 || n > cfg->micro_batch) {
            report(cfg, key_index("parallel.a2a_chunks"),
                   "must be auto or a whole number from 1 to train.micro_batch");
            bad++;
        } else if (cfg->micro_batch % n != 0) {
            rule_failed(cfg, "parallel.a2a_chunks", "train.micro_batch", "does not divide",
                        "is not a multiple of");
            bad++;
        }
    }
    if (strcmp(cfg->backend, "cpu") == 0 &&
        (strcmp(cfg->precision, "bf16") == 0 || strcmp(cfg->precision, "fp16") == 0)) {
        rule_failed(cfg, "precision.mode", "parallel.backend",
                    "needs a GPU (the CPU path is fp32 only), not", "runs fp32 only, not");
        bad++;
    }
    if (strcmp(cfg->master_weights, "bf16") == 0 && strcmp(cfg->precision, "bf16") != 0 &&
        strcmp(cfg->precision, "auto") != 0) {
        rule_failed(cfg, "precision.master_weights", "precision.mode",
                    "= bf16 updates the bf16 GEMM copy of the weights, so it needs bf16 in",
                    "must be bf16 (or auto on sm_80+) with");
        bad++;
    }
    if (strcmp(cfg->expert_grads, "bf16") == 0 && strcmp(cfg->master_weights, "bf16") != 0) {
        rule_failed(cfg, "precision.expert_grads", "precision.master_weights",
                    "= bf16 keeps the gradients of bf16 master weights, so it needs bf16 in",
                    "must be bf16 with");
        bad++;
    }
    return bad ? MOE_ERR_INVALID : MOE_OK;
}

/* ---- queries and output ---- */

int moe_config_accum_at(const moe_config *cfg, int step)
{
    int mb = cfg->n_accum > 0 ? cfg->accum[0].micro_batches : 1;
    for (int p = 1; p < cfg->n_accum && p < MOE_MAX_ACCUM_PHASES; p++)
        if (cfg->accum[p].from_step <= step)
            mb = cfg->accum[p].micro_batches;
    return mb;
}

int moe_config_chunks(const moe_config *cfg, int ep_hosts)
{
    if (strcmp(cfg->a2a_chunks, "auto") == 0) /* a capacity applies per chunk: keep one, so
                                                 that the drops do not depend on ep */
        return cfg->ep > 1 && ep_hosts > 1 && cfg->micro_batch % 2 == 0 && cfg->capacity_factor <= 0
                   ? 2
                   : 1;
    return (int)strtol(cfg->a2a_chunks, NULL, 10);
}

size_t moe_config_to_ini(const moe_config *cfg, char *buf, size_t cap)
{
    size_t len = 0;
    char v[MOE_PATH_MAX];
    if (cap > 0)
        buf[0] = '\0';
    append(buf, cap, &len, "; moe-dist configuration: every key (docs/config.md)\n");
    for (int i = 0; i < N_KEYS; i++) {
        if (i == 0 || strcmp(keys[i].section, keys[i - 1].section) != 0)
            append(buf, cap, &len, "\n[%s]\n", keys[i].section);
        format_value(cfg, i, v, sizeof v);
        append(buf, cap, &len, "; %s\n%s = %s\n", keys[i].doc, keys[i].key, v);
    }
    return len;
}

int moe_config_key_count(void) { return N_KEYS; }

const char *moe_config_key_name(int i) { return i >= 0 && i < N_KEYS ? keys[i].full : NULL; }
