/* recorder.c - an LD_PRELOAD shim that logs every file-system mutation under one directory.
 *
 * Built by the power-loss tests (tests/powerloss/oplog.py) and preloaded into a process that saves a
 * checkpoint. Every call below is passed to libc unchanged; when it succeeds and touches a path under
 * SNEPPX_PL_ROOT (or an fd opened under it), one line is appended to SNEPPX_PL_LOG and the bytes of a write
 * to SNEPPX_PL_DATA. oplog.py parses the lines; crashfs.py replays them.
 *
 * Which symbols: those that libpython and the native writer import (`nm -D --undefined-only`), plus their
 * 32/64-bit-offset twins and the fortified open variants, so a rebuild with other flags can't slip past.
 * Calls the model can't follow (a write through stdio, sendfile, a shared writable mmap, a symlink, an
 * fd under the root that was opened behind our back) are logged as `err` lines: the tests fail on them.
 *
 * Order: each call runs under one mutex, the log line written before it is released, so the log is one
 * real order in which the calls happened, also across the native writer's threads. Only the process that
 * loaded the shim first records (a forked child is ignored: its closes are not the parent's).
 *
 * Line format (tab-separated, paths absolute and canonical, bytes outside 0x21..0x7e %-escaped):
 *   open FD FLAGS PATH | close FD | dup OLD NEW | setfl FD FLAGS
 *   write FD OFFSET LEN DATA_OFFSET | trunc FD SIZE | truncpath PATH SIZE | falloc FD MODE OFFSET LEN
 *   fsync FD | fdatasync FD | syncrange FD OFFSET LEN FLAGS | syncfs FD | sync
 *   rename FROM TO | link FROM TO | unlink PATH | rmdir PATH | mkdir PATH
 *   err WHAT DETAIL
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/falloc.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_FDS 65536

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int inside; /* a libc call made by the shim itself is never recorded */
static pid_t recording_pid;
static char root[PATH_MAX];
static size_t root_len;
static int log_fd = -1, data_fd = -1;
static uint64_t data_offset;
static unsigned char tracked[MAX_FDS]; /* written under the lock; an fd's bit can't change while it is open */
static struct { dev_t dev; ino_t ino; } identity[MAX_FDS]; /* what a tracked fd was opened on */

