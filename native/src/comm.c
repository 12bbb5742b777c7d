/* comm.c - collectives over a TCP ring (allreduce, reduce-scatter, allgather, broadcast, barrier).
 *
 * Why our own: elastic training needs CPU collectives whose membership changes from one generation to
 * the next, that fail fast and typed when a peer dies or hangs, and that can be aborted from the
 * heartbeat's thread. MPI worlds are fixed and gloo comes only inside torch, so this is the small core
 * that does exactly that; connection setup and authentication stay in Python (SneppX_ALG/collectives/),
 * which hands this file two connected sockets per rank.
 *
 * The ring: rank r sends to r+1 on send_fd and receives from r-1 on recv_fd. A collective is a plan of
 * steps, each "send this segment, receive into that one (adding it in, or not)". The data of a step
 * travels in frames of at most `chunk` payload bytes, each behind a 32-byte header (magic, op,
 * generation, sequence number of the call, step, length) that the receiver checks before it reads
 * the payload. A step's send may depend on an earlier step's receive (ring allreduce forwards the
 * segment it has just reduced); that dependency is tracked per frame, so frames flow around the
 * ring as a pipeline instead of one segment at a time.
 *
 * One thread drives both directions with non-blocking I/O and poll(), alongside a self-pipe that
 * sx_comm_abort() writes to: an abort, a deadline, a closed or reset connection, or a bad frame ends
 * the call at once. The failing rank then tells both neighbours what failed and whom it blames (a
 * notice frame: to the right once the frame it was sending is complete, to the left on the socket it
 * otherwise only reads) and shuts both sockets. A neighbour takes a notice's failure as its own and
 * passes it on, so the news travels around the ring in both directions, and every survivor of a
 * SIGKILLed rank names that rank, not the neighbour that told it.
 */
#define _GNU_SOURCE
#include "sneppx.h"
#include "reduce.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define HEADER SX_COMM_HEADER_BYTES
#define DEFAULT_CHUNK ((size_t)1 << 20)
#define MAX_CHUNK ((size_t)1 << 30) /* the header's length field is 32 bits */
#define MAX_WORLD 65536

enum { OP_ALLREDUCE = 1, OP_REDUCE_SCATTER = 2, OP_ALLGATHER = 3, OP_BROADCAST = 4, OP_BARRIER = 5, OP_SHIFT = 6,
       OP_NOTICE = 0x7F };
#define NOTICE_FLUSH_S 1.0 /* at most this long to complete the frame a failing rank was sending */

struct sx_comm {
    int rank, world;
    uint64_t generation;
    uint64_t seq; /* collectives started: the same count on every rank of a healthy group */
    int send_fd, recv_fd;
    int wake[2]; /* self-pipe: sx_comm_abort() writes, poll() wakes */
    size_t chunk;
    unsigned char *staging; /* one received frame, before it is reduced into place */
    struct step *steps;     /* 2 (world - 1) steps, the longest plan */
    int failed;             /* the first failure's status (atomic); 0 while healthy */
    int failed_peer;
    int failed_outer; /* the rank an enclosing group blames (sx_comm_relay, or a notice of one), or -1 */
    int aborted; /* atomic */
    int64_t barrier_word;
};

struct step {
    char *send;
    size_t send_len;
    char *recv;
    size_t recv_len;
    int reduce;     /* received bytes are combined into recv (1) or written there (0) */
    int send_after; /* sending may not pass what step send_after has received; -1: no dependency */
};

/* ---- small helpers ------------------------------------------------------------------------------ */

static void put16(unsigned char *p, uint16_t v) { p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8); }
static void put32(unsigned char *p, uint32_t v) { put16(p, (uint16_t)v); put16(p + 2, (uint16_t)(v >> 16)); }
static void put64(unsigned char *p, uint64_t v) { put32(p, (uint32_t)v); put32(p + 4, (uint32_t)(v >> 32)); }
static uint16_t get16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t get32(const unsigned char *p) { return get16(p) | (uint32_t)get16(p + 2) << 16; }
static uint64_t get64(const unsigned char *p) { return get32(p) | (uint64_t)get32(p + 4) << 32; }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

