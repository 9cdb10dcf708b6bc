"""LaTeX tables (booktabs) of combined partial correlations, ready to \\input into a paper.

Testsets, training sets, families and methods are printed by their display names
(naming.DISPLAY_NAMES). A correlation with significance marks takes two columns, `r@{}l`
(MARKED_COLUMNS): the number right-aligned, its marks left-aligned after it, so that the
decimal points of a column line up whatever marks follow them; this needs no package
beyond booktabs (siunitx, the usual alternative, is not in texlive-latex-recommended).
"""

from collections.abc import Sequence

import numpy as np
import pandas as pd

from analysis.aggregate import SIGNIFICANCE, UNDEFINED_IN_EVERY_RUN, lower_triangle
from analysis.meta import TREND_MARGIN
from analysis.naming import display_name
from analysis.sensitivity import CHANGES, SENSITIVE

_LATEX_SPECIALS = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}

# Significance marks by adjusted p-value, strictest first.
MARKS = ((0.001, "***"), (0.01, "**"), (SIGNIFICANCE, "*"))

SIGNIFICANCE_NOTE = "$^{*}p_{\\mathrm{adj}}<0.05$, $^{**}p_{\\mathrm{adj}}<0.01$, $^{***}p_{\\mathrm{adj}}<0.001$"
# The summary's counts of significant pairs, read as a comparison of models, would be the
# significant-versus-not-significant fallacy: its caption says where such claims rest.
COUNTS_ARE_NOT_COMPARISONS = (
    "Counts of significant pairs do not compare models: a claim that models differ rests on the "
    "meta-analysis across models (Welch's test of equal means, $\\tau^2$, $I^2$), not on these counts."
)
# Marks a result whose sign or significance differs under the other residualiser.
SENSITIVE_MARK = r"\dagger"
# Marks a combined r without a test across runs: fewer than two runs define it, or all have the same r.
UNTESTED_MARK = r"\circ"
UNTESTED_NOTE = "fewer than two runs with an $r$ (or the same $r$ in each): no test across runs"
# The Trend column of the meta-analysis table: what the pooled / prediction interval says (meta.trend).
TREND_MARKS = {"positive": "$+$", "negative": "$-$", "none": "0", "undetermined": "?"}
TREND_NOTE = (
    f"Trend: pooled / new model, $+$ or $-$ where the 95\\% interval excludes 0, 0 where it lies within "
    f"$\\pm {TREND_MARGIN}$ (no trend), ? otherwise; a pair without a trend is one whose interval excludes "
    f"$|r| \\geq {TREND_MARGIN}$, never one that is not significant. $Q$ is descriptive."
)
# The column pair of a marked correlation (see the module docstring), and what spans it.
MARKED_COLUMNS = "r@{}l"


def sensitivity_note(other_residualiser: str) -> str:
    """What the dagger means, for the note under a table."""
    return (
        f"${SENSITIVE_MARK}$ sign or significance differs under the "
        f"{_name(other_residualiser)} residualiser (or $r$ is defined under one only)."
    )


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIALS.get(char, char) for char in str(text))


def runs_per_cell(pairs: pd.DataFrame) -> tuple[str, float]:
    """How many runs the defined cells of one group's `pairs` rest on, in words ("each cell the
    mean of 2 runs", or "of 1 to 2 runs, its count in parentheses where fewer than 2"), and the
    count below which a cell prints its own (0: none does)."""
    counts = pairs.loc[pairs["r"].notna(), "n_runs"]
    if counts.empty:
        return "no cell defined", 0
    low, high = int(counts.min()), int(counts.max())
    if low == high:
        return f"each cell the mean of {high} run{'s' * (high != 1)}", 0
    return f"each cell the mean of {low} to {high} runs, its count in parentheses where fewer than {high}", high


def significance_mark(p_adj: float) -> str:
    for threshold, mark in MARKS:
        if p_adj < threshold:
            return mark
    return ""


