/* tests/fuzz/fuzz_config.c: libFuzzer target for the config parser: any bytes as INI
 * text (and as one --set assignment), then validation. Must never crash, leak or read
 * out of bounds (built with ASan and UBSan by tests/fuzz/readers.sh, which runs it with
 * -close_fd_mask=2: the parser's messages go nowhere, the fuzzer's reports still show). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    if (!text)
        return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    moe_config cfg;
    moe_config_defaults(&cfg);
    if (moe_config_load_string(&cfg, text, "fuzz.ini") == MOE_OK) {
        (void)moe_config_validate(&cfg);
        size_t n = moe_config_to_ini(&cfg, NULL, 0);
        char *ini = malloc(n + 1);
        if (ini) {
            moe_config_to_ini(&cfg, ini, n + 1);
            moe_config again;
            moe_config_defaults(&again);
            (void)moe_config_load_string(&again, ini, "round-trip.ini");
            free(ini);
        }
    }
    moe_config_defaults(&cfg);
    (void)moe_config_set(&cfg, text);
    free(text);
    return 0;
}
