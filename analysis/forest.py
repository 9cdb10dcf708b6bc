"""Forest plots of the meta-analysis across models: one panel per pair of testsets, one row per model.

Drawn in the paper style of ``figures`` (its palette, fonts, headings and
``save``), with every panel on the same rows and the range -1 to 1, so that
pairs compare down and across the grid.
"""

from collections.abc import Mapping

import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd

from analysis.figures import DAGGER, OKABE_ITO, PAPER_STYLE, TITLE_LINE_HEIGHT, heading, wrap
from analysis.naming import display_name
from analysis.sensitivity import SENSITIVE

POOLED_COLOUR = OKABE_ITO[0]
# Forest plots: inches per model row, per panel beyond its rows, and panels per figure row; the
# least width, for the legend under one panel, and the height of the x-axis' ticks and label.
FOREST_ROW_HEIGHT = 0.1
FOREST_PANEL_EXTRA = 0.6
FOREST_COLUMNS = 4
FOREST_MIN_WIDTH = 5.0
FOREST_WIDTH_FOR_3_ENTRIES = 6.5  # legend entries to a row; fewer where the figure is narrower
FOREST_AXIS_HEIGHT = 0.4


def forest_plots(
    pooled: pd.DataFrame,
    members: pd.DataFrame,
    labels: Mapping[tuple[str, str], str],
    *,
    title: str,
    note: str,
) -> plt.Figure:
    """One forest plot per pair of a meta-analysis across models, in a grid.

    `pooled` and `members` are one scope's rows of meta.meta_analyse (pooled
    with SENSITIVE); `labels` names each (model, training set) member. In a
    panel each model is a square at its r (area by its weight in the pooled
    estimate, hollow when it is left out) with its 95% interval across runs,
    the diamond spans the pooled r's HKSJ interval, and the line through it
    the prediction interval for a new model. Every panel has the same rows
    and the range -1 to 1, so that pairs compare down and across the grid.
    """
    keys = list(labels)
    train_sets = list(dict.fromkeys(train_set for _, train_set in keys))
    colours = dict(zip(train_sets, (OKABE_ITO[6], *OKABE_ITO[1:6])))
    columns = min(FOREST_COLUMNS, len(pooled))
    rows = int(np.ceil(len(pooled) / columns))
    panel_height = FOREST_ROW_HEIGHT * (len(keys) + 2) + FOREST_PANEL_EXTRA
    with plt.rc_context(PAPER_STYLE):
        fig, axes = plt.subplots(
            rows,
            columns,
            figsize=(max(1.9 * columns + 1.0, FOREST_MIN_WIDTH), panel_height * rows),
            sharex=True,
            sharey=True,
            squeeze=False,
            layout="constrained",
        )
        top = heading(fig, title, note)
        handles, names = _forest_legend(colours, members)
        legend_columns = min(3 if fig.get_figwidth() >= FOREST_WIDTH_FOR_3_ENTRIES else 2, len(handles))
        key = wrap(
            fig,
            "squares: a model's mean $r$ over its runs with its 95% t interval, area by its weight in the pooled $r$",
            PAPER_STYLE["legend.fontsize"],
        )
        # Lines of the heading, of the legend's title and of its entries, and the x-axis labels.
        lines = top.count("\n") + key.count("\n") + 2 + int(np.ceil(len(handles) / legend_columns))
        fig.set_figheight(panel_height * rows + FOREST_AXIS_HEIGHT + TITLE_LINE_HEIGHT * lines)
        for ax in axes.ravel()[len(pooled) :]:
            ax.set_visible(False)
        for ax, summary in zip(axes.ravel(), pooled.itertuples()):
            pair = members[(members["x"] == summary.x) & (members["y"] == summary.y)]
            _draw_forest(ax, summary, pair, keys, colours)
        ax = axes[0, 0]
        ax.set_yticks(range(len(keys) + 1), [*labels.values(), "pooled"])
        ax.set_ylim(len(keys) + 0.8, -0.8)
        ax.set_xlim(-1.0, 1.0)
        ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator([-1.0, -0.5, 0.0, 0.5, 1.0]))
        for bottom in _lowest_visible(axes, len(pooled)):
            bottom.set_xlabel("partial $r$")
            bottom.tick_params(labelbottom=True)
        fig.legend(handles, names, loc="outside lower center", ncols=legend_columns, frameon=False, title=key)
        fig.suptitle(top)
    return fig


