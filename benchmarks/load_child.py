"""`python -m benchmarks.load_child {oodjax,transformers} CHECKPOINT_DIR`: load once, print JSON, exit.

Run in a fresh process per measurement so the peak resident memory is this
load's alone. After the imports the kernel's high-water mark is reset
(/proc/self/clear_refs, value 5), so the reported peak covers the load and
not whatever the imports touched; resident memory includes the pages of the
memory-mapped checkpoint that were read.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

LOADERS = ("oodjax", "transformers")


def _status_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(f"/proc/self/status has no {field}")


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in LOADERS:
        raise SystemExit(f"usage: python -m benchmarks.load_child {{{','.join(LOADERS)}}} CHECKPOINT_DIR; got {argv}")
    loader, path = argv
    start = time.perf_counter()
    if loader == "oodjax":
        import jax
        from flax import nnx

        from oodjax import models

        def load() -> None:
            jax.block_until_ready(nnx.state(models.load_pretrained(path, dtype="bfloat16")))

    else:
        import torch
        import transformers

        def load() -> None:
            transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)

    imported = time.perf_counter()
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    load()
    loaded = time.perf_counter()
    measured = {"import_s": imported - start, "load_s": loaded - imported, "rss_before_mib": before / 1024}
    print(json.dumps({**measured, "peak_rss_mib": _status_kib("VmHWM") / 1024}))


if __name__ == "__main__":
    main(sys.argv[1:])
