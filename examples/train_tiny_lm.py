"""Train a tiny character-level MixerLM on the short story in examples/data/tiny_text.txt,
on the CPU in about a minute, then generate from it with the state cache.

    python examples/train_tiny_lm.py                        # gla, 300 steps
    python examples/train_tiny_lm.py --spec mamba2 --steps 500
    python examples/train_tiny_lm.py --spec gla --attention-every 2    # a hybrid

Prints the loss as it goes and writes OUT/loss.csv (step, train loss, held-out loss) and
OUT/loss.png when matplotlib is installed (pip install -e '.[bench]'). The held-out loss is
on the text's last tenth. 3.5 KB is far too little text for 120k parameters: the model
memorizes it (train loss near 0.3 nats per character after 300 steps, about 20 s on 2
cores) while the held-out loss bottoms out near 2.3 around step 50 and then rises, which the
curve shows plainly. Give --text a larger UTF-8 file for a run that generalizes."""
from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # run from a checkout without install
from mixc.argtypes import PLOT_HINT  # noqa: E402
from mixc.nn import MixerLM  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "tiny_text.txt"


def batches(data: torch.Tensor, batch: int, context: int, gen: torch.Generator):
    """Random windows of context + 1 characters: (inputs, next characters)."""
    start = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
    x = torch.stack([data[s:s + context + 1] for s in start.tolist()])
    return x[:, :-1], x[:, 1:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="gla", help="a library spec name or a .mix file")
    p.add_argument("--text", default=str(TEXT), help="a UTF-8 text file (default: the short story shipped here)")
    p.add_argument("--attention-every", type=int, default=None, help="every k-th layer attention (a hybrid)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", default="torch", help="the ops' mode (torch: the CPU backend; auto on a GPU)")
    p.add_argument("--out", default="tiny_lm_out", help="folder for loss.csv and loss.png")
    a = p.parse_args(argv)

    text = Path(a.text).read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text])
    split = int(0.9 * len(data))                     # the last tenth is held out
    train, held = data[:split], data[split:]
    torch.manual_seed(a.seed)
    model = MixerLM(len(chars), a.width, a.layers, a.spec, n_heads=a.heads,
                    attention_every=a.attention_every, mode=a.mode, layer_kwargs={"max_len": a.context})
    print(f"{len(text)} characters, vocabulary {len(chars)}; layers {'/'.join(model.specs)}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(a.seed)
    held_x, held_y = batches(held, 32, min(a.context, len(held) - 2), torch.Generator().manual_seed(123))
    rows, t0, smooth = [], time.perf_counter(), None
    every = max(1, a.steps // 12)
    for step in range(1, a.steps + 1):
        lr = a.lr * min(1.0, step / max(1, a.steps // 10)) * 0.5 * (1 + math.cos(math.pi * step / a.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batches(train, a.batch, a.context, gen)
        logits, _ = model(x)
        loss = F.cross_entropy(logits.reshape(-1, len(chars)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = loss.item() if smooth is None else 0.9 * smooth + 0.1 * loss.item()
        if step % every == 0 or step == a.steps:
            with torch.no_grad():
                model.eval()
                hl = F.cross_entropy(model(held_x)[0].reshape(-1, len(chars)), held_y.reshape(-1)).item()
                model.train()
            rows.append((step, round(smooth, 4), round(hl, 4)))
            print(f"step {step:4d}  train loss {smooth:.3f}  held-out loss {hl:.3f}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "loss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "train_loss", "heldout_loss"])
        w.writerows(rows)
    plotted = _plot(rows, out / "loss.png", "/".join(model.specs))
    print(f"wrote {out / 'loss.csv'}" + (f" and {out / 'loss.png'}" if plotted else
                                          f" (no plot: matplotlib is not installed; {PLOT_HINT})"))

    model.eval()
    prompt = torch.tensor([[index[c] for c in "The keeper "]])
    ids = model.generate(prompt, 120, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(a.seed))
    print("sample:", repr("".join(chars[i] for i in ids[0].tolist())))
    return 0


def _plot(rows, path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r[0] for r in rows], [r[1] for r in rows], "o-", label="train (smoothed)")
    ax.plot([r[0] for r in rows], [r[2] for r in rows], "s-", label="held out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title(f"tiny char LM: {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())
