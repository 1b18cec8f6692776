"""`mixc recall`: multi-query associative recall (MQAR, Arora et al. 2023, "Zoology") on the
CPU, to measure how well a mixer's fixed-size state recalls, against attention and hybrids.

A sequence holds num_kv_pairs key-value pairs, then the keys again as queries, each followed
by its value. Zoology's layout asks each key once at random places among filler tokens; the
default here fills every pair slot after the context with a query (mqar(dense=True)):

    k3 v3 k1 v1 k7 v7 ... | 0 0 k1 v1 0 0 0 k7 v7 0 k3 v3 0 ...    (dense=False, Zoology)
    k3 v3 k1 v1 k7 v7 ... | k1 v1 k7 v7 k1 v1 k3 v3 ...              (dense=True)
                            ^     ^     ^     ^    the model must predict v1, v7, v1, v3

The loss and the accuracy count only the tokens that answer a query (the value after a
queried key); training batches mix 1 .. n pairs (RecallConfig.mixed), evaluation has n. Keys and values are drawn without replacement from disjoint halves of the
vocabulary (token 0 is the filler). A model is trained on fresh batches for each (spec,
sequence length, width) and scored on held-out sequences; the table gives its accuracy next
to its state size (floats per sequence in all its mixers' states at that length, a KV
cache for attention). Writes results.csv, results.md, config.json and recall.png (when
matplotlib is installed) into the output folder. docs/recall.md.
"""
from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .argtypes import PLOT_HINT, nonnegative_int, positive_float, positive_int, positive_ints
from .dsl import library_names

# torch is imported inside the functions: `mixc --help` and the other commands build this
# command's parser without paying for it.

IGNORE = -100
DEFAULT_SPECS = ("linear_attn", "retention", "gla", "mamba2", "delta_rule", "attention", "gla+attention",
                 "attention+gla")


def mqar(batch: int, seq_len: int, num_kv_pairs: int, vocab_size: int,
         generator=None, dense: bool = False):
    """A batch of MQAR sequences: (inputs [batch, seq_len] int64, targets [batch, seq_len] with
    the answer where inputs holds a queried key and IGNORE elsewhere). Keys come from tokens
    1 .. vocab/2 - 1, values from vocab/2 .. vocab - 1; 0 fills the gaps.

    dense=False is Zoology's layout: each key queried once, at random pair slots after the
    context. dense=True fills every pair slot after the context with a query of a random key
    (keys repeat), so a sequence gives (seq_len - 2 n) / 2 answers instead of n: the same
    recall, more signal per sequence (what makes CPU training in minutes possible)."""
    import torch        # lazy: torch only when training (see above)
    half = vocab_size // 2
    n = num_kv_pairs
    if n < 1 or n > half - 1:
        raise ValueError(f"num_kv_pairs: expected 1 .. {half - 1} for vocab_size {vocab_size}, got {n}")
    if seq_len < 4 * n:
        raise ValueError(f"seq_len: {n} key-value pairs and their {n} queries need seq_len >= {4 * n}, got {seq_len}")
    g = generator
    keys = torch.rand(batch, half - 1, generator=g).argsort(-1)[:, :n] + 1
    values = torch.rand(batch, vocab_size - half, generator=g).argsort(-1)[:, :n] + half
    inputs = torch.zeros(batch, seq_len, dtype=torch.long)
    inputs[:, 0:2 * n:2], inputs[:, 1:2 * n:2] = keys, values
    slots = (seq_len - 2 * n) // 2
    if dense:
        where = (2 * n + 2 * torch.arange(slots)).expand(batch, slots)
        order = torch.randint(0, n, (batch, slots), generator=g)                       # which key asked where
    else:
        where = 2 * n + 2 * torch.rand(batch, slots, generator=g).argsort(-1)[:, :n]    # distinct pair slots
        order = torch.rand(batch, n, generator=g).argsort(-1)                            # each key once
    qk, qv = keys.gather(1, order), values.gather(1, order)
    inputs.scatter_(1, where, qk)
    inputs.scatter_(1, where + 1, qv)
    targets = torch.full_like(inputs, IGNORE)
    targets.scatter_(1, where, qv)               # at the key's position, predict the next token
    return inputs, targets


