/* copy.c - the snapshot copy engine: state -> staging chunks, with CRC32C as the bytes land.
 *
 * Why in C: an async save is only as "async" as its snapshot is short. On a GPU the
 * snapshot is a device-to-host copy that must overlap with hashing the bytes already
 * copied, which needs a CUDA stream, events and pinned memory; in Python each of those
 * would cost a GIL round trip per chunk. On the CPU the same call splits a copy over
 * plain threads. Either way the caller gets the CRC32C of what was copied, so the
 * bytes written later can be checked against the bytes snapshot.
 *
 * CUDA is never a build-time dependency: libcudart is dlopen'ed at run time (the
 * path is chosen by the Python side: the nvidia-cuda-runtime-cu12 wheel, an
 * environment override, or the soname). On a machine without a GPU the library
 * still loads and cudaGetDeviceCount fails (35, insufficient driver, or 100, no
 * device): that is SX_ENODEV, and callers fall back to the CPU path.
 */
#define _GNU_SOURCE
#include "sneppx.h"
#include "split.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- the slice of the CUDA runtime API we use (ABI-stable since CUDA 4) ---- */

typedef int cuda_err;
typedef void *cuda_stream;
typedef void *cuda_event;

enum { CUDA_SUCCESS = 0, CUDA_ERR_INSUFFICIENT_DRIVER = 35, CUDA_ERR_NO_DEVICE = 100 };
enum { MEMCPY_H2D = 1, MEMCPY_D2H = 2, MEMCPY_D2D = 3 };
enum { HOST_ALLOC_PORTABLE = 1, STREAM_NON_BLOCKING = 1, EVENT_BLOCKING_SYNC = 1, EVENT_DISABLE_TIMING = 2 };

struct cuda_api {
    cuda_err (*GetDeviceCount)(int *);
    cuda_err (*SetDevice)(int);
    cuda_err (*HostAlloc)(void **, size_t, unsigned);
    cuda_err (*FreeHost)(void *);
    cuda_err (*Malloc)(void **, size_t);
    cuda_err (*Free)(void *);
    cuda_err (*Memcpy)(void *, const void *, size_t, int);
    cuda_err (*MemcpyAsync)(void *, const void *, size_t, int, cuda_stream);
    cuda_err (*StreamCreateWithFlags)(cuda_stream *, unsigned);
    cuda_err (*StreamSynchronize)(cuda_stream);
    cuda_err (*StreamDestroy)(cuda_stream);
    cuda_err (*EventCreateWithFlags)(cuda_event *, unsigned);
    cuda_err (*EventRecord)(cuda_event, cuda_stream);
    cuda_err (*EventSynchronize)(cuda_event);
    cuda_err (*EventDestroy)(cuda_event);
    cuda_err (*StreamWaitEvent)(cuda_stream, cuda_event, unsigned);
    cuda_err (*MemsetAsync)(void *, int, size_t, cuda_stream);
    const char *(*GetErrorString)(cuda_err);
};

/* Written once, under cuda_lock, before cuda_handle is published with a
 * release store; read without the lock only after an acquire load of
 * cuda_handle (cuda_loaded) saw it set, so a reader never sees the handle
 * without the table and path it guards. Never changed after that. */
static pthread_mutex_t cuda_lock = PTHREAD_MUTEX_INITIALIZER;
static struct cuda_api cuda;
static char cuda_path[4096];
static void *cuda_handle;
static __thread int cuda_last;

static int cuda_loaded(void) { return __atomic_load_n(&cuda_handle, __ATOMIC_ACQUIRE) != NULL; }

int sx_cuda_last_error(void) { return cuda_last; }

const char *sx_cuda_error_string(int err) {
    if (cuda_loaded()) return cuda.GetErrorString(err);
    return "CUDA runtime not loaded";
}

static int cuda_status(cuda_err e) {
    if (e == CUDA_SUCCESS) return SX_OK;
    cuda_last = e;
    if (e == CUDA_ERR_INSUFFICIENT_DRIVER || e == CUDA_ERR_NO_DEVICE) return SX_ENODEV;
    return SX_ECUDA;
}

