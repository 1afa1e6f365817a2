"""Fit a recipe to the user's GPUs (`pixelrl plan`, `trainer.fit_to_memory_gb`).

A paper config is written for its authors' cards: 8 GPUs of 80 GB in the Flow-GRPO setting,
with a small micro-batch and gradient checkpointing chosen for that memory. pixelrl's batch
sizes are global (prompts per step, images per optimizer step), so running the recipe on G GPUs
keeps the algorithm as it is: each worker accumulates (images per optimizer step / G) samples
per optimizer step in micro-batches. What G and the card's memory do change is how large those
micro-batches can be, whether checkpointing is needed, and how fast a step runs; this module
chooses them from an estimate of each phase's peak memory and time, and says what it changed.

The estimate is arithmetic on the denoiser's shape (read from the model folder, or the
release's published shape when the folder is not here), calibrated on measurements of
SD3.5-Medium-shaped models on one H200 (docs/benchmarks.md, "On one NVIDIA H200"). Its error
on those measurements is in docs/planning.md; it leaves out communication between GPUs, the
reward's own time and memory, and the VAE decode's time.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from pixelrl.config.evidence import evidence_line
from pixelrl.config.sections import PixelRLConfig
from pixelrl.engine.config import images_per_step, mini_batches_per_epoch, optimizer_steps_per_rollout
from pixelrl.algos.losses import LOSSES
from pixelrl.algos.methods import method_of_loss
from pixelrl.core.errors import AUTO, ConfigError

# --- calibration: SD3.5-Medium shapes, one NVIDIA H200, bf16, torch 2.11 + CUDA 13 ----------------
# Eight measured steps (docs/planning.md lists each prediction beside its measurement): the
# shipped and tuned Flow-GRPO, Flow-GRPO-Fast and AWM cases at 16 images per step, Flow-GRPO-Fast
# at 64 images per step with micro-batches of 16 and 32, and one Wan case.
#
# Bytes a forward with gradient keeps for its backward, per (token x hidden unit x layer) of one
# row: (71.6 GB peak - 5.9 GB resident) / 32 rows of 1229 tokens x 1536 x 24 layers (Flow-GRPO-Fast,
# micro-batch 32); the other seven cases agree within 1%.
# Since then the fused RMS norm keeps no float32 copies of q and k: the tuned SD3.5 case peaked at
# 30.7 GB against 38.8 estimated (2026-11-28). Not refitted: FLUX and Wan, which this constant
# also sizes, always used torch's norm, so a constant fitted on SD3.5 now would be too low for
# them; for SD3.5 and Qwen-Image the estimate errs high, the safe side.
ACTIVATION_BYTES = 45.4
# With gradient checkpointing a block keeps only its input (bf16, both streams) until its
# recompute; one block's full activations live at a time. Not calibrated: the checkpointed cases
# measured peaked while decoding, not in the update.
CHECKPOINT_BYTES = 2.0
# Decoding one sampling micro-batch, per output pixel: an image VAE, (10.2 GB - 5.9 GB) / 8 images
# of 512 x 512 (the checkpointed Flow-GRPO cases, which peaked while decoding); a video VAE (Wan's,
# which decodes frame chunks with a cache), per pixel of the whole clip, from the one Wan case
# (11.2 GB peak, 2 clips of 33 frames): fitted on that point alone, not validated.
DECODE_BYTES_PER_PIXEL = 2070.0
VIDEO_DECODE_BYTES_PER_PIXEL = 422.0
# Time, least squares over the eight steps (all within 9%): a phase takes its FLOPs at a fixed
# fraction of the card's dense bf16 peak, plus a fixed cost per forward-equivalent of each denoiser
# call (host work and kernel launches, which make small micro-batches slow; a backward counts two).
# A checkpointed update call costs one more forward of FLOPs but about five more of that fixed
# cost (the recompute re-enters every block from Python); decoding costs a fixed time per pixel.
ACHIEVED_FRACTION_OF_PEAK = 0.49
SECONDS_PER_FORWARD_CALL = 0.052
CHECKPOINT_OVERHEAD_CALLS = 5.1
DECODE_SECONDS_PER_MEGAPIXEL = 0.18
BACKWARD_FLOPS = 2.0  # a backward costs two forwards
# Compiled blocks (`model.compile`): the denoiser's share of the step (not the decode) at this
# fraction of the eager estimate. One case, measured on the H200 on 2026-11-28: the tuned
# Flow-GRPO step at 7.26 s against 12.31 s estimated eager, less 0.75 s of decode and 0.05 s of
# reward. Sampling sped up more (0.44) than the update (0.57) and the reference forwards (0.64);
# one fraction for all three is within 1% of that step. The eager constants above were fitted on
# the code before the fused RMS norm, which runs that step at 10.96 s (12.52 before): eager
# estimates of SD3.5 and Qwen-Image now err about 10% slow.
COMPILED_DENOISER_FRACTION = 0.56
NEAR_TIE = 0.05  # plans within 5% of the fastest count as equal (the estimate is not finer than that)
# All-gather / all-reduce bus bandwidth per GPU, GB/s: an assumption for NVLink within one node of
# H100s (its links carry 450 GB/s each way); across nodes over 400 Gb/s InfiniBand it is about 45.
LINK_GB_PER_S = 350.0
# The calibration reached 32 rows per denoiser call; past twice that the predicted gain is
# overhead spread thinner, which nothing measured confirms, so the search stops there.
MAX_ROWS_PER_CALL = 64
# what a plan chooses, besides the strategy across several GPUs
SIZE_FIELDS = ("actor.ppo_micro_batch_size", "model.gradient_checkpointing", "rollout.micro_batch_size")
HEADROOM = 0.9  # plan to this fraction of the card: allocator fragmentation, the CUDA context, NCCL
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
TRAINABLE_STATE_BYTES = 16  # float32 weight, gradient and Adam's two moments per trained parameter
LORA_PROJECTIONS_PER_LAYER = 8  # the attention projections of both streams the adapters target


@dataclass(frozen=True)
class Shape:
    """What the estimate needs to know about one model at one resolution."""
    name: str
    denoiser_params: float  # every expert's (Wan 2.2 A14B holds two; a forward runs one)
    encoder_params: float
    vae_params: float
    layers: int
    hidden: int
    seq_tokens: int  # tokens in the denoiser's sequence (image + joint text) per row
    latent_values: int  # one sample's latent (all frames): the float32 values a stored trajectory step holds
    forward_flops: float  # one row's denoiser forward
    frames: int  # decoded frames per sample (1 for images)
    pixels: int  # decoded pixels per frame
    experts: int = 1  # denoisers of equal shape, one per step (model_index.json's transformer_2)
    trained_experts: int = 1  # of them, those model.trained_experts trains

    @property
    def expert_params(self) -> float:
        """One expert's parameters: what a forward passes through (and FSDP2 gathers)."""
        return self.denoiser_params / self.experts

    @property
    def trained_params(self) -> float:
        """The fully fine-tuned parameters: the trained experts'."""
        return self.expert_params * self.trained_experts