def matrix_table(
    pairs: pd.DataFrame,
    testsets: list[str],
    *,
    caption: str,
    label: str,
    other_residualiser: str,
) -> str:
    """Lower-triangular matrix of one group's combined r, marked by adjusted p.

    `pairs` has one row per pair (columns x, y, r, p_adj, reason and
    SENSITIVE); `testsets` orders rows and columns. Undefined correlations
    show as an en dash, and a note under the table gives their reasons, so
    that a dash is never read as a zero or a typesetting slip. A dagger marks
    pairs whose result changes under `other_residualiser`.
    """
    r, p_adj, sensitive, runs = lower_triangle(pairs, testsets, ("r", "p_adj", SENSITIVE, "n_runs"))
    _, counted_below = runs_per_cell(pairs)
    rows = [
        [_name(name)]
        + [
            cell
            for j in range(i + 1)
            for cell in _cell(r[i, j], p_adj[i, j], sensitive[i, j] == 1, runs=runs[i, j], counted_below=counted_below)
        ]
        + [""] * 2 * (len(r) - i - 1)
        for i, name in enumerate(testsets[1:])
    ]
    header = [""] + [_spanning(_name(name)) for name in testsets[:-1]]
    undefined = pairs[pairs["r"].isna()]
    reasons = dict.fromkeys(reason.removeprefix(UNDEFINED_IN_EVERY_RUN) for reason in undefined["reason"])
    if np.isnan(r[np.tril_indices(len(r))]).sum() > len(undefined):
        reasons["no run evaluated both testsets"] = None
    untested = pairs["r"].notna() & pairs["p_adj"].isna()
    notes = [
        "-- undefined in every run: " + "; ".join(map(latex_escape, reasons)) + "." if reasons else "",
        f"${UNTESTED_MARK}$ {UNTESTED_NOTE}." if untested.any() else "",
        sensitivity_note(other_residualiser) if pairs[SENSITIVE].any() else "",
    ]
    return _table(caption, label, "l" + MARKED_COLUMNS * len(r), [_row(header)], rows, " ".join(filter(None, notes)))


def meta_analysis_table(pooled: pd.DataFrame, *, other_residualiser: str, caption: str, label: str) -> str:
    """One scope's random-effects meta-analysis across models, one row per pair.

    `pooled` holds meta.meta_analyse's pooled rows joined with their
    comparison (sensitivity.compare_residualisers): the pooled r marked by
    adjusted p and by a dagger where it changes under `other_residualiser`,
    its HKSJ interval, the prediction interval for a new model, what they say of
    a trend (pooled / new model, meta.trend), tau^2 (Fisher z scale), I^2,
    Welch's bootstrap p adjusted across the scope's pairs, Q as a description
    only (its chi^2 p runs high with estimated variances), the models
    agreeing in sign, and the pooled r under the other residualiser.
    """
    header = [
        "Pair",
        "$k$",
        _spanning("$r$"),
        r"95\% CI",
        r"95\% PI",
        "Trend",
        r"$\tau^2$",
        "$I^2$",
        r"$p^{\mathrm{adj}}_{\mathrm{Welch}}$",
        "$Q$",
        "Agree",
        _spanning(f"$r$ ({_name(other_residualiser)})"),
    ]
    rows = [
        [
            f"{_name(row.x)}--{_name(row.y)}",
            str(row.k),
            *_cell(row.r, row.p_adj, getattr(row, SENSITIVE)),
            _interval(row.ci_low, row.ci_high),
            _interval(row.pi_low, row.pi_high),
            f"{TREND_MARKS[row.trend]}/{TREND_MARKS[row.trend_new_model]}",
            _number(row.tau2, 3),
            "--" if np.isnan(row.i2) else f"${100 * row.i2:.0f}\\%$",
            _pvalue(row.welch_p_adj),
            _number(row.q, 1),
            "--" if np.isnan(row.r) else f"{row.n_agree:.0f}/{row.k}",
            *_cell(getattr(row, f"r_{other_residualiser}"), getattr(row, f"p_adj_{other_residualiser}"), False),
        ]
        for row in pooled.itertuples()
    ]
    reasons = dict.fromkeys(reason for reason in pooled["reason"] if reason)
    notes = [
        TREND_NOTE,
        "-- " + "; ".join(map(latex_escape, reasons)) + "." if reasons else "",
        sensitivity_note(other_residualiser) if pooled[SENSITIVE].any() else "",
    ]
    columns = "lr" + MARKED_COLUMNS + "rrc" + "r" * 5 + MARKED_COLUMNS
    return _table(
        caption,
        label,
        columns,
        [_row(header)],
        rows,
        " ".join(filter(None, notes)),
        font=r"\footnotesize\setlength{\tabcolsep}{4pt}",
    )


