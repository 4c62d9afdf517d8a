/* tests/unit/test_checkpoint.c: runtime/checkpoint.c in one process (comm NULL): a save
 * and a resume restore every arena bit for bit and the step, data position and optimizer
 * t; retention keeps the newest K; "auto" ignores .tmp directories and falls back past a
 * flipped byte or a truncated manifest; an explicit path with a defect is an error; a
 * different model shape is refused; inspect verifies; export refuses what Mixtral cannot
 * express and writes a well-formed safetensors file. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/checkpoint.h"
#include "runtime/model.h"
#include "runtime/optimizer.h"
#include "util/crc32c.h"
#include "util/rng.h"

#include "tmpdir.h"

/* A small config writing into tmpdir/name. */
static moe_config small_config(const char *name, int dense_layers)
{
    moe_config cfg;
    moe_config_defaults(&cfg);
    cfg.vocab_size = 32;
    cfg.d_model = 16;
    cfg.n_layers = 2;
    cfg.n_heads = 2;
    cfg.seq_len = 8;
    cfg.experts = 4;
    cfg.top_k = 2;
    cfg.expert_hidden = 8;
    cfg.dense_layers = dense_layers;
    cfg.dense_hidden = 12;
    cfg.micro_batch = 2;
    snprintf(cfg.ckpt_dir, sizeof cfg.ckpt_dir, "%s/%s", tmpdir, name);
    cfg.ckpt_keep = 2;
    assert_int_equal(moe_config_validate(&cfg), MOE_OK);
    return cfg;
}

typedef struct {
    moe_model *m;
    moe_optimizer *opt;
} pair;

/* A model whose parameters and moments are all distinct, from `seed` (bf16 moments when
 * cfg says so). */
static pair make_pair(const moe_config *cfg, uint64_t seed)
{
    pair p;
    assert_int_equal(moe_model_create(&p.m, cfg, NULL, NULL), MOE_OK);
    assert_int_equal(moe_optimizer_create(&p.opt, p.m, cfg, p.m->be), MOE_OK);
    for (size_t i = 0; i < p.m->n_params; i++) {
        p.m->params[i] = (real)moe_rng_normal(seed, 1, i);
        const double m = moe_rng_normal(seed, 2, i), v = moe_rng_uniform(seed, 3, i);
        if (p.opt->moments16) {
            ((uint16_t *)p.opt->m)[i] = moe_bf16_round((float)m);
            ((uint16_t *)p.opt->v)[i] = moe_bf16_round((float)v);
        } else {
            ((real *)p.opt->m)[i] = (real)m;
            ((real *)p.opt->v)[i] = (real)v;
        }
    }
    p.opt->t = (int)seed;
    return p;
}

static void free_pair(pair *p)
{
    moe_optimizer_destroy(p->opt);
    moe_model_destroy(p->m);
}

static void save(const moe_config *cfg, pair *p, int64_t step, int64_t consumed)
{
    moe_ckpt_state st = {.step = step, .consumed = consumed};
    char path[2048];
    assert_int_equal(moe_checkpoint_save(cfg, NULL, p->m, p->opt, &st, NULL, path, sizeof path),
                     MOE_OK);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
}

static int exists(const char *dir, const char *name)
{
    char path[2048];
    struct stat sb;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return stat(path, &sb) == 0;
}

/* Flips one byte of a file at offset (from the end when negative). */
static void flip_byte(const char *path, long offset)
{
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, offset, offset < 0 ? SEEK_END : SEEK_SET), 0);
    int c = fgetc(f);
    assert_true(c != EOF);
    assert_int_equal(fseek(f, -1, SEEK_CUR), 0);
    fputc(c ^ 0x40, f);
    assert_int_equal(fclose(f), 0);
}

/* Saves and resumes; moments of elem bytes compared bit for bit. */
static void check_save_resume_exact(moe_config *cfg)
{
    pair a = make_pair(cfg, 11);
    save(cfg, &a, 7, 70);
    pair b = make_pair(cfg, 99);
    moe_ckpt_state st;
    int found = 0;
    char path[2048];
    assert_int_equal(
        moe_checkpoint_resume("auto", cfg, NULL, b.m, b.opt, &st, &found, path, sizeof path),
        MOE_OK);
    assert_int_equal(found, 1);
    assert_int_equal(st.step, 7);
    assert_int_equal(st.consumed, 70);
    assert_int_equal(b.opt->t, 11);
    assert_non_null(strstr(path, "step-00000007"));
    assert_memory_equal(a.m->params, b.m->params, sizeof(real) * a.m->n_params);
    const size_t elem = a.opt->moments16 ? sizeof(uint16_t) : sizeof(real);
    assert_memory_equal(a.opt->m, b.opt->m, elem * a.m->n_params);
    assert_memory_equal(a.opt->v, b.opt->v, elem * a.m->n_params);
    assert_int_equal(moe_checkpoint_inspect(path, stdout), MOE_OK);
    free_pair(&a);
    free_pair(&b);
}