int sx_cuda_load(const char *path) {
    pthread_mutex_lock(&cuda_lock);
    int rc = SX_OK;
    if (cuda_handle) goto out; /* loaded once per process; later paths are ignored */
    const char *name = path && *path ? path : "libcudart.so.12";
    void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!h) { rc = SX_ENOLIB; goto out; }
    struct cuda_api api; /* filled aside, so a failed load leaves the shared table untouched */
#define SYM(field, sym)                                       \
    do {                                                      \
        *(void **)&api.field = dlsym(h, sym);                 \
        if (!api.field) { dlclose(h); rc = SX_ENOLIB; goto out; } \
    } while (0)
    SYM(GetDeviceCount, "cudaGetDeviceCount");
    SYM(SetDevice, "cudaSetDevice");
    SYM(HostAlloc, "cudaHostAlloc");
    SYM(FreeHost, "cudaFreeHost");
    SYM(Malloc, "cudaMalloc");
    SYM(Free, "cudaFree");
    SYM(Memcpy, "cudaMemcpy");
    SYM(MemcpyAsync, "cudaMemcpyAsync");
    SYM(StreamCreateWithFlags, "cudaStreamCreateWithFlags");
    SYM(StreamSynchronize, "cudaStreamSynchronize");
    SYM(StreamDestroy, "cudaStreamDestroy");
    SYM(EventCreateWithFlags, "cudaEventCreateWithFlags");
    SYM(EventRecord, "cudaEventRecord");
    SYM(EventSynchronize, "cudaEventSynchronize");
    SYM(EventDestroy, "cudaEventDestroy");
    SYM(StreamWaitEvent, "cudaStreamWaitEvent");
    SYM(MemsetAsync, "cudaMemsetAsync");
    SYM(GetErrorString, "cudaGetErrorString");
#undef SYM
    cuda = api;
    Dl_info info;
    const char *where = dladdr(*(void **)&api.GetDeviceCount, &info) && info.dli_fname ? info.dli_fname : name;
    strncpy(cuda_path, where, sizeof cuda_path - 1);
    __atomic_store_n(&cuda_handle, h, __ATOMIC_RELEASE); /* last: publishes cuda and cuda_path */
out:
    pthread_mutex_unlock(&cuda_lock);
    return rc;
}

const char *sx_cuda_library(void) { return cuda_loaded() ? cuda_path : NULL; }

int sx_cuda_device_count(int *count) {
    if (!count) return SX_EINVAL;
    *count = 0;
    if (!cuda_loaded()) return SX_ENOLIB;
    int rc = cuda_status(cuda.GetDeviceCount(count));
    if (rc != SX_OK) *count = 0;
    else if (*count == 0) { cuda_last = CUDA_ERR_NO_DEVICE; rc = SX_ENODEV; }
    return rc;
}

int sx_cuda_malloc(int device, size_t len, void **out) {
    if (!out || !cuda_loaded()) return out ? SX_ENOLIB : SX_EINVAL;
    *out = NULL;
    int rc = cuda_status(cuda.SetDevice(device));
    if (rc == SX_OK) rc = cuda_status(cuda.Malloc(out, len ? len : 1));
    return rc;
}

int sx_cuda_free(int device, void *p) {
    if (!cuda_loaded()) return SX_ENOLIB;
    int rc = cuda_status(cuda.SetDevice(device));
    if (rc == SX_OK && p) rc = cuda_status(cuda.Free(p));
    return rc;
}

int sx_cuda_memcpy(int device, void *dst, const void *src, size_t len, int kind) {
    if (!cuda_loaded()) return SX_ENOLIB;
    if (kind != SX_COPY_H2D && kind != SX_COPY_D2H && kind != SX_COPY_D2D) return SX_EINVAL;
    int rc = cuda_status(cuda.SetDevice(device));
    int k = kind == SX_COPY_H2D ? MEMCPY_H2D : kind == SX_COPY_D2H ? MEMCPY_D2H : MEMCPY_D2D;
    if (rc == SX_OK && len) rc = cuda_status(cuda.Memcpy(dst, src, len, k));
    return rc;
}

/* ---- the copier ---------------------------------------------------------- */