@dataclass
class RecallConfig:
    specs: tuple[str, ...] = DEFAULT_SPECS     # 'a+b' is a hybrid: the layers cycle a, b
    lengths: tuple[int, ...] = (32, 64)
    widths: tuple[int, ...] = (32, 64)
    kv_per_token: float = 1 / 4                # num_kv_pairs = seq_len * this
    dense: bool = True                         # every slot after the context a query (mqar())
    mixed: bool = True                         # training batches hold 1 .. n pairs (uniform), eval n
    vocab_size: int = 64
    n_layers: int = 2
    head_dim: int = 16                         # n_heads = width // head_dim
    steps: int = 400
    batch: int = 32
    lr: float = 1e-2
    weight_decay: float = 0.1
    eval_sequences: int = 512
    seed: int = 0
    mode: str = "torch"                        # the ops' mode: the torch backend on the CPU
    jobs: int = 1                              # models trained at once, in worker processes
    layer_kwargs: dict = field(default_factory=dict)

    def kv_pairs(self, seq_len: int) -> int:
        return max(1, int(round(seq_len * self.kv_per_token)))


def stack(pattern: str, n_layers: int) -> list[str]:
    """'gla' -> [gla] * n; 'gla+attention' -> gla, attention, gla, attention, ... (n layers)."""
    parts = [p for p in pattern.split("+") if p]
    if not parts:
        raise ValueError(f"spec pattern {pattern!r}: expected NAME or NAME+NAME...")
    return [parts[i % len(parts)] for i in range(n_layers)]


