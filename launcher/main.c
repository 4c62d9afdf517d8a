/* launcher/main.c: the moe-dist command line. Owns argument parsing, the verbs
 * (train, dump, inspect, export), exit statuses, and ending the job on failure. The
 * only place that exits.
 *
 * Exit statuses: 0 success; 1 runtime failure (also a bad checkpoint, a communication
 * timeout, a lost rank); 2 bad command line or config (also a config whose model shape
 * differs from the checkpoint resumed, a model export cannot express); 75 (EX_TEMPFAIL)
 * stopped by SIGUSR1/SIGTERM after writing a checkpoint: requeue with --resume auto.
 * A failure on any rank ends the whole job through MPI_Abort (never one rank alone,
 * never a hang); every rank checks the config, so a config error exits 2 everywhere. */
#include <errno.h>
#include <jansson.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "comm/comm.h"
#include "launcher/bench.h"
#include "launcher/bind.h"
#include "launcher/plan.h"
#include "launcher/ranks.h"
#include "launcher/signals.h"
#include "kernels/backend.h"
#include "runtime/config.h"
#include "runtime/checkpoint.h"
#include "runtime/model.h"
#include "runtime/trainer.h"
#include "sched/stats.h"
#include "util/status.h"

#define EXIT_USAGE 2
#define MAX_SETS 128

static const char usage_text[] =
    "usage: moe-dist <command> [CONFIG] [options]\n"
    "\n"
    "commands:\n"
    "  train [CONFIG]          train; without CONFIG, the embedded default (configs/tiny.ini)\n"
    "  bench [CONFIG]          time [train] steps after --warmup untimed ones: tokens/s, MFU,\n"
    "                          phases, communication, kernel profile (docs/bench.md)\n"
    "  dump CONFIG --out DIR   run the first step's forward and backward and write the\n"
    "                          weights, gradients and losses to DIR (for reference checks)\n"
    "  inspect CKPT|STATS      print a checkpoint's manifest and verify every checksum, or\n"
    "                          print a routing_stats file (load, top co-activations)\n"
    "  plan-experts STATS --ranks R [--nodes N] [--out PLAN]\n"
    "                          plan an expert placement from a routing_stats file and\n"
    "                          print the predicted traffic against the contiguous one\n"
    "  export CKPT --format safetensors OUT\n"
    "                          write OUT/model.safetensors + config.json (Mixtral names)\n"
    "\n"
    "options:\n"
    "  --set section.key=value override one config key (repeatable)\n"
    "  --out DIR               output directory (dump, export)\n"
    "  --resume auto|PATH      train (or dump) from a checkpoint: auto = the newest committed\n"
    "                          one in [checkpoint] dir that verifies (none: start fresh)\n"
    "  --format safetensors    export format\n"
    "  --ranks R, --nodes N    plan-experts: EP ranks and nodes to plan for\n"
    "  --warmup N              bench: untimed steps before the timed ones (default 10)\n"
    "  -h, --help              this text\n"
    "  --version               print the version\n"
    "\n"
    "exit status: 0 done; 1 runtime failure (bad checkpoint, communication timeout, lost\n"
    "rank); 2 bad command line or config; 75 stopped by SIGUSR1/SIGTERM after writing a\n"
    "checkpoint: requeue the job with --resume auto (docs/checkpoints.md).\n"
    "Every config key and its default: docs/config.md.\n";

/* bench: untimed steps first. Early steps build cuBLASLt plans for the row counts the
 * shifting routing brings (an H200 at the bench shape: steps 5 and 6 took 85 and 64 ms
 * against about 50 after them); 10 leaves those out of the timed steps. */
#define BENCH_WARMUP 10

typedef struct {
    const char *verb;
    const char *config_path; /* NULL: embedded default */
    const char *sets[MAX_SETS];
    int n_sets;
    const char *out_dir;
    const char *resume; /* --resume: "auto" or a checkpoint directory; NULL: none */
    const char *format; /* --format (export) */
    const char *extra;  /* a third positional argument (export's OUT) */
    int ranks, nodes;   /* plan-experts */
    int warmup;         /* bench: untimed steps first (--warmup, BENCH_WARMUP unless given) */
} cli_args;

