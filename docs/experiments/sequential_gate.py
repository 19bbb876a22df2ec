"""The sequential gate's error rates beside the fixed gate's (docs/ladder.md section 4), by
simulation: each battle won with probability p independently, 4,000 gates a rate, condition 1 at
the cpu profile's 600 battles, looks of 100, bar 0.52. The sequential verdict is
ladder.sequential_settled itself. Run from the project root:

    .venv/bin/python docs/experiments/sequential_gate.py
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import ladder  # noqa: E402

TOTAL, LOOK, BAR, GATES = 600, 100, 0.52, 4000


def one_rate(p: float, seed: int = 1) -> tuple[float, float, float]:
    """(P(promote) fixed, P(promote) sequential, mean battles sequential) at true rate p."""
    wins = np.cumsum(np.random.default_rng(seed).random((GATES, TOTAL)) < p, 1)
    fixed = np.mean([ladder.wilson_interval(w / TOTAL, TOTAL)[0] >= BAR for w in wins[:, -1]])
    promoted, battles = [], []
    for row in wins:
        for n in range(LOOK, TOTAL + 1, LOOK):
            verdict = ladder.sequential_settled(row[n - 1] / n, n, TOTAL, BAR)
            if verdict is not None:
                promoted.append(verdict)
                battles.append(n)
                break
    return float(fixed), float(np.mean(promoted)), float(np.mean(battles))


if __name__ == "__main__":
    print("| true rate p | P(promote), fixed | P(promote), sequential | mean battles, sequential |")
    print("|---|---|---|---|")
    for p in (0.50, 0.52, 0.55, 0.57, 0.60, 0.65):
        f, s, n = one_rate(p)
        print(f"| {p:.2f} | {f:.3f} | {s:.3f} | {n:.0f} |")
