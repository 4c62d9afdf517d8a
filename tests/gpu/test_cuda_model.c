/* tests/gpu/test_cuda_model.c: the whole model on the "cuda" backend against the same
 * model on the CPU reference: same config, same weights (both initialise from the seed
 * on the host), same tokens; one forward and one backward. The loss terms must agree to
 * a relative 1e-5 and every gradient tensor to a relative norm error of 1e-4. Cases:
 * the embedded tiny config (dropless), and a capacity config with a shared expert that
 * drops assignments. Without a usable GPU it prints "SKIP: ..." and exits 77. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "runtime/config.h"
#include "runtime/model.h"
#include "util/rng.h"

#define LOSS_RTOL 1e-5
#define GRAD_RTOL 1e-4

static const moe_backend *gpu;

static int close_rel(const char *what, double g, double r, double rtol)
{
    double d = fabs(g - r), scale = fabs(r) > 1e-30 ? fabs(r) : 1.0;
    int ok = d <= rtol * scale;
    printf("  %-10s cpu %.10g cuda %.10g rel %.3g %s\n", what, r, g, d / scale, ok ? "" : "FAIL");
    return ok;
}

/* The discrete choices of every MoE layer (top-k experts, kept slots) must agree; a
 * difference prints the probabilities involved, to tell a near-tie from a bug. Returns
 * the number of layers that differ. */
static int compare_routing(const moe_model *mc, const moe_model *mg)
{
    const int N = mc->N, K = mc->K, E = mc->E;
    const size_t NK = (size_t)N * K, NE = (size_t)N * E;
    int32_t *idx = malloc(sizeof(int32_t) * NK), *slot_row = malloc(sizeof(int32_t) * NK);
    float *probs = malloc(sizeof(float) * NE);
    int bad_layers = 0;
    for (int l = mc->cfg.dense_layers; l < mc->L && idx && slot_row && probs; l++) {
        const moe_layer_acts *a = &mc->acts[l];
        gpu->copy(idx, mg->acts[l].idx, sizeof(int32_t) * NK, MOE_COPY_D2H);
        gpu->copy(slot_row, mg->acts[l].slot_row, sizeof(int32_t) * NK, MOE_COPY_D2H);
        gpu->copy(probs, mg->acts[l].probs, sizeof(float) * NE, MOE_COPY_D2H);
        int shown = 0, differ = 0;
        for (size_t i = 0; i < NK; i++) {
            if (idx[i] == a->idx[i] && (slot_row[i] >= 0) == (a->slot_row[i] >= 0))
                continue;
            differ++;
            if (shown++ < 3) {
                const size_t n = i / K;
                const int ec = a->idx[i], eg = idx[i];
                printf("  layer %d token %zu slot %zu: cpu expert %d (p %.9g, kept %d), cuda "
                       "expert %d (p %.9g, kept %d)\n",
                       l, n, i % K, ec, ec >= 0 ? a->probs[n * E + ec] : 0.0, a->slot_row[i] >= 0,
                       eg, eg >= 0 && eg < E ? probs[n * E + eg] : 0.0, slot_row[i] >= 0);
            }
        }
        if (differ) {
            printf("  FAIL layer %d: %d routing choices differ (a near-tie if the "
                   "probabilities above are within ~1e-6)\n",
                   l, differ);
            bad_layers++;
        }
    }
    free(idx);
    free(slot_row);
    free(probs);
    return bad_layers;
}

