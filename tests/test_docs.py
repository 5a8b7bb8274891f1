"""The README's examples run, and every public name and CLI command is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer.main

import lab
from lab.cli import app

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks(lang: str, page: Path = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", page.read_text(encoding="utf-8"), re.S)


@pytest.mark.slow
def test_readme_python_examples_run_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {"__name__": "readme"}
    for block in _blocks("python"):
        exec(compile(block, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert "best arm by val/loss (min)" in out
    assert "not shown: lr, step_time (all_metrics=True, or --all-metrics, shows them)" in out
    assert "on_run_start" in out
    assert "lr-sweep" in out and "bench-demo" in out
    assert "lr: 0.1 -> 0.05 (large-r0 and 2 more); use a new experiment name" in out
    assert "['throughput/samples_per_s', 'throughput/steps_per_s']" in out  # callbacks-demo


def _check_store_page(out: str, namespace: dict[str, object]) -> None:
    assert out.splitlines()[0] == "auto thread thread"  # the writers a store takes
    assert "metric 'acc' at step 2 is a str ('high')" in out
    assert "keys hold at most 255" in out
    assert "arm names hold at most 512: shorten it" in out
    assert "['RuntimeError: bad\ufffdbyte']" in out
    assert out.splitlines()[-3:] == ["NoStore", "NotADatabase", "False True"]  # read-only
    assert out.splitlines()[-5] == (  # metric blocks: a step logged again as NaN
        "[(0, 32, 0, 31, 32, 1.0), (1, 32, 32, 63, 31, 0.0303), (2, 32, 64, 95, 32, 0.0154), "
        "(3, 4, 96, 99, 4, 0.0103)]"
    )
    assert out.splitlines()[-4] == (  # its packed points: step 40, offset 8, is NaN
        "[6, 7, 8, 9] (0.02564102564102564, 0.025, nan, 0.023809523809523808)"
    )
    # an experiment whose driver stopped without finishing it (crashed experiments)
    assert out.splitlines()[-6] == "[('driven', 'crashed')]"
    table = out.splitlines()[-10:-6]  # final_metrics: acc, grad, loss (any order), under a header
    assert sorted(line.split()[1] for line in table[1:]) == ["acc", "grad", "loss"]


def _check_analysis_page(out: str, namespace: dict[str, object]) -> None:
    assert "best arm by test/acc (max): fast, ahead by" in out
    assert "['acc.png', 'loss.png']" in out
    assert not namespace["folder"].exists()  # type: ignore[attr-defined]  # cleaned up


def _check_callbacks_page(out: str, namespace: dict[str, object]) -> None:
    from lab.callbacks import REGISTRY

    lines = out.splitlines()
    assert lines[:2] == ["5 True", ", ".join(sorted(set(REGISTRY) - {"loss_every"}))]
    REGISTRY.pop("loss_every")  # the page's own kind: gone, so later tests see the built-ins
    assert lines[2:4] == ["LossEvery(every=0): use an int >= 1"] * 2  # both doors, one line
    assert lines[4] == (  # a typo in a needed metric name: an error before the first step
        "EarlyStopping('val/los'): no evaluator, loss function or callback logs metric "
        "'val/los'; did you mean 'val/loss'? (declared: grad_norm, loss, lr, step_time, val/loss)"
    )
    page = (README.parent / "docs" / "callbacks.md").read_text(encoding="utf-8")
    assert f"\n{lines[1]}\n" in page  # the page shows every registered kind
    assert "['checkpoints', 'config.json', 'hooks.jsonl', 'metrics.json']" in lines
    refused = lines.index("['loss', 'loss_x2']")  # a producer's key, seen by a consumer
    assert lines[refused - 1].startswith("RefusedMetric: DoubledLoss put metrics['loss_vec']")
    assert lines[-3:] == ["5 True", "10 True", "10"]  # the replayed LossPrinter


def _check_loggers_page(out: str, namespace: dict[str, object]) -> None:
    kinds = [type(cb).__name__ for cb in namespace["callbacks"]]  # type: ignore[attr-defined]
    assert kinds == ["ConsoleLogger", "WandbLogger", "Notifier"]
    assert "['completed', 'completed']" in out  # the offline wandb experiment
    assert len(list(Path("wandb").glob("offline-run-*"))) == 2  # one wandb run per lab run
    assert ":white_check_mark: lab: experiment notify-demo completed" in out.splitlines()


def _check_provenance_page(out: str, namespace: dict[str, object]) -> None:
    import importlib.metadata

    torch_version = importlib.metadata.version("torch")
    assert out.splitlines() == [
        "{'tags': ['published'], 'notes': 'first try'}",
        "[('prov-b',)]",
        "[('prov-a', 'base-r1'), ('prov-b', 'base-r1')]",
        "2 ('prov-b', 'base-r0', 1.0)",
        f"[('base-r0', '{torch_version}'), ('base-r1', '{torch_version}')]",
    ]


def _check_checkpoints_page(out: str, namespace: dict[str, object]) -> None:
    lines = ["None", "[1, 2, 3, 4]", "['step_000003', 'step_000001']", "step_000003"]
    assert out.splitlines() == lines
    page = (README.parent / "docs" / "checkpoints.md").read_text(encoding="utf-8")
    assert "\n".join(["```", *lines, "```"]) in page  # the page shows what its example prints


def _check_run_handle_page(out: str, namespace: dict[str, object]) -> None:
    lines = out.splitlines()
    assert lines[0] == "completed 12 ['loss', 'val/loss']"
    assert lines[1] == "['COMPLETE', 'export.pt', 'state.pt', 'training_info.json']"
    assert lines[2:5] == ["experiment True", "run loop loop None", "run end completed"]
    assert lines[5] == "[('main-r0', 'completed', 0)]"
    assert lines[6] == "10 float"  # log_every=5: the held tensors read as floats


def _check_media_page(out: str, namespace: dict[str, object]) -> None:
    edges = "[-1.0, -0.5, 0.0, 0.5, 1.0]"
    assert out.splitlines()[-4:] == [
        f"2 {edges} 8 0",  # the 8 weights of a Linear(4, 2), all in range
        f"4 {edges} 8 0",
        "[('base-r0', 'weights/image', 2, 4, 2), ('base-r0', 'weights/image', 4, 4, 2)]",
        "True",
    ]


def _check_rl_page(out: str, namespace: dict[str, object]) -> None:
    lines = out.splitlines()
    assert lines[:3] == [
        "fast [2, 2]",
        "64 [0, 10, 20, 30]",
        "[['slow', 'all', 2], ['fast', 'all', 2]]",
    ]
    assert lines[3] == "Performance summary:"
    assert lines[4].startswith("Generate 12 samples, throughput: ")
    assert lines[5].startswith("Train 24 samples, throughput: ")
    assert not namespace["folder"].exists()  # type: ignore[attr-defined]  # cleaned up


def _check_rl_rlhf_page(out: str, namespace: dict[str, object]) -> None:
    lines = ["[1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]", "[0.1931, 0.3069, 0.0]"]
    assert out.splitlines() == lines
    page = (README.parent / "docs" / "rl-rlhf.md").read_text(encoding="utf-8")
    assert "\n".join(["```text", *lines, "```"]) in page  # the page shows what it prints


def _check_rl_cartpole_page(out: str, namespace: dict[str, object]) -> None:
    lines = out.splitlines()
    assert lines == [
        "True",  # a restored GymVectorEnv goes on as the original
        "[([10.0], [10]), ([10.0, 9.0], [10, 9])]",
        "[1.75, 1.5, 1.0]",
        "-0.1309 0.6667",
        "1.0",
    ]
    page = (README.parent / "docs" / "rl-cartpole.md").read_text(encoding="utf-8")
    assert "\n".join(["```text", *lines[:2], "```"]) in page  # the page shows what it prints
    assert "\n".join(["```text", *lines[2:], "```"]) in page


def _check_serve_page(out: str, namespace: dict[str, object]) -> None:
    assert out.splitlines() == [
        "['completed', 'completed', 'completed', 'completed']",
        "completed",
        "sgd-lr0.1 3",  # reading it: the best arm over HTTP, a series in 4 buckets, predictions
        "40 [1, 11, 21, 31] [10, 20, 30, 40]",
        "64 h00",
    ]


def _check_ray_page(out: str, namespace: dict[str, object]) -> None:
    assert out.splitlines()[-2:] == [
        "[('slow-r0', 'completed'), ('slow-r1', 'completed'), ('fast-r0', 'completed'), "
        "('fast-r1', 'completed')]",
        "fast",
    ]


PAGES = {
    "run-handle.md": _check_run_handle_page,
    "checkpoints.md": _check_checkpoints_page,
    "provenance.md": _check_provenance_page,
    "store.md": _check_store_page,
    "analysis.md": _check_analysis_page,
    "callbacks.md": _check_callbacks_page,
    "loggers.md": _check_loggers_page,
    "media.md": _check_media_page,
    "rl.md": _check_rl_page,
    "rl-rlhf.md": _check_rl_rlhf_page,
    "rl-cartpole.md": _check_rl_cartpole_page,
    "serve.md": _check_serve_page,
    "ray.md": _check_ray_page,
}


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(PAGES))
def test_docs_python_examples_run_in_order(page: str, capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {"__name__": "docs"}
    for block in _blocks("python", README.parent / "docs" / page):
        exec(compile(block, page, "exec"), namespace)
    PAGES[page](capsys.readouterr().out, namespace)


def test_every_public_name_is_in_the_readme() -> None:
    text = README.read_text(encoding="utf-8")
    missing = [name for name in lab.__all__ if name not in text]
    assert not missing, f"document these public names in README.md: {missing}"


def test_every_public_name_has_a_docstring() -> None:
    undocumented = [n for n in lab.__all__ if not (getattr(lab, n).__doc__ or "").strip()]
    assert not undocumented


def _commands(group: typer.Typer, prefix: str = "lab") -> list[str]:
    click_group = typer.main.get_command(group)
    out = []
    for name, cmd in click_group.commands.items():
        sub = getattr(cmd, "commands", None)
        if sub:
            out += [f"{prefix} {name} {s}" for s in sub]
        else:
            out.append(f"{prefix} {name}")
    return out


def test_every_cli_command_is_in_the_readme() -> None:
    text = README.read_text(encoding="utf-8")
    commands = _commands(app)
    assert {"lab quickstart", "lab ls", "lab show", "lab db upgrade", "lab db current"} <= set(
        commands
    )
    missing = [c for c in commands if c not in text]
    assert not missing, f"document these commands in README.md: {missing}"
