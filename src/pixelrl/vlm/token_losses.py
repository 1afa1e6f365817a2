"""PPO-family math for token policies (language and vision-language models), as pure functions.

Shapes: per-token tensors are [B, T] over the response tokens, with `mask` [B, T] (1 on a
response token, 0 on padding and after the end); sequence tensors are [B]. Defaults follow
LightRFT's VL trainer; verl's definitions are used where LightRFT lacks a feature (asymmetric
clip, dual clip, GSPO, selectable aggregation), as documented on docs/algorithms/vlm_ppo.md.
"""

from __future__ import annotations

import math

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, style: str = "lightrft", shift_mean: bool = True,
                  all_reduce=None):
    """(x - mean) / std over the masked entries, zero elsewhere.

    `lightrft`: biased variance, x * rsqrt(max(var, 1e-8)); `verl`: unbiased variance,
    x * rsqrt(var + 1e-8). `shift_mean=False` adds the mean back (scale only). With data
    parallelism, `all_reduce` (a sum over ranks of a small tensor) makes the moments global."""
    if all_reduce is None:
        mean = masked_mean(x, mask)
        var = masked_mean((x - mean) ** 2, mask)
        n = mask.sum()
    else:
        total, n = all_reduce(torch.stack([(x * mask).sum(), mask.sum().to(x.dtype)]))
        mean = total / n.clamp(min=1)
        var = all_reduce(((x - mean) ** 2 * mask).sum()) / n.clamp(min=1)
    if style == "lightrft":
        scale = torch.rsqrt(var.clamp(min=1e-8))
    elif style == "verl":
        var = var * n / (n - 1).clamp(min=1)
        scale = torch.rsqrt(var + 1e-8)
    else:
        raise ValueError(f"whitening style must be lightrft or verl, got {style!r}")
    out = (x - mean) * scale
    if not shift_mean:
        out = out + mean
    return out * mask


# --- rewards and advantages ----------------------------------------------------------------
def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Column of the last response token of each row: [B]."""
    T = mask.shape[1]
    return T - 1 - mask.long().flip(1).argmax(1)


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """r_t = -kl_coef * kl_t on every response token, plus the sequence score at the last one."""
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rewards.scatter_(1, last_token_index(mask).unsqueeze(1), scores.float().unsqueeze(1))
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    return rewards * mask


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + gamma G_{t+1} over the response tokens (0 after the end): REINFORCE returns."""
    rewards = rewards * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    return returns


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation: delta_t = r_t + gamma V_{t+1} - V_t (V = 0 after the
    last token), A_t = delta_t + gamma lam A_{t+1}; returns (A, A + V), both zero outside `mask`."""
    values, rewards = values * mask, rewards * mask
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    T = rewards.shape[1]
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def sequence_baseline_advantages(scores: torch.Tensor, n: int, estimator: str, eps: float = 1e-9) -> torch.Tensor:
    """Sequence advantages from groups of `n` consecutive samples of one prompt.

    group_norm (GRPO): (r - mean_g) / (std_g + eps), unbiased std; rloo: r - mean of the others;
    reinforce_baseline: r - mean_g."""
    from pixelrl.algos.advantages import group_advantages

    r = scores.float().reshape(-1, n)
    if n < 2:
        raise ValueError(f"{estimator} compares samples of one prompt: it needs n_samples_per_prompt > 1, got {n}")
    if estimator == "group_norm":
        groups = torch.arange(r.shape[0]).repeat_interleave(n)
        return group_advantages(scores.float(), groups, global_std=False, unbiased=True, eps=eps)
    if estimator == "rloo":
        return (r - (r.sum(1, keepdim=True) - r) / (n - 1)).reshape(-1)
    if estimator == "reinforce_baseline":
        return (r - r.mean(1, keepdim=True)).reshape(-1)
    raise ValueError(f"unknown sequence estimator {estimator!r}")


# --- KL --------------------------------------------------------------------------------------
def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from d = logp - ref_logp (masked first).

    k1 = d; k2 = d^2 / 2; k3 = exp(-d) - 1 + d; low_var_kl: k3 with -d clamped to [-20, 20]
    and the result to [-10, 10] (verl)."""
    d = (logp - ref_logp) * mask
    if kind == "k1":
        kl = d
    elif kind == "k2":
        kl = d ** 2 / 2
    elif kind == "k3":
        kl = torch.exp(-d) - 1 + d
    elif kind == "low_var_kl":
        neg = (-d).clamp(-20, 20)
        kl = (torch.exp(neg) - 1 - neg).clamp(-10, 10)
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_ESTIMATORS}")
    return kl * mask


