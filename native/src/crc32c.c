/* crc32c.c - CRC32C (Castagnoli) with a run-time choice of kernel.
 *
 * Every byte of a checkpoint is hashed once on the save path and once on the
 * load path, so CRC speed is checkpoint speed: the goal is to run at memory
 * read bandwidth on one core. The package is built without -march flags (one
 * wheel for every x86-64), so each SIMD kernel carries its own GCC target
 * attribute and the fastest one this CPU can run is picked once, at first use.
 *
 * Kernels (see sneppx.h):
 *   portable    slicing-by-8 tables; any CPU, also the reference in tests.
 *   sse42       the crc32q instruction over three long contiguous streams (one
 *               crc32q has 3 cycles latency and 1 cycle throughput, so three
 *               independent streams keep it busy), merged by carry-less
 *               multiplication. Long streams rather than blocks a few KiB apart
 *               keep the hardware prefetcher on three sequential reads.
 *   vpclmul256  "folding" (Intel, "Fast CRC Computation for Generic Polynomials
 *   vpclmul512  Using PCLMULQDQ", 2009): many 128-bit lanes are multiplied
 *               forward by x^k mod P and xor-ed into the data k bits later, so
 *               only the last 16 bytes need a real reduction. Both widths are
 *               one macro body (FOLD_KERNEL) over a handful of vector
 *               primitives, so the 512-bit kernel shares every line of logic
 *               with the 256-bit one, which runs on more machines.
 *
 * Representation. CRC32C is bit-reflected: bit j of a 32-bit value is the
 * coefficient of x^(31-j), and the first message bit is bit 0 of byte 0. All
 * kernels work on the "raw" register (the public value with ~ applied), and
 * every constant is computed at init from the polynomial, never copied.
 */
#include "sneppx.h"
#include "split.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define SX_HAVE_X86 1
#else
#define SX_HAVE_X86 0
#endif

/* x^32 + x^28 + ... + 1 (0x1EDC6F41), bit-reflected, without the x^32 term. */
#define CRC32C_POLY_REFLECTED 0x82F63B78u
/* x^0 in the reflected representation. */
#define X_POW_0 0x80000000u

#define PARALLEL_MAX_THREADS 256

typedef uint32_t (*crc_raw_fn)(uint32_t raw, const unsigned char *p, size_t len);

/* ---- GF(2) arithmetic modulo P, portable --------------------------------- */

/* x * v mod P. */
static uint32_t mul_x(uint32_t v) { return (v >> 1) ^ (CRC32C_POLY_REFLECTED & (0u - (v & 1u))); }

/* a * b mod P: shift-and-add over the bits of a, highest degree first. */
static uint32_t mulmod_portable(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (uint32_t bit = X_POW_0; a; bit >>= 1) {
        if (a & bit) {
            product ^= b;
            a ^= bit;
        }
        b = mul_x(b);
    }
    return product;
}

static struct {
    uint32_t slice[8][256];      /* slicing-by-8 tables */
    uint32_t x_pow2k[64];        /* x^(2^k) mod P */
    unsigned kernels;            /* bit k: kernel k runs on this CPU */
    int best;
    crc_raw_fn fn[SX_CRC_NKERNELS];
#if SX_HAVE_X86
    /* Fold constants, (lo, hi) = (x^(8B+31), x^(8B-33)) mod P for a fold
     * forward by B bytes (derivation at fold_constants()). */
    __m128i fold16;              /* one 128-bit lane to the next */
    __m128i fold_block256;       /* across one main-loop block of the 256-bit kernel */
    __m128i fold_block512;       /* ... of the 512-bit kernel */
#endif
} G;

static pthread_once_t init_once = PTHREAD_ONCE_INIT;

/* x^(8 * nbytes) mod P in O(log n) multiplications: the shift that moves a
 * CRC past nbytes of following data. */
static uint32_t xpow8n_portable(uint64_t nbytes) {
    uint32_t acc = X_POW_0;
    for (unsigned k = 3; nbytes; nbytes >>= 1, k++)
        if (nbytes & 1) acc = mulmod_portable(G.x_pow2k[k & 63], acc);
    return acc;
}

