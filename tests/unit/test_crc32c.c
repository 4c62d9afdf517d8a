/* tests/unit/test_crc32c.c: util/crc32c.c against the standard check value, the empty
 * input, incremental use, and a bit-at-a-time reference on random data. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "util/crc32c.h"
#include "util/rng.h"

static void test_check_value(void **state)
{
    (void)state;
    assert_int_equal(moe_crc32c(0, "123456789", 9), 0xE3069283u);
    assert_int_equal(moe_crc32c(0, "", 0), 0);
    /* RFC 3720 B.4: 32 bytes of zeros, 32 bytes of 0xFF */
    unsigned char buf[32];
    memset(buf, 0, sizeof buf);
    assert_int_equal(moe_crc32c(0, buf, 32), 0x8A9136AAu);
    memset(buf, 0xFF, sizeof buf);
    assert_int_equal(moe_crc32c(0, buf, 32), 0x62A8AB43u);
}

static uint32_t bitwise(const unsigned char *p, size_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
    }
    return ~c;
}

static void test_incremental_and_reference(void **state)
{
    (void)state;
    unsigned char data[1000];
    for (size_t i = 0; i < sizeof data; i++)
        data[i] = (unsigned char)moe_rng_u64(7, 1, i);
    uint32_t whole = moe_crc32c(0, data, sizeof data);
    assert_int_equal(whole, bitwise(data, sizeof data));
    for (size_t cut = 0; cut <= sizeof data; cut += 37)
        assert_int_equal(moe_crc32c(moe_crc32c(0, data, cut), data + cut, sizeof data - cut),
                         whole);
    data[500] ^= 1; /* one flipped bit changes it */
    assert_int_not_equal(moe_crc32c(0, data, sizeof data), whole);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_check_value),
        cmocka_unit_test(test_incremental_and_reference),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
