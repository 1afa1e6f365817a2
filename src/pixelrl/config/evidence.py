"""What stands behind each shipped recipe: its evidence level and where the evidence is.

Every config in `src/pixelrl/configs/` has one entry; `pixelrl train` prints it at start-up and
`pixelrl plan` with its plan, and `docs/algorithms/paper_settings.md` carries the table
(`evidence_table`). A level names what was measured for that recipe itself, never what a
neighbour measured; `tests/test_evidence.py` checks that every named test exists and names the
recipe, and that every named doc section exists and names it.
"""

from __future__ import annotations

from dataclasses import dataclass

# highest first
LEVELS = {
    "reproduced": "reproduces the paper's reported numbers on the paper's model",
    "proxy-gated": "learns on the shapes world: its held-out evaluation beats the untrained model beyond the "
                   "bootstrap interval, on today's model and code",
    "measured": "trained on the shapes world and evaluated on its held-out set, a gain not established (one seed "
                "without an interval, intervals that overlap, or a model since replaced)",
    "real-size": "ran at the real model's size on a GPU (random weights of its real shapes): time and memory per "
                 "step measured, learning not",
    "tiny-e2e": "trains end to end through `pixelrl train` on a tiny random model in the test suite",
    "composes": "composes, passes its checks and plans; its update schedule is checked against the reference "
                "code where it has one",
}

H200 = "docs/benchmarks.md#on-one-nvidia-h200-the-paper-configs-on-random-weight-models-of-the-real-shapes"
SCHEDULE = "tests/test_fidelity.py::test_paper_configs_take_the_reference_number_of_optimizer_steps_per_rollout"
EDIT_SAMPLING = "tests/test_fidelity.py::test_edit_paper_configs_sample_as_their_references"
SHAPES_METHODS = "docs/benchmarks.md#forward-process-methods-vs-flow-grpo-fast-on-the-shapes-model"
PG_TINY = "tests/test_pg_family.py::test_each_method_runs_as_itself_through_the_trainer_and_its_checkpoint_reloads"
DIRECT_TINY = "tests/test_forward_process.py::test_direct_preference_resume_is_exact_with_the_old_adapter"
MORE_TINY = "tests/test_evidence.py::test_the_recipes_no_other_test_trains_train_end_to_end_and_resume"


@dataclass(frozen=True)
class Evidence:
    level: str
    where: tuple[str, ...]  # `tests/<file>.py::<test>` or `docs/<page>.md#<anchor>`
    note: str = ""