def sensitivity_table(
    blocks: Sequence[tuple[Sequence[str], pd.DataFrame]],
    residualisers: Sequence[str],
    *,
    caption: str,
    label: str,
) -> str:
    """How many pairs change between the two residualisers, in blocks of rows (per model
    and training set; per scope of the meta-analysis). Each block is its rows' labels and
    sensitivity.summarise_changes' rows, with the training set or scope as train_set."""
    first, second = map(_name, residualisers)
    header_lines = [
        _row(
            [
                "",
                "",
                "",
                r"\multicolumn{2}{c}{Mean $r$}",
                r"\multicolumn{2}{c}{Sig.\ $+/-$}",
                r"\multicolumn{3}{c}{Pairs that change}",
            ]
        ),
        r"\cmidrule(lr){4-5} \cmidrule(lr){6-7} \cmidrule(lr){8-10}",
        _row(["", "Train", "Pairs", first, second, first, second, "sign", "sig.", "defined"]),
    ]
    rows: list[list[str] | None] = []
    for labels, changes in blocks:
        rows += [None] if rows else []
        rows += [
            [latex_escape(name), _name(row["train_set"]), str(row["n_pairs"])]
            + [_number(row[f"mean_r_{r}"]) for r in residualisers]
            + [f"{row[f'n_sig_positive_{r}']}/{row[f'n_sig_negative_{r}']}" for r in residualisers]
            + [str(row[change]) for change in CHANGES]
            for name, row in zip(labels, changes.to_dict("records"))
        ]
    return _table(caption, label, "ll" + "r" * 8, header_lines, rows)


def summary_table(summary: pd.DataFrame, *, caption: str, label: str) -> str:
    """Mean partial correlation by model family, size and training set, families apart."""
    header = ["Family", "Size", "Train", "Runs", "Pairs", "Mean $r$", "Mean $|r|$", r"Sig.\ $+/-$"]
    rows = []
    for previous, row in zip([None, *summary["family"]], summary.itertuples()):
        if previous is not None and row.family != previous:
            rows.append(None)
        rows.append(
            [
                _name(row.family),
                latex_escape(row.size),
                _name(row.train_set),
                str(row.n_runs),
                str(row.n_pairs),
                _number(row.mean_r),
                _number(row.mean_abs_r),
                f"{row.n_sig_positive}/{row.n_sig_negative}",
            ]
        )
    note = (
        "-- no pair of testsets has a partial correlation in any run; "
        "the CSV of partial correlations gives each pair's reason."
        if summary["mean_r"].isna().any()
        else ""
    )
    return _table(caption, label, "lll" + "r" * 5, [_row(header)], rows, note)


def shots_table(
    summary: pd.DataFrame, shots: pd.DataFrame, shot_tests: pd.DataFrame, *, caption: str, label: str
) -> str:
    """summary_table's mean r beside the same mean per shot count (sensitivity.by_shot_count's rows),
    one row per model and training set in the summary's order, families apart, and the pairs whose
    within-model test finds a shot effect (adjusted p < SIGNIFICANCE) of those tested
    (sensitivity.shot_counts' rows): a mean over pairs hides an effect that flips between pairs."""
    counts = sorted(shots["shots"].unique())
    by_key = shots.set_index(["model", "train_set", "shots"])["mean_r"]
    tested = shot_tests.drop_duplicates(["model", "train_set", "x", "y"]).dropna(subset=["shot_p_adj"])
    found = tested.groupby(["model", "train_set"])["shot_p_adj"].agg(lambda p: f"{(p < SIGNIFICANCE).sum()}/{p.size}")
    header = ["Family", "Size", "Train", "All", *(f"{count} shots" for count in counts), "Shot effect"]
    rows = []
    for previous, row in zip([None, *summary["family"]], summary.itertuples()):
        if previous is not None and row.family != previous:
            rows.append(None)
        per_count = [by_key.get((row.model, row.train_set, count), np.nan) for count in counts]
        rows.append(
            [_name(row.family), latex_escape(row.size), _name(row.train_set), _number(row.mean_r)]
            + [_number(value) for value in per_count]
            + [found.get((row.model, row.train_set), "--")]
        )
    return _table(caption, label, "lll" + "r" * (2 + len(counts)), [_row(header)], rows)