/* The next definition of `name` (libc's), looked up once into a static of the calling wrapper. */
#define REAL(name) static __typeof__(&name) real_##name; \
    if (!real_##name) *(void **)&real_##name = dlsym(RTLD_NEXT, #name)

/* ---- the log ----------------------------------------------------------------------------------------- */

static void put_all(int fd, const void *p, size_t len) {
    const char *c = p;
    while (len) {
        ssize_t n = syscall(SYS_write, fd, c, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) abort(); /* a lost line would make the replay lie: die loudly instead */
        c += n; len -= (size_t)n;
    }
}

__attribute__((constructor)) static void init(void) {
    const char *r = getenv("SNEPPX_PL_ROOT"), *l = getenv("SNEPPX_PL_LOG"), *d = getenv("SNEPPX_PL_DATA");
    if (!r || !l || !d || !realpath(r, root)) return;
    root_len = strlen(root);
    log_fd = (int)syscall(SYS_openat, AT_FDCWD, l, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    data_fd = (int)syscall(SYS_openat, AT_FDCWD, d, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log_fd < 0 || data_fd < 0) abort();
    recording_pid = getpid();
}

static int recording(void) { return log_fd >= 0 && !inside && getpid() == recording_pid; }

/* The line being built (under the lock): fields appended with add_*, written by end_line(). */
static char line[4 * PATH_MAX + 256];
static size_t line_len;

static void add_raw(const char *s) {
    size_t n = strlen(s);
    if (line_len + n + 2 > sizeof line) abort();
    memcpy(line + line_len, s, n);
    line_len += n;
}

static void begin_line(const char *kind) { line_len = 0; add_raw(kind); }

static void add_int(long long v) {
    char buf[32];
    snprintf(buf, sizeof buf, "\t%lld", v);
    add_raw(buf);
}

static void add_path(const char *p) {
    char buf[3 * PATH_MAX + 2];
    size_t n = 0;
    buf[n++] = '\t';
    for (const unsigned char *c = (const unsigned char *)p; *c && n + 4 < sizeof buf; c++) {
        if (*c > 0x20 && *c < 0x7f && *c != '%') buf[n++] = (char)*c;
        else n += (size_t)snprintf(buf + n, 4, "%%%02X", *c);
    }
    buf[n] = 0;
    add_raw(buf);
}

static void end_line(void) {
    line[line_len++] = '\n';
    put_all(log_fd, line, line_len);
}

static void log_err(const char *what, const char *detail) {
    begin_line("err");
    add_path(what);
    add_path(detail);
    end_line();
}

#define ENTER() do { pthread_mutex_lock(&lock); inside = 1; } while (0)
#define LEAVE() do { inside = 0; pthread_mutex_unlock(&lock); } while (0)

/* ---- paths and fds ----------------------------------------------------------------------------------- */

static int under_root(const char *path) {
    return root_len && !strncmp(path, root, root_len) && (path[root_len] == 0 || path[root_len] == '/');
}

static int fd_path(int fd, char *out) {
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(proc, out, PATH_MAX - 1);
    if (n < 0) return -1;
    out[n] = 0;
    return 0;
}

/* `path` relative to `dirfd`, made absolute with a canonical parent (the last component is kept as it is:
 * it may not exist yet). Called before the operation, while the parent surely exists. */
static void resolve_at(int dirfd, const char *path, char *out) {
    char full[2 * PATH_MAX + 2], base[PATH_MAX], parent[PATH_MAX];
    if (path[0] == '/') snprintf(full, sizeof full, "%s", path);
    else if (dirfd == AT_FDCWD) snprintf(full, sizeof full, "%s/%s", getcwd(base, sizeof base) ? base : "", path);
    else snprintf(full, sizeof full, "%s/%s", fd_path(dirfd, base) == 0 ? base : "", path);
    size_t n = strlen(full);
    while (n > 1 && full[n - 1] == '/') full[--n] = 0;
    char *slash = strrchr(full, '/');
    const char *leaf = slash + 1;
    if (!*leaf || !strcmp(leaf, ".") || !strcmp(leaf, "..")) {
        if (!realpath(full, out)) snprintf(out, PATH_MAX, "%s", full);
        return;
    }
    *slash = 0;
    if (!realpath(*full ? full : "/", parent)) snprintf(parent, sizeof parent, "%s", full);
    snprintf(out, PATH_MAX, "%s%s%s", parent, strcmp(parent, "/") ? "/" : "", leaf);
}

static int is_tracked(int fd) { return fd >= 0 && fd < MAX_FDS && tracked[fd]; }

static void track(int fd) { /* under the lock */
    struct stat st;
    int ok = fstat(fd, &st) == 0;
    tracked[fd] = 1;
    identity[fd].dev = ok ? st.st_dev : 0;
    identity[fd].ino = ok ? st.st_ino : 0;
}

/* Under the lock, before a tracked fd's line: an fd closed where no shim sees it (inside libc) and reused
 * would send another file's writes to this one's log. closedir and fclose are wrapped; this catches the rest. */
static void check_identity(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_dev != identity[fd].dev || st.st_ino != identity[fd].ino)
        log_err("a tracked fd now points elsewhere (closed behind the shim's back?)", "");
}

/* A mutation through an fd whose open we did not see: harmless unless the file is under the root. */
static void check_untracked(int fd, const char *what) {
    char p[PATH_MAX];
    if (!recording() || is_tracked(fd) || fd_path(fd, p) != 0 || !under_root(p)) return;
    ENTER();
    log_err(what, p);
    LEAVE();
}

/* ---- open, close, dup -------------------------------------------------------------------------------- */

static int do_open(int dirfd, const char *path, int flags, mode_t mode) {
    REAL(openat);
    char abs[PATH_MAX];
    if (!recording()) return real_openat(dirfd, path, flags, mode);
    resolve_at(dirfd, path, abs);
    if (!under_root(abs)) return real_openat(dirfd, path, flags, mode);
    ENTER();
    int fd = real_openat(dirfd, path, flags, mode);
    int saved = errno;
    if (fd >= 0 && (flags & O_TMPFILE) == O_TMPFILE) log_err("O_TMPFILE", abs);
    else if (fd >= MAX_FDS) log_err("fd too large", abs);
    else if (fd >= 0) {
        track(fd);
        begin_line("open");
        add_int(fd);
        add_int(flags);
        add_path(abs);
        end_line();
    }
    LEAVE();
    errno = saved;
    return fd;
}

#define MODE_ARG(flags) mode_t mode = 0; \
    if ((flags) & (O_CREAT | O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = (mode_t)va_arg(ap, int); va_end(ap); }

int open(const char *path, int flags, ...) { MODE_ARG(flags); return do_open(AT_FDCWD, path, flags, mode); }
int open64(const char *path, int flags, ...) { MODE_ARG(flags); return do_open(AT_FDCWD, path, flags, mode); }
int openat(int dirfd, const char *path, int flags, ...) { MODE_ARG(flags); return do_open(dirfd, path, flags, mode); }
int openat64(int dirfd, const char *path, int flags, ...) { MODE_ARG(flags); return do_open(dirfd, path, flags, mode); }
int __open_2(const char *path, int flags) { return do_open(AT_FDCWD, path, flags, 0); }
int __open64_2(const char *path, int flags) { return do_open(AT_FDCWD, path, flags, 0); }
int __openat_2(int dirfd, const char *path, int flags) { return do_open(dirfd, path, flags, 0); }
int __openat64_2(int dirfd, const char *path, int flags) { return do_open(dirfd, path, flags, 0); }
int creat(const char *path, mode_t mode) { return do_open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode); }
int creat64(const char *path, mode_t mode) { return do_open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode); }

