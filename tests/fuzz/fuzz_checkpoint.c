/* tests/fuzz/fuzz_checkpoint.c: libFuzzer target for the checkpoint readers. The input
 * is split at the first 0xFF 0xFE pair into a manifest.pb and a rank-00000.bin; a valid
 * COMMITTED marker is written for that manifest (so the fuzzer gets past the marker's
 * checksum into the protobuf unpacking and the structural checks), then the checkpoint
 * is inspected (every slice read and verified) and exported (the safetensors writer).
 * The marker parser itself is fuzzed with a second split. Must never crash, leak or
 * read out of bounds (ASan and UBSan, see tests/fuzz/readers.sh). comm/ is stubbed:
 * these paths run in one process. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "comm/comm.h"
#include "runtime/checkpoint.h"
#include "runtime/model.h"
#include "util/crc32c.h"

/* one-process stubs of what checkpoint.c links from comm/ */
moe_status moe_comm_sum_int64(moe_comm *c, moe_group g, int64_t *vals, int n)
{
    (void)c, (void)g, (void)vals, (void)n;
    return MOE_OK;
}
moe_status moe_comm_gather_bytes(moe_comm *c, const void *data, size_t nbytes, void **out,
                                 size_t *sizes)
{
    (void)c, (void)data, (void)nbytes, (void)sizes;
    *out = NULL;
    return MOE_ERR_COMM;
}
void moe_comm_set_context(moe_comm *c, const char *phase, int layer)
{
    (void)c, (void)phase, (void)layer;
}
int moe_comm_rank(const moe_comm *c, moe_group g)
{
    (void)c, (void)g;
    return 0;
}
int moe_comm_size(const moe_comm *c, moe_group g)
{
    (void)c, (void)g;
    return 1;
}
/* ... and from runtime/model.c: resume adopts a placement; the readers never resume */
moe_status moe_model_set_placement(moe_model *m, const int *expert_rank)
{
    (void)m, (void)expert_rank;
    return MOE_ERR_INVALID;
}

static char dir[64], out[80];

static void put(const char *name, const void *data, size_t n)
{
    char path[160];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f)
        abort();
    if (n && fwrite(data, 1, n, f) != n)
        abort();
    fclose(f);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!dir[0]) {
        snprintf(dir, sizeof dir, "/tmp/fuzz_ckpt.%d", (int)getpid());
        snprintf(out, sizeof out, "%s.out", dir);
        if (mkdir(dir, 0755) != 0)
            abort();
    }
    size_t cut = size;
    for (size_t i = 0; i + 1 < size; i++)
        if (data[i] == 0xFF && data[i + 1] == 0xFE) {
            cut = i;
            break;
        }
    const uint8_t *manifest = data, *tensors = cut < size ? data + cut + 2 : data + size;
    size_t mn = cut, tn = cut < size ? size - cut - 2 : 0;
    put("manifest.pb", manifest, mn);
    put("rank-00000.bin", tensors, tn);
    char marker[160];
    int len = snprintf(marker, sizeof marker,
                       "moe-dist checkpoint\nstep %d\nmanifest_bytes %zu\nmanifest_crc32c 0x%08x\n",
                       size > 0 ? data[0] & 1 : 0, mn, (unsigned)moe_crc32c(0, manifest, mn));
    put("COMMITTED", marker, (size_t)len);
    FILE *sink = fopen("/dev/null", "w");
    (void)moe_checkpoint_inspect(dir, sink);
    fclose(sink);
    (void)moe_checkpoint_export_safetensors(dir, out);
    /* the marker parser on raw bytes */
    put("COMMITTED", data, size < 4096 ? size : 4096);
    sink = fopen("/dev/null", "w");
    (void)moe_checkpoint_inspect(dir, sink);
    fclose(sink);
    return 0;
}
