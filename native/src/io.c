/* io.c - durable, streaming file writes and the fault-injection hook.
 *
 * Why in C: the write path must overlap copying (and CRC) of the next chunk
 * with the disk write of the previous one, keep O_DIRECT's alignment rules
 * out of Python, and give the crash tests one hook in front of every write,
 * fsync and rename. Two aligned staging buffers: the caller fills one while
 * a background thread writes the other.
 */
#define _GNU_SOURCE
#include "sneppx.h"
#include "split.h"
#include "status.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h> /* rename */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ALIGN 4096u
#define CRC_PIECE (256u * 1024u) /* CRC then copy in L2-sized pieces */

static __thread int last_errno;
int sx_last_errno(void) { return last_errno; }
void sx_record_errno(int e) { last_errno = e; }

const char *sx_strerror(int code) {
    switch (code) {
    case SX_OK: return "ok";
    case SX_EINVAL: return "invalid argument";
    case SX_EIO: return "I/O error";
    case SX_ENOSPC: return "no space left on device";
    case SX_ENOMEM: return "out of memory";
    case SX_ENOENT: return "no such file or directory";
    case SX_EEXIST: return "file exists";
    case SX_EFSYNC: return "fsync failed: data may not be on disk";
    case SX_ENODEV: return "no device";
    case SX_ENOLIB: return "library not found";
    case SX_ECUDA: return "CUDA error";
    case SX_EPERM: return "permission denied";
    case SX_ESTATE: return "not allowed in the current state";
    case SX_ETIMEDOUT: return "timed out";
    case SX_ENET: return "socket error";
    case SX_EPEER: return "peer lost: it died or left (its connection closed, or a neighbour reported it)";
    case SX_EABORTED: return "aborted, or failed in an earlier call";
    case SX_ESTALE: return "message from another membership generation";
    case SX_EPROTO: return "malformed message, or ranks called different collectives";
    case SX_ENCCL: return "NCCL error";
    case SX_EEOF: return "unexpected end of file";
    default: return "unknown error";
    }
}

static int status_from_errno(int e) {
    last_errno = e;
    switch (e) {
    case ENOSPC: case EDQUOT: return SX_ENOSPC;
    case ENOENT: return SX_ENOENT;
    case EEXIST: return SX_EEXIST;
    case ENOMEM: return SX_ENOMEM;
    case EACCES: case EPERM: case EROFS: return SX_EPERM;
    case EINVAL: return SX_EINVAL;
    default: return SX_EIO;
    }
}

/* ---- fault injection ---------------------------------------------------- */

static pthread_mutex_t fault_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t fault_env_once = PTHREAD_ONCE_INIT;
static unsigned fault_mask;
static long fault_countdown; /* fires when it reaches 0; <= 0 means disarmed */
static int fault_action;
static long fault_repeat; /* matching calls still to fail after the one that fires */
static long sites_passed;

static void fault_from_env(void) {
    const char *spec = getenv("SNEPPX_FAULT"); /* e.g. "write,fsync:17:kill" */
    if (!spec) return;
    char buf[128];
    strncpy(buf, spec, sizeof buf - 1);
    buf[sizeof buf - 1] = 0;
    char *count = strchr(buf, ':');
    if (!count) return;
    *count++ = 0;
    char *action = strchr(count, ':');
    if (action) *action++ = 0;
    unsigned mask = 0;
    if (strstr(buf, "write")) mask |= SX_SITE_WRITE;
    if (strstr(buf, "fsync")) mask |= SX_SITE_FSYNC;
    if (strstr(buf, "rename")) mask |= SX_SITE_RENAME;
    if (strstr(buf, "dirsync")) mask |= SX_SITE_DIRSYNC;
    if (strstr(buf, "read")) mask |= SX_SITE_READ;
    if (strstr(buf, "all")) mask = ~0u;
    int act = 0;
    if (action && !strcmp(action, "ENOSPC")) act = ENOSPC;
    else if (action && !strcmp(action, "EIO")) act = EIO;
    fault_mask = mask;
    fault_countdown = strtol(count, NULL, 10);
    fault_action = act;
}