static void record_close(int fd) { /* under the lock */
    if (!is_tracked(fd)) return;
    tracked[fd] = 0;
    begin_line("close");
    add_int(fd);
    end_line();
}

int close(int fd) {
    REAL(close);
    if (!recording() || !is_tracked(fd)) return real_close(fd);
    ENTER();
    int rc = real_close(fd);
    int saved = errno;
    record_close(fd); /* even on EINTR or EIO: Linux frees the descriptor either way */
    LEAVE();
    errno = saved;
    return rc;
}

/* closedir and fclose close their fd inside libc (os.scandir(fd) reads a dup of a tracked fd) */
int closedir(DIR *dir) {
    REAL(closedir);
    int fd = dirfd(dir);
    if (!recording() || !is_tracked(fd)) return real_closedir(dir);
    ENTER();
    int rc = real_closedir(dir), saved = errno;
    record_close(fd);
    LEAVE();
    errno = saved;
    return rc;
}

int fclose(FILE *stream) {
    REAL(fclose);
    int fd = fileno(stream);
    if (!recording() || !is_tracked(fd)) return real_fclose(stream);
    ENTER();
    int rc = real_fclose(stream), saved = errno;
    record_close(fd);
    LEAVE();
    errno = saved;
    return rc;
}

int close_range(unsigned first, unsigned last, int flags) {
    REAL(close_range);
    if (!recording()) return real_close_range(first, last, flags);
    ENTER();
    int rc = real_close_range(first, last, flags);
    int saved = errno;
    if (rc == 0 && !(flags & CLOSE_RANGE_CLOEXEC))
        for (unsigned fd = first; fd <= last && fd < MAX_FDS; fd++) record_close((int)fd);
    LEAVE();
    errno = saved;
    return rc;
}

static void record_dup(int old, int new) { /* under the lock */
    record_close(new); /* dup2/dup3 onto an open fd close it first */
    if (!is_tracked(old) || new >= MAX_FDS) return;
    track(new);
    begin_line("dup");
    add_int(old);
    add_int(new);
    end_line();
}

