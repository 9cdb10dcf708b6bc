"""LaTeX tables (booktabs) of combined partial correlations, ready to \\input into a paper."""

import numpy as np
import pandas as pd

from analysis.aggregate import SIGNIFICANCE, UNDEFINED_IN_EVERY_RUN, lower_triangle

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

SIGNIFICANCE_NOTE = (
    "$^{*}p_{\\mathrm{adj}}<0.05$, $^{**}p_{\\mathrm{adj}}<0.01$, $^{***}p_{\\mathrm{adj}}<0.001$"
)


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIALS.get(char, char) for char in str(text))


def significance_mark(p_adj: float) -> str:
    for threshold, mark in MARKS:
        if p_adj < threshold:
            return mark
    return ""


def matrix_table(
    pairs: pd.DataFrame, testsets: list[str], *, caption: str, label: str
) -> str:
    """Lower-triangular matrix of one group's combined r, marked by adjusted p.

    `pairs` has one row per pair (columns x, y, r, p_adj, reason); `testsets`
    orders rows and columns. Undefined correlations show as an en dash, and a
    note under the table gives their reasons, so that a dash is never read as
    a zero or a typesetting slip.
    """
    r, p_adj = lower_triangle(pairs, testsets)
    rows = [
        [latex_escape(name)]
        + [_cell(r[i, j], p_adj[i, j]) for j in range(i + 1)]
        + [""] * (len(r) - i - 1)
        for i, name in enumerate(testsets[1:])
    ]
    header = [""] + [latex_escape(name) for name in testsets[:-1]]
    undefined = pairs[pairs["r"].isna()]
    reasons = dict.fromkeys(
        reason.removeprefix(UNDEFINED_IN_EVERY_RUN) for reason in undefined["reason"]
    )
    if np.isnan(r[np.tril_indices(len(r))]).sum() > len(undefined):
        reasons["no run evaluated both testsets"] = None
    note = "-- undefined in every run: " + "; ".join(map(latex_escape, reasons)) + "."
    return _table(caption, label, "l" + "r" * len(r), header, rows, note if reasons else "")


def summary_table(summary: pd.DataFrame, *, caption: str, label: str) -> str:
    """Mean partial correlation by model family, size and training set, families apart."""
    header = ["Family", "Size", "Train", "Runs", "Pairs", "Mean $r$", "Mean $|r|$",
              r"Sig.\ $+/-$"]
    rows = []
    for previous, row in zip([None, *summary["family"]], summary.itertuples()):
        if previous is not None and row.family != previous:
            rows.append(None)
        rows.append([
            latex_escape(row.family),
            latex_escape(row.size),
            latex_escape(row.train_set),
            str(row.n_runs),
            str(row.n_pairs),
            _number(row.mean_r),
            _number(row.mean_abs_r),
            f"{row.n_sig_positive}/{row.n_sig_negative}",
        ])
    note = (
        "-- no pair of testsets has a partial correlation in any run; "
        "the CSV of partial correlations gives each pair's reason."
        if summary["mean_r"].isna().any() else ""
    )
    return _table(caption, label, "lll" + "r" * 5, header, rows, note)


def standalone_document(table_files: list[str]) -> str:
    """A document that \\inputs every table, to check they compile and to preview them."""
    body = "\n".join(rf"\input{{{name}}}" for name in table_files)
    return "\n".join(
        [
            r"\documentclass{article}",
            r"\usepackage[margin=2cm]{geometry}",
            r"\usepackage{booktabs}",
            r"\begin{document}",
            body,
            r"\end{document}",
            "",
        ]
    )


def _table(
    caption: str, label: str, columns: str, header: list[str], rows: list[list[str] | None],
    note: str = "",
) -> str:
    """A booktabs table float; a None row is a gap (\\addlinespace) between blocks; a
    `note` (LaTeX) is set in small type under the rule."""
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        r"\small",
        rf"\caption{{{caption}}}",
        rf"\label{{{label}}}",
        rf"\begin{{tabular}}{{{columns}}}",
        r"\toprule",
        " & ".join(header) + r" \\",
        r"\midrule",
        *(r"\addlinespace" if row is None else " & ".join(row) + r" \\" for row in rows),
        r"\bottomrule",
        r"\end{tabular}",
        *([r"\par\smallskip{\footnotesize " + note + "}"] if note else []),
        r"\end{table}",
        "",
    ]
    return "\n".join(lines)


def _cell(r: float, p_adj: float) -> str:
    if np.isnan(r):
        return "--"
    mark = significance_mark(p_adj) if not np.isnan(p_adj) else ""
    superscript = f"^{{{mark}}}" if mark else ""
    return f"${r:.2f}{superscript}$"


def _number(value: float) -> str:
    return "--" if np.isnan(value) else f"${value:.2f}$"