void sx_fault_arm_times(unsigned site_mask, long countdown, long times, int action) {
    pthread_once(&fault_env_once, fault_from_env);
    pthread_mutex_lock(&fault_lock);
    fault_mask = site_mask;
    fault_countdown = countdown;
    fault_action = action;
    fault_repeat = times > 1 ? times - 1 : 0;
    pthread_mutex_unlock(&fault_lock);
}

void sx_fault_arm(unsigned site_mask, long countdown, int action) {
    sx_fault_arm_times(site_mask, countdown, 1, action);
}

long sx_fault_sites_passed(void) {
    pthread_mutex_lock(&fault_lock);
    long n = sites_passed;
    pthread_mutex_unlock(&fault_lock);
    return n;
}

/* Called in front of every I/O site: 0 to go on, or an errno to fail with. */
static int fault_point(unsigned site) {
    pthread_once(&fault_env_once, fault_from_env);
    pthread_mutex_lock(&fault_lock);
    sites_passed++;
    int fire = (fault_mask & site) && fault_countdown > 0 && --fault_countdown == 0;
    if (fire && fault_repeat > 0) { fault_repeat--; fault_countdown = 1; } /* the next match fails too */
    int action = fault_action;
    pthread_mutex_unlock(&fault_lock);
    if (!fire) return 0;
    if (action == 0) kill(getpid(), SIGKILL);
    return action;
}

/* ---- plain durable helpers --------------------------------------------- */

static int fsync_fd(int fd) {
    int inj = fault_point(SX_SITE_FSYNC);
    if (inj || fsync(fd) != 0) return status_from_errno(inj ? inj : errno) == SX_ENOSPC ? SX_ENOSPC : SX_EFSYNC;
    return SX_OK;
}

int sx_fsync_path(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return status_from_errno(errno);
    int rc = fsync_fd(fd);
    close(fd);
    return rc;
}

static int fsync_dir_of(const char *path) {
    char *copy = strdup(path);
    if (!copy) return SX_ENOMEM;
    int rc = SX_OK;
    int fd = open(dirname(copy), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) rc = status_from_errno(errno);
    else {
        int inj = fault_point(SX_SITE_DIRSYNC);
        if (inj || fsync(fd) != 0) { status_from_errno(inj ? inj : errno); rc = SX_EFSYNC; }
        close(fd);
    }
    free(copy);
    return rc;
}

int sx_rename_durable(const char *from, const char *to) {
    int inj = fault_point(SX_SITE_RENAME);
    if (inj || rename(from, to) != 0) return status_from_errno(inj ? inj : errno);
    int rc = fsync_dir_of(to);
    if (rc != SX_OK) return rc;
    char *a = strdup(from), *b = strdup(to);
    if (!a || !b) { free(a); free(b); return SX_ENOMEM; }
    if (strcmp(dirname(a), dirname(b)) != 0) rc = fsync_dir_of(from);
    free(a); free(b);
    return rc;
}

/* ---- streaming writer --------------------------------------------------- */

/* Writes are queued to WRITERS background threads, so the device always has the next write waiting when one
 * completes (with one writer and two buffers, two thread handoffs per buffer left the device idle between
 * writes) and a device that gains from two writes in flight gets them. Bytes reach the queue two ways:
 *   staged:    copied (and CRC-ed) into one of NBUF aligned staging buffers, queued when the buffer is full.
 *              Always under O_DIRECT: the caller keeps filling while the writers write, across appends.
 *   zero-copy: in buffered mode, a large append is queued straight from the caller's memory in chunks while
 *              the caller computes the CRC of the same chunks (the kernel's copy into the page cache is the
 *              only copy); the append returns once every chunk is written, so the caller's memory is never
 *              read after the call. (Tried under O_DIRECT from page-aligned memory too: that wait at the end
 *              of every append left the device idle between tensors, 0.8x the staged path.)
 * Every job carries its file offset, so the order in which writers finish doesn't matter.
 * Measured on a virtio disk (docs/BENCHMARKS.md): 2 MiB chunks with two writers 1.2x 8 MiB chunks with one. */
#define NBUF 4
#define WRITERS 2
#define QCAP 8
#define DEFAULT_CHUNK ((size_t)2 << 20)
#define ZERO_COPY_MIN ((size_t)1 << 20) /* below this a copy costs less than the round trips to the writers */

struct write_job {
    const unsigned char *p;
    size_t len;
    uint64_t off;
    int buf; /* the staging buffer it came from, or -1: the caller's memory */
};