/* dup, dup2, dup3 and fcntl(F_DUPFD*): `call` is the real call, made under the lock. */
#define DUP_WRAPPER(call, old, cond) do {                           \
        if (!recording()) return call;                              \
        ENTER();                                                    \
        int fd_ = call;                                             \
        int saved_ = errno;                                         \
        if (fd_ >= 0 && (cond)) record_dup(old, fd_);               \
        LEAVE();                                                    \
        errno = saved_;                                             \
        return fd_;                                                 \
    } while (0)

int dup(int old) { REAL(dup); DUP_WRAPPER(real_dup(old), old, 1); }
int dup2(int old, int new) { REAL(dup2); DUP_WRAPPER(real_dup2(old, new), old, old != new); }
int dup3(int old, int new, int flags) { REAL(dup3); DUP_WRAPPER(real_dup3(old, new, flags), old, 1); }

static int do_fcntl(int (*real)(int, int, ...), int fd, int cmd, long arg) {
    int dups = cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC;
    if (!recording() || !(dups || (cmd == F_SETFL && is_tracked(fd)))) return real(fd, cmd, arg);
    ENTER();
    int rc = real(fd, cmd, arg);
    int saved = errno;
    if (rc >= 0 && dups) record_dup(fd, rc);
    if (rc >= 0 && cmd == F_SETFL) {
        check_identity(fd);
        begin_line("setfl");
        add_int(fd);
        add_int(arg);
        end_line();
    }
    LEAVE();
    errno = saved;
    return rc;
}

int fcntl(int fd, int cmd, ...) {
    REAL(fcntl);
    va_list ap; va_start(ap, cmd); long arg = va_arg(ap, long); va_end(ap);
    return do_fcntl(real_fcntl, fd, cmd, arg);
}

int fcntl64(int fd, int cmd, ...) {
    REAL(fcntl64);
    va_list ap; va_start(ap, cmd); long arg = va_arg(ap, long); va_end(ap);
    return do_fcntl(real_fcntl64, fd, cmd, arg);
}

/* ---- writes ------------------------------------------------------------------------------------------ */

enum where { AT_OFFSET, AT_POSITION, AT_END };

/* Logs the `n` bytes a write put at `off`. AT_POSITION: they went to the file position, which has moved
 * past them; AT_END (O_APPEND, RWF_APPEND): they went to the end, which is now past them. */
static void record_write(int fd, const struct iovec *iov, int iovcnt, ssize_t n, off_t off, enum where where) {
    if (n < 0) return;
    check_identity(fd);
    if (where == AT_END) {
        struct stat st;
        off = fstat(fd, &st) == 0 ? st.st_size - n : -1;
    } else if (where == AT_POSITION) {
        off = lseek(fd, 0, SEEK_CUR) - n;
    }
    begin_line("write");
    add_int(fd);
    add_int(off);
    add_int(n);
    add_int((long long)data_offset);
    end_line();
    size_t left = (size_t)n;
    for (int i = 0; i < iovcnt && left; i++) {
        size_t take = iov[i].iov_len < left ? iov[i].iov_len : left;
        put_all(data_fd, iov[i].iov_base, take);
        left -= take;
    }
    data_offset += (uint64_t)n;
}

static int appends(int fd) {
    REAL(fcntl);
    int fl = real_fcntl(fd, F_GETFL);
    return fl >= 0 && (fl & O_APPEND);
}

/* Every write-like wrapper: untracked fds pass straight through (checked against the root afterwards). */
#define WRITE_WRAPPER(call, fd, iov, iovcnt, off, where) do {       \
        if (!recording() || !is_tracked(fd)) {                      \
            ssize_t n_ = call;                                      \
            int saved_ = errno;                                     \
            if (n_ > 0) check_untracked(fd, "write");               \
            errno = saved_;                                         \
            return n_;                                              \
        }                                                           \
        ENTER();                                                    \
        ssize_t n_ = call;                                          \
        int saved_ = errno;                                         \
        record_write(fd, iov, iovcnt, n_, off, where);              \
        LEAVE();                                                    \
        errno = saved_;                                             \
        return n_;                                                  \
    } while (0)

