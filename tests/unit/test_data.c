/* tests/unit/test_data.c: the data module (runtime/data.h).
 *
 * Synthetic corpus: determinism across dataset objects and overlapping batches, token
 * range, process bands and markers, each process's rule, low bigram entropy.
 * Shards: exact tokens (a sequence spanning three files, wrap-around), and every error,
 * each checked for its status and its message (stderr captured through fd 2). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/config.h"
#include "runtime/data.h"

#include "tmpdir.h"

/* ---------------------------------------------------------------------------------- */
/* helpers                                                                            */
/* ---------------------------------------------------------------------------------- */

static void synth_config(moe_config *cfg, int V, int T, int P, uint64_t seed)
{
    moe_config_defaults(cfg);
    cfg->vocab_size = V;
    cfg->seq_len = T;
    cfg->synthetic_processes = P;
    cfg->data_seed = seed;
    strcpy(cfg->data_source, "synthetic");
    cfg->data_path[0] = '\0';
}

static void shard_config(moe_config *cfg, int V, int T, const char *paths)
{
    moe_config_defaults(cfg);
    cfg->vocab_size = V;
    cfg->seq_len = T;
    strcpy(cfg->data_source, "shards");
    size_t n = strlen(paths);
    assert_true(n < sizeof cfg->data_path);
    memcpy(cfg->data_path, paths, n + 1);
}

/* stderr capture: everything written to fd 2 between begin and end lands in buf */
typedef struct {
    FILE *file;
    int saved_fd;
} capture;

static void capture_begin(capture *c)
{
    fflush(stderr);
    c->file = tmpfile();
    assert_non_null(c->file);
    c->saved_fd = dup(2);
    assert_true(c->saved_fd >= 0);
    assert_true(dup2(fileno(c->file), 2) >= 0);
}

static void capture_end(capture *c, char *buf, size_t cap)
{
    fflush(stderr);
    dup2(c->saved_fd, 2);
    close(c->saved_fd);
    rewind(c->file);
    size_t n = fread(buf, 1, cap - 1, c->file);
    buf[n] = '\0';
    fclose(c->file);
}

/* Open file descriptors of this process: a dataset closes every shard it opened. */
static int count_fds(void)
{
    DIR *dir = opendir("/proc/self/fd");
    if (dir == NULL)
        return -1;
    int n = 0;
    while (readdir(dir) != NULL)
        n++;
    closedir(dir);
    return n;
}

static void expect_in(const char *msg, const char *needle)
{
    if (strstr(msg, needle) == NULL) {
        fprintf(stderr, "expected \"%s\" in the message:\n%s\n", needle, msg);
        fail();
    }
}

/* Creating a dataset from cfg fails with `want`, no dataset, and a message holding
 * every one of the NULL-terminated needles. */
static void expect_create_error(const moe_config *cfg, moe_status want, ...)
{
    char msg[8192];
    capture cap;
    moe_data *d = (moe_data *)0x1;
    capture_begin(&cap);
    moe_status st = moe_data_create(&d, cfg);
    capture_end(&cap, msg, sizeof msg);
    if (st != want)
        fprintf(stderr, "status %d (%s), expected %d; message:\n%s\n", st, moe_status_str(st), want,
                msg);
    assert_int_equal(st, want);
    assert_null(d);
    va_list ap;
    va_start(ap, want);
    for (const char *needle; (needle = va_arg(ap, const char *)) != NULL;)
        expect_in(msg, needle);
    va_end(ap);
}

/* ---------------------------------------------------------------------------------- */
/* synthetic corpus                                                                   */
/* ---------------------------------------------------------------------------------- */

