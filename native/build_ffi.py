"""cffi (API mode) build of SneppX's native core into `SneppX_ALG._sneppx_native`.

The cdef is derived from include/sneppx.h so the header stays the one source of
truth: preprocessor guards are dropped and every `#define NAME value` becomes
`#define NAME ...` for the compiler to fill in. Nothing here needs CUDA: the
CUDA runtime is dlopen'ed at run time when present.
"""

import pathlib
import re

from cffi import FFI

NATIVE = pathlib.Path(__file__).resolve().parent
HEADER = NATIVE / "include" / "sneppx.h"


def cdef_from_header(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)
    lines = []
    for line in text.splitlines():
        define = re.match(r"#define\s+(SX_\w+)\s+\S+", line)
        if define:
            lines.append(f"#define {define.group(1)} ...")
        elif not line.startswith("#"):
            lines.append(line)
    return "\n".join(lines)


ffibuilder = FFI()
ffibuilder.cdef(cdef_from_header(HEADER.read_text()))
ffibuilder.set_source(
    "SneppX_ALG._sneppx_native",
    '#include "sneppx.h"',
    sources=sorted(str(p.relative_to(NATIVE.parent)) for p in (NATIVE / "src").glob("*.c")),
    include_dirs=[str(HEADER.parent.relative_to(NATIVE.parent))],
    extra_compile_args=["-O3", "-std=gnu99", "-fvisibility=hidden", "-Wall", "-Wextra"],
    libraries=["pthread", "dl"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
