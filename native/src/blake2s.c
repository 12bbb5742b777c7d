/* blake2s.c - BLAKE2s (RFC 7693), keyed: the heartbeat datagrams' MAC.
 *
 * Why BLAKE2s and why by hand: the C heartbeat thread authenticates every
 * datagram without the GIL, so the MAC must live in C; the build links no
 * crypto library (cffi API mode, nothing but libc). Keyed BLAKE2s is a PRF
 * by design (no HMAC nesting: one compression per 64-byte block, two for a
 * heartbeat), takes a 256-bit key, is what WireGuard uses for its keyed
 * 128-bit MACs, and its reference code is a page. Tests check it against the
 * RFC's self-test and against Python's hashlib.blake2s(key=..., digest_size=16).
 */
#include "sneppx.h"
#include "blake2s.h"

#include <string.h>

static const uint32_t IV[8] = {0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A,
                               0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19};

static const uint8_t SIGMA[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static inline uint32_t load32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint32_t rotr32(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

#define G(a, b, c, d, x, y)                                                                                      \
    do {                                                                                                         \
        v[a] = v[a] + v[b] + (x);                                                                                \
        v[d] = rotr32(v[d] ^ v[a], 16);                                                                          \
        v[c] = v[c] + v[d];                                                                                      \
        v[b] = rotr32(v[b] ^ v[c], 12);                                                                          \
        v[a] = v[a] + v[b] + (y);                                                                                \
        v[d] = rotr32(v[d] ^ v[a], 8);                                                                           \
        v[c] = v[c] + v[d];                                                                                      \
        v[b] = rotr32(v[b] ^ v[c], 7);                                                                           \
    } while (0)

static void compress(blake2s_state *s, const uint8_t block[64], int last) {
    uint32_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load32(block + 4 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= s->t[0];
    v[13] ^= s->t[1];
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 10; r++) {
        const uint8_t *z = SIGMA[r];
        G(0, 4, 8, 12, m[z[0]], m[z[1]]);
        G(1, 5, 9, 13, m[z[2]], m[z[3]]);
        G(2, 6, 10, 14, m[z[4]], m[z[5]]);
        G(3, 7, 11, 15, m[z[6]], m[z[7]]);
        G(0, 5, 10, 15, m[z[8]], m[z[9]]);
        G(1, 6, 11, 12, m[z[10]], m[z[11]]);
        G(2, 7, 8, 13, m[z[12]], m[z[13]]);
        G(3, 4, 9, 14, m[z[14]], m[z[15]]);
    }
    for (int i = 0; i < 8; i++) s->h[i] ^= v[i] ^ v[i + 8];
}

static void add_bytes(blake2s_state *s, uint32_t n) {
    s->t[0] += n;
    if (s->t[0] < n) s->t[1]++;
}

int blake2s_init(blake2s_state *s, size_t outlen, const void *key, size_t keylen) {
    if (outlen == 0 || outlen > 32 || keylen > 32 || (keylen && !key)) return SX_EINVAL;
    memset(s, 0, sizeof *s);
    memcpy(s->h, IV, sizeof IV);
    s->h[0] ^= 0x01010000u ^ (uint32_t)keylen << 8 ^ (uint32_t)outlen; /* parameter block: depth 1, fanout 1 */
    s->outlen = outlen;
    if (keylen) { /* the key is the first block, zero-padded */
        memcpy(s->buf, key, keylen);
        s->buflen = 64;
    }
    return SX_OK;
}

void blake2s_absorb_key(blake2s_state *s) {
    if (s->buflen == 64 && s->t[0] == 0 && s->t[1] == 0) {
        add_bytes(s, 64);
        compress(s, s->buf, 0);
        s->buflen = 0;
    }
}

void blake2s_update(blake2s_state *s, const void *in, size_t len) {
    const uint8_t *p = in;
    while (len) {
        if (s->buflen == 64) { /* only compress a full buffer once more input follows: the last block is special */
            add_bytes(s, 64);
            compress(s, s->buf, 0);
            s->buflen = 0;
        }
        size_t take = 64 - s->buflen < len ? 64 - s->buflen : len;
        memcpy(s->buf + s->buflen, p, take);
        s->buflen += take;
        p += take;
        len -= take;
    }
}

void blake2s_final(blake2s_state *s, void *out) {
    add_bytes(s, (uint32_t)s->buflen);
    memset(s->buf + s->buflen, 0, 64 - s->buflen);
    compress(s, s->buf, 1);
    uint8_t full[32];
    for (int i = 0; i < 8; i++) {
        full[4 * i] = (uint8_t)s->h[i];
        full[4 * i + 1] = (uint8_t)(s->h[i] >> 8);
        full[4 * i + 2] = (uint8_t)(s->h[i] >> 16);
        full[4 * i + 3] = (uint8_t)(s->h[i] >> 24);
    }
    memcpy(out, full, s->outlen);
    memset(s, 0, sizeof *s); /* the state holds key material */
}

int sx_blake2s(void *out, size_t outlen, const void *key, size_t keylen, const void *in, size_t inlen) {
    blake2s_state s;
    if (!out || (inlen && !in)) return SX_EINVAL;
    int rc = blake2s_init(&s, outlen, key, keylen);
    if (rc != SX_OK) return rc;
    blake2s_update(&s, in, inlen);
    blake2s_final(&s, out);
    return SX_OK;
}

int sx_equal_ct(const void *a, const void *b, size_t len) {
    const volatile uint8_t *x = a, *y = b;
    uint8_t diff = 0;
    for (size_t i = 0; i < len; i++) diff |= x[i] ^ y[i];
    return diff == 0;
}
