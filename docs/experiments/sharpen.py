"""A decode plugin (design 7.5): wait as often as the policy says, then choose where more greedily.

Use it as `--ladder.release-mode plugin:docs.experiments.sharpen:wait_then_sharpen` (how the
snapshots act in evaluation) or `--ladder.opponent-mode ...` (how the pool acts in training), run
from the repository root. ppo_clash.decode_fn calls it with copies of the rows' masked log-probs
(B, A), their mask (B, A), the decoded observation vector (B, V) and one uniform per row (B,),
and checks that it returns one legal action per row.

Why this one: the joint argmax of a trained policy is nearly always the no-op, so `argmax` waits
a whole battle, while a sample spreads its plays over every legal tile. This keeps the policy's
own probability of waiting, p(no-op), and sharpens only the choice among the plays: softmax of
the log-probs over TEMPERATURE. One uniform serves both draws (wait iff u < p(no-op); the rest of
its range, rescaled, picks the play), so the action stays a function of the master seed.
Measured on the best 1M weights: no stronger than plain sampling (docs/learning.md 3.3).
"""
import torch

TEMPERATURE = 0.5   # 1 is the policy's own sample among the plays; toward 0, its argmax


def wait_then_sharpen(logp: torch.Tensor, mask: torch.Tensor, vector: torch.Tensor,
                      u: torch.Tensor) -> torch.Tensor:
    p_wait = logp[:, 0].exp()
    u = u.to(logp.dtype).clamp(0.0, 1.0 - 1e-7)
    plays = mask[:, 1:]
    # the plays' log-probs, sharpened; a forbidden play keeps its finfo.min, so it weighs exactly 0
    sharp = torch.log_softmax(torch.where(plays, logp[:, 1:] / TEMPERATURE, logp[:, 1:]), -1)
    cdf = sharp.exp().cumsum(-1)
    cdf = cdf / cdf[:, -1:].clamp_min(1e-30)
    rest = ((u - p_wait) / (1.0 - p_wait).clamp_min(1e-30)).clamp(0.0, 1.0 - 1e-7)
    play = (torch.searchsorted(cdf, rest.unsqueeze(-1), right=True).squeeze(-1)
            .clamp(max=cdf.shape[-1] - 1) + 1)
    wait = (u < p_wait) | ~plays.any(-1)
    return torch.where(wait, torch.zeros_like(play), play)
