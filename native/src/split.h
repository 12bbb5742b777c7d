/* split.h - how one buffer is cut into per-thread slices (internal, not installed).
 *
 * Why shared: the threaded host copy (copy.c) and the parallel CRC32C
 * (crc32c.c) split a buffer the same way, and a split that drops the
 * remainder loses bytes silently (the copy once left the last len % n bytes
 * uncopied and unhashed). One rule, in one place, tested through both users.
 */
#ifndef SX_SPLIT_H
#define SX_SPLIT_H

#include <stddef.h>
#include <unistd.h>

/* Below this many bytes per thread, thread start-up costs more than it saves. */
#define SPLIT_MIN_PER_THREAD ((size_t)4 << 20)
/* Slices start on cache-line multiples: threads never share a line of an aligned buffer. */
#define SPLIT_LINE ((size_t)64)

/* How many slices to cut len bytes into, given wanted (>= 1) and max threads. */
static inline size_t split_count(size_t len, size_t wanted, size_t max) {
    size_t n = wanted < max ? wanted : max;
    if (n > len / SPLIT_MIN_PER_THREAD) n = len / SPLIT_MIN_PER_THREAD;
    return n ? n : 1;
}

/* Online CPUs, asked once: sysconf reads a /sys file each call (tens of microseconds, measured as most of
 * the cost of CRC-checking a small tensor). */
static inline size_t split_online_cpus(void) {
    static long cached; /* 0 until known; a benign race: every writer stores the same value */
    long n = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (n <= 0) {
        n = sysconf(_SC_NPROCESSORS_ONLN);
        if (n <= 0) n = 1;
        __atomic_store_n(&cached, n, __ATOMIC_RELAXED);
    }
    return (size_t)n;
}

struct split_slice {
    size_t off, len;
};

/* Slice i of n: whole cache lines each, the last one takes whatever is left,
 * and a slice that would start past the end is empty. Together the n slices
 * cover [0, len) exactly once, in order. */
static inline struct split_slice split_slice(size_t len, size_t n, size_t i) {
    size_t per = (len / n + SPLIT_LINE - 1) & ~(SPLIT_LINE - 1);
    struct split_slice s = {len, 0};
    if (i * per >= len) return s;
    s.off = i * per;
    s.len = i + 1 < n && len - s.off > per ? per : len - s.off;
    return s;
}

#endif
