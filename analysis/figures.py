"""Figures for a paper (matplotlib, Agg): correlation heatmaps, accuracy curves, OOD vs
in-domain, the models side by side (heatmaps by family and size, mean r against size); the
forest plots of the meta-analysis across models are ``forest``'s, in this module's style.

Each figure is written as PDF (vector, fonts embedded as TrueType so
journals accept it) and PNG (for a quick look). Colours are safe for the
common colour-vision deficiencies (Okabe-Ito lines, a red-blue diverging map
for correlations), and every figure carries a note of what it rests on
(correlation method, residualiser, runs and steps), so that it cannot be
read apart from how it was made. Panels that compare share their ranges,
chance is each testset's majority-class rate, marks have a key, and
testsets, methods and families go by their display names
(naming.DISPLAY_NAMES).
"""

import itertools
import pathlib
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.image  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import scipy.stats  # noqa: E402

from analysis.aggregate import lower_triangle  # noqa: E402
from analysis.naming import ModelInfo, display_name  # noqa: E402
from analysis.residualise import fit  # noqa: E402
from analysis.runs import RunRecord  # noqa: E402
from analysis.sensitivity import SENSITIVE  # noqa: E402
from analysis.stats import probit_transform  # noqa: E402
from analysis.tables import MARKS, runs_per_cell, significance_mark  # noqa: E402

# Okabe & Ito's palette, safe for the common colour-vision deficiencies, in an
# order whose first colours stay apart in greyscale too; its yellow, faint on
# white, comes last.
OKABE_ITO = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")
PAPER_STYLE = {
    "font.size": 8,
    "figure.titlesize": 9,  # headings (`heading`)
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "legend.fontsize": 7,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.prop_cycle": matplotlib.cycler(color=OKABE_ITO),
    "pdf.fonttype": 42,
}
PNG_DPI = 150
# Diverging and symmetric about 0, readable with red-green colour blindness.
DIVERGING_MAP = "RdBu_r"
PANEL_COLUMNS = 4
# Accuracy of always answering a testset's majority class (aggregate.majority_class_rates), drawn dashed.
CHANCE_STYLE = {"color": "0.5", "lw": 0.7, "ls": "--"}
CHANCE_LABEL = "chance (majority class)"
# Significance marks in the heatmaps without numbers: as large as the tick labels, to be read in print.
MARK_SIZE = 8
# A heatmap's figure, in inches: wide enough for the key to its marks, high enough for that key and
# for its heading, a line of which takes the heading's 9 pt with line spacing.
HEATMAP_MIN_WIDTH = 3.2
HEATMAP_KEY_HEIGHT = 0.45
TITLE_LINE_HEIGHT = 0.16
DAGGER = "\u2020"  # marks a result that changes under the other residualiser
MINUS = "\u2212"  # a minus sign, not the shorter hyphen
UNTESTED = "\u00b0"  # marks an r without a test across runs (tables.UNTESTED_NOTE)
_BILLIONS = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}B")


def save(fig: plt.Figure, stem: pathlib.Path) -> list[pathlib.Path]:
    """Write `stem`.pdf and `stem`.png and close the figure.

    The suffixes are appended, never substituted: stems hold model names with
    dots ("heatmap_opt2.7_mnli"), which `with_suffix` would cut.
    """
    paths = [stem.with_name(f"{stem.name}.pdf"), stem.with_name(f"{stem.name}.png")]
    with plt.rc_context(PAPER_STYLE):
        fig.savefig(paths[0])
        fig.set_layout_engine("none")  # keep the layout just computed: solving it is slow
        fig.savefig(paths[1], dpi=PNG_DPI)
    plt.close(fig)
    return paths


