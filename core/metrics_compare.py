"""`python -m core.metrics compare RUN_A RUN_B [--out compare.html]`.

Prints, side by side with the difference, the parameter count, final loss,
TFLOP/s, tokens/s, average seconds per step, memory use and library versions
of two runs, and writes an HTML page with both loss curves.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import sys
from pathlib import Path

import numpy as np

from core.errors import UserError
from core.metrics import read_metrics


def summarize(run_dir: Path) -> dict:
    rows = read_metrics(run_dir)
    info_path = run_dir / "run_info.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    train = [r for r in rows if "loss" in r]

    def mean(key):
        vals = [r[key] for r in train if key in r]
        return float(np.mean(vals)) if vals else None

    return {
        "parameters": info.get("param_count"),
        "final loss": train[-1]["loss"] if train else None,
        "TFLOP/s": None if mean("tflops_per_s") is None else mean("tflops_per_s"),
        "tokens/s": mean("tokens_per_s"),
        "s/step": mean("step_seconds"),
        "MFU": mean("mfu"),
        "memory": info.get("memory_after_first_step"),
        "versions": info.get("versions", {}),
        "steps": train[-1]["step"] if train else 0,
    }


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def comparison_table(a: dict, b: dict, name_a: str, name_b: str) -> list[tuple[str, str, str, str]]:
    rows = []
    for key in ("parameters", "steps", "final loss", "TFLOP/s", "tokens/s", "s/step", "MFU", "memory"):
        va, vb = a[key], b[key]
        diff = f"{vb - va:+,.4g}" if isinstance(va, (int, float)) and isinstance(vb, (int, float)) else ""
        rows.append((key, _cell(va), _cell(vb), diff))
    for lib in sorted(set(a["versions"]) | set(b["versions"])):
        va, vb = a["versions"].get(lib, "-"), b["versions"].get(lib, "-")
        rows.append((lib, va, vb, "" if va == vb else "differs"))
    return rows


def loss_plot_png(runs: dict[str, Path]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, run in runs.items():
        pts = [(r["step"], r["loss"]) for r in read_metrics(run) if "loss" in r]
        if pts:
            ax.plot(*zip(*pts), label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m core.metrics", description="Compare two Temper runs.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="side-by-side summary and loss curves of two runs")
    c.add_argument("run_a")
    c.add_argument("run_b")
    c.add_argument("--out", default="compare.html")
    args = p.parse_args(argv)

    a_dir, b_dir = Path(args.run_a), Path(args.run_b)
    try:
        a, b = summarize(a_dir), summarize(b_dir)
    except (FileNotFoundError, UserError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    name_a, name_b = a_dir.name or str(a_dir), b_dir.name or str(b_dir)
    if name_a == name_b:
        name_a, name_b = str(a_dir), str(b_dir)
    rows = comparison_table(a, b, name_a, name_b)
    header = ("", name_a, name_b, "B - A")
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(4)]
    for r in [header, *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))

    png = base64.b64encode(loss_plot_png({name_a: a_dir, name_b: b_dir})).decode()
    table = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r) + "</tr>" for r in rows)
    title = f"Temper: {html.escape(name_a)} vs {html.escape(name_b)}"
    style = (
        "body{font-family:sans-serif;margin:2em}td,th{padding:4px 12px;border-bottom:1px solid #ddd;text-align:left}"
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>{style}</style></head>
<body><h1>{html.escape(name_a)} vs {html.escape(name_b)}</h1>
<img src="data:image/png;base64,{png}" alt="loss curves">
<table><tr>{"".join(f"<th>{html.escape(h)}</th>" for h in header)}</tr>{table}</table></body></html>"""
    Path(args.out).write_text(page)
    print(f"wrote {args.out}")
    return 0
