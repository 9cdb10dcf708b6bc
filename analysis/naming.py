"""A run's model family and size, read from its config, file names that never collide, and the names that
figures and tables print for testsets, methods and families.

Run names ("opt2.7", "olmo7", "smol3") are the sweep's short labels and say
nothing reliable about the model, so family and size come from the config
the engine stores with every run (`config["model"]`):

- `path`, a hub id or checkpoint directory ("facebook/opt-2.7b",
  "allenai/OLMo-2-1124-7B", "HuggingFaceTB/SmolLM3-3B"): its last component
  follows the hub's naming, so the size is its dash-separated token like
  "2.7b" or "135M" and the family is the tokens before it, four-digit
  release tokens such as "1124" dropped, lower-cased and joined ("opt",
  "olmo2", "smollm3", as transformers' model_type names them; a variant
  after the size, "SmolLM3-3B-Base", is the same family);
- otherwise `hf_config.model_type` (a randomly initialised model: demo,
  tests) gives the family.

The size is the parameter count written in the hub id, in billions; it is
unknown (NaN, shown as UNKNOWN) for a randomly initialised model or an id
without a size token. The published counts of the study's checkpoints live
in configs/models.py, which the analysis does not import (it runs
without JAX and the launch tooling), so the id's rounded size ("7B" for
OLMo 2's 7.30B) is what orders and labels models.
"""

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from analysis import schema

UNKNOWN = "unknown"

# What figures and tables print for a key of the results or the command line, as papers write it: testsets by
# their published names, correlation methods and p-value adjustments by their authors', and model families
# (the keys of `hub_id_info`). CSVs and file names keep the keys. A key missing here prints as it is: a
# declared testset, a new family, and the residualisers ("linear", "spline"), common nouns already.
DISPLAY_NAMES = {
    # testsets (oodjax/data/testsets.py), ANLI's rounds as a declared testset might name them
    "snli": "SNLI",
    "mnli": "MNLI",
    "scitail": "SciTail",
    "rte": "RTE",
    "hans": "HANS",
    "anli": "ANLI",
    "anli_r1": "ANLI R1",
    "anli_r2": "ANLI R2",
    "anli_r3": "ANLI R3",
    "wnli": "WNLI",
    "paws": "PAWS",
    schema.TRAIN_TESTSET: "training set",
    # --method and --padjust (analysis/stats.py, padjust.py)
    "pearson": "Pearson",
    "spearman": "Spearman",
    "holm": "Holm",
    "bonferroni": "Bonferroni",
    "fdr_bh": "Benjamini-Hochberg",
    "none": "unadjusted",
    # model families
    "opt": "OPT",
    "olmo2": "OLMo 2",
    "smollm2": "SmolLM2",
    "smollm3": "SmolLM3",
}

_SIZE_TOKEN = re.compile(r"(\d+(?:\.\d+)?)([mMbB])")
_RELEASE_TOKEN = re.compile(r"\d{4}")
_BILLIONS_PER_UNIT = {"m": 1e-3, "b": 1.0}
# Anything but letters, digits, dots and dashes becomes a dash in a file stem.
_UNSAFE_IN_STEM = re.compile(r"[^A-Za-z0-9.-]+")


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a figure or table needs to know of a run's model."""

    family: str
    size_billions: float  # NaN when unknown

    @property
    def size_label(self) -> str:
        """The size as papers write it ("2.7B", "135M"), or UNKNOWN."""
        if math.isnan(self.size_billions):
            return UNKNOWN
        if self.size_billions < 1.0:
            return f"{self.size_billions * 1e3:g}M"
        return f"{self.size_billions:g}B"

    @property
    def description(self) -> str:
        """Family (its display name) and size for titles and captions: "OPT 2.7B", "OLMo 2, size unknown"."""
        if math.isnan(self.size_billions):
            return f"{display_name(self.family)}, size {UNKNOWN}"
        return f"{display_name(self.family)} {self.size_label}"


def display_name(key: str) -> str:
    """What a figure or table prints for `key` (see DISPLAY_NAMES): "scitail" -> "SciTail"."""
    return DISPLAY_NAMES.get(key, key)


def model_info(config: Mapping[str, Any]) -> ModelInfo:
    """Family and size of the model a run's config names (see the module docstring)."""
    model = config.get("model") or {}
    path = str(model.get("path") or "")
    if path:
        return hub_id_info(path)
    model_type = str((model.get("hf_config") or {}).get("model_type") or "")
    return ModelInfo(model_type.lower() or UNKNOWN, math.nan)


def hub_id_info(hub_id: str) -> ModelInfo:
    """Family and size written in a hub id or checkpoint directory name."""
    tokens = [t for t in re.split(r"[-_]", hub_id.rstrip("/").rsplit("/", 1)[-1]) if t]
    sizes = [_SIZE_TOKEN.fullmatch(t) for t in tokens]
    size_at = next((i for i in reversed(range(len(sizes))) if sizes[i]), None)
    size = sizes[size_at] if size_at is not None else None
    # A variant after the size ("SmolLM3-3B-Base", "-Instruct") is the same family.
    family_tokens = tokens if size_at is None else tokens[:size_at]
    kept = [t for t in family_tokens if not _SIZE_TOKEN.fullmatch(t) and not _RELEASE_TOKEN.fullmatch(t)]
    family = "".join(kept).lower() or UNKNOWN
    if size is None:
        return ModelInfo(family, math.nan)
    return ModelInfo(family, float(size.group(1)) * _BILLIONS_PER_UNIT[size.group(2).lower()])


def slug(*parts: str) -> str:
    """A file-name-safe join of parts: letters, digits, dots and dashes within a part, parts
    joined by "_" (so "facebook/opt-2.7b", "mnli" gives "facebook-opt-2.7b_mnli")."""
    return "_".join(_UNSAFE_IN_STEM.sub("-", part).strip("-") for part in parts)


def unique_stems(keys: Iterable[tuple[str, ...]]) -> dict[tuple[str, ...], str]:
    """The slug of each key, or a ValueError naming the keys whose files would overwrite
    each other. Stems are compared case-insensitively, as macOS and Windows file systems do."""
    stems = {key: slug(*key) for key in keys}
    owners: dict[str, list[tuple[str, ...]]] = {}
    for key, stem in stems.items():
        owners.setdefault(stem.lower(), []).append(key)
    clashes = [keys for keys in owners.values() if len(keys) > 1]
    if clashes:
        described = "; ".join(" and ".join(map(repr, clash)) + f" -> {stems[clash[0]]!r}" for clash in clashes)
        raise ValueError(f"these groups would write to the same files: {described}")
    return stems
