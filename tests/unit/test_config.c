/* tests/unit/test_config.c: runtime/config.c: defaults, configs/tiny.ini, every class of
 * error and its message (file, line, key, reason), --set, rules between keys and whom
 * they blame, the grad_accum schedule, to_ini -> load round trip, and docs/config.md
 * listing every key. Messages are read back from stderr (fd 2 redirected to a file). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/config.h"

#include "tmpdir.h"

/* Writes `text` to tmpdir/name; returns the path (static buffer). */
static const char *write_file(const char *name, const char *text)
{
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
    assert_int_equal(fclose(f), 0);
    return path;
}

#include "capture.h"

static int key_index(const char *full)
{
    for (int i = 0; i < moe_config_key_count(); i++)
        if (strcmp(moe_config_key_name(i), full) == 0)
            return i;
    fail_msg("no key %s", full);
    return -1;
}

static char *ini_of(const moe_config *cfg)
{
    size_t n = moe_config_to_ini(cfg, NULL, 0);
    char *buf = malloc(n + 1);
    assert_non_null(buf);
    assert_int_equal(moe_config_to_ini(cfg, buf, n + 1), n);
    assert_int_equal(strlen(buf), n);
    return buf;
}

/* Asserts that a and b hold the same values and lines (through their INI text, whose
 * doubles are written exactly). */
static void assert_same_config(const moe_config *a, const moe_config *b)
{
    char *ta = ini_of(a), *tb = ini_of(b);
    assert_string_equal(ta, tb);
    free(ta);
    free(tb);
    assert_memory_equal(a->key_line, b->key_line, sizeof a->key_line);
    assert_string_equal(a->source_path, b->source_path);
}

/* ---- defaults and the shipped configs ---- */

static void test_defaults_valid(void **state)
{
    (void)state;
    moe_config cfg;
    memset(&cfg, 0x5a, sizeof cfg);
    moe_config_defaults(&cfg);
    assert_int_equal(moe_config_validate(&cfg), MOE_OK);
    assert_int_equal(cfg.vocab_size, 256);
    assert_int_equal(cfg.d_model, 64);
    assert_int_equal(cfg.n_layers, 2);
    assert_int_equal(cfg.n_heads, 4);
    assert_int_equal(cfg.seq_len, 64);
    assert_int_equal(cfg.experts, 8);
    assert_int_equal(cfg.top_k, 2);
    assert_int_equal(cfg.expert_hidden, 128);
    assert_int_equal(cfg.dense_layers, 0);
    assert_int_equal(cfg.dense_hidden, 256);
    assert_int_equal(cfg.shared_experts, 0);
    assert_int_equal(cfg.renorm_topk, 1);
    assert_true(cfg.capacity_factor == 0.0);
    assert_true(cfg.aux_loss_coef == 0.01);
    assert_true(cfg.z_loss_coef == 0.001);
    assert_true(cfg.rope_theta == 10000.0);
    assert_true(cfg.norm_eps == 1e-5);
    assert_true(cfg.init_std == 0.02);
    assert_int_equal(cfg.steps, 100);
    assert_int_equal(cfg.micro_batch, 8);
    assert_int_equal(cfg.n_accum, 1);
    assert_int_equal(cfg.accum[0].from_step, 0);
    assert_int_equal(cfg.accum[0].micro_batches, 1);
    assert_true(cfg.lr == 3e-4);
    assert_true(cfg.min_lr == 3e-5);
    assert_int_equal(cfg.warmup_steps, 10);
    assert_true(cfg.weight_decay == 0.1);
    assert_true(cfg.beta1 == 0.9);
    assert_true(cfg.beta2 == 0.95);
    assert_true(cfg.adam_eps == 1e-8);
    assert_true(cfg.grad_clip == 1.0);
    assert_true(cfg.seed == 1234);
    assert_int_equal(cfg.ep, 1);
    assert_string_equal(cfg.backend, "auto");
    assert_string_equal(cfg.data_source, "synthetic");
    assert_string_equal(cfg.data_path, "");
    assert_string_equal(cfg.synthetic, "processes");
    assert_int_equal(cfg.synthetic_processes, 4);
    assert_true(cfg.data_seed == 42);
    assert_string_equal(cfg.precision, "fp32");
    assert_string_equal(cfg.ckpt_dir, "runs/ckpt");
    assert_int_equal(cfg.ckpt_interval, 0);
    assert_int_equal(cfg.ckpt_keep, 2);
    assert_int_equal(cfg.log_interval, 1);
    assert_int_equal(cfg.expert_load_interval, 50);
    assert_string_equal(cfg.jsonl_path, "");
    assert_string_equal(cfg.source_path, "");
    for (int i = 0; i < MOE_CONFIG_MAX_KEYS; i++)
        assert_int_equal(cfg.key_line[i], 0);
}

