/* util/crc32c.c: table-driven CRC-32C (see crc32c.h). The table is built once, on first
 * use, from the reflected polynomial; building it twice gives the same bytes, so a race
 * between two threads' first calls is harmless. */
#include "util/crc32c.h"

static uint32_t table[256];
static int table_ready;

static void build_table(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        table[i] = c;
    }
    table_ready = 1;
}

uint32_t moe_crc32c(uint32_t crc, const void *data, size_t n)
{
    if (!table_ready)
        build_table();
    const unsigned char *p = data;
    crc = ~crc;
    for (size_t i = 0; i < n; i++)
        crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
    return ~crc;
}
