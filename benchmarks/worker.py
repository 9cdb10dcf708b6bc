"""`python -m benchmarks.worker MODULE CONTENDER KWARGS_JSON`: one contender of a case, in a process of its own.

Started by ``benchmarks.harness.compare``, never by hand. It builds the
contender, ``benchmarks.MODULE.contender(CONTENDER, **KWARGS)``, which
returns the call to time and a dict of what it built, and answers once with
that dict (and its pid, setup time and PyTorch's thread count). Then, for
each line "call" on its stdin, it makes one call and answers with its wall
seconds, the seconds JAX compiled during it and what it returned. Answers
are single JSON lines on the process's own stdout; everything else the
libraries print goes to stderr. It ends when its stdin closes.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

from benchmarks import harness


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(f"usage: python -m benchmarks.worker MODULE CONTENDER KWARGS_JSON; got {argv}")
    module, name, kwargs = argv
    answer = harness.json_channel()
    start = time.perf_counter()
    call, built = importlib.import_module(f"benchmarks.{module}").contender(name, **json.loads(kwargs))
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else None
    answer({"pid": os.getpid(), "setup_s": time.perf_counter() - start, "torch_threads": threads, **built})
    for request in sys.stdin:
        if request.strip() != "call":
            raise ValueError(f"benchmarks.worker takes only 'call' requests, got {request!r}")
        returned, seconds, compile_s = harness.timed(call)
        answer({"seconds": seconds, "compile_s": compile_s, "returned": returned})


if __name__ == "__main__":
    main(sys.argv[1:])
