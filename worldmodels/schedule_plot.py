"""A picture of the server's schedule, from a recorded run.

    python -m worldmodels.schedule_plot --out docs/worldmodel_schedule.png      # tiny model, CPU, seconds

Runs a few streams of the tiny model through a ring of stages on the CPU (streams joining at
different ticks, actions sent ahead), records which (stream, chunk, pass) items every stage ran
in every tick, and draws it: one row per stage, one column per tick, one box per item coloured
by stream and labelled chunk.pass ("P" = the context prefill, "R" = the clean re-cache pass).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from worldmodels.config import WorldModelConfig
from worldmodels.serve import TickRecord, WorldModelServer
from worldmodels.serve_config import ServeConfig


def record_demo(schedule: str = "noisy", stages: int = 3, streams: int = 4, chunks: int = 3, lookahead: int = 2,
                join_every: int = 2, seed: int = 0) -> tuple[list[TickRecord], WorldModelServer]:
    """Streams join every `join_every` ticks and keep `lookahead` chunks of actions queued."""
    torch.manual_seed(seed)
    cfg = WorldModelConfig.preset("tiny", kv_schedule=schedule, dit={"num_blocks": max(stages, 2)})
    server = WorldModelServer(cfg, ServeConfig(rings=[["cpu"] * stages], max_streams=streams, record_timeline=True))
    shape = (cfg.frames_per_chunk, cfg.dit.latent_channels, *cfg.latent_hw)
    ids, sent, got = [], {}, {}
    for tick in range(10_000):
        if len(ids) < streams and tick % join_every == 0:
            sid = server.open_stream(torch.randn(shape), seed=seed + len(ids))
            ids.append(sid)
            sent[sid], got[sid] = 0, 0
        for sid in ids:
            while sent[sid] < chunks and sent[sid] - got[sid] < lookahead:
                server.submit(sid, torch.rand(cfg.chunk_actions, cfg.dit.action_dim) * 2 - 1)
                sent[sid] += 1
        for out in server.tick():
            got[out.stream] += 1
        if len(ids) == streams and all(got[s] == chunks for s in ids):
            return server.timeline, server
    raise RuntimeError("demo did not finish")


def plot_timeline(records: Sequence[TickRecord], ring_sizes: Sequence[int], path: str | Path, title: str,
                  passes: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    ranks = sum(ring_sizes)
    ticks = max(r.tick for r in records) + 1
    per_cell = max(len(r.items) for r in records)
    streams = sorted({s for r in records for s, _, _ in r.items})
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(max(8.0, ticks * 0.42), 1.0 + ranks * 0.22 * per_cell + 0.8))
    for record in records:
        row = ranks - 1 - record.rank
        height = 0.9 / per_cell
        for slot, (stream, chunk, step) in enumerate(sorted(record.items)):
            y = row + 0.05 + slot * height
            color = colors(streams.index(stream) % 10)
            ax.add_patch(Rectangle((record.tick + 0.04, y), 0.92, height * 0.92, facecolor=color, alpha=0.85,
                                   edgecolor="black", linewidth=0.3))
            label = "P" if chunk < 0 else (f"{chunk}.R" if step == passes - 1 and passes > 4 else f"{chunk}.{step}")
            ax.text(record.tick + 0.5, y + height * 0.46, label, ha="center", va="center", fontsize=5.5)
    ax.set_xlim(0, ticks)
    ax.set_ylim(0, ranks)
    ax.set_yticks([ranks - 1 - r + 0.5 for r in range(ranks)])
    ax.set_yticklabels([f"stage {r}" for r in range(ranks)])
    ax.set_xlabel("tick (every stage runs once per tick, all its ready items as one batch)")
    handles = [Rectangle((0, 0), 1, 1, facecolor=colors(i % 10)) for i in range(len(streams))]
    ax.legend(handles, [f"stream {s}" for s in streams], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/worldmodel_schedule.png")
    parser.add_argument("--schedule", default="noisy", choices=["noisy", "clean"])
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--lookahead", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    records, server = record_demo(args.schedule, args.stages, args.streams, args.chunks, args.lookahead)
    passes = server.cfg.passes_per_chunk
    title = (f"{args.schedule} KV schedule, {args.stages} stages in a ring (tiny model, CPU), {args.streams} streams "
             f"joining every 2 ticks, {args.lookahead} chunks of actions ahead; label chunk.pass, P = prefill")
    path = plot_timeline(records, server.placement.ring_sizes, args.out, title, passes)
    busy = sum(len(r.items) for r in records)
    print(f"wrote {path}: {max(r.tick for r in records) + 1} ticks, {busy} stage-items, "
          f"largest batch {max(len(r.items) for r in records)}")


if __name__ == "__main__":
    main()