static int parse_args(int argc, char **argv, cli_args *a)
{
    memset(a, 0, sizeof *a);
    a->warmup = BENCH_WARMUP;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--set") == 0 || strcmp(arg, "--out") == 0) {
            if (i + 1 >= argc) {
                fprintf(stderr, "moe-dist: %s needs a value\n", arg);
                return EXIT_USAGE;
            }
            if (arg[2] == 'o') {
                a->out_dir = argv[++i];
            } else if (a->n_sets == MAX_SETS) {
                fprintf(stderr, "moe-dist: more than %d --set options\n", MAX_SETS);
                return EXIT_USAGE;
            } else {
                a->sets[a->n_sets++] = argv[++i];
            }
        } else if (strncmp(arg, "--set=", 6) == 0 && a->n_sets < MAX_SETS) {
            a->sets[a->n_sets++] = arg + 6;
        } else if (strcmp(arg, "--resume") == 0 || strcmp(arg, "--format") == 0) {
            if (i + 1 >= argc) {
                fprintf(stderr, "moe-dist: %s needs a value\n", arg);
                return EXIT_USAGE;
            }
            *(arg[2] == 'r' ? &a->resume : &a->format) = argv[++i];
        } else if (strcmp(arg, "--ranks") == 0 || strcmp(arg, "--nodes") == 0 ||
                   strcmp(arg, "--warmup") == 0) {
            const int warm = arg[2] == 'w';
            char *end = NULL;
            long v = i + 1 < argc ? strtol(argv[i + 1], &end, 10) : 0;
            if (i + 1 >= argc || *end != '\0' || v < !warm || v > 1 << 20) {
                fprintf(stderr, "moe-dist: %s needs a %s integer\n", arg,
                        warm ? "non-negative" : "positive");
                return EXIT_USAGE;
            }
            *(warm ? &a->warmup : arg[2] == 'r' ? &a->ranks : &a->nodes) = (int)v;
            i++;
        } else if (strncmp(arg, "--resume=", 9) == 0) {
            a->resume = arg + 9;
        } else if (strncmp(arg, "--format=", 9) == 0) {
            a->format = arg + 9;
        } else if (arg[0] == '-') {
            fprintf(stderr, "moe-dist: unknown option '%s'\n%s", arg, usage_text);
            return EXIT_USAGE;
        } else if (!a->verb) {
            a->verb = arg;
        } else if (!a->config_path) {
            a->config_path = arg;
        } else if (!a->extra && a->verb && strcmp(a->verb, "export") == 0) {
            a->extra = arg;
        } else {
            fprintf(stderr, "moe-dist: unexpected argument '%s'\n%s", arg, usage_text);
            return EXIT_USAGE;
        }
    }
    return 0;
}

/* Loads, overrides and validates the config; any failure is a usage error (exit 2). */
static int load_config(const cli_args *a, moe_config *cfg)
{
    moe_config_defaults(cfg);
    moe_status st = a->config_path
                        ? moe_config_load(cfg, a->config_path)
                        : moe_config_load_string(cfg, moe_config_tiny_ini, "<embedded tiny.ini>");
    for (int i = 0; st == MOE_OK && i < a->n_sets; i++)
        st = moe_config_set(cfg, a->sets[i]);
    if (st == MOE_OK)
        st = moe_config_validate(cfg);
    return st == MOE_OK ? 0 : EXIT_USAGE;
}

static moe_ranks ranks;

/* Collective (gathers the host names); rank 0 prints. */
static void print_banner(const moe_config *cfg, const moe_trainer *tr, const char *source)
{
    const moe_model *m = tr->model;
    char hosts[1024];
    moe_ranks_hosts(&ranks, hosts, sizeof hosts);
    if (ranks.rank != 0)
        return;
    printf("moe-dist %s: %s, backend %s (%s)\n", MOE_VERSION, source, m->be->name,
           moe_trainer_precision(tr));
    printf("layout: world %d, ep %d, expert-data-parallel %d, %d of %d experts per rank per "
           "layer; %s\n",
           ranks.world, cfg->ep, ranks.world / cfg->ep, m->El, m->E, hosts);
    printf("model: %d layers (%d dense), d_model %d, %d heads, %d experts top-%d, expert ffn %d, "
           "vocab %d, seq %d: %.2fM parameters\n",
           cfg->n_layers, cfg->dense_layers, cfg->d_model, cfg->n_heads, cfg->experts, cfg->top_k,
           cfg->expert_hidden, cfg->vocab_size, cfg->seq_len, m->n_params / 1e6);
    printf("train: %d steps, micro-batch %d, grad_accum %d%s, data %s\n", cfg->steps,
           cfg->micro_batch, cfg->accum[0].micro_batches, cfg->n_accum > 1 ? " (scheduled)" : "",
           cfg->data_source);
    printf("optimizer: %s\n", moe_trainer_update_mode(tr));
    moe_bind_print(stdout); /* each rank's cores and NUMA node (launcher/bind.h) */
    fflush(stdout);
}

