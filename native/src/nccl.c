/* nccl.c - NCCL collectives that fail instead of hanging: dlopen'ed library, non-blocking communicators,
 * and a watchdog that aborts.
 *
 * Why: a rank that dies mid-collective leaves its peers spinning in NCCL kernels; torchrun's survivors
 * then wait out a 30-minute timeout (pytorch#111646). NCCL's answer is a non-blocking communicator
 * (ncclConfig_t.blocking = 0) polled with ncclCommGetAsyncError and ended with ncclCommAbort, which
 * stops the kernels and frees the communicator; ncclCommDestroy would wait on the hung kernels forever.
 * Here a watchdog thread per communicator does that polling: on an asynchronous error (a peer lost), a
 * passed deadline or an abort request it calls ncclCommAbort, and the caller, which waits on its CUDA
 * stream while watching the watchdog's verdict, returns a status instead of hanging.
 *
 * Nothing NVIDIA is needed to build this: libnccl.so.2 comes from the nvidia-nccl-cu12 wheel at run
 * time (the Python side picks the path), the CUDA runtime from copy.c's loader. ncclConfig_t changes
 * layout between releases, so only its leading fields (unchanged since 2.17) are passed, with `size`
 * saying so and `version` the loaded library's: NCCL copies `size` bytes and keeps its defaults for
 * the rest.
 */
#define _GNU_SOURCE
#include "sneppx.h"

#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nccl_result;
typedef void *nccl_comm;
typedef void *cuda_stream;
typedef struct { unsigned char internal[SX_NCCL_UNIQUE_ID_BYTES]; } nccl_unique_id;

enum { NCCL_SUCCESS = 0, NCCL_IN_PROGRESS = 7 };
enum { NCCL_UINT8 = 1, NCCL_INT32 = 2, NCCL_INT64 = 4, NCCL_FLOAT32 = 7, NCCL_FLOAT64 = 8 };
enum { NCCL_SUM = 0, NCCL_MAX = 2, NCCL_MIN = 3 };
enum { CUDA_SUCCESS = 0, CUDA_NOT_READY = 600, STREAM_NON_BLOCKING = 1 };
#define NCCL_CONFIG_MAGIC 0xcafebeefu
#define NCCL_CONFIG_UNDEF_INT (-2147483647 - 1)
#define NCCL_MIN_VERSION 21403 /* ncclCommInitRankConfig with blocking = 0 */
#define WATCHDOG_PERIOD_NS 1000000L

/* The leading fields of ncclConfig_t (nccl.h), the same from 2.17 on; 2.14-2.16 read only the first four. */
struct nccl_config {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
    int cga_cluster_size;
    int min_ctas;
    int max_ctas;
    const char *net_name;
};

struct nccl_api {
    nccl_result (*GetVersion)(int *);
    nccl_result (*GetUniqueId)(nccl_unique_id *);
    nccl_result (*CommInitRankConfig)(nccl_comm *, int, nccl_unique_id, int, struct nccl_config *);
    nccl_result (*CommGetAsyncError)(nccl_comm, nccl_result *);
    nccl_result (*CommAbort)(nccl_comm);
    nccl_result (*CommFinalize)(nccl_comm);
    nccl_result (*CommDestroy)(nccl_comm);
    nccl_result (*AllReduce)(const void *, void *, size_t, int, int, nccl_comm, cuda_stream);
    nccl_result (*Broadcast)(const void *, void *, size_t, int, int, nccl_comm, cuda_stream);
    nccl_result (*ReduceScatter)(const void *, void *, size_t, int, int, nccl_comm, cuda_stream);
    nccl_result (*AllGather)(const void *, void *, size_t, int, nccl_comm, cuda_stream);
    const char *(*GetErrorString)(nccl_result);
};

struct cuda_streams {
    int (*SetDevice)(int);
    int (*StreamCreateWithFlags)(cuda_stream *, unsigned);
    int (*StreamQuery)(cuda_stream);
    int (*StreamDestroy)(cuda_stream);
};