void sx_shard_range(uint64_t count, int world_size, int rank, uint64_t *start, uint64_t *stop) {
    if (world_size < 1 || rank < 0 || rank >= world_size) { *start = *stop = 0; return; }
    uint64_t w = (uint64_t)world_size, q = count / w, r = count % w, k = (uint64_t)rank;
    /* floor(count * k / w) without the 128-bit product: r * k < w * w fits easily */
    *start = q * k + r * k / w;
    *stop = q * (k + 1) + r * (k + 1) / w;
}

size_t sx_dtype_size(int dtype) {
    switch (dtype) {
    case SX_DTYPE_F32: case SX_DTYPE_I32: return 4;
    case SX_DTYPE_F64: case SX_DTYPE_I64: return 8;
    case SX_DTYPE_U8: return 1;
    default: return 0;
    }
}

/* ---- reductions: dst[i] = dst[i] (op) src[i] ------------------------------------------------------- */

typedef sx_reduce_fn reduce_fn;

/* Integer sums go through the unsigned type: they wrap like numpy's instead of being undefined. NaN
 * wins max and min, as in numpy. */
#define REDUCERS(T, U, name)                                                                         \
    static void sum_##name(void *d, const void *s, size_t n) {                                      \
        U *restrict a = d; const U *restrict b = s;                                                  \
        for (size_t i = 0; i < n; i++) a[i] += b[i];                                                 \
    }                                                                                                \
    static void max_##name(void *d, const void *s, size_t n) {                                      \
        T *restrict a = d; const T *restrict b = s;                                                  \
        for (size_t i = 0; i < n; i++) a[i] = (b[i] > a[i] || b[i] != b[i]) ? b[i] : a[i];           \
    }                                                                                                \
    static void min_##name(void *d, const void *s, size_t n) {                                      \
        T *restrict a = d; const T *restrict b = s;                                                  \
        for (size_t i = 0; i < n; i++) a[i] = (b[i] < a[i] || b[i] != b[i]) ? b[i] : a[i];           \
    }

REDUCERS(float, float, f32)
REDUCERS(double, double, f64)
REDUCERS(int32_t, uint32_t, i32)
REDUCERS(int64_t, uint64_t, i64)

reduce_fn sx_reducer(int dtype, int op) {
    static const reduce_fn table[4][3] = {
        {sum_f32, max_f32, min_f32}, {sum_f64, max_f64, min_f64},
        {sum_i32, max_i32, min_i32}, {sum_i64, max_i64, min_i64},
    };
    if (dtype < 0 || dtype > SX_DTYPE_I64 || op < SX_OP_SUM || op > SX_OP_MIN) return NULL;
    return table[dtype][op];
}

/* ---- life cycle ------------------------------------------------------------------------------------ */

int sx_comm_create(int rank, int world_size, uint64_t generation, int send_fd, int recv_fd, size_t chunk_bytes,
                   sx_comm **out) {
    int rc = SX_EINVAL;
    sx_comm *c = NULL;
    if (!out) goto fail;
    *out = NULL;
    if (world_size < 1 || world_size > MAX_WORLD || rank < 0 || rank >= world_size) goto fail;
    if (world_size > 1 && (send_fd < 0 || recv_fd < 0 || send_fd == recv_fd)) goto fail;
    size_t chunk = chunk_bytes ? chunk_bytes & ~(size_t)7 : DEFAULT_CHUNK;
    if (chunk < 8 || chunk > MAX_CHUNK) goto fail;
    rc = SX_ENOMEM;
    c = calloc(1, sizeof *c);
    if (!c) goto fail;
    c->rank = rank;
    c->world = world_size;
    c->generation = generation;
    c->send_fd = send_fd;
    c->recv_fd = recv_fd;
    c->wake[0] = c->wake[1] = -1;
    c->chunk = chunk;
    c->failed_peer = -1;
    c->failed_outer = -1;
    if (world_size == 1) { *out = c; return SX_OK; }
    c->staging = aligned_alloc(64, (chunk + 63) & ~(size_t)63);
    c->steps = calloc(2 * (size_t)(world_size - 1), sizeof *c->steps);
    if (!c->staging || !c->steps) goto fail;
    rc = SX_EIO;
    if (pipe2(c->wake, O_NONBLOCK | O_CLOEXEC) != 0) goto fail;
    for (int i = 0; i < 2; i++) {
        int fd = i ? recv_fd : send_fd, flags = fcntl(fd, F_GETFL);
        if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) { rc = SX_EINVAL; goto fail; }
    }
    *out = c;
    return SX_OK;