#define MAX_INFLIGHT 8
#define CPU_PIECE ((size_t)256 << 10) /* CRC then copy in L2-sized pieces */
#define CPU_MAX_THREADS 64

struct sx_copier {
    int device;     /* -1: host only */
    int nthreads;   /* host copies */
    size_t piece;   /* bytes per D2H piece (one event each) */
    cuda_stream stream;
    cuda_event events[MAX_INFLIGHT];
    int nevents;
    cuda_event producer; /* recorded on a producer's stream; the copier's stream waits for it */
    /* The handle's reference plus one per staging buffer not yet freed (atomic). sx_copier_free needs
     * `device`, and a garbage collector runs finalizers in any order (CPython's cycle collector, as at
     * interpreter exit, often destroys the copier before its buffers): the struct lives until the last. */
    int refs;
};

static void copier_unref(sx_copier *c) {
    if (__atomic_sub_fetch(&c->refs, 1, __ATOMIC_ACQ_REL) == 0) free(c);
}

int sx_copier_create(int device, size_t piece_bytes, int nthreads, sx_copier **out) {
    if (!out || device < -1) return SX_EINVAL;
    *out = NULL;
    sx_copier *c = calloc(1, sizeof *c);
    if (!c) return SX_ENOMEM;
    c->device = device;
    c->refs = 1;
    c->nthreads = nthreads > 0 ? nthreads : (int)split_online_cpus();
    if (c->nthreads > CPU_MAX_THREADS) c->nthreads = CPU_MAX_THREADS;
    c->piece = piece_bytes ? piece_bytes : ((size_t)8 << 20);
    if (device >= 0) {
        int count = 0;
        int rc = sx_cuda_device_count(&count);
        if (rc == SX_OK && device >= count) { rc = SX_ENODEV; }
        if (rc == SX_OK) rc = cuda_status(cuda.SetDevice(device));
        if (rc == SX_OK) rc = cuda_status(cuda.StreamCreateWithFlags(&c->stream, STREAM_NON_BLOCKING));
        for (int i = 0; rc == SX_OK && i < MAX_INFLIGHT; i++) {
            rc = cuda_status(cuda.EventCreateWithFlags(&c->events[i], EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING));
            if (rc == SX_OK) c->nevents++;
        }
        if (rc == SX_OK) rc = cuda_status(cuda.EventCreateWithFlags(&c->producer, EVENT_DISABLE_TIMING));
        if (rc != SX_OK) { sx_copier_destroy(c); return rc; }
    }
    *out = c;
    return SX_OK;
}

void sx_copier_destroy(sx_copier *c) {
    if (!c) return;
    if (c->device >= 0 && cuda_loaded()) {
        cuda.SetDevice(c->device);
        if (c->stream) cuda.StreamSynchronize(c->stream);
        for (int i = 0; i < c->nevents; i++) cuda.EventDestroy(c->events[i]);
        if (c->producer) cuda.EventDestroy(c->producer);
        if (c->stream) cuda.StreamDestroy(c->stream);
        c->stream = NULL, c->nevents = 0, c->producer = NULL;
    }
    copier_unref(c); /* freed now, or by the free of its last buffer */
}

int sx_copier_device(const sx_copier *c) { return c ? c->device : -1; }

int sx_copier_alloc(sx_copier *c, size_t len, void **out) {
    if (!c || !out || !len) return SX_EINVAL;
    *out = NULL;
    int rc;
    if (c->device >= 0) {
        /* pinned, so D2H runs at full link speed and asynchronously; pin once and reuse */
        rc = cuda_status(cuda.SetDevice(c->device));
        if (rc == SX_OK) rc = cuda_status(cuda.HostAlloc(out, len, HOST_ALLOC_PORTABLE));
    } else {
        rc = posix_memalign(out, 4096, len) ? SX_ENOMEM : SX_OK;
    }
    if (rc != SX_OK) { *out = NULL; return rc; }
    __atomic_add_fetch(&c->refs, 1, __ATOMIC_RELAXED); /* the buffer keeps the copier */
    return SX_OK;
}

void sx_copier_free(sx_copier *c, void *p) {
    if (!c || !p) return;
    if (c->device >= 0) cuda.FreeHost(p);
    else free(p);
    copier_unref(c);
}

