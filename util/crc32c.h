/* util/crc32c.h: CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of
 * every checkpoint tensor slice. Table-driven, byte at a time; no hardware instructions.
 *
 * Owns: the checksum only. Does not own: where it is stored (runtime/checkpoint.c). */
#ifndef MOE_UTIL_CRC32C_H
#define MOE_UTIL_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Extends `crc` (the CRC-32C of the bytes before, 0 for none) over n bytes of data and
 * returns the CRC-32C of the whole. crc32c(0, "123456789", 9) == 0xE3069283. */
uint32_t moe_crc32c(uint32_t crc, const void *data, size_t n);

#endif