/* Linux quirk: pwrite and pwritev on an O_APPEND fd append, whatever the offset. */
#define POSITIONED(fd, off) ((off) < 0 ? AT_POSITION : appends(fd) ? AT_END : AT_OFFSET)

ssize_t write(int fd, const void *buf, size_t len) {
    REAL(write);
    struct iovec iov = {(void *)buf, len};
    WRITE_WRAPPER(real_write(fd, buf, len), fd, &iov, 1, -1, AT_POSITION);
}

ssize_t pwrite(int fd, const void *buf, size_t len, off_t off) {
    REAL(pwrite);
    struct iovec iov = {(void *)buf, len};
    WRITE_WRAPPER(real_pwrite(fd, buf, len, off), fd, &iov, 1, off, appends(fd) ? AT_END : AT_OFFSET);
}

ssize_t pwrite64(int fd, const void *buf, size_t len, off_t off) {
    REAL(pwrite64);
    struct iovec iov = {(void *)buf, len};
    WRITE_WRAPPER(real_pwrite64(fd, buf, len, off), fd, &iov, 1, off, appends(fd) ? AT_END : AT_OFFSET);
}

ssize_t writev(int fd, const struct iovec *iov, int c) {
    REAL(writev);
    WRITE_WRAPPER(real_writev(fd, iov, c), fd, iov, c, -1, AT_POSITION);
}

ssize_t pwritev(int fd, const struct iovec *iov, int c, off_t off) {
    REAL(pwritev);
    WRITE_WRAPPER(real_pwritev(fd, iov, c, off), fd, iov, c, off, POSITIONED(fd, off));
}

ssize_t pwritev64(int fd, const struct iovec *iov, int c, off_t off) {
    REAL(pwritev64);
    WRITE_WRAPPER(real_pwritev64(fd, iov, c, off), fd, iov, c, off, POSITIONED(fd, off));
}

ssize_t pwritev2(int fd, const struct iovec *iov, int c, off_t off, int fl) {
    REAL(pwritev2);
    WRITE_WRAPPER(real_pwritev2(fd, iov, c, off, fl), fd, iov, c, off,
                  (fl & RWF_APPEND) ? AT_END : POSITIONED(fd, off));
}

ssize_t pwritev64v2(int fd, const struct iovec *iov, int c, off_t off, int fl) {
    REAL(pwritev64v2);
    WRITE_WRAPPER(real_pwritev64v2(fd, iov, c, off, fl), fd, iov, c, off,
                  (fl & RWF_APPEND) ? AT_END : POSITIONED(fd, off));
}

/* ---- sizes ------------------------------------------------------------------------------------------- */

static int do_ftruncate(int (*real)(int, off_t), int fd, off_t size) {
    if (!recording() || !is_tracked(fd)) {
        int rc = real(fd, size), saved = errno;
        if (rc == 0) check_untracked(fd, "ftruncate");
        errno = saved;
        return rc;
    }
    ENTER();
    int rc = real(fd, size), saved = errno;
    if (rc == 0) {
        check_identity(fd);
        begin_line("trunc");
        add_int(fd);
        add_int(size);
        end_line();
    }
    LEAVE();
    errno = saved;
    return rc;
}

int ftruncate(int fd, off_t size) { REAL(ftruncate); return do_ftruncate(real_ftruncate, fd, size); }
int ftruncate64(int fd, off_t size) { REAL(ftruncate64); return do_ftruncate(real_ftruncate64, fd, size); }

static int do_truncate(int (*real)(const char *, off_t), const char *path, off_t size) {
    char abs[PATH_MAX];
    if (!recording()) return real(path, size);
    resolve_at(AT_FDCWD, path, abs);
    if (!under_root(abs)) return real(path, size);
    ENTER();
    int rc = real(path, size), saved = errno;
    if (rc == 0) {
        begin_line("truncpath");
        add_path(abs);
        add_int(size);
        end_line();
    }
    LEAVE();
    errno = saved;
    return rc;
}