static void test_save_resume_exact(void **state)
{
    (void)state;
    moe_config cfg = small_config("exact", 1);
    check_save_resume_exact(&cfg);
}

/* bf16 moments are written widened to fp32 (the format does not change) and rounded back
 * on resume: exact both ways. */
static void test_save_resume_bf16_moments(void **state)
{
    (void)state;
    moe_config cfg = small_config("exact16", 1);
    snprintf(cfg.optimizer_state, sizeof cfg.optimizer_state, "bf16");
    check_save_resume_exact(&cfg);
}

static void test_keep_and_tmp_ignored(void **state)
{
    (void)state;
    moe_config cfg = small_config("keep", 1);
    cfg.ckpt_keep = 3;
    pair a = make_pair(&cfg, 5);
    for (int s = 1; s <= 5; s++)
        save(&cfg, &a, s, s * 10);
    assert_false(exists(cfg.ckpt_dir, "step-00000001"));
    assert_false(exists(cfg.ckpt_dir, "step-00000002"));
    assert_true(exists(cfg.ckpt_dir, "step-00000003"));
    assert_true(exists(cfg.ckpt_dir, "step-00000005"));
    /* an interrupted save of step 9: never picked, removed by the next save */
    char tmp[2048];
    snprintf(tmp, sizeof tmp, "%s/.tmp-step-00000009", cfg.ckpt_dir);
    assert_int_equal(mkdir(tmp, 0755), 0);
    moe_ckpt_state st;
    int found = 0;
    assert_int_equal(moe_checkpoint_resume("auto", &cfg, NULL, a.m, a.opt, &st, &found, NULL, 0),
                     MOE_OK);
    assert_int_equal(st.step, 5);
    save(&cfg, &a, 6, 60);
    assert_false(exists(cfg.ckpt_dir, ".tmp-step-00000009"));
    /* no checkpoint at all: auto starts fresh */
    moe_config empty = small_config("none", 1);
    assert_int_equal(moe_checkpoint_resume("auto", &empty, NULL, a.m, a.opt, &st, &found, NULL, 0),
                     MOE_OK);
    assert_int_equal(found, 0);
    assert_int_equal(st.step, 0);
    free_pair(&a);
}

static void test_corruption_fallback(void **state)
{
    (void)state;
    moe_config cfg = small_config("corrupt", 1);
    pair a = make_pair(&cfg, 21), b = make_pair(&cfg, 22);
    save(&cfg, &a, 2, 20);
    save(&cfg, &b, 4, 40);
    char file[2100], newest[2048];
    snprintf(newest, sizeof newest, "%s/step-00000004", cfg.ckpt_dir);
    snprintf(file, sizeof file, "%s/rank-00000.bin", newest);
    flip_byte(file, 1000);
    assert_int_equal(moe_checkpoint_inspect(newest, stdout), MOE_ERR_IO);
    pair c = make_pair(&cfg, 23);
    moe_ckpt_state st;
    int found = 0;
    /* the explicit path is an error; the model is untouched */
    pair d = make_pair(&cfg, 23);
    assert_int_equal(moe_checkpoint_resume(newest, &cfg, NULL, c.m, c.opt, &st, &found, NULL, 0),
                     MOE_ERR_IO);
    assert_memory_equal(c.m->params, d.m->params, sizeof(real) * c.m->n_params);
    /* auto falls back to step 2 */
    assert_int_equal(moe_checkpoint_resume("auto", &cfg, NULL, c.m, c.opt, &st, &found, NULL, 0),
                     MOE_OK);
    assert_int_equal(st.step, 2);
    assert_memory_equal(c.m->params, a.m->params, sizeof(real) * c.m->n_params);
    /* a truncated manifest in step 2 as well: nothing usable */
    char manifest[2048];
    snprintf(manifest, sizeof manifest, "%s/step-00000002/manifest.pb", cfg.ckpt_dir);
    assert_int_equal(truncate(manifest, 100), 0);
    snprintf(newest, sizeof newest, "%s/step-00000002", cfg.ckpt_dir);
    assert_int_equal(moe_checkpoint_inspect(newest, stdout), MOE_ERR_IO);
    assert_int_equal(moe_checkpoint_resume("auto", &cfg, NULL, c.m, c.opt, &st, &found, NULL, 0),
                     MOE_ERR_IO);
    free_pair(&a);
    free_pair(&b);
    free_pair(&c);
    free_pair(&d);
}

