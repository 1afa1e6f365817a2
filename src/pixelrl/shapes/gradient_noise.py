"""How much of a policy-gradient step is signal: the gradient noise scale.

From K gradients g_1 .. g_K, each the mean over b samples at the same weights (McCandlish et al.,
"An Empirical Model of Large-Batch Training", 2018, appendix A.1), with B = K b and G_B their mean:

    |G|^2 ~= (B |G_B|^2 - b mean_i |g_i|^2) / (B - b)       (squared norm of the true gradient)
    tr S  ~= (mean_i |g_i|^2 - |G_B|^2) / (1/b - 1/B)       (per-sample gradient variance, summed)
    B_noise = tr S / |G|^2

A step on b samples has gradient signal-to-noise |G|^2 / (tr S / b) = b / B_noise: while b is far
below B_noise, the step is mostly noise, twice the batch at twice the rate makes the same
progress per sample, and only more samples (not a different split of them) move the policy
further. The expected cosine between two independent b-sample gradients is about
1 / (1 + B_noise / b), reported as measured (`pairwise_cosine`).

When the signal is small against the noise of K batches, the |G|^2 estimate scatters around 0
(it can come out negative). Its jackknife standard error over the K gradients gives a bound that
holds either way: B_noise >= tr S / (|G|^2 + 2 se) (`noise_scale_lower`, about 97.5% one-sided).
"""

from __future__ import annotations

import itertools

import torch


def gradient_noise_scale(grads: list[torch.Tensor], samples_per_grad: int) -> dict[str, float]:
    """`grads`: K >= 2 flattened gradients at the same weights, each the mean over
    `samples_per_grad` samples. Returns |G|^2, tr S, B_noise (inf when the |G|^2 estimate is not
    positive: no signal measurable at this many samples), the mean pairwise cosine and, with
    K >= 3, the jackknife standard error of |G|^2 and the lower bound on B_noise."""
    if len(grads) < 2:
        raise ValueError(f"the noise scale needs at least 2 gradients, got {len(grads)}")
    if samples_per_grad < 1:
        raise ValueError(f"samples_per_grad must be >= 1, got {samples_per_grad}")
    g = torch.stack([x.detach().reshape(-1).double() for x in grads])
    k, b = g.shape[0], samples_per_grad
    grad_sq, trace_cov = _estimates(g, b)
    result = {"grad_sq": grad_sq, "trace_cov": trace_cov,
              "noise_scale": trace_cov / grad_sq if grad_sq > 0 else float("inf")}
    if k >= 3:  # leave-one-out needs two gradients left
        loo = [_estimates(torch.cat([g[:i], g[i + 1:]]), b)[0] for i in range(k)]
        mean = sum(loo) / k
        se = ((k - 1) / k * sum((x - mean) ** 2 for x in loo)) ** 0.5
        upper = grad_sq + 2 * se
        result.update(grad_sq_se=se, noise_scale_lower=trace_cov / upper if upper > 0 else float("inf"))
    cosines = [float(torch.nn.functional.cosine_similarity(g[i], g[j], dim=0))
               for i, j in itertools.combinations(range(k), 2)]
    result["pairwise_cosine"] = sum(cosines) / len(cosines)
    return result


def _estimates(g: torch.Tensor, b: int) -> tuple[float, float]:
    """(|G|^2, tr S) from the rows of g, each a b-sample mean gradient."""
    big = g.shape[0] * b
    small_sq = float((g * g).sum(dim=1).mean())
    big_sq = float(g.mean(dim=0).pow(2).sum())
    return (big * big_sq - b * small_sq) / (big - b), (small_sq - big_sq) / (1.0 / b - 1.0 / big)
