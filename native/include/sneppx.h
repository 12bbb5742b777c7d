/* sneppx.h - the one public header of SneppX's native core.
 *
 * Conventions: every function that can fail returns an int status, SX_OK (0)
 * or a negative SX_E* code; sx_strerror() names it. Nothing here prints,
 * aborts or touches Python; the cffi wrapper (runtime/SneppX_ALG/_native.py)
 * turns codes into typed exceptions and releases the GIL around every call.
 * Symbols start with sx_. C99 plus GCC target attributes for the SIMD kernels.
 */
#ifndef SNEPPX_H
#define SNEPPX_H

#include <stddef.h>
#include <stdint.h>

/* ---- status codes ------------------------------------------------------ */
#define SX_OK 0
#define SX_EINVAL -1      /* bad argument */
#define SX_EIO -2         /* read/write/fsync failed (see sx_last_errno) */
#define SX_ENOSPC -3      /* the device is full */
#define SX_ENOMEM -4      /* allocation failed */
#define SX_ENOENT -5      /* no such file or directory */
#define SX_EEXIST -6      /* target exists */
#define SX_EFSYNC -7        /* fsync failed: the data may not be durable (never retried) */
#define SX_ENODEV -8      /* no device (e.g. CUDA present but no GPU) */
#define SX_ENOLIB -9      /* a dlopen'ed library is missing */
#define SX_ECUDA -10      /* a CUDA call failed */
#define SX_EPERM -11      /* permission denied */

const char *sx_strerror(int code);
/* errno of the last failed system call in this thread (0 if none). */
int sx_last_errno(void);

/* ---- CRC32C (Castagnoli, reflected, init/xorout 0xFFFFFFFF) ------------ */
/* Kernels, in order of preference; sx_crc32c() uses the best one this CPU has. */
#define SX_CRC_PORTABLE 0    /* slicing-by-8 table, any CPU */
#define SX_CRC_SSE42 1       /* crc32q, three long contiguous streams */
#define SX_CRC_VPCLMUL256 2  /* AVX2 + VPCLMULQDQ folding, 256-bit lanes */
#define SX_CRC_VPCLMUL512 3  /* AVX-512 + VPCLMULQDQ folding, 512-bit lanes */
#define SX_CRC_NKERNELS 4

/* crc is the running value: start with 0, feed the result back to continue. */
uint32_t sx_crc32c(uint32_t crc, const void *buf, size_t len);
/* Bit k set when kernel k runs on this CPU. */
unsigned sx_crc32c_kernels(void);
const char *sx_crc32c_kernel_name(int kernel);
/* One named kernel; SX_EINVAL if this CPU can't run it. */
int sx_crc32c_with(int kernel, uint32_t crc, const void *buf, size_t len, uint32_t *out);
/* crc(A || B) from crc(A), crc(B) and len(B); O(log len) */
uint32_t sx_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
/* Splits large buffers over up to nthreads threads (0 = online CPUs). */
uint32_t sx_crc32c_parallel(uint32_t crc, const void *buf, size_t len, int nthreads);

/* ---- durable file writing ---------------------------------------------- */
/* A file written in one streaming pass: appends go through aligned staging
 * buffers, handed to a background I/O thread (O_DIRECT where the filesystem
 * allows it, buffered with write-behind otherwise), while the caller fills the
 * next buffer. CRC32C of each append is computed as it is copied in. A finished
 * writer's buffers are kept (two at most) for the next one, so periodic saves
 * don't page-fault fresh memory every time. */
typedef struct sx_file sx_file;

/* Creates path exclusively (O_EXCL). buffer_bytes: per staging buffer (two of
 * them), rounded up to the alignment; 0 = 8 MiB. direct: 1 try O_DIRECT and
 * fall back, 0 buffered. */
int sx_file_create(const char *path, size_t buffer_bytes, int direct, sx_file **out);
/* Appends len bytes; *crc is updated with them (pass NULL to skip). */
int sx_file_append(sx_file *f, const void *buf, size_t len, uint32_t *crc);
/* Appends zero bytes up to the next multiple of alignment. */
int sx_file_pad(sx_file *f, uint64_t alignment);
uint64_t sx_file_size(const sx_file *f);
/* Writes len bytes at an offset already passed (e.g. a header at 0). */
int sx_file_pwrite(sx_file *f, const void *buf, size_t len, uint64_t offset);
/* Flushes, trims the O_DIRECT tail padding, fdatasyncs and closes. A failed
 * fsync is reported, never retried. f is freed in every case. */
int sx_file_finish(sx_file *f);
/* Closes and unlinks a file that will not be committed; f is freed. */
void sx_file_abort(sx_file *f);
/* 1 if the file is using O_DIRECT. */
int sx_file_is_direct(const sx_file *f);

/* fsync of an existing file or directory by path. */
int sx_fsync_path(const char *path);
/* rename(from, to) then fsync of the directory of `to` (and of `from` if it differs). */
int sx_rename_durable(const char *from, const char *to);