RECIPES: dict[str, Evidence] = {
    # paper settings: their references' schedules, at most timed at real size
    "flow_grpo_sd35": Evidence("real-size", (H200, SCHEDULE)),
    "flow_grpo_fast_sd35": Evidence("real-size", (H200, SCHEDULE)),
    "awm_sd35": Evidence("real-size", (H200, SCHEDULE)),
    "dance_grpo_wan": Evidence("real-size", (H200, SCHEDULE)),
    "grpo_guard_sd35": Evidence("composes", (SCHEDULE,)),
    "flow_dppo_sd35": Evidence("composes", (SCHEDULE,)),
    "dance_grpo_sd35": Evidence("composes", (SCHEDULE,)),
    "mixgrpo_sd35": Evidence("composes", (SCHEDULE,)),
    "nft_sd35": Evidence("composes", (SCHEDULE,)),
    "sol_rl_sd35": Evidence("composes", (SCHEDULE,)),
    "dgpo_sd35": Evidence("composes", ("tests/test_fidelity.py::test_dgpo_paper_config_samples_trains_and_evaluates_as_"
                                       "the_reference", SCHEDULE)),
    "dpo_sd35": Evidence("composes", (SCHEDULE,)),
    "flow_grpo_flux": Evidence("composes", (SCHEDULE,)),
    "dance_grpo_flux": Evidence("composes", (SCHEDULE,)),
    "flow_grpo_qwen_image": Evidence("composes", (SCHEDULE,)),
    "flow_grpo_flux_kontext": Evidence("composes", (EDIT_SAMPLING, SCHEDULE)),
    "flow_grpo_counting_flux_kontext": Evidence("composes", (EDIT_SAMPLING, SCHEDULE)),
    "flow_grpo_qwen_image_edit": Evidence("composes", (EDIT_SAMPLING, SCHEDULE)),
    "nft_qwen_image_edit": Evidence("composes", (EDIT_SAMPLING, SCHEDULE)),
    "dmd2_sd35": Evidence("composes", ("tests/test_dmd2.py::test_the_dmd2_presets_keep_their_references_schedules",)),
    "dmd2_qwen_image": Evidence("composes", ("tests/test_dmd2.py::test_the_dmd2_presets_keep_their_references_"
                                             "schedules",)),
    "opd_sd35": Evidence("composes", ("tests/test_distillation.py::test_opd_sd35_keeps_the_launchers_update_"
                                      "schedule",)),
    "opd_ode_sd35": Evidence("composes", ("tests/test_distillation.py::test_the_diffusion_opd_config_samples_and_"
                                          "updates_as_its_reference",)),
    # tiny models
    "flow_grpo_tiny": Evidence("tiny-e2e", ("tests/test_distillation.py::test_on_policy_distillation_pulls_the_"
                                            "student_onto_its_teacher",)),
    "flow_grpo_fast_tiny": Evidence("tiny-e2e", (PG_TINY,)),
    "cps_tiny": Evidence("tiny-e2e", (PG_TINY,)),
    "mixgrpo_tiny": Evidence("tiny-e2e", (PG_TINY,)),
    "dance_grpo_tiny": Evidence("tiny-e2e", (PG_TINY,)),
    "grpo_guard_tiny": Evidence("tiny-e2e", (PG_TINY,)),
    "flow_dppo_tiny": Evidence("tiny-e2e", (PG_TINY,)),
    "decoupled_tiny": Evidence("tiny-e2e", (PG_TINY,)),
    "nft_tiny": Evidence("tiny-e2e", (DIRECT_TINY,)),
    "dpo_tiny": Evidence("tiny-e2e", (DIRECT_TINY,)),
    "awm_tiny": Evidence("tiny-e2e", (MORE_TINY,)),
    "dgpo_tiny": Evidence("tiny-e2e", (MORE_TINY,)),
    "flow_grpo_wan_tiny": Evidence("tiny-e2e", (MORE_TINY,)),
    "dmd2_tiny": Evidence("tiny-e2e", ("tests/test_dmd2.py::test_resume_mid_run_is_exact_for_both_roles",)),
    "flow_grpo_flux_tiny": Evidence("tiny-e2e", ("tests/test_conditions.py::test_an_edit_run_trains_and_validates_on_"
                                                 "its_sources_through_pixelrl_train",)),
    "flow_grpo_qwen_image_tiny": Evidence("tiny-e2e", ("tests/test_conditions.py::test_a_run_of_one_and_two_picture_"
                                                       "rows_trains_and_validates_each",)),
    # the shapes world
    "shapes_demo": Evidence("proxy-gated", ("docs/results.md#the-shapes-demo-make-demo", "tests/test_demo.py::"
                                            "test_the_demo_runs_end_to_end_and_writes_its_summary")),
    "shapes_demo_long": Evidence("proxy-gated", ("docs/results.md#the-shapes-demo-make-demo",)),
    "shapes_edit_demo": Evidence("proxy-gated", ("docs/shapes_edit.md#rl-for-editing-on-the-cpu-pixelrl-demo-edit",)),
    "shapes_opd": Evidence("proxy-gated", ("docs/algorithms/opd.md#rl-then-distil-on-the-cpu-pixelrl-demo-distill",),
                           "the student's gain over the base, at 10 steps"),
    "shapes_sft": Evidence("measured", ("docs/algorithms/sft.md#what-was-measured-2026-12-02-2-core-amd-epyc-cpu",),
                           "the paired gain's interval includes 0: the base was pretrained on this world"),
    "shapes_edit_sft": Evidence("measured", ("docs/algorithms/sft.md#editing-demonstrations-2026-12-02-2-core-intel-"
                                             "xeon-cpu",), "the paired gain's interval includes 0"),
    "shapes_text_ocr": Evidence("proxy-gated", ("docs/shapes.md#the-text-task-for-the-ocr-reward",),
                                "the gain is in exactly readable words; the ocr score's interval touches 0"),
    "vlm_grpo_shapes_qa": Evidence("measured", ("docs/results.md#the-vision-language-demo-pixelrl-demo-vlm",),
                                   "+0.13 balanced accuracy for the demo's seed, less for others; no interval"),
    "shapes_dmd2": Evidence("measured", ("docs/algorithms/dmd2.md#what-was-measured",),
                            "the 4-step student ends above the base at 4 steps, intervals overlapping, one run"),
    "shapes_dpo_offline": Evidence("measured", ("docs/algorithms/diffusion_dpo.md#offline-preference-data",),
                                   "no interval, measured 2026-11-22"),
    "shapes_awm": Evidence("measured", (SHAPES_METHODS,), "one seed each"),
    "shapes_nft": Evidence("measured", (SHAPES_METHODS,), "one seed each"),
    "shapes_dgpo": Evidence("measured", (SHAPES_METHODS,), "one seed each"),
    "shapes_dpo": Evidence("measured", (SHAPES_METHODS,), "one seed each"),
    "shapes_flow_grpo": Evidence("measured", (SHAPES_METHODS,), "one seed each"),
    "shapes_demo_flow_grpo": Evidence("measured", ("docs/results.md#the-shapes-demo-make-demo",),
                                      "no interval; the demo until 2026-11-26"),
    "shapes_demo_flow_grpo_long": Evidence("measured", ("docs/results.md#the-shapes-demo-make-demo",),
                                           "on the retired v2 shapes model"),
    "shapes_flow_grpo_long": Evidence("measured", ("docs/history/shapes_log.md#on-the-first-model-measured-"
                                                   "2026-11-23",),
                                      "on a retired shapes model"),
}


def evidence_line(config_name: str | None) -> str | None:
    """`evidence: <level> (<what it means>): <where>` for a shipped recipe; None for a user's own
    YAML file or the defaults."""
    entry = RECIPES.get(config_name or "")
    if entry is None:
        return None
    note = f"; {entry.note}" if entry.note else ""
    return f"evidence: {entry.level} ({LEVELS[entry.level]}{note}): {', '.join(entry.where)}"


def _link(where: str) -> str:
    """A reference as a link from docs/algorithms/ (a test as its file, named)."""
    if where.startswith("docs/"):
        path, _, anchor = where.partition("#")
        page = path[len("docs/"):]
        target = page[len("algorithms/"):] if page.startswith("algorithms/") else "../" + page
        suffix = f"#{anchor}" if anchor else ""
        return f"[{page}{suffix}]({target}{suffix})"
    file, _, test = where.partition("::")
    return f"`{file}::{test}`" if test else f"`{file}`"


def evidence_table() -> str:
    """The markdown table of docs/algorithms/paper_settings.md: every recipe, highest level first."""
    order = list(LEVELS)
    rows = ["| recipe | level | evidence | note |", "|---|---|---|---|"]
    for name, entry in sorted(RECIPES.items(), key=lambda item: (order.index(item[1].level), item[0])):
        rows.append(f"| `{name}` | {entry.level} | {'<br>'.join(_link(w) for w in entry.where)} | {entry.note} |")
    return "\n".join(rows)
