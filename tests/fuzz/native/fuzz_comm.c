/* libFuzzer target: the TCP ring's receive path (native/src/comm.c) on any bytes from a neighbour, under ASan
 * and UBSan: rank 0 of 3 runs an allreduce of 12 floats in 8-byte frames while the input arrives from its left
 * neighbour (frames, notices, garbage) and the stream then ends; with the first input byte's bit 0 set, the input
 * arrives instead on the socket its right neighbour only ever writes notices on. The call must succeed (every
 * frame arrived) or end in a collective's typed status, blaming one of the group's ranks or none. */
#include "sneppx.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > 65536) return 0;
    int right[2], left[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, right) || socketpair(AF_UNIX, SOCK_STREAM, 0, left)) abort();
    int to = (data[0] & 1) ? right[1] : left[1];
    const uint8_t *p = data + 1;
    size_t n = size - 1;
    while (n) { /* fits the socket buffer: 64 KiB at most */
        ssize_t w = write(to, p, n);
        if (w <= 0) abort();
        p += w;
        n -= (size_t)w;
    }
    shutdown(right[1], SHUT_WR);
    shutdown(left[1], SHUT_WR);
    sx_comm *c;
    if (sx_comm_create(0, 3, 5, right[0], left[0], 8, &c) != SX_OK) abort();
    float values[12] = {0};
    int rc = sx_comm_allreduce(c, values, 12, SX_DTYPE_F32, SX_OP_SUM, 0.05);
    int peer = sx_comm_failed_peer(c);
    int typed = rc == SX_OK || rc == SX_EPEER || rc == SX_ETIMEDOUT || rc == SX_EPROTO || rc == SX_ESTALE;
    if (!typed || peer < -1 || peer > 2 || (rc == SX_OK && peer != -1)) abort();
    sx_comm_destroy(c);
    close(right[1]);
    close(left[1]);
    return 0;
}
