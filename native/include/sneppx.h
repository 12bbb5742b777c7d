/* sneppx.h - the one public header of SneppX's native core.
 *
 * Conventions: every function that can fail returns an int status, SX_OK (0)
 * or a negative SX_E* code; sx_strerror() names it. Nothing here prints,
 * aborts or touches Python; the cffi wrapper (runtime/SneppX_ALG/_native/)
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
#define SX_ESTATE -12     /* not allowed in the current state (e.g. an illegal lifecycle transition) */
#define SX_ETIMEDOUT -13  /* a wait ended at its deadline */
#define SX_ENET -14       /* a socket call failed (see sx_last_errno), e.g. the address is in use */

#define SX_EPEER -15      /* a peer died or left: its connection closed, or a neighbour reported it (see sx_comm_failed_peer) */
#define SX_EABORTED -16   /* aborted (sx_comm_abort), or the communicator failed earlier */
#define SX_ESTALE -17     /* a message from another membership generation */
#define SX_EPROTO -18     /* a malformed message, or ranks that called different collectives */
#define SX_ENCCL -19      /* an NCCL call failed (see sx_nccl_last_error) */
#define SX_EEOF -20       /* the file ended before the bytes asked for (sx_read_at) */

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
/* crcs[i] = CRC32C of the lengths[i] bytes at base + offsets[i], for n ranges at once: their bytes are split
 * evenly over up to nthreads threads (0 = online CPUs) whatever the ranges' sizes, so many small ranges (the
 * tensors of a small checkpoint) use every core as one large one does. SX_ENOMEM, SX_EINVAL. */
int sx_crc32c_ranges(const void *base, size_t n, const uint64_t *offsets, const uint64_t *lengths, uint32_t *crcs,
                     int nthreads);

/* ---- durable file writing ---------------------------------------------- */
/* A file written in one streaming pass: appends are queued to two background
 * writer threads, so the device always has the next write waiting. Under
 * O_DIRECT (where the filesystem allows it) bytes are copied into aligned
 * staging buffers; in buffered mode large appends are written straight from the
 * caller's memory with write-behind (sync_file_range, then the written pages
 * dropped). CRC32C of each append is computed as it is copied or written. A
 * finished writer's buffers are kept (four at most) for the next one, so
 * periodic saves don't page-fault fresh memory every time. */
typedef struct sx_file sx_file;

/* Creates path exclusively (O_EXCL). buffer_bytes: per staging buffer (four of
 * them) and per write, rounded up to the alignment; 0 = 2 MiB. direct: 1 try
 * O_DIRECT and fall back, 0 buffered. */
