"""`zoo plot RUN_DIR`: loss, eval loss, eval-task scores, DPO rewards and learning-rate curves of a run as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

from zoo.errors import UserError


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``run_dir/metrics.jsonl`` into a PNG (default ``run_dir/curves.png``); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    f = run / "metrics.jsonl"
    if not f.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl; is it a training run's output_dir?")
    rows = []
    for i, line in enumerate(f.read_text().splitlines()):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise UserError(f"{f}, line {i + 1}: not valid JSON") from None
    if not rows:
        raise UserError(f"{f} is empty: the run has not logged a step yet")

    def series(key: str) -> tuple[list, list]:
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    scores = sorted({k for r in rows for k in r if k.startswith("eval/")})  # eval.tasks metrics
    rewards = any("rewards/margins" in r for r in rows)  # a preference (DPO) run
    middle = [name for name, shown in (("scores", scores), ("rewards", rewards)) if shown]
    panels = 2 + len(middle)
    fig, axes = plt.subplots(panels, 1, figsize=(8, 6 + 2 * (panels - 2)), sharex=True,
                             height_ratios=(2, *[1.5] * len(middle), 1))
    ax_loss, ax_lr = axes[0], axes[-1]
    if rewards:
        ax = axes[1 + middle.index("rewards")]
        for key, style in (("rewards/chosen", "-"), ("rewards/rejected", "-"), ("rewards/margins", "-"),
                           ("eval_rewards/margins", "o-")):
            steps, values = series(key)
            if values:
                ax.plot(steps, values, style, label=key)
        ax.set_ylabel("rewards")
        acc = ax.twinx()  # accuracies live on [0, 1], the rewards anywhere
        acc.plot(*series("rewards/accuracies"), ":", color="gray", label="rewards/accuracies")
        acc.set_ylim(-0.05, 1.05)
        acc.set_ylabel("accuracy")
        ax.legend(fontsize="small", loc="upper left")
        ax.grid(alpha=0.3)
    if scores:
        for key in scores:
            ax_scores_steps, values = series(key)
            axes[1].plot(ax_scores_steps, values, "o-", label=key.removeprefix("eval/"))
        axes[1].set_ylabel("eval tasks")
        axes[1].legend(fontsize="small")
        axes[1].grid(alpha=0.3)
    ax_loss.plot(*series("loss"), label="train loss")
    steps, ev = series("eval_loss")
    if ev:
        ax_loss.plot(steps, ev, "o-", label="eval loss")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_lr.plot(*series("learning_rate"), color="tab:green")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.grid(alpha=0.3)
    fig.suptitle(run.name)
    fig.tight_layout()
    path = Path(out) if out else run / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
