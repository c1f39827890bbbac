"""The model benchmark's parts that need no processes (benchmarks/models.py, model_runs.py, model_zoo.py):
the models' layouts, the gradient-time figure, the scoring of snapshots, the ratios and their verdicts,
the report and the plot. Speed is never checked; tests/integration/test_bench_models.py runs it end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from benchmarks import model_zoo as zoo
from benchmarks.model_runs import Run, _clock, grad_time, score
from benchmarks.models import GRAD_TARGET, SYSTEMS, markdown, parse_system, plot, ratio_lines, ratios
from ps.cli.main import main


def test_models_have_the_layouts_the_issue_names():
    resnet = zoo.build_model(zoo.spec_of("resnet18", "full"))
    blocks = [p for p in resnet.parameters() if p.requires_grad]
    assert len(blocks) == 62 and 11_000_000 < zoo.num_params(resnet) < 11_300_000
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in resnet.modules()) == 20
    gpt = zoo.build_model(zoo.spec_of("gpt2", "tiny"))
    assert gpt.lm_head.weight is gpt.wte.weight  # tied: one block in the layout
    assert "lm_head.weight" not in dict(gpt.named_parameters())
    mlp = zoo.build_model(zoo.spec_of("mlp", "tiny"))
    assert sum(isinstance(m, torch.nn.Linear) for m in mlp.modules()) == 30
    assert len(list(mlp.parameters())) == 60


@pytest.mark.parametrize("model", zoo.MODELS)
def test_each_tiny_problem_gives_a_gradient_and_its_metric(model):
    spec = zoo.spec_of(model, "tiny")
    problem = zoo.make_problem(model, "tiny")
    x = problem.init_params(0)
    g = problem.grad(x, 1, spec.batch)
    assert g.grad.shape == x.shape and np.isfinite(g.grad).all() and np.abs(g.grad).sum() > 0
    assert math.isfinite(problem.evaluate(x)[spec.metric])
    # the plain loop and DDP build the same x0 as the server: torch.manual_seed(0), then the model
    torch.manual_seed(0)
    net = zoo.build_model(spec)
    assert np.array_equal(torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy(), x)


def test_snapshot_problem_saves_x_and_says_which(tmp_path):
    problem = zoo.make_problem("mlp", "tiny", snapshots=str(tmp_path / "snaps"))
    x = problem.init_params(0)
    assert problem.evaluate(x)["snapshot"] == 0.0
    ev = problem.evaluate(x + 1)
    assert ev["snapshot"] == 1.0 and ev["snapshot_s"] >= 0
    assert np.array_equal(np.load(tmp_path / "snaps" / "00001.npy"), x + 1)


def test_grad_time_figures_are_finite():
    g = grad_time("mlp", "tiny", reps=2, threads=1, warmup=1)
    assert g["blocks"] == 60 and len(g["plain_all"]) == len(g["grad_all"]) == 2
    assert g["plain_s"] > 0 and g["grad_s"] > 0 and math.isfinite(g["ratio"])


def test_clock_leaves_out_the_stalls_before_it():
    stalls = [(10.5, 0.1), (11.0, 0.2), (12.0, 5.0)]
    assert _clock(11.5, 10.0, stalls) == pytest.approx(1.5 - 0.3)
    assert _clock(10.0, 10.0, stalls) == 0.0


class _Fake:
    """evaluate(x) = {"accuracy": x[0]}."""

    def evaluate(self, x):
        return {"accuracy": float(x[0])}


def test_score_stops_at_the_first_snapshot_that_reaches_the_target_then_thins(tmp_path):
    spec = zoo.spec_of("mlp", "tiny")  # accuracy >= 0.2
    values = [0.05, 0.1, 0.25, 0.15, *([0.3] * 40)]  # reached at the 3rd, not monotone after it
    run = Run("mlp", "tiny", "plain", 1)
    for i, v in enumerate(values):
        path = tmp_path / f"{i:05d}.npy"
        np.save(path, np.array([v], np.float32))
        run.snapshots.append([0.5 * i, 10 * i, str(path)])
    score(run, _Fake(), spec, max_points=10)
    assert run.tta_s == 1.0 and run.tta_step == 20
    assert len(run.curve) <= 10 and run.curve[-1][1] == 10 * (len(values) - 1)
    assert [c[1] for c in run.curve] == sorted(c[1] for c in run.curve)
    none = Run("mlp", "tiny", "plain", 1, snapshots=run.snapshots[:2])
    score(none, _Fake(), spec)
    assert math.isnan(none.tta_s) and none.tta_step == -1 and len(none.curve) == 2


def test_parse_system():
    assert parse_system("plain") == ("plain", 1, 1.0)
    assert parse_system("ddp-2") == ("ddp", 2, 1.0)
    assert parse_system("latecomer-2-slow") == ("latecomer", 2, 3.0)
    for bad in ("ddp", "ddp-x", "latecomer-1-slow", "ray-2", "ddp-2-fast", "ddp-0"):
        with pytest.raises(ValueError):
            parse_system(bad)
    assert all(parse_system(s) for s in SYSTEMS)


def _run(name: str, sps: float, tta: float, train_s: float = 10.0) -> dict:
    kind, procs, slow = parse_system(name)
    r = Run("mlp", "small", kind, procs, slow, steps=int(sps * train_s), train_s=train_s, steps_per_s=sps, tta_s=tta,
            tta_step=10 if math.isfinite(tta) else -1, final=0.9, curve=[[0.0, 0, 0.1], [train_s, 100, 0.9]],
            profile={"threads": 1, "start_s": 2.0, "load": 1.0,
                     "workers": [{"id": "w0", "jobs": 100, "mean_job_s": 0.05}] if kind == "latecomer" else []})
    return r.as_dict()


def _data(**tta) -> dict:
    runs = [_run("plain", 50, 4.0), _run("ddp-1", 45, 4.5), _run("latecomer-1", 40, 5.0), _run("ddp-2", 80, 3.0),
            _run("latecomer-2", 90, tta.get("lc2", 2.5)), _run("ddp-2-slow", 30, tta.get("ddp_slow", 8.0)),
            _run("latecomer-2-slow", 60, tta.get("lc_slow", 4.0))]
    data = {"machine": "test machine; more", "date": "2026-01-01 00:00", "commit": "abc1234", "cores": 2,
            "seconds": 10.0, "size": "small", "grad_size": "full", "grad_reps": 3, "load_start": 0.5, "load_end": 0.6,
            "elapsed_s": 60.0, "specs": {"mlp": zoo.spec_of("mlp", "small").__dict__},
            "grad": [{"model": "mlp", "size": "full", "params": 7_392_778, "blocks": 60, "batch": 64, "threads": 1,
                      "reps": 3, "plain_s": 0.1, "grad_s": 0.11, "ratio": 1.1},
                     {"model": "mlp", "size": "small", "params": 1_861_386, "blocks": 60, "batch": 64, "threads": 1,
                      "reps": 3, "plain_s": 0.01, "grad_s": 0.03, "ratio": 3.0}],
            "runs": runs}
    data["ratios"] = ratios(data)
    return data


def test_ratios_and_their_verdicts():
    rows = _data()["ratios"]
    grad = [r for r in rows if r["what"].startswith("gradient")]
    assert len(grad) == 1 and grad[0]["value"] == pytest.approx(1.1) and grad[0]["met"] is True
    assert grad[0]["target"] == f"<= {GRAD_TARGET:g}"
    steps = {r["what"]: r for r in rows if r["what"].startswith("steps/s")}
    assert steps["steps/s: latecomer-2 / ddp-2"]["value"] == pytest.approx(90 / 80)
    assert steps["steps/s: latecomer-2 / ddp-2"]["met"] is True
    one = steps["steps/s: latecomer-1 / plain"]
    assert one["target"] == "" and one["met"] is None
    tta = {r["what"]: r for r in rows if r["what"].startswith("time to target")}
    slow = tta["time to target: latecomer-2-slow / ddp-2-slow"]
    assert slow["value"] == pytest.approx(0.5) and slow["met"] is True
    lines = ratio_lines(rows)
    assert any("latecomer-2-slow / ddp-2-slow" in ln and "target <= 0.7: met" in ln for ln in lines)


def test_ratios_when_a_run_did_not_reach_the_target():
    def slow_row(**tta) -> dict:
        return [r for r in _data(**tta)["ratios"] if r["what"] == "time to target: latecomer-2-slow / ddp-2-slow"][0]

    # latecomer never reached it in its 10 s, DDP in 8: more than 10 / 8, and not met
    row = slow_row(lc_slow=math.nan)
    assert row["value"] == pytest.approx(1.25) and row["bound"] == "lower" and row["met"] is False
    assert "did not reach" in row["note"] and "> 1.25" in " ".join(ratio_lines([row]))
    # DDP never reached it in its 10 s: latecomer's 4 s over DDP's whole run, an upper bound below the target
    row = slow_row(ddp_slow=math.nan)
    assert row["value"] == pytest.approx(0.4) and row["bound"] == "upper" and row["met"] is True
    assert "upper bound" in row["note"]
    # an upper bound above the target says nothing
    row = slow_row(ddp_slow=math.nan, lc_slow=9.0)
    assert row["value"] == pytest.approx(0.9) and row["met"] is None
    # neither: not measurable
    row = slow_row(ddp_slow=math.nan, lc_slow=math.nan)
    assert math.isnan(row["value"]) and row["met"] is None


def test_ratios_leave_out_pairs_not_run():
    data = _data()
    data["runs"] = [r for r in data["runs"] if r["name"] not in ("ddp-1", "latecomer-1")]
    whats = {r["what"] for r in ratios(data)}
    assert "steps/s: latecomer-2 / ddp-2" in whats
    assert not any("latecomer-1" in w for w in whats)
    data["runs"] = [r | {"skipped": "boom"} if r["name"] == "ddp-2" else r for r in data["runs"]]
    row = {r["what"]: r for r in ratios(data)}["steps/s: latecomer-2 / ddp-2"]  # run but skipped: n/a
    assert math.isnan(row["value"]) and row["met"] is None


def test_markdown_has_every_table_and_row(tmp_path):
    data = _data()
    md = markdown(data, str(tmp_path / "p.png"))
    for head in ("## Gradient time", "## Training runs", "## Ratios and targets", "## Where a latecomer worker's"):
        assert head in md
    for name in SYSTEMS:
        assert f"| mlp | {name} |" in md
    assert "| mlp | full | 7,392,778 | 60 | 64 | 1 | 100.0 | 110.0 | 1.10 | met |" in md
    assert "Commit abc1234" in md and "test machine" in md
    assert "| mlp | latecomer-2 | w0 | 100 | 50.0 |" in md  # compute 50 ms of the wall 10 s / 100 jobs
    skipped = data["runs"][1] | {"skipped": "rank 0 failed: boom"}
    data["runs"][1] = skipped
    assert "skipped: rank 0 failed: boom" in markdown(data)


def test_plot_writes_a_png(tmp_path):
    out = tmp_path / "models.png"
    plot(_data(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,fix", [
    (["--model", "vgg"], "unknown model(s) ['vgg']"),
    (["--systems", "ddp-2,horovod-2"], "unknown system 'horovod-2'"),
    (["--seconds", "0"], "must be positive"),
])
def test_bench_models_refuses_bad_options(args, fix):
    r = CliRunner().invoke(main, ["bench", "--models", *args])
    assert r.exit_code == 2 and fix in r.output, r.output