fail:
    if (c) {
        c->send_fd = c->recv_fd = -1; /* closed just below */
        sx_comm_destroy(c);
    }
    if (send_fd >= 0) close(send_fd);
    if (recv_fd >= 0 && recv_fd != send_fd) close(recv_fd);
    return rc;
}

void sx_comm_destroy(sx_comm *c) {
    if (!c) return;
    int fds[4] = {c->send_fd, c->recv_fd, c->wake[0], c->wake[1]};
    for (int i = 0; i < 4; i++)
        if (fds[i] >= 0) close(fds[i]);
    free(c->staging);
    free(c->steps);
    free(c);
}

static void shut_sockets(sx_comm *c) {
    if (c->world > 1) {
        shutdown(c->send_fd, SHUT_RDWR);
        shutdown(c->recv_fd, SHUT_RDWR);
    }
}

void sx_comm_abort(sx_comm *c) {
    if (!c) return;
    __atomic_store_n(&c->aborted, 1, __ATOMIC_SEQ_CST);
    if (c->wake[1] >= 0) {
        char byte = 1;
        ssize_t ignored = write(c->wake[1], &byte, 1); /* a full pipe has already woken the poller */
        (void)ignored;
    }
    shut_sockets(c);
}

int sx_comm_failed_peer(const sx_comm *c) { return c ? c->failed_peer : -1; }

int sx_comm_failed_outer(const sx_comm *c) { return c ? c->failed_outer : -1; }

/* Records the first failure (later ones are its consequences), with the rank an enclosing group blames for
 * it (-1: none). The call that failed then tells the neighbours and shuts the sockets (run_plan). */