/* A failure after start-up ends every rank: the others may be inside a collective. */
static int fail_job(int code)
{
    fflush(stdout);
    if (ranks.world > 1)
        moe_ranks_abort(code);
    return code;
}

static int cmd_train(const cli_args *a, int bench)
{
    moe_config cfg;
    int rc = load_config(a, &cfg);
    if (rc)
        return rc;
    /* one GPU per rank, by local rank; its bus id decides the CPU binding */
    char bus_id[32] = "";
    int gpu = strcmp(cfg.backend, "cpu") != 0 &&
              moe_cuda_pick_device(ranks.local_rank, bus_id, sizeof bus_id) == MOE_OK;
    if (moe_bind_rank(&ranks, cfg.bind, gpu ? bus_id : NULL) != MOE_OK)
        return fail_job(1);
    moe_comm *comm = NULL;
    if (moe_comm_create(&comm, cfg.ep) != MOE_OK)
        return fail_job(EXIT_USAGE);
    moe_comm_set_timeout(comm, cfg.comm_timeout_s);
    moe_comm_set_exchange_repeat(comm, cfg.exchange_repeat);
    if (moe_signals_install() != 0)
        return fail_job(1);
    moe_trainer *tr = NULL;
    if (moe_trainer_create(&tr, &cfg, comm) != MOE_OK)
        return fail_job(1);
    tr->stop_request = moe_signals_flag();
    print_banner(&cfg, tr, a->config_path ? a->config_path : "embedded tiny.ini");
    moe_status st = MOE_OK;
    if (a->resume && (st = moe_trainer_resume(tr, a->resume)) != MOE_OK)
        return fail_job(st == MOE_ERR_INVALID ? EXIT_USAGE : 1);
    st = bench ? moe_bench_run(tr, a->warmup, 3, 2, stdout) : moe_trainer_run(tr, stdout);
    if (st != MOE_OK)
        return fail_job(1);
    int stopped = tr->stopped;
    moe_trainer_destroy(tr);
    moe_comm_destroy(comm);
    return stopped ? MOE_EXIT_REQUEUE : 0;
}

static moe_status write_file(const char *dir, const char *name, const void *data, size_t nbytes)
{
    char path[2048];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f)
        MOE_FAIL(MOE_ERR_IO, "cannot open '%s' for writing: %m", path);
    size_t wrote = fwrite(data, 1, nbytes, f);
    int close_rc = fclose(f);
    if (wrote != nbytes || close_rc != 0)
        MOE_FAIL(MOE_ERR_IO, "cannot write '%s': %m", path);
    return MOE_OK;
}

static moe_status dump_tensors_json(const char *dir, const moe_model *m, const moe_step_result *r)
{
    moe_status st = MOE_OK;
    json_t *root = json_object(), *list = json_array();
    if (!root || !list) {
        json_decref(root);
        json_decref(list);
        MOE_FAIL(MOE_ERR_NOMEM, "cannot build the tensor index");
    }
    for (int i = 0; i < m->n_tensors; i++) {
        const moe_tensor *t = &m->tensors[i];
        json_t *shape = json_array();
        for (int d = 0; d < t->ndim; d++)
            json_array_append_new(shape, json_integer(t->shape[d]));
        json_array_append_new(list, json_pack("{s:s, s:I, s:o}", "name", t->name, "offset",
                                              (json_int_t)t->offset, "shape", shape));
    }
    json_object_set_new(root, "tensors", list);
    json_object_set_new(root, "loss", json_real(r->loss));
    json_object_set_new(root, "ce", json_real(r->ce));
    json_object_set_new(root, "aux", json_real(r->aux));
    json_object_set_new(root, "z", json_real(r->z));
    json_object_set_new(root, "dropped", json_integer(r->dropped));
    char path[2048];
    snprintf(path, sizeof path, "%s/tensors.json", dir);
    if (json_dump_file(root, path, JSON_INDENT(1)) != 0) {
        moe_log_at(__FILE__, __LINE__, "cannot write '%s'", path);
        st = MOE_ERR_IO;
    }
    json_decref(root);
    return st;
}

