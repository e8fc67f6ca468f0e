"""Plot one or more runs' metrics.jsonl: loss, accuracy or BLEU, LR and throughput against step.

    python scripts/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --out curves.png
    python scripts/plot_metrics.py runs/a --out curves.png      # a run directory works too
    python scripts/plot_metrics.py runs/a --panels loss eval    # train loss and the val metric alone

Steps that a restarted run repeated (it resumed from an earlier checkpoint) are plotted once: the last record wins.
The same logs and matplotlib give the same pixels: default style, fixed size and dpi. A PNG's metadata names each log
with its sha256, so a picture can be checked against the log it claims to show.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

PANELS = {  # name: (title, split filter, key candidates)
    "loss": ("train loss", "train", ["loss"]),
    "eval": ("eval", "eval", ["acc1", "bleu"]),
    "eval-loss": ("eval loss", "eval", ["loss"]),
    "lr": ("learning rate", "train", ["lr"]),
    "throughput": ("throughput", "train", ["img_per_s", "tok_per_s"]),
}


def default_label(path: Path) -> str:
    """The run directory's name, or the file's when it is not called metrics.jsonl."""
    if path.is_dir() or path.name == "metrics.jsonl":
        return (path if path.is_dir() else path.parent).name
    return path.stem


def log_file(path: Path) -> Path:
    return path / "metrics.jsonl" if path.is_dir() else path


def load(path: Path) -> list[dict]:
    recs = [json.loads(line) for line in log_file(path).read_text().splitlines() if line.strip()]
    latest: dict[tuple, dict] = {}
    for r in recs:  # de-duplicate (split, step) after restarts, keeping the newest
        latest[(r.get("split"), r.get("step"))] = r
    return sorted(latest.values(), key=lambda r: r.get("step") or 0)


def sources(runs: list[Path]) -> str:
    """What a PNG's "Source" entry says: each log as given on the command line, with its sha256."""
    return "; ".join(f"{log_file(p)} sha256:{hashlib.sha256(log_file(p).read_bytes()).hexdigest()}" for p in runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="metrics.jsonl files or run directories")
    p.add_argument("--out", default="metrics.png")
    p.add_argument(
        "--labels",
        nargs="*",
        help="legend labels (default: the run directory, or the file name when it is not metrics.jsonl)",
    )
    p.add_argument("--panels", nargs="+", choices=list(PANELS), default=list(PANELS), help="which plots, in order")
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    plt.style.use("default")  # not a matplotlibrc's: the same logs give the same picture everywhere
    panels = [PANELS[name] for name in args.panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    axes = axes[0]
    for i, path in enumerate(args.runs):
        recs = load(path)
        label = args.labels[i] if args.labels and i < len(args.labels) else default_label(path)
        for ax, (title, split, keys) in zip(axes, panels):
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
    meta = {"Source": sources(args.runs)} if str(args.out).lower().endswith(".png") else None
    fig.savefig(args.out, dpi=110, metadata=meta)  # PNG: no timestamp, so a redraw is the same file
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