int sx_file_create(const char *path, size_t buffer_bytes, int direct, sx_file **out);
/* Appends len bytes; *crc is updated with them (pass NULL to skip). buf is not read after the call. */
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
 * malloc otherwise. Free with the copier that allocated it: before or after
 * sx_copier_destroy (each buffer keeps the copier's memory until it is freed). */
int sx_copier_alloc(sx_copier *c, size_t len, void **out);
void sx_copier_free(sx_copier *c, void *p);
/* Copies len bytes (kind SX_COPY_H2H or SX_COPY_D2H). With crc non-NULL, *crc
 * is continued with the copied bytes, each piece hashed as it lands (pieces
 * combined with sx_crc32c_combine); with crc NULL the D2H path is the bare
 * cudaMemcpyAsync loop. Returns only when every byte has landed. */
int sx_copier_copy(sx_copier *c, void *dst, const void *src, size_t len, int kind, uint32_t *crc);
/* equal[i] = 1 when the lens[i] bytes at a[i] and b[i] are the same, else 0, for n pairs at once, the pairs
 * split over up to nthreads threads (0 = online CPUs); memcmp, which stops at the first difference. An
 * incremental save's test that host pieces did not change since the save whose bytes a staging buffer still
 * holds: exact, and cheaper than hashing them. SX_EINVAL. */
int sx_equal_ranges(size_t n, const void *const *a, const void *const *b, const uint64_t *lens, uint8_t *equal,
                    int nthreads);

/* ---- keyed BLAKE2s (RFC 7693; blake2s.c) ------------------------------- */
/* outlen 1..32 bytes, keylen 0..32 bytes. The heartbeat MAC is outlen 16 with
 * the job's 32-byte key. */
int sx_blake2s(void *out, size_t outlen, const void *key, size_t keylen, const void *in, size_t inlen);
/* 1 if the len bytes at a and b are equal; time depends on len only. */
int sx_equal_ct(const void *a, const void *b, size_t len);

/* ---- heartbeats: failure detection over UDP (heartbeat.c) --------------- */
/* One monitor = one UDP socket and one C thread that sends, receives,
 * authenticates and decides suspicion without the GIL. Wire format and the
 * detection bounds: docs/ELASTIC.md ("Failure detection"). IPv4; addresses
 * are host-order uint32 and ports host-order uint16. Times are CLOCK_MONOTONIC
 * nanoseconds (the clock of Python's time.monotonic_ns on Linux). */
#define SX_HB_VERSION 1
#define SX_HB_MAGIC 0x42485853u  /* "SXHB" read as a little-endian uint32 */
#define SX_HB_HEADER_BYTES 88
#define SX_HB_ENTRY_BYTES 24     /* one piggybacked membership update */
#define SX_HB_MAX_ENTRIES 8
#define SX_HB_MAC_BYTES 16
#define SX_HB_MAX_DATAGRAM 296   /* header + 8 entries + MAC */
#define SX_HB_MIN_KEY 16
#define SX_HB_KEY_BYTES 32       /* longer keys are hashed to this by the caller */

/* datagram types */
#define SX_HB_PING 1             /* "are you there?": the receiver answers with an ACK */
#define SX_HB_ACK 2              /* echoes the PING's sequence, send time and target */
#define SX_HB_PING_REQ 3         /* gossip mode: "ping target for me" (indirect probe) */
#define SX_HB_FLAG_RELAYED 1     /* an ACK forwarded by the member asked with PING_REQ */

/* peer states; also the states of piggybacked membership updates */
#define SX_HB_UNKNOWN 0          /* not heard from yet */
#define SX_HB_HEALTHY 1
#define SX_HB_SUSPECTED 2
#define SX_HB_CONFIRMED 3        /* gossip mode: suspected for longer than the suspicion timeout */

/* modes */
#define SX_HB_DIRECT 0           /* every peer probed every interval (peers <= direct_limit) */
#define SX_HB_GOSSIP 1           /* SWIM: one probe per interval, indirect probes, piggybacked suspicion */

/* why a datagram was dropped (indexes into sx_hb_stats.drops) */
#define SX_HB_DROP_TRUNCATED 0   /* shorter than its header says */
#define SX_HB_DROP_OVERSIZED 1   /* longer than SX_HB_MAX_DATAGRAM or than its header says */
#define SX_HB_DROP_BAD_MAGIC 2   /* not a SneppX heartbeat at all (random bytes) */
#define SX_HB_DROP_BAD_VERSION 3
#define SX_HB_DROP_BAD_MAC 4     /* wrong key or altered bytes */
#define SX_HB_DROP_WRONG_JOB 5
#define SX_HB_DROP_UNKNOWN_SENDER 6  /* the source address is not a peer */
#define SX_HB_DROP_STALE_GENERATION 7
#define SX_HB_DROP_REPLAY 8      /* a sequence number already seen, older than the window, or our own */
#define SX_HB_DROP_REORDERED 9   /* older than the newest seen from that sender: carries no news */
#define SX_HB_DROP_UNSOLICITED 10  /* an ACK for no probe of ours, or a PING meant for another member */
#define SX_HB_DROP_MALFORMED 11  /* authentic but impossible fields (unknown type, flags) */
#define SX_HB_DROP_BUSY 12       /* a PING_REQ with every relay slot in use */
#define SX_HB_NDROPS 13

/* membership events */
#define SX_HB_EVENT_HEALTHY 1    /* first heard from, or back after a suspicion */
#define SX_HB_EVENT_SUSPECTED 2
#define SX_HB_EVENT_CONFIRMED 3  /* gossip mode: suspicion not refuted in time */
#define SX_HB_EVENT_RESTARTED 4  /* the peer's datagrams come from a new process (instance) */

typedef struct {
    uint32_t bind_addr;          /* 0 = every interface */
    uint16_t bind_port;          /* 0 = any free port (see sx_hb_port) */
    uint64_t interval_ns;        /* between probe rounds */
    uint64_t timeout_ns;         /* direct mode: silence before suspicion */
    uint64_t probe_timeout_ns;   /* gossip mode: wait for a direct ACK before indirect probes */
    uint64_t suspicion_ns;       /* gossip mode: suspected -> confirmed */
    uint32_t direct_limit;       /* more peers than this: gossip mode */
    uint32_t indirect_probes;    /* gossip mode: members asked to probe a silent target */
    uint32_t retransmits;        /* gossip mode: times each membership update is piggybacked */
    uint64_t generation;         /* datagrams from older generations are dropped */
    uint8_t key[32];             /* SX_HB_KEY_BYTES */
    uint8_t job_tag[16];         /* BLAKE2s-128 of the job id */
    uint64_t first_contact_grace_ns; /* a peer never heard from is suspected only timeout + this after the start
                                    (both modes); 0: direct mode after timeout, gossip mode at its first
                                    unanswered probe */
    int sock_fd;                 /* -1: bind bind_addr:bind_port. Else an IPv4 UDP socket the caller already bound
                                    and keeps: the monitor uses a dup of it (bind_* are taken from it), closed on
                                    stop; the socket itself stays open and bound */
} sx_hb_config;

typedef struct {
    uint32_t addr;
    uint16_t port;
    int state;                   /* SX_HB_UNKNOWN .. SX_HB_CONFIRMED */
    int64_t state_since_ns;
    int64_t last_seen_ns;        /* last accepted datagram from it; -1 never */
    int64_t last_alive_ns;       /* newest proof of life (send time of a probe it answered); -1 never */
    uint64_t rtt_ns;             /* smoothed round-trip time (RFC 6298); 0 until measured */
    uint64_t rtt_var_ns;
    uint64_t probes_sent, acks_received, pings_received, accepted;
    uint64_t suspicions;         /* times it went healthy/unknown -> suspected */
    uint64_t instance;           /* random id of its current process; 0 until heard */
    uint64_t restarts;           /* times that id changed */
    uint64_t incarnation;        /* gossip mode: its SWIM incarnation as known here */
} sx_hb_peer;

typedef struct {
    int mode;
    uint16_t port;
    uint64_t instance, incarnation, generation;
    uint64_t sent, send_errors, received, accepted;
    uint64_t drops[16];          /* by SX_HB_DROP_*; the first SX_HB_NDROPS are used */
    uint64_t relayed;            /* gossip mode: indirect probes answered for others */
    uint64_t stalls;             /* times our own thread was not scheduled for over 2 intervals */
    uint64_t events;             /* index of the newest event */
} sx_hb_stats;

typedef struct {
    uint64_t index;              /* 1, 2, 3... per monitor */
    int kind;                    /* SX_HB_EVENT_* */
    uint32_t peer;               /* index in the peer list */
    int64_t time_ns;
    uint64_t generation;
} sx_hb_event;

typedef struct sx_hb sx_hb;

/* Binds the socket (SX_ENET if it can't: address in use, not local), or dups
 * cfg->sock_fd (SX_EINVAL if it is not a bound IPv4 UDP socket). The peers
 * are copied; an entry equal to the bound address is SX_EINVAL. */
int sx_hb_create(const sx_hb_config *cfg, const uint32_t *addrs, const uint16_t *ports, size_t npeers,
                 sx_hb **out);
/* Starts the thread (once; SX_ESTATE after a stop). */
int sx_hb_start(sx_hb *hb);
/* Stops and joins the thread, closes the socket (only the monitor's dup of a
 * caller's sock_fd) and wakes every waiter; idempotent. */
int sx_hb_stop(sx_hb *hb);
/* Stops, closes and frees. */
void sx_hb_destroy(sx_hb *hb);
/* The generation stamped on datagrams; lower ones are refused (SX_EINVAL). */
int sx_hb_set_generation(sx_hb *hb, uint64_t generation);
int sx_hb_get_stats(sx_hb *hb, sx_hb_stats *out);
/* Copies all peers (n = the count given to create) in one consistent snapshot. */
int sx_hb_get_peers(sx_hb *hb, sx_hb_peer *out, size_t n);
/* Events with index > after, oldest first, at most max: waits up to
 * timeout_ns (< 0: forever) for the first one. SX_ETIMEDOUT when none came,
 * SX_ESTATE once stopped. Events older than the last 4096 are gone (the
 * index shows the gap). */
int sx_hb_wait_events(sx_hb *hb, uint64_t after, sx_hb_event *out, size_t max, int64_t timeout_ns, size_t *n);
const char *sx_hb_drop_name(int reason);

/* ---- the elastic lifecycle of one node (elastic.c) ---------------------- */
/* A pure state machine, no I/O: the ElasticTrainer feeds it events and acts
 * on the states. Illegal transitions return SX_ESTATE and change nothing.
 * Table and reasons: docs/ELASTIC.md ("Lifecycle"). */
#define SX_EL_INIT 0
#define SX_EL_JOINING 1
#define SX_EL_RUNNING 2
#define SX_EL_RECONFIGURING 3
#define SX_EL_STOPPED 4
#define SX_EL_FAILED 5
#define SX_EL_NSTATES 6

#define SX_EL_JOIN 0
#define SX_EL_LEAVE 1
#define SX_EL_PEER_FAILED 2
#define SX_EL_TIMEOUT 3
#define SX_EL_RECONFIGURED 4
#define SX_EL_BUDGET_EXHAUSTED 5
#define SX_EL_FATAL 6
#define SX_EL_NEVENTS 7

typedef struct {
    int state;
    uint64_t generation;         /* membership generation: raised by each `reconfigured` */
    uint64_t transitions;        /* legal events applied */
} sx_elastic;

void sx_elastic_init(sx_elastic *m);
/* Applies event; generation matters for RECONFIGURED only (0 = current + 1,
 * otherwise it must be higher than the current one, or SX_EINVAL). */
int sx_elastic_fire(sx_elastic *m, int event, uint64_t generation);
/* The state event leads to from state, or SX_ESTATE if it is illegal there. */
int sx_elastic_next(int state, int event);
const char *sx_elastic_state_name(int state);
const char *sx_elastic_event_name(int event);

/* ---- JSON from someone else: its cost before it is parsed (json_scan.c) ----
 * One pass, no allocation: counts the objects and arrays of a document and its
 * deepest nesting, skipping strings whole. SX_EPROTO when brackets don't
 * balance or match or a string never ends; a document nested deeper than
 * max_depth (at most 4096) stops the scan with depth = max_depth + 1. */
typedef struct {
    uint64_t containers; /* objects and arrays */
    uint64_t depth;      /* deepest nesting; the top-level value is depth 1 */
} sx_json_shape;
int sx_json_scan(const void *buf, size_t len, uint32_t max_depth, sx_json_shape *out);

/* ---- collectives: a TCP ring between the ranks of one generation (comm.c) ----
 * Each rank holds two connected stream sockets, authenticated and handed over
 * by the caller: send_fd to rank+1 and recv_fd from rank-1 (mod world_size).
 * allreduce = reduce-scatter then allgather around the ring (bandwidth
 * optimal: each rank sends 2(N-1)/N of the data), pipelined in frames of
 * chunk_bytes so a rank forwards a frame as soon as it has reduced it.
 * Every frame carries the generation and a sequence number, checked on
 * arrival. Every call has a deadline. sx_comm_abort(), from any thread,
 * makes the running call and every later one return SX_EABORTED at once and
 * shuts the sockets, so the neighbours fail too (SX_EPEER) instead of waiting
 * out their deadlines. Any other failure (a peer lost, a deadline, a bad
 * frame) is sent to both neighbours in a notice frame naming the blamed rank
 * before the sockets shut; a neighbour takes it as its own and passes it on,
 * so every survivor reports the same failure and rank (sx_comm_failed_peer).
 * After any failure the communicator only fails: build a
 * new one for the next generation. One call at a time per communicator.
 * On failure, the contents of buf are unspecified. */
#define SX_DTYPE_F32 0
#define SX_DTYPE_F64 1
#define SX_DTYPE_I32 2
#define SX_DTYPE_I64 3
#define SX_DTYPE_U8 4     /* broadcast and allgather only */
#define SX_OP_SUM 0       /* integers wrap around, as in numpy */
#define SX_OP_MAX 1
#define SX_OP_MIN 2
#define SX_COMM_HEADER_BYTES 32
#define SX_COMM_MAGIC 0x31435853u /* "SXC1" little-endian */

typedef struct sx_comm sx_comm;

/* Takes ownership of both fds (closed by sx_comm_destroy, also on failure);
 * world_size 1 takes -1 for both. chunk_bytes: payload per frame, rounded
 * down to a multiple of 8; 0 = 1 MiB. */
int sx_comm_create(int rank, int world_size, uint64_t generation, int send_fd, int recv_fd, size_t chunk_bytes,
                   sx_comm **out);
/* Never while a call is running on c: sx_comm_abort() first, then wait for it. */
void sx_comm_destroy(sx_comm *c);
/* Thread-safe and async-signal-safe; idempotent. */
void sx_comm_abort(sx_comm *c);
/* The rank blamed for the first failure (the peer whose connection broke or
 * who sent a bad frame), or -1. */
int sx_comm_failed_peer(const sx_comm *c);
/* Fails c, between calls, with a failure of an enclosing group (one that
 * composes this communicator with others): code is SX_EPEER, SX_ETIMEDOUT,
 * SX_ESTALE or SX_EPROTO, outer a rank as the enclosing group numbers them
 * (-1: none). Both neighbours are told in a notice that carries outer, and
 * pass it on, so every rank reports it (sx_comm_failed_outer) instead of
 * blaming the rank that relayed it. A no-op on a communicator that failed. */
int sx_comm_relay(sx_comm *c, int code, int outer);
/* The enclosing group's blamed rank of the first failure, or -1. */
int sx_comm_failed_outer(const sx_comm *c);

/* In place over count elements. reduce_scatter leaves rank r's shard of buf
 * (sx_shard_range(count, world, r)) reduced over all ranks and the rest
 * unspecified; allgather fills every shard of buf from the rank that owns it. */
int sx_comm_allreduce(sx_comm *c, void *buf, size_t count, int dtype, int op, double timeout_s);
int sx_comm_reduce_scatter(sx_comm *c, void *buf, size_t count, int dtype, int op, double timeout_s);
int sx_comm_allgather(sx_comm *c, void *buf, size_t count, int dtype, double timeout_s);
/* nbytes from root's buf into everyone's, along the ring. */
int sx_comm_broadcast(sx_comm *c, void *buf, size_t nbytes, int root, double timeout_s);
/* send_len bytes of send_buf to rank + 1 while recv_len bytes from rank - 1
 * land in recv_buf (recv_len must be what that rank sends). */
int sx_comm_shift(sx_comm *c, const void *send_buf, size_t send_len, void *recv_buf, size_t recv_len,
                  double timeout_s);
/* Returns when every rank has entered it. */
int sx_comm_barrier(sx_comm *c, double timeout_s);

/* ---- collectives: shared memory between the ranks of one host (shm.c) ----
 * The same calls and results as sx_comm_* (reductions may differ in the last
 * bits of floats: another order), for ranks that share /dev/shm and a PID
 * namespace. Rank 0 creates the segment `name` (create=1, O_EXCL, mode 0600;
 * the caller makes the name unguessable), the others open it; then every rank
 * calls sx_shm_wait_attached, which unlinks the name once all have mapped it.
 * A peer's exit is seen through its pidfd (SX_EPEER, and sx_shm_failed_peer
 * names it on every rank); a failure or sx_shm_abort() on any rank fails every
 * rank's running and later calls at once. slot_bytes: per rank and chunk, a
 * multiple of 64. One call at a time per communicator. */
typedef struct sx_shm sx_shm;

int sx_shm_create(const char *name, int create, int rank, int world_size, uint64_t generation, size_t slot_bytes,
                  sx_shm **out);
/* SX_ETIMEDOUT when not every rank has come by timeout_s: call it again. */
int sx_shm_wait_attached(sx_shm *c, double timeout_s);
/* Never while a call is running on c: sx_shm_abort() first, then wait for it. */
void sx_shm_destroy(sx_shm *c);
/* Thread-safe; idempotent. */
void sx_shm_abort(sx_shm *c);
/* The rank blamed for the first failure (the one that died, left or called
 * something else), or -1. */
int sx_shm_failed_peer(const sx_shm *c);
/* As sx_comm_relay and sx_comm_failed_outer: every rank of the segment fails
 * with code, reporting outer. Thread-safe. */
int sx_shm_relay(sx_shm *c, int code, int outer);
int sx_shm_failed_outer(const sx_shm *c);
int sx_shm_allreduce(sx_shm *c, void *buf, size_t count, int dtype, int op, double timeout_s);
int sx_shm_reduce_scatter(sx_shm *c, void *buf, size_t count, int dtype, int op, double timeout_s);
int sx_shm_allgather(sx_shm *c, void *buf, size_t count, int dtype, double timeout_s);
int sx_shm_broadcast(sx_shm *c, void *buf, size_t nbytes, int root, double timeout_s);
int sx_shm_barrier(sx_shm *c, double timeout_s);
/* The shard of count elements that rank owns among world ranks: [*start, *stop),
 * start = floor(count * rank / world), exact for any count < 2^64. */
void sx_shard_range(uint64_t count, int world_size, int rank, uint64_t *start, uint64_t *stop);

/* ---- NCCL, dlopen'ed (nccl.c) --------------------------------------------
 * Communicators are non-blocking (ncclConfig_t.blocking = 0), with the
 * config's size/magic/version set for the loaded library. A watchdog thread
 * per communicator polls ncclCommGetAsyncError; on an error, a passed
 * deadline or sx_nccl_abort() it calls ncclCommAbort, so a call waiting on
 * the GPU returns instead of hanging. A communicator that failed is only ever
 * aborted, never ncclCommDestroy'ed. sx_cuda_load() must have succeeded first
 * (streams come from the CUDA runtime). */
#define SX_NCCL_UNIQUE_ID_BYTES 128
typedef struct sx_nccl sx_nccl;

/* Loads libnccl from path (NULL or "" = the soname libnccl.so.2); once loaded,
 * later calls are no-ops. SX_ENOLIB if missing or older than 2.14.3. */
int sx_nccl_load(const char *path);
const char *sx_nccl_library(void);
/* The loaded library's version code (e.g. 23203 for 2.32.3). */
int sx_nccl_version(int *version);
int sx_nccl_unique_id(unsigned char *id); /* SX_NCCL_UNIQUE_ID_BYTES bytes */
/* The last ncclResult_t seen by this thread and NCCL's text for it. */
int sx_nccl_last_error(void);
const char *sx_nccl_error_string(int result);
/* Joins the communicator of world_size ranks named by id on `device`;
 * returns when every rank has joined, or fails at the deadline (aborted). */
int sx_nccl_create(const unsigned char *id, int rank, int world_size, int device,
                   double timeout_s, sx_nccl **out);
/* Aborts a communicator that failed or is running; destroys one that is idle. */
void sx_nccl_destroy(sx_nccl *n);
void sx_nccl_abort(sx_nccl *n);
/* On device memory, in place; they return once the GPU has finished. */
int sx_nccl_allreduce(sx_nccl *n, void *buf, size_t count, int dtype, int op, double timeout_s);
int sx_nccl_broadcast(sx_nccl *n, void *buf, size_t nbytes, int root, double timeout_s);
/* As sx_comm_*: NCCL's own layout (equal shards), so count must divide by world_size. */
int sx_nccl_reduce_scatter(sx_nccl *n, void *buf, size_t count, int dtype, int op, double timeout_s);
int sx_nccl_allgather(sx_nccl *n, void *buf, size_t count, int dtype, double timeout_s);

/* ---- reads with the fault hook, and producer-stream ordering (issue 9) ---- */
#define SX_SITE_READ 16u  /* fault-hook site in front of every read(2) of sx_read_at */

/* Reads exactly len bytes at offset into buf through the fault hook's "read" site (short reads and
 * EINTR are continued), so a failing read is an error code, never a SIGBUS as from a memory map. *crc,
 * if non-NULL, is continued with the bytes, each piece hashed right after it lands (in cache).
 * SX_EEOF when the file ends first. */
int sx_read_at(int fd, void *buf, size_t len, uint64_t offset, uint32_t *crc);
/* As sx_read_at, with one CRC32C per block_bytes block of the range (the last may be shorter) into crcs
 * (ceil(len / block_bytes) of them), each taken as the block lands: what a ranged read of checked chunks
 * needs, in one pass over the bytes. */
int sx_read_blocks_at(int fd, void *buf, size_t len, uint64_t offset, size_t block_bytes, uint32_t *crcs);
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

/* ---- benchmarks only: the memory read ceiling (membench.c) ----------------
 * Widths: 0 = 64-bit scalar loads, 1 = AVX2 (256-bit), 2 = AVX-512 (512-bit), 3 = AVX-512 over four
 * streams a quarter of the buffer apart (as the CRC kernels read three). */
/* Bit w set: width w runs on this CPU. */
unsigned sx_memory_read_widths(void);
/* Reads every byte of buf once with loads of that width on the calling thread; *out gets the xor of its
 * 64-bit words, then of its last len % 8 bytes (the same at every width; nothing is optimised away). SX_EINVAL for a width this CPU lacks. */
int sx_memory_read(int width, const void *buf, size_t len, uint64_t *out);

#endif