/* Writes config.ini, tokens.bin (S, T+1) int32, params.bin, grads.bin (float32 arenas)
 * and tensors.json for the first step of cfg. */
static moe_status dump_step(const moe_config *cfg, const char *dir, const char *resume)
{
    moe_status st = MOE_OK;
    moe_trainer *tr = NULL;
    int32_t *tokens = NULL;
    float *buf = NULL;
    char *ini = NULL;
    moe_step_result r;
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        MOE_FAIL(MOE_ERR_IO, "cannot create '%s': %m", dir);
    MOE_CHECK_GOTO(st, moe_trainer_create(&tr, cfg, NULL));
    if (resume) { /* the checkpoint's weights, on the sequences [0, S) */
        MOE_CHECK_GOTO(st, moe_trainer_resume(tr, resume));
        tr->consumed = 0;
    }
    MOE_CHECK_GOTO(st, moe_trainer_accumulate(tr, &r));
    MOE_CHECK_GOTO(st, moe_trainer_losses(tr, &r));

    size_t ini_len = moe_config_to_ini(cfg, NULL, 0);
    int64_t S = r.sequences, T1 = cfg->seq_len + 1;
    size_t n = tr->model->n_params;
    ini = malloc(ini_len + 1);
    tokens = malloc(sizeof(int32_t) * (size_t)(S * T1));
    buf = malloc(sizeof(float) * n);
    if (!ini || !tokens || !buf) {
        st = MOE_ERR_NOMEM;
        goto fail;
    }
    moe_config_to_ini(cfg, ini, ini_len + 1);
    MOE_CHECK_GOTO(st, write_file(dir, "config.ini", ini, ini_len));
    MOE_CHECK_GOTO(st, moe_data_batch(tr->data, tokens, 0, (int)S));
    MOE_CHECK_GOTO(st, write_file(dir, "tokens.bin", tokens, sizeof(int32_t) * (size_t)(S * T1)));
    /* the arenas may live on the GPU: copy them to the host first (real is float) */
    MOE_CHECK_GOTO(st, tr->model->be->sync_master());
    tr->model->be->copy(buf, tr->model->params, sizeof(float) * n, MOE_COPY_D2H);
    MOE_CHECK_GOTO(st, write_file(dir, "params.bin", buf, sizeof(float) * n));
    tr->model->be->copy(buf, tr->model->grads, sizeof(float) * n, MOE_COPY_D2H);
    MOE_CHECK_GOTO(st, write_file(dir, "grads.bin", buf, sizeof(float) * n));
    MOE_CHECK_GOTO(st, dump_tensors_json(dir, tr->model, &r));
    if (r.micro_batches == 1) { /* the logits of the one micro-batch: (S*T, V) float32 */
        moe_model *m = tr->model;
        size_t nl = (size_t)m->N * m->V;
        float *logits = malloc(sizeof(float) * nl);
        real *host = malloc(sizeof(real) * nl);
        if (!logits || !host) {
            free(logits);
            free(host);
            st = MOE_ERR_NOMEM;
            goto fail;
        }
        st = moe_model_logits(m, host);
        for (size_t i = 0; st == MOE_OK && i < nl; i++)
            logits[i] = (float)host[i];
        if (st == MOE_OK)
            st = write_file(dir, "logits.bin", logits, sizeof(float) * nl);
        free(logits);
        free(host);
        MOE_CHECK_GOTO(st, st);
    }
    printf("dump: step 1 loss %.6f (ce %.6f aux %.6f z %.6f), %zu parameters -> %s\n", r.loss, r.ce,
           r.aux, r.z, n, dir);
fail:
    free(ini);
    free(tokens);
    free(buf);
    moe_trainer_destroy(tr);
    return st;
}

static int cmd_dump(const cli_args *a)
{
    if (!a->config_path || !a->out_dir) {
        fprintf(stderr, "moe-dist: dump needs CONFIG and --out DIR\n%s", usage_text);
        return EXIT_USAGE;
    }
    if (ranks.world > 1) {
        fprintf(stderr, "moe-dist: dump runs as one process\n");
        return EXIT_USAGE;
    }
    moe_config cfg;
    int rc = load_config(a, &cfg);
    if (rc)
        return rc;
    moe_status st = dump_step(&cfg, a->out_dir, a->resume);
    return st == MOE_OK ? 0 : st == MOE_ERR_INVALID ? EXIT_USAGE : 1;
}