/* ---- portable: slicing-by-8 ---------------------------------------------- */

static uint32_t crc_portable_raw(uint32_t crc, const unsigned char *p, size_t len) {
    while (len && ((uintptr_t)p & 7)) {
        crc = (crc >> 8) ^ G.slice[0][(crc ^ *p++) & 0xFF];
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        w ^= crc;
        crc = G.slice[7][w & 0xFF] ^ G.slice[6][(w >> 8) & 0xFF] ^ G.slice[5][(w >> 16) & 0xFF] ^
              G.slice[4][(w >> 24) & 0xFF] ^ G.slice[3][(w >> 32) & 0xFF] ^ G.slice[2][(w >> 40) & 0xFF] ^
              G.slice[1][(w >> 48) & 0xFF] ^ G.slice[0][w >> 56];
        p += 8;
        len -= 8;
    }
    while (len--) crc = (crc >> 8) ^ G.slice[0][(crc ^ *p++) & 0xFF];
    return crc;
}

#if SX_HAVE_X86
/* ---- x86: crc32 instruction + carry-less multiply ------------------------ */

#define TARGET_SSE42 __attribute__((target("sse4.2,pclmul")))
#define TARGET_V256 __attribute__((target("sse4.2,pclmul,avx2,vpclmulqdq")))
#define TARGET_V512 __attribute__((target("sse4.2,pclmul,avx2,avx512f,avx512vl,vpclmulqdq")))

static inline uint64_t load64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* a * b mod P. The carry-less product (degree <= 62), shifted up one place to
 * fill a reflected 64-bit word, is H * x^32 + L with H in the low half and L
 * (degree < 32, already reduced) in the high half; crc32 of H from a zero
 * register is exactly H * x^32 mod P. */
TARGET_SSE42 static inline uint32_t mulmod_hw(uint32_t a, uint32_t b) {
    __m128i product = _mm_clmulepi64_si128(_mm_cvtsi32_si128((int)a), _mm_cvtsi32_si128((int)b), 0x00);
    uint64_t d = (uint64_t)_mm_cvtsi128_si64(product) << 1;
    return _mm_crc32_u32(0, (uint32_t)d) ^ (uint32_t)(d >> 32);
}

TARGET_SSE42 static uint32_t xpow8n_hw(uint64_t nbytes) {
    uint32_t acc = X_POW_0;
    for (unsigned k = 3; nbytes; nbytes >>= 1, k++)
        if (nbytes & 1) acc = mulmod_hw(G.x_pow2k[k & 63], acc);
    return acc;
}

TARGET_SSE42 static uint32_t crc_sse42_bytes(uint32_t crc, const unsigned char *p, size_t len) {
    for (; len >= 8; p += 8, len -= 8) crc = (uint32_t)_mm_crc32_u64(crc, load64(p));
    for (; len; len--) crc = _mm_crc32_u8(crc, *p++);
    return crc;
}

/* Below this the two multiplications that merge the streams cost more than
 * the streams save. */
#define SSE42_STREAMS_MIN 192

TARGET_SSE42 static uint32_t crc_sse42_raw(uint32_t crc, const unsigned char *p, size_t len) {
    for (; len && ((uintptr_t)p & 7); len--) crc = _mm_crc32_u8(crc, *p++);
    if (len >= SSE42_STREAMS_MIN) {
        size_t stream = (len / 3) & ~(size_t)7;
        const unsigned char *a = p, *b = p + stream, *c = p + 2 * stream;
        uint64_t ca = crc, cb = 0, cc = 0;
        for (size_t i = 0; i < stream; i += 8) {
            ca = _mm_crc32_u64(ca, load64(a + i));
            cb = _mm_crc32_u64(cb, load64(b + i));
            cc = _mm_crc32_u64(cc, load64(c + i));
        }
        /* crc(A || B) = crc(A) * x^(8 |B|) + crc_from_zero(B), for raw registers. */
        uint32_t shift = xpow8n_hw(stream);
        crc = mulmod_hw((uint32_t)ca, shift) ^ (uint32_t)cb;
        crc = mulmod_hw(crc, shift) ^ (uint32_t)cc;
        p += 3 * stream;
        len -= 3 * stream;
    }
    return crc_sse42_bytes(crc, p, len);
}