def build_model(pattern: str, width: int, cfg: RecallConfig):
    from .nn import MixerLM         # lazy: imports torch
    heads = max(1, width // cfg.head_dim)
    return MixerLM(cfg.vocab_size, width, cfg.n_layers, stack(pattern, cfg.n_layers), n_heads=heads,
                   mode=cfg.mode, layer_kwargs=cfg.layer_kwargs)


def _lr(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over the first 10% of steps, then cosine decay to 10% of lr."""
    warm = max(1, steps // 10)
    if step < warm:
        return lr * (step + 1) / warm
    p = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def evaluate(model, seq_len: int, cfg: RecallConfig, batch: int = 128) -> float:
    """Accuracy on held-out sequences (the same ones for every model: a fixed seed)."""
    import torch        # lazy: torch only when training (see above)
    g = torch.Generator().manual_seed(10_000 + cfg.seed)
    right = total = 0
    model.eval()
    with torch.no_grad():
        for start in range(0, cfg.eval_sequences, batch):
            x, y = mqar(min(batch, cfg.eval_sequences - start), seq_len, cfg.kv_pairs(seq_len), cfg.vocab_size,
                        g, dense=cfg.dense)
            pred = model(x)[0].argmax(-1)
            mask = y != IGNORE
            right += (pred[mask] == y[mask]).sum().item()
            total += mask.sum().item()
    model.train()
    return right / total


def train_one(pattern: str, seq_len: int, width: int, cfg: RecallConfig, progress=None) -> dict:
    """Train one model on fresh MQAR batches; return its row of the table."""
    import torch                        # lazy: torch only when training (see above)
    import torch.nn.functional as F     # lazy: torch
    torch.manual_seed(cfg.seed)
    model = build_model(pattern, width, cfg)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2 and "param_" not in n]
    other = [p for n, p in model.named_parameters() if p.requires_grad and not (p.dim() >= 2 and "param_" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))
    g = torch.Generator().manual_seed(cfg.seed)
    n = cfg.kv_pairs(seq_len)
    t0 = time.perf_counter()
    loss_v = float("nan")
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg.steps, cfg.lr)
        # Zoology trains on a mixture of pair counts; the easy sequences teach the lookup early
        k = int(torch.randint(1, n + 1, (), generator=g)) if cfg.mixed else n
        x, y = mqar(cfg.batch, seq_len, k, cfg.vocab_size, g, dense=cfg.dense)
        logits, _ = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # a smoothed loss for the progress line
        loss_v = loss.item() if step == 0 else 0.9 * loss_v + 0.1 * loss.item()
        if progress is not None:
            progress(step + 1, loss_v)
    train_s = time.perf_counter() - t0
    acc = evaluate(model, seq_len, cfg)
    with torch.no_grad():
        _, state = model(torch.zeros(1, seq_len, dtype=torch.long), use_cache=True)
    return {"spec": pattern, "layers": "/".join(model.specs), "seq_len": seq_len, "width": width,
            "kv_pairs": n, "state_size": model.state_size(state),
            "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "accuracy": round(acc, 4), "final_loss": round(loss_v, 4), "train_s": round(train_s, 1)}


def time_left(elapsed: float, frac: float, start: float = 0.0) -> float | None:
    """Seconds left at the pace so far: `elapsed` seconds took the work from fraction `start` to
    `frac`, and 1 - frac is left. Never below 0 (frac may pass 1 by rounding); None before any
    progress."""
    if not frac - start > 0:
        return None
    return max(0.0, elapsed * (1.0 - min(frac, 1.0)) / (frac - start))


def duration_text(seconds: float) -> str:
    """'42 s', '3.5 min', '1.2 h' (never negative: -0.0 and rounding below 0 read 0 s)."""
    s = max(0.0, float(seconds)) + 0.0            # + 0.0 turns -0.0 into 0.0
    if s < 59.5:
        return f"{s:.0f} s"
    if s < 90 * 60:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def eta_text(seconds: float | None) -> str:
    """The remaining-time part of a progress line: '~3.5 min left', '~0 s left' at the end,
    'time left: ?' before the first step; never negative."""
    if seconds is None or seconds != seconds:
        return "time left: ?"
    return f"~{duration_text(seconds)} left"


# seconds between progress lines in a log (stderr not a terminal; a terminal redraws every step)
LOG_EVERY = 10.0


class Progress:
    """Progress on stderr while models train: the runs done, each running model's step and
    smoothed loss, the time spent and an estimate of the time left (the runs weighed by their
    cost). On a terminal one line redrawn at every step; in a log (not a terminal) a line every
    `every` seconds. Each finished run gets its own line either way."""

    def __init__(self, costs: list[float], steps: int, stream=None, labels: list[str] | None = None,
                 every: float | None = None):
        self.total, self.steps = len(costs), steps
        self.weights = [c / sum(costs) for c in costs] if costs else []   # the time left weighs runs by cost
        self.labels = list(labels) if labels is not None else [f"run {i + 1}" for i in range(len(costs))]
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = LOG_EVERY if every is None else every
        self.t0 = time.perf_counter()
        self.done = 0
        self.frac = 0.0                          # the finished runs' share of the work
        self.running: dict[int, tuple[int, float]] = {}     # run index -> (step, smoothed loss)
        self.finished: set[int] = set()
        self.last_line = self.t0                 # a log's last progress line
        self.last_draw = 0.0                     # a terminal's last redraw
        self.first: tuple[float, float] | None = None     # (time, fraction done) at the first step

    def _bar(self, frac: float) -> str:
        now = time.perf_counter()
        # the pace from the first step on: starting the workers and loading the ops (seconds
        # before any step) would make the first estimates hours
        left = time_left(now - self.first[0], frac, self.first[1]) if self.first else None
        return f"[{'#' * int(24 * min(frac, 1.0)):<24}] {duration_text(now - self.t0)}, {eta_text(left)}"

    def _frac(self) -> float:
        return self.frac + sum(self.weights[i] * step / self.steps for i, (step, _) in self.running.items())

    def header(self, jobs: int) -> None:
        self.stream.write(f"training {self.total} model{'s' if self.total != 1 else ''}, {self.steps} steps each, "
                          f"{jobs} at a time\n")
        self.stream.flush()

    def step(self, index: int, step: int, loss: float) -> None:
        """Run `index` has taken `step` steps (its smoothed loss)."""
        if index in self.finished:
            return                               # a late message from a run already reported
        self.running[index] = (step, loss)
        if self.first is None:
            self.first = (time.perf_counter(), self._frac())
        now = time.perf_counter()
        if self.tty and (now - self.last_draw >= 0.1 or step == self.steps):
            self.last_draw = now
            self.stream.write("\r" + self._line()[:150].ljust(150))
            self.stream.flush()
        elif not self.tty and now - self.last_line >= self.every:
            self.last_line = now
            self.stream.write(self._line() + "\n")
            self.stream.flush()

    def __call__(self, step: int, loss: float) -> None:
        """The training loop's callback for the one run in progress (train_one's `progress`)."""
        self.step(next(iter(self.running), 0), step, loss)

    def start(self, index: int) -> None:
        self.running[index] = (0, float("nan"))

    def _line(self) -> str:
        runs = "; ".join(f"{self.labels[i]} step {st}/{self.steps} loss {loss:.3f}"
                         for i, (st, loss) in sorted(self.running.items()))
        return f"{self._bar(self._frac())} | {self.done}/{self.total} done | {runs}"

    def finish_run(self, row: dict, cost_index: int) -> None:
        self.done += 1
        self.frac += self.weights[cost_index]
        self.running.pop(cost_index, None)
        self.finished.add(cost_index)
        line = (f"{self._bar(self._frac())} | {self.done}/{self.total} {row['spec']} T={row['seq_len']} "
                f"d={row['width']}: accuracy {row['accuracy']:.3f}, state {row['state_size']}, {row['train_s']:.0f} s")
        self.stream.write(("\r" if self.tty else "") + line.ljust(150 if self.tty else 0) + "\n")
        self.stream.flush()
        self.last_line = time.perf_counter()


# Relative cost of a training step on the CPU (the torch backend), from the train_s of the
# committed run (linear_attn = 1), to hand the slowest models to the workers first so that
# none is left running alone at the end, and to weigh the time left. Only the order of work.
_STEP_COST = {"delta_rule": 4.5, "gated_delta_rule": 4.5, "rwkv7": 4.5, "gla": 2.0, "based": 2.0,
              "attention": 0.8}


def _cost(run) -> float:
    pattern, T, d = run
    parts = [p for p in pattern.split("+") if p]
    return T * d * sum(_STEP_COST.get(p, 1.0) for p in parts) / len(parts)


_QUEUE = None          # a worker process's queue of progress messages to the parent (run())


def _init_worker(queue) -> None:
    global _QUEUE
    _QUEUE = queue


def _train_in_worker(args) -> dict:
    import torch        # lazy: torch only when training (see above)
    index, pattern, T, d, cfg, threads = args
    torch.set_num_threads(threads)
    last = [0.0]

    def progress(step, loss):
        # a message every quarter second (and the last step): the parent redraws from them
        now = time.perf_counter()
        if _QUEUE is not None and (now - last[0] >= 0.25 or step == cfg.steps):
            last[0] = now
            _QUEUE.put((index, step, loss))
    return train_one(pattern, T, d, cfg, progress)


def _drain(queue, bar: Progress) -> None:
    import queue as queues      # lazy: only for --jobs > 1 (its Empty)
    while True:
        try:
            index, step, loss = queue.get_nowait()
        except queues.Empty:
            return
        bar.step(index, step, loss)


def run(cfg: RecallConfig, out: Path | None = None, stream=None) -> list[dict]:
    """Train every (spec, length, width) of cfg; write the results to out when given."""
    runs = [(s, T, d) for T in cfg.lengths for d in cfg.widths for s in cfg.specs]
    bar = Progress([_cost(r) for r in runs], cfg.steps, stream, labels=[f"{s} T={T} d={d}" for s, T, d in runs])
    bar.header(min(cfg.jobs, len(runs)))
    t0 = time.perf_counter()
    if cfg.jobs > 1:
        # one model per worker process, each on its share of the cores (small models use one
        # core poorly with threads; processes side by side use them fully); the workers send
        # their steps through a queue, which the parent drains between waits
        import multiprocessing as mp       # lazy: 6 ms each that `mixc --help` does without; only for --jobs > 1
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait     # lazy: as multiprocessing
        threads = max(1, (os.cpu_count() or 1) // cfg.jobs)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        done = {}
        with ProcessPoolExecutor(cfg.jobs, mp_context=ctx, initializer=_init_worker, initargs=(queue,)) as pool:
            order = sorted(range(len(runs)), key=lambda i: _cost(runs[i]), reverse=True)
            futures = {pool.submit(_train_in_worker, (i, *runs[i], cfg, threads)): i for i in order}
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                _drain(queue, bar)
                for f in finished:
                    i = futures[f]
                    done[i] = f.result()
                    bar.finish_run(done[i], i)
        rows = [done[i] for i in range(len(runs))]
    else:
        rows = []
        for i, (s, T, d) in enumerate(runs):
            bar.start(i)
            rows.append(train_one(s, T, d, cfg, bar))
            bar.finish_run(rows[-1], i)
    total = time.perf_counter() - t0
    if out is not None:
        write(rows, cfg, Path(out), total)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: one row per spec, a column per (length, width): accuracy (state size)."""
    cols = sorted({(r["seq_len"], r["width"]) for r in rows})
    specs = list(dict.fromkeys(r["spec"] for r in rows))
    at = {(r["spec"], r["seq_len"], r["width"]): r for r in rows}
    head = "| spec | " + " | ".join(f"T={T}, d={d} ({rows_kv(rows, T)} pairs)" for T, d in cols) + " |"
    lines = [head, "|---|" + "---|" * len(cols)]
    for s in specs:
        cells = []
        for T, d in cols:
            r = at.get((s, T, d))
            cells.append(f"{r['accuracy']:.3f} ({_size(r['state_size'])})" if r else "")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rows_kv(rows, T) -> int:
    return next(r["kv_pairs"] for r in rows if r["seq_len"] == T)


def _size(n: int) -> str:
    return f"{n / 1024:.0f}K" if n >= 10_240 else (f"{n / 1024:.1f}K" if n >= 1024 else str(n))


def write(rows: list[dict], cfg: RecallConfig, out: Path, total_s: float) -> None:
    import torch        # lazy: torch only when training (see above)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    summed = round(sum(r["train_s"] for r in rows) / 60, 2)       # the runs' own times, added up
    meta = dict(asdict(cfg), total_minutes=round(total_s / 60, 2), train_minutes_summed=summed,
                torch=torch.__version__, cpus=os.cpu_count())
    (out / "config.json").write_text(json.dumps(meta, indent=1) + "\n")
    md = ["# MQAR recall", "",
          f"{cfg.n_layers} layers, head dim {cfg.head_dim}, vocab {cfg.vocab_size}, {cfg.steps} steps of "
          f"{cfg.batch} sequences, lr {cfg.lr}, {cfg.eval_sequences} held-out sequences; "
          f"{total_s / 60:.1f} min in all ({cfg.jobs} job{'s' if cfg.jobs > 1 else ''} on {os.cpu_count()} CPU cores).",
          "Cells: accuracy on the queries (state size: floats per sequence in the mixers' states).", "",
          table(rows), ""]
    (out / "results.md").write_text("\n".join(md))
    plotted = plot(rows, out / "recall.png")
    print(f"wrote {out / 'results.md'}, results.csv, config.json"
          + (", recall.png" if plotted else f" (no plot: matplotlib is not installed; {PLOT_HINT})"))


def plot(rows: list[dict], path: Path) -> bool:
    """Accuracy against state size, one panel per sequence length, a line per spec over the
    widths. False when matplotlib is missing."""
    try:
        import matplotlib       # optional: no plot without it (pip install -e '.[bench]')
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt      # optional
    except ImportError:
        return False
    fig = figure(rows, plt)
    fig.savefig(path, dpi=120, bbox_inches="tight")     # "tight": the legend outside the panels is kept
    plt.close(fig)
    return True


def figure(rows: list[dict], plt):
    """The recall figure (plot() saves it). The legend sits right of the panels, outside them: a
    legend inside a panel hid the points under it (accuracies fill the whole height)."""
    lengths = sorted({r["seq_len"] for r in rows})
    specs = list(dict.fromkeys(r["spec"] for r in rows))
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    lines = {}
    for ax, T in zip(axes[0], lengths):
        for k, s in enumerate(specs):
            pts = sorted((r["state_size"], r["accuracy"], r["width"]) for r in rows
                         if r["spec"] == s and r["seq_len"] == T)
            if pts:
                # one color per spec in every panel (the legend names each once)
                lines[s], = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{k % 10}", label=s)
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("state size (floats per sequence)")
        ax.set_title(f"T = {T}, {rows_kv(rows, T)} key-value pairs")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("MQAR accuracy")
    fig.tight_layout()
    fig.legend(list(lines.values()), list(lines), fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5),
               bbox_transform=axes[0][-1].transAxes, borderaxespad=0.5)
    return fig


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def add_arguments(p) -> None:
    d = RecallConfig()
    p.add_argument("--specs", default=",".join(d.specs),
                   help="comma-separated spec names or .mix files; 'a+b' is a hybrid whose layers cycle a, b "
                        f"(default: {', '.join(d.specs)})")
    p.add_argument("--lengths", type=positive_ints, default=d.lengths, help="sequence lengths (comma-separated)")
    p.add_argument("--widths", type=positive_ints, default=d.widths, help="model widths (d_model, comma-separated)")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="training steps per model")
    p.add_argument("--batch", type=positive_int, default=d.batch, help="sequences per training step")
    p.add_argument("--lr", type=positive_float, default=d.lr,
                   help="peak learning rate of AdamW (warm-up over the first 10%% of steps, then cosine to 10%%)")
    p.add_argument("--kv-per-token", type=positive_float, default=d.kv_per_token,
                   help="key-value pairs per token of the sequence (default 1/4: 16 pairs at T = 64)")
    p.add_argument("--queries", choices=("dense", "once"), default="dense",
                   help="dense: every slot after the context a query; once: each key asked once among "
                        "filler (Zoology's layout)")
    p.add_argument("--fixed-pairs", action="store_true",
                   help="train on n pairs only (default: a mixture of 1 .. n pairs per batch)")
    p.add_argument("--vocab", type=positive_int, default=d.vocab_size,
                   help="vocabulary size: keys from the lower half, values from the upper half (token 0 is filler)")
    p.add_argument("--layers", type=positive_int, default=d.n_layers, help="layers of each model")
    p.add_argument("--head-dim", type=positive_int, default=d.head_dim, help="channels per head (heads = width / this)")
    p.add_argument("--eval", type=positive_int, default=d.eval_sequences,
                   help="held-out sequences each model is scored on")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the models' weights and of the data")
    p.add_argument("--mode", default=d.mode, choices=("auto", "chunk", "recurrent", "torch", "reference"),
                   help="the ops' mode (torch: the CPU backend)")
    p.add_argument("--jobs", type=positive_int, default=min(2, os.cpu_count() or 1),
                   help="models trained at once in worker processes (default: 2 where there are 2 cores or more)")
    p.add_argument("--threads", type=nonnegative_int, default=0, help="torch CPU threads with --jobs 1 (0: as many as torch picks)")
    p.add_argument("-o", "--out", metavar="DIR", help="write results.md/.csv, config.json, recall.png to DIR")