static void test_shape_mismatch_refused(void **state)
{
    (void)state;
    moe_config cfg = small_config("shape", 1);
    pair a = make_pair(&cfg, 31);
    save(&cfg, &a, 3, 30);
    moe_config other = cfg;
    other.expert_hidden = 16;
    pair b = make_pair(&other, 32);
    moe_ckpt_state st;
    int found = 0;
    assert_int_equal(moe_checkpoint_resume("auto", &other, NULL, b.m, b.opt, &st, &found, NULL, 0),
                     MOE_ERR_INVALID);
    free_pair(&a);
    free_pair(&b);
}

static void test_export(void **state)
{
    (void)state;
    moe_config dense = small_config("export_dense", 1);
    pair a = make_pair(&dense, 41);
    save(&dense, &a, 1, 10);
    char ckpt[2048], out[2048];
    snprintf(ckpt, sizeof ckpt, "%s/step-00000001", dense.ckpt_dir);
    snprintf(out, sizeof out, "%s/hf_dense", tmpdir);
    assert_int_equal(moe_checkpoint_export_safetensors(ckpt, out), MOE_ERR_INVALID);
    free_pair(&a);

    moe_config cfg = small_config("export", 0);
    pair b = make_pair(&cfg, 42);
    save(&cfg, &b, 1, 10);
    snprintf(ckpt, sizeof ckpt, "%s/step-00000001", cfg.ckpt_dir);
    snprintf(out, sizeof out, "%s/hf", tmpdir);
    assert_int_equal(moe_checkpoint_export_safetensors(ckpt, out), MOE_OK);
    char file[2100];
    snprintf(file, sizeof file, "%s/model.safetensors", out);
    FILE *f = fopen(file, "rb");
    assert_non_null(f);
    unsigned char len8[8];
    assert_int_equal(fread(len8, 1, 8, f), 8);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)len8[i] << (8 * i);
    assert_int_equal(hlen % 8, 0);
    char *hdr = calloc(1, hlen + 1);
    assert_non_null(hdr);
    assert_int_equal(fread(hdr, 1, hlen, f), hlen);
    json_error_t err;
    json_t *j = json_loads(hdr, JSON_REJECT_DUPLICATES, &err);
    assert_non_null(j);
    /* the expert 3 w2 of layer 1 is (D, F) and equals the model's slice */
    json_t *e = json_object_get(j, "model.layers.1.block_sparse_moe.experts.3.w2.weight");
    assert_non_null(e);
    assert_int_equal(json_integer_value(json_array_get(json_object_get(e, "shape"), 0)), 16);
    assert_int_equal(json_integer_value(json_array_get(json_object_get(e, "shape"), 1)), 8);
    json_int_t begin = json_integer_value(json_array_get(json_object_get(e, "data_offsets"), 0));
    float got[16 * 8];
    assert_int_equal(fseek(f, (long)(8 + hlen + (uint64_t)begin), SEEK_SET), 0);
    assert_int_equal(fread(got, sizeof(float), 16 * 8, f), 16 * 8);
    int t = moe_model_find_tensor(b.m, "layers.1.moe.experts.w2");
    assert_true(t >= 0);
    const real *want = b.m->params + b.m->tensors[t].offset + (size_t)3 * 16 * 8;
    for (int i = 0; i < 16 * 8; i++)
        assert_true(got[i] == (float)want[i]);
    assert_non_null(json_object_get(j, "model.embed_tokens.weight"));
    assert_non_null(json_object_get(j, "lm_head.weight"));
    assert_string_equal(
        json_string_value(json_object_get(json_object_get(j, "__metadata__"), "format")), "pt");
    json_decref(j);
    free(hdr);
    fclose(f);
    free_pair(&b);
}

static void test_fnv(void **state)
{
    (void)state;
    assert_true(moe_fnv1a64("", 0) == 0xcbf29ce484222325ULL);
    assert_true(moe_fnv1a64("a", 1) == 0xaf63dc4c8601ec8cULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_save_resume_exact),
        cmocka_unit_test(test_save_resume_bf16_moments),
        cmocka_unit_test(test_keep_and_tmp_ignored),
        cmocka_unit_test(test_corruption_fallback),
        cmocka_unit_test(test_shape_mismatch_refused),
        cmocka_unit_test(test_export),
        cmocka_unit_test(test_fnv),
    };
    return cmocka_run_group_tests(tests, setup_dir, remove_dir);
}