static void test_key_names(void **state)
{
    (void)state;
    int n = moe_config_key_count();
    assert_true(n > 40 && n <= MOE_CONFIG_MAX_KEYS);
    for (int i = 0; i < n; i++) {
        const char *name = moe_config_key_name(i);
        assert_non_null(name);
        const char *dot = strchr(name, '.');
        assert_non_null(dot);
        assert_true(dot > name && dot[1] != '\0' && !strchr(dot + 1, '.'));
        for (int j = 0; j < i; j++)
            assert_string_not_equal(name, moe_config_key_name(j));
    }
    assert_null(moe_config_key_name(-1));
    assert_null(moe_config_key_name(n));
}

/* Line (1-based) of the first line of `path` that starts with `prefix`, or 0. */
static int line_of(const char *path, const char *prefix)
{
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[512];
    int n = 0, found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        n++;
        if (strncmp(line, prefix, strlen(prefix)) == 0)
            found = n;
    }
    fclose(f);
    return found;
}

static void test_tiny_ini(void **state)
{
    (void)state;
    const char *path = MOE_SOURCE_DIR "/configs/tiny.ini";
    moe_config cfg;
    moe_config_defaults(&cfg);
    assert_int_equal(moe_config_load(&cfg, path), MOE_OK);
    assert_int_equal(moe_config_validate(&cfg), MOE_OK);
    assert_string_equal(cfg.source_path, path);
    assert_int_equal(cfg.n_layers, 3);
    assert_int_equal(cfg.dense_layers, 1);
    assert_int_equal(cfg.steps, 150);
    assert_true(cfg.lr == 3e-3);
    assert_true(cfg.min_lr == 3e-4);
    assert_int_equal(cfg.warmup_steps, 15);
    int line = line_of(path, "n_layers");
    assert_true(line > 0);
    assert_int_equal(cfg.key_line[key_index("model.n_layers")], line);
    assert_int_equal(cfg.key_line[key_index("model.rope_theta")], 0); /* not in the file */

    /* The embedded copy is the same file. */
    moe_config emb;
    moe_config_defaults(&emb);
    assert_int_equal(moe_config_load_string(&emb, moe_config_tiny_ini, path), MOE_OK);
    assert_same_config(&cfg, &emb);
}

/* ---- errors while loading ---- */

typedef struct {
    const char *text;
    int line;
    const char *needle[3]; /* beyond "FILE:LINE:" */
} load_case;