/* -- host to host: plain threads, each hashing its slice as it copies -- */

struct host_job {
    unsigned char *dst;
    const unsigned char *src;
    size_t len;
    int want_crc;
    uint32_t crc;
};

static void host_copy_slice(struct host_job *j) {
    uint32_t crc = 0;
    for (size_t off = 0; off < j->len; off += CPU_PIECE) {
        size_t n = j->len - off < CPU_PIECE ? j->len - off : CPU_PIECE;
        /* CRC first brings the piece into cache; the copy then reads it from there */
        if (j->want_crc) crc = sx_crc32c(crc, j->src + off, n);
        memcpy(j->dst + off, j->src + off, n);
    }
    j->crc = crc;
}

static void *host_copy_main(void *arg) {
    host_copy_slice(arg);
    return NULL;
}

static int copy_host(sx_copier *c, void *dst, const void *src, size_t len, uint32_t *crc) {
    int n = (int)split_count(len, (size_t)c->nthreads, CPU_MAX_THREADS);
    struct host_job jobs[CPU_MAX_THREADS];
    pthread_t threads[CPU_MAX_THREADS];
    int started[CPU_MAX_THREADS] = {0};
    for (int i = 0; i < n; i++) {
        struct split_slice s = split_slice(len, (size_t)n, (size_t)i);
        jobs[i].dst = (unsigned char *)dst + s.off;
        jobs[i].src = (const unsigned char *)src + s.off;
        jobs[i].len = s.len;
        jobs[i].want_crc = crc != NULL;
    }
    /* slice 0 runs on the calling thread; a failed thread start runs its slice here too */
    for (int i = 1; i < n; i++) started[i] = pthread_create(&threads[i], NULL, host_copy_main, &jobs[i]) == 0;
    host_copy_slice(&jobs[0]);
    for (int i = 1; i < n; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        else host_copy_slice(&jobs[i]);
    }
    if (crc) {
        uint32_t total = *crc;
        for (int i = 0; i < n; i++) total = sx_crc32c_combine(total, jobs[i].crc, jobs[i].len);
        *crc = total;
    }
    return SX_OK;
}

/* -- device to host: pieces on the copier's stream, one event each; each piece
 * is hashed as soon as its event fires while the next pieces are in flight -- */

static int copy_d2h(sx_copier *c, void *dst, const void *src, size_t len, uint32_t *crc) {
    int rc = cuda_status(cuda.SetDevice(c->device));
    if (rc != SX_OK) return rc;
    size_t npieces = (len + c->piece - 1) / c->piece;
    unsigned char *d = dst;
    const unsigned char *s = src;
    if (!crc) { /* the bare loop: every piece queued, one synchronization */
        for (size_t i = 0; rc == SX_OK && i < npieces; i++) {
            size_t off = i * c->piece, n = len - off < c->piece ? len - off : c->piece;
            rc = cuda_status(cuda.MemcpyAsync(d + off, s + off, n, MEMCPY_D2H, c->stream));
        }
        int sync = cuda_status(cuda.StreamSynchronize(c->stream));
        return rc != SX_OK ? rc : sync;
    }
    uint32_t total = *crc;
    size_t issued = 0, landed = 0;
    while (rc == SX_OK && landed < npieces) {
        while (rc == SX_OK && issued < npieces && issued - landed < (size_t)c->nevents) {
            size_t off = issued * c->piece, n = len - off < c->piece ? len - off : c->piece;
            rc = cuda_status(cuda.MemcpyAsync(d + off, s + off, n, MEMCPY_D2H, c->stream));
            if (rc == SX_OK) rc = cuda_status(cuda.EventRecord(c->events[issued % (size_t)c->nevents], c->stream));
            if (rc == SX_OK) issued++;
        }
        if (rc != SX_OK) break;
        rc = cuda_status(cuda.EventSynchronize(c->events[landed % (size_t)c->nevents]));
        if (rc != SX_OK) break;
        size_t off = landed * c->piece, n = len - off < c->piece ? len - off : c->piece;
        total = sx_crc32c_combine(total, sx_crc32c(0, d + off, n), n);
        landed++;
    }
    if (rc != SX_OK) {
        /* never return while DMA may still write into the caller's buffer */
        cuda.StreamSynchronize(c->stream);
        return rc;
    }
    *crc = total;
    return SX_OK;
}

