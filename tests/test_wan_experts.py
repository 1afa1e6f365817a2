"""Wan 2.2 A14B's two experts (a `transformer_2` and a `boundary_ratio` in the folder): sampling,
adapters and exports equal to WanPipeline's, each row routed to its timestep's expert with that
expert's guidance, the trained experts chosen by `model.trained_experts`, bad options refused."""

import pytest
import torch

from conftest import tiny_config
from pixelrl.core.errors import ConfigError
from pixelrl.engine import PolicyEngine

WAN22 = dict(model__type="wan", model__max_sequence_length=16, model__num_frames=5, rollout__guidance_scale=4.0,
             rollout__num_steps=4, model__guidance_scale_2=2.0)
PROMPTS = ["a red circle", "two blue squares on the left"]


def _pipeline_latents(pipe, prompt, seed, guidance_scale_2=2.0):
    return pipe(prompt, num_inference_steps=4, height=32, width=32, output_type="latent", max_sequence_length=16,
                num_frames=5, guidance_scale=4.0, guidance_scale_2=guidance_scale_2,
                generator=torch.Generator().manual_seed(seed)).frames


def _our_latents(engine, prompts, seeds):
    from pixelrl.sampling import SamplingSettings, Window, rollout

    settings = SamplingSettings(noise_level=0.0, guidance_scale=4.0)
    with torch.no_grad():
        return rollout(engine.model, prompts, seeds, sigmas=engine.sigmas, window=Window(0, 0), settings=settings,
                       height=32, width=32).final_latents


def _perturb_adapters(engine):
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in engine.model.transformer.named_parameters():
            if "lora_B" in name:  # B starts at zero: give each adapter an effect
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))


def test_two_expert_samples_adapters_and_exports_equal_wan_pipeline(tiny_wan22_path, tmp_path):
    """The 4-step grid straddles the boundary (step 0 high noise, 1-3 low noise). pixelrl's ODE
    sample is WanPipeline's with guidance_scale 4 and guidance_scale_2 2 (and not its sample at
    guidance_scale_2 4: the low-noise expert's own scale is used); after changing both experts'
    adapters the saved adapter loads into the pipeline expert by expert (diffusers'
    `load_into_transformer_2`) and the exported, fused pipeline samples as pixelrl does."""
    from diffusers import WanPipeline

    from pixelrl.engine.checkpoint import save_engine
    from pixelrl.models.export import export_checkpoint
    from pixelrl.models.wan import WanModel

    engine = PolicyEngine.from_config(tiny_config(tiny_wan22_path, **WAN22))
    assert {n.split(".")[0] for n in engine.trainable_names()} == {"transformer", "transformer_2"}
    pipe = WanPipeline.from_pretrained(tiny_wan22_path)
    expected = torch.cat([_pipeline_latents(pipe, p, seed) for p, seed in zip(PROMPTS, (3, 4))])
    ours = _our_latents(engine, PROMPTS, [3, 4])
    assert torch.allclose(ours, expected, atol=1e-5)
    assert (ours[:1] - _pipeline_latents(pipe, PROMPTS[0], 3, guidance_scale_2=4.0)).abs().max() > 1e-2

    _perturb_adapters(engine)
    save_engine(engine, tmp_path / "actor")
    assert sorted(p.name for p in (tmp_path / "actor" / "adapter").iterdir()) == ["transformer", "transformer_2"]
    WanModel.load_lora_into_pipeline(pipe, tmp_path / "actor" / "adapter")
    tuned = torch.cat([_pipeline_latents(pipe, p, seed) for p, seed in zip(PROMPTS, (3, 4))])
    assert (tuned - expected).abs().max() > 1e-3
    assert torch.allclose(_our_latents(engine, PROMPTS, [3, 4]), tuned, atol=1e-5)

    export_checkpoint(tmp_path / "actor", tiny_wan22_path, tmp_path / "exported", model_type="wan")
    exported = WanPipeline.from_pretrained(tmp_path / "exported")
    assert torch.allclose(_pipeline_latents(exported, PROMPTS[0], 3), tuned[:1], atol=1e-4)  # fused: reordering only


