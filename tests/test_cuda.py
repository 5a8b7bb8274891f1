"""On a CUDA device: mixed precision with a grad scaler, the CUDA generator across a crash and
a resume, and an experiment's runs on the GPU recorded as on the CPU. Each test skips where
no CUDA device is; the others marked `gpu` live beside the features they check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import lab
from lab import CheckpointConfig, TrainingLoop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

INIT_SCALE = 2.0**24  # float16 gradients overflow at this scale: the first steps are skipped


class Crash(Exception):
    """The failure that interrupts the first attempt."""


def _amp_loss(crash_at: int = 0) -> Any:
    calls = {"n": 0}

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == crash_at:
            raise Crash(f"crash in step {crash_at}")
        x, y = batch
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)  # float16: its dropout draws from the CUDA generator
        return torch.nn.functional.mse_loss(out.float(), y)

    return loss_fn


def _amp_loop(steps: int, crash_at: int = 0) -> TrainingLoop:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen))
            for _ in range(4)]  # fmt: skip
    scaler = torch.amp.GradScaler("cuda", init_scale=INIT_SCALE, growth_interval=3)
    return TrainingLoop(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data,
                        _amp_loss(crash_at), steps, scaler=scaler, device="cuda",
                        checkpoint=CheckpointConfig(every=4))  # fmt: skip


def test_amp_with_a_grad_scaler_resumed_after_a_crash_equals_a_straight_run(
    tmp_path: Path,
) -> None:
    straight = _amp_loop(12)
    straight.fit(run_dir=tmp_path / "straight")
    with pytest.raises(Crash):  # in step 7, after the save of step 4
        _amp_loop(12, crash_at=7).fit(run_dir=tmp_path / "resumed")
    resumed = _amp_loop(12)
    resumed.fit(run_dir=tmp_path / "resumed")
    assert straight.scaler is not None and resumed.scaler is not None
    assert straight.scaler.get_scale() < INIT_SCALE  # overflowing steps were skipped
    assert resumed.scaler.state_dict() == straight.scaler.state_dict()
    first = _amp_loop(1).model.state_dict()  # the weights before any step
    moved = False
    for (name, got), want in zip(resumed.model.state_dict().items(),
                                 straight.model.state_dict().values(), strict=True):  # fmt: skip
        assert got.device.type == "cuda", name
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same dropout masks too
        moved = moved or not torch.equal(got.cpu(), first[name])
    assert moved  # some steps were taken, not all skipped


def _train_on(device: str) -> Any:
    def train(run: lab.RunSpec) -> dict[str, float]:
        model = torch.nn.Linear(4, 1)
        gen = torch.Generator().manual_seed(run.seed)
        data = [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen))
                for _ in range(3)]  # fmt: skip

        def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(m(x), y)

        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return TrainingLoop(model, opt, data, loss_fn, 6, device=device, log_every=2).fit(run)

    return train


def test_an_experiment_on_the_gpu_records_what_it_records_on_the_cpu(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lab.db'}"
    results = {
        device: lab.Experiment(f"on-{device}", _train_on(device), repeats=2,
                               store=url, output_dir=str(tmp_path / device)).run()
        for device in ("cpu", "cuda")
    }  # fmt: skip
    on_cpu, on_gpu = (sorted((r.run_key, r.status) for r in results[d].runs)
                      for d in ("cpu", "cuda"))  # fmt: skip
    assert on_gpu == on_cpu == [("base-r0", "completed"), ("base-r1", "completed")]
    for cpu_run, gpu_run in zip(results["cpu"].runs, results["cuda"].runs, strict=True):
        assert gpu_run.metrics.keys() == cpu_run.metrics.keys()
        assert gpu_run.metrics["loss"] == pytest.approx(cpu_run.metrics["loss"], rel=1e-4)