static void test_synthetic_deterministic(void **state)
{
    (void)state;
    enum { V = 256, T = 64, B = 16, ROW = T + 1 };
    moe_config cfg;
    synth_config(&cfg, V, T, 4, 7);
    moe_data *d1 = NULL, *d2 = NULL;
    assert_int_equal(moe_data_create(&d1, &cfg), MOE_OK);
    assert_int_equal(moe_data_create(&d2, &cfg), MOE_OK);
    assert_true(moe_data_tokens(d1) == INT64_MAX);
    assert_true(moe_data_is_synthetic(d1));

    static int32_t a[B * ROW], b[B * ROW], one[ROW];
    assert_int_equal(moe_data_batch(d1, a, 1000, B), MOE_OK); /* sequences 1000..1015 */
    assert_int_equal(moe_data_batch(d2, b, 1008, B), MOE_OK); /* sequences 1008..1023 */
    for (int s = 1008; s < 1016; s++)
        assert_memory_equal(a + (s - 1000) * ROW, b + (s - 1008) * ROW, ROW * sizeof(int32_t));
    /* asking again, alone and out of order, gives the same row */
    assert_int_equal(moe_data_batch(d2, one, 1003, 1), MOE_OK);
    assert_memory_equal(one, a + 3 * ROW, sizeof one);
    assert_int_equal(moe_data_batch(d1, b, 1000, B), MOE_OK);
    assert_memory_equal(a, b, sizeof a);

    /* neighbouring sequences differ, and another data_seed gives another corpus */
    int rows_equal = 0;
    for (int r = 1; r < B; r++)
        rows_equal += memcmp(a, a + r * ROW, ROW * sizeof(int32_t)) == 0;
    assert_int_equal(rows_equal, 0);
    moe_data *d3 = NULL;
    synth_config(&cfg, V, T, 4, 8);
    assert_int_equal(moe_data_create(&d3, &cfg), MOE_OK);
    assert_int_equal(moe_data_batch(d3, b, 1000, B), MOE_OK);
    assert_true(memcmp(a, b, sizeof a) != 0);

    moe_data_destroy(d1);
    moe_data_destroy(d2);
    moe_data_destroy(d3);
    moe_data_destroy(NULL);
}

/* Tokens lie in [0, V), each sequence starts with its process's marker and stays in its
 * band, the bands partition the vocabulary, every process appears about 1/P of the time. */
static void check_bands(int V, int T, int P, int n_seq)
{
    moe_config cfg;
    synth_config(&cfg, V, T, P, 11);
    moe_data *d = NULL;
    assert_int_equal(moe_data_create(&d, &cfg), MOE_OK);

    int32_t *tok = malloc((size_t)(T + 1) * sizeof *tok);
    int *seen = calloc((size_t)P, sizeof *seen);
    int32_t *lo = calloc((size_t)P, sizeof *lo), *width = calloc((size_t)P, sizeof *width);
    assert_non_null(tok);
    assert_non_null(seen);
    for (int s = 0; s < n_seq; s++) {
        assert_int_equal(moe_data_batch(d, tok, s, 1), MOE_OK);
        moe_synth_info info;
        assert_int_equal(moe_data_synthetic_info(d, s, &info), MOE_OK);
        assert_in_range(info.process, 0, P - 1);
        assert_int_equal(info.kind, info.process % 4);
        seen[info.process]++;
        lo[info.process] = info.band_lo;
        width[info.process] = info.band_width;
        assert_int_equal(tok[0], info.band_lo);
        for (int i = 0; i <= T; i++) {
            assert_in_range(tok[i], 0, V - 1);
            if (tok[i] < info.band_lo || tok[i] >= info.band_lo + info.band_width) {
                fprintf(stderr, "V=%d P=%d seq %d (process %d, band [%d, %d)): token %d = %d\n", V,
                        P, s, info.process, info.band_lo, info.band_lo + info.band_width, i,
                        tok[i]);
                fail();
            }
        }
    }
    int32_t next = 0;
    for (int p = 0; p < P; p++) {
        /* expected n/P; allow 5 standard deviations */
        double mean = (double)n_seq / P, sd = sqrt(mean * (1.0 - 1.0 / P));
        if (fabs(seen[p] - mean) > 5 * sd + 1) {
            fprintf(stderr, "process %d drew %d of %d sequences, expected ~%.0f\n", p, seen[p],
                    n_seq, mean);
            fail();
        }
        assert_int_equal(lo[p], next); /* bands are contiguous and in order */
        assert_true(width[p] >= 2);
        assert_true(width[p] == V / P || width[p] == V / P + 1);
        next += width[p];
    }
    assert_int_equal(next, V);
    free(tok);
    free(seen);
    free(lo);
    free(width);
    moe_data_destroy(d);
}

static void test_synthetic_bands(void **state)
{
    (void)state;
    check_bands(256, 64, 4, 4000);  /* the tiny config */
    check_bands(1000, 32, 7, 2000); /* bands of 143 and 142 tokens, every kind twice */
    check_bands(8, 16, 4, 400);     /* the smallest vocabulary: bands of 2 */
    check_bands(9, 16, 4, 400);
    check_bands(50257, 128, 8, 400);
    check_bands(2, 8, 1, 50);
}

/* Each process follows its own rule. Counted over many sequences of the tiny config:
 * markov: the 3 most frequent successors of each token carry >= 90% of its transitions;
 * motif: each sequence repeats with a period in 3..8 (>= 85% of tokens on average);
 * progression: each sequence has one step mod w (>= 85% of differences on average),
 * and a process uses at most 3 steps; runs: most neighbours are equal, and run values change by the
 * process's permutation (one successor per value, >= 90%). */
