"""Progress on the console: each training line ends with `i/N, elapsed, eta`, counted from the
steps this process ran (a resumed run's earlier steps do not make its ETA optimistic)."""

from pixelrl.core.progress import Progress, duration
from pixelrl.trainers.tracking import Tracker


def test_duration_reads_like_a_clock():
    assert [duration(s) for s in (4.6, 65, 3725)] == ["5s", "1m05s", "1h02m"]


def test_the_eta_counts_this_process_steps_only():
    now = [100.0]
    progress = Progress(total=10, first_done=4, clock=lambda: now[0])  # resumed after step 4
    assert progress.line(4) == ""  # a validation row before the first step of this process
    now[0] += 30.0
    assert progress.line(5) == "5/10, 30s, eta 2m30s"  # 5 steps left at 30 s each
    now[0] += 30.0
    assert progress.line(6) == "6/10, 1m00s, eta 2m00s"


def test_the_eta_ends_where_the_time_budget_stops_the_run():
    """210 steps at 4 s each would take 14 minutes more; a 10-minute trainer.time_budget_s stops the
    run first, and the ETA says so."""
    now = [0.0]
    progress = Progress(total=210, clock=lambda: now[0], budget_s=600.0)
    now[0] += 40.0
    assert progress.line(10) == "10/210, 40s, eta 9m20s (time budget)"
    unbounded = Progress(total=20, clock=lambda: now[0], budget_s=600.0)
    now[0] += 40.0
    assert unbounded.line(10) == "10/20, 40s, eta 40s"  # the steps end first


def test_console_lines_end_with_the_progress(tmp_path):
    lines = []
    tracker = Tracker(["console"], tmp_path, "p", "e", {}, console=lines.append, total_steps=3)
    tracker.log({"critic/rewards/mean": 0.5}, 1)
    tracker.log({"critic/rewards/mean": 0.6}, 3)
    assert lines[0].startswith("step 1: rewards/mean=0.5  [1/3, ") and "eta" in lines[0]
    assert lines[1].endswith("eta 0s]")
    plain = []
    Tracker(["console"], tmp_path, "p", "e", {}, console=plain.append).log({"critic/rewards/mean": 0.5}, 1)
    assert plain == ["step 1: rewards/mean=0.5"]


def test_generation_says_how_far_it_is(tiny_pixel_path, capsys):
    """`pixelrl eval` and `generate` sample in batches and say after each how many images are done
    and how long the rest will take (a 384-image evaluation took minutes in silence)."""
    from pixelrl.engine.evaluate import generate
    from pixelrl.models.loader import load_folder_model

    model = load_folder_model(tiny_pixel_path)
    generate(model, ["a red circle"] * 5, list(range(5)), num_steps=2, guidance_scale=1.0, batch_size=2,
             progress=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("generated images")]
    assert [line.split(",")[0] for line in lines] == ["generated images: 2/5", "generated images: 4/5",
                                                      "generated images: 5/5"]
    assert lines[-1].endswith("eta 0s")