struct equal_job {
    const void *const *a, *const *b;
    const uint64_t *lens;
    uint8_t *equal;
    size_t from, to; /* the pairs of one thread */
};

static void *equal_run(void *arg) {
    struct equal_job *j = arg;
    for (size_t i = j->from; i < j->to; i++) j->equal[i] = j->lens[i] == 0 || memcmp(j->a[i], j->b[i], j->lens[i]) == 0;
    return NULL;
}

int sx_equal_ranges(size_t n, const void *const *a, const void *const *b, const uint64_t *lens, uint8_t *equal,
                    int nthreads) {
    if (n && (!a || !b || !lens || !equal)) return SX_EINVAL;
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (lens[i] && (!a[i] || !b[i])) return SX_EINVAL;
        total += lens[i];
    }
    size_t threads = split_count(total, nthreads > 0 ? (size_t)nthreads : split_online_cpus(), 16);
    if (threads > n) threads = n ? n : 1;
    struct equal_job jobs[16];
    pthread_t ids[16];
    int started[16] = {0};
    for (size_t t = 0; t < threads; t++) jobs[t] = (struct equal_job){a, b, lens, equal, n * t / threads, n * (t + 1) / threads};
    /* job 0 runs here; a failed thread start runs its job here too */
    for (size_t t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, equal_run, &jobs[t]) == 0;
    equal_run(&jobs[0]);
    for (size_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else equal_run(&jobs[t]);
    }
    return SX_OK;
}

int sx_copier_copy(sx_copier *c, void *dst, const void *src, size_t len, int kind, uint32_t *crc) {
    if (!c || (len && (!dst || !src))) return SX_EINVAL;
    if (len == 0) return SX_OK;
    if (kind == SX_COPY_H2H) return copy_host(c, dst, src, len, crc);
    if (kind == SX_COPY_D2H) return c->device < 0 ? SX_ENODEV : copy_d2h(c, dst, src, len, crc);
    return SX_EINVAL;
}

/* -- ordering after the producer: a tensor handed over with __cuda_array_interface__ may still be being
 * written by work queued on the producer's stream; the copier's own stream is non-blocking, so nothing
 * orders it after that work unless it waits for an event recorded there. -- */

int sx_copier_wait_stream(sx_copier *c, uintptr_t stream) {
    if (!c || c->device < 0 || stream == 0) return SX_EINVAL;
    int rc = cuda_status(cuda.SetDevice(c->device));
    if (rc == SX_OK) rc = cuda_status(cuda.EventRecord(c->producer, (cuda_stream)stream));
    if (rc == SX_OK) rc = cuda_status(cuda.StreamWaitEvent(c->stream, c->producer, 0));
    return rc;
}

int sx_cuda_stream_create(int device, uintptr_t *out) {
    if (!out) return SX_EINVAL;
    *out = 0;
    if (!cuda_loaded()) return SX_ENOLIB;
    cuda_stream s = NULL;
    int rc = cuda_status(cuda.SetDevice(device));
    if (rc == SX_OK) rc = cuda_status(cuda.StreamCreateWithFlags(&s, STREAM_NON_BLOCKING));
    if (rc == SX_OK) *out = (uintptr_t)s;
    return rc;
}

int sx_cuda_stream_destroy(int device, uintptr_t stream) {
    if (!cuda_loaded()) return SX_ENOLIB;
    int rc = cuda_status(cuda.SetDevice(device));
    if (rc == SX_OK && stream > 2) rc = cuda_status(cuda.StreamDestroy((cuda_stream)stream));
    return rc;
}

int sx_cuda_memset_async(int device, void *dst, int value, size_t len, uintptr_t stream) {
    if (!cuda_loaded()) return SX_ENOLIB;
    int rc = cuda_status(cuda.SetDevice(device));
    if (rc == SX_OK && len) rc = cuda_status(cuda.MemsetAsync(dst, value, len, (cuda_stream)stream));
    return rc;
}
