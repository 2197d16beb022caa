#!/usr/bin/env python3
"""#include closure of a tree made by prepare.sh (measurement tooling only).

usage: include_closure.py DEST [--prune-cutlass]

Starts from DEST/sources.txt and follows every #include line (whatever #if it sits in, except
groups on a macro listed in UNDEFINED below, so the set is a superset of what the preprocessor
reads) through the include path build.sh / build_prefill.sh pass (the includer's folder for
"..." first, then csrc, csrc/kerutils/include, csrc/sm90, csrc/cutlass/include,
csrc/cutlass/tools/util/include). Includes not found there must come from the C++ standard
library, CUDA, Python or torch; anything else (a missing FlashMLA / CUTLASS / CuTe / kerutils
header) fails the check. With --prune-cutlass, CUTLASS headers outside the closure are deleted.
"""

import os
import pathlib
import re
import sys

d = pathlib.Path(sys.argv[1]).resolve()
prune = "--prune-cutlass" in sys.argv[2:]
INC = [
    d / "csrc",
    d / "csrc/kerutils/include",
    d / "csrc/sm90",
    d / "csrc/cutlass/include",
    d / "csrc/cutlass/tools/util/include",
]
CUT = d / "csrc/cutlass"
inc_re = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
macro_re = re.compile(r"^\s*#\s*include\s+CUDA_STD_HEADER\((\w+)\)", re.M)

# headers that come from outside the tree (std, CUDA incl. CCCL, Python, torch, pybind11)
EXT_PREFIX = (
    "cuda/",
    "nv/",
    "cub/",
    "thrust/",
    "crt/",
    "torch/",
    "ATen/",
    "c10/",
    "pybind11/",
    "cuda_",
    "cooperative_groups",
    "cublas",
    "cusparse",
    "cusolver",
    "curand",
    "cufft",
    "nvrtc",
    "nvtx3/",
)
EXT_NAMES = {
    "cuda.h",
    "cudaTypedefs.h",
    "math_constants.h",
    "mma.h",
    "vector_types.h",
    "driver_types.h",
    "device_functions.h",
    "host_defines.h",
    "Python.h",
    "cudaProfiler.h",
    "nvToolsExt.h",
    "sm_61_intrinsics.h",
    "sm_60_atomic_functions.h",
    "builtin_types.h",
    "library_types.h",
    "nvrtc.h",
    "nvJitLink.h",
    "nvml.h",
    "cuComplex.h",
    "ciso646",
    "cpuid.h",
}
STD = {
    "algorithm",
    "array",
    "atomic",
    "bit",
    "bitset",
    "cassert",
    "cfloat",
    "chrono",
    "climits",
    "cmath",
    "complex",
    "cstddef",
    "cstdint",
    "cstdio",
    "cstdlib",
    "cstring",
    "ctime",
    "deque",
    "exception",
    "fstream",
    "functional",
    "initializer_list",
    "iomanip",
    "iosfwd",
    "iostream",
    "istream",
    "iterator",
    "limits",
    "list",
    "map",
    "memory",
    "mutex",
    "numeric",
    "optional",
    "ostream",
    "random",
    "ratio",
    "set",
    "span",
    "sstream",
    "stdexcept",
    "stdint.h",
    "stdio.h",
    "stdlib.h",
    "string",
    "string.h",
    "string_view",
    "tuple",
    "type_traits",
    "typeinfo",
    "unordered_map",
    "unordered_set",
    "utility",
    "variant",
    "vector",
    "assert.h",
    "math.h",
    "float.h",
    "limits.h",
    "cctype",
    "cinttypes",
    "regex",
    "thread",
    "condition_variable",
    "future",
    "any",
    "concepts",
    "compare",
    "ranges",
    "source_location",
    "cstdarg",
    "csignal",
    "new",
    "queue",
    "stack",
    "valarray",
    "filesystem",
    "execution",
    "version",
    "numbers",
    "format",
    "charconv",
    "sys/time.h",
    "time.h",
    "unistd.h",
    "dlfcn.h",
    "errno.h",
    "ctype.h",
    "stddef.h",
    "immintrin.h",
    "x86intrin.h",
    "malloc.h",
    "fenv.h",
    "cfenv",
    "cwchar",
    "locale",
    "codecvt",
    "streambuf",
    "system_error",
    "typeindex",
    "scoped_allocator",
    "shared_mutex",
    "barrier",
    "latch",
    "semaphore",
    "stop_token",
    "coroutine",
    "expected",
    "print",
    "stdarg.h",
    "windows.h",
    "intrin.h",
    "sys/stat.h",
    "sys/types.h",
    "pthread.h",
    "cxxabi.h",
    "execinfo.h",
}


