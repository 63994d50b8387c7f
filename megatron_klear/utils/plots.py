"""Charts of runs with matplotlib (the ``[logging]`` extra): line charts of metrics over steps,
mean-and-spread bands over seeds, and grouped bars. PNG by default (the format follows the file
name: ``.png``, ``.svg``, ``.pdf``), written atomically; the Agg backend, so no display is needed.
"""

from __future__ import annotations

import os

from megatron_klear.utils import atomic


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plots need matplotlib, from the [logging] extra: pip install -e '.[logging]' in the repository's root"
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> str:
    plt = _pyplot()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    try:
        with atomic.atomic_path(path) as tmp:
            fig.savefig(tmp, format=fmt, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def _figure(title: str, xlabel: str, ylabel: str | None):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
    return fig, ax


def line_chart(
    path: str, series: dict, *, title: str, xlabel: str = "step", ylabel: str | None = None, markers: bool | None = None
) -> str:
    """``series``: label -> [(x, y), ...], one line each."""
    fig, ax = _figure(title, xlabel, ylabel)
    for label, points in series.items():
        xs, ys = zip(*points) if points else ((), ())
        ax.plot(
            xs,
            ys,
            label=label,
            marker="o" if (markers if markers is not None else len(xs) <= 30) else None,
            markersize=3,
            linewidth=1.5,
        )
    if len(series) > 1 or (series and ylabel is None):
        ax.legend(fontsize=8)
    return _save(fig, path)


def band_chart(path: str, series: dict, *, title: str, xlabel: str = "step", ylabel: str | None = None) -> str:
    """``series``: label -> (xs, mean, low, high): the mean as a line, [low, high] shaded (for
    several seeds: e.g. min..max or mean +- std)."""
    fig, ax = _figure(title, xlabel, ylabel)
    for label, (xs, mean, low, high) in series.items():
        (line,) = ax.plot(xs, mean, label=label, marker="o", markersize=3, linewidth=1.5)
        ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.18, linewidth=0)
    if series:
        ax.legend(fontsize=8)
    return _save(fig, path)


def bar_chart(
    path: str,
    groups: dict,
    *,
    title: str,
    ylabel: str | None = None,
    value_format: str = "{:.1f}",
    ylim: tuple | None = None,
) -> str:
    """``groups``: group label -> {bar label -> value}: bars side by side per group, values written
    on the bars (e.g. {"avg@8": {"SFT": 31.2, "SFT + GPPO": 52.0}, "greedy": {...}})."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.set_title(title, fontsize=11)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    bars = list(dict.fromkeys(b for g in groups.values() for b in g))
    width = 0.8 / max(len(bars), 1)
    for j, bar in enumerate(bars):
        xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(groups))]
        ys = [g.get(bar, 0.0) for g in groups.values()]
        rects = ax.bar(xs, ys, width=width * 0.95, label=bar)
        for r, y in zip(rects, ys):
            ax.annotate(
                value_format.format(y),
                (r.get_x() + r.get_width() / 2, r.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(list(groups))
    if ylim is not None:
        ax.set_ylim(*ylim)
    else:
        ax.margins(y=0.15)
    if len(bars) > 1:
        ax.legend(fontsize=8)
    return _save(fig, path)


def interval_chart(path: str, rows: dict, *, title: str, xlabel: str, reference: float | None = None) -> str:
    """``rows``: label -> (low, mean, high): one horizontal interval per label, top to bottom, the
    mean as a dot (e.g. a 95% interval per variant); ``reference``: a vertical line (e.g. 0 for
    paired differences)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 0.45 * len(rows) + 1.2))
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.grid(True, axis="x", alpha=0.3)
    labels = list(rows)
    for y, label in enumerate(labels):
        low, mean, high = rows[label]
        ax.plot([low, high], [y, y], color="tab:blue", linewidth=2)
        ax.plot([mean], [y], "o", color="tab:blue", markersize=5)
    if reference is not None:
        ax.axvline(reference, color="gray", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    return _save(fig, path)