def _safetensors_params(folder: Path) -> float:
    """Parameters stored in a component folder's safetensors files (their JSON headers only)."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return float(total)


def model_shape(cfg: PixelRLConfig) -> Shape:
    """The configured model's shape: from its folder when it is here, else from the published
    release of its family; the costs from the family's own formula (its `FamilySpec`)."""
    from pixelrl.models.family import RowInput
    from pixelrl.models.loader import family_spec, folder_transformer, latent_unit, model_family

    m, r = cfg.model, cfg.rollout
    spec = family_spec(m.type)
    folder, transformer = folder_transformer(m.path)
    if transformer is None and spec.release is None:
        raise ConfigError("model.path", m.path, f"planning needs the model folder (its transformer/config.json): "
                          f"the {m.type} family names no published release to plan from")
    loaded = lambda component: spec.loads_component(component, m.max_sequence_length)  # noqa: E731
    if transformer is not None:
        name = str(folder)
        parts = {p.name: _safetensors_params(p) for p in folder.iterdir() if p.is_dir()}
        experts = model_family(m.type).expert_names(folder) or ("transformer",)
        denoiser = sum(parts.get(expert, 0.0) for expert in experts)
        encoders = sum(v for k, v in parts.items() if k.startswith("text_encoder") and loaded(k))
        vae, unit = parts.get("vae", 0.0), latent_unit(m.type, folder) or 16
    else:
        release = spec.release
        transformer, name, denoiser = release.transformer, release.name + " (published shape)", release.denoiser_params
        experts = ("transformer",)
        encoders = sum(v for k, v in release.encoder_params.items() if loaded(k))
        vae, unit = release.vae_params, 16
    pictures = pictures_per_row(cfg, spec.model_class.condition_images)
    if pictures > 1:
        name += f", {pictures} condition pictures a row (data.train_files)"
    row = RowInput(r.resolution, r.resolution, max(1, m.num_frames), spec.text_tokens(m.max_sequence_length), unit,
                   pictures, r.condition_resolution)
    cost = spec.cost(transformer, row)
    trained = len(m.trained_experts) if m.trained_experts else len(experts)
    return Shape(name, denoiser, encoders, vae, cost.layers, cost.hidden, cost.tokens, cost.latent_values,
                 cost.forward_flops, row.frames, r.resolution ** 2, len(experts), trained)


def pictures_per_row(cfg: PixelRLConfig, family_default: int) -> int:
    """Condition images each sample carries: the number the training rows give (one per run) when
    its files are here (prompts, preference pairs or demonstrations, which name sources alike), else
    the family's own (0 for text-to-image, 1 for an edit family)."""
    d = cfg.data
    if not family_default or not d.train_files:
        return family_default
    if not all(Path(f).is_file() for f in d.train_files):  # a recipe planned away from its data
        return family_default
    from pixelrl.data.prompts import PromptDataset

    # counted without opening the images: this runs at every config load (the step-size check),
    # and loading the rows for training checks each image once
    counts = PromptDataset.from_files(d.train_files, d.prompt_key, check_images=False).condition_counts()
    return max(counts) if counts else family_default


@dataclass(frozen=True)
class Work:
    """One worker's denoiser work in a step. A row is one sample at one step in one CFG branch."""
    sampled_images: int
    sampling_steps: int
    trained_samples: int  # samples (or preference pairs) the update trains on
    substeps: int  # per sample: trained window steps, or drawn timesteps
    rows_per_substep: int  # CFG branches (transition), the pair (Diffusion-DPO), else 1
    substeps_per_call: int  # actor.window_steps_per_forward (0 = all)
    no_grad_passes: float  # forwards without gradient per trained sub-step: reference, old policy, teacher
    epochs: int
    branches: int  # CFG branches while sampling
    optimizer_steps: int  # per rollout batch (epochs x mini-batches)
    pool_images: int = 0  # rollout.oversample's candidates, sampled deterministically and decoded
    pool_steps: int = 0