static const load_case load_errors[] = {
    /* sections and keys */
    {"[model]\nd_model = 64\n[foo]\nx = 1\n", 3, {"unknown section [foo]"}},
    {"[model]\nd_model = 64\n\n[modle]\n", 4, {"unknown section [modle]", "did you mean [model]"}},
    {"[model]\ntop_kk = 2\n", 2, {"[model] unknown key 'top_kk'", "did you mean 'top_k'"}},
    {"[model]\n\nlr = 0.1\n", 3, {"[model] unknown key 'lr'", "[train] lr"}},
    {"d_model = 64\n[model]\n", 1, {"d_model = 64", "before any [section]"}},
    {"[model]\nthis is not a key\n", 2, {"this is not a key", "expected 'key = value'"}},
    {"[model\nd_model = 64\n", 1, {"[model", "expected [section]"}},
    {"[model] x\n", 1, {"[model]", "unexpected text 'x'"}},
    {"[model]\n= 64\n", 2, {"[model]", "missing key name"}},
    /* types */
    {"[model]\n\nd_model = abc\n", 3, {"[model] d_model = abc: expected an integer"}},
    {"[model]\nd_model = 64x\n", 2, {"[model] d_model = 64x: expected an integer"}},
    {"[model]\nd_model = 6.5\n", 2, {"[model] d_model = 6.5: expected an integer"}},
    {"[model]\nd_model = 99999999999\n", 2, {"[model] d_model = 99999999999", "32 bits"}},
    {"[train]\nlr = fast\n", 2, {"[train] lr = fast: expected a number"}},
    {"[train]\nlr = 1e999\n", 2, {"[train] lr = 1e999", "finite"}},
    {"[train]\nlr = nan\n", 2, {"[train] lr = nan", "finite"}},
    {"[model]\nrenorm_topk = maybe\n", 2, {"[model] renorm_topk = maybe: expected true or false"}},
    {"[train]\nseed = -1\n", 2, {"[train] seed = -1: expected an unsigned integer"}},
    {"[data]\nseed = 18446744073709551616\n", 2, {"[data] seed = 18446744073709551616", "2^64"}},
    {"[parallel]\nbackend = tpu\n", 2, {"[parallel] backend = tpu", "auto, cpu, cuda"}},
    {"[precision]\nmode = fp64\n", 2, {"[precision] mode = fp64", "fp32, bf16, fp16, auto"}},
    {"[data]\nsynthetic = words\n", 2, {"[data] synthetic = words", "processes, topics"}},
    /* ranges */
    {"[model]\ntop_k = 0\n", 2, {"[model] top_k = 0: must be >= 1"}},
    {"[model]\nvocab_size = 1\n", 2, {"[model] vocab_size = 1: must be >= 2"}},
    {"[data]\nsynthetic_processes = 65\n", 2, {"synthetic_processes = 65: must be in [1, 64]"}},
    {"[train]\nbeta1 = 1\n", 2, {"[train] beta1 = 1: must be in [0, 1)"}},
    {"[train]\nlr = 0\n", 2, {"[train] lr = 0: must be > 0"}},
    {"[model]\ncapacity_factor = -0.5\n", 2, {"capacity_factor = -0.5: must be >= 0"}},
    {"[checkpoint]\nkeep = 1\n", 2, {"[checkpoint] keep = 1: must be >= 2"}},
    {"[log]\ninterval = 0\n", 2, {"[log] interval = 0: must be >= 1"}},
    /* grad_accum */
    {"[train]\ngrad_accum = 8@5\n", 2, {"grad_accum = 8@5", "first phase must start at step 0"}},
    {"[train]\ngrad_accum = 8@0,4@0\n", 2, {"grad_accum = 8@0,4@0", "phase 2 (4@0) must start"}},
    {"[train]\ngrad_accum = 8@0,4@100,2@50\n", 2, {"grad_accum", "phase 3 (2@50) must start"}},
    {"[train]\ngrad_accum = 8@0,,4@10\n", 2, {"grad_accum = 8@0,,4@10", "empty phase 2"}},
    {"[train]\ngrad_accum = 8@0,x@10\n", 2, {"grad_accum = 8@0,x@10", "'x@10' is not N or N@STEP"}},
    {"[train]\ngrad_accum = 8@\n", 2, {"grad_accum = 8@", "is not N or N@STEP"}},
    {"[train]\ngrad_accum = 0\n", 2, {"grad_accum = 0", "micro-batches must be >= 1"}},
    {"[train]\ngrad_accum =\n", 2, {"[train] grad_accum = : expected N or a schedule"}},
    {"[train]\ngrad_accum = 1@0,1@1,1@2,1@3,1@4,1@5,1@6,1@7,1@8,1@9,1@10,1@11,1@12,1@13,"
     "1@14,1@15,1@16\n",
     2,
     {"grad_accum", "more than 16 phases"}},
};

static void check_load_error(const load_case *c, int index)
{
    char name[32];
    snprintf(name, sizeof name, "err%d.ini", index);
    const char *path = write_file(name, c->text);
    char path_copy[512];
    snprintf(path_copy, sizeof path_copy, "%s", path);

    moe_config cfg, before;
    moe_config_defaults(&cfg);
    before = cfg;
    capture_begin();
    moe_status st = moe_config_load(&cfg, path_copy);
    const char *msg = capture_end();
    if (st != MOE_ERR_INVALID)
        fail_msg("case %d (%s): status %d, expected MOE_ERR_INVALID", index, c->text, st);
    char where[600];
    snprintf(where, sizeof where, "%s:%d: ", path_copy, c->line);
    assert_has(msg, where);
    for (int k = 0; k < 3 && c->needle[k]; k++)
        assert_has(msg, c->needle[k]);
    assert_same_config(&cfg, &before); /* a failed load changes nothing */
}

static void test_load_errors(void **state)
{
    (void)state;
    for (int i = 0; i < (int)(sizeof load_errors / sizeof load_errors[0]); i++)
        check_load_error(&load_errors[i], i);
}