/* inspect CKPT: one process, no MPI. 0 verified, 1 a bad file (named), 2 usage. */
static int cmd_inspect(const cli_args *a)
{
    if (!a->config_path) {
        fprintf(stderr, "moe-dist: inspect needs a checkpoint directory\n%s", usage_text);
        return EXIT_USAGE;
    }
    struct stat sb;
    if (stat(a->config_path, &sb) == 0 && S_ISREG(sb.st_mode)) { /* a routing_stats file */
        moe_routing_stats *s = NULL;
        if (moe_routing_stats_load(&s, a->config_path) != MOE_OK)
            return 1;
        moe_status st = moe_routing_stats_print(s, stdout, 5);
        moe_routing_stats_destroy(s);
        return st == MOE_OK ? 0 : 1;
    }
    moe_status st = moe_checkpoint_inspect(a->config_path, stdout);
    fflush(stdout);
    return st == MOE_OK ? 0 : 1;
}

/* export CKPT --format safetensors OUT: one process, no MPI. */
static int cmd_export(const cli_args *a)
{
    const char *out = a->extra ? a->extra : a->out_dir;
    if (!a->config_path || !out || !a->format) {
        fprintf(stderr, "moe-dist: export needs CKPT --format safetensors OUT\n%s", usage_text);
        return EXIT_USAGE;
    }
    if (strcmp(a->format, "safetensors") != 0) {
        fprintf(stderr, "moe-dist: export --format '%s': only safetensors is supported\n",
                a->format);
        return EXIT_USAGE;
    }
    moe_status st = moe_checkpoint_export_safetensors(a->config_path, out);
    if (st == MOE_OK)
        printf("export: %s -> %s/model.safetensors, %s/config.json\n", a->config_path, out, out);
    return st == MOE_OK ? 0 : st == MOE_ERR_INVALID ? EXIT_USAGE : 1;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            fputs(usage_text, stdout);
            return 0;
        }
        if (strcmp(argv[i], "--version") == 0) {
            printf("moe-dist %s\n", MOE_VERSION);
            return 0;
        }
    }
    /* One CPU thread per rank unless OMP_NUM_THREADS says otherwise: ranks fill the
     * cores, and OpenMP's spinning threads collapse when they oversubscribe them. */
    if (!getenv("OMP_NUM_THREADS"))
        omp_set_num_threads(1);
    cli_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc)
        return rc;
    if (!a.verb) {
        fputs(usage_text, stderr);
        return EXIT_USAGE;
    }
    if (strcmp(a.verb, "plan-experts") == 0) {
        if (!a.config_path) {
            fprintf(stderr, "moe-dist: plan-experts needs a routing_stats file\n%s", usage_text);
            return EXIT_USAGE;
        }
        return moe_cmd_plan_experts(a.config_path, a.ranks, a.nodes ? a.nodes : 1, a.out_dir);
    }
    if (strcmp(a.verb, "inspect") == 0 || strcmp(a.verb, "export") == 0) {
        moe_log_set_rank(0); /* one process, no MPI */
        return strcmp(a.verb, "inspect") == 0 ? cmd_inspect(&a) : cmd_export(&a);
    }
    const int bench = strcmp(a.verb, "bench") == 0;
    if (strcmp(a.verb, "train") != 0 && strcmp(a.verb, "dump") != 0 && !bench) {
        fprintf(stderr, "moe-dist: unknown command '%s'\n%s", a.verb, usage_text);
        return EXIT_USAGE;
    }
    if (a.resume && !*a.resume) {
        fprintf(stderr, "moe-dist: --resume needs auto or a checkpoint directory\n");
        return EXIT_USAGE;
    }
    /* a stop request during start-up is kept too (installed again after MPI starts, in
     * case the MPI library replaced a handler) */
    if (strcmp(a.verb, "train") == 0 && moe_signals_install() != 0)
        return 1;
    if (moe_ranks_init(&argc, &argv, &ranks) != 0)
        return 1;
    rc = strcmp(a.verb, "dump") == 0 ? cmd_dump(&a) : cmd_train(&a, bench);
    moe_ranks_finalize();
    return rc;
}