def _cfg_branches(cfg: PixelRLConfig) -> int:
    from pixelrl.models.loader import model_family

    return 2 if cfg.rollout.guidance_scale > 1 and model_family(cfg.model.type).uses_negative_prompt else 1


def data_ranks(cfg: PixelRLConfig, gpus: int) -> int:
    """GPUs holding different rows: a sequence group's GPUs hold the same ones."""
    return gpus // cfg.trainer.sequence_parallel_size


def step_work(cfg: PixelRLConfig, gpus: int) -> Work:
    from pixelrl.algos.losses import LOSSES, REFERENCE_STEP_KEYS

    r, a = cfg.rollout, cfg.actor
    gpus = data_ranks(cfg, gpus)  # each GPU of a sequence group runs every forward of its rows
    images = images_per_step(cfg) // gpus
    loss = LOSSES.get(cfg.diffusion_loss.name)
    method = method_of_loss(loss)
    if not method.samples_through_producer and method.attempt_cycle is not None:  # DMD2's cycle of attempts
        return _attempt_cycle_work(cfg, loss, images)
    branches = _cfg_branches(cfg)
    if method.rescores_transitions:
        window = r.sde_window_size or r.num_steps - 1
        substeps = max(1, int(window * a.timestep_fraction)) if a.permute_timesteps \
            else min(window, max(1, int(r.num_steps * a.timestep_fraction)))
        # no-grad replays of the stored steps: the reference (KL) and a distillation teacher
        passes = int(cfg.diffusion_loss.kl_coef > 0) + int(loss.reads_teacher(loss.bind(cfg.diffusion_loss)))
        per_substep, samples = branches, images
    else:  # forward process: no guidance in training, as the references
        bound = loss.bind(cfg.diffusion_loss)
        substeps = getattr(bound, "num_timesteps", 1)
        needed = set(loss.step_keys_needed(bound))
        pairs = loss.trains_on_pairs
        per_substep = 2 if pairs else 1  # chosen and rejected side by side
        passes = int(bool(needed & REFERENCE_STEP_KEYS)) + int("v_old" in needed)
        # a pair per prompt; a demonstration per row (supervised fine-tuning); else every sample
        samples = cfg.data.train_batch_size // gpus if pairs or method.trains_on_demonstrations else images
    sampled = images if cfg.algorithm.sample_source == "online" and method.samples_through_producer else 0
    over = r.oversample
    pool = sampled * over.factor if over.enabled else 0
    if pool and not over.regenerate:
        sampled = 0  # the kept candidates are trained as they are
    return Work(sampled, r.num_steps, samples, substeps, per_substep, min(a.window_steps_per_forward or substeps,
                substeps), passes, a.ppo_epochs, branches, optimizer_steps_per_rollout(cfg), pool,
                over.num_steps or r.num_steps)


def _attempt_cycle_work(cfg: PixelRLConfig, loss, images: int) -> Work:
    """DMD2's step, one cycle of attempts, each over a step's images: the student's Euler steps
    before the exit (on average (S - 1) / 2, no gradient) and one forward with gradient (the
    student's exit in a student attempt, the fake score's in a fake one); a student attempt also
    runs the teacher (both guidance branches) and the fake score without gradient, a fake
    attempt the student's exit forward. Nothing is decoded."""
    from pixelrl.algos.distribution_matching import update_cycle
    from pixelrl.models.loader import model_family

    bound = loss.bind(cfg.diffusion_loss)
    cycle = update_cycle(bound)
    teacher = 2 if bound.teacher_guidance > 1 and model_family(cfg.model.type).uses_negative_prompt else 1
    before_exit = (cfg.rollout.num_steps - 1) / 2
    no_grad = sum(before_exit + (teacher + 1 if role == "student" else 1) for role in cycle) / len(cycle)
    return Work(0, cfg.rollout.num_steps, images * len(cycle), 1, 1, 1, no_grad, 1, 1, len(cycle))


def teacher_weights_of(cfg: PixelRLConfig) -> dict:
    """A distillation run's teachers: each distinct `diffusion_loss.teacher` entry's weights (None
    for the base); empty when the loss reads no teacher."""
    from pixelrl.algos.distillation import teacher_routes
    from pixelrl.engine.checkpoint import teacher_weights

    loss = LOSSES.get(cfg.diffusion_loss.name)
    if not loss.reads_teacher(loss.bind(cfg.diffusion_loss)) or method_of_loss(loss).reads_teacher:
        return {}  # DMD2's teacher is the base with its adapters off
    return {spec: teacher_weights(spec) for spec in set(teacher_routes(cfg.diffusion_loss.teacher).values())}


def _method(cfg: PixelRLConfig):
    """The method family of the run's loss (the planner reads a plan by its loss, as a validated
    config's algorithm.trainer_type always names the same family)."""
    return method_of_loss(LOSSES.get(cfg.diffusion_loss.name))