/* x^n mod P for small n, by stepping. */
static uint32_t xpow_slow(unsigned n) {
    uint32_t v = X_POW_0;
    while (n--) v = mul_x(v);
    return v;
}

/* Folding, derived. A 16-byte lane X loaded little-endian holds the message
 * bits with bit j the coefficient of x^(127-j) (counted from the lane's end):
 * its low qword is the high half H (times x^64), its high qword the low half L.
 * Moving X forward by D bits is X * x^D = H * x^(64+D) + L * x^D. A carry-less
 * product of a 64-bit reflected half with a 32-bit reflected constant k lands,
 * read as a 128-bit lane, at half * k * x^33 (the bit positions add up to 33
 * fewer than the degrees). So the constants are k_lo = x^(64+D-33) and
 * k_hi = x^(D-33), and clmul(X.lo, k_lo) ^ clmul(X.hi, k_hi) is a lane
 * congruent to X * x^D, ready to xor into the data D bits later. */
static __m128i fold_constants(unsigned bytes) {
    return _mm_set_epi64x((long long)xpow_slow(8 * bytes - 33), (long long)xpow_slow(8 * bytes + 31));
}

TARGET_SSE42 static inline __m128i fold_lane(__m128i lane, __m128i k, __m128i next) {
    __m128i lo = _mm_clmulepi64_si128(lane, k, 0x00), hi = _mm_clmulepi64_si128(lane, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

/* Reduces the state after a folding loop, `lanes` in message order, to the
 * raw CRC at their end: folds them into one lane, whose CRC from a zero
 * register (everything before it is already folded in) is two crc32s. */
TARGET_SSE42 static uint32_t fold_reduce(const __m128i *lanes, size_t nlanes) {
    __m128i k = G.fold16, z = _mm_loadu_si128(lanes);
    for (size_t i = 1; i < nlanes; i++) z = fold_lane(z, k, _mm_loadu_si128(lanes + i));
    uint64_t crc = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(z));
    return (uint32_t)_mm_crc32_u64(crc, (uint64_t)_mm_extract_epi64(z, 1));
}

/* Below this the streams' merge (a few hundred cycles) costs more than fusing saves. */
#define FUSION_MIN 4096

/* One folding kernel over vectors of W bytes with NACC independent
 * accumulators (so the multiplier's latency overlaps), "fused" (corsix's
 * term) with NS crc32 streams of SQ bytes per iteration: the multiplier and
 * the crc32 unit are different execution units, so each iteration hashes
 * BLOCK bytes by folding and NS * SQ more with crc32 in about the time of
 * either. The buffer is cut into the folded region, then NS long scalar
 * streams, then a short tail:
 *
 *   | folded: iters * BLOCK | stream 0: iters * SQ | ... | stream NS-1 | tail |
 *
 * and the pieces are joined with crc(A || B) = crc(A) * x^(8 |B|) + crc(B).
 * Vector primitives: V type, LOADU(p), STOREU(p, v), XOR(a, b), XOR3(a, b, c),
 * CLMUL(a, k, imm), BCAST(k128) (a 128-bit value in every lane), LOW32(c)
 * (c in bits 0..31, zeros elsewhere). */
#define FOLD_KERNEL(NAME, TARGET, V, W, NACC, NS, SQ, K_BLOCK,                                             \
                    LOADU, STOREU, XOR, XOR3, CLMUL, BCAST, LOW32)                                         \
    TARGET static uint32_t NAME(uint32_t crc, const unsigned char *p, size_t len) {                        \
        enum { BLOCK = (W) * (NACC), LANES_PER_V = (W) / 16, STEP = BLOCK + (NS) * (SQ) };              \
        size_t head = (size_t)(-(uintptr_t)p & 63);                                                      \
        if (len < head + 2 * BLOCK) return crc_sse42_raw(crc, p, len);                                   \
        crc = crc_sse42_bytes(crc, p, head);                                                             \
        p += head;                                                                                       \
        len -= head;                                                                                     \
        size_t iters = len >= FUSION_MIN ? len / STEP : 0;                                               \
        size_t folded = iters ? iters * BLOCK : len / BLOCK * BLOCK, stream = iters * (SQ);              \
        const unsigned char *v = p, *s = p + folded;                                                     \
        uint64_t c[(NS)] = {0};                                                                          \
        V x[NACC];                                                                                       \
        for (int i = 0; i < (NACC); i++) x[i] = LOADU(v + i * (W));                                      \
        x[0] = XOR(x[0], LOW32(crc)); /* the running CRC enters as the first 32 message bits */          \
        const V k = BCAST(K_BLOCK);                                                                      \
        if (iters) {                                                                                     \
            for (v += BLOCK; v < p + folded; v += BLOCK, s += (SQ)) {                                    \
                for (int i = 0; i < (NACC); i++)                                                         \
                    x[i] = XOR3(CLMUL(x[i], k, 0x00), CLMUL(x[i], k, 0x11), LOADU(v + i * (W)));         \
                for (int q = 0; q < (SQ); q += 8)                                                        \
                    for (int j = 0; j < (NS); j++) c[j] = _mm_crc32_u64(c[j], load64(s + j * stream + q)); \
            }                                                                                            \
            for (int q = 0; q < (SQ); q += 8) /* streams have one iteration more than the loop */        \
                for (int j = 0; j < (NS); j++) c[j] = _mm_crc32_u64(c[j], load64(s + j * stream + q));   \
        } else {                                                                                         \
            for (v += BLOCK; v < p + folded; v += BLOCK)                                                 \
                for (int i = 0; i < (NACC); i++)                                                         \
                    x[i] = XOR3(CLMUL(x[i], k, 0x00), CLMUL(x[i], k, 0x11), LOADU(v + i * (W)));         \
        }                                                                                                \
        __m128i lanes[(NACC) * LANES_PER_V];                                                             \
        for (int i = 0; i < (NACC); i++) STOREU(lanes + i * LANES_PER_V, x[i]);                          \
        crc = fold_reduce(lanes, (NACC) * LANES_PER_V);                                                  \
        if (iters) {                                                                                     \
            uint32_t shift = xpow8n_hw(stream);                                                          \
            for (int j = 0; j < (NS); j++) crc = mulmod_hw(crc, shift) ^ (uint32_t)c[j];                 \
        }                                                                                                \
        size_t done = folded + (NS) * stream;                                                            \
        return crc_sse42_raw(crc, p + done, len - done);                                                 \
    }