# Macros our build never defines (no -D for them, no #define in CUTLASS or FlashMLA). Lines
# inside an "#if defined(M)" / "#ifdef M" group on one of these are dead
# (CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED guards ~6.7 MB of *_ext.hpp GMMA shapes). Every other
# conditional counts as live.
UNDEFINED = {"CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"}
cond_re = re.compile(r"^\s*#\s*(if|ifdef|ifndef|elif|else|endif)\b(.*)$")


def live_text(text):
    out, stack = [], []  # stack of (dead_now, ever_dead_group)
    for line in text.splitlines():
        m = cond_re.match(line)
        if m:
            kw, rest = m.group(1), m.group(2).strip()
            if kw in ("if", "ifdef", "ifndef"):
                mac = None
                if kw == "ifdef":
                    mac = rest
                elif kw == "if":
                    m2 = re.fullmatch(r"defined\s*\(?\s*(\w+)\s*\)?", rest)
                    mac = m2.group(1) if m2 else None
                stack.append(mac in UNDEFINED)
            elif kw in ("elif", "else") and stack:
                stack[-1] = False  # the alternative branch of a dead group is live (conservative)
            elif kw == "endif" and stack:
                stack.pop()
            continue
        if not any(stack):
            out.append(line)
    return "\n".join(out)


def external(name):
    return name in STD or name in EXT_NAMES or name.startswith(EXT_PREFIX)


def resolve(name, includer, quoted):
    dirs = ([includer.parent] if quoted else []) + INC
    for x in dirs:
        f = x / name
        if f.is_file():
            return pathlib.Path(os.path.normpath(f))
    return None


roots = [d / l.strip() for l in (d / "sources.txt").read_text().splitlines() if l.strip()]
seen, todo, ext, missing = set(), list(roots), {}, []
while todo:
    f = todo.pop()
    if f in seen:
        continue
    seen.add(f)
    text = live_text(f.read_text(errors="replace"))
    for q, name in inc_re.findall(text):
        r = resolve(name, f, q == '"')
        if r is not None:
            todo.append(r)
        elif external(name):
            ext.setdefault(name, f)
        else:
            missing.append((name, f))
    for name in macro_re.findall(text):  # CUTLASS: #define CUDA_STD_HEADER(h) <cuda/std/h>
        ext.setdefault("cuda/std/" + name, f)


def rel(f):
    return str(f.relative_to(d))


print(
    f"closure: {len(seen)} files ({sum(1 for f in seen if CUT in f.parents)} CUTLASS), "
    f"{len(ext)} external headers"
)
print("external (must come from the C++ library / CUDA / Python / torch):")
print("  " + " ".join(sorted(ext)))
if missing:
    print("UNRESOLVED (not in the tree, not a known outside header):")
    for name, f in missing:
        print(f"  {name}   <- {rel(f)}")
    sys.exit(1)

if prune:
    n = b = 0
    for f in list(CUT.rglob("*")):
        if f.is_file() and f not in seen:
            n += 1
            b += f.stat().st_size
            f.unlink()
    for x in sorted(CUT.rglob("*"), key=lambda p: -len(p.parts)):
        if x.is_dir() and not any(x.iterdir()):
            x.rmdir()
    print(f"pruned {n} CUTLASS files ({b / 1e6:.1f} MB) outside the closure")