def trained_roles(cfg: PixelRLConfig) -> int:
    """Networks the run trains, each with its own adapter (or weights) and optimizer state."""
    return len(_method(cfg).trained_roles)


@dataclass(frozen=True)
class Choice:
    micro_batch: int  # actor.ppo_micro_batch_size
    checkpointing: bool
    sampling_micro_batch: int  # rollout.micro_batch_size
    strategy: str = ""  # trainer.strategy ("" = the config's)


@dataclass(frozen=True)
class Estimate:
    resident_gb: float
    update_gb: float
    sampling_gb: float
    sampling_s: float
    no_grad_s: float
    update_s: float
    step_flops: float
    communication_gb: float = 0.0  # sent and received per GPU per step
    communication_s: float = 0.0  # at the link bandwidth, none of it hidden behind compute

    @property
    def peak_gb(self) -> float:
        return self.resident_gb + max(self.update_gb, self.sampling_gb)

    @property
    def step_s(self) -> float:
        return self.sampling_s + self.no_grad_s + self.update_s


def resident_bytes(cfg: PixelRLConfig, shape: Shape, gpus: int) -> float:
    """Weights and optimizer state held for the whole run on each GPU: FSDP2 shards the denoiser
    (and a full fine-tune's state) over the GPUs; the encoders and the VAE are replicated, and so
    is a full fine-tune's frozen reference copy, taken before sharding."""
    from pixelrl.algos.losses import LOSSES

    m = cfg.model
    width = DTYPE_BYTES.get(m.dtype, 4)
    shards = gpus if cfg.trainer.strategy == "fsdp2" else 1
    teachers = teacher_weights_of(cfg)
    whole_teachers = sum(1 for weights in teachers.values() if weights is not None and weights.kind == "full")
    if m.lora_rank:
        trainable = lora_parameters(cfg, shape) * trained_roles(cfg)  # DMD2: the student's and the fake score's
        frozen = shape.denoiser_params * width / shards
    else:
        loss = LOSSES.get(cfg.diffusion_loss.name)
        trainable = shape.trained_params / shards
        keeps_reference = loss.reads_reference(loss.bind(cfg.diffusion_loss)) or None in teachers.values()
        # the experts left frozen stay in the compute dtype; the reference copies the whole denoiser
        frozen = (shape.denoiser_params - shape.trained_params) * width / shards
        frozen += shape.denoiser_params * width if keeps_reference else 0.0
    # a whole fine-tuned distillation teacher is a frozen copy of the denoiser, replicated as the reference
    frozen += whole_teachers * shape.denoiser_params * width
    ema = 4 * trainable if cfg.actor.ema_decay > 0 else 0.0
    return frozen + trainable * TRAINABLE_STATE_BYTES + ema + (shape.encoder_params + shape.vae_params) * width


def estimate(cfg: PixelRLConfig, shape: Shape, work: Work, gpus: int, choice: Choice, peak_tflops: float,
             link_gb_per_s: float = LINK_GB_PER_S) -> Estimate:
    """Per-GPU peak memory, phase times and communication of one step under `choice`."""
    rate = ACHIEVED_FRACTION_OF_PEAK * peak_tflops * 1e12
    # a sequence group's GPU holds 1/P of each row's tokens and does 1/P of its work (the
    # attention over H/P heads; the text a split family keeps whole is small beside the video)
    split = cfg.trainer.sequence_parallel_size
    token_layer = shape.seq_tokens * shape.hidden * shape.layers / split
    # the engine splits each worker's optimizer-step share into micro-batches: a larger setting runs
    # as the whole share
    micro_batch = min(choice.micro_batch, _samples_per_optimizer_step(cfg, gpus))
    rows_per_call = micro_batch * work.rows_per_substep * work.substeps_per_call
    if choice.checkpointing:
        kept = token_layer * CHECKPOINT_BYTES + token_layer / shape.layers * ACTIVATION_BYTES
    else:
        kept = token_layer * ACTIVATION_BYTES
    per_pixel = DECODE_BYTES_PER_PIXEL if shape.frames == 1 else VIDEO_DECODE_BYTES_PER_PIXEL
    sampling_bytes = choice.sampling_micro_batch * shape.frames * shape.pixels * per_pixel
    f = shape.forward_flops / split
    sampling_calls = (math.ceil(work.sampled_images / choice.sampling_micro_batch) * work.sampling_steps
                      + math.ceil(work.pool_images / choice.sampling_micro_batch) * work.pool_steps)
    sampling_flops = (work.sampled_images * work.sampling_steps + work.pool_images * work.pool_steps) * work.branches * f
    calls = math.ceil(work.trained_samples / micro_batch) * math.ceil(work.substeps / work.substeps_per_call)
    rows = work.trained_samples * work.substeps * work.rows_per_substep
    per_update_call = 1 + BACKWARD_FLOPS + choice.checkpointing  # forward-equivalents of FLOPs
    update_flops = rows * work.epochs * f * per_update_call
    update_overheads = 1 + BACKWARD_FLOPS + choice.checkpointing * CHECKPOINT_OVERHEAD_CALLS
    no_grad_flops = rows * work.no_grad_passes * f
    sent = communication_bytes(cfg, shape, work, gpus, sampling_calls + calls * work.no_grad_passes,
                               calls * work.epochs)
    row_passes = (sampling_flops + no_grad_flops) / f + rows * work.epochs * (2 + choice.checkpointing)
    sent += sequence_bytes(cfg, shape, row_passes)
    denoiser = COMPILED_DENOISER_FRACTION if compiles_blocks(cfg) else 1.0  # of the eager time
    return Estimate(resident_bytes(cfg, shape, gpus) / 1e9, rows_per_call * kept / 1e9, sampling_bytes / 1e9,
                    denoiser * (sampling_flops / rate + sampling_calls * SECONDS_PER_FORWARD_CALL)
                    + (work.sampled_images + work.pool_images) * shape.frames * shape.pixels / 1e6
                    * DECODE_SECONDS_PER_MEGAPIXEL,
                    denoiser * (no_grad_flops / rate + calls * work.no_grad_passes * SECONDS_PER_FORWARD_CALL),
                    denoiser * (update_flops / rate + calls * work.epochs * update_overheads * SECONDS_PER_FORWARD_CALL),
                    sampling_flops + no_grad_flops + update_flops, sent / 1e9, sent / 1e9 / link_gb_per_s)