def _draw_forest(ax: plt.Axes, summary, pair: pd.DataFrame, keys: list, colours: dict) -> None:
    """One pair's panel: its models (rows in `keys` order), the pooled diamond and the
    prediction interval, and a title with the pooled r, I^2 and the models agreeing in sign."""
    row_of = {key: i for i, key in enumerate(keys)}
    shown = pair[pair["r"].notna()]
    rows = [row_of[key] for key in zip(shown["model"], shown["train_set"])]
    member_colours = [colours[train_set] for train_set in shown["train_set"]]
    pooled_in = shown["weight"].notna().to_numpy()
    ax.hlines(rows, shown["ci_low"], shown["ci_high"], colors=member_colours, lw=0.8)
    ax.scatter(
        shown["r"],
        rows,
        marker="s",
        s=np.where(pooled_in, 8 + 120 * shown["weight"], 10),
        c=np.where(pooled_in, member_colours, "white"),
        edgecolors=member_colours,
        lw=0.7,
        zorder=3,
    )
    ax.axvline(0.0, color="0.6", lw=0.6, ls="--")
    row = len(keys)
    if np.isnan(summary.r):
        ax.text(0.0, row, "not pooled", ha="center", va="center", fontsize=6, color="0.4")
        ax.set_title(_pair_name(summary), fontsize=6.5)
        return
    if not np.isnan(summary.pi_low):
        ax.plot([summary.pi_low, summary.pi_high], [row, row], color=POOLED_COLOUR, lw=1.0, marker="|", ms=5)
    ax.fill(
        [summary.ci_low, summary.r, summary.ci_high, summary.r],
        [row, row - 0.45, row, row + 0.45],
        color=POOLED_COLOUR,
        lw=0,
        zorder=3,
    )
    dagger = DAGGER if getattr(summary, SENSITIVE) else ""
    ax.set_title(
        f"{_pair_name(summary)}{dagger}\nr = {summary.r:.2f} "
        f"[{summary.ci_low:.2f}, {summary.ci_high:.2f}]\nI\u00b2 = {100 * summary.i2:.0f}%, "
        f"{summary.n_agree:.0f}/{summary.k} agree in sign",
        fontsize=6.5,
    )


def _pair_name(summary) -> str:
    """A pair of testsets as panel titles name it: "SNLI – SciTail"."""
    return f"{display_name(summary.x)} \u2013 {display_name(summary.y)}"


def _forest_legend(colours: dict, members: pd.DataFrame) -> tuple[list, list[str]]:
    """Legend entries: models (per training set when there are several), a model left out
    (if any), the pooled diamond and the prediction interval."""
    several = len(colours) > 1
    handles = [plt.Line2D([], [], color=c, marker="s", ms=4, lw=0.8) for c in colours.values()]
    names = [f"model trained on {display_name(train_set)}" if several else "model" for train_set in colours]
    if (members["r"].notna() & members["weight"].isna()).any():
        handles.append(plt.Line2D([], [], color="0.2", marker="s", mfc="white", ms=4, lw=0))
        names.append("not pooled (no variance across runs)")
    handles += [
        plt.Line2D([], [], color=POOLED_COLOUR, marker="D", ms=5, lw=0),
        plt.Line2D([], [], color=POOLED_COLOUR, marker="|", ms=5, lw=1.0),
    ]
    names += ["pooled $r$, 95% CI", "95% prediction interval for a new model"]
    return handles, names


def _lowest_visible(axes: np.ndarray, count: int) -> list[plt.Axes]:
    """The lowest of the first `count` panels in each column of a grid filled row by row:
    where the x-axis is labelled when the last row is not full."""
    columns = axes.shape[1]
    return [axes[(count - 1 - column) // columns, column] for column in range(min(columns, count))]