static void test_synthetic_rules(void **state)
{
    (void)state;
    enum { V = 256, T = 64, P = 4, N = 3000 };
    moe_config cfg;
    synth_config(&cfg, V, T, P, 3);
    moe_data *d = NULL;
    assert_int_equal(moe_data_create(&d, &cfg), MOE_OK);

    static int32_t tok[T + 1];
    static int markov_counts[V][V];      /* transitions within markov sequences */
    static int runs_change_counts[V][V]; /* value changes within runs sequences */
    int steps_seen[V] = {0};
    long runs_equal = 0, runs_pairs = 0;
    int n_kind[4] = {0};
    double motif_sum = 0.0, progression_sum = 0.0;
    for (int s = 0; s < N; s++) {
        moe_synth_info info;
        assert_int_equal(moe_data_synthetic_info(d, s, &info), MOE_OK);
        assert_int_equal(moe_data_batch(d, tok, s, 1), MOE_OK);
        const int w = info.band_width;
        const int32_t *x = tok + 1; /* content, band tokens */
        n_kind[info.kind]++;
        switch (info.kind) {
        case MOE_SYNTH_MARKOV:
            for (int i = 0; i + 1 < T; i++)
                markov_counts[x[i]][x[i + 1]]++;
            break;
        case MOE_SYNTH_MOTIF: {
            double best = 0.0;
            for (int L = 3; L <= 8; L++) {
                int match = 0;
                for (int i = 0; i + L < T; i++)
                    match += x[i] == x[i + L];
                if ((double)match / (T - L) > best)
                    best = (double)match / (T - L);
            }
            if (best < 0.5) {
                fprintf(stderr, "motif sequence %d has no period in 3..8 (best %.2f)\n", s, best);
                fail();
            }
            motif_sum += best;
            break;
        }
        case MOE_SYNTH_PROGRESSION: {
            int count[1024] = {0}, mode = 0;
            assert_true(w <= 1024);
            for (int i = 0; i + 1 < T; i++) {
                int diff = ((x[i + 1] - x[i]) % w + w) % w;
                if (++count[diff] > count[mode])
                    mode = diff;
            }
            progression_sum += (double)count[mode] / (T - 1);
            if (count[mode] < 0.5 * (T - 1)) {
                fprintf(stderr, "progression sequence %d: modal step %d in only %d of %d\n", s,
                        mode, count[mode], T - 1);
                fail();
            }
            assert_true(mode != 0);
            steps_seen[mode] = 1;
            break;
        }
        case MOE_SYNTH_TOPIC: fail_msg("a topic in the processes corpus (sequence %d)", s); break;
        case MOE_SYNTH_RUNS:
            for (int i = 0; i + 1 < T; i++) {
                runs_pairs++;
                if (x[i] == x[i + 1])
                    runs_equal++;
                else
                    runs_change_counts[x[i]][x[i + 1]]++;
            }
            break;
        }
    }
    for (int k = 0; k < 4; k++)
        assert_true(n_kind[k] > N / 8);
    assert_string_equal(moe_synth_kind_name(MOE_SYNTH_MARKOV), "markov");
    assert_string_equal(moe_synth_kind_name(MOE_SYNTH_RUNS), "runs");
    assert_string_equal(moe_synth_kind_name(MOE_SYNTH_TOPIC), "topic");
    assert_string_equal(moe_synth_kind_name((moe_synth_kind)9), "?");

    /* markov: top-3 successors */
    long top3 = 0, total = 0;
    for (int a = 0; a < V; a++) {
        int first = 0, second = 0, third = 0;
        for (int b = 0; b < V; b++) {
            int c = markov_counts[a][b];
            total += c;
            if (c > first) {
                third = second;
                second = first;
                first = c;
            } else if (c > second) {
                third = second;
                second = c;
            } else if (c > third) {
                third = c;
            }
        }
        top3 += first + second + third;
    }
    fprintf(stderr, "markov: top-3 successors carry %.3f of %ld transitions\n",
            (double)top3 / total, total);
    assert_true(total > 1000);
    assert_true(top3 >= 0.9 * total);

    /* motif and progression: on average ~90% of tokens follow the rule (noise 5%
     * breaks up to two comparisons); no sequence falls below 50% (checked above) */
    fprintf(stderr,
            "motif: %.3f of tokens repeat with the period; progression: %.3f of "
            "differences equal the step\n",
            motif_sum / n_kind[MOE_SYNTH_MOTIF], progression_sum / n_kind[MOE_SYNTH_PROGRESSION]);
    assert_true(motif_sum >= 0.85 * n_kind[MOE_SYNTH_MOTIF]);
    assert_true(progression_sum >= 0.85 * n_kind[MOE_SYNTH_PROGRESSION]);
    /* ... but not all: the noise keeps the entropy floor off zero */
    assert_true(motif_sum <= 0.97 * n_kind[MOE_SYNTH_MOTIF]);
    assert_true(progression_sum <= 0.97 * n_kind[MOE_SYNTH_PROGRESSION]);

    /* progression: at most 3 distinct steps for the one progression process */
    int n_steps = 0;
    for (int i = 0; i < V; i++)
        n_steps += steps_seen[i];
    assert_in_range(n_steps, 1, 3);

    /* runs: runs of 2..4 give 50-75% equal neighbours, less a little noise */
    double equal = (double)runs_equal / runs_pairs;
    fprintf(stderr, "runs: %.3f of neighbours equal\n", equal);
    assert_true(equal > 0.4 && equal < 0.8);
    long top1 = 0, changes = 0;
    for (int a = 0; a < V; a++) {
        int best = 0;
        for (int b = 0; b < V; b++) {
            changes += runs_change_counts[a][b];
            if (runs_change_counts[a][b] > best)
                best = runs_change_counts[a][b];
        }
        top1 += best;
    }
    fprintf(stderr, "runs: the permutation explains %.3f of %ld value changes\n",
            (double)top1 / changes, changes);
    assert_true(top1 >= 0.7 * changes);
    moe_data_destroy(d);
}