/* Published like copy.c's CUDA table: filled under the lock, then the handle stored with release. */
static pthread_mutex_t nccl_lock = PTHREAD_MUTEX_INITIALIZER;
static struct nccl_api nccl;
static struct cuda_streams cudas;
static int nccl_version_code;
static char nccl_path[4096];
static void *nccl_handle;
static void *streams_handle;
static __thread int nccl_last;

static int nccl_loaded(void) { return __atomic_load_n(&nccl_handle, __ATOMIC_ACQUIRE) != NULL; }

int sx_nccl_last_error(void) { return nccl_last; }

const char *sx_nccl_error_string(int result) {
    return nccl_loaded() ? nccl.GetErrorString(result) : "NCCL not loaded";
}

static int nccl_status(nccl_result r) {
    if (r == NCCL_SUCCESS) return SX_OK;
    nccl_last = r;
    return SX_ENCCL;
}

int sx_nccl_load(const char *path) {
    pthread_mutex_lock(&nccl_lock);
    int rc = SX_OK;
    if (nccl_handle) goto out;
    const char *name = path && *path ? path : "libnccl.so.2";
    void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!h) { rc = SX_ENOLIB; goto out; }
    struct nccl_api api;
#define SYM(field, sym)                                           \
    do {                                                          \
        *(void **)&api.field = dlsym(h, sym);                     \
        if (!api.field) { dlclose(h); rc = SX_ENOLIB; goto out; } \
    } while (0)
    SYM(GetVersion, "ncclGetVersion");
    SYM(GetUniqueId, "ncclGetUniqueId");
    SYM(CommInitRankConfig, "ncclCommInitRankConfig");
    SYM(CommGetAsyncError, "ncclCommGetAsyncError");
    SYM(CommAbort, "ncclCommAbort");
    SYM(CommFinalize, "ncclCommFinalize");
    SYM(CommDestroy, "ncclCommDestroy");
    SYM(AllReduce, "ncclAllReduce");
    SYM(Broadcast, "ncclBroadcast");
    SYM(ReduceScatter, "ncclReduceScatter");
    SYM(AllGather, "ncclAllGather");
    SYM(GetErrorString, "ncclGetErrorString");
#undef SYM
    int version = 0;
    if (api.GetVersion(&version) != NCCL_SUCCESS || version < NCCL_MIN_VERSION) {
        dlclose(h);
        rc = SX_ENOLIB;
        goto out;
    }
    nccl = api;
    nccl_version_code = version;
    Dl_info info;
    const char *where = dladdr(*(void **)&api.GetVersion, &info) && info.dli_fname ? info.dli_fname : name;
    strncpy(nccl_path, where, sizeof nccl_path - 1);
    __atomic_store_n(&nccl_handle, h, __ATOMIC_RELEASE);
out:
    pthread_mutex_unlock(&nccl_lock);
    return rc;
}

const char *sx_nccl_library(void) { return nccl_loaded() ? nccl_path : NULL; }

int sx_nccl_version(int *version) {
    if (!version) return SX_EINVAL;
    if (!nccl_loaded()) return SX_ENOLIB;
    *version = nccl_version_code;
    return SX_OK;
}

int sx_nccl_unique_id(unsigned char *id) {
    if (!id) return SX_EINVAL;
    if (!nccl_loaded()) return SX_ENOLIB;
    nccl_unique_id uid;
    int rc = nccl_status(nccl.GetUniqueId(&uid));
    if (rc == SX_OK) memcpy(id, uid.internal, sizeof uid.internal);
    return rc;
}

/* The stream calls, from the libcudart copy.c loaded (the same handle, not a second copy). */
static int load_streams(void) {
    pthread_mutex_lock(&nccl_lock);
    int rc = SX_OK;
    if (streams_handle) goto out;
    const char *cudart = sx_cuda_library();
    void *h = cudart ? dlopen(cudart, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD) : NULL;
    if (!h) { rc = SX_ENOLIB; goto out; }
    struct cuda_streams api;
#define SYM(field, sym)                                           \
    do {                                                          \
        *(void **)&api.field = dlsym(h, sym);                     \
        if (!api.field) { dlclose(h); rc = SX_ENOLIB; goto out; } \
    } while (0)
    SYM(SetDevice, "cudaSetDevice");
    SYM(StreamCreateWithFlags, "cudaStreamCreateWithFlags");
    SYM(StreamQuery, "cudaStreamQuery");
    SYM(StreamDestroy, "cudaStreamDestroy");
#undef SYM
    cudas = api;
    __atomic_store_n(&streams_handle, h, __ATOMIC_RELEASE);
out:
    pthread_mutex_unlock(&nccl_lock);
    return rc;
}