/* ---- fault injection (tests only) -------------------------------------- */
/* Every I/O site (write, fsync, rename, dirsync) calls the hook first. When
 * armed with (site_mask, countdown, action), the countdown-th matching call
 * either kills the process with SIGKILL (action 0) or fails exactly as if the
 * system call had failed with errno = action (e.g. ENOSPC or EIO). Also armed from the environment:
 * SNEPPX_FAULT="<sites>:<countdown>:<kill|ENOSPC|EIO>", sites like "write,fsync". */
#define SX_SITE_WRITE 1u
#define SX_SITE_FSYNC 2u
#define SX_SITE_RENAME 4u
#define SX_SITE_DIRSYNC 8u
void sx_fault_arm(unsigned site_mask, long countdown, int action);
/* Number of I/O sites passed since the process started (to size a kill sweep). */
long sx_fault_sites_passed(void);

/* ---- copy engine: snapshot state into staging chunks (copy.c) ----------- */
/* CUDA is dlopen'ed, never linked. sx_cuda_load(path) loads libcudart from
 * path (NULL or "" = the soname libcudart.so.12); once loaded, later calls are
 * no-ops. SX_ENOLIB if it can't be loaded. A machine without a GPU loads it
 * fine and sx_cuda_device_count() returns SX_ENODEV (CUDA error 35 or 100,
 * see sx_cuda_last_error()). */
#define SX_COPY_H2H 0      /* host to host: plain threads */
#define SX_COPY_D2H 1      /* device to host: cudaMemcpyAsync on the copier's stream */
#define SX_COPY_H2D 2      /* sx_cuda_memcpy only (tests, benchmarks) */
#define SX_COPY_D2D 3      /* sx_cuda_memcpy only */

int sx_cuda_load(const char *path);
/* The file libcudart was loaded from, or NULL. */
const char *sx_cuda_library(void);
int sx_cuda_device_count(int *count);
/* The last cudaError_t seen by this thread, and its text. */
int sx_cuda_last_error(void);
const char *sx_cuda_error_string(int err);
/* Device memory and synchronous copies, for tests and benchmarks. */
int sx_cuda_malloc(int device, size_t len, void **out);
int sx_cuda_free(int device, void *p);
int sx_cuda_memcpy(int device, void *dst, const void *src, size_t len, int kind);

typedef struct sx_copier sx_copier;
/* device -1: host copies with up to nthreads threads (0 = online CPUs).
 * device >= 0: also D2H on its own non-blocking stream in pieces of
 * piece_bytes (0 = 8 MiB), one event per piece, at most 8 in flight. */
int sx_copier_create(int device, size_t piece_bytes, int nthreads, sx_copier **out);
void sx_copier_destroy(sx_copier *c);
int sx_copier_device(const sx_copier *c);
/* Staging memory: pinned (cudaHostAlloc) on a device copier, 4 KiB-aligned
 * malloc otherwise. Free with the copier that allocated it. */
int sx_copier_alloc(sx_copier *c, size_t len, void **out);
void sx_copier_free(sx_copier *c, void *p);
/* Copies len bytes (kind SX_COPY_H2H or SX_COPY_D2H). With crc non-NULL, *crc
 * is continued with the copied bytes, each piece hashed as it lands (pieces
 * combined with sx_crc32c_combine); with crc NULL the D2H path is the bare
 * cudaMemcpyAsync loop. Returns only when every byte has landed. */
int sx_copier_copy(sx_copier *c, void *dst, const void *src, size_t len, int kind, uint32_t *crc);

/* ---- reads with the fault hook, and producer-stream ordering (issue 9) ---- */
#define SX_EEOF -12       /* the file ended before the bytes asked for */
#define SX_SITE_READ 16u  /* fault-hook site in front of every read(2) of sx_read_at */

/* Reads exactly len bytes at offset into buf through the fault hook's "read" site (short reads and
 * EINTR are continued), so a failing read is an error code, never a SIGBUS as from a memory map. *crc,
 * if non-NULL, is continued with the bytes, each piece hashed right after it lands (in cache).
 * SX_EEOF when the file ends first. */
int sx_read_at(int fd, void *buf, size_t len, uint64_t offset, uint32_t *crc);
/* As sx_fault_arm, but `times` consecutive matching calls from the countdown-th on fail (a persistent
 * fault; times 1 is sx_fault_arm). */
void sx_fault_arm_times(unsigned site_mask, long countdown, long times, int action);

/* Orders the copier's later copies after the work queued so far on a producer's stream (the
 * __cuda_array_interface__ "stream" value: 1 the legacy default stream, 2 the per-thread default
 * stream, else a cudaStream_t): records an event on it and makes the copier's stream wait for the
 * event, without blocking the caller. SX_EINVAL for stream 0 (ambiguous) or a host copier. */
int sx_copier_wait_stream(sx_copier *c, uintptr_t stream);
/* Streams and asynchronous memset, for tests and benchmarks (work to order a copy after). */
int sx_cuda_stream_create(int device, uintptr_t *out);
int sx_cuda_stream_destroy(int device, uintptr_t stream);
int sx_cuda_memset_async(int device, void *dst, int value, size_t len, uintptr_t stream);

#endif