/* Bigram conditional entropy H(x[i+1] | x[i]) over many sequences (an upper bound on
 * what a model that sees the whole context can reach) is far below log V, and above the
 * module's own estimate of the floor. */
static double bigram_entropy(int V, int T, int P, int n_seq, double *floor_out)
{
    moe_config cfg;
    synth_config(&cfg, V, T, P, 1234);
    moe_data *d = NULL;
    assert_int_equal(moe_data_create(&d, &cfg), MOE_OK);
    *floor_out = moe_data_entropy_floor(d);

    enum { CHUNK = 64 };
    int32_t *tok = malloc((size_t)CHUNK * (T + 1) * sizeof *tok);
    long *counts = calloc((size_t)V * V, sizeof *counts);
    long *row = calloc((size_t)V, sizeof *row);
    assert_non_null(tok);
    assert_non_null(counts);
    assert_non_null(row);
    for (int s = 0; s < n_seq; s += CHUNK) {
        assert_int_equal(moe_data_batch(d, tok, s, CHUNK), MOE_OK);
        for (int b = 0; b < CHUNK; b++)
            for (int i = 0; i < T; i++) {
                const int32_t *x = tok + (size_t)b * (T + 1);
                counts[(size_t)x[i] * V + x[i + 1]]++;
                row[x[i]]++;
            }
    }
    double h = 0.0, n = 0.0;
    for (int a = 0; a < V; a++) {
        n += row[a];
        for (int b = 0; b < V; b++) {
            long c = counts[(size_t)a * V + b];
            if (c > 0)
                h -= c * log((double)c / row[a]);
        }
    }
    free(tok);
    free(counts);
    free(row);
    moe_data_destroy(d);
    return h / n;
}