struct sx_file {
    int fd;           /* the write fd (O_DIRECT when direct) */
    int fd_buffered;  /* for pwrite of small regions under O_DIRECT */
    int direct;       /* under lock: a writer thread may turn it off (write_all) */
    char *path;
    size_t cap;                  /* bytes per staging buffer and per zero-copy chunk, multiple of ALIGN */
    unsigned char *buf[NBUF];
    int busy[NBUF];              /* under lock: queued or being written */
    int cur;                     /* buffer the caller fills, -1 when none */
    size_t fill;                 /* bytes in buf[cur] */
    uint64_t base;               /* file offset of buf[cur][0] (of the next byte when cur is -1) */
    pthread_t thread[WRITERS];
    int threads;
    pthread_mutex_t lock;
    pthread_cond_t cond;         /* any change below */
    struct write_job queue[QCAP];
    int head, queued, writing;   /* ring of queued jobs; jobs taken by a writer and not yet done */
    int caller_jobs;             /* zero-copy jobs queued or being written */
    int stop;
    int status, status_errno;    /* first failure, sticky */
};

/* Turns O_DIRECT off on the write fd (idempotent: another writer may have done it already). */
static int go_buffered(sx_file *f) {
    pthread_mutex_lock(&f->lock);
    int fl = fcntl(f->fd, F_GETFL);
    int rc = fl < 0 ? -1 : (fl & O_DIRECT) ? fcntl(f->fd, F_SETFL, fl & ~O_DIRECT) : 0;
    if (rc == 0) f->direct = 0;
    pthread_mutex_unlock(&f->lock);
    return rc;
}

static int write_all(sx_file *f, int fd, const unsigned char *p, size_t len, uint64_t off, int *err) {
    /* read before writing: two writers may both be refused under O_DIRECT, and the
     * second must fall back too even though the first already turned it off */
    int direct = fd == f->fd && sx_file_is_direct(f);
    while (len) {
        int inj = fault_point(SX_SITE_WRITE);
        ssize_t n = inj ? (errno = inj, -1) : pwrite(fd, p, len, (off_t)off);
        if (n < 0) {
            int e = errno; /* the write's, whatever the fall back's fcntl leaves */
            if (e == EINTR) continue;
            if (e == EINVAL && direct && go_buffered(f) == 0) {
                /* the filesystem took O_DIRECT at open but not at write: retry buffered, once */
                direct = 0;
                continue;
            }
            *err = e;
            return e == ENOSPC || e == EDQUOT ? SX_ENOSPC : SX_EIO;
        }
        if (n == 0) { *err = EIO; return SX_EIO; }
        p += n; len -= (size_t)n; off += (uint64_t)n;
    }
    return SX_OK;
}

