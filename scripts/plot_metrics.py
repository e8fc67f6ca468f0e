"""Plot one or more runs' metrics.jsonl: loss, accuracy or BLEU, LR and throughput against step.

    python scripts/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --out curves.png
    python scripts/plot_metrics.py runs/a --out curves.png      # a run directory works too

Steps that a restarted run repeated (it resumed from an earlier checkpoint) are plotted once: the last record wins.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = [  # (title, split filter, key candidates)
    ("train loss", "train", ["loss"]),
    ("eval", "eval", ["acc1", "bleu"]),
    ("eval loss", "eval", ["loss"]),
    ("learning rate", "train", ["lr"]),
    ("throughput", "train", ["img_per_s", "tok_per_s"]),
]


def default_label(path: Path) -> str:
    """The run directory's name, or the file's when it is not called metrics.jsonl."""
    if path.is_dir() or path.name == "metrics.jsonl":
        return (path if path.is_dir() else path.parent).name
    return path.stem


def load(path: Path) -> list[dict]:
    path = path / "metrics.jsonl" if path.is_dir() else path
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    latest: dict[tuple, dict] = {}
    for r in recs:  # de-duplicate (split, step) after restarts, keeping the newest
        latest[(r.get("split"), r.get("step"))] = r
    return sorted(latest.values(), key=lambda r: r.get("step") or 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="metrics.jsonl files or run directories")
    p.add_argument("--out", default="metrics.png")
    p.add_argument(
        "--labels",
        nargs="*",
        help="legend labels (default: the run directory, or the file name when it is not metrics.jsonl)",
    )
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for i, path in enumerate(args.runs):
        recs = load(path)
        label = args.labels[i] if args.labels and i < len(args.labels) else default_label(path)
        for ax, (title, split, keys) in zip(axes, PANELS):
            rows = [r for r in recs if (r.get("split") == "train") == (split == "train")]
            key = next((k for k in keys if any(k in r for r in rows)), None)
            if key is None:
                continue
            pts = [(r["step"], r[key]) for r in rows if key in r and r.get("step") is not None]
            ax.plot(*zip(*pts), marker="o" if split == "eval" else None, ms=3, label=label)
            ax.set_title(f"{title} ({key})" if title in ("eval", "throughput") else title)
            ax.set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