def correlation_heatmap(pairs: pd.DataFrame, testsets: list[str], *, padjust: str, title: str, note: str) -> plt.Figure:
    """Lower triangle of combined r (rows testsets[1:], columns testsets[:-1]).

    Diverging map centred at 0 with limits -1 and 1; each cell shows r, its
    significance marks (p adjusted by `padjust`, explained under the
    triangle), a dagger where the result changes under the other
    residualiser (column SENSITIVE), UNTESTED where no test across runs
    exists, and its run count where it rests on fewer runs than others
    (`tables.runs_per_cell`, said in the note); undefined cells are grey.
    `note` (what the numbers rest on) is printed under the title.
    """
    values, p_adj, sensitive, runs = lower_triangle(pairs, testsets, ("r", "p_adj", SENSITIVE, "n_runs"))
    per_cell, counted_below = runs_per_cell(pairs)
    note = f"{note}; {per_cell}"
    size = len(values)
    with plt.rc_context(PAPER_STYLE):
        side = 0.9 + 0.5 * size
        fig, ax = plt.subplots(figsize=(max(side + 0.9, HEATMAP_MIN_WIDTH), side), layout="constrained")
        top = heading(fig, title, note)
        # The triangle, and above and below it the heading's lines and the key to the marks:
        # a figure as small as one cell would otherwise have no room left for the cell.
        fig.set_figheight(side + HEATMAP_KEY_HEIGHT + TITLE_LINE_HEIGHT * (top.count("\n") + 1))
        image = _draw_triangle(
            ax, values, p_adj, testsets, annotate=True, sensitive=sensitive, runs=runs, counted_below=counted_below
        )
        _colourbar(fig, image, ax)
        _significance_legend(fig, padjust, untested=_untested(values, p_adj).any())
        fig.suptitle(top)  # centred on the figure: the axes' own title could run off its edge
    return fig


def comparison_heatmaps(
    groups: Sequence[tuple[str, pd.DataFrame, list[str]]],
    models: Mapping[str, ModelInfo],
    *,
    padjust: str,
    title: str,
    note: str,
) -> plt.Figure:
    """The models side by side for one training set: one row per family, its sizes in
    increasing order left to right, each panel the model's lower triangle of combined r.

    `groups` holds (model, pairs, testsets) per model, in the order rows
    and columns should follow. Panels carry colours and significance marks
    (p adjusted by `padjust`, explained under the panels) but no numbers,
    which would be unreadable at this size; the per-model heatmaps have them.
    """
    families = list(dict.fromkeys(models[model].family for model, _, _ in groups))
    rows = [[g for g in groups if models[g[0]].family == family] for family in families]
    columns = max(len(row) for row in rows)
    with plt.rc_context(PAPER_STYLE):
        fig, axes = plt.subplots(
            len(rows),
            columns,
            figsize=(2.2 * columns + 1.0, 2.2 * len(rows) + 1.0),
            squeeze=False,
            layout="constrained",
        )
        image, untested = None, False
        for row, row_axes in zip(rows, axes):
            for ax in row_axes[len(row) :]:
                ax.set_visible(False)
            for ax, (model, pairs, testsets) in zip(row_axes, row):
                values, p_adj = lower_triangle(pairs, testsets)
                image = _draw_triangle(ax, values, p_adj, testsets, annotate=False)
                untested |= _untested(values, p_adj).any()
                ax.set_title(f"{models[model].description}\n({model})")  # one line is wider than a panel
        fig.suptitle(heading(fig, title, note))
        _colourbar(fig, image, axes.ravel().tolist())
        _significance_legend(fig, padjust, untested=untested)
    return fig