static void test_missing_file(void **state)
{
    (void)state;
    char path[512];
    snprintf(path, sizeof path, "%s/no-such-config.ini", tmpdir);
    moe_config cfg;
    moe_config_defaults(&cfg);
    capture_begin();
    moe_status st = moe_config_load(&cfg, path);
    const char *msg = capture_end();
    assert_int_equal(st, MOE_ERR_IO);
    assert_has(msg, path);
    assert_has(msg, "No such file or directory");
}

/* Comments, blanks, CRLF, a byte-order mark, indented keys, ':' separators, repeats. */
static void test_ini_syntax(void **state)
{
    (void)state;
    const char *path = write_file("syntax.ini", "\xEF\xBB\xBF; comment\r\n"
                                                "# another\r\n"
                                                "[ model ]\r\n"
                                                "  d_model = 32 ; inline comment\r\n"
                                                "\tn_heads: 2\r\n"
                                                "\r\n"
                                                "[train]\n"
                                                "lr = 0.5\n"
                                                "steps = 7\n"
                                                "lr = 0.25\n");
    moe_config cfg;
    moe_config_defaults(&cfg);
    assert_int_equal(moe_config_load(&cfg, path), MOE_OK);
    assert_int_equal(cfg.d_model, 32);
    assert_int_equal(cfg.n_heads, 2);
    assert_int_equal(cfg.steps, 7);
    assert_true(cfg.lr == 0.25);
    assert_int_equal(cfg.key_line[key_index("model.d_model")], 4);
    assert_int_equal(cfg.key_line[key_index("model.n_heads")], 5);
    assert_int_equal(cfg.key_line[key_index("train.lr")], 10);
    assert_int_equal(cfg.key_line[key_index("train.steps")], 9);
    assert_int_equal(cfg.key_line[key_index("model.top_k")], 0);

    /* Lines longer than inih's buffer (200 bytes): a long shard list still loads. */
    char text[3000], list[2200];
    size_t len = 0;
    for (int s = 0; s < 40; s++)
        len += (size_t)snprintf(list + len, sizeof list - len, "%sdata/shard_%03d.bin",
                                s ? "," : "", s);
    snprintf(text, sizeof text, "[data]\nsource = shards\npath = %s ; forty shards\nseed = 5\n",
             list);
    path = write_file("long.ini", text);
    moe_config_defaults(&cfg);
    assert_int_equal(moe_config_load(&cfg, path), MOE_OK);
    assert_string_equal(cfg.data_path, list);
    assert_true(cfg.data_seed == 5);
    assert_int_equal(cfg.key_line[key_index("data.path")], 3);
    assert_int_equal(cfg.key_line[key_index("data.seed")], 4);
    assert_int_equal(moe_config_validate(&cfg), MOE_OK);

    /* ... and one longer than the field is an error naming it. */
    char huge[MOE_PATH_MAX + 200];
    memset(huge, 'x', sizeof huge - 1);
    huge[sizeof huge - 1] = '\0';
    snprintf(text, sizeof text, "[data]\n\npath = %s\n", huge);
    path = write_file("huge.ini", text);
    char path_copy[512];
    snprintf(path_copy, sizeof path_copy, "%s:3: [data] path = xxx", path);
    moe_config_defaults(&cfg);
    capture_begin();
    moe_status st = moe_config_load(&cfg, path);
    const char *msg = capture_end();
    assert_int_equal(st, MOE_ERR_INVALID);
    assert_has(msg, path_copy);
    assert_has(msg, "too long (at most 1023 characters)");

    /* An inline comment ends a value; ';' without a blank before it does not. */
    path = write_file("semi.ini", "[log]\njsonl = out;1.jsonl ; the metrics\n");
    moe_config_defaults(&cfg);
    assert_int_equal(moe_config_load(&cfg, path), MOE_OK);
    assert_string_equal(cfg.jsonl_path, "out;1.jsonl");
}

/* ---- --set ---- */

