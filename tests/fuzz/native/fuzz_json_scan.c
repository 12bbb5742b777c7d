/* libFuzzer target: sx_json_scan (native/src/json_scan.c) on any bytes, under ASan and UBSan. It must not read
 * outside the buffer, and what it reports must be possible: at most one container per byte, a depth no deeper
 * than the containers (one more where the scan stopped too deep), and never past max_depth + 1. */
#include "sneppx.h"

#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    sx_json_shape shape;
    int rc = sx_json_scan(data, size, 64, &shape);
    if (rc != SX_OK && rc != SX_EPROTO) abort();
    if (rc == SX_OK && (shape.containers > size || shape.depth > 65 || shape.depth > shape.containers + 1)) abort();
    return 0;
}
