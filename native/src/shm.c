/* shm.c - collectives through shared memory between the ranks of one host (allreduce, reduce-scatter,
 * allgather, broadcast, barrier), with the TCP ring's failure semantics.
 *
 * Why: on one host the TCP ring copies every byte through the kernel twice per hop; here each rank copies
 * its data into a segment all ranks map, each reduces its share of it in place, and each copies the result
 * out: about three passes over the data per rank, at memory speed.
 *
 * The segment: a header (magic, generation, world, the first failure), one 64-byte record per rank (its pid,
 * a `posted` counter of the phases it has finished, the call it is in), then two sets of `world` slots of
 * slot_bytes each. A call is a sequence of chunks; a chunk uses set (chunk number mod 2) and two or three
 * phases: every rank writes its own slot and posts (phase A), waits until every rank has posted A, then
 * reads what it needs (reducing its share in place: phase B) and posts again. A slot set is written again
 * two chunks later, by which time every rank has posted A of the chunk in between, i.e. finished reading it.
 *
 * Waiting: a short spin on the counter, then FUTEX_WAIT on it (shared, woken by each post) with a 2 ms
 * timeout, after which the peers' pidfds are polled: a SIGKILLed peer closes no socket here, but its pidfd
 * becomes readable when it exits. The first rank to see a failure (a dead peer, its own abort, a deadline,
 * ranks in different calls) writes it into the header and wakes every counter, so every rank fails at once
 * with the same error, naming the same rank: the one that died, left, never came (a stopped peer ends in the
 * first waiter's deadline) or called something else.
 */
#define _GNU_SOURCE
#include "reduce.h"
#include "sneppx.h"
#include "status.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SHM_MAGIC 0x314d485358504e53ULL /* "SNPXSHM1" little-endian */
#define MAX_LOCAL 1024
#define SPINS 256     /* reads of a counter before yielding the CPU between reads */
#define YIELD_S 50e-6 /* then yielding (a peer that needs this core runs) this long before sleeping on it */
#define PEER_CHECK_S 0.002 /* a dead peer is seen within about this */
#define NAME_MAX_LEN 255

enum { OP_ALLREDUCE = 1, OP_REDUCE_SCATTER = 2, OP_ALLGATHER = 3, OP_BROADCAST = 4, OP_BARRIER = 5 };

struct shm_head {
    uint64_t magic;
    uint64_t generation;
    uint32_t world;
    uint32_t attached; /* futex: ranks that have mapped the segment */
    uint64_t slot_bytes;
    int32_t failed;      /* 0, or the SX_E* status of the first failure of any rank */
    int32_t failed_rank; /* the rank that died or left, or -1 */
    int32_t failed_outer; /* the rank an enclosing group blames for it, plus one (sx_shm_relay); 0: none */
};

struct shm_rank { /* one 64-byte line per rank: a rank's counter is written by it alone */
    uint32_t posted; /* futex: phases this rank has finished */
    int32_t pid;
    uint64_t call[2]; /* (op, dtype, count, root) of its call number n, in call[n % 2]: see check_calls */
    char pad[40];
};

_Static_assert(sizeof(struct shm_rank) == 64, "a rank's record is one 64-byte line");

struct sx_shm {
    int rank, world;
    uint64_t generation;
    size_t slot, size;
    unsigned char *base, *data;
    struct shm_head *head;
    struct shm_rank *ranks;
    int *pidfds; /* per peer, -1 for itself (and where pidfd_open is refused) */
    uint32_t posted;   /* this rank's count, mirrored */
    uint64_t calls, chunks;
    int aborted, failed, failed_peer, failed_outer;
    int named, unlinked; /* every rank that opened the name unlinks it if setup did not: a setup that failed
                          * leaks nothing, also when its creator was SIGKILLed in it */
    char name[NAME_MAX_LEN + 1];
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

static void futex_wait(uint32_t *word, uint32_t seen, double seconds) {
    struct timespec ts = {.tv_sec = (time_t)seconds, .tv_nsec = (long)((seconds - floor(seconds)) * 1e9)};
    syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, NULL, 0); /* shared: no FUTEX_PRIVATE_FLAG */
}