static int fail_outer(sx_comm *c, int code, int peer, int outer) {
    int none = 0;
    if (__atomic_compare_exchange_n(&c->failed, &none, code, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        c->failed_peer = peer;
        c->failed_outer = outer;
    }
    return code;
}

static int fail(sx_comm *c, int code, int peer) { return fail_outer(c, code, peer, -1); }

static int usable(sx_comm *c) {
    if (__atomic_load_n(&c->aborted, __ATOMIC_SEQ_CST) || __atomic_load_n(&c->failed, __ATOMIC_SEQ_CST))
        return SX_EABORTED;
    return SX_OK;
}

/* ---- the engine: runs one plan --------------------------------------------------------------------- */

struct run {
    sx_comm *c;
    const struct step *steps;
    int nsteps, op;
    uint64_t seq;
    reduce_fn reduce;
    size_t elsize;
    /* sending: step st, its frame starting at sbase, of slen payload bytes, sdone bytes of it (with the
     * header) written */
    int st;
    size_t sbase, slen, sdone;
    unsigned char shdr[HEADER];
    /* receiving: step rt, frames before rbase landed; the current frame's header (rhdr_got bytes of it)
     * then rgot of its rlen payload bytes */
    int rt;
    size_t rbase, rlen, rgot, rhdr_got;
    unsigned char rhdr[HEADER];
};

static int left_of(const sx_comm *c) { return (c->rank + c->world - 1) % c->world; }
static int right_of(const sx_comm *c) { return (c->rank + 1) % c->world; }

/* Has everything a frame ending at `end` of a dependent send needs been received? */
static int dependency_met(const struct run *r, int after, size_t end) {
    if (after < 0 || r->rt > after) return 1;
    return r->rt == after && r->rbase >= end;
}

static int peer_lost(sx_comm *c, int peer, int err) {
    (void)err;
    return fail(c, SX_EPEER, peer);
}

/* ---- notices: a failure passed on to the neighbours ------------------------------------------------- */

/* The failures a notice carries: the others end with the same error, blaming the same rank. An abort is
 * not among them: its sockets are already shut, which tells the neighbours this rank left. */
static int relayable(int code) {
    return code == SX_EPEER || code == SX_ETIMEDOUT || code == SX_ESTALE || code == SX_EPROTO;
}

/* A frame header with op NOTICE, the status negated in the flags byte, the blamed rank in the step field
 * (0xFFFFFFFF: none), the rank an enclosing group blames plus one in the length field (0: none), and no
 * payload. */
static void notice_header(const sx_comm *c, unsigned char *h, int code, int peer) {
    memset(h, 0, HEADER);
    put32(h, SX_COMM_MAGIC);
    h[4] = OP_NOTICE;
    h[5] = (unsigned char)-code;
    put64(h + 8, c->generation);
    put64(h + 16, c->seq);
    put32(h + 24, (uint32_t)peer);
    put32(h + 28, (uint32_t)(c->failed_outer + 1));
}

static int is_notice(const unsigned char *h) { return get32(h) == SX_COMM_MAGIC && h[4] == OP_NOTICE; }

/* A neighbour's notice, taken as this rank's own failure. A notice that names no failure or rank this
 * group knows is garbage (the caller blames the neighbour that sent it). */
static int take_notice(sx_comm *c, const unsigned char *h) {
    int code = -(int)h[5];
    uint32_t peer = get32(h + 24), outer = get32(h + 28);
    if (get64(h + 8) != c->generation) return SX_ESTALE;
    if (!relayable(code) || get16(h + 6) != 0 || outer > (uint32_t)INT32_MAX ||
        (peer != UINT32_MAX && peer >= (uint32_t)c->world))
        return SX_EPROTO;
    return fail_outer(c, code, peer == UINT32_MAX ? -1 : (int)peer, (int)outer - 1);
}

/* The right-hand neighbour writes on send_fd only to send a notice: anything else readable there means it
 * closed, reset or sent garbage. A notice is read before the end of the stream that follows it. */
static int check_right(sx_comm *c) {
    unsigned char h[HEADER];
    ssize_t got = recv(c->send_fd, h, HEADER, MSG_PEEK | MSG_DONTWAIT);
    if (got == HEADER && is_notice(h)) return fail(c, take_notice(c, h), right_of(c));
    if (got > 0 && got < HEADER && get32(h) == SX_COMM_MAGIC) return SX_OK; /* the rest of a notice is on its way */
    if (got > 0) return fail(c, SX_EPROTO, right_of(c));
    if (got == 0) return peer_lost(c, right_of(c), 0);
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return SX_OK;
    return peer_lost(c, right_of(c), errno);
}

/* Sends len bytes on fd by `until`; 0 once all are out, -1 if the socket fails, the deadline passes or the
 * comm is aborted. */
static int send_by(sx_comm *c, int fd, const unsigned char *at, size_t len, double until) {
    while (len) {
        ssize_t w = send(fd, at, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) { at += w; len -= (size_t)w; continue; }
        if (w < 0 && errno == EINTR) continue;
        if (w == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) return -1;
        double left = until - now_s();
        if (left <= 0 || __atomic_load_n(&c->aborted, __ATOMIC_SEQ_CST)) return -1;
        struct pollfd p[2] = {{.fd = fd, .events = POLLOUT}, {.fd = c->wake[0], .events = POLLIN}};
        if (poll(p, 2, (int)ceil(left * 1000.0)) > 0 && p[1].revents) return -1;
    }
    return 0;
}

/* After a failure: a notice of it to both neighbours, then both sockets shut. To the left it goes on the
 * socket that otherwise carries nothing that way; to the right it must start at a frame boundary, so the
 * frame being sent is completed first (with whatever its buffer holds: the receiver fails on the notice
 * that follows), for at most NOTICE_FLUSH_S. A neighbour that is gone just fails the write. */
static void tell_neighbours(struct run *r) {
    sx_comm *c = r->c;
    int code = __atomic_load_n(&c->failed, __ATOMIC_SEQ_CST);
    if (relayable(code) && !__atomic_load_n(&c->aborted, __ATOMIC_SEQ_CST)) {
        unsigned char notice[HEADER];
        notice_header(c, notice, code, c->failed_peer);
        double until = now_s() + NOTICE_FLUSH_S;
        send_by(c, c->recv_fd, notice, HEADER, until);
        int flushed = 0;
        if (r->sdone == 0) {
            flushed = 1;
        } else if (r->sdone < HEADER) {
            flushed = send_by(c, c->send_fd, r->shdr + r->sdone, HEADER - r->sdone, until) == 0 &&
                      send_by(c, c->send_fd, (unsigned char *)r->steps[r->st].send + r->sbase, r->slen, until) == 0;
        } else {
            size_t done = r->sdone - HEADER;
            flushed = send_by(c, c->send_fd, (unsigned char *)r->steps[r->st].send + r->sbase + done,
                              r->slen - done, until) == 0;
        }
        if (flushed) send_by(c, c->send_fd, notice, HEADER, until);
    }
    shut_sockets(c);
}

int sx_comm_relay(sx_comm *c, int code, int outer) {
    if (!c || !relayable(code) || outer < -1) return SX_EINVAL;
    if (usable(c) != SX_OK) return SX_OK; /* failed already: its neighbours were told then */
    fail_outer(c, code, -1, outer);
    if (c->world > 1) { /* between calls: both streams are at a frame boundary */
        unsigned char notice[HEADER];
        notice_header(c, notice, code, -1);
        double until = now_s() + NOTICE_FLUSH_S;
        send_by(c, c->recv_fd, notice, HEADER, until);
        send_by(c, c->send_fd, notice, HEADER, until);
        shut_sockets(c);
    }
    return SX_OK;
}

static int send_some(struct run *r, int *progressed, int *want_out) {
    sx_comm *c = r->c;
    for (;;) {
        while (r->st < r->nsteps && r->sdone == 0 && r->sbase >= r->steps[r->st].send_len) {
            r->st++;
            r->sbase = 0;
        }
        if (r->st == r->nsteps) return SX_OK;
        const struct step *s = &r->steps[r->st];
        if (r->sdone == 0) { /* a new frame, once the bytes it forwards are here */
            size_t len = min_size(c->chunk, s->send_len - r->sbase);
            if (!dependency_met(r, s->send_after, r->sbase + len)) return SX_OK;
            put32(r->shdr, SX_COMM_MAGIC);
            r->shdr[4] = (unsigned char)r->op;
            r->shdr[5] = 0;
            put16(r->shdr + 6, 0);
            put64(r->shdr + 8, c->generation);
            put64(r->shdr + 16, r->seq);
            put32(r->shdr + 24, (uint32_t)r->st);
            put32(r->shdr + 28, (uint32_t)len);
            r->slen = len;
        }
        struct iovec iov[2];
        int n = 0;
        char *payload = s->send + r->sbase;
        if (r->sdone < HEADER) {
            iov[n++] = (struct iovec){r->shdr + r->sdone, HEADER - r->sdone};
            iov[n++] = (struct iovec){payload, r->slen};
        } else {
            iov[n++] = (struct iovec){payload + (r->sdone - HEADER), r->slen - (r->sdone - HEADER)};
        }
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t w = sendmsg(c->send_fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) { *want_out = 1; return SX_OK; }
            int rc = check_right(c); /* a notice it sent before it shut is still to be read */
            return rc != SX_OK ? rc : peer_lost(c, right_of(c), errno);
        }
        *progressed = 1;
        r->sdone += (size_t)w;
        if (r->sdone == HEADER + r->slen) {
            r->sbase += r->slen;
            r->sdone = 0;
        }
    }
}

