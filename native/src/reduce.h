/* reduce.h - the element-wise reductions and dtype sizes the collectives share (internal, not installed):
 * comm.c (the TCP ring) owns them, shm.c (shared memory on one host) uses them too. */
#ifndef SX_REDUCE_H
#define SX_REDUCE_H

#include <stddef.h>

/* dst[i] = dst[i] (op) src[i] for i < n. */
typedef void (*sx_reduce_fn)(void *dst, const void *src, size_t n);

/* The reduction for an SX_DTYPE_* and SX_OP_*, or NULL when the pair is not one. */
sx_reduce_fn sx_reducer(int dtype, int op);
/* Bytes per element of an SX_DTYPE_*, or 0. */
size_t sx_dtype_size(int dtype);

#endif