class FixedKLController:
    def __init__(self, value: float):
        self.value = float(value)

    def update(self, current_kl: float, n_samples: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n_samples / horizon (once per rollout round)."""

    def __init__(self, value: float, target: float, horizon: int):
        super().__init__(value)
        self.target, self.horizon = float(target), int(horizon)

    def update(self, current_kl: float, n_samples: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon


# --- losses ----------------------------------------------------------------------------------
def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str = "seq-mean-token-mean") -> torch.Tensor:
    """Reduce a [B, T] loss: token-mean (all tokens of the batch), seq-mean-token-mean, seq-mean-token-sum,
    seq-mean-token-sum-norm (sum of every token's loss / T, Dr.GRPO's constant normaliser)."""
    if mode == "token-mean":
        return masked_mean(loss, mask)
    if mode == "seq-mean-token-mean":
        return masked_mean(loss, mask, dim=-1).mean()
    if mode == "seq-mean-token-sum":
        return (loss * mask).sum(-1).mean()
    if mode == "seq-mean-token-sum-norm":
        return (loss * mask).sum() / mask.shape[-1]
    raise ValueError(f"unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")


def ppo_policy_loss(logp, old_logp, advantages, mask, *, clip_low: float = 0.2, clip_high: float = 0.2,
                    dual_clip: float | None = None, aggregation: str = "seq-mean-token-mean",
                    log_ratio_clamp: float | None = None) -> tuple[torch.Tensor, dict]:
    """PPO clip: max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high)) per token; with
    `dual_clip` c (> 1), tokens with A < 0 are capped at -A c. `log_ratio_clamp` (verl: 20)
    bounds log rho before the exponential."""
    log_ratio = logp - old_logp
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
               "approx_kl": masked_mean(-log_ratio, mask).detach()}
    if dual_clip is not None:
        cap = -advantages * dual_clip
        metrics["clipfrac_dual"] = masked_mean(((loss > cap) & (advantages < 0)).float(), mask).detach()
        loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)
    return aggregate(loss, mask, aggregation), metrics


def gspo_loss(logp, old_logp, advantages, mask, *, clip_low: float = 3e-4, clip_high: float = 4e-4):
    """GSPO: the sequence ratio s = exp(mean_t(logp - old_logp)) in its token form
    log s_t = logp_t - sg(logp_t) + sg(mean_t(logp - old_logp)), clamped at 10, clipped like PPO,
    aggregated seq-mean-token-mean."""
    seq_log_ratio = masked_mean(logp - old_logp, mask, dim=-1)
    log_s = (logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    s = torch.exp(log_s)
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
               "approx_kl": masked_mean(-(logp - old_logp), mask).detach()}
    return aggregate(loss, mask, "seq-mean-token-mean"), metrics


def cpg_loss(logp, old_logp, advantages, mask, *, clip: float = 0.2):
    """Clipped policy gradient: L = -A lp with lp = min(logp, old + log(1 + eps)) where A > 0 and
    max(logp, old + log(1 - eps)) where A <= 0; the gradient vanishes once the ratio leaves the
    trust region on the side the advantage pushes it. Aggregated seq-mean-token-mean."""
    upper = old_logp + math.log1p(clip)
    lower = old_logp + math.log1p(-clip)
    clipped_logp = torch.where(advantages > 0, torch.minimum(logp, upper), torch.maximum(logp, lower))
    loss = -advantages * clipped_logp
    metrics = {"clipfrac": masked_mean((clipped_logp != logp).float(), mask).detach(),
               "approx_kl": masked_mean(-(logp - old_logp), mask).detach()}
    return aggregate(loss, mask, "seq-mean-token-mean"), metrics


def value_loss(values, old_values, returns, mask, *, clip: float | None = 0.2,
               aggregation: str = "seq-mean-token-mean") -> tuple[torch.Tensor, dict]:
    """0.5 * max((V_clip - R)^2, (V - R)^2) with V_clip = V_old + clip(V - V_old, +-clip);
    (V - R)^2 / 2 when `clip` is None."""
    loss = (values - returns) ** 2
    metrics = {}
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        clipped_loss = (clipped - returns) ** 2
        metrics["value_clipfrac"] = masked_mean((clipped_loss > loss).float(), mask).detach()
        loss = torch.maximum(loss, clipped_loss)
    return 0.5 * aggregate(loss, mask, aggregation), metrics


def ptx_loss(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Supervised (pretraining-mix) loss: mean negative log-likelihood over the target tokens."""
    return -masked_mean(logp, mask)


def entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, ratio: float) -> torch.Tensor:
    """Keep, per sequence, the max(1, int(ratio * n_valid)) highest-entropy response tokens
    (the mask of the policy loss only); ratio 0 keeps every token."""
    if ratio <= 0:
        return mask
    keep = torch.zeros_like(mask)
    scores = entropy.masked_fill(mask == 0, float("-inf"))
    for row in range(mask.shape[0]):
        n_valid = int(mask[row].sum())
        if n_valid == 0:
            continue
        k = max(1, int(ratio * n_valid))
        keep[row, scores[row].topk(k).indices] = 1.0
    return keep


@torch.no_grad()
def ema_update(ema_params, params, decay: float = 0.992) -> None:
    """ema <- decay * ema + (1 - decay) * theta, in place."""
    torch._foreach_lerp_(list(ema_params), [p.detach() for p in params], 1.0 - decay)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens (1 = the critic predicts the returns)."""
    var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    diff = returns - values
    var_d = masked_mean((diff - masked_mean(diff, mask)) ** 2, mask)
    return float(1 - var_d / var_r) if var_r > 0 else float("nan")