#define V256_LOADU(p) _mm256_loadu_si256((const __m256i *)(p))
#define V256_STOREU(p, v) _mm256_storeu_si256((__m256i *)(p), (v))
#define V256_XOR(a, b) _mm256_xor_si256((a), (b))
#define V256_XOR3(a, b, c) _mm256_xor_si256(_mm256_xor_si256((a), (b)), (c))
#define V256_CLMUL(a, k, imm) _mm256_clmulepi64_epi128((a), (k), (imm))
#define V256_BCAST(k) _mm256_broadcastsi128_si256(k)
#define V256_LOW32(c) _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)(c)))

#define V512_LOADU(p) _mm512_loadu_si512((const void *)(p))
#define V512_STOREU(p, v) _mm512_storeu_si512((void *)(p), (v))
#define V512_XOR(a, b) _mm512_xor_si512((a), (b))
#define V512_XOR3(a, b, c) _mm512_ternarylogic_epi64((a), (b), (c), 0x96)
#define V512_CLMUL(a, k, imm) _mm512_clmulepi64_epi128((a), (k), (imm))
#define V512_BCAST(k) _mm512_broadcast_i32x4(k)
#define V512_LOW32(c) _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)(c)))

FOLD_KERNEL(crc_vpclmul256_raw, TARGET_V256, __m256i, 32, 8, 3, 64, G.fold_block256, V256_LOADU, V256_STOREU,
            V256_XOR, V256_XOR3, V256_CLMUL, V256_BCAST, V256_LOW32)
FOLD_KERNEL(crc_vpclmul512_raw, TARGET_V512, __m512i, 64, 4, 3, 40, G.fold_block512, V512_LOADU, V512_STOREU,
            V512_XOR, V512_XOR3, V512_CLMUL, V512_BCAST, V512_LOW32)

