/* runtime/trainer.c: the training loop, progress line and logs. */
#include "runtime/trainer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

moe_status moe_trainer_create(moe_trainer **out, const moe_config *cfg)
{
    moe_status st = MOE_OK;
    moe_trainer *tr = calloc(1, sizeof *tr);
    *out = NULL;
    if (!tr)
        MOE_FAIL(MOE_ERR_NOMEM, "cannot allocate the trainer");
    tr->cfg = *cfg;
    tr->world = 1;
    tr->rank = 0;
    MOE_CHECK_GOTO(st, moe_model_create(&tr->model, cfg, 0, cfg->experts));
    MOE_CHECK_GOTO(st, moe_data_create(&tr->data, cfg));
    MOE_CHECK_GOTO(st, moe_optimizer_create(&tr->opt, tr->model->n_params));
    tr->tokens = malloc(sizeof(int32_t) * (size_t)cfg->micro_batch * (cfg->seq_len + 1));
    if (!tr->tokens) {
        st = MOE_ERR_NOMEM;
        moe_log_at(__FILE__, __LINE__, "cannot allocate the token buffer");
        goto fail;
    }
    if (cfg->jsonl_path[0] && tr->rank == 0) {
        tr->jsonl = fopen(cfg->jsonl_path, "w");
        if (!tr->jsonl) {
            moe_log_at(__FILE__, __LINE__, "[log] jsonl: cannot open '%s' for writing: %m",
                       cfg->jsonl_path);
            st = MOE_ERR_IO;
            goto fail;
        }
    }
    *out = tr;
    return MOE_OK;
fail:
    moe_trainer_destroy(tr);
    return st;
}

void moe_trainer_destroy(moe_trainer *tr)
{
    if (!tr)
        return;
    if (tr->jsonl)
        fclose(tr->jsonl);
    free(tr->tokens);
    moe_optimizer_destroy(tr->opt);
    moe_data_destroy(tr->data);
    moe_model_destroy(tr->model);
    free(tr);
}

moe_status moe_trainer_accumulate(moe_trainer *tr, moe_step_result *res)
{
    moe_model *m = tr->model;
    const int micro = tr->cfg.micro_batch;
    const int accum = moe_config_accum_at(&tr->cfg, tr->step);
    const int64_t S = (int64_t)micro * tr->world * accum;
    double t0 = now_seconds();
    memset(res, 0, sizeof *res);
    res->step = tr->step;
    res->micro_batches = accum;
    res->sequences = S;
    memset(m->grads, 0, sizeof(real) * m->n_params);
    double ce = 0, aux = 0, z = 0;
    for (int j = 0; j < accum; j++) {
        int64_t first = tr->consumed + ((int64_t)j * tr->world + tr->rank) * micro;
        moe_fwd_stats fs;
        MOE_CHECK(moe_data_batch(tr->data, tr->tokens, first, micro));
        MOE_CHECK(moe_model_forward(m, tr->tokens, &fs));
        moe_model_backward(m, S);
        ce += fs.ce_sum;
        aux += fs.aux_sum;
        z += fs.z_sum;
        res->dropped += fs.dropped;
    }
    const double tokens = (double)S * tr->cfg.seq_len;
    res->ce = ce / tokens;
    res->aux = aux / ((double)tr->world * accum); /* mean over the step's micro-batches */
    res->z = z / tokens;
    res->loss = res->ce + tr->cfg.aux_loss_coef * res->aux + tr->cfg.z_loss_coef * res->z;
    res->seconds = now_seconds() - t0;
    return MOE_OK;
}

moe_status moe_trainer_apply(moe_trainer *tr, moe_step_result *res)
{
    moe_model *m = tr->model;
    double t0 = now_seconds();
    double norm = sqrt(sum_squares(m->grads, m->n_params));
    if (!isfinite(norm))
        MOE_FAIL(MOE_ERR_NUMERIC, "step %d: gradient norm is %g", tr->step, norm);
    res->grad_norm = norm;
    res->lr = moe_lr_at(&tr->cfg, tr->step);
    moe_optimizer_step(tr->opt, m, &tr->cfg, res->lr, moe_clip_scale(norm, tr->cfg.grad_clip));
    tr->consumed += res->sequences;
    tr->step++;
    res->seconds += now_seconds() - t0;
    return MOE_OK;
}

/* "41k", "1.2M": a compact count for the progress line. */
static void fmt_count(char *buf, size_t cap, double x)
{
    if (x >= 1e6)
        snprintf(buf, cap, "%.1fM", x / 1e6);
    else if (x >= 1e3)
        snprintf(buf, cap, "%.0fk", x / 1e3);
    else
        snprintf(buf, cap, "%.0f", x);
}

