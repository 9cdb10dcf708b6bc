"""Model family and size read off a model name, for the summary table and file names.

Names follow the hub's conventions ("opt-2.7b", "OLMo-2-1124-7B",
"SmolLM2-135M", optionally prefixed by an organisation): the size is the
dash-separated token like "2.7b" or "135M", four-digit release tokens such
as "1124" are dropped, and the rest is the family ("opt", "OLMo-2",
"SmolLM2"). A name without a size token is its own family, of unknown size.
"""

import re

_SIZE_TOKEN = re.compile(r"(\d+(?:\.\d+)?)([mMbB])")
_RELEASE_TOKEN = re.compile(r"\d{4}")
_UNIT = {"m": 1e-3, "b": 1.0}


def model_family(name: str) -> str:
    tokens = _tokens(name)
    kept = [t for t in tokens if not (_SIZE_TOKEN.fullmatch(t) or _RELEASE_TOKEN.fullmatch(t))]
    return "-".join(kept) if kept and len(kept) < len(tokens) else _short(name)


def model_size_billions(name: str) -> float:
    """Parameter count in billions, NaN when the name carries no size."""
    for token in reversed(_tokens(name)):
        match = _SIZE_TOKEN.fullmatch(token)
        if match:
            return float(match.group(1)) * _UNIT[match.group(2).lower()]
    return float("nan")


def model_size_label(name: str) -> str:
    """The size as written in papers ("2.7B", "135M"); empty when unknown."""
    for token in reversed(_tokens(name)):
        if _SIZE_TOKEN.fullmatch(token):
            return token.upper()
    return ""


def slug(*parts: str) -> str:
    """A file-name-safe join of parts (letters, digits, dots, dashes)."""
    return "_".join(re.sub(r"[^A-Za-z0-9.-]+", "-", part).strip("-") for part in parts)


def _short(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[-_]", _short(name)) if t]