def communication_bytes(cfg: PixelRLConfig, shape: Shape, work: Work, gpus: int, forward_calls: int,
                        backward_calls: int) -> float:
    """Bytes each GPU moves per step (ring collectives: (G - 1) / G of the buffer each way).
    FSDP2 all-gathers the sharded denoiser for every forward and again for every backward, and
    reduce-scatters the trained gradients after every backward; DDP (pixelrl's) all-reduces the
    trained gradients once per optimizer step (2 x the buffer)."""
    if gpus == 1:
        return 0.0
    m, ring = cfg.model, (gpus - 1) / gpus
    trained = lora_parameters(cfg, shape) if m.lora_rank else shape.trained_params
    if cfg.trainer.strategy == "fsdp2":
        weights = shape.expert_params * DTYPE_BYTES.get(m.dtype, 4)  # a forward gathers its step's expert
        return ring * ((forward_calls + 2 * backward_calls) * weights + backward_calls * trained * 4)
    return ring * 2 * trained * 4 * work.optimizer_steps


def compiles_blocks(cfg: PixelRLConfig) -> bool:
    """Whether the engine compiles the denoiser's blocks: `model.compile`, never under a sequence split."""
    return cfg.model.compiles() and cfg.trainer.sequence_parallel_size == 1


def sequence_bytes(cfg: PixelRLConfig, shape: Shape, row_passes: float) -> float:
    """Bytes each GPU of a sequence group of P moves per step: four all-to-alls (q, k, v, the
    output) around every self-attention of every pass of a row through the denoiser (forward,
    backward, recompute), each sending (P - 1) / P of its local (S / P) x hidden tensor."""
    split = cfg.trainer.sequence_parallel_size
    if split == 1:
        return 0.0
    local = shape.seq_tokens / split * shape.hidden * DTYPE_BYTES.get(cfg.model.dtype, 4)
    return row_passes * shape.layers * 4 * (split - 1) / split * local


def lora_parameters(cfg: PixelRLConfig, shape: Shape) -> float:
    """The adapters on each layer's attention projections of both streams: rank x (in + out) each,
    on each trained expert."""
    return cfg.model.lora_rank * 2 * shape.hidden * LORA_PROJECTIONS_PER_LAYER * shape.layers * shape.trained_experts


# errors about things on the user's machine (folders, files) rather than the recipe: a plan made
# elsewhere (a paper config naming /models/...) notes them and goes on
MACHINE_FIELDS = ("model.path", "reward.functions", "data.train_files", "data.val_files", "trainer.default_local_dir",
                  "vlm.ptx_files", "diffusion_loss.teacher")


def check_recipe(cfg: PixelRLConfig) -> list[str]:
    """Every config check. A recipe error is raised; one about this machine's files (MACHINE_FIELDS)
    is noted and a stand-in takes its place (a rule reward, a scratch folder) so that the checks
    after it still run: a plan made away from the data and models names every missing path at
    once. The data files, which only a run's start reads, are looked for too."""
    import copy
    import tempfile

    from pixelrl.config.step_size import DriverMemoryError
    from pixelrl.config.validation import validate

    notes, cfg = [], copy.deepcopy(cfg)
    with tempfile.TemporaryDirectory(prefix="pixelrl_plan_") as scratch:
        for _ in MACHINE_FIELDS:
            try:
                validate(cfg)
                break
            except ConfigError as err:
                if not (err.field.startswith(MACHINE_FIELDS) or isinstance(err, DriverMemoryError)):
                    raise
                notes.append(str(err))
                if not _stand_in(cfg, err.field, scratch):  # the driver's memory is checked last: done
                    break
    for field in ("data.train_files", "data.val_files"):
        missing = [f for f in getattr(cfg.data, field.split(".")[1]) if ":" not in str(f) and not Path(f).is_file()]
        if missing:
            notes.append(f"config field `{field}`: {missing} not found here")
    return notes


def _stand_in(cfg: PixelRLConfig, field: str, scratch: str) -> bool:
    """Put a stand-in for what `field` names on another machine; False when there is none."""
    if field.startswith("reward.functions"):
        cfg.reward.functions = [{"name": "jpeg_compressibility", "weight": 1.0}]
    elif field == "model.path":
        cfg.model.path = scratch
    elif field == "trainer.default_local_dir":
        cfg.trainer.default_local_dir = scratch
    else:
        return False
    return True


