"""The timeline picture of a ledger (PNG): the step curve above, one lane per allocation below.

Each lane is the allocation's wall time painted by category (the same spans the ledger sums);
a node that left early gets a thin lane of its own under its allocation. Markers: checkpoints
(ticks), signals and stops (triangles), failures and hangs (crosses). Time runs left to right
across allocations; queue waits between them are cut out (the x axis is allocated time), and
each lane is labelled with its allocation, nodes, queue wait and how it ended.

matplotlib is imported here only: ``hpc --help`` and ``hpc render`` never load it.
"""

from __future__ import annotations

from pathlib import Path

from hpc.contract.ledger import CATEGORIES, Ledger
from hpc.report.table import LABELS, to_json

COLORS = {
    "productive": "#2e8b57", "startup": "#6fa8dc", "rendezvous": "#8e7cc3", "restore": "#f6b26b",
    "checkpoint": "#ffd966", "lost": "#cc0000", "preemption": "#e69138", "hang": "#741b47",
    "teardown": "#999999", "spare": "#b7d7e8", "unaccounted": "#eeeeee",
}
MARKERS = {"checkpoint": ("|", "#7f6000"), "signal": ("v", "#e69138"), "stop": ("v", "#b45f06"),
           "failure": ("x", "#cc0000"), "hang": ("X", "#741b47"), "restart": ("o", "#351c75"),
           "spare": ("^", "#0b5394")}


def render_png(ledger: Ledger, path: Path, *, title: str = "", dpi: int = 80) -> Path:
    """Draws the ledger's timeline to ``path`` (PNG); returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    allocs = ledger.allocations
    # Allocations back to back on one axis (seconds of allocated time, queue cut out).
    offsets, x = [], 0.0
    for a in allocs:
        offsets.append(x - a.start)
        x += a.wall_s
    lanes = []   # (label, allocation, node end or None)
    for a in allocs:
        lanes.append((f"alloc {a.allocation}: {len(a.nodes)} node{'s' if len(a.nodes) != 1 else ''}", a, None))
        for node, end in a.node_ends.items():
            if len(a.nodes) > 1 and end < a.end - 1.0 and node not in a.spares:
                lanes.append((f"{node} (left)", a, end))
        for node in a.spares:   # a hot spare: its wait, then the job's spans once it joined
            lanes.append((f"{node} (spare)", a, a.node_ends.get(node, a.end)))
    fig, (ax_s, ax_t) = plt.subplots(2, 1, figsize=(10, 3.2 + 0.6 * len(lanes)), sharex=True,
                                     gridspec_kw={"height_ratios": [2, max(1.2, 0.55 * len(lanes))]})
    for a, off in zip(allocs, offsets):
        for seg in _runs(a.steps):   # one line per stretch; a resume from an older step breaks it
            ax_s.plot([t + off for t, _ in seg], [s for _, s in seg], color="#2e8b57", lw=1.5)
        ax_s.axvline(a.start + off, color="#cccccc", lw=0.8)
    ax_s.set_ylabel("step")
    ax_s.set_title(f"{title}  goodput {ledger.goodput * 100:.1f}%, lost steps {ledger.lost_steps}"
                   .strip(), fontsize=10)
    used = set()
    for row, (label, a, node_end) in enumerate(lanes):
        y = len(lanes) - 1 - row
        off = offsets[allocs.index(a)]
        h = 0.8 if node_end is None else 0.35
        node = label.split(" ")[0] if node_end is not None else None
        cut = node_end if node is None else min(node_end, a.node_dead.get(node, node_end))
        wait = a.spares.get(node) if node is not None else None
        if wait is not None:
            ax_t.broken_barh([(wait[0] + off, wait[1] - wait[0])], (y - h / 2, h),
                             color=COLORS["spare"], linewidth=0)
            used.add("spare")
        own = [(a.start, cut if node_end is not None else a.end)] if wait is None else \
            [(a.start, wait[0]), (wait[1], cut)]   # a spare: before and after its wait
        for s in a.spans:
            for lo, hi in own:
                t0, t1 = max(s.t0, lo), min(s.t1, hi)
                if t1 > t0:
                    ax_t.broken_barh([(t0 + off, t1 - t0)], (y - h / 2, h),
                                     color=COLORS[s.category], linewidth=0)
                    used.add(s.category)
        if node_end is not None and cut < node_end:   # dead, still allocated
            ax_t.broken_barh([(cut + off, node_end - cut)], (y - h / 2, h), color=COLORS["lost"],
                             linewidth=0)
        if node_end is None:
            for m in a.markers:
                sym, col = MARKERS.get(m.kind, ("o", "black"))
                ax_t.plot([m.t + off], [y + 0.5], marker=sym, color=col, ms=7, mew=1.5, ls="none")
                if m.kind == "failure":
                    ax_s.axvline(m.t + off, color=col, lw=0.8, ls=":")
            extra = [f"queue {a.queue_s:.0f}s"] if a.queue_s is not None else []
            extra += [a.kind] if a.kind else []
            label = label + ("\n" + ", ".join(extra) if extra else "")
        ax_t.text(-0.01, y, label, transform=ax_t.get_yaxis_transform(), ha="right", va="center",
                  fontsize=7)
    ax_t.set_yticks([])
    ax_t.set_ylim(-0.6, len(lanes) - 0.4 + 0.5)
    ax_t.set_xlim(0, max(x, 1e-6))
    ax_t.set_xlabel("allocated time (s; queue waits cut out)")
    handles = [Patch(color=COLORS[c], label=f"{LABELS[c]} {ledger.categories[c] / max(ledger.allocated_node_s, 1e-9) * 100:.1f}%")
               for c in CATEGORIES if c in used]
    handles += [Line2D([], [], marker=MARKERS[k][0], color=MARKERS[k][1], ls="none", label=k)
                for k in ("checkpoint", "signal", "failure", "restart", "spare")
                if k != "spare" or any(x.spares for x in allocs)]
    rows = (len(handles) + 4) // 5
    height = fig.get_figheight()
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=7, frameon=False)
    fig.subplots_adjust(left=0.14, right=0.98, top=0.9, hspace=0.08,
                        bottom=(0.45 + 0.2 * rows) / height)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _runs(points: list[tuple[float, int]]) -> list[list[tuple[float, int]]]:
    """Splits a step curve where the step goes back (a resume from an older checkpoint)."""
    out: list[list[tuple[float, int]]] = []
    for p in points:
        if not out or p[1] < out[-1][-1][1]:
            out.append([])
        out[-1].append(p)
    return out


def render_html(ledger: Ledger, path: Path, *, title: str = "", table: str = "") -> Path:
    """One self-contained page: the timeline (PNG inlined), the table, and the JSON to download."""
    import base64
    import html
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        png = render_png(ledger, Path(tmp) / "timeline.png", title=title, dpi=100)
        image = base64.b64encode(png.read_bytes()).decode()
    data = base64.b64encode(to_json(ledger).encode()).decode()
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>goodput {html.escape(title)}"
            f"</title></head><body style='font-family:sans-serif;max-width:1100px;margin:auto'>"
            f"<h2>goodput: {html.escape(title)}</h2><img alt='timeline' style='width:100%' "
            f"src='data:image/png;base64,{image}'><pre>{html.escape(table)}</pre>"
            f"<a download='goodput.json' href='data:application/json;base64,{data}'>ledger as JSON</a>"
            f"</body></html>\n")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