static void futex_wake(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

static void wake_everyone(sx_shm *c) {
    futex_wake(&c->head->attached);
    for (int r = 0; r < c->world; r++) futex_wake(&c->ranks[r].posted);
}

/* The header's failure word while its first writer fills in the rank and blame (no SX_E* code is this). */
#define FAILURE_BEING_WRITTEN INT32_MIN

/* Records the first failure, here and in the header, where every rank sees it at its next wait, with the
 * rank an enclosing group blames for it (-1: none). */
static int fail_outer(sx_shm *c, int code, int peer, int outer) {
    int none = 0;
    if (__atomic_compare_exchange_n(&c->failed, &none, code, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        c->failed_peer = peer;
        c->failed_outer = outer;
    }
    if (c->head) {
        none = 0;
        int32_t shared = code == SX_EABORTED ? SX_EPEER : code; /* an abort here is a peer gone for the others */
        if (peer < 0 && code == SX_EABORTED) peer = c->rank;
        /* claimed as FAILURE_BEING_WRITTEN first, the code stored last: a reader that sees the code sees the
         * rank and the blame written with it, never the ones from before */
        if (__atomic_compare_exchange_n(&c->head->failed, &none, FAILURE_BEING_WRITTEN, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {
            __atomic_store_n(&c->head->failed_outer, outer + 1, __ATOMIC_SEQ_CST);
            __atomic_store_n(&c->head->failed_rank, peer, __ATOMIC_SEQ_CST);
            __atomic_store_n(&c->head->failed, shared, __ATOMIC_SEQ_CST);
        }
        wake_everyone(c);
    }
    return code;
}

static int fail(sx_shm *c, int code, int peer) { return fail_outer(c, code, peer, -1); }

/* A failure another rank recorded, taken as this rank's own. */
static int failed_elsewhere(sx_shm *c) {
    int code = __atomic_load_n(&c->head->failed, __ATOMIC_SEQ_CST);
    /* two stores away: the writer is between its claim and its code (bounded: it may be killed right there,
     * and then a peer is gone whatever it was about to say) */
    for (int tries = 0; code == FAILURE_BEING_WRITTEN; tries++) {
        if (tries == 100000) {
            code = SX_EPEER;
            break;
        }
        sched_yield();
        code = __atomic_load_n(&c->head->failed, __ATOMIC_SEQ_CST);
    }
    if (!code) return SX_OK;
    int peer = __atomic_load_n(&c->head->failed_rank, __ATOMIC_SEQ_CST);
    int outer = __atomic_load_n(&c->head->failed_outer, __ATOMIC_SEQ_CST) - 1;
    int none = 0;
    if (__atomic_compare_exchange_n(&c->failed, &none, code, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        c->failed_peer = peer;
        c->failed_outer = outer;
    }
    return code;
}

/* Whether rank r's process has exited. Asked only of the rank being waited for: a peer that posted everything
 * this rank needs and then exited (its last call done) has not failed anyone. */
static int exited(sx_shm *c, int r) {
    struct pollfd p = {.fd = c->pidfds[r], .events = POLLIN};
    return p.fd >= 0 && poll(&p, 1, 0) > 0;
}

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

/* Until rank r's counter reaches target (counters wrap: compared as a signed difference), a failure, or the
 * deadline. */
static int wait_rank(sx_shm *c, int r, uint32_t target, double deadline) {
    uint32_t *word = &c->ranks[r].posted;
    double yield_until = 0;
    for (int spin = 0;; spin++) {
        uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if ((int32_t)(seen - target) >= 0) return SX_OK;
        if (__atomic_load_n(&c->aborted, __ATOMIC_SEQ_CST)) return fail(c, SX_EABORTED, -1);
        int rc = failed_elsewhere(c);
        if (rc != SX_OK) return rc;
        if (spin < SPINS) {
            cpu_relax();
            continue;
        }
        if (spin == SPINS) yield_until = now_s() + YIELD_S;
        if (now_s() < yield_until) { /* a futex sleep and wake costs more than a phase of a small chunk */
            sched_yield();
            continue;
        }
        double left = deadline - now_s();
        if (left <= 0) return fail(c, SX_ETIMEDOUT, r); /* r is the one that never came: every rank names it */
        futex_wait(word, seen, left < PEER_CHECK_S ? left : PEER_CHECK_S);
        if (exited(c, r)) return fail(c, SX_EPEER, r);
    }
}

static int wait_all(sx_shm *c, uint32_t target, double deadline) {
    for (int r = 0; r < c->world; r++) {
        int rc = wait_rank(c, r, target, deadline);
        if (rc != SX_OK) return rc;
    }
    return SX_OK;
}

static void post(sx_shm *c) {
    c->posted++;
    __atomic_store_n(&c->ranks[c->rank].posted, c->posted, __ATOMIC_RELEASE);
    futex_wake(&c->ranks[c->rank].posted);
}

static unsigned char *slot_of(sx_shm *c, int rank) {
    return c->data + ((c->chunks % 2) * (size_t)c->world + (size_t)rank) * c->slot;
}

/* ---- life cycle ------------------------------------------------------------------------------------ */

#define RANKS_AT 128 /* the header, then the ranks' records */
_Static_assert(sizeof(struct shm_head) <= RANKS_AT, "the header fits before the ranks' records");

static size_t head_bytes(int world) {
    size_t n = RANKS_AT + (size_t)world * sizeof(struct shm_rank);
    return (n + 4095) & ~(size_t)4095;
}

void sx_shm_destroy(sx_shm *c) {
    if (!c) return;
    if (c->named && !c->unlinked) shm_unlink(c->name);
    if (c->pidfds)
        for (int r = 0; r < c->world; r++)
            if (c->pidfds[r] >= 0) close(c->pidfds[r]);
    free(c->pidfds);
    if (c->base) munmap(c->base, c->size);
    free(c);
}

int sx_shm_create(const char *name, int create, int rank, int world_size, uint64_t generation, size_t slot_bytes,
                  sx_shm **out) {
    if (!out || !name || name[0] != '/' || strlen(name) > NAME_MAX_LEN || world_size < 1 ||
        world_size > MAX_LOCAL || rank < 0 || rank >= world_size || slot_bytes < 64 || slot_bytes % 64 ||
        slot_bytes > ((size_t)1 << 30))
        return SX_EINVAL;
    *out = NULL;
    sx_shm *c = calloc(1, sizeof *c);
    if (!c) return SX_ENOMEM;
    c->rank = rank, c->world = world_size, c->generation = generation, c->slot = slot_bytes, c->failed_peer = -1;
    c->failed_outer = -1;
    snprintf(c->name, sizeof c->name, "%s", name);
    c->pidfds = malloc((size_t)world_size * sizeof *c->pidfds);
    if (!c->pidfds) { sx_shm_destroy(c); return SX_ENOMEM; }
    for (int r = 0; r < world_size; r++) c->pidfds[r] = -1;
    c->size = head_bytes(world_size) + 2 * (size_t)world_size * slot_bytes;
    int fd = shm_open(name, create ? O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC : O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) {
        int e = errno;
        sx_record_errno(e);
        sx_shm_destroy(c);
        return e == ENOENT ? SX_ENOENT : e == EEXIST ? SX_EEXIST : e == EACCES ? SX_EPERM : SX_EIO;
    }
    struct stat st;
    int rc = SX_OK;
    if (create) { /* reserved now: a tmpfs too small (a container's 64 MiB /dev/shm) is an error here, not a
                   * SIGBUS on first touch in the middle of a collective */
        int e = posix_fallocate(fd, 0, (off_t)c->size);
        if (e) { sx_record_errno(e); rc = e == ENOSPC ? SX_ENOSPC : SX_EIO; }
    }
    if (rc == SX_OK && (fstat(fd, &st) != 0 || (size_t)st.st_size != c->size)) rc = SX_EPROTO; /* not ours */
    if (rc == SX_OK) {
        void *base = mmap(NULL, c->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (base == MAP_FAILED) rc = SX_ENOMEM;
        else c->base = base;
    }
    close(fd);
    if (rc != SX_OK) {
        if (create) shm_unlink(name);
        sx_shm_destroy(c);
        return rc;
    }
    c->head = (struct shm_head *)c->base;
    c->ranks = (struct shm_rank *)(c->base + RANKS_AT);
    c->data = c->base + head_bytes(world_size);
    if (create) {
        c->head->generation = generation;
        c->head->world = (uint32_t)world_size;
        c->head->slot_bytes = slot_bytes;
        c->head->failed_rank = -1;
        __atomic_store_n(&c->head->magic, SHM_MAGIC, __ATOMIC_RELEASE); /* last: the segment is ready */
    } else if (__atomic_load_n(&c->head->magic, __ATOMIC_ACQUIRE) != SHM_MAGIC || c->head->world != (uint32_t)world_size ||
               c->head->slot_bytes != slot_bytes) {
        sx_shm_destroy(c);
        return SX_EPROTO;
    } else if (c->head->generation != generation) {
        sx_shm_destroy(c);
        return SX_ESTALE;
    }
    c->named = 1; /* ours (a segment of another generation or shape is left to its own ranks) */
    c->ranks[rank].pid = (int32_t)getpid();
    c->posted = __atomic_load_n(&c->ranks[rank].posted, __ATOMIC_ACQUIRE);
    __atomic_add_fetch(&c->head->attached, 1, __ATOMIC_SEQ_CST);
    futex_wake(&c->head->attached);
    *out = c;
    return SX_OK;
}

/* Opens a pidfd for each peer that has written its pid and has none yet; SX_EPEER naming the first that is gone
 * and, while setup waits (`judge`), the first that has exited: no rank leaves before every rank has mapped the
 * segment. (Once all have, one may have finished setup, closed and exited.) A peer refused a pidfd keeps -1: its
 * death then ends in the deadline. */
static int watch_peers(sx_shm *c, int judge) {
    for (int r = 0; r < c->world; r++) {
        pid_t pid = __atomic_load_n(&c->ranks[r].pid, __ATOMIC_ACQUIRE);
        if (r == c->rank || pid == 0 || pid == getpid()) continue; /* ranks as threads of one process share it */
        if (c->pidfds[r] < 0) {
            long fd = syscall(SYS_pidfd_open, pid, 0);
            if (fd < 0 && errno == ESRCH) return fail(c, SX_EPEER, r);
            if (fd < 0) continue;
            c->pidfds[r] = (int)fd;
        }
        if (judge && exited(c, r)) return fail(c, SX_EPEER, r);
    }
    return SX_OK;
}

/* Until every rank has mapped the segment (SX_ETIMEDOUT at timeout_s, and it may be called again); then
 * unlinks its name (no other process can attach, and the memory goes with the last rank). Meanwhile it watches
 * the ranks that have mapped it: one that dies (the creator SIGKILLed while a peer is late) fails the setup of
 * every rank at once, each of which then unlinks the name, instead of waiting out the deadline. */
int sx_shm_wait_attached(sx_shm *c, double timeout_s) {
    if (!c || !(timeout_s > 0)) return SX_EINVAL;
    double deadline = now_s() + timeout_s;
    for (;;) {
        uint32_t seen = __atomic_load_n(&c->head->attached, __ATOMIC_SEQ_CST);
        if (seen >= (uint32_t)c->world) break;
        if (__atomic_load_n(&c->aborted, __ATOMIC_SEQ_CST)) return fail(c, SX_EABORTED, -1);
        int rc = failed_elsewhere(c);
        if (rc == SX_OK) rc = watch_peers(c, 1);
        if (rc != SX_OK) return rc;
        double left = deadline - now_s();
        if (left <= 0) return SX_ETIMEDOUT; /* not a failure: the caller may look for an abort and wait again */
        futex_wait(&c->head->attached, seen, left < 0.05 ? left : 0.05);
    }
    shm_unlink(c->name); /* every rank tries: whichever is first; ENOENT for the rest */
    c->unlinked = 1;
    return watch_peers(c, 0);
}

void sx_shm_abort(sx_shm *c) {
    if (!c) return;
    __atomic_store_n(&c->aborted, 1, __ATOMIC_SEQ_CST);
    fail(c, SX_EABORTED, -1);
}

int sx_shm_failed_peer(const sx_shm *c) { return c ? c->failed_peer : -1; }

int sx_shm_failed_outer(const sx_shm *c) { return c ? c->failed_outer : -1; }

int sx_shm_relay(sx_shm *c, int code, int outer) {
    if (!c || outer < -1 || !(code == SX_EPEER || code == SX_ETIMEDOUT || code == SX_ESTALE || code == SX_EPROTO))
        return SX_EINVAL;
    fail_outer(c, code, -1, outer);
    return SX_OK;
}

/* ---- the collectives ------------------------------------------------------------------------------- */

/* Every call starts here: the communicator must be healthy, and this rank's call is published for the others
 * to compare (check_calls) after the first wait. */
static int start(sx_shm *c, int op, int dtype, size_t count, int root, double timeout_s, double *deadline) {
    if (!(timeout_s > 0) || isinf(timeout_s)) return SX_EINVAL;
    if (__atomic_load_n(&c->aborted, __ATOMIC_SEQ_CST) || __atomic_load_n(&c->failed, __ATOMIC_SEQ_CST))
        return SX_EABORTED;
    int rc = failed_elsewhere(c); /* a peer's failure first met here: as the ring, its own error (and blame) */
    if (rc != SX_OK) return rc;
    *deadline = now_s() + timeout_s;
    c->calls++;
    c->ranks[c->rank].call[c->calls % 2] =
        (uint64_t)op | (uint64_t)dtype << 4 | (uint64_t)(root & 0xFFFF) << 8 | (uint64_t)count << 24;
    return SX_OK;
}

/* After the first wait of a call every rank has published its call: a rank in another one (another op,
 * size, dtype or root) is a bug in the caller that would corrupt data silently, so it fails the group. A
 * rank cannot be two calls ahead: it would need this rank's post of the next call. */
static int check_calls(sx_shm *c) {
    uint64_t mine = c->ranks[c->rank].call[c->calls % 2];
    for (int r = 0; r < c->world; r++)
        if (__atomic_load_n(&c->ranks[r].call[c->calls % 2], __ATOMIC_ACQUIRE) != mine) return fail(c, SX_EPROTO, r);
    return SX_OK;
}

/* A barrier with no data: every call with nothing to move still meets the others once. */
static int meet(sx_shm *c, double deadline) {
    post(c);
    int rc = wait_all(c, c->posted, deadline);
    return rc == SX_OK ? check_calls(c) : rc;
}

int sx_shm_allreduce(sx_shm *c, void *buf, size_t count, int dtype, int op, double timeout_s) {
    sx_reduce_fn reduce = sx_reducer(dtype, op);
    if (!c || !reduce || (count && !buf)) return SX_EINVAL;
    double deadline;
    int rc = start(c, OP_ALLREDUCE, dtype, count, op, timeout_s, &deadline);
    if (rc != SX_OK || c->world == 1) return rc;
    size_t elsize = sx_dtype_size(dtype), per_chunk = c->slot / elsize;
    char *data = buf;
    if (!count) return meet(c, deadline);
    for (size_t done = 0; done < count; done += per_chunk, c->chunks++) {
        size_t n = min_size(per_chunk, count - done);
        memcpy(slot_of(c, c->rank), data + done * elsize, n * elsize); /* A: my data into my slot */
        post(c);
        if ((rc = wait_all(c, c->posted, deadline)) != SX_OK) return rc;
        if (done == 0 && (rc = check_calls(c)) != SX_OK) return rc;
        uint64_t lo, hi; /* B: my share, reduced over every slot, into my slot */
        sx_shard_range(n, c->world, c->rank, &lo, &hi);
        unsigned char *mine = slot_of(c, c->rank) + lo * elsize;
        for (int r = 0; r < c->world; r++)
            if (r != c->rank) reduce(mine, slot_of(c, r) + lo * elsize, hi - lo);
        post(c);
        if ((rc = wait_all(c, c->posted, deadline)) != SX_OK) return rc;
        for (int r = 0; r < c->world; r++) { /* C: every share out of its owner's slot */
            sx_shard_range(n, c->world, r, &lo, &hi);
            memcpy(data + (done + lo) * elsize, slot_of(c, r) + lo * elsize, (hi - lo) * elsize);
        }
        post(c);
    }
    return SX_OK;
}

/* Chunk k of a reduce-scatter carries piece k of every shard: the slot holds world pieces of per_piece
 * elements each; rank r reduces piece k of its shard from every slot into its own buf. */
int sx_shm_reduce_scatter(sx_shm *c, void *buf, size_t count, int dtype, int op, double timeout_s) {
    sx_reduce_fn reduce = sx_reducer(dtype, op);
    if (!c || !reduce || (count && !buf)) return SX_EINVAL;
    double deadline;
    int rc = start(c, OP_REDUCE_SCATTER, dtype, count, op, timeout_s, &deadline);
    if (rc != SX_OK || c->world == 1) return rc;
    size_t elsize = sx_dtype_size(dtype), per_piece = c->slot / elsize / (size_t)c->world;
    if (per_piece == 0) return fail(c, SX_EINVAL, -1);
    uint64_t widest = count / (uint64_t)c->world + 1;
    char *data = buf;
    if (!count) return meet(c, deadline);
    for (size_t at = 0; at < widest; at += per_piece, c->chunks++) {
        unsigned char *slot = slot_of(c, c->rank);
        for (int s = 0; s < c->world; s++) { /* A: piece `at` of every shard of my data */
            uint64_t lo, hi;
            sx_shard_range(count, c->world, s, &lo, &hi);
            size_t n = lo + at < hi ? min_size(per_piece, hi - lo - at) : 0;
            memcpy(slot + (size_t)s * per_piece * elsize, data + (lo + at) * elsize, n * elsize);
        }
        post(c);
        if ((rc = wait_all(c, c->posted, deadline)) != SX_OK) return rc;
        if (at == 0 && (rc = check_calls(c)) != SX_OK) return rc;
        uint64_t lo, hi; /* B: my shard's piece from every other slot, into buf */
        sx_shard_range(count, c->world, c->rank, &lo, &hi);
        size_t n = lo + at < hi ? min_size(per_piece, hi - lo - at) : 0;
        for (int r = 0; r < c->world && n; r++)
            if (r != c->rank) reduce(data + (lo + at) * elsize, slot_of(c, r) + (size_t)c->rank * per_piece * elsize, n);
        post(c);
    }
    return SX_OK;
}

int sx_shm_allgather(sx_shm *c, void *buf, size_t count, int dtype, double timeout_s) {
    size_t elsize = sx_dtype_size(dtype);
    if (!c || !elsize || (count && !buf)) return SX_EINVAL;
    double deadline;
    int rc = start(c, OP_ALLGATHER, dtype, count, 0, timeout_s, &deadline);
    if (rc != SX_OK || c->world == 1) return rc;
    size_t per_chunk = c->slot / elsize;
    uint64_t widest = count / (uint64_t)c->world + 1;
    char *data = buf;
    if (!count) return meet(c, deadline);
    for (size_t at = 0; at < widest; at += per_chunk, c->chunks++) {
        uint64_t lo, hi;
        sx_shard_range(count, c->world, c->rank, &lo, &hi); /* A: piece `at` of my shard into my slot */
        size_t n = lo + at < hi ? min_size(per_chunk, hi - lo - at) : 0;
        memcpy(slot_of(c, c->rank), data + (lo + at) * elsize, n * elsize);
        post(c);
        if ((rc = wait_all(c, c->posted, deadline)) != SX_OK) return rc;
        if (at == 0 && (rc = check_calls(c)) != SX_OK) return rc;
        for (int r = 0; r < c->world; r++) { /* B: every other shard's piece out */
            sx_shard_range(count, c->world, r, &lo, &hi);
            n = lo + at < hi ? min_size(per_chunk, hi - lo - at) : 0;
            if (r != c->rank) memcpy(data + (lo + at) * elsize, slot_of(c, r), n * elsize);
        }
        post(c);
    }
    return SX_OK;
}

int sx_shm_broadcast(sx_shm *c, void *buf, size_t nbytes, int root, double timeout_s) {
    if (!c || root < 0 || root >= c->world || (nbytes && !buf)) return SX_EINVAL;
    double deadline;
    int rc = start(c, OP_BROADCAST, SX_DTYPE_U8, nbytes, root, timeout_s, &deadline);
    if (rc != SX_OK || c->world == 1) return rc;
    char *data = buf;
    if (!nbytes) return meet(c, deadline);
    for (size_t done = 0; done < nbytes; done += c->slot, c->chunks++) {
        size_t n = min_size(c->slot, nbytes - done);
        if (c->rank == root) memcpy(slot_of(c, root), data + done, n);
        post(c);
        if ((rc = wait_all(c, c->posted, deadline)) != SX_OK) return rc;
        if (done == 0 && (rc = check_calls(c)) != SX_OK) return rc;
        if (c->rank != root) memcpy(data + done, slot_of(c, root), n);
        post(c);
    }
    return SX_OK;
}

int sx_shm_barrier(sx_shm *c, double timeout_s) {
    if (!c) return SX_EINVAL;
    double deadline;
    int rc = start(c, OP_BARRIER, 0, 0, 0, timeout_s, &deadline);
    if (rc != SX_OK || c->world == 1) return rc;
    return meet(c, deadline);
}