static void fmt_duration(char *buf, size_t cap, double s)
{
    if (s < 60)
        snprintf(buf, cap, "%.1fs", s);
    else if (s < 3600)
        snprintf(buf, cap, "%dm%02ds", (int)(s / 60), (int)fmod(s, 60));
    else
        snprintf(buf, cap, "%dh%02dm", (int)(s / 3600), (int)fmod(s / 60, 60));
}

static void print_progress(const moe_trainer *tr, const moe_step_result *r, double elapsed,
                           double tok_per_s, int tty, FILE *out)
{
    char tps[16], el[16], eta[16];
    int remaining = tr->cfg.steps - (r->step + 1);
    fmt_count(tps, sizeof tps, tok_per_s);
    fmt_duration(el, sizeof el, elapsed);
    fmt_duration(eta, sizeof eta, elapsed / (r->step + 1) * remaining);
    fprintf(out, "%sstep %d/%d loss %.4f aux %.4f lr %.1e norm %.3f tok/s %s elapsed %s eta %s",
            tty ? "\r\033[K" : "", r->step + 1, tr->cfg.steps, r->ce, r->aux, r->lr, r->grad_norm,
            tps, el, eta);
    if (r->dropped)
        fprintf(out, " dropped %lld", (long long)r->dropped);
    if (!tty)
        fputc('\n', out);
    fflush(out);
}

/* Per MoE layer: share of assignments of the least and most loaded expert, and max/mean,
 * since the last summary; then resets the counts. */
static void print_expert_load(moe_trainer *tr, int tty, FILE *out)
{
    moe_model *m = tr->model;
    if (tty)
        fputc('\n', out);
    for (int l = tr->cfg.dense_layers; l < m->L; l++) {
        int64_t *load = m->load + (size_t)l * m->E;
        int64_t total = 0, lo = load[0], hi = load[0];
        for (int e = 0; e < m->E; e++) {
            total += load[e];
            lo = load[e] < lo ? load[e] : lo;
            hi = load[e] > hi ? load[e] : hi;
        }
        double mean = (double)total / m->E;
        fprintf(out, "  expert load layer %d: min %.3f max %.3f max/mean %.2f\n", l,
                total ? (double)lo / total : 0.0, total ? (double)hi / total : 0.0,
                mean > 0 ? (double)hi / mean : 0.0);
        memset(load, 0, sizeof(int64_t) * m->E);
    }
}

static void write_jsonl(FILE *f, const moe_step_result *r, double tok_per_s)
{
    fprintf(f,
            "{\"step\":%d,\"loss\":%.9g,\"ce\":%.9g,\"aux\":%.9g,\"z\":%.9g,\"grad_norm\":%.9g,"
            "\"lr\":%.9g,\"sequences\":%lld,\"dropped\":%lld,\"step_s\":%.6f,\"tok_per_s\":%.1f}\n",
            r->step + 1, r->loss, r->ce, r->aux, r->z, r->grad_norm, r->lr,
            (long long)r->sequences, (long long)r->dropped, r->seconds, tok_per_s);
    fflush(f);
}

moe_status moe_trainer_run(moe_trainer *tr, FILE *out)
{
    const int tty = isatty(fileno(out));
    const int log_every = tr->cfg.log_interval;
    double start = now_seconds();
    int64_t tokens = 0;
    moe_step_result r = {0};
    while (tr->step < tr->cfg.steps) {
        MOE_CHECK(moe_trainer_accumulate(tr, &r));
        MOE_CHECK(moe_trainer_apply(tr, &r));
        tokens += r.sequences * tr->cfg.seq_len;
        double elapsed = now_seconds() - start;
        double tps = tokens / elapsed;
        int last = tr->step == tr->cfg.steps;
        if (tr->rank == 0 && (tr->step % log_every == 0 || last || tr->step == 1))
            print_progress(tr, &r, elapsed, tps, tty, out);
        if (tr->jsonl)
            write_jsonl(tr->jsonl, &r, tps);
        if (tr->rank == 0 && tr->cfg.expert_load_interval > 0 &&
            tr->step % tr->cfg.expert_load_interval == 0 && tr->cfg.dense_layers < tr->cfg.n_layers)
            print_expert_load(tr, tty, out);
    }
    if (tr->rank == 0) {
        double elapsed = now_seconds() - start;
        if (tty)
            fputc('\n', out);
        fprintf(out, "done: %d steps, final loss %.4f, %.0f tokens/s, %.1fs\n", tr->cfg.steps,
                r.ce, tokens / elapsed, elapsed);
    }
    return MOE_OK;
}
