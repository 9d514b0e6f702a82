"""Calibrated acceptance of a tree's nodes: how often the target accepts a node whose path
the drafter gave a given log-probability.

Ours, not vLLM's ``OnlineAcceptanceEstimator``: that one fits a logistic curve to a chain
position's own confidence; a tree node's evidence is its path's probability (the product of
the drafter's marginals along it), and its verdict is whether the target's path went
through it. A histogram over the path log-probability (bins of 0.25 nats) counts verified
and accepted nodes on the device, decayed so that it follows the traffic; a bin's rate
starts at the drafter's own claim (a prior of two nodes) and the rates are fitted
non-increasing over the bins (weighted isotonic regression: a bin seen often outweighs its
empty neighbours' priors), so a request's calibrated scores stay non-increasing along its
tree's build order and the best nodes of a step are always a prefix of each tree.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ddtree.spec_decode.adaptive.host_copy import HostCopy

BIN_NATS = 0.25
NUM_BINS = 64  # down to a path probability of e^-16
PRIOR_NODES = 2.0
DECAY = 0.998  # per verify step: the histogram remembers ~500 steps


def bins_of(logprobs: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """A path log-probability's bin (-inf: the last)."""
    if isinstance(logprobs, torch.Tensor):
        scaled = torch.nan_to_num(-logprobs / BIN_NATS, posinf=NUM_BINS - 1)
        return scaled.clamp(0, NUM_BINS - 1).long()
    scaled = np.nan_to_num(-logprobs / BIN_NATS, posinf=NUM_BINS - 1)
    return np.clip(scaled, 0, NUM_BINS - 1).astype(np.int64)


class AcceptanceCalibration:
    def __init__(self, device: torch.device) -> None:
        # Row 0: nodes verified, row 1: nodes accepted, by bin.
        self.counts = torch.zeros(2, NUM_BINS, dtype=torch.float32, device=device)
        self.host = HostCopy(self.counts)
        centers = (np.arange(NUM_BINS) + 0.5) * BIN_NATS
        self._prior = np.exp(-centers)

    def observe(self, logprobs: torch.Tensor, verified: torch.Tensor,
                accepted: torch.Tensor) -> None:
        """On the device, no sync: nodes' path log-probs, whether each was verified and
        whether the target accepted it, [R, N]."""
        bins = bins_of(logprobs).flatten()
        self.counts.mul_(DECAY)
        self.counts[0].index_add_(0, bins, verified.flatten().float())
        self.counts[1].index_add_(0, bins, (accepted & verified).flatten().float())

    def rates(self) -> np.ndarray:
        """Each bin's calibrated acceptance, from the latest copy on the host."""
        verified, accepted = self.host.latest()
        weight = verified + PRIOR_NODES
        return non_increasing((accepted + PRIOR_NODES * self._prior) / weight, weight)

    def probabilities(self, logprobs: np.ndarray) -> np.ndarray:
        return self.rates()[bins_of(logprobs)]


def non_increasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-increasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values.tolist(), weights.tolist(), strict=True):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            (v2, w2, n2), (v1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.concatenate([np.full(n, v) for v, _, n in blocks])
