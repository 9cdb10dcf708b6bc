"""Case 4, checkpoint loading: oodjax's load_pretrained in bfloat16 against transformers' from_pretrained.

The checkpoint is a float32 safetensors file written by transformers'
save_pretrained (the same one the evaluation and training cases run on).
Each load runs in a fresh process (benchmarks.load_child), alternating the
two loaders; the process reports its load time (imports excluded, and
reported apart) and its peak resident memory during the load.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
from typing import Any

from benchmarks import harness
from benchmarks.load_child import LOADERS
from benchmarks.settings import Mode


def run(mode: Mode, checkpoint: pathlib.Path) -> dict[str, Any]:
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    measured: dict[str, list[dict[str, float]]] = {name: [] for name in LOADERS}
    for _, loader in harness.alternating(list(LOADERS), mode.loading_repeats):
        command = [sys.executable, "-m", "benchmarks.load_child", loader, str(checkpoint)]
        stdout = harness.run_command(command, what=f"loading {checkpoint} with {loader}")
        measured[loader].append(json.loads(stdout.strip().splitlines()[-1]))
    results = {}
    for loader, runs in measured.items():
        load_s = [r["load_s"] for r in runs]
        growth = [(r["peak_rss_mib"] - r["rss_before_mib"]) * 2**20 for r in runs]
        results[loader] = {
            **harness.time_fields(load_s),
            "import_s_median": statistics.median(r["import_s"] for r in runs),
            "peak_rss_mib_median": statistics.median(r["peak_rss_mib"] for r in runs),
            "load_rss_growth_mib_median": statistics.median(growth) / 2**20,
            "load_rss_growth_over_checkpoint": statistics.median(growth) / size,
        }
    fields = harness.ratio_fields({name: {**r, "work_per_repeat": 1} for name, r in results.items()}, "oodjax")
    return {
        "case": "loading",
        "title": "Checkpoint loading (to bfloat16)",
        "unit": "s",
        "description": (
            f"float32 safetensors checkpoint of {size / 1e6:.0f} MB ({mode.model['num_hidden_layers']} layers, "
            f"hidden {mode.model['hidden_size']}); each load in a fresh process; memory = peak resident memory "
            "during the load minus resident memory before it (mapped checkpoint pages included)."
        ),
        "checkpoint_bytes": size,
        "contenders": results,
        # of the fastest loads, as harness.ratios takes them, beside the medians' and each round's
        **{key: {"transformers/oodjax time": ratios["oodjax/transformers"]} for key, ratios in fields.items()},
    }