def test_each_row_runs_on_its_timesteps_expert_and_trains_only_that_expert(tiny_wan22_path):
    """A batch with one row above the boundary (sigma 0.95) and one below (0.5): each row's
    velocity is the one it gets alone, from its own expert's network (row 1 = transformer_2 called
    directly), guided with its expert's scale; the gradient of row 0 alone reaches only
    `transformer`'s adapter, of both rows both adapters."""
    from pixelrl.models.base import PromptEmbeds

    engine = PolicyEngine.from_config(tiny_config(tiny_wan22_path, **WAN22))
    model = engine.model
    _perturb_adapters(engine)
    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    sigmas = torch.tensor([0.95, 0.5])
    text, negative = model.encode_prompts(PROMPTS), model.encode_prompts(["", ""])
    together = model.predict_velocity(x, sigmas, text, guidance_scale=4.0, negative=negative)
    for row in (0, 1):
        alone = model.predict_velocity(x[row:row + 1], sigmas[row:row + 1], PromptEmbeds(text.embeds[row:row + 1]),
                                       guidance_scale=4.0, negative=PromptEmbeds(negative.embeds[row:row + 1]))
        torch.testing.assert_close(together[row:row + 1], alone, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        def low(embeds):
            return model.transformer.transformer_2(hidden_states=x[1:], timestep=torch.tensor([500.0]),
                                                   encoder_hidden_states=embeds, return_dict=False)[0]

        v_u, v_c = low(negative.embeds[1:]), low(text.embeds[1:])
    torch.testing.assert_close(together[1:], v_u + 2.0 * (v_c - v_u), rtol=1e-5, atol=1e-6)  # guidance_scale_2

    def adapter_grads(rows):
        model.transformer.zero_grad()
        model.predict_velocity(x[rows], sigmas[rows], PromptEmbeds(text.embeds[rows])).square().mean().backward()
        return {expert: sum(float(p.grad.abs().sum()) for n, p in model.transformer.named_parameters()
                            if n.startswith(expert + ".") and p.grad is not None)
                for expert in ("transformer", "transformer_2")}

    high_only = adapter_grads([0])
    assert high_only["transformer"] > 0 and high_only["transformer_2"] == 0
    both = adapter_grads([0, 1])
    assert both["transformer"] > 0 and both["transformer_2"] > 0


@pytest.mark.parametrize("lora_rank", [8, 0])
def test_trained_experts_train_the_named_expert_and_freeze_the_other(tiny_wan22_path, tmp_path, lora_rank):
    """model.trained_experts=[transformer_2]: with LoRA only the low-noise expert has an adapter
    (saved as its own folder), under full fine-tuning only its weights are trainable; an update
    leaves `transformer` as it was."""
    from pixelrl.engine.checkpoint import save_engine
    from pixelrl.trainers.step import compute_advantages, expand_prompts

    cfg = tiny_config(tiny_wan22_path, **WAN22, model__lora_rank=lora_rank, model__trained_experts=["transformer_2"],
                      actor__ppo_micro_batch_size=4)
    engine = PolicyEngine.from_config(cfg)
    names = engine.trainable_names()
    assert names and all(n.startswith("transformer_2.") for n in names)
    high = {n: p.detach().clone() for n, p in engine.model.transformer.transformer.named_parameters()}
    low = {n: p.detach().clone() for n, p in engine.model.transformer.transformer_2.named_parameters()}
    samples = expand_prompts(PROMPTS, [{}] * 2, cfg.rollout.n, seed=1)
    batch = engine.rollout(samples["prompts"], samples["seeds"])
    batch["uids"] = samples["uids"]
    batch["rewards"] = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))
    batch["advantages"] = compute_advantages(batch["rewards"], batch["uids"], cfg.algorithm)
    engine.update(batch)
    assert all(torch.equal(p, high[n]) for n, p in engine.model.transformer.transformer.named_parameters())
    assert any(not torch.equal(p, low[n]) for n, p in engine.model.transformer.transformer_2.named_parameters())
    if lora_rank:
        save_engine(engine, tmp_path / "actor")
        assert [p.name for p in (tmp_path / "actor" / "adapter").iterdir()] == ["transformer_2"]


