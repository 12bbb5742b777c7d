/* status.h - the per-thread errno behind sx_last_errno(), shared by the files that make system calls
 * (internal, not installed). io.c owns it; others record the errno of a failed call here before
 * returning their SX_E* code, so the Python wrapper can name the cause. */
#ifndef SX_STATUS_H
#define SX_STATUS_H

void sx_record_errno(int e);

#endif
