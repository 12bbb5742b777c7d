/* membench.c - the memory read ceiling, for benchmarks only.
 *
 * Why: a CRC that claims to run "at memory speed" needs the memory's speed
 * measured by something that does nothing but read. A numpy reduction is not
 * that (it reads through 8-byte scalars or a narrower vector than the CPU has),
 * so this is a loop of the widest loads the CPU runs, xor-ed into eight
 * independent accumulators (no dependency chain, nothing the compiler can drop).
 * Like the CRC kernels, each width carries its own GCC target attribute and is
 * chosen at run time.
 */
#include "sneppx.h"

#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define SX_HAVE_X86 1
#else
#define SX_HAVE_X86 0
#endif

static uint64_t read_portable(const unsigned char *p, size_t len, size_t *done) {
    uint64_t a[8] = {0};
    size_t i = 0;
    for (; i + 64 <= len; i += 64)
        for (int k = 0; k < 8; k++) {
            uint64_t v;
            memcpy(&v, p + i + 8 * k, 8);
            a[k] ^= v;
        }
    *done = i;
    return a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
}

#if SX_HAVE_X86
__attribute__((target("avx2"))) static uint64_t read_avx2(const unsigned char *p, size_t len, size_t *done) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    size_t i = 0;
    for (; i + 256 <= len; i += 256) {
        const __m256i *v = (const __m256i *)(p + i);
        a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(v + 0));
        a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(v + 1));
        a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(v + 2));
        a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(v + 3));
        a4 = _mm256_xor_si256(a4, _mm256_loadu_si256(v + 4));
        a5 = _mm256_xor_si256(a5, _mm256_loadu_si256(v + 5));
        a6 = _mm256_xor_si256(a6, _mm256_loadu_si256(v + 6));
        a7 = _mm256_xor_si256(a7, _mm256_loadu_si256(v + 7));
    }
    __m256i x = _mm256_xor_si256(_mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)),
                                 _mm256_xor_si256(_mm256_xor_si256(a4, a5), _mm256_xor_si256(a6, a7)));
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)out, x);
    *done = i;
    return out[0] ^ out[1] ^ out[2] ^ out[3];
}

__attribute__((target("avx512f"))) static uint64_t read_avx512(const unsigned char *p, size_t len, size_t *done) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    size_t i = 0;
    for (; i + 512 <= len; i += 512) {
        const unsigned char *q = p + i;
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(q + 0));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(q + 64));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(q + 128));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(q + 192));
        a4 = _mm512_xor_si512(a4, _mm512_loadu_si512(q + 256));
        a5 = _mm512_xor_si512(a5, _mm512_loadu_si512(q + 320));
        a6 = _mm512_xor_si512(a6, _mm512_loadu_si512(q + 384));
        a7 = _mm512_xor_si512(a7, _mm512_loadu_si512(q + 448));
    }
    __m512i x = _mm512_xor_si512(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)),
                                 _mm512_xor_si512(_mm512_xor_si512(a4, a5), _mm512_xor_si512(a6, a7)));
    uint64_t out[8];
    _mm512_storeu_si512(out, x);
    *done = i;
    return out[0] ^ out[1] ^ out[2] ^ out[3] ^ out[4] ^ out[5] ^ out[6] ^ out[7];
}

/* Four streams a quarter of the buffer apart, read side by side: the CRC kernels read three long streams,
 * which a core's prefetchers serve faster than one, so one stream alone is not the ceiling they run against. */
__attribute__((target("avx512f"))) static uint64_t read_avx512_streams(const unsigned char *p, size_t len,
                                                                        size_t *done) {
    size_t quarter = len / 4 / 512 * 512;
    const unsigned char *s0 = p, *s1 = p + quarter, *s2 = p + 2 * quarter, *s3 = p + 3 * quarter;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (size_t i = 0; i < quarter; i += 128) {
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(s0 + i));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(s0 + i + 64));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(s1 + i));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(s1 + i + 64));
        a4 = _mm512_xor_si512(a4, _mm512_loadu_si512(s2 + i));
        a5 = _mm512_xor_si512(a5, _mm512_loadu_si512(s2 + i + 64));
        a6 = _mm512_xor_si512(a6, _mm512_loadu_si512(s3 + i));
        a7 = _mm512_xor_si512(a7, _mm512_loadu_si512(s3 + i + 64));
    }
    __m512i x = _mm512_xor_si512(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)),
                                 _mm512_xor_si512(_mm512_xor_si512(a4, a5), _mm512_xor_si512(a6, a7)));
    uint64_t out[8];
    _mm512_storeu_si512(out, x);
    *done = 4 * quarter;
    return out[0] ^ out[1] ^ out[2] ^ out[3] ^ out[4] ^ out[5] ^ out[6] ^ out[7];
}
#endif

unsigned sx_memory_read_widths(void) {
    unsigned mask = 1u << 0;
#if SX_HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) mask |= 1u << 1;
    if (__builtin_cpu_supports("avx512f")) mask |= 1u << 2 | 1u << 3;
#endif
    return mask;
}

int sx_memory_read(int width, const void *buf, size_t len, uint64_t *out) {
    if (!out || (!buf && len) || width < 0 || width > 3 || !(sx_memory_read_widths() & (1u << width)))
        return SX_EINVAL;
    const unsigned char *p = buf;
    size_t done = 0;
    uint64_t x = 0;
#if SX_HAVE_X86
    if (width == 3) x = read_avx512_streams(p, len, &done);
    else if (width == 2) x = read_avx512(p, len, &done);
    else if (width == 1) x = read_avx2(p, len, &done);
    else
#endif
        x = read_portable(p, len, &done);
    for (; done + 8 <= len; done += 8) { /* the same fold whatever the width: whole words, then bytes */
        uint64_t v;
        memcpy(&v, p + done, 8);
        x ^= v;
    }
    for (; done < len; done++) x ^= p[done];
    *out = x;
    return SX_OK;
}