static int check_header(struct run *r, size_t len) {
    const unsigned char *h = r->rhdr;
    sx_comm *c = r->c;
    if (get32(h) != SX_COMM_MAGIC) return SX_EPROTO;
    if (get64(h + 8) != c->generation) return SX_ESTALE;
    if (h[4] != r->op || h[5] != 0 || get16(h + 6) != 0 || get64(h + 16) != r->seq ||
        get32(h + 24) != (uint32_t)r->rt || get32(h + 28) != (uint32_t)len)
        return SX_EPROTO;
    return SX_OK;
}

static int recv_some(struct run *r, int *progressed) {
    sx_comm *c = r->c;
    for (;;) {
        while (r->rt < r->nsteps && r->rhdr_got == 0 && r->rbase >= r->steps[r->rt].recv_len) {
            r->rt++;
            r->rbase = 0;
            *progressed = 1; /* may release a send waiting on this step */
        }
        if (r->rt == r->nsteps) return SX_OK;
        const struct step *s = &r->steps[r->rt];
        void *into;
        size_t want;
        if (r->rhdr_got < HEADER) {
            into = r->rhdr + r->rhdr_got;
            want = HEADER - r->rhdr_got;
        } else {
            into = (s->reduce ? (char *)c->staging : s->recv + r->rbase) + r->rgot;
            want = r->rlen - r->rgot;
        }
        ssize_t got = recv(c->recv_fd, into, want, MSG_DONTWAIT);
        if (got == 0) return peer_lost(c, left_of(c), 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return SX_OK;
            return peer_lost(c, left_of(c), errno);
        }
        *progressed = 1;
        if (r->rhdr_got < HEADER) {
            r->rhdr_got += (size_t)got;
            if (r->rhdr_got < HEADER) continue;
            size_t len = min_size(c->chunk, s->recv_len - r->rbase);
            int rc = is_notice(r->rhdr) ? take_notice(c, r->rhdr) : check_header(r, len);
            if (rc != SX_OK) return fail(c, rc, left_of(c));
            r->rlen = len;
            r->rgot = 0;
            continue;
        }
        r->rgot += (size_t)got;
        if (r->rgot == r->rlen) {
            if (s->reduce) r->reduce(s->recv + r->rbase, c->staging, r->rlen / r->elsize);
            r->rbase += r->rlen;
            r->rhdr_got = 0;
            return SX_OK; /* a frame landed: let the sender forward it before reading on */
        }
    }
}