@dataclass
class Plan:
    shape: Shape
    gpus: int
    gpu_memory_gb: float
    peak_tflops: float
    choice: Choice
    estimate: Estimate
    changes: list  # (field, was, now, why)
    unchecked: list[str]  # the machine-specific checks that failed here
    samples_per_optimizer_step: int  # per worker
    link_gb_per_s: float = LINK_GB_PER_S

    @property
    def overrides(self) -> list[str]:
        return [f"{name}={_text(now)}" for name, _, now, _ in self.changes]


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _divisors(n: int, cap: int | None = None) -> list[int]:
    return [d for d in range(min(n, cap or n), 0, -1) if n % d == 0]


def _samples_per_optimizer_step(cfg: PixelRLConfig, gpus: int) -> int:
    if LOSSES.get(cfg.diffusion_loss.name).trains_on_pairs:  # one pair per prompt
        return cfg.data.train_batch_size // (data_ranks(cfg, gpus) * mini_batches_per_epoch(cfg))
    if trained_roles(cfg) > 1:  # DMD2: an attempt's images, one optimizer step
        return images_per_step(cfg) // data_ranks(cfg, gpus)
    return (cfg.actor.ppo_mini_batch_size or images_per_step(cfg)) // data_ranks(cfg, gpus)


def written_sizes(cfg: PixelRLConfig) -> dict:
    """The SIZE_FIELDS as the config has them (numbers, booleans or `auto`)."""
    return {"actor.ppo_micro_batch_size": cfg.actor.ppo_micro_batch_size,
            "model.gradient_checkpointing": cfg.model.gradient_checkpointing,
            "rollout.micro_batch_size": cfg.rollout.micro_batch_size}