static void test_set(void **state)
{
    (void)state;
    moe_config cfg;
    moe_config_defaults(&cfg);
    assert_int_equal(moe_config_set(&cfg, "model.top_k=4"), MOE_OK);
    assert_int_equal(cfg.top_k, 4);
    assert_int_equal(cfg.key_line[key_index("model.top_k")], -1);
    assert_int_equal(moe_config_set(&cfg, " train.lr = 0.125 "), MOE_OK);
    assert_true(cfg.lr == 0.125);
    assert_int_equal(moe_config_set(&cfg, "data.path=a b/c=d.bin"), MOE_OK);
    assert_string_equal(cfg.data_path, "a b/c=d.bin");
    assert_int_equal(moe_config_set(&cfg, "model.renorm_topk=no"), MOE_OK);
    assert_int_equal(cfg.renorm_topk, 0);

    /* A file's values are overridden, and its other lines kept. */
    const char *path = write_file("set.ini", "[model]\nexperts = 16\ntop_k = 1\n");
    moe_config_defaults(&cfg);
    assert_int_equal(moe_config_load(&cfg, path), MOE_OK);
    assert_int_equal(moe_config_set(&cfg, "model.top_k=3"), MOE_OK);
    assert_int_equal(cfg.top_k, 3);
    assert_int_equal(cfg.key_line[key_index("model.top_k")], -1);
    assert_int_equal(cfg.key_line[key_index("model.experts")], 2);
    assert_int_equal(moe_config_validate(&cfg), MOE_OK);

    static const struct {
        const char *set, *needle;
    } bad[] = {
        {"model.top_k=abc", "--set model.top_k=abc: expected an integer"},
        {"model.top_k=0", "--set model.top_k=0: must be >= 1"},
        {"model.nope=1", "--set model.nope=1: [model] unknown key 'nope'"},
        {"model.lr=1", "did you mean [train] lr?"},
        {"foo.bar=1", "--set foo.bar=1: unknown section [foo]"},
        {"model.top_k", "--set model.top_k: expected section.key=value"},
        {"top_k=2", "--set top_k=2: expected section.key=value"},
        {"train.grad_accum=4@0,2@0", "--set train.grad_accum=4@0,2@0: phase 2 (2@0)"},
        {"parallel.backend=gpu", "--set parallel.backend=gpu: expected one of auto, cpu, cuda"},
        {"log.jsonl=a ;b", "--set log.jsonl=a ;b: contains ' ;'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        moe_config before = cfg;
        capture_begin();
        moe_status st = moe_config_set(&cfg, bad[i].set);
        const char *msg = capture_end();
        assert_int_equal(st, MOE_ERR_INVALID);
        assert_has(msg, bad[i].needle);
        assert_same_config(&cfg, &before);
    }
}

/* ---- rules between keys ---- */

typedef struct {
    const char *text; /* INI file */
    const char *set;  /* then this --set, or NULL */
    const char *needle[3];
} rule_case;

static const rule_case rule_errors[] = {
    {"[train]\nmicro_batch = 4\n[parallel]\na2a_chunks = 3\n",
     NULL,
     {"R.ini:4: [parallel] a2a_chunks = 3: does not divide [train] micro_batch = 4 (line 2)"}},
    {"[parallel]\na2a_chunks = two\n",
     NULL,
     {"R.ini:2: [parallel] a2a_chunks = two: must be auto or a whole number from 1 to "
      "train.micro_batch"}},
    {"[parallel]\na2a_chunks = 0\n", NULL, {"R.ini:2: [parallel] a2a_chunks = 0: must be auto"}},
    {"[parallel]\na2a_chunks = 16\n", NULL, {"R.ini:2: [parallel] a2a_chunks = 16: must be auto"}},
    {"[model]\nexperts = 8\ntop_k = 9\n",
     NULL,
     {"R.ini:3: [model] top_k = 9: exceeds [model] experts = 8 (line 2)"}},
    {"[model]\ntop_k = 4\nexperts = 2\n",
     NULL,
     {"R.ini:3: [model] experts = 2: is less than [model] top_k = 4 (line 2)"}},
    {"[model]\nexperts = 8\n",
     "model.top_k=9",
     {"--set model.top_k=9: exceeds [model] experts = 8 (line 2)"}},
    {"[model]\nd_model = 64\nn_heads = 3\n",
     NULL,
     {"R.ini:3: [model] n_heads = 3: does not divide [model] d_model = 64 (line 2)"}},
    {"[model]\nn_heads = 4\n\nd_model = 12\n",
     NULL,
     {"R.ini:4: [model] d_model = 12: gives an odd head dimension 3", "n_heads = 4 (line 2)"}},
    {"[model]\nn_layers = 2\ndense_layers = 3\n",
     NULL,
     {"R.ini:3: [model] dense_layers = 3: exceeds [model] n_layers = 2 (line 2)"}},
    {"[model]\nexperts = 6\n[parallel]\nep = 4\n",
     NULL,
     {"R.ini:4: [parallel] ep = 4: does not divide [model] experts = 6 (line 2)"}},
    {"[train]\nmin_lr = 0.5\n",
     NULL,
     {"R.ini:2: [train] min_lr = 0.5: exceeds [train] lr = 0.0003 (default)"}},
    {"[train]\nmin_lr = 0.01\n",
     "train.lr=0.001",
     {"--set train.lr=0.001: is less than [train] min_lr = 0.01 (line 2)"}},
    {"[data]\nsource = shards\n",
     NULL,
     {"R.ini:2: [data] source = shards: needs the shard files in [data] path = \"\""}},
    {"[precision]\nmode = bf16\n[parallel]\nbackend = cpu\n",
     NULL,
     {"R.ini:4: [parallel] backend = cpu: runs fp32 only, not [precision] mode = bf16 (line 2)"}},
    {"[precision]\nmaster_weights = bf16\n",
     NULL,
     {"R.ini:2: [precision] master_weights = bf16: = bf16 updates the bf16 GEMM copy",
      "needs bf16 in [precision] mode = fp32 (default)"}},
    {"[precision]\nmaster_weights = bf16\nmode = fp16\n",
     NULL,
     {"R.ini:3: [precision] mode = fp16: must be bf16 (or auto on sm_80+) with [precision] "
      "master_weights = bf16 (line 2)"}},
    {"[precision]\nmode = bf16\nexpert_grads = bf16\n",
     NULL,
     {"R.ini:3: [precision] expert_grads = bf16: = bf16 keeps the gradients of bf16 master",
      "needs bf16 in [precision] master_weights = fp32 (default)"}},
    {"[precision]\nmode = bf16\nexpert_grads = bf16\nmaster_weights = fp32\n",
     NULL,
     {"R.ini:4: [precision] master_weights = fp32: must be bf16 with [precision] "
      "expert_grads = bf16 (line 3)"}},
};

static void test_rules(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof rule_errors / sizeof rule_errors[0]; i++) {
        const rule_case *c = &rule_errors[i];
        const char *path = write_file("R.ini", c->text);
        moe_config cfg;
        moe_config_defaults(&cfg);
        assert_int_equal(moe_config_load(&cfg, path), MOE_OK);
        if (c->set)
            assert_int_equal(moe_config_set(&cfg, c->set), MOE_OK);
        capture_begin();
        moe_status st = moe_config_validate(&cfg);
        const char *msg = capture_end();
        if (st != MOE_ERR_INVALID)
            fail_msg("rule case %zu: validate returned %d", i, st);
        for (int k = 0; k < 3 && c->needle[k]; k++)
            assert_has(msg, c->needle[k]);
    }

    /* A value set by the program (no line) is still checked and named. */
    moe_config cfg;
    moe_config_defaults(&cfg);
    cfg.top_k = 0;
    capture_begin();
    moe_status st = moe_config_validate(&cfg);
    const char *msg = capture_end();
    assert_int_equal(st, MOE_ERR_INVALID);
    assert_has(msg, "[model] top_k = 0: must be >= 1");
    moe_config_defaults(&cfg);
    cfg.n_accum = 0;
    capture_begin();
    st = moe_config_validate(&cfg);
    capture_end();
    assert_int_equal(st, MOE_ERR_INVALID);
}