def correlation_by_size(summary: pd.DataFrame, per_run: pd.DataFrame, *, title: str, note: str) -> plt.Figure | None:
    """Mean partial correlation over testset pairs against model size, one line per family,
    one panel per training set; dots are single runs, showing the spread across runs.

    `summary` is `summarise_by_model`'s table, `per_run` is `run_means`'s.
    Models of unknown size cannot be placed and are left out (the figure
    says how many); None when no model has a known size.
    """
    known = summary[summary["size_billions"].notna()]
    if known.empty:
        return None
    train_sets = list(dict.fromkeys(summary["train_set"]))
    colours = dict(zip(dict.fromkeys(known["family"]), itertools.cycle(OKABE_ITO)))
    with plt.rc_context(PAPER_STYLE):
        fig, axes = plt.subplots(
            1,
            len(train_sets),
            figsize=(3.0 * len(train_sets) + 0.6, 2.9),
            sharey=True,
            squeeze=False,
            layout="constrained",
        )
        for ax, train_set in zip(axes[0], train_sets):
            rows = known[known["train_set"] == train_set]
            for family, lines in rows.groupby("family", sort=False):
                lines = lines.sort_values("size_billions")
                ax.plot(
                    lines["size_billions"],
                    lines["mean_r"],
                    color=colours[family],
                    marker="o",
                    ms=4,
                    lw=1.2,
                    label=display_name(family),
                )
                runs = per_run.merge(lines[["model", "train_set", "size_billions"]], on=["model", "train_set"])
                ax.scatter(runs["size_billions"], runs["mean_r"], color=colours[family], s=8, alpha=0.45, lw=0)
            ax.axhline(0.0, color="0.6", lw=0.6)
            ax.set_xscale("log")
            ax.set_xlim(known["size_billions"].min() / 1.4, known["size_billions"].max() * 1.4)
            # 1-2-3-5 ticks: the study's sizes sit close together on a log axis
            # (2.7B and 3B, 30B and 32B), so ticks at the sizes would overlap.
            ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
            ax.xaxis.set_major_formatter(_BILLIONS)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_title(f"trained on {display_name(train_set)}")
            ax.set_xlabel("parameters")
        axes[0, 0].set_ylabel("mean partial $r$ over pairs")
        left_out = summary["size_billions"].isna().sum()
        unplaced = f"; {left_out} model(s) of unknown size not shown" if left_out else ""
        fig.legend(
            *axes[0, 0].get_legend_handles_labels(),
            loc="outside lower center",
            ncols=len(colours) + 1,
            frameon=False,
            title="lines: all runs combined; dots: single runs",
        )
        fig.suptitle(heading(fig, title, note + unplaced))
    return fig


def accuracy_curves(
    runs: list[RunRecord],
    *,
    chance: Mapping[str, Sequence[float]],
    title: str,
    note: str,
    ylim: tuple[float, float] | None = None,
) -> plt.Figure:
    """Accuracy over steps, one panel per testset, one line per shot count.

    Lines are the mean over seeds; bands span the lowest to highest seed; a
    dashed line marks each of the testset's `chance` accuracies
    (aggregate.majority_class_rates). Every panel has the same y-range, so
    that testsets compare: `ylim`, so that figures of different models
    compare too, or when None one range that fits every panel. A testset
    without any accuracy keeps its (empty) panel, so that the gap shows.
    """
    testsets = list(dict.fromkeys(t for run in runs for t in run.accuracy.columns))
    colours = _shot_colours(runs)
    with plt.rc_context(PAPER_STYLE):
        fig, axes = _panel_grid(len(testsets))
        for ax, testset in zip(axes, testsets):
            for rate in chance.get(testset, ()):
                ax.axhline(rate, **CHANCE_STYLE)
            for shot, colour in colours.items():
                seeds = [r.accuracy[testset] for r in runs if r.shots == shot and testset in r.accuracy]
                if not seeds:
                    continue
                curves = pd.concat(seeds, axis=1)
                steps = curves.index.to_numpy()
                ax.plot(steps, curves.mean(axis=1), color=colour, lw=1.2, label=f"{shot} shots")
                ax.fill_between(steps, curves.min(axis=1), curves.max(axis=1), color=colour, alpha=0.2, lw=0)
            in_domain = any(testset == run.in_domain for run in runs)
            ax.set_title(f"{display_name(testset)} (in-domain)" if in_domain else display_name(testset))
        if ylim is not None:
            axes[0].set_ylim(ylim)  # shared by every panel
        axes[0].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(nbins=4, integer=True))
        _label_lowest(axes, "step")
        fig.supylabel("accuracy")
        chance_drawn = any(chance.get(testset) for testset in testsets)
        _shots_legend(fig, colours, chance=chance_drawn, title="mean over seeds; band: min to max", lw=1.2)
        fig.suptitle(heading(fig, title, note))
    return fig


