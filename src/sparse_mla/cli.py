"""``sparse-mla``: info, verify, bench, demo and warmup."""

from __future__ import annotations

import sys

USAGE = """usage: sparse-mla COMMAND [options]   (sparse-mla --version: the version)

commands:
  info     execution mode (cuda or interpreter) and versions
  verify   randomized bit-exact sweep of the kernels (--quick for the CPU interpreter)
  bench    timing harness: CUDA graph and eager, with floors (GPU only)
  demo     random DeepSeek-V3.2 and DeepSeek-V4 models generating through sparse-mla beside
           Hugging Face's own implementation, and the time of one decode step
  warmup   compile the kernels a decode configuration launches (--heads, --cache, --topk,
           --page, --tokens, ...: see sparse-mla warmup --help), and say how long it took
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("-V", "--version"):
        from . import __version__

        print(f"sparse-mla {__version__}")
        return 0
    if cmd == "info":
        from ._runtime import info

        for k, v in info().items():
            print(f"{k:10} {v}")
        return 0
    if cmd == "verify":
        from .verify import main as verify_main

        return verify_main(rest)
    if cmd == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    if cmd == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if cmd == "warmup":
        from .decode.warmup import main as warmup_main

        return warmup_main(rest)
    print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