static void test_synthetic_entropy(void **state)
{
    (void)state;
    static const struct {
        int V, T, P;
    } cases[] = {{256, 64, 4}, {512, 128, 8}, {64, 32, 2}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {

        double floor_h, h = bigram_entropy(cases[c].V, cases[c].T, cases[c].P, 8192, &floor_h);
        double logv = log(cases[c].V);
        fprintf(stderr,
                "synthetic V=%d T=%d P=%d: bigram entropy %.3f nats, floor ~%.3f, "
                "log V %.3f (bigram/logV %.2f)\n",
                cases[c].V, cases[c].T, cases[c].P, h, floor_h, logv, h / logv);
        assert_true(h < 0.6 * logv);
        assert_true(floor_h > 0.3); /* noise keeps it off zero */
        assert_true(floor_h < h);   /* a full-context predictor beats bigrams */
        if (c == 0)                 /* docs/data.md quotes the tiny config's figures */
            assert_true(fabs(floor_h - 0.61) < 0.01 && fabs(h - 1.27) < 0.05);
    }
}

/* synthetic = topics: a sequence is T+1 uniform tokens of its topic's band (no marker);
 * the topics share the processes' bands and sequence-to-topic draw; each topic appears
 * about 1/G of the time and each token of a band about 1/w of its topic's tokens. The
 * processes corpus of the same seed is not affected by the key's existence. */
static void test_synthetic_topics(void **state)
{
    (void)state;
    enum { V = 256, T = 64, G = 4, N = 4000, ROW = T + 1 };
    moe_config cfg;
    synth_config(&cfg, V, T, G, 42);
    strcpy(cfg.synthetic, "topics");
    moe_data *d = NULL, *p = NULL;
    assert_int_equal(moe_data_create(&d, &cfg), MOE_OK);
    strcpy(cfg.synthetic, "processes");
    assert_int_equal(moe_data_create(&p, &cfg), MOE_OK);

    static int32_t tok[ROW], again[ROW];
    static long count[V];
    long per_topic[G] = {0}, first_is_lo = 0;
    for (int s = 0; s < N; s++) {
        moe_synth_info info, pinfo;
        assert_int_equal(moe_data_synthetic_info(d, s, &info), MOE_OK);
        assert_int_equal(moe_data_synthetic_info(p, s, &pinfo), MOE_OK);
        assert_int_equal(info.kind, MOE_SYNTH_TOPIC);
        assert_int_equal(info.process, pinfo.process); /* the same draw of the topic */
        assert_int_equal(info.band_lo, pinfo.band_lo);
        assert_int_equal(info.band_width, V / G);
        per_topic[info.process]++;
        assert_int_equal(moe_data_batch(d, tok, s, 1), MOE_OK);
        for (int i = 0; i < ROW; i++) {
            assert_true(tok[i] >= info.band_lo && tok[i] < info.band_lo + info.band_width);
            count[tok[i]]++;
        }
        first_is_lo += tok[0] == info.band_lo;
        assert_int_equal(moe_data_batch(d, again, s, 1), MOE_OK); /* deterministic */
        assert_memory_equal(tok, again, sizeof tok);
    }
    for (int g = 0; g < G; g++)
        assert_true(per_topic[g] > N / G * 8 / 10 && per_topic[g] < N / G * 12 / 10);
    assert_true(first_is_lo < N / 8); /* no marker: the first token is uniform too */
    /* each token about (N / G) * ROW / w times: 1015 here; allow +-20% */
    for (int v = 0; v < V; v++) {
        double expect = (double)per_topic[v / (V / G)] * ROW / (V / G);
        if (count[v] < 0.8 * expect || count[v] > 1.2 * expect)
            fail_msg("token %d: %ld occurrences, expected about %.0f", v, count[v], expect);
    }
    /* the floor is log(w) */
    assert_true(fabs(moe_data_entropy_floor(d) - log(V / G)) < 1e-12);
    moe_data_destroy(d);
    moe_data_destroy(p);
}

static void test_synthetic_invalid(void **state)
{
    (void)state;
    moe_config cfg;
    synth_config(&cfg, 7, 16, 4, 1);
    expect_create_error(&cfg, MOE_ERR_INVALID, "[data] synthetic_processes = 4",
                        "[model] vocab_size >= 2 * 4 = 8", "vocab_size is 7", NULL);
    synth_config(&cfg, 256, 16, 0, 1);
    expect_create_error(&cfg, MOE_ERR_INVALID, "[data] synthetic_processes = 0", NULL);
    synth_config(&cfg, 256, 0, 4, 1);
    expect_create_error(&cfg, MOE_ERR_INVALID, "[model] seq_len = 0", NULL);
    synth_config(&cfg, 256, 16, 4, 1);
    strcpy(cfg.data_source, "tfrecord");
    expect_create_error(&cfg, MOE_ERR_INVALID, "[data] source = 'tfrecord'", NULL);

    /* bad batch arguments */
    synth_config(&cfg, 256, 16, 4, 1);
    moe_data *d = NULL;
    assert_int_equal(moe_data_create(&d, &cfg), MOE_OK);
    int32_t tok[17];
    char msg[4096];
    capture cap;
    capture_begin(&cap);
    moe_status st = moe_data_batch(d, tok, -1, 1);
    capture_end(&cap, msg, sizeof msg);
    assert_int_equal(st, MOE_ERR_INVALID);
    expect_in(msg, "first_seq = -1");
    assert_int_equal(moe_data_batch(d, tok, 0, 0), MOE_OK);
    moe_data_destroy(d);
}

/* ---------------------------------------------------------------------------------- */
/* shards                                                                             */
/* ---------------------------------------------------------------------------------- */

static void put_le32(uint8_t *p, int32_t v)
{
    uint32_t u = (uint32_t)v;
    p[0] = u & 0xff;
    p[1] = (u >> 8) & 0xff;
    p[2] = (u >> 16) & 0xff;
    p[3] = (u >> 24) & 0xff;
}

/* Writes tmpdir/name: header (magic, version, count), then n_written tokens
 * (little-endian uint16), then `extra` zero bytes. header_bytes < 1024 writes only that
 * much of the header and nothing else. Returns the path (static storage per call). */
static const char *write_shard_raw(const char *name, int32_t magic, int32_t version, int32_t count,
                                   const uint16_t *tokens, int n_written, int extra,
                                   int header_bytes)
{
    static char paths[16][512];
    static int next;
    char *path = paths[next++ % 16];
    snprintf(path, 512, "%s/%s", tmpdir, name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint8_t header[1024] = {0};
    put_le32(header, magic);
    put_le32(header + 4, version);
    put_le32(header + 8, count);
    assert_int_equal(fwrite(header, 1, (size_t)header_bytes, f), (size_t)header_bytes);
    if (header_bytes == 1024) {
        for (int i = 0; i < n_written; i++) {
            uint8_t le[2] = {(uint8_t)(tokens[i] & 0xff), (uint8_t)(tokens[i] >> 8)};
            assert_int_equal(fwrite(le, 1, 2, f), 2);
        }
        for (int i = 0; i < extra; i++)
            assert_int_equal(fputc(0, f), 0);
    }
    assert_int_equal(fclose(f), 0);
    return path;
}

static const char *write_shard(const char *name, const uint16_t *tokens, int n)
{
    return write_shard_raw(name, MOE_SHARD_MAGIC, MOE_SHARD_VERSION, n, tokens, n, 0, 1024);
}

/* Four shards: a (10 tokens 1000..1009), b (1 token 1500), c (7 tokens 2000..2006),
 * d (5 tokens 3000..3004): 23 tokens. With T = 4, sequence s starts at 4s mod 19. */
static void test_shards_exact(void **state)
{
    (void)state;
    enum { T = 4, ROW = T + 1, TOTAL = 23 };
    uint16_t a[10], b[1] = {1500}, c[7], e[5];
    for (int i = 0; i < 10; i++)
        a[i] = (uint16_t)(1000 + i);
    for (int i = 0; i < 7; i++)
        c[i] = (uint16_t)(2000 + i);
    for (int i = 0; i < 5; i++)
        e[i] = (uint16_t)(3000 + i);
    char list[4096];
    snprintf(list, sizeof list, "%s, %s ,%s,%s", write_shard("a.bin", a, 10),
             write_shard("b.bin", b, 1), write_shard("c.bin", c, 7), write_shard("d.bin", e, 5));
    moe_config cfg;
    shard_config(&cfg, 4000, T, list);
    const int fds_before = count_fds();
    moe_data *d = NULL;
    assert_int_equal(moe_data_create(&d, &cfg), MOE_OK);
    assert_int_equal(moe_data_tokens(d), TOTAL);
    assert_false(moe_data_is_synthetic(d));
    assert_true(moe_data_entropy_floor(d) == -1.0);
    moe_synth_info info;
    capture cap;
    char msg[4096];
    capture_begin(&cap);
    moe_status st = moe_data_synthetic_info(d, 0, &info);
    capture_end(&cap, msg, sizeof msg);
    assert_int_equal(st, MOE_ERR_INVALID);

    int32_t tok[8 * ROW];
    /* sequences 0..2 in one batch: starts 0, 4, 8 (8 spans a -> b -> c) */
    assert_int_equal(moe_data_batch(d, tok, 0, 3), MOE_OK);
    const int32_t want0[3 * ROW] = {1000, 1001, 1002, 1003, 1004, 1004, 1005, 1006,
                                    1007, 1008, 1008, 1009, 1500, 2000, 2001};
    assert_memory_equal(tok, want0, sizeof want0);
    /* sequence 4 starts at 16 (spans c -> d); 5 wraps to 20 mod 19 = 1 */
    assert_int_equal(moe_data_batch(d, tok, 4, 2), MOE_OK);
    const int32_t want4[2 * ROW] = {2005, 2006, 3000, 3001, 3002, 1001, 1002, 1003, 1004, 1005};
    assert_memory_equal(tok, want4, sizeof want4);
    /* the last usable start, 18 = 4 * 14 mod 19, ends on the last token */
    assert_int_equal(moe_data_batch(d, tok, 14, 1), MOE_OK);
    const int32_t want14[ROW] = {3000, 3001, 3002, 3003, 3004};
    assert_memory_equal(tok, want14, sizeof want14);

    /* every sequence 0..199 against the concatenation */
    int32_t all[TOTAL];
    int k = 0;
    for (int i = 0; i < 10; i++)
        all[k++] = a[i];
    all[k++] = b[0];
    for (int i = 0; i < 7; i++)
        all[k++] = c[i];
    for (int i = 0; i < 5; i++)
        all[k++] = e[i];
    for (int s = 0; s < 200; s++) {
        assert_int_equal(moe_data_batch(d, tok, s, 1), MOE_OK);
        int start = (s * T) % (TOTAL - T);
        assert_memory_equal(tok, all + start, ROW * sizeof(int32_t));
    }
    /* a huge index does not overflow: s * T is taken mod 19 exactly */
    int64_t huge = INT64_MAX - 10;
    assert_int_equal(moe_data_batch(d, tok, huge, 1), MOE_OK);
    int start = (int)((unsigned __int128)huge * T % (TOTAL - T));
    assert_memory_equal(tok, all + start, ROW * sizeof(int32_t));
    moe_data_destroy(d);
    assert_int_equal(count_fds(), fds_before); /* destroy closed the four files */
}

/* A single shard with exactly T+1 tokens: every sequence is the whole file. */
static void test_shards_minimal(void **state)
{
    (void)state;
    uint16_t t[5] = {5, 4, 3, 2, 65535};
    moe_config cfg;
    shard_config(&cfg, 65536, 4, write_shard("min.bin", t, 5));
    moe_data *d = NULL;
    assert_int_equal(moe_data_create(&d, &cfg), MOE_OK);
    int32_t tok[10];
    assert_int_equal(moe_data_batch(d, tok, 0, 2), MOE_OK);
    const int32_t want[10] = {5, 4, 3, 2, 65535, 5, 4, 3, 2, 65535};
    assert_memory_equal(tok, want, sizeof want);
    moe_data_destroy(d);
}

static void test_shards_errors(void **state)
{
    (void)state;
    uint16_t t[64];
    for (int i = 0; i < 64; i++)
        t[i] = (uint16_t)i;
    moe_config cfg;
    char path[1024], list[2048];
    const int fds_before = count_fds();

    /* missing file */
    snprintf(path, sizeof path, "%s/no_such_shard.bin", tmpdir);
    shard_config(&cfg, 256, 4, path);
    expect_create_error(&cfg, MOE_ERR_IO, path, strerror(ENOENT), NULL);

    /* the second of two files is missing: names that one */
    snprintf(list, sizeof list, "%s,%s", write_shard("good.bin", t, 64), path);
    shard_config(&cfg, 256, 4, list);
    expect_create_error(&cfg, MOE_ERR_IO, "no_such_shard.bin", strerror(ENOENT), NULL);

    /* wrong magic */
    const char *p = write_shard_raw("magic.bin", 12345, 1, 64, t, 64, 0, 1024);
    shard_config(&cfg, 256, 4, p);
    expect_create_error(&cfg, MOE_ERR_INVALID, p,
                        "not an llm.c token shard: magic 12345, expected 20240520", NULL);

    /* wrong version */
    p = write_shard_raw("version.bin", MOE_SHARD_MAGIC, 2, 64, t, 64, 0, 1024);
    shard_config(&cfg, 256, 4, p);
    expect_create_error(&cfg, MOE_ERR_INVALID, p, "version 2, expected 1", NULL);

    /* truncated: header says 64 tokens, 60 written: 1144 bytes of 1152 */
    p = write_shard_raw("trunc.bin", MOE_SHARD_MAGIC, 1, 64, t, 60, 0, 1024);
    shard_config(&cfg, 256, 4, p);
    expect_create_error(&cfg, MOE_ERR_INVALID, p, "truncated", "1144 bytes", "expected 1152", NULL);

    /* trailing bytes: 3 after the last token */
    p = write_shard_raw("trail.bin", MOE_SHARD_MAGIC, 1, 64, t, 64, 3, 1024);
    shard_config(&cfg, 256, 4, p);
    expect_create_error(&cfg, MOE_ERR_INVALID, p, "3 trailing bytes", "1155 bytes", "expected 1152",
                        NULL);

    /* an empty file, and one shorter than the header */
    p = write_shard_raw("empty.bin", 0, 0, 0, NULL, 0, 0, 0);
    shard_config(&cfg, 256, 4, p);
    expect_create_error(&cfg, MOE_ERR_INVALID, p, "0 bytes, shorter than the 1024-byte header",
                        NULL);
    p = write_shard_raw("short.bin", MOE_SHARD_MAGIC, 1, 64, NULL, 0, 0, 100);
    shard_config(&cfg, 256, 4, p);
    expect_create_error(&cfg, MOE_ERR_INVALID, p, "100 bytes, shorter than the 1024-byte header",
                        NULL);

    /* a header that counts no tokens, and one that counts a negative number */
    p = write_shard_raw("zero.bin", MOE_SHARD_MAGIC, 1, 0, NULL, 0, 0, 1024);
    shard_config(&cfg, 256, 4, p);
    expect_create_error(&cfg, MOE_ERR_INVALID, p, "header says 0 tokens", NULL);
    p = write_shard_raw("neg.bin", MOE_SHARD_MAGIC, 1, -5, NULL, 0, 0, 1024);
    shard_config(&cfg, 256, 4, p);
    expect_create_error(&cfg, MOE_ERR_INVALID, p, "header says -5 tokens", NULL);

    /* too few tokens for one sequence: 2 + 2 < T + 1 = 5 */
    snprintf(list, sizeof list, "%s,%s", write_shard("two_a.bin", t, 2),
             write_shard("two_b.bin", t, 2));
    shard_config(&cfg, 256, 4, list);
    expect_create_error(&cfg, MOE_ERR_INVALID, "hold 4 tokens", "seq_len + 1 = 5", NULL);

    /* an empty entry in the list, and a directory */
    snprintf(list, sizeof list, "%s,,%s", write_shard("e1.bin", t, 8), write_shard("e2.bin", t, 8));
    shard_config(&cfg, 256, 4, list);
    expect_create_error(&cfg, MOE_ERR_INVALID, "entry 2 is empty", NULL);
    shard_config(&cfg, 256, 4, tmpdir);
    expect_create_error(&cfg, MOE_ERR_IO, tmpdir, "not a regular file", NULL);

    /* every failed create closed what it had opened */
    assert_int_equal(count_fds(), fds_before);
}

/* Tokens >= vocab_size are found when a batch reads them, and named by file and
 * position; batches that do not read them succeed. */
static void test_shards_bad_token(void **state)
{
    (void)state;
    uint16_t good[8] = {1, 2, 3, 4, 5, 6, 7, 8}, bad[8] = {10, 11, 300, 13, 14, 15, 16, 17};
    char list[2048];
    const char *bad_path = write_shard("bad_token.bin", bad, 8);
    snprintf(list, sizeof list, "%s,%s", write_shard("ok.bin", good, 8), bad_path);
    moe_config cfg;
    shard_config(&cfg, 256, 4, list); /* 16 tokens; sequence s starts at 4s mod 12 */
    moe_data *d = NULL;
    assert_int_equal(moe_data_create(&d, &cfg), MOE_OK);
    int32_t tok[2 * 5];
    assert_int_equal(moe_data_batch(d, tok, 0, 2), MOE_OK); /* tokens 0..8: clean */
    const int32_t want[10] = {1, 2, 3, 4, 5, 5, 6, 7, 8, 10};
    assert_memory_equal(tok, want, sizeof want);
    assert_int_equal(moe_data_batch(d, tok, 3, 1), MOE_OK); /* 12 mod 12 = 0: clean */

    char msg[4096];
    capture cap;
    capture_begin(&cap);
    moe_status st = moe_data_batch(d, tok, 1, 2); /* sequence 2 reads tokens 8..12 */
    capture_end(&cap, msg, sizeof msg);
    assert_int_equal(st, MOE_ERR_INVALID);
    expect_in(msg, bad_path);
    expect_in(msg, "token 300 at position 2");
    expect_in(msg, "vocab_size = 256");
    moe_data_destroy(d);
}

int main(void)
{
    const struct CMUnitTest synthetic[] = {
        cmocka_unit_test(test_synthetic_deterministic), cmocka_unit_test(test_synthetic_bands),
        cmocka_unit_test(test_synthetic_rules),         cmocka_unit_test(test_synthetic_entropy),
        cmocka_unit_test(test_synthetic_invalid),       cmocka_unit_test(test_synthetic_topics),
    };
    const struct CMUnitTest shards[] = {
        cmocka_unit_test(test_shards_exact),
        cmocka_unit_test(test_shards_minimal),
        cmocka_unit_test(test_shards_errors),
        cmocka_unit_test(test_shards_bad_token),
    };
    int failed = cmocka_run_group_tests_name("synthetic", synthetic, NULL, NULL);
    failed += cmocka_run_group_tests_name("shards", shards, setup_dir, remove_dir);
    return failed != 0;
}