static unsigned detect_x86_kernels(void) {
    unsigned mask = 0;
    __builtin_cpu_init();
    /* Every folding kernel also uses crc32 and 128-bit clmul for its edges. */
    if (!__builtin_cpu_supports("sse4.2") || !__builtin_cpu_supports("pclmul")) return 0;
    mask |= 1u << SX_CRC_SSE42;
    if (__builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("avx2")) {
        mask |= 1u << SX_CRC_VPCLMUL256;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl"))
            mask |= 1u << SX_CRC_VPCLMUL512;
    }
    return mask;
}
#endif /* SX_HAVE_X86 */

/* ---- init and dispatch ----------------------------------------------------- */

static void init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (CRC32C_POLY_REFLECTED & (0u - (c & 1u)));
        G.slice[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++) {
            uint32_t prev = G.slice[t - 1][n];
            G.slice[t][n] = (prev >> 8) ^ G.slice[0][prev & 0xFF];
        }
    G.x_pow2k[0] = X_POW_0 >> 1; /* x^1 */
    for (int k = 1; k < 64; k++) G.x_pow2k[k] = mulmod_portable(G.x_pow2k[k - 1], G.x_pow2k[k - 1]);

    G.kernels = 1u << SX_CRC_PORTABLE;
    G.fn[SX_CRC_PORTABLE] = crc_portable_raw;
#if SX_HAVE_X86
    G.kernels |= detect_x86_kernels();
    G.fold16 = fold_constants(16);
    G.fold_block256 = fold_constants(32 * 8);
    G.fold_block512 = fold_constants(64 * 4);
    G.fn[SX_CRC_SSE42] = crc_sse42_raw;
    G.fn[SX_CRC_VPCLMUL256] = crc_vpclmul256_raw;
    G.fn[SX_CRC_VPCLMUL512] = crc_vpclmul512_raw;
#endif
    G.best = SX_CRC_PORTABLE;
    for (int k = 0; k < SX_CRC_NKERNELS; k++)
        if (G.kernels & (1u << k)) G.best = k;
}

static inline void ensure_init(void) { pthread_once(&init_once, init); }

uint32_t sx_crc32c(uint32_t crc, const void *buf, size_t len) {
    ensure_init();
    if (!len) return crc;
    return ~G.fn[G.best](~crc, buf, len);
}

unsigned sx_crc32c_kernels(void) {
    ensure_init();
    return G.kernels;
}

const char *sx_crc32c_kernel_name(int kernel) {
    static const char *const names[SX_CRC_NKERNELS] = {"portable", "sse42", "vpclmul256", "vpclmul512"};
    return kernel >= 0 && kernel < SX_CRC_NKERNELS ? names[kernel] : "unknown";
}

int sx_crc32c_with(int kernel, uint32_t crc, const void *buf, size_t len, uint32_t *out) {
    ensure_init();
    if (!out || kernel < 0 || kernel >= SX_CRC_NKERNELS || !(G.kernels & (1u << kernel))) return SX_EINVAL;
    if (!buf && len) return SX_EINVAL;
    *out = len ? ~G.fn[kernel](~crc, buf, len) : crc;
    return SX_OK;
}

/* Linear in each argument, so the ~ of the public values cancels out:
 * crc(A || B) = crc(A) * x^(8 len_b) + crc(B). */
uint32_t sx_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
    ensure_init();
    if (!len_b) return crc_a; /* B is empty, so crc(B) is 0 */
    return mulmod_portable(xpow8n_portable(len_b), crc_a) ^ crc_b;
}

struct crc_job {
    const unsigned char *p;
    size_t len;
    uint32_t crc;
};

static void *crc_job_run(void *arg) {
    struct crc_job *job = arg;
    job->crc = sx_crc32c(0, job->p, job->len);
    return NULL;
}