static void write_behind(sx_file *f, uint64_t off, size_t len) {
    /* Buffered mode: start writeback now, and drop pages written a few chunks back (waiting for them) so
     * dirty-page throttling never stalls the stream and the page cache doesn't fill with checkpoint bytes
     * nobody reads (measured 5x faster than plain buffered writes on a disk that throttled). */
    sync_file_range(f->fd, (off_t)off, (off_t)len, SYNC_FILE_RANGE_WRITE);
    uint64_t lag = (uint64_t)(WRITERS + 2) * f->cap; /* behind every write that may still be running */
    if (off >= lag) {
        uint64_t old = off - lag;
        sync_file_range(f->fd, (off_t)old, (off_t)f->cap,
                        SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
        posix_fadvise(f->fd, (off_t)old, (off_t)f->cap, POSIX_FADV_DONTNEED);
    }
}

static void *writer_main(void *arg) {
    sx_file *f = arg;
    pthread_mutex_lock(&f->lock);
    for (;;) {
        while (!f->queued && !f->stop) pthread_cond_wait(&f->cond, &f->lock);
        if (!f->queued) break; /* stopping, and nothing left */
        struct write_job job = f->queue[f->head];
        f->head = (f->head + 1) % QCAP;
        f->queued--;
        f->writing++;
        int failed = f->status != SX_OK, direct = f->direct;
        pthread_mutex_unlock(&f->lock);
        int err = 0, rc = SX_OK;
        if (!failed) { /* after a failure, jobs are only retired: the file will not be committed */
            rc = write_all(f, f->fd, job.p, job.len, job.off, &err);
            if (rc == SX_OK && !direct) write_behind(f, job.off, job.len);
        }
        pthread_mutex_lock(&f->lock);
        if (rc != SX_OK && f->status == SX_OK) { f->status = rc; f->status_errno = err; }
        if (job.buf >= 0) f->busy[job.buf] = 0;
        else f->caller_jobs--;
        f->writing--;
        pthread_cond_broadcast(&f->cond);
    }
    pthread_mutex_unlock(&f->lock);
    return NULL;
}

/* The sticky status, under the lock; records its errno for the caller. */
static int status_locked(sx_file *f) {
    if (f->status != SX_OK) last_errno = f->status_errno;
    return f->status;
}

/* Waits until every queued write is done; returns the sticky status. */
static int drain(sx_file *f) {
    pthread_mutex_lock(&f->lock);
    while (f->queued || f->writing) pthread_cond_wait(&f->cond, &f->lock);
    int rc = status_locked(f);
    pthread_mutex_unlock(&f->lock);
    return rc;
}

/* Queues one job (waiting for room); fails at once with the sticky status after a failure. */
static int enqueue(sx_file *f, struct write_job job) {
    pthread_mutex_lock(&f->lock);
    while (f->queued == QCAP && f->status == SX_OK) pthread_cond_wait(&f->cond, &f->lock);
    int rc = status_locked(f);
    if (rc == SX_OK) {
        f->queue[(f->head + f->queued) % QCAP] = job;
        f->queued++;
        if (job.buf >= 0) f->busy[job.buf] = 1;
        else f->caller_jobs++;
        pthread_cond_signal(&f->cond);
    }
    pthread_mutex_unlock(&f->lock);
    return rc;
}

/* Queues buf[cur] (len bytes, len padded for O_DIRECT) at its offset; the caller takes a new one next. */
static int submit(sx_file *f, size_t len) {
    int rc = enqueue(f, (struct write_job){f->buf[f->cur], len, f->base, f->cur});
    if (rc != SX_OK) return rc;
    f->base += f->fill;
    f->fill = 0;
    f->cur = -1;
    return SX_OK;
}

/* Makes buf[cur] a staging buffer to fill: waits for one that no writer holds. */
static int take_buffer(sx_file *f) {
    if (f->cur >= 0) return SX_OK;
    pthread_mutex_lock(&f->lock);
    int found = -1;
    for (;;) {
        for (int i = 0; i < NBUF && found < 0; i++)
            if (!f->busy[i]) found = i;
        if (found >= 0 || f->status != SX_OK) break;
        pthread_cond_wait(&f->cond, &f->lock);
    }
    int rc = status_locked(f);
    pthread_mutex_unlock(&f->lock);
    if (rc == SX_OK) f->cur = found;
    return rc;
}

/* Staging buffers outlive their writer: a process that saves every few minutes reuses the same ones
 * instead of page-faulting fresh memory each time (measured on this VM: about 1 ms per MiB touched
 * for the first time, more than the copy and CRC of the same bytes). At most POOL_SIZE are kept. */
#define POOL_SIZE NBUF
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned char *pool[POOL_SIZE];
static size_t pool_cap[POOL_SIZE];

static unsigned char *buffer_get(size_t cap) {
    unsigned char *b = NULL;
    pthread_mutex_lock(&pool_lock);
    for (int i = 0; i < POOL_SIZE && !b; i++)
        if (pool[i] && pool_cap[i] == cap) { b = pool[i]; pool[i] = NULL; }
    pthread_mutex_unlock(&pool_lock);
    if (!b && posix_memalign((void **)&b, ALIGN, cap)) b = NULL;
    return b;
}

static void buffer_put(unsigned char *b, size_t cap) {
    if (!b) return;
    pthread_mutex_lock(&pool_lock);
    for (int i = 0; i < POOL_SIZE && b; i++)
        if (!pool[i]) { pool[i] = b; pool_cap[i] = cap; b = NULL; }
    pthread_mutex_unlock(&pool_lock);
    free(b);
}

static void release(sx_file *f) {
    if (f->threads) {
        pthread_mutex_lock(&f->lock);
        f->stop = 1;
        pthread_cond_broadcast(&f->cond);
        pthread_mutex_unlock(&f->lock);
        for (int i = 0; i < f->threads; i++) pthread_join(f->thread[i], NULL);
    }
    pthread_mutex_destroy(&f->lock);
    pthread_cond_destroy(&f->cond);
    if (f->fd >= 0) close(f->fd);
    if (f->fd_buffered >= 0) close(f->fd_buffered);
    for (int i = 0; i < NBUF; i++) buffer_put(f->buf[i], f->cap);
    free(f->path);
    free(f);
}

int sx_file_create(const char *path, size_t buffer_bytes, int direct, sx_file **out) {
    *out = NULL;
    if (!path) return SX_EINVAL;
    sx_file *f = calloc(1, sizeof *f);
    if (!f) return SX_ENOMEM;
    f->fd = f->fd_buffered = -1;
    f->cur = -1;
    f->cap = buffer_bytes ? (buffer_bytes + ALIGN - 1) / ALIGN * ALIGN : DEFAULT_CHUNK;
    pthread_mutex_init(&f->lock, NULL);
    pthread_cond_init(&f->cond, NULL);
    int rc = SX_OK, created = 0;
    f->path = strdup(path);
    if (!f->path) { rc = SX_ENOMEM; goto fail; }
    for (int i = 0; i < NBUF; i++)
        if (!(f->buf[i] = buffer_get(f->cap))) { rc = SX_ENOMEM; goto fail; }
    f->fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (f->fd < 0) { rc = status_from_errno(errno); goto fail; }
    created = 1;
    /* O_DIRECT is asked for only once the file exists: some filesystems create the
     * inode and then refuse O_DIRECT in open(), and a buffered retry with O_EXCL
     * would then fail on the empty file the first try left behind. Refused here
     * (EINVAL), the file just stays buffered. */
    int fl = direct ? fcntl(f->fd, F_GETFL) : -1;
    f->direct = fl >= 0 && fcntl(f->fd, F_SETFL, fl | O_DIRECT) == 0;
    f->fd_buffered = open(path, O_WRONLY | O_CLOEXEC);
    if (f->fd_buffered < 0) { rc = status_from_errno(errno); goto fail; }
    for (; f->threads < WRITERS; f->threads++)
        if (pthread_create(&f->thread[f->threads], NULL, writer_main, f) != 0) break;
    if (!f->threads) { rc = SX_ENOMEM; goto fail; }
    *out = f;
    return SX_OK;
fail:
    if (created) unlink(path);
    release(f);
    return rc;
}

/* Copies (and CRCs) into staging buffers, queueing each one that fills. */
static int append_staged(sx_file *f, const unsigned char *p, size_t len, uint32_t *crc) {
    while (len) {
        int rc = take_buffer(f);
        if (rc != SX_OK) return rc;
        size_t room = f->cap - f->fill;
        size_t n = len < room ? len : room;
        if (n > CRC_PIECE) n = CRC_PIECE;
        if (crc) *crc = sx_crc32c(*crc, p, n);
        memcpy(f->buf[f->cur] + f->fill, p, n);
        f->fill += n; p += n; len -= n;
        if (f->fill == f->cap && (rc = submit(f, f->cap)) != SX_OK) return rc;
    }
    return SX_OK;
}

/* How many leading bytes of an append can be written from the caller's memory (0: none). */
static size_t zero_copy_bytes(sx_file *f, size_t len) {
    return len >= ZERO_COPY_MIN && !sx_file_is_direct(f) ? len : 0;
}

/* Queues the caller's memory in chunks, CRCs each chunk while it is being written, then waits for them. */
static int append_zero_copy(sx_file *f, const unsigned char *p, size_t len, uint32_t *crc) {
    int rc = f->fill ? submit(f, f->fill) : SX_OK; /* what is staged goes first; its end is aligned here */
    f->cur = -1; /* an empty buffer is given back too */
    for (size_t done = 0; rc == SX_OK && done < len;) {
        size_t n = len - done < f->cap ? len - done : f->cap;
        rc = enqueue(f, (struct write_job){p + done, n, f->base, -1});
        if (rc != SX_OK) break;
        f->base += n;
        if (crc) *crc = sx_crc32c(*crc, p + done, n);
        done += n;
    }
    pthread_mutex_lock(&f->lock); /* the caller's memory must not be read after this call returns */
    while (f->caller_jobs) pthread_cond_wait(&f->cond, &f->lock);
    int failed = status_locked(f);
    pthread_mutex_unlock(&f->lock);
    return rc != SX_OK ? rc : failed;
}

int sx_file_append(sx_file *f, const void *data, size_t len, uint32_t *crc) {
    const unsigned char *p = data;
    if (!f || (!p && len)) return SX_EINVAL;
    size_t direct_len = zero_copy_bytes(f, len);
    if (direct_len) {
        int rc = append_zero_copy(f, p, direct_len, crc);
        if (rc != SX_OK) return rc;
        p += direct_len; len -= direct_len;
    }
    return append_staged(f, p, len, crc);
}

int sx_file_pad(sx_file *f, uint64_t alignment) {
    static const unsigned char zeros[ALIGN];
    if (!f || alignment == 0 || alignment > (1u << 30)) return SX_EINVAL;
    uint64_t size = sx_file_size(f);
    uint64_t need = (alignment - size % alignment) % alignment;
    while (need) {
        size_t n = need < sizeof zeros ? (size_t)need : sizeof zeros;
        int rc = append_staged(f, zeros, n, NULL);
        if (rc != SX_OK) return rc;
        need -= n;
    }
    return SX_OK;
}

uint64_t sx_file_size(const sx_file *f) { return f->base + f->fill; }

int sx_file_is_direct(const sx_file *f) {
    /* the lock is not part of the file's logical state, so a const file may take it */
    pthread_mutex_t *lock = (pthread_mutex_t *)&f->lock;
    pthread_mutex_lock(lock);
    int direct = f->direct;
    pthread_mutex_unlock(lock);
    return direct;
}

int sx_file_pwrite(sx_file *f, const void *data, size_t len, uint64_t off) {
    const unsigned char *p = data;
    if (!f || off + len > sx_file_size(f) || off + len < off) return SX_EINVAL;
    /* the part still in the staging buffer is patched there */
    if (off + len > f->base) {
        uint64_t start = off > f->base ? off : f->base;
        memcpy(f->buf[f->cur] + (start - f->base), p + (start - off), (size_t)(off + len - start));
        len = (size_t)(start - off);
    }
    if (!len) return SX_OK;
    int rc = drain(f); /* the region is on its way to disk: wait, then overwrite */
    if (rc != SX_OK) return rc;
    int err = 0;
    rc = write_all(f, f->fd_buffered, p, len, off, &err);
    if (rc != SX_OK) last_errno = err;
    return rc;
}

int sx_file_finish(sx_file *f) {
    if (!f) return SX_EINVAL;
    uint64_t size = sx_file_size(f);
    /* Drain first: until the writers are idle they may still turn O_DIRECT off. */
    int rc = drain(f);
    int padded = 0;
    if (rc == SX_OK && f->fill) {
        size_t len = f->fill;
        if (sx_file_is_direct(f)) { /* O_DIRECT writes whole blocks: pad with zeros, trim below */
            size_t whole = (len + ALIGN - 1) / ALIGN * ALIGN;
            memset(f->buf[f->cur] + len, 0, whole - len);
            padded = whole != len;
            len = whole;
        }
        rc = submit(f, len);
    }
    if (rc == SX_OK) rc = drain(f);
    /* trim by what was padded, not by f->direct: a late fall back to buffered
     * writes still wrote the padding */
    if (rc == SX_OK && padded && ftruncate(f->fd, (off_t)size) != 0) rc = status_from_errno(errno);
    if (rc == SX_OK) rc = fsync_fd(f->fd);
    int saved = last_errno;
    release(f);
    last_errno = saved;
    return rc;
}

void sx_file_abort(sx_file *f) {
    if (!f) return;
    char *path = strdup(f->path);
    release(f);
    if (path) unlink(path);
    free(path);
}

/* ---- reads ----------------------------------------------------------------- */

#define READ_PIECE ((size_t)256 << 10) /* read then CRC in pieces that stay in cache */
#define READ_MAX_THREADS 16

struct read_job {
    int fd;
    unsigned char *p;
    size_t len;
    uint64_t off;
    int want_crc;
    uint32_t crc;
    size_t block;    /* > 0: one CRC per block of the slice (which starts on a block boundary) into crcs */
    uint32_t *crcs;
    int rc, err; /* status and errno of the first failure */
};

static void read_slice(struct read_job *j) {
    uint32_t c = 0;
    size_t done = 0;
    j->rc = SX_OK;
    while (done < j->len) {
        size_t want = j->len - done < READ_PIECE ? j->len - done : READ_PIECE;
        if (j->block && want > j->block - done % j->block) want = j->block - done % j->block;
        int inj = fault_point(SX_SITE_READ);
        ssize_t n = inj ? (errno = inj, -1) : pread(j->fd, j->p + done, want, (off_t)(j->off + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            j->err = errno;
            j->rc = status_from_errno(errno);
            return;
        }
        if (n == 0) { j->err = 0; j->rc = SX_EEOF; return; }
        if (j->want_crc) c = sx_crc32c(c, j->p + done, (size_t)n);
        done += (size_t)n;
        if (j->block && (done % j->block == 0 || done == j->len)) {
            j->crcs[(done - 1) / j->block] = c;
            c = 0;
        }
    }
    j->crc = c;
}

static void *read_main(void *arg) {
    read_slice(arg);
    return NULL;
}

/* Runs n read jobs, job 0 on the calling thread; the first failure's status (its errno kept). */
static int run_reads(struct read_job *jobs, size_t n) {
    pthread_t threads[READ_MAX_THREADS];
    int started[READ_MAX_THREADS] = {0};
    /* a failed thread start runs its slice here too */
    for (size_t i = 1; i < n; i++) started[i] = pthread_create(&threads[i], NULL, read_main, &jobs[i]) == 0;
    read_slice(&jobs[0]);
    for (size_t i = 1; i < n; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        else read_slice(&jobs[i]);
    }
    for (size_t i = 0; i < n; i++) {
        if (jobs[i].rc != SX_OK) {
            last_errno = jobs[i].err;
            return jobs[i].rc;
        }
    }
    return SX_OK;
}

/* Large reads are split over threads, as the parallel CRC is: each slice is read and hashed by its own
 * thread (from the page cache a read is a memory copy, and one core copies and hashes at about half the
 * speed two do); the CRCs are combined in order. */
int sx_read_at(int fd, void *buf, size_t len, uint64_t offset, uint32_t *crc) {
    if (fd < 0 || (len && !buf)) return SX_EINVAL;
    size_t n = split_count(len, split_online_cpus(), READ_MAX_THREADS);
    struct read_job jobs[READ_MAX_THREADS];
    for (size_t i = 0; i < n; i++) {
        struct split_slice sl = split_slice(len, n, i);
        jobs[i] = (struct read_job){fd, (unsigned char *)buf + sl.off, sl.len, offset + sl.off, crc != NULL, 0, 0,
                                    NULL, SX_OK, 0};
    }
    int rc = run_reads(jobs, n);
    if (rc != SX_OK) return rc;
    uint32_t total = crc ? *crc : 0;
    for (size_t i = 0; i < n; i++) total = sx_crc32c_combine(total, jobs[i].crc, jobs[i].len);
    if (crc) *crc = total;
    return SX_OK;
}

/* The threads' slices are whole blocks, so each block's CRC is one thread's. */
int sx_read_blocks_at(int fd, void *buf, size_t len, uint64_t offset, size_t block_bytes, uint32_t *crcs) {
    if (fd < 0 || (len && (!buf || !crcs)) || block_bytes == 0) return SX_EINVAL;
    size_t blocks = len / block_bytes + (len % block_bytes != 0);
    size_t n = split_count(len, split_online_cpus(), READ_MAX_THREADS);
    if (n > blocks) n = blocks ? blocks : 1;
    struct read_job jobs[READ_MAX_THREADS];
    for (size_t i = 0; i < n; i++) {
        size_t first = blocks * i / n, last = blocks * (i + 1) / n;
        size_t start = first * block_bytes, end = last * block_bytes < len ? last * block_bytes : len;
        jobs[i] = (struct read_job){fd, (unsigned char *)buf + start, end - start, offset + start, 1, 0, block_bytes,
                                    crcs ? crcs + first : NULL, SX_OK, 0};
    }
    return run_reads(jobs, n);
}