/* ---- a2a_chunks ---- */

static void test_chunks(void **state)
{
    (void)state;
    moe_config cfg;
    moe_config_defaults(&cfg);
    cfg.micro_batch = 4;
    assert_int_equal(moe_config_chunks(&cfg, 1), 1); /* auto, ep 1: nothing is exchanged */
    cfg.ep = 2;
    assert_int_equal(moe_config_chunks(&cfg, 1), 1); /* one host: the exchange is short */
    assert_int_equal(moe_config_chunks(&cfg, 2), 2); /* across hosts */
    cfg.micro_batch = 3;
    assert_int_equal(moe_config_chunks(&cfg, 2), 1); /* odd: no two equal chunks */
    cfg.micro_batch = 4;
    cfg.capacity_factor = 1.25;
    assert_int_equal(moe_config_chunks(&cfg, 2), 1); /* a capacity is per chunk: keep one */
    assert_int_equal(moe_config_set(&cfg, "parallel.a2a_chunks=4"), MOE_OK);
    assert_int_equal(moe_config_validate(&cfg), MOE_OK);
    assert_int_equal(moe_config_chunks(&cfg, 1), 4);
}

/* ---- grad_accum ---- */

static void test_accum_schedule(void **state)
{
    (void)state;
    moe_config cfg;
    moe_config_defaults(&cfg);
    assert_int_equal(moe_config_accum_at(&cfg, 0), 1);
    assert_int_equal(moe_config_accum_at(&cfg, 1000000), 1);

    assert_int_equal(moe_config_set(&cfg, "train.grad_accum=8@0,4@1000"), MOE_OK);
    assert_int_equal(cfg.n_accum, 2);
    assert_int_equal(moe_config_accum_at(&cfg, 0), 8);
    assert_int_equal(moe_config_accum_at(&cfg, 999), 8);
    assert_int_equal(moe_config_accum_at(&cfg, 1000), 4);
    assert_int_equal(moe_config_accum_at(&cfg, 50000), 4);

    assert_int_equal(moe_config_set(&cfg, "train.grad_accum= 16 @ 0 , 2@10 ,1@20"), MOE_OK);
    assert_int_equal(cfg.n_accum, 3);
    assert_int_equal(moe_config_accum_at(&cfg, 9), 16);
    assert_int_equal(moe_config_accum_at(&cfg, 10), 2);
    assert_int_equal(moe_config_accum_at(&cfg, 19), 2);
    assert_int_equal(moe_config_accum_at(&cfg, 20), 1);

    assert_int_equal(moe_config_set(&cfg, "train.grad_accum=3"), MOE_OK);
    assert_int_equal(cfg.n_accum, 1);
    assert_int_equal(moe_config_accum_at(&cfg, 0), 3);
    assert_int_equal(moe_config_accum_at(&cfg, 123456), 3);

    /* 16 phases fit. */
    assert_int_equal(moe_config_set(&cfg, "train.grad_accum=1@0,1@1,1@2,1@3,1@4,1@5,1@6,1@7,"
                                          "1@8,1@9,1@10,1@11,1@12,1@13,1@14,9@15"),
                     MOE_OK);
    assert_int_equal(cfg.n_accum, MOE_MAX_ACCUM_PHASES);
    assert_int_equal(moe_config_accum_at(&cfg, 15), 9);
    assert_int_equal(moe_config_accum_at(&cfg, 14), 1);
}

