"""Sequence parallelism on the CPU: a Wan-layout denoiser (random weights) at a long video
sequence, one training forward and backward per repeat, at sequence size 1 (one process holding
whole samples) and at sequence size 2 (two gloo processes, each a half of every sample's tokens,
pixelrl's own split: `pixelrl.parallel.sequence`). Per rank it prints the activation memory the
forward keeps for its backward (the bytes of every tensor autograd saves, counted as it saves
them: the quantity the split divides; allocator caching and the weights are not in it) and the
median step time, and checks that the two runs' outputs and summed gradients agree.

    python benchmarks/bench_sequence_parallel.py --frames 5 --side 48 --layers 4 --repeats 3

Run it with nothing else on the machine; each process takes --threads threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def build(args):
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=args.heads, attention_head_dim=args.head_dim,
                                 in_channels=16, out_channels=16, text_dim=64, freq_dim=64,
                                 ffn_dim=4 * args.heads * args.head_dim, num_layers=args.layers, rope_max_seq_len=1024)


def inputs(args):
    import torch

    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 16, args.frames, args.side, args.side, generator=generator)
    text = torch.randn(1, 32, 64, generator=generator)
    return latents, torch.tensor([500.0]), text


def measure(model, args) -> dict:
    """Saved-activation bytes and the median time of forward + backward; the last output and
    gradients for the comparison."""
    import torch

    latents, timestep, text = inputs(args)
    saved = {"bytes": 0}

    def pack(tensor):
        saved["bytes"] += tensor.numel() * tensor.element_size()
        return tensor

    times, peak = [], 0
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        saved["bytes"] = 0
        started = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
        (out.double() ** 2).mean().backward()
        times.append(time.perf_counter() - started)
        peak = max(peak, saved["bytes"])
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"saved_bytes": peak, "step_s": statistics.median(times), "out": out.detach(), "grads": grads}


def rank_main(rank: int, world: int, args, folder: str) -> None:
    import torch
    import torch.distributed as dist

    from pixelrl.parallel.group import Mesh
    from pixelrl.parallel.sequence import split_sequence

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build(args)
    mesh = Mesh(world_size=world, rank=rank, sequence_size=world)
    split_sequence(model, mesh, torch.device("cpu"), lambda x: x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2),
                   "--frames or --side")
    result = measure(model, args)
    for grad in result["grads"].values():  # the sequence group's sum (Mesh.grad_sync at one data rank)
        dist.all_reduce(grad)
    torch.save(result, os.path.join(folder, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=5, help="latent frames")
    parser.add_argument("--side", type=int, default=48, help="latent height and width (tokens: frames x side^2 / 4)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp

    from pixelrl.core.quiet import quiet_libraries

    quiet_libraries()
    tokens = args.frames * (args.side // 2) ** 2
    print(f"Wan layout: {args.layers} layers, {args.heads} heads x {args.head_dim}, {tokens} video tokens "
          f"({args.frames} latent frames of {args.side} x {args.side}), 32 text tokens, one sample, float32, "
          f"{args.threads} thread(s) per process, torch {torch.__version__}")
    torch.set_num_threads(args.threads)
    whole = measure(build(args), args)
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(rank_main, args=(2, args, folder), nprocs=2, join=True, start_method="spawn")
        ranks = [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(2)]
    out_diff = max(float((r["out"] - whole["out"]).abs().max()) for r in ranks)
    grad_diff = max(float((ranks[0]["grads"][n] - g).abs().max() / (g.abs().max() + 1e-30))
                    for n, g in whole["grads"].items())
    rows = [("1", whole)] + [(f"2 (rank {i})", r) for i, r in enumerate(ranks)]
    print("| sequence size | saved activations per rank (MB) | vs size 1 | step (s) |")
    print("|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['saved_bytes'] / 1e6:.1f} | {r['saved_bytes'] / whole['saved_bytes']:.2f}x | "
              f"{r['step_s']:.2f} |")
    print(f"size 2 against size 1: output max |diff| {out_diff:.2e}, summed gradients max relative diff {grad_diff:.2e}")
    print(json.dumps({"tokens": tokens, "ratio": max(r["saved_bytes"] for r in ranks) / whole["saved_bytes"],
                      "step_s": {name: r["step_s"] for name, r in rows}}))


if __name__ == "__main__":
    main()
