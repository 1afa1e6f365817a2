"""The optimizer preflight: does each update still follow its gradient?

Adam's step is lr * m_hat / (sqrt(v_hat) + eps) per entry. When the gradients are tiny (a LoRA
on a huge base, a reward of small scale, a loss averaged over many elements) eps is no longer
small beside sqrt(v_hat) ~ |g|, and every update shrinks toward zero while the loss and the
reward curves look merely flat: UniRL found a gradient RMS of ~5e-9 against eps 1e-8 and lowered
eps to 1e-15. After the first optimizer step and every `actor.preflight_every` after it, the
learner measures, over its trained parameters (the policy's, or another role's):

- `grad_rms`: the RMS of the clipped gradient entries Adam received;
- `eps_over_grad_rms`: adam_eps / grad_rms (0.1 shrinks a first step by about a tenth);
- `update_rms_over_lr`: the RMS of Adam's normalised step m_hat / (sqrt(v_hat) + eps), from the
  optimizer's own state: about 1 when the update follows the gradient's signs, far below 1 when
  eps dominates;
- `zero_grad_share`: the share of entries whose gradient is exactly 0 (LoRA's A matrices get
  none at the first step, since B starts at 0: half the entries; all of them means the loss does
  not reach the trained weights).

The metrics travel with the step's others (`actor/preflight/...`, `fake_score/preflight/...`);
`preflight_warnings` turns them into one line each, with the fix, on the driver.
"""

from __future__ import annotations

import math

import torch

# eps at a tenth of the gradient RMS shrinks each early update by about 9%
EPS_SHARE_WARNED = 0.1
# almost no entry received a gradient: the loss does not reach the trained weights
ZERO_SHARE_WARNED = 0.9


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _summed(values: list[float], sharded: bool) -> list[float]:
    """Sums over FSDP2's shards (each rank holds part of every tensor), else as they are."""
    if not (sharded and torch.distributed.is_initialized()):
        return values
    total = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(total)
    return total.tolist()


def measure(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, clipped_norm: float,
            eps: float) -> dict[str, float]:
    """The preflight's metrics after `optimizer` stepped on `params` with gradients of total norm
    `clipped_norm` (after clipping); one host read per tensor, so only on the steps it runs."""
    sharded = hasattr(params[0], "to_local")
    numel = sum(p.numel() for p in params)  # a DTensor's numel is the whole tensor's
    grad_rms = clipped_norm / math.sqrt(max(numel, 1))
    zeros, squares, entries = 0.0, 0.0, 0.0
    beta1, beta2 = optimizer.defaults["betas"]
    for p in params:
        local = _local(p)
        zeros += float((_local(p.grad) == 0).sum()) if p.grad is not None else float(local.numel())
        state = optimizer.state.get(p, {})
        if "exp_avg" not in state:
            continue
        step = float(state["step"])
        m_hat = _local(state["exp_avg"]).float() / (1 - beta1 ** step)
        v_hat = _local(state["exp_avg_sq"]).float() / (1 - beta2 ** step)
        squares += float(((m_hat / (v_hat.sqrt() + eps)) ** 2).sum())
        entries += float(local.numel())
    zeros, squares, entries = _summed([zeros, squares, entries], sharded)
    return {"preflight/grad_rms": grad_rms,
            "preflight/eps_over_grad_rms": eps / grad_rms if grad_rms > 0 else math.inf,
            "preflight/update_rms_over_lr": math.sqrt(squares / entries) if entries else 0.0,
            "preflight/zero_grad_share": zeros / max(numel, 1)}


def preflight_warnings(metrics: dict[str, float], eps_field: str = "actor.adam_eps") -> list[str]:
    """One line per trained role whose preflight tripped, naming the evidence and the fix."""
    lines = []
    for key, share in sorted(metrics.items()):
        if not key.endswith("/preflight/eps_over_grad_rms"):
            continue
        role = key[: -len("/preflight/eps_over_grad_rms")]
        rms = metrics.get(f"{role}/preflight/grad_rms", float("nan"))
        update = metrics.get(f"{role}/preflight/update_rms_over_lr", float("nan"))
        if share >= EPS_SHARE_WARNED:
            lines.append(f"preflight ({role}): Adam's epsilon is {share:.3g} x the gradient RMS ({rms:.3g}), so each "
                         f"update is {update:.3g} x lr in RMS where about 1 follows the gradient: lower {eps_field} "
                         f"below {EPS_SHARE_WARNED * rms:.1e} (e.g. 1e-15), or scale the loss or reward up")
        zero = metrics.get(f"{role}/preflight/zero_grad_share", 0.0)
        if zero >= ZERO_SHARE_WARNED:
            lines.append(f"preflight ({role}): {zero:.1%} of the trained entries received no gradient: the loss does "
                         "not reach most of the trained weights (check model.lora_target_modules and that the loss "
                         "reads the policy's output)")
    return lines