int truncate(const char *path, off_t size) { REAL(truncate); return do_truncate(real_truncate, path, size); }
int truncate64(const char *path, off_t size) { REAL(truncate64); return do_truncate(real_truncate64, path, size); }

/* fallocate and posix_fallocate (which returns the error instead of setting errno): 0 is success for both. */
#define FALLOC_WRAPPER(call, fd, mode, off, len) do {               \
        if (!recording() || !is_tracked(fd)) {                      \
            int rc_ = call, saved_ = errno;                         \
            if (rc_ == 0) check_untracked(fd, "fallocate");         \
            errno = saved_;                                         \
            return rc_;                                             \
        }                                                           \
        ENTER();                                                    \
        int rc_ = call, saved_ = errno;                             \
        if (rc_ == 0 && ((mode) & ~FALLOC_FL_KEEP_SIZE))            \
            log_err("fallocate mode", "only 0 and FALLOC_FL_KEEP_SIZE are modelled"); \
        else if (rc_ == 0) {                                        \
            check_identity(fd);                                     \
            begin_line("falloc");                                   \
            add_int(fd);                                            \
            add_int(mode);                                          \
            add_int(off);                                           \
            add_int(len);                                           \
            end_line();                                             \
        }                                                           \
        LEAVE();                                                    \
        errno = saved_;                                             \
        return rc_;                                                 \
    } while (0)

int fallocate(int fd, int mode, off_t off, off_t len) { REAL(fallocate); FALLOC_WRAPPER(real_fallocate(fd, mode, off, len), fd, mode, off, len); }
int fallocate64(int fd, int mode, off_t off, off_t len) { REAL(fallocate64); FALLOC_WRAPPER(real_fallocate64(fd, mode, off, len), fd, mode, off, len); }
int posix_fallocate(int fd, off_t off, off_t len) { REAL(posix_fallocate); FALLOC_WRAPPER(real_posix_fallocate(fd, off, len), fd, 0, off, len); }
int posix_fallocate64(int fd, off_t off, off_t len) { REAL(posix_fallocate64); FALLOC_WRAPPER(real_posix_fallocate64(fd, off, len), fd, 0, off, len); }

/* ---- durability -------------------------------------------------------------------------------------- */

static int do_sync_fd(int (*real)(int), const char *kind, int fd) {
    int whole_fs = !strcmp(kind, "syncfs"); /* through any fd: everything under the root becomes durable */
    if (!recording() || !(is_tracked(fd) || whole_fs)) return real(fd);
    ENTER();
    int rc = real(fd), saved = errno;
    if (rc == 0) {
        if (is_tracked(fd)) check_identity(fd);
        begin_line(kind);
        add_int(is_tracked(fd) ? fd : -1);
        end_line();
    }
    LEAVE();
    errno = saved;
    return rc;
}

int fsync(int fd) { REAL(fsync); return do_sync_fd(real_fsync, "fsync", fd); }
int fdatasync(int fd) { REAL(fdatasync); return do_sync_fd(real_fdatasync, "fdatasync", fd); }
int syncfs(int fd) { REAL(syncfs); return do_sync_fd(real_syncfs, "syncfs", fd); }

void sync(void) {
    REAL(sync);
    if (!recording()) { real_sync(); return; }
    ENTER();
    real_sync();
    begin_line("sync");
    end_line();
    LEAVE();
}

int sync_file_range(int fd, off_t off, off_t len, unsigned flags) {
    REAL(sync_file_range);
    if (!recording() || !is_tracked(fd)) return real_sync_file_range(fd, off, len, flags);
    ENTER();
    int rc = real_sync_file_range(fd, off, len, flags), saved = errno;
    if (rc == 0) {
        check_identity(fd);
        begin_line("syncrange");
        add_int(fd);
        add_int(off);
        add_int(len);
        add_int(flags);
        end_line();
    }
    LEAVE();
    errno = saved;
    return rc;
}

/* ---- names ------------------------------------------------------------------------------------------- */