def test_expert_options_are_refused_where_the_folder_has_one_denoiser(tiny_wan_path, tiny_wan22_path):
    from pixelrl.config import load_config

    base = ["model.max_sequence_length=16", "model.num_frames=5"]
    with pytest.raises(ConfigError, match="model.guidance_scale_2.*one denoiser"):
        load_config("flow_grpo_wan_tiny", [f"model.path={tiny_wan_path}", *base, "model.guidance_scale_2=3"])
    with pytest.raises(ConfigError, match="model.trained_experts.*one or both of"):
        load_config("flow_grpo_wan_tiny", [f"model.path={tiny_wan22_path}", *base,
                                           "model.trained_experts=[transformer_3]"])
    with pytest.raises(ConfigError, match="model.guidance_scale_2.*positive"):
        load_config("flow_grpo_wan_tiny", [f"model.path={tiny_wan22_path}", *base, "model.guidance_scale_2=-1"])
    # the tiny folder's 4 steps: sigma 1.0 on the high-noise expert, 0.86, 0.60 (and the last) on the low-noise one
    window = [*base, f"model.path={tiny_wan22_path}", "rollout.num_steps=4", "rollout.sde_window_size=2",
              "rollout.sde_window_range=[1,3]"]
    with pytest.raises(ConfigError, match=r"rollout.sde_window_range.*frozen expert.*within \[0, 1\]"):
        load_config("flow_grpo_wan_tiny", [*window, "model.trained_experts=[transformer]"])
    load_config("flow_grpo_wan_tiny", [*window, "model.trained_experts=[transformer_2]"])
    load_config("flow_grpo_wan_tiny", [*window[:-1], "rollout.sde_window_range=[0,2]",
                                       "model.trained_experts=[transformer]"])


def _fsdp2_rank(rank, path, port, out):
    """One rank of a 2-rank FSDP2 run: a single row, at sigma 0.95 (high noise) on rank 0 and 0.5
    (low noise) on rank 1; writes the full LoRA gradients."""
    from pixelrl.parallel.fsdp import parallelize_denoiser
    from pixelrl.parallel.group import Mesh, destroy_process_group, init_process_group
    from pixelrl.parallel.state import full_tensor

    torch.set_num_threads(1)
    init_process_group(rank, 2, "127.0.0.1", port)
    model, x, sigmas, text = _lockstep_inputs(path)
    parallelize_denoiser(model, Mesh(world_size=2, rank=rank, strategy="fsdp2"))
    model.predict_velocity(x[rank:rank + 1], sigmas[rank:rank + 1],
                           type(text)(text.embeds[rank:rank + 1])).square().mean().backward()
    grads = {n: full_tensor(p.grad) for n, p in model.transformer.named_parameters() if p.requires_grad}
    if rank == 0:
        torch.save(grads, out)
    destroy_process_group()


def _lockstep_inputs(path):
    from pixelrl.models.lora import add_lora
    from pixelrl.models.wan import WanModel

    torch.manual_seed(0)
    model = WanModel(path, max_sequence_length=16, num_frames=5)
    add_lora(model.transformer, rank=4, alpha=8, target_modules=["to_q", "to_v"])
    with torch.no_grad():
        for name, param in model.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    return model, x, torch.tensor([0.95, 0.5]), model.encode_prompts(PROMPTS)


def test_sharded_experts_run_in_lockstep_when_ranks_hold_rows_of_different_experts(tiny_wan22_path, tmp_path):
    """Under FSDP2 each expert's blocks all-gather across ranks, so a rank whose rows need only one
    expert must still run the other when a peer runs it (else both ranks wait forever): rank 0's
    row is high noise, rank 1's low noise. The run ends, and its reduced gradient (FSDP2's mean
    over ranks) is one process's gradient of the two rows' mean loss: the borrowed row
    contributed zeros."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:  # a free loopback port for the group's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "grads.pt"
    context = mp.spawn(_fsdp2_rank, args=(str(tiny_wan22_path), port, str(out)), nprocs=2, join=False)
    for process in context.processes:
        process.join(timeout=120)
    alive = [p for p in context.processes if p.is_alive()]
    for process in alive:
        process.kill()
    assert not alive, "the ranks hung: an expert ran on one rank only"
    assert all(p.exitcode == 0 for p in context.processes)
    model, x, sigmas, text = _lockstep_inputs(tiny_wan22_path)
    sum(model.predict_velocity(x[r:r + 1], sigmas[r:r + 1], type(text)(text.embeds[r:r + 1])).square().mean()
        for r in (0, 1)).div(2).backward()
    sharded = torch.load(out, weights_only=True)
    assert {n.split(".")[0] for n, g in sharded.items() if g.abs().max() > 0} == {"transformer", "transformer_2"}
    for name, param in model.transformer.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(sharded[name], param.grad, rtol=1e-4, atol=1e-7)
