/* crc32c.c - CRC32C (Castagnoli) with a run-time choice of kernel.
 * Placeholder portable implementation; SIMD kernels come next. */
#include "sneppx.h"

#include <pthread.h>
#include <string.h>

static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void build_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++) table[t][n] = (table[t - 1][n] >> 8) ^ table[0][table[t - 1][n] & 0xFF];
}

static uint32_t crc_portable(uint32_t crc, const unsigned char *p, size_t len) {
    pthread_once(&table_once, build_table);
    crc = ~crc;
    while (len && ((uintptr_t)p & 7)) { crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xFF]; len--; }
    while (len >= 8) {
        uint64_t w; memcpy(&w, p, 8); w ^= crc;
        crc = table[7][w & 0xFF] ^ table[6][(w >> 8) & 0xFF] ^ table[5][(w >> 16) & 0xFF] ^ table[4][(w >> 24) & 0xFF] ^
              table[3][(w >> 32) & 0xFF] ^ table[2][(w >> 40) & 0xFF] ^ table[1][(w >> 48) & 0xFF] ^ table[0][w >> 56];
        p += 8; len -= 8;
    }
    while (len--) crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xFF];
    return ~crc;
}

uint32_t sx_crc32c(uint32_t crc, const void *buf, size_t len) { return crc_portable(crc, buf, len); }
unsigned sx_crc32c_kernels(void) { return 1u << SX_CRC_PORTABLE; }
const char *sx_crc32c_kernel_name(int k) { return k == SX_CRC_PORTABLE ? "portable" : "unknown"; }
int sx_crc32c_with(int k, uint32_t crc, const void *buf, size_t len, uint32_t *out) {
    if (k != SX_CRC_PORTABLE) return SX_EINVAL;
    *out = crc_portable(crc, buf, len);
    return SX_OK;
}
static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    for (; vec; vec >>= 1, mat++) if (vec & 1) sum ^= *mat;
    return sum;
}
static void gf2_square(uint32_t *sq, const uint32_t *mat) { for (int n = 0; n < 32; n++) sq[n] = gf2_times(mat, mat[n]); }
uint32_t sx_crc32c_combine(uint32_t a, uint32_t b, uint64_t len_b) {
    uint32_t even[32], odd[32];
    if (!len_b) return a;
    odd[0] = 0x82F63B78u;
    for (int n = 1, row = 1; n < 32; n++, row <<= 1) odd[n] = (uint32_t)row;
    gf2_square(even, odd); gf2_square(odd, even);
    do {
        gf2_square(even, odd); if (len_b & 1) a = gf2_times(even, a); len_b >>= 1; if (!len_b) break;
        gf2_square(odd, even); if (len_b & 1) a = gf2_times(odd, a); len_b >>= 1;
    } while (len_b);
    return a ^ b;
}
uint32_t sx_crc32c_parallel(uint32_t crc, const void *buf, size_t len, int nthreads) {
    (void)nthreads; return sx_crc32c(crc, buf, len);
}