/* rename, renameat, renameat2, link, linkat: `call` is the real call, `a` and `b` the resolved paths. */
#define TWO_PATH_WRAPPER(kind, call, fd1, from, fd2, to, flags, allowed) do {  \
        char a[PATH_MAX], b[PATH_MAX];                                          \
        if (!recording()) return call;                                          \
        resolve_at(fd1, from, a);                                               \
        resolve_at(fd2, to, b);                                                 \
        if (!under_root(a) && !under_root(b)) return call;                      \
        ENTER();                                                                \
        int rc_ = call, saved_ = errno;                                         \
        if (rc_ == 0 && (!under_root(a) || !under_root(b)))                     \
            log_err(kind " across the root", b);                                \
        else if (rc_ == 0 && ((flags) & ~(allowed)))                            \
            log_err(kind " flags", "not modelled");                             \
        else if (rc_ == 0) {                                                    \
            begin_line(kind);                                                   \
            add_path(a);                                                        \
            add_path(b);                                                        \
            end_line();                                                         \
        }                                                                       \
        LEAVE();                                                                \
        errno = saved_;                                                         \
        return rc_;                                                             \
    } while (0)

int rename(const char *from, const char *to) {
    REAL(rename);
    TWO_PATH_WRAPPER("rename", real_rename(from, to), AT_FDCWD, from, AT_FDCWD, to, 0, 0);
}

int renameat(int f1, const char *from, int f2, const char *to) {
    REAL(renameat);
    TWO_PATH_WRAPPER("rename", real_renameat(f1, from, f2, to), f1, from, f2, to, 0, 0);
}

int renameat2(int f1, const char *from, int f2, const char *to, unsigned fl) {
    REAL(renameat2);
    TWO_PATH_WRAPPER("rename", real_renameat2(f1, from, f2, to, fl), f1, from, f2, to, fl, RENAME_NOREPLACE);
}

int link(const char *from, const char *to) {
    REAL(link);
    TWO_PATH_WRAPPER("link", real_link(from, to), AT_FDCWD, from, AT_FDCWD, to, 0, 0);
}

int linkat(int f1, const char *from, int f2, const char *to, int fl) {
    REAL(linkat);
    TWO_PATH_WRAPPER("link", real_linkat(f1, from, f2, to, fl), f1, from, f2, to, fl, AT_SYMLINK_FOLLOW);
}

/* unlink, unlinkat, rmdir, mkdir, mkdirat: one path each. */
#define ONE_PATH_WRAPPER(kind, call, dirfd, path) do {              \
        char abs[PATH_MAX];                                         \
        if (!recording()) return call;                              \
        resolve_at(dirfd, path, abs);                               \
        if (!under_root(abs)) return call;                          \
        ENTER();                                                    \
        int rc_ = call, saved_ = errno;                             \
        if (rc_ == 0) {                                             \
            begin_line(kind);                                       \
            add_path(abs);                                          \
            end_line();                                             \
        }                                                           \
        LEAVE();                                                    \
        errno = saved_;                                             \
        return rc_;                                                 \
    } while (0)

int unlink(const char *path) { REAL(unlink); ONE_PATH_WRAPPER("unlink", real_unlink(path), AT_FDCWD, path); }
int rmdir(const char *path) { REAL(rmdir); ONE_PATH_WRAPPER("rmdir", real_rmdir(path), AT_FDCWD, path); }
int mkdir(const char *path, mode_t mode) { REAL(mkdir); ONE_PATH_WRAPPER("mkdir", real_mkdir(path, mode), AT_FDCWD, path); }

int mkdirat(int dirfd, const char *path, mode_t mode) {
    REAL(mkdirat);
    ONE_PATH_WRAPPER("mkdir", real_mkdirat(dirfd, path, mode), dirfd, path);
}

int unlinkat(int dirfd, const char *path, int flags) {
    REAL(unlinkat);
    ONE_PATH_WRAPPER(flags & AT_REMOVEDIR ? "rmdir" : "unlink", real_unlinkat(dirfd, path, flags), dirfd, path);
}

