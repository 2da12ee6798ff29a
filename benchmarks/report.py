"""Markdown and plotting helpers for the benchmark report, and the facts about the machine."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def machine_facts(device: str = "cpu", dtype: str = "float32") -> dict:
    facts = {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "device": device,
        "dtype": dtype,
        "load_average_at_start": load_average(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
    return facts


def facts_lines(facts: dict) -> list[str]:
    lines = [f"- date: {facts['date']}",
             f"- CPU: {facts['cpu']}, {facts['cores']} cores (from /proc/cpuinfo / os.cpu_count)",
             f"- torch {facts['torch']}, {facts['torch_threads']} intra-op threads, Python {facts['python']}",
             f"- device: {facts['device']}, {facts['dtype']}" + (f" ({facts['gpu']})" if facts.get("gpu") else "")]
    load = facts.get("load_average_at_start")
    if load is not None:
        lines.append(f"- load average when the run started: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} "
                     f"(1 / 5 / 15 min)")
    if facts.get("load_average_at_end") is not None:
        load = facts["load_average_at_end"]
        lines.append(f"- load average when the run ended: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    return lines


def fmt(value, digits: int = 1) -> str:
    """A table cell: numbers with ``digits`` decimals, None as an em dash."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: list[str], rows: list[list], digits: int = 1) -> str:
    """A GitHub markdown table; numbers right-aligned."""
    def align(cells):
        return ["---:" if isinstance(c, (int, float)) and not isinstance(c, bool) else "---" for c in cells]

    out = ["| " + " | ".join(headers) + " |",
           "| " + " | ".join(align(rows[0]) if rows else ["---"] * len(headers)) + " |"]
    out += ["| " + " | ".join(fmt(c, digits) for c in row) + " |" for row in rows]
    return "\n".join(out)


def save_results(results_dir: Path, name: str, intro: list[str], table_lines: list[str], rows: list, command: str,
                 facts: dict) -> None:
    """A benchmark's ``--write``: ``name``.md (``intro``, the command and machine, the table) and
    ``name``.json (the raw rows)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    lines = intro + [f"Command: `{command}`; " + "; ".join(facts_lines(facts)).replace("- ", ""), ""] + table_lines
    (results_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    (results_dir / f"{name}.json").write_text(json.dumps({"command": command, "facts": facts, "rows": rows},
                                                         indent=1, default=str))


def saved_section(title: str, saved: Path) -> list[str]:
    """A benchmark's saved markdown (written by its ``--write``) as a BENCHMARKS.md section under
    ``title`` instead of its own first line; [] before the first run."""
    if not saved.exists():
        return []
    return [title, "", saved.read_text().split("\n", 1)[1].strip()]


def replace_section(path: Path, number: str, section: list[str], before: str | None = None) -> None:
    """Put ``section`` (its lines, title first) into the markdown file at ``path`` in place of the
    section whose title starts with ``number`` (e.g. "## 4b. "): before the section titled
    ``before`` when there is one, else at the end. An empty ``section`` only removes the old one."""
    kept, inside = [], False
    for line in path.read_text().split("\n"):
        if line.startswith(number):
            inside = True
        elif inside and line.startswith("## "):
            inside = False
        if not inside:
            kept.append(line)
    text, new = "\n".join(kept).rstrip(), "\n".join(section)
    if not new:
        path.write_text(text + "\n")
    elif before is not None and "\n" + before in text:
        head, tail = text.split("\n" + before, 1)
        path.write_text(head.rstrip() + "\n\n" + new + "\n\n" + before + tail + "\n")
    else:
        path.write_text(text + "\n\n" + new + "\n")


def ratio(baseline: float | None, value: float | None) -> float | None:
    """How many times ``value`` beats ``baseline`` (baseline / value), None when undefined."""
    if baseline is None or value is None or value <= 0:
        return None
    return baseline / value


def plot_lines(path: Path, series: list[tuple[str, list[float], list[float]]], *, title: str, xlabel: str,
               ylabel: str, logy: bool = False) -> Path:
    """One PNG with a line per (label, xs, ys)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, xs, ys in series:
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_bars(path: Path, groups: list[str], series: list[tuple[str, list[int], list[float]]], *, title: str,
              ylabel: str, logy: bool = False) -> Path:
    """Grouped bars: one group per entry of ``groups``, one bar per (label, group indices, values)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(series))
    for i, (label, xs, ys) in enumerate(series):
        bars = ax.bar([x + (i - (len(series) - 1) / 2) * width for x in xs], ys, width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