/* ---- to_ini ---- */

static void test_round_trip(void **state)
{
    (void)state;
    static const char *const sets[] = {
        "model.vocab_size=1000",
        "model.d_model=96",
        "model.n_layers=5",
        "model.n_heads=6",
        "model.seq_len=33",
        "model.experts=12",
        "model.top_k=3",
        "model.expert_hidden=77",
        "model.dense_layers=2",
        "model.dense_hidden=300",
        "model.shared_experts=1",
        "model.renorm_topk=false",
        "model.capacity_factor=1.25",
        "model.aux_loss_coef=0.30000000000000004",
        "model.z_loss_coef=1e-300",
        "model.rope_theta=500000",
        "model.norm_eps=1e-6",
        "model.init_std=0.006",
        "model.router_init_std=0.5",
        "train.steps=12345",
        "train.micro_batch=3",
        "train.grad_accum=8@0,4@1000",
        "train.lr=0.1",
        "train.min_lr=0",
        "train.warmup_steps=0",
        "train.weight_decay=0",
        "train.beta1=0",
        "train.beta2=0.999",
        "train.adam_eps=1e-10",
        "train.grad_clip=0",
        "train.seed=18446744073709551615",
        "parallel.ep=4",
        "parallel.backend=cuda",
        "parallel.comm_timeout_s=5.5",
        "parallel.bind=numa",
        "precision.loss_scale_init=1024",
        "precision.loss_scale_growth_interval=50",
        "precision.loss_scale_growth=4",
        "precision.loss_scale_backoff=0.25",
        "parallel.placement=plan.txt",
        "parallel.replan_interval=7",
        "parallel.a2a_chunks=3",
        "parallel.exchange_repeat=2",
        "log.routing_stats=stats.txt",
        "data.source=shards",
        "data.path=/data/my shards/a.bin,b#1.bin,c;d.bin",
        "data.synthetic=topics",
        "data.synthetic_processes=64",
        "data.seed=0",
        "precision.mode=bf16",
        "precision.optimizer_state=bf16",
        "precision.master_weights=bf16",
        "precision.expert_grads=bf16",
        "checkpoint.dir=/scratch/ckpt dir",
        "checkpoint.interval=500",
        "checkpoint.interval_minutes=30",
        "checkpoint.keep=5",
        "log.interval=10",
        "log.expert_load_interval=0",
        "log.jsonl=runs/x.jsonl",
    };
    moe_config a;
    moe_config_defaults(&a);
    char *defaults = ini_of(&a);
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        assert_int_equal(moe_config_set(&a, sets[i]), MOE_OK);
    assert_int_equal(moe_config_validate(&a), MOE_OK);
    /* every key was changed, so the round trip below tests every key */
    for (int i = 0; i < moe_config_key_count(); i++)
        if (a.key_line[i] != -1)
            fail_msg("the round trip does not set %s", moe_config_key_name(i));

    char *text = ini_of(&a);
    assert_string_not_equal(text, defaults);
    for (int i = 0; i < moe_config_key_count(); i++) { /* "\nkey = " under its section */
        const char *name = moe_config_key_name(i), *dot = strchr(name, '.');
        char header[64], line[64];
        snprintf(header, sizeof header, "\n[%.*s]\n", (int)(dot - name), name);
        snprintf(line, sizeof line, "\n%s = ", dot + 1);
        const char *sec = strstr(text, header);
        assert_non_null(sec);
        const char *next = strstr(sec + 1, "\n[");
        const char *at = strstr(sec, line);
        if (!at || (next && at > next))
            fail_msg("to_ini has no line for %s", name);
    }
    const char *path = write_file("round.ini", text);
    moe_config b;
    moe_config_defaults(&b);
    assert_int_equal(moe_config_load(&b, path), MOE_OK);
    char *text_b = ini_of(&b);
    assert_string_equal(text, text_b);
    assert_true(b.aux_loss_coef == a.aux_loss_coef);
    assert_true(b.z_loss_coef == 1e-300);
    assert_true(b.seed == UINT64_MAX);
    assert_string_equal(b.data_path, a.data_path);
    assert_string_equal(b.ckpt_dir, "/scratch/ckpt dir");
    assert_int_equal(b.n_accum, 2);
    assert_int_equal(b.accum[1].from_step, 1000);
    assert_int_equal(b.renorm_topk, 0);
    assert_int_equal(moe_config_validate(&b), MOE_OK);

    /* like snprintf: a short buffer gets a terminated prefix, the full length returned */
    char small[16];
    assert_int_equal(moe_config_to_ini(&a, small, sizeof small), strlen(text));
    assert_int_equal(strlen(small), sizeof small - 1);
    assert_memory_equal(small, text, sizeof small - 1);
    free(defaults);
    free(text);
    free(text_b);
}