def config_from_args(a) -> RecallConfig:
    ints = (lambda x: _ints(x) if isinstance(x, str) else tuple(x))
    return RecallConfig(specs=tuple(s for s in a.specs.split(",") if s), lengths=ints(a.lengths),
                        widths=ints(a.widths), kv_per_token=a.kv_per_token, vocab_size=a.vocab,
                        dense=a.queries == "dense", mixed=not a.fixed_pairs,
                        n_layers=a.layers, head_dim=a.head_dim, steps=a.steps, batch=a.batch, lr=a.lr,
                        eval_sequences=a.eval, seed=a.seed, mode=a.mode, jobs=a.jobs)


def check_config(cfg: RecallConfig) -> str | None:
    """What makes a configuration impossible, in the options' words (None when it can run)."""
    if not cfg.specs:
        return "--specs: expected at least one spec name"
    for T in cfg.lengths:
        n = cfg.kv_pairs(T)
        if T < 4 * n:
            return (f"--lengths {T}: {n} key-value pair{'s' if n > 1 else ''} (--kv-per-token {cfg.kv_per_token:g}) "
                    f"and their queries need sequences of at least {4 * n} tokens")
        if n > cfg.vocab_size // 2 - 1:
            return (f"--lengths {T}: {n} distinct keys need --vocab of at least {2 * n + 2}, got {cfg.vocab_size}")
    return None


def main(a) -> int:
    import torch        # lazy: torch only when training (see above)
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = config_from_args(a)
    missing = sorted({p for s in cfg.specs for p in s.split("+") if p} - set(library_names())
                     - {p for s in cfg.specs for p in s.split("+") if p.endswith(".mix") and os.path.exists(p)})
    if missing:
        print(f"error: no spec named {', '.join(missing)}; library specs: {', '.join(library_names())}",
              file=sys.stderr)
        return 1
    problem = check_config(cfg)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    if a.out:                                  # a path onto a file or an unwritable folder: now, not after training
        from .bench import writable_folder      # lazy: mixc.bench imports torch and Triton
        writable_folder(a.out)
    rows = run(cfg, Path(a.out) if a.out else None)
    print(table(rows))
    return 0