/* Returns the number of failures of one case. */
static int run_case(const char *name, const moe_config *cfg)
{
    moe_model *mc = NULL, *mg = NULL;
    int failed = 0;
    float *grads = NULL;
    int32_t *tokens = NULL;
    printf("case %s\n", name);
    if (moe_model_create(&mc, cfg, NULL, &moe_backend_cpu) != MOE_OK ||
        moe_model_create(&mg, cfg, NULL, gpu) != MOE_OK) {
        printf("FAIL %s: cannot create the models\n", name);
        failed = 1;
        goto done;
    }
    const int B = mc->B, T = mc->T, N = mc->N;
    tokens = malloc(sizeof(int32_t) * (size_t)B * (T + 1));
    grads = malloc(sizeof(float) * mg->n_params);
    if (!tokens || !grads) {
        printf("FAIL %s: out of host memory\n", name);
        failed = 1;
        goto done;
    }
    for (int i = 0; i < B * (T + 1); i++)
        tokens[i] = (int32_t)(moe_rng_u64(11, 3, i) % (uint64_t)cfg->vocab_size);

    moe_fwd_stats fc, fg;
    double ce_c = 0, ce_g = 0;
    if (moe_model_forward(mc, tokens, &fc) != MOE_OK ||
        moe_model_forward(mg, tokens, &fg) != MOE_OK || moe_model_take_ce(mc, &ce_c) != MOE_OK ||
        moe_model_take_ce(mg, &ce_g) != MOE_OK) {
        printf("FAIL %s: forward failed\n", name);
        failed = 1;
        goto done;
    }
    const double micro = 1.0; /* one micro-batch of B sequences */
    const double lc =
        ce_c / N + cfg->aux_loss_coef * fc.aux_sum / micro + cfg->z_loss_coef * fc.z_sum / N;
    const double lg =
        ce_g / N + cfg->aux_loss_coef * fg.aux_sum / micro + cfg->z_loss_coef * fg.z_sum / N;
    failed += !close_rel("loss", lg, lc, LOSS_RTOL);
    failed += !close_rel("ce_sum", ce_g, ce_c, LOSS_RTOL);
    failed += !close_rel("aux_sum", fg.aux_sum, fc.aux_sum, LOSS_RTOL);
    failed += !close_rel("z_sum", fg.z_sum, fc.z_sum, LOSS_RTOL);
    printf("  dropped    cpu %lld cuda %lld %s\n", (long long)fc.dropped, (long long)fg.dropped,
           fc.dropped == fg.dropped ? "" : "FAIL");
    failed += fc.dropped != fg.dropped;
    if (cfg->capacity_factor > 0 && fc.dropped == 0)
        printf("  note: the capacity case dropped nothing\n");

    failed += compare_routing(mc, mg);

    if (moe_model_backward(mc, B) != MOE_OK || moe_model_backward(mg, B) != MOE_OK ||
        gpu->sync() != MOE_OK) {
        printf("FAIL %s: backward failed\n", name);
        failed++;
        goto done;
    }
    gpu->copy(grads, mg->grads, sizeof(float) * mg->n_params, MOE_COPY_D2H);
    double worst = 0.0;
    for (int i = 0; i < mc->n_tensors; i++) {
        const moe_tensor *t = &mc->tensors[i];
        const float *r = mc->grads + t->offset, *g = grads + t->offset;
        double num = 0.0, den = 0.0;
        for (size_t j = 0; j < t->count; j++) {
            double d = (double)g[j] - r[j];
            num += d * d;
            den += (double)r[j] * r[j];
        }
        double err = den > 0 ? sqrt(num / den) : sqrt(num);
        if (!(err <= GRAD_RTOL)) {
            printf("  FAIL %-32s |d|/|ref| %.3g (|ref| %.3g)\n", t->name, err, sqrt(den));
            failed++;
        }
        if (!(err <= worst))
            worst = err;
    }
    printf("  gradients: %d tensors, worst relative norm error %.3g\n", mc->n_tensors, worst);
done:
    free(tokens);
    free(grads);
    moe_model_destroy(mc);
    moe_model_destroy(mg);
    printf("%s %s\n", failed ? "FAIL" : "PASS", name);
    return failed;
}

int main(void)
{
    const char *why = NULL;
    gpu = moe_backend_cuda(&why);
    if (!gpu) {
        printf("SKIP: no usable GPU: %s\n", why ? why : "unknown");
        return 77;
    }
    moe_config cfg;
    moe_config_defaults(&cfg);
    if (moe_config_load_string(&cfg, moe_config_tiny_ini, "tiny.ini") != MOE_OK) {
        printf("FAIL: cannot load the tiny config\n");
        return 1;
    }
    int failed = 0;
    failed += run_case("tiny (dropless)", &cfg);

    moe_config cap = cfg;
    cap.capacity_factor = 0.5;
    cap.shared_experts = 1;
    cap.renorm_topk = 0;
    cap.aux_loss_coef = 0.1;
    cap.z_loss_coef = 0.01;
    if (moe_config_validate(&cap) != MOE_OK) {
        printf("FAIL: the capacity config does not validate\n");
        return 1;
    }
    failed += run_case("capacity 0.5, shared expert, k weights not renormalised", &cap);

    moe_config k1 = cfg;
    k1.top_k = 1;
    k1.micro_batch = 3;
    k1.seq_len = 37;
    failed += run_case("top-1, B=3 T=37", &k1);

    printf("%s\n", failed ? "FAIL" : "PASS");
    return failed ? 1 : 0;
}