uint32_t sx_crc32c_parallel(uint32_t crc, const void *buf, size_t len, int nthreads) {
    size_t n = split_count(len, nthreads > 0 ? (size_t)nthreads : split_online_cpus(), PARALLEL_MAX_THREADS);
    if (n == 1) return sx_crc32c(crc, buf, len);

    struct crc_job jobs[PARALLEL_MAX_THREADS];
    pthread_t threads[PARALLEL_MAX_THREADS];
    int started[PARALLEL_MAX_THREADS];
    const unsigned char *p = buf;
    for (size_t i = 0; i < n; i++) {
        struct split_slice s = split_slice(len, n, i);
        jobs[i].p = p + s.off;
        jobs[i].len = s.len;
    }
    /* The caller hashes chunk 0 itself; a thread that can't start is run inline. */
    for (size_t i = 1; i < n; i++) {
        started[i] = pthread_create(&threads[i], NULL, crc_job_run, &jobs[i]) == 0;
        if (!started[i]) crc_job_run(&jobs[i]);
    }
    crc = sx_crc32c(crc, jobs[0].p, jobs[0].len);
    for (size_t i = 1; i < n; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        crc = sx_crc32c_combine(crc, jobs[i].crc, jobs[i].len);
    }
    return crc;
}

/* ---- many ranges, all threads ------------------------------------------------ */

/* One thread's share of the ranges: the bytes [from, to) of their concatenation. */
struct ranges_job {
    const unsigned char *base;
    const uint64_t *offsets, *lengths;
    size_t n;
    uint64_t from, to;
    uint32_t *part_crcs; /* per range: CRC of the part of it in [from, to), 0 when none */
};

static void *ranges_job_run(void *arg) {
    struct ranges_job *job = arg;
    uint64_t start = 0; /* of range i in the concatenation */
    for (size_t i = 0; i < job->n && start < job->to; start += job->lengths[i], i++) {
        uint64_t lo = job->from > start ? job->from : start;
        uint64_t hi = job->to < start + job->lengths[i] ? job->to : start + job->lengths[i];
        if (lo < hi) job->part_crcs[i] = sx_crc32c(0, job->base + job->offsets[i] + (lo - start), hi - lo);
    }
    return NULL;
}

int sx_crc32c_ranges(const void *base, size_t n, const uint64_t *offsets, const uint64_t *lengths, uint32_t *crcs,
                     int nthreads) {
    if (!n) return SX_OK;
    if (!base || !offsets || !lengths || !crcs) return SX_EINVAL;
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) total += lengths[i];
    size_t t = split_count(total, nthreads > 0 ? (size_t)nthreads : split_online_cpus(), PARALLEL_MAX_THREADS);
    uint32_t *parts = calloc(t * n, sizeof *parts);
    struct ranges_job *jobs = calloc(t, sizeof *jobs);
    pthread_t *threads = calloc(t, sizeof *threads);
    int *started = calloc(t, sizeof *started);
    if (!parts || !jobs || !threads || !started) {
        free(parts); free(jobs); free(threads); free(started);
        return SX_ENOMEM;
    }
    for (size_t k = 0; k < t; k++) {
        struct split_slice s = split_slice(total, t, k);
        jobs[k] = (struct ranges_job){base, offsets, lengths, n, s.off, s.off + s.len, parts + k * n};
    }
    /* The caller takes share 0; a thread that can't start is run inline. */
    for (size_t k = 1; k < t; k++) {
        started[k] = pthread_create(&threads[k], NULL, ranges_job_run, &jobs[k]) == 0;
        if (!started[k]) ranges_job_run(&jobs[k]);
    }
    ranges_job_run(&jobs[0]);
    for (size_t k = 1; k < t; k++)
        if (started[k]) pthread_join(threads[k], NULL);
    /* Each range is the CRCs of its parts, in share order, combined. */
    uint64_t start = 0;
    for (size_t i = 0; i < n; start += lengths[i], i++) {
        uint32_t crc = 0;
        for (size_t k = 0; k < t; k++) {
            uint64_t lo = jobs[k].from > start ? jobs[k].from : start;
            uint64_t hi = jobs[k].to < start + lengths[i] ? jobs[k].to : start + lengths[i];
            if (lo < hi) crc = sx_crc32c_combine(crc, parts[k * n + i], hi - lo);
        }
        crcs[i] = crc;
    }
    free(parts); free(jobs); free(threads); free(started);
    return SX_OK;
}