/* Moves the plan's frames until both directions are done or something fails. */
static int drive(struct run *r, double deadline) {
    sx_comm *c = r->c;
    for (;;) {
        if (__atomic_load_n(&c->aborted, __ATOMIC_SEQ_CST)) return fail(c, SX_EABORTED, -1);
        int progressed = 0, want_out = 0;
        int rc = send_some(r, &progressed, &want_out);
        if (rc == SX_OK) rc = recv_some(r, &progressed);
        if (rc != SX_OK) return rc;
        if (r->st == r->nsteps && r->rt == r->nsteps) return SX_OK;
        double left = deadline - now_s();
        if (left <= 0) return fail(c, SX_ETIMEDOUT, -1);
        if (progressed) continue;
        /* Only the directions still in use are watched: a neighbour that finished this call early may
         * already be sending the next one's frames, or have closed after its last one. */
        struct pollfd p[3] = {
            {.fd = r->st < r->nsteps ? c->send_fd : -1, .events = (short)(POLLIN | (want_out ? POLLOUT : 0))},
            {.fd = r->rt < r->nsteps ? c->recv_fd : -1, .events = POLLIN},
            {.fd = c->wake[0], .events = POLLIN},
        };
        double ms = ceil(left * 1000.0);
        int n = poll(p, 3, ms > (double)INT_MAX ? INT_MAX : (int)ms); /* only an event or the deadline wakes it */
        if (n < 0 && errno != EINTR) return fail(c, SX_EIO, -1);
        if (n <= 0) continue;
        if (p[2].revents) return fail(c, SX_EABORTED, -1);
        if (p[0].revents & (POLLIN | POLLERR | POLLHUP)) {
            rc = check_right(c);
            if (rc != SX_OK) return rc;
        }
    }
}