def standalone_document(table_files: list[str], assumptions: str = "") -> str:
    """A document that \\inputs every table, to check they compile and to preview them, after a
    paragraph stating the `assumptions` (LaTeX) the results rest on."""
    body = "\n".join(rf"\input{{{name}}}" for name in table_files)
    return "\n".join(
        [
            r"\documentclass{article}",
            r"\usepackage[margin=2cm]{geometry}",
            r"\usepackage{booktabs}",
            r"\begin{document}",
            *([r"\paragraph{Assumptions.} " + assumptions, ""] if assumptions else []),
            body,
            r"\end{document}",
            "",
        ]
    )


def _table(
    caption: str,
    label: str,
    columns: str,
    header_lines: list[str],
    rows: list[list[str] | None],
    note: str = "",
    font: str = r"\small",
) -> str:
    """A booktabs table float; `header_lines` are LaTeX lines above the mid rule (see _row);
    a None row is a gap (\\addlinespace) between blocks; a `note` (LaTeX) is set in small
    type under the rule; `font` sizes the table (a wide one needs \\footnotesize, and gaps
    between columns narrower than \\tabcolsep's 6pt, to fit)."""
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        font,
        rf"\caption{{{caption}}}",
        rf"\label{{{label}}}",
        rf"\begin{{tabular}}{{{columns}}}",
        r"\toprule",
        *header_lines,
        r"\midrule",
        *(r"\addlinespace" if row is None else _row(row) for row in rows),
        r"\bottomrule",
        r"\end{tabular}",
        *([r"\par\smallskip{\footnotesize " + note + "}"] if note else []),
        r"\end{table}",
        "",
    ]
    return "\n".join(lines)


def _row(cells: list[str]) -> str:
    return " & ".join(cells) + r" \\"


def _name(key: str) -> str:
    """A key's display name, escaped for LaTeX."""
    return latex_escape(display_name(key))


def _spanning(text: str) -> str:
    """A header or an en dash over both columns of a marked correlation."""
    return rf"\multicolumn{{2}}{{c}}{{{text}}}"


def _cell(r: float, p_adj: float, sensitive: bool, *, runs: float = np.nan, counted_below: float = 0) -> list[str]:
    """The two cells (MARKED_COLUMNS) of r: r to two decimals, then its significance marks
    (UNTESTED_MARK where `runs` is given and p_adj is not), a dagger if `sensitive`, and
    `runs` in parentheses when fewer than `counted_below`; one en dash over both when r is undefined."""
    if np.isnan(r):
        return [_spanning("--")]
    untested = not np.isnan(runs) and np.isnan(p_adj)
    marks = (
        (significance_mark(p_adj) if not np.isnan(p_adj) else "")
        + (UNTESTED_MARK if untested else "")
        + (SENSITIVE_MARK if sensitive else "")
    )
    count = rf"\,({runs:.0f})" if runs < counted_below else ""
    return [f"${r:.2f}$", (f"$^{{{marks}}}$" if marks else "") + count]


def _interval(low: float, high: float) -> str:
    return "--" if np.isnan(low) else f"$[{low:.2f}, {high:.2f}]$"


def _pvalue(p: float) -> str:
    if np.isnan(p):
        return "--"
    return "$<0.001$" if p < 0.001 else f"${p:.3f}$"


def _number(value: float, decimals: int = 2) -> str:
    return "--" if np.isnan(value) else f"${value:.{decimals}f}$"