/* ---- what the model does not follow: an `err` line when it touches the root -------------------------- */

static void refuse_path(int dirfd, const char *path, const char *what) {
    char abs[PATH_MAX];
    if (!recording()) return;
    resolve_at(dirfd, path, abs);
    if (!under_root(abs)) return;
    ENTER();
    log_err(what, abs);
    LEAVE();
}

static void refuse_fd(int fd, const char *what) {
    char p[PATH_MAX];
    if (!recording()) return;
    if (!is_tracked(fd) && (fd_path(fd, p) != 0 || !under_root(p))) return;
    ENTER();
    log_err(what, is_tracked(fd) ? "an fd opened under the root" : p);
    LEAVE();
}

int symlink(const char *target, const char *path) {
    REAL(symlink);
    refuse_path(AT_FDCWD, path, "symlink");
    return real_symlink(target, path);
}

int symlinkat(const char *target, int dirfd, const char *path) {
    REAL(symlinkat);
    refuse_path(dirfd, path, "symlinkat");
    return real_symlinkat(target, dirfd, path);
}

/* stdio writes go through libc's internal write, which no shim sees */
FILE *fopen(const char *path, const char *mode) {
    REAL(fopen);
    if (strpbrk(mode, "wa+")) refuse_path(AT_FDCWD, path, "fopen for writing");
    return real_fopen(path, mode);
}

FILE *fopen64(const char *path, const char *mode) {
    REAL(fopen64);
    if (strpbrk(mode, "wa+")) refuse_path(AT_FDCWD, path, "fopen64 for writing");
    return real_fopen64(path, mode);
}

FILE *fdopen(int fd, const char *mode) {
    REAL(fdopen);
    if (strpbrk(mode, "wa+")) refuse_fd(fd, "fdopen for writing");
    return real_fdopen(fd, mode);
}

ssize_t copy_file_range(int in, off_t *off_in, int out, off_t *off_out, size_t len, unsigned flags) {
    REAL(copy_file_range);
    refuse_fd(out, "copy_file_range");
    return real_copy_file_range(in, off_in, out, off_out, len, flags);
}

ssize_t sendfile(int out, int in, off_t *off, size_t count) {
    REAL(sendfile);
    refuse_fd(out, "sendfile");
    return real_sendfile(out, in, off, count);
}

ssize_t sendfile64(int out, int in, off_t *off, size_t count) {
    REAL(sendfile64);
    refuse_fd(out, "sendfile64");
    return real_sendfile64(out, in, off, count);
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    REAL(mmap);
    if ((prot & PROT_WRITE) && (flags & MAP_SHARED) && fd >= 0) refuse_fd(fd, "shared writable mmap");
    return real_mmap(addr, len, prot, flags, fd, off);
}

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    REAL(mmap64);
    if ((prot & PROT_WRITE) && (flags & MAP_SHARED) && fd >= 0) refuse_fd(fd, "shared writable mmap");
    return real_mmap64(addr, len, prot, flags, fd, off);
}

ssize_t splice(int in, off_t *off_in, int out, off_t *off_out, size_t len, unsigned flags) {
    REAL(splice);
    refuse_fd(out, "splice");
    return real_splice(in, off_in, out, off_out, len, flags);
}

int mknod(const char *path, mode_t mode, dev_t dev) {
    REAL(mknod);
    refuse_path(AT_FDCWD, path, "mknod");
    return real_mknod(path, mode, dev);
}

int mknodat(int dirfd, const char *path, mode_t mode, dev_t dev) {
    REAL(mknodat);
    refuse_path(dirfd, path, "mknodat");
    return real_mknodat(dirfd, path, mode, dev);
}

int mkfifo(const char *path, mode_t mode) {
    REAL(mkfifo);
    refuse_path(AT_FDCWD, path, "mkfifo");
    return real_mkfifo(path, mode);
}

int mkfifoat(int dirfd, const char *path, mode_t mode) {
    REAL(mkfifoat);
    refuse_path(dirfd, path, "mkfifoat");
    return real_mkfifoat(dirfd, path, mode);
}