def ood_vs_in_domain(
    runs: list[RunRecord],
    *,
    chance: Mapping[str, Sequence[float]],
    residualiser: str,
    probit: bool,
    title: str,
    note: str,
) -> plt.Figure:
    """OOD accuracy against in-domain accuracy, one panel per OOD testset, all on the same axes' ranges.

    Points are evaluation steps, coloured by shot count; each run's
    residualiser fit is drawn over its range (fitted on the probit scale when
    `probit`, mapped back to accuracies). For Pearson correlations of levels
    the residuals are the vertical distances to these curves; with ranks or
    first differences the picture still shows levels. Dashed lines mark the
    `chance` accuracies (aggregate.majority_class_rates) of the OOD testset
    (horizontal) and of the in-domain one (vertical).
    """
    testsets = list(dict.fromkeys(t for run in runs for t in run.ood_testsets))
    in_domain = runs[0].in_domain  # the group's training set
    colours = _shot_colours(runs)
    with plt.rc_context(PAPER_STYLE):
        fig, axes = _panel_grid(len(testsets))
        for ax, testset in zip(axes, testsets):
            for rate in chance.get(testset, ()):
                ax.axhline(rate, **CHANCE_STYLE)
            for rate in chance.get(in_domain, ()):
                ax.axvline(rate, **CHANCE_STYLE)
            for run in runs:
                if testset not in run.accuracy:
                    continue
                points = run.accuracy[[run.in_domain, testset]].dropna().to_numpy()
                colour = colours[run.shots]
                ax.scatter(points[:, 0], points[:, 1], s=6, color=colour, alpha=0.6, lw=0)
                _draw_fit(ax, points, residualiser=residualiser, probit=probit, colour=colour)
            ax.set_title(display_name(testset))
        # Two lines: one would be wider than a panel and run into the next one or off the figure.
        _label_lowest(axes, f"{display_name(in_domain)} accuracy\n(in-domain)")
        fig.supylabel("OOD accuracy")
        key = f"one curve per run: {display_name(residualiser)} fit" + (" on the probit scale" if probit else "")
        chance_drawn = any(chance.get(testset) for testset in [in_domain, *testsets])
        _shots_legend(fig, colours, chance=chance_drawn, title=key, marker="o", ms=3, lw=1)
        fig.suptitle(heading(fig, title, note))
    return fig


def _draw_fit(ax, points: np.ndarray, *, residualiser: str, probit: bool, colour) -> None:
    """Draw the residualiser's curve through one run's points, if it can be fitted."""
    if len(points) < 2:  # a testset without accuracies at these steps: nothing to fit
        return
    if probit:
        covar = probit_transform(points[:, 0], "in-domain")
        target = probit_transform(points[:, 1], "ood")
    else:
        covar, target = points[:, 0], points[:, 1]
    try:
        fitted = fit(covar, target, residualiser)
    except ValueError:  # too few distinct in-domain values for this residualiser
        return
    grid = np.linspace(covar.min(), covar.max(), 100)
    curve = fitted.predict(grid)
    if probit:
        grid, curve = scipy.stats.norm.cdf(grid), scipy.stats.norm.cdf(curve)
    ax.plot(grid, curve, color=colour, lw=0.8, alpha=0.8)


def _draw_triangle(
    ax: plt.Axes,
    values: np.ndarray,
    p_adj: np.ndarray,
    testsets: list[str],
    *,
    annotate: bool,
    sensitive: np.ndarray | None = None,
    runs: np.ndarray | None = None,
    counted_below: float = 0,
) -> matplotlib.image.AxesImage:
    """One lower triangle of r on `ax`: undefined cells grey ("n/a" when annotated); with
    `annotate` each cell shows r and its marks (a dagger where `sensitive` is 1) and, where
    `runs` is below `counted_below`, its run count in parentheses; without it only marks.
    A defined r without a test (no p) is marked UNTESTED."""
    size = len(values)
    sensitive = np.zeros_like(values) if sensitive is None else sensitive
    runs = np.full_like(values, np.inf) if runs is None else runs
    image = ax.imshow(values, cmap=DIVERGING_MAP, vmin=-1.0, vmax=1.0)
    for i, j in zip(*np.tril_indices(size)):
        if np.isnan(values[i, j]):
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, color="0.85"))
            if annotate:
                ax.text(j, i, "n/a", ha="center", va="center", color="0.4", fontsize=6)
            continue
        mark = UNTESTED if np.isnan(p_adj[i, j]) else significance_mark(p_adj[i, j])
        if annotate and sensitive[i, j] == 1:
            mark += DAGGER
        if annotate and runs[i, j] < counted_below:
            mark += f"({runs[i, j]:.0f})"
        number = f"{values[i, j]:.2f}".replace("-", MINUS)
        text = f"{number}\n{mark}".strip() if annotate else mark
        ax.text(
            j,
            i,
            text,
            ha="center",
            va="center",
            fontsize=6.5 if annotate else MARK_SIZE,
            color="white" if abs(values[i, j]) > 0.6 else "black",
            linespacing=0.9,
        )
    ax.set_xticks(range(size), map(display_name, testsets[:-1]), rotation=45, ha="right")
    ax.set_yticks(range(size), map(display_name, testsets[1:]))
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    return image