/* ---- docs ---- */

static void test_docs_list_every_key(void **state)
{
    (void)state;
    FILE *f = fopen(MOE_SOURCE_DIR "/docs/config.md", "rb");
    assert_non_null(f);
    static char doc[65536];
    size_t n = fread(doc, 1, sizeof doc - 1, f);
    fclose(f);
    doc[n] = '\0';
    for (int i = 0; i < moe_config_key_count(); i++) {
        const char *name = moe_config_key_name(i), *dot = strchr(name, '.');
        char heading[64], cell[64];
        snprintf(heading, sizeof heading, "\n## [%.*s]", (int)(dot - name), name);
        snprintf(cell, sizeof cell, "| `%s` |", dot + 1);
        const char *sec = strstr(doc, heading);
        if (!sec)
            fail_msg("docs/config.md has no heading '%s'", heading + 1);
        const char *next = strstr(sec + 1, "\n## ");
        const char *row = strstr(sec, cell);
        if (!row || (next && row > next))
            fail_msg("docs/config.md does not list %s (a row '%s' under '%s')", name, cell,
                     heading + 1);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults_valid),
        cmocka_unit_test(test_key_names),
        cmocka_unit_test(test_tiny_ini),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_ini_syntax),
        cmocka_unit_test(test_set),
        cmocka_unit_test(test_rules),
        cmocka_unit_test(test_chunks),
        cmocka_unit_test(test_accum_schedule),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_docs_list_every_key),
    };
    return cmocka_run_group_tests(tests, setup_dir, remove_dir);
}