static int run_plan(sx_comm *c, int op, uint64_t seq, int nsteps, reduce_fn reduce, size_t elsize,
                    double deadline) {
    struct run r = {.c = c, .steps = c->steps, .nsteps = nsteps, .op = op, .seq = seq, .reduce = reduce,
                    .elsize = elsize};
    int rc = drive(&r, deadline);
    if (rc != SX_OK) tell_neighbours(&r);
    return rc;
}

/* ---- the collectives ------------------------------------------------------------------------------- */

static int start(sx_comm *c, double timeout_s, double *deadline, uint64_t *seq) {
    if (!c || !(timeout_s > 0) || isinf(timeout_s)) return SX_EINVAL;
    int rc = usable(c);
    if (rc != SX_OK) return rc;
    *seq = ++c->seq;
    *deadline = now_s() + timeout_s;
    return SX_OK;
}

/* Segment i of the ring = shard i of count elements, in bytes. */
static void segment(const sx_comm *c, char *buf, size_t count, size_t elsize, int i, char **at, size_t *len) {
    uint64_t lo, hi;
    sx_shard_range(count, c->world, ((i % c->world) + c->world) % c->world, &lo, &hi);
    *at = buf + lo * elsize;
    *len = (size_t)(hi - lo) * elsize;
}

/* Reduce-scatter (first N-1 steps): at step t rank r sends segment r-t-1 (its own at t=0, then the one
 * it reduced at t-1) and adds segment r-t-2 into place; after N-1 steps segment r is complete.
 * Allgather (N-1 steps after `first`): at step s it sends segment r-s and writes segment r-s-1. */
static int plan_reduce_scatter(sx_comm *c, char *buf, size_t count, size_t elsize) {
    int n = c->world;
    for (int t = 0; t < n - 1; t++) {
        struct step *s = &c->steps[t];
        segment(c, buf, count, elsize, c->rank - t - 1, &s->send, &s->send_len);
        segment(c, buf, count, elsize, c->rank - t - 2, &s->recv, &s->recv_len);
        s->reduce = 1;
        s->send_after = t - 1;
    }
    return n - 1;
}

static int plan_allgather(sx_comm *c, char *buf, size_t count, size_t elsize, int first) {
    int n = c->world;
    for (int k = 0; k < n - 1; k++) {
        struct step *s = &c->steps[first + k];
        segment(c, buf, count, elsize, c->rank - k, &s->send, &s->send_len);
        segment(c, buf, count, elsize, c->rank - k - 1, &s->recv, &s->recv_len);
        s->reduce = 0;
        s->send_after = first + k - 1; /* -1 for a plain allgather: its own segment is ready */
    }
    return first + n - 1;
}

static int reduce_call(sx_comm *c, int op_code, void *buf, size_t count, int dtype, int op, double timeout_s,
                       int gather) {
    reduce_fn reduce = sx_reducer(dtype, op);
    if (!reduce || (count && !buf)) return SX_EINVAL;
    double deadline;
    uint64_t seq;
    int rc = start(c, timeout_s, &deadline, &seq);
    if (rc != SX_OK || c->world == 1) return rc;
    size_t elsize = sx_dtype_size(dtype);
    int nsteps = plan_reduce_scatter(c, buf, count, elsize);
    if (gather) nsteps = plan_allgather(c, buf, count, elsize, nsteps);
    return run_plan(c, op_code, seq, nsteps, reduce, elsize, deadline);
}