def _colourbar(fig: plt.Figure, image: matplotlib.image.AxesImage, ax) -> None:
    colourbar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, ticks=[-1, -0.5, 0, 0.5, 1])
    colourbar.set_label("partial correlation $r$")
    colourbar.outline.set_visible(False)


def _untested(values: np.ndarray, p_adj: np.ndarray) -> np.ndarray:
    """Cells with an r but no test across runs."""
    return ~np.isnan(values) & np.isnan(p_adj)


def _significance_legend(fig: plt.Figure, padjust: str, *, untested: bool) -> None:
    """What the heatmaps' marks mean (tables.MARKS, and UNTESTED when a cell has it), as a legend under the panels."""
    blank = plt.Line2D([], [], lw=0)
    labels = [f"{mark} p < {threshold:g}" for threshold, mark in reversed(MARKS)]
    labels += [f"{UNTESTED} no test across runs"] * int(untested)
    adjusted = "unadjusted" if padjust == "none" else f"{display_name(padjust)}-adjusted"
    fig.legend(
        [blank] * len(labels),
        labels,
        loc="outside lower center",
        ncols=len(labels),
        frameon=False,
        handlelength=0,
        handletextpad=0,
        columnspacing=1.5,
        title=f"marks: {adjusted} p-values",
    )


def _shots_legend(fig: plt.Figure, colours: dict[int, str], *, chance: bool, title: str, **line: Any) -> None:
    """The legend under the panels: a line drawn as ``line`` per shot count, after the chance line's when
    ``chance`` (the figure draws one)."""
    handles = [plt.Line2D([], [], color=colour, **line) for colour in colours.values()]
    labels = [f"{shot} shots" for shot in colours]
    if chance:
        handles, labels = [plt.Line2D([], [], **CHANCE_STYLE), *handles], [CHANCE_LABEL, *labels]
    fig.legend(handles, labels, loc="outside lower center", ncols=len(handles), frameon=False, title=title)


def _shot_colours(runs: list[RunRecord]) -> dict[int, str]:
    """One Okabe-Ito colour per shot count, the same in every figure of a group."""
    return dict(zip(sorted({run.shots for run in runs}), itertools.cycle(OKABE_ITO)))


def heading(fig: plt.Figure, title: str, note: str) -> str:
    """Title and note, each wrapped to the figure's width: a note longer than a small
    figure is wide would be cut off at its edges."""
    return "\n".join(wrap(fig, line, PAPER_STYLE["figure.titlesize"]) for line in (title, note))


def wrap(fig: plt.Figure, text: str, points: float) -> str:
    """`text` in lines as wide as the figure at a font size of `points` (a character is
    about 0.6 of it wide)."""
    characters = int(fig.get_figwidth() * 72 / (0.6 * points))
    return textwrap.fill(text, max(characters, 20))


def _label_lowest(axes: list[plt.Axes], label: str) -> None:
    """Label the x-axis of the lowest panel of each column, and show its tick labels, which
    shared axes hide above the last row (a figure-wide label would collide with a legend below
    the panels, which constrained layout does not stack)."""
    columns = min(PANEL_COLUMNS, len(axes))
    for ax in axes[-columns:]:
        ax.set_xlabel(label)
        ax.tick_params(labelbottom=True)


def _panel_grid(count: int) -> tuple[plt.Figure, list[plt.Axes]]:
    """`count` panels, PANEL_COLUMNS to a row, sharing their x and y ranges: the panels show
    one quantity each, and compare only on the same scale."""
    columns = min(PANEL_COLUMNS, count)
    rows = int(np.ceil(count / columns))
    fig, axes = plt.subplots(
        rows,
        columns,
        figsize=(1.75 * columns, 1.6 * rows + 0.8),
        sharex=True,
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    axes = axes.ravel().tolist()
    for ax in axes[:count]:
        ax.locator_params(nbins=4)
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes[:count]