/* ---- a communicator and its watchdog -------------------------------------------------------------- */

struct sx_nccl {
    nccl_comm comm; /* NULL once aborted: nothing may touch it after ncclCommAbort */
    cuda_stream stream;
    int device, rank, world;
    pthread_t watchdog;
    int watchdog_running;
    pthread_mutex_t lock; /* every NCCL call on comm, and all fields below */
    pthread_cond_t wake;
    int busy;          /* a call is in flight until `deadline` */
    double deadline;
    int abort_requested;
    int stop;
    int failure;       /* why the communicator was aborted: SX_ETIMEDOUT, SX_ENCCL or SX_EABORTED */
    int async_error;   /* the ncclResult_t behind an SX_ENCCL failure */
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Under n->lock. */
static void abort_locked(sx_nccl *n, int why) {
    if (!n->comm) return;
    n->failure = why;
    nccl.CommAbort(n->comm);
    n->comm = NULL;
}

static void *watchdog_main(void *arg) {
    sx_nccl *n = arg;
    pthread_mutex_lock(&n->lock);
    while (!n->stop) {
        if (n->comm) {
            nccl_result state = NCCL_SUCCESS;
            nccl.CommGetAsyncError(n->comm, &state);
            if (n->abort_requested) abort_locked(n, SX_EABORTED);
            else if (state != NCCL_SUCCESS && state != NCCL_IN_PROGRESS) {
                n->async_error = state;
                abort_locked(n, SX_ENCCL);
            } else if (n->busy && now_s() > n->deadline) abort_locked(n, SX_ETIMEDOUT);
        }
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += WATCHDOG_PERIOD_NS;
        if (until.tv_nsec >= 1000000000L) { until.tv_sec++; until.tv_nsec -= 1000000000L; }
        pthread_cond_timedwait(&n->wake, &n->lock, &until);
    }
    pthread_mutex_unlock(&n->lock);
    return NULL;
}

/* Under n->lock: the status of a communicator the watchdog aborted, for the caller to return. */
static int failure_locked(sx_nccl *n) {
    if (n->failure == SX_ENCCL) nccl_last = n->async_error;
    return n->failure ? n->failure : SX_EABORTED;
}

/* Waits, without the lock, until NCCL has taken the call (async state no longer in progress) and then the
 * stream has drained it; the watchdog aborts on error, deadline or request, which ends the wait. */
static int wait_done(sx_nccl *n, int on_stream) {
    struct timespec pause = {0, 20000};
    int enqueued = 0;
    for (;;) {
        pthread_mutex_lock(&n->lock);
        if (!n->comm) {
            int rc = failure_locked(n);
            n->busy = 0;
            pthread_mutex_unlock(&n->lock);
            return rc;
        }
        if (!enqueued) {
            nccl_result state = NCCL_SUCCESS;
            nccl.CommGetAsyncError(n->comm, &state);
            if (state == NCCL_SUCCESS) enqueued = 1;
            else if (state != NCCL_IN_PROGRESS) {
                n->async_error = state;
                abort_locked(n, SX_ENCCL);
                pthread_mutex_unlock(&n->lock);
                continue;
            }
        }
        if (enqueued && !on_stream) { n->busy = 0; pthread_mutex_unlock(&n->lock); return SX_OK; }
        pthread_mutex_unlock(&n->lock);
        if (enqueued) {
            int q = cudas.StreamQuery(n->stream);
            if (q == CUDA_SUCCESS) {
                pthread_mutex_lock(&n->lock);
                n->busy = 0;
                pthread_mutex_unlock(&n->lock);
                return SX_OK;
            }
            if (q != CUDA_NOT_READY) {
                pthread_mutex_lock(&n->lock);
                abort_locked(n, SX_ECUDA);
                pthread_mutex_unlock(&n->lock);
                continue;
            }
        }
        nanosleep(&pause, NULL);
    }
}

int sx_nccl_create(const unsigned char *id, int rank, int world_size, int device, double timeout_s, sx_nccl **out) {
    if (!id || !out || world_size < 1 || rank < 0 || rank >= world_size || device < 0 || !(timeout_s > 0) ||
        isinf(timeout_s))
        return SX_EINVAL;
    *out = NULL;
    if (!nccl_loaded()) return SX_ENOLIB;
    int rc = load_streams();
    if (rc != SX_OK) return rc;
    if (cudas.SetDevice(device) != CUDA_SUCCESS) return SX_ENODEV;
    sx_nccl *n = calloc(1, sizeof *n);
    if (!n) return SX_ENOMEM;
    n->device = device;
    n->rank = rank;
    n->world = world_size;
    pthread_mutex_init(&n->lock, NULL);
    pthread_cond_init(&n->wake, NULL);
    if (cudas.StreamCreateWithFlags(&n->stream, STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
        sx_nccl_destroy(n);
        return SX_ECUDA;
    }
    struct nccl_config config = {
        .size = sizeof config, .magic = NCCL_CONFIG_MAGIC, .version = (unsigned)nccl_version_code,
        .blocking = 0, .cga_cluster_size = NCCL_CONFIG_UNDEF_INT, .min_ctas = NCCL_CONFIG_UNDEF_INT,
        .max_ctas = NCCL_CONFIG_UNDEF_INT, .net_name = NULL,
    };
    nccl_unique_id uid;
    memcpy(uid.internal, id, sizeof uid.internal);
    nccl_result r = nccl.CommInitRankConfig(&n->comm, world_size, uid, rank, &config);
    if (r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS) {
        if (n->comm) nccl.CommAbort(n->comm);
        n->comm = NULL;
        n->failure = nccl_status(r);
        sx_nccl_destroy(n);
        return SX_ENCCL;
    }
    n->busy = 1;
    n->deadline = now_s() + timeout_s;
    if (pthread_create(&n->watchdog, NULL, watchdog_main, n) != 0) {
        pthread_mutex_lock(&n->lock);
        abort_locked(n, SX_ENOMEM);
        pthread_mutex_unlock(&n->lock);
        sx_nccl_destroy(n);
        return SX_ENOMEM;
    }
    n->watchdog_running = 1;
    rc = wait_done(n, 0); /* joined when the async state leaves "in progress" */
    if (rc != SX_OK) {
        sx_nccl_destroy(n);
        return rc;
    }
    *out = n;
    return SX_OK;
}

void sx_nccl_abort(sx_nccl *n) {
    if (!n) return;
    pthread_mutex_lock(&n->lock);
    n->abort_requested = 1;
    if (!n->watchdog_running) abort_locked(n, SX_EABORTED);
    pthread_cond_signal(&n->wake);
    pthread_mutex_unlock(&n->lock);
}

/* ncclCommFinalize flushes outstanding work; non-blocking, so it is polled, for 30 s at most. */
static int finalize(sx_nccl *n) {
    nccl_result state = nccl.CommFinalize(n->comm);
    double deadline = now_s() + 30.0;
    struct timespec pause = {0, 100000};
    while (state == NCCL_IN_PROGRESS && now_s() < deadline) {
        nanosleep(&pause, NULL);
        nccl.CommGetAsyncError(n->comm, &state);
    }
    return state == NCCL_SUCCESS;
}

void sx_nccl_destroy(sx_nccl *n) {
    if (!n) return;
    if (n->watchdog_running) {
        pthread_mutex_lock(&n->lock);
        n->stop = 1;
        pthread_cond_signal(&n->wake);
        pthread_mutex_unlock(&n->lock);
        pthread_join(n->watchdog, NULL);
    }
    if (n->comm) {
        /* A healthy, idle communicator is finalized and destroyed; anything else is aborted (a destroy
         * would wait on kernels that may never finish). */
        nccl_result state = NCCL_IN_PROGRESS;
        if (!n->busy) nccl.CommGetAsyncError(n->comm, &state);
        if (state == NCCL_SUCCESS && finalize(n)) nccl.CommDestroy(n->comm);
        else nccl.CommAbort(n->comm);
        n->comm = NULL;
    }
    if (n->stream) cudas.StreamDestroy(n->stream);
    pthread_cond_destroy(&n->wake);
    pthread_mutex_destroy(&n->lock);
    free(n);
}

/* ---- the collectives -------------------------------------------------------------------------------- */

static int nccl_dtype(int dtype, size_t *elsize) {
    switch (dtype) {
    case SX_DTYPE_F32: *elsize = 4; return NCCL_FLOAT32;
    case SX_DTYPE_F64: *elsize = 8; return NCCL_FLOAT64;
    case SX_DTYPE_I32: *elsize = 4; return NCCL_INT32;
    case SX_DTYPE_I64: *elsize = 8; return NCCL_INT64;
    case SX_DTYPE_U8: *elsize = 1; return NCCL_UINT8;
    default: return -1;
    }
}

static int nccl_op(int op) {
    switch (op) {
    case SX_OP_SUM: return NCCL_SUM;
    case SX_OP_MAX: return NCCL_MAX;
    case SX_OP_MIN: return NCCL_MIN;
    default: return -1;
    }
}

enum { CALL_ALLREDUCE, CALL_BROADCAST, CALL_REDUCE_SCATTER, CALL_ALLGATHER };

static int call(sx_nccl *n, int kind, void *buf, size_t count, int dtype, int op, int root, double timeout_s) {
    size_t elsize = 0;
    int t = nccl_dtype(dtype, &elsize), o = nccl_op(op);
    if (!n || t < 0 || o < 0 || (count && !buf) || !(timeout_s > 0) || isinf(timeout_s)) return SX_EINVAL;
    if ((kind == CALL_REDUCE_SCATTER || kind == CALL_ALLGATHER) && count % (size_t)n->world) return SX_EINVAL;
    if (kind == CALL_BROADCAST && (root < 0 || root >= n->world)) return SX_EINVAL;
    if (cudas.SetDevice(n->device) != CUDA_SUCCESS) return SX_ENODEV;
    pthread_mutex_lock(&n->lock);
    if (!n->comm || n->abort_requested) {
        int rc = n->comm ? SX_EABORTED : failure_locked(n);
        pthread_mutex_unlock(&n->lock);
        return rc;
    }
    size_t shard = count / (size_t)n->world;
    char *mine = (char *)buf + (size_t)n->rank * shard * elsize;
    nccl_result r;
    switch (kind) {
    case CALL_ALLREDUCE: r = nccl.AllReduce(buf, buf, count, t, o, n->comm, n->stream); break;
    case CALL_BROADCAST: r = nccl.Broadcast(buf, buf, count, t, root, n->comm, n->stream); break;
    case CALL_REDUCE_SCATTER: r = nccl.ReduceScatter(buf, mine, shard, t, o, n->comm, n->stream); break;
    default: r = nccl.AllGather(mine, buf, shard, t, n->comm, n->stream); break;
    }
    if (r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS) {
        n->async_error = r;
        abort_locked(n, SX_ENCCL);
        int rc = failure_locked(n);
        pthread_mutex_unlock(&n->lock);
        return rc;
    }
    n->busy = 1;
    n->deadline = now_s() + timeout_s;
    pthread_mutex_unlock(&n->lock);
    return wait_done(n, 1);
}

int sx_nccl_allreduce(sx_nccl *n, void *buf, size_t count, int dtype, int op, double timeout_s) {
    return call(n, CALL_ALLREDUCE, buf, count, dtype, op, 0, timeout_s);
}

int sx_nccl_broadcast(sx_nccl *n, void *buf, size_t nbytes, int root, double timeout_s) {
    return call(n, CALL_BROADCAST, buf, nbytes, SX_DTYPE_U8, SX_OP_SUM, root, timeout_s);
}

int sx_nccl_reduce_scatter(sx_nccl *n, void *buf, size_t count, int dtype, int op, double timeout_s) {
    return call(n, CALL_REDUCE_SCATTER, buf, count, dtype, op, 0, timeout_s);
}

int sx_nccl_allgather(sx_nccl *n, void *buf, size_t count, int dtype, double timeout_s) {
    return call(n, CALL_ALLGATHER, buf, count, dtype, SX_OP_SUM, 0, timeout_s);
}