int sx_comm_allreduce(sx_comm *c, void *buf, size_t count, int dtype, int op, double timeout_s) {
    return reduce_call(c, OP_ALLREDUCE, buf, count, dtype, op, timeout_s, 1);
}

int sx_comm_reduce_scatter(sx_comm *c, void *buf, size_t count, int dtype, int op, double timeout_s) {
    return reduce_call(c, OP_REDUCE_SCATTER, buf, count, dtype, op, timeout_s, 0);
}

int sx_comm_allgather(sx_comm *c, void *buf, size_t count, int dtype, double timeout_s) {
    size_t elsize = sx_dtype_size(dtype);
    if (!elsize || (count && !buf)) return SX_EINVAL;
    double deadline;
    uint64_t seq;
    int rc = start(c, timeout_s, &deadline, &seq);
    if (rc != SX_OK || c->world == 1) return rc;
    int nsteps = plan_allgather(c, buf, count, elsize, 0);
    return run_plan(c, OP_ALLGATHER, seq, nsteps, NULL, elsize, deadline);
}

/* A chain from root around the ring: every rank but root receives, every rank but the last forwards
 * each frame as soon as it has landed. */
int sx_comm_broadcast(sx_comm *c, void *buf, size_t nbytes, int root, double timeout_s) {
    if (!c || root < 0 || root >= c->world || (nbytes && !buf)) return SX_EINVAL;
    double deadline;
    uint64_t seq;
    int rc = start(c, timeout_s, &deadline, &seq);
    if (rc != SX_OK || c->world == 1) return rc;
    int position = (c->rank - root + c->world) % c->world;
    struct step *s = &c->steps[0];
    *s = (struct step){.send_after = position ? 0 : -1};
    if (position < c->world - 1) { s->send = buf; s->send_len = nbytes; }
    if (position > 0) { s->recv = buf; s->recv_len = nbytes; }
    return run_plan(c, OP_BROADCAST, seq, 1, NULL, 1, deadline);
}

/* One step of the ring in both directions at once: send_len bytes to the right-hand neighbour while the
 * left-hand one's recv_len bytes land (peer-memory snapshots: each rank's copy goes to the next node). */
int sx_comm_shift(sx_comm *c, const void *send_buf, size_t send_len, void *recv_buf, size_t recv_len,
                  double timeout_s) {
    if (!c || (send_len && !send_buf) || (recv_len && !recv_buf)) return SX_EINVAL;
    double deadline;
    uint64_t seq;
    int rc = start(c, timeout_s, &deadline, &seq);
    if (rc != SX_OK || c->world == 1) return rc;
    c->steps[0] = (struct step){.send = (char *)send_buf, .send_len = send_len, .recv = recv_buf,
                                .recv_len = recv_len, .send_after = -1};
    return run_plan(c, OP_SHIFT, seq, 1, NULL, 1, deadline);
}

/* An allreduce of one word: no rank can finish before every rank has sent its part. */
int sx_comm_barrier(sx_comm *c, double timeout_s) {
    double deadline;
    uint64_t seq;
    int rc = start(c, timeout_s, &deadline, &seq);
    if (rc != SX_OK || c->world == 1) return rc;
    c->barrier_word = 1;
    int nsteps = plan_reduce_scatter(c, (char *)&c->barrier_word, 1, 8);
    nsteps = plan_allgather(c, (char *)&c->barrier_word, 1, 8, nsteps);
    return run_plan(c, OP_BARRIER, seq, nsteps, sx_reducer(SX_DTYPE_I64, SX_OP_SUM), 8, deadline);
}
