/* json_scan.c - what a JSON document would cost to parse, found before anything parses it.
 *
 * Why: Python's json module builds every value of a document before its caller can look at any of
 * them, and an empty object or array costs 20-30 times its bytes there. A checkpoint's table, a
 * manifest or a record comes from whoever wrote the file, so this pass (one look at each byte, no
 * allocation) counts the objects and arrays and measures the nesting, and the caller refuses a
 * document whose parse would cost far more than its size, or would recurse too deep, before parsing
 * it. Strings are skipped whole (a bracket in a name is not a container). It checks only what the
 * counts need: brackets balance and match, strings end; the parser checks the rest.
 */
#include "sneppx.h"

#define MAX_SCAN_DEPTH 4096

int sx_json_scan(const void *buf, size_t len, uint32_t max_depth, sx_json_shape *out) {
    if ((!buf && len) || !out || max_depth > MAX_SCAN_DEPTH) return SX_EINVAL;
    const unsigned char *p = buf, *end = p + len;
    uint64_t open_is_object[MAX_SCAN_DEPTH / 64 + 1] = {0}; /* one bit per open level: '{' or '[' */
    uint32_t depth = 0;
    out->containers = 0;
    out->depth = 0;
    while (p < end) {
        unsigned char c = *p++;
        if (c == '"') {
            while (p < end && *p != '"') {
                if (*p == '\\' && end - p < 2) return SX_EPROTO;
                p += *p == '\\' ? 2 : 1;
            }
            if (p == end) return SX_EPROTO; /* the string never ends */
            p++;
        } else if (c == '{' || c == '[') {
            if (depth == max_depth) { out->depth = (uint64_t)max_depth + 1; return SX_OK; } /* too deep: stop */
            uint64_t bit = 1ULL << (depth % 64);
            if (c == '{') open_is_object[depth / 64] |= bit;
            else open_is_object[depth / 64] &= ~bit;
            depth++;
            out->containers++;
            if (depth > out->depth) out->depth = depth;
        } else if (c == '}' || c == ']') {
            if (depth == 0) return SX_EPROTO;
            depth--;
            int object = (int)(open_is_object[depth / 64] >> (depth % 64) & 1);
            if (object != (c == '}')) return SX_EPROTO;
        }
    }
    return depth ? SX_EPROTO : SX_OK;
}