def plan_for(cfg: PixelRLConfig, gpus: int, gpu_memory_gb: float, peak_tflops: float = 989.0,
             field: str = "--gpu-memory", link_gb_per_s: float = LINK_GB_PER_S, free: tuple | None = None) -> Plan:
    """The fastest strategy, micro-batches and checkpointing whose estimated peak fits
    `gpu_memory_gb` on each of `gpus` GPUs, with everything that defines the algorithm kept.
    Communication counts in full (none hidden behind compute) when comparing DDP with FSDP2.
    `free` names the SIZE_FIELDS chosen (None: all of them and the strategy); the others stay as
    the config has them."""
    if gpus < 1:
        raise ConfigError("--gpus", gpus, "the number of GPUs (one worker each), at least 1")
    if not gpu_memory_gb > 0:
        raise ConfigError(field, gpu_memory_gb, "each GPU's memory in GB, e.g. 80 for an H100 / A100-80GB")
    planned = replace(cfg, trainer=replace(cfg.trainer, n_workers=gpus,
                                           backend="ray" if gpus > 1 else cfg.trainer.backend))
    images, split = images_per_step(cfg), cfg.trainer.sequence_parallel_size
    keeps = lambda g: g % split == 0 and images % (g // split) == 0 and \
        (cfg.actor.ppo_mini_batch_size or images) % (g // split) == 0  # noqa: E731
    if not keeps(gpus):
        fitting = [g for g in range(1, 65) if keeps(g)]
        over = f"{gpus} GPUs" + (f" in sequence groups of {split}" if split > 1 else "")
        raise ConfigError("--gpus", gpus, f"the recipe's {images} images per step and "
                          f"{cfg.actor.ppo_mini_batch_size or images} per optimizer step do not split evenly over "
                          f"{over}; GPU counts that keep the recipe: {fitting}")
    shape, work = model_shape(planned), step_work(planned, gpus)
    per_worker = _samples_per_optimizer_step(planned, gpus)
    budget = gpu_memory_gb * HEADROOM
    # one GPU: nothing to shard or average
    strategies = (cfg.trainer.strategy,) if gpus == 1 or free is not None else ("ddp", "fsdp2")
    chosen = SIZE_FIELDS if free is None else free
    # a loss that sums over prompt groups trains whole groups per micro-batch
    group = cfg.rollout.n if LOSSES.get(cfg.diffusion_loss.name).whole_groups else 1
    micros = [m for m in _divisors(per_worker, max(1, MAX_ROWS_PER_CALL // (work.rows_per_substep * work.substeps_per_call)))
              if m % group == 0] or [per_worker]
    micros = micros if "actor.ppo_micro_batch_size" in chosen else [cfg.actor.ppo_micro_batch_size]
    recompute = (False, True) if "model.gradient_checkpointing" in chosen else (cfg.model.gradient_checkpointing,)
    # a method that samples nothing to train on (SFT, offline DPO) keeps the validation's sampling
    # micro-batch: a step's sampling cost says nothing of it
    sampled = work.sampled_images or work.pool_images
    sizes_sampling = "rollout.micro_batch_size" in chosen and (sampled or cfg.rollout.micro_batch_size == AUTO)
    samplings = _divisors(sampled or 1, max(1, MAX_ROWS_PER_CALL // work.branches)) \
        if sizes_sampling else [cfg.rollout.micro_batch_size]
    options = []
    for strategy in strategies:
        sharded = replace(planned, trainer=replace(planned.trainer, strategy=strategy))
        for micro in micros:
            for checkpointing in recompute:
                for sampling in samplings:
                    choice = Choice(micro, checkpointing, sampling, strategy)
                    est = estimate(sharded, shape, work, gpus, choice, peak_tflops, link_gb_per_s)
                    options.append((est.peak_gb <= budget, choice, est))
    fitting = [(choice, est) for fits, choice, est in options if fits]
    if not fitting:
        _, least, smallest = min(options, key=lambda o: o[2].peak_gb)
        raise ConfigError(field, gpu_memory_gb, f"no micro-batch fits: the smallest setting (micro-batch "
                          f"{least.micro_batch}, gradient checkpointing {_text(least.checkpointing)}, sampling "
                          f"micro-batch {least.sampling_micro_batch}) needs about {smallest.peak_gb:.0f} "
                          f"GB per GPU, {smallest.resident_gb:.0f} GB of it weights and optimizer state ({shape.name}); "
                          "use more GPUs with trainer.strategy=fsdp2, a LoRA (model.lora_rank > 0) or a lower "
                          "rollout.resolution" + (f", or {AUTO} for {', '.join(n for n in SIZE_FIELDS if n not in chosen)}"
                                                  if len(chosen) < len(SIZE_FIELDS) else ""))
    # within NEAR_TIE of the fastest, prefer no recompute and then the largest micro-batches: the
    # estimate's error is larger than such differences
    def seconds(e: Estimate) -> float:
        return e.step_s + e.communication_s

    fastest = min(seconds(est) for _, est in fitting)
    choice, est = max(((c, e) for c, e in fitting if seconds(e) <= fastest * (1 + NEAR_TIE)),
                      key=lambda ce: (ce[0].strategy == cfg.trainer.strategy, not ce[0].checkpointing,
                                      ce[0].micro_batch, ce[0].sampling_micro_batch))
    planned = apply_choice(planned, choice)
    unchecked = check_recipe(planned)
    peak = f"an estimated {est.peak_gb:.0f} of {gpu_memory_gb:g} GB"
    reasons = {
        "trainer.n_workers": f"one worker per GPU; batch sizes are global, so each worker accumulates {per_worker} "
                             "samples per optimizer step",
        "actor.ppo_micro_batch_size": f"the fastest update that fits ({peak} per GPU, {HEADROOM:.0%} planned)",
        "model.gradient_checkpointing": "on: without it no micro-batch fits" if choice.checkpointing
                                        else "off: the update fits without it, and the recompute would cost time",
        "rollout.micro_batch_size": "images per sampling call (and per decode) that fit beside the weights",
        "trainer.strategy": "ddp: the replicated weights fit, and it saves FSDP2's all-gather of the denoiser on "
                            "every call" if choice.strategy == "ddp" else
                            "fsdp2: sharding the weights leaves room for larger micro-batches, which outweighs its "
                            "all-gathers",
    }
    was = {"trainer.n_workers": cfg.trainer.n_workers, "trainer.strategy": cfg.trainer.strategy, **written_sizes(cfg)}
    now = {"trainer.n_workers": gpus, "trainer.strategy": choice.strategy,
           "actor.ppo_micro_batch_size": choice.micro_batch,
           "model.gradient_checkpointing": choice.checkpointing, "rollout.micro_batch_size": choice.sampling_micro_batch}
    if gpus > 1 and cfg.trainer.backend == "local":
        was["trainer.backend"], now["trainer.backend"] = "local", "ray"
        reasons["trainer.backend"] = "several workers run under Ray"
    changes = [(k, was[k], now[k], reasons[k]) for k in now if was[k] != now[k]]
    return Plan(shape, gpus, gpu_memory_gb, peak_tflops, choice, est, changes, unchecked, per_worker, link_gb_per_s)


def apply_choice(cfg: PixelRLConfig, c: Choice) -> PixelRLConfig:
    """`cfg` with a plan's choices (the number of workers is the config's own)."""
    return replace(cfg, trainer=replace(cfg.trainer, strategy=c.strategy or cfg.trainer.strategy),
                   actor=replace(cfg.actor, ppo_micro_batch_size=c.micro_batch),
                   model=replace(cfg.model, gradient_checkpointing=c.checkpointing),
                   rollout=replace(cfg.rollout, micro_batch_size=c.sampling_micro_batch))


def reward_names(cfg) -> str:
    """`name (weight w)` of each configured reward, for the lines that say what a run trains on."""
    return ", ".join(f"{spec.get('name')} (weight {float(spec.get('weight', 1.0)):g})" for spec in cfg.reward.functions)


def _loss_settings(cfg: PixelRLConfig) -> str:
    """The loss and the settings of it the recipe wrote: a transition loss's clip and KL, which it
    reads; a forward-process loss's own params (AWM's reference weight, NFT's beta, ...), since
    the transition fields mean nothing to it."""
    loss = cfg.diffusion_loss
    if _method(cfg).rescores_transitions:
        return f"{loss.name} (clip {loss.clip_ratio:g}, KL {loss.kl_coef:g})"
    params = ", ".join(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
                       for name, value in dict(loss.params or {}).items())
    return f"{loss.name} ({params or 'its default params'})"


def _attempts_per_step(cfg: PixelRLConfig) -> int:
    """DMD2's attempts per training step (each over a step's images), else 1."""
    if trained_roles(cfg) == 1:
        return 1
    from pixelrl.algos.distribution_matching import cycle_of

    return len(cycle_of(cfg.diffusion_loss))


def _schedule_kept(cfg: PixelRLConfig) -> str:
    a, images = cfg.actor, images_per_step(cfg)
    if trained_roles(cfg) > 1:
        return (f"{cfg.data.train_batch_size} prompts x {cfg.rollout.n} images = {images} images per attempt, one "
                f"optimizer step each, {_attempts_per_step(cfg)} attempts per step; student lr {a.lr:g}, {_loss_settings(cfg)}")
    return (f"{cfg.data.train_batch_size} prompts x {cfg.rollout.n} images = {images} images per step, "
            f"{a.ppo_mini_batch_size or images} per optimizer step, {optimizer_steps_per_rollout(cfg)} optimizer "
            f"step(s) per rollout batch, lr {a.lr:g}, {_loss_settings(cfg)}")


def _run_total(cfg: PixelRLConfig, step_s: float) -> str:
    """The whole run at the estimated step time, with a word when one step is long."""
    steps = cfg.trainer.total_training_steps
    line = (f"whole run: {steps} steps x {step_s:.1f} s = {steps * step_s / 3600:.1f} h, before validation and "
            "checkpoints" if steps else
            f"whole run: an epoch of the training files (trainer.total_training_steps 0, not counted here) at "
            f"{step_s / 60:.1f} minutes per step")
    if step_s > 600:
        line += (f"; one step takes {step_s / 60:.0f} minutes: more GPUs shorten it (a smaller data.train_batch_size "
                 "or rollout.n would change the algorithm)")
    return line


def describe(cfg: PixelRLConfig, plan: Plan, config_name: str | None = None) -> str:
    """The plan as text: what stays, what changes and why, the estimate, the command."""
    e, s = plan.estimate, plan.shape
    images = images_per_step(cfg) * _attempts_per_step(cfg)
    no_grad = ("no-grad forwards (the student's steps before its exit, the teacher, the fake score)"
               if trained_roles(cfg) > 1 else "reference/old forwards")
    lines = [f"plan: {config_name or 'config'} on {plan.gpus} GPU(s) of {plan.gpu_memory_gb:g} GB, "
             f"{plan.peak_tflops:g} TFLOP/s dense bf16 peak each",
             *filter(None, [evidence_line(config_name)]),  # what stands behind a shipped recipe
             f"model: {s.name}: denoiser {s.denoiser_params / 1e9:.2f}B"
             + (f" ({s.experts} experts, {s.trained_experts} trained)" if s.experts > 1 else "")
             + f", text encoders {s.encoder_params / 1e9:.2f}B, "
             f"{s.seq_tokens} tokens per row, {s.forward_flops / 1e12:.2f} TFLOP per row forward",
             "kept (defines the algorithm): " + _schedule_kept(cfg),
             f"reward: {reward_names(cfg)}" + (" (scores validation only: DMD2 trains on none)"
                                               if trained_roles(cfg) > 1 else "")]
    lines.append("changed:" if plan.changes else "changed: nothing (the recipe already fits)")
    lines += [f"  {name}: {_text(was)} -> {_text(now)}  ({why})" for name, was, now, why in plan.changes]
    unit = "videos" if s.frames > 1 else "images"
    step_s = e.step_s + e.communication_s  # none of the communication hidden: the planner's own assumption
    lines += [f"estimate per GPU: peak {e.peak_gb:.1f} GB = weights and state {e.resident_gb:.1f} + the larger of "
              f"the update's activations {e.update_gb:.1f} and sampling and decode {e.sampling_gb:.1f} (they never "
              "run at once)",
              f"estimate per step: {step_s:.1f} s (sampling {e.sampling_s:.1f}, {no_grad} {e.no_grad_s:.1f}, update "
              f"{e.update_s:.1f}" + (f", communication {e.communication_s:.1f}" if plan.gpus > 1 else "")
              + f"), {images / step_s / plan.gpus:.2f} {unit}/s per GPU, {e.step_flops / 1e15:.2f} PFLOP per GPU; "
              + ("compiled blocks (model.compile, about 95 s of compiling once not included); " if compiles_blocks(cfg)
                 else "")
              + "the rewards' time not included (sampling includes the decode)"]
    if plan.gpus > 1:
        lines.append(f"communication per GPU per step ({plan.choice.strategy}): {e.communication_gb:.0f} GB, "
                     f"{e.communication_s:.1f} s at {plan.link_gb_per_s:g} GB/s, counted as if none of it "
                     "overlapped compute")
    if cfg.trainer.sequence_parallel_size > 1:
        split = cfg.trainer.sequence_parallel_size
        lines.append(f"sequence parallel: each row on {split} GPUs (trainer.sequence_parallel_size), each holding "
                     f"{s.seq_tokens // split} of its {s.seq_tokens} tokens: activations and work per GPU / {split}, "
                     "the all-to-alls around each self-attention in the communication")
    lines.append(_run_total(cfg, step_s))
    lines.extend(f"not checked on this machine: {note}" for note in plan.unchecked)
    command = " ".join(["pixelrl train"] + ([f"--config-name {config_name}"] if config_name else []) + plan.overrides)
    lines.append(f"run: {command}")
    return "\n".join(lines)
