"""The README's examples run, and every public name and CLI command is documented."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import typer.main

import lab
from lab.cli import app
from tests import warm

README = Path(__file__).resolve().parent.parent / "README.md"

#: What the README's set-up (``pip install -e .``) leaves out, by the modules that import it:
#: each extra's packages, and pandas (``.df()`` needs it), which no dependency brings.
EXTRAS = {
    "postgres": ("psycopg", "duckdb_extension_postgres_scanner"),
    "server": ("fastapi", "starlette", "uvicorn"),
    "wandb": ("wandb",),
    "system": ("pynvml",),
    "rl": ("gymnasium",),
    "ray": ("ray",),
    "lightning": ("lightning", "jsonargparse"),
    "transformers": ("transformers",),
    "accelerate": ("accelerate",),
    "import": ("mlflow", "tensorboard"),
    "sweeps": ("optuna", "cmaes"),
    "dev": ("pandas", "scipy", "pytest", "hypothesis", "selenium", "schemathesis"),
}

#: Runs a page's python blocks in order, in one namespace, in an interpreter that finds
#: none of the modules named in argv[2] (as if they were not installed).
_RUN_PAGE = """
import re, sys
missing = set(sys.argv[2].split(","))

class NotInstalled:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in missing:
            return None
        return self.finder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        found = getattr(self.finder, "find_distributions", None)
        return found(*args, **kwargs) if found else iter(())

    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()

sys.meta_path[:] = [NotInstalled(finder) for finder in sys.meta_path]
namespace = {"__name__": "docs"}
page = open(sys.argv[1], encoding="utf-8").read()
for block in re.findall(r"```python\\n(.*?)```", page, re.S):
    exec(compile(block, sys.argv[1], "exec"), namespace)
"""


def _run_without_extras(page: Path, folder: Path, extras: Sequence[str] = ()) -> str:
    """What a page's python blocks print, run in order in `folder` by a fresh interpreter
    with the README's set-up and `extras` alone: a block that needs more fails the test."""
    missing = [m for extra, modules in EXTRAS.items() if extra not in extras for m in modules]
    env = {k: v for k, v in os.environ.items() if k != "LAB_STORE_URL"}
    env["PYTHONPATH"] = str(README.parent)
    done = warm.run(
        [sys.executable, "-c", _RUN_PAGE, str(page), ",".join(missing)],
        capture_output=True, text=True, timeout=900, cwd=folder, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-5000:]
    return done.stdout


def _blocks(lang: str, page: Path = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", page.read_text(encoding="utf-8"), re.S)


@pytest.mark.slow
def test_readme_python_examples_run_in_order_with_the_set_up_alone(tmp_path: Path) -> None:
    out = _run_without_extras(README, tmp_path)
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
    assert out.splitlines()[-7:-3] == [  # sweeps: a pruned run, its trial, the points
        "[{'number': 0, 'arm': 's000', 'params': {'lr': 0.1}, 'asked_after': 0, 'told': 0, "
        "'value': 1.4, 'state': 'pruned', 'intermediate': {3: 1.4}}]",
        "{'s000/0': [(1, 2.0), (2, 1.5), (3, 1.4)]}",
        "{'pruned': 1}",
        "[('search', 's000', 0, 'pruned', 1.4)]",
    ]
    assert out.splitlines()[-9] == (  # metric blocks: a step logged again as NaN
        "[(0, 32, 0, 31, 32, 1.0), (1, 32, 32, 63, 31, 0.0303), (2, 32, 64, 95, 32, 0.0154), "
        "(3, 4, 96, 99, 4, 0.0103)]"
    )
    assert out.splitlines()[-8] == (  # its packed points: step 40, offset 8, is NaN
        "[6, 7, 8, 9] (0.02564102564102564, 0.025, nan, 0.023809523809523808)"
    )
    # an experiment whose driver stopped without finishing it (crashed experiments), read
    # alike by a read-only Store and by the Reader that lab ls opens
    assert out.splitlines()[-11:-9] == ["[('driven', 'crashed')]", "True"]
    table = out.splitlines()[-15:-11]  # final_metrics: acc, grad, loss (any order), under a header
    assert sorted(line.split()[1] for line in table[1:]) == ["acc", "grad", "loss"]


def _check_analysis_page(out: str, namespace: dict[str, object]) -> None:
    assert "best arm by test/acc (max): fast, ahead by" in out
    assert "True" in out.splitlines()  # a declared metric: Python and DuckDB name one best arm
    assert "['acc.png', 'loss.png']" in out
    assert not namespace["folder"].exists()  # type: ignore[attr-defined]  # cleaned up


def _check_callbacks_page(out: str, namespace: dict[str, object]) -> None:
    from lab.callbacks import REGISTRY, kinds

    lines = out.splitlines()
    assert lines[:2] == ["5 True", ", ".join(sorted(set(kinds()) - {"loss_every"}))]
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
    assert out.splitlines()[-5:] == [
        f"2 {edges} 8 0",  # the 8 weights of a Linear(4, 2), all in range
        f"4 {edges} 8 0",
        "[('base-r0', 'weights/image', 2, 4, 2), ('base-r0', 'weights/image', 4, 4, 2)]",
        "True",
        "True",  # the store keeps the PNG's bytes
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


def _check_transformers_page(out: str, namespace: dict[str, object]) -> None:
    assert "[('eval', 2), ('eval', 4), ('train', 4), ('test', 4)]" in out
    assert "[(2, 'save', None), (4, 'save', None), (4, 'remove', 'save_total_limit')]" in out
    assert "('fast-r1', 'completed')]" in out
    assert "[(1, 'loss'), (2, 'loss'), (3, 'loss')]" in out


def _check_ray_page(out: str, namespace: dict[str, object]) -> None:
    assert out.splitlines()[-2:] == [
        "[('slow-r0', 'completed'), ('slow-r1', 'completed'), ('fast-r0', 'completed'), "
        "('fast-r1', 'completed')]",
        "fast",
    ]


def _check_lightning_page(out: str, namespace: dict[str, object]) -> None:
    assert out.splitlines() == [
        "[('slow-r0', 'completed'), ('slow-r1', 'completed'), ('fast-r0', 'completed'), "
        "('fast-r1', 'completed')]",
        "[('fast-r0', 0), ('fast-r1', 1), ('slow-r0', 0), ('slow-r1', 1)]",
        "[(512,)]",  # 4 runs x 2 validations x 64 examples
        """[('{"lr": 0.05}', '{"lr":0.05}')]""",  # the arm's config; the module's hparams
        "diff 3",  # lab.inspect.disagreements over the validations' predictions
        "lightning-alone main-r0 lightning-runs/lightning-alone/main-r0",
        """[('{"lr": 0.05}', 'val', 4)]""",
    ]
    assert not Path("lightning-runs").exists()  # cleaned up


def _check_importing_page(out: str, namespace: dict[str, object]) -> None:
    lines = out.splitlines()
    assert lines == [
        "imported 4 new runs (12 points) from mlflow into experiment 'lr-sweep'",
        "nothing new: the 4 runs from mlflow are in experiment 'lr-sweep' already",
        "('lr=0.1', 2, 0.15000000000000002)",
    ]
    page = (README.parent / "docs" / "importing.md").read_text(encoding="utf-8")
    assert "\n".join(["```text", *lines, "```"]) in page  # the page shows what it prints


def _check_sweeps_page(out: str, namespace: dict[str, object]) -> None:
    page = (README.parent / "docs" / "sweeps.md").read_text(encoding="utf-8")
    printed = out.splitlines()
    samplers = ["True", "True", "{'lr': Float(low=0.0001, high=0.1, log=True, when=None)}"]
    assert printed[:3] == samplers  # the samplers' section
    assert "\n".join(["```text", *samplers, "```"]) in page  # the page shows what it prints
    lines = [  # the race's section
        "round 2: lr=0.1 dropped, friedman 5.00 p=0.0042 vs lr=0.01",
        "round 2: lr=0.003 dropped, friedman 3.50 p=0.0242 vs lr=0.01",
        "round 2: lr=0.001 dropped, friedman 3.50 p=0.0242 vs lr=0.01",
        "winner lr=0.01 of ['lr=0.03', 'lr=0.01'] after 21 runs (full: 30)",
        "4 ['lr=0.01'] True",
    ]
    start = printed.index(lines[0])
    assert printed[start : start + len(lines)] == lines
    assert "\n".join(["```text", *lines[:4], "```"]) in page
    assert "\n".join(["```text", *lines[4:], "```"]) in page
    # the race in an experiment
    race = printed.index("lr=1 1")  # the race: lr=1 dropped after round 1 (0-based)
    assert printed[race + 1 : race + 3] == ["14 of 18 runs", "race-demo: 14 runs (14 completed)"]
    assert "lr=1 (eliminated)  val/loss  2" in out
    assert "eliminated by the race: lr=1 after round 1 (t, p=" in out
    assert "best arm by val/loss (min): lr=0.1 (0.4993), ahead of lr=0.03 by 0.001" in out
    shown = [  # the sweep page's JSON
        "[('lr', 'float', False)]",
        "[('lr=0.1', None), ('lr=0.03', None), ('lr=1', 1)]",
        "[('lr=1', 1, 2, 'completed')]",
        "[('lr=1', 1, 't', 'lr=0.1')]",
        "lr=0.1 6 True [{'param': 'lr', 'importance': 1.0}]",
    ]
    start = printed.index(shown[0])
    assert printed[start : start + len(shown)] == shown
    assert "\n".join(["```text", *shown, "```"]) in page
    pruning = [  # pruning in an experiment
        "fast-r0 completed",
        "fast-r1 completed",
        "slow-r0 pruned at step 3 (0.6561)",
        "slow-r1 pruned at step 3 (0.6561)",
        "stuck-r0 pruned at step 3 (1.0000)",
        "stuck-r1 pruned at step 3 (1.0000)",
        "{'completed': 2, 'pruned': 4}",
    ]
    _printed_and_shown(printed, page, pruning)

    # sampled arms in an experiment: asked one at a time, told, reused when run again
    sampled = [
        "s000 (lr=0.01477, opt=sgd): asked after 0, complete 0.5287",
        "s001 (lr=0.002392, opt=adam): asked after 1, complete 0.3859",
        "s002 (lr=0.008922, opt=adam): asked after 2, complete 0.0025",
        "s003 (lr=0.004405, opt=adam): asked after 3, complete 0.1268",
        "4 runs, 4 of them reused",
    ]
    _printed_and_shown(printed, page, sampled)


def _printed_and_shown(printed: list[str], page: str, lines: list[str]) -> None:
    """`lines` were printed in a row, and the page shows them as one text block."""
    start = printed.index(lines[0])
    assert printed[start : start + len(lines)] == lines
    assert "\n".join(["```text", *lines, "```"]) in page


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
    "ray.md": _check_ray_page,
    "lightning.md": _check_lightning_page,
    "transformers.md": _check_transformers_page,
    "importing.md": _check_importing_page,
    "sweeps.md": _check_sweeps_page,
}


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(PAGES))
def test_docs_python_examples_run_in_order(page: str, capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {"__name__": "docs"}
    for block in _blocks("python", README.parent / "docs" / page):
        exec(compile(block, page, "exec"), namespace)
    PAGES[page](capsys.readouterr().out, namespace)


@pytest.mark.slow
def test_the_serve_page_runs_with_the_server_extra_alone_and_runs_again(tmp_path: Path) -> None:
    page = README.parent / "docs" / "serve.md"
    for _ in range(2):  # the same again: a token made a second time, the same answers
        _check_serve_page(_run_without_extras(page, tmp_path, ["server"]), {})
    assert list(tmp_path.iterdir()) == []  # its folders removed


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


def test_the_schema_revision_the_docs_show_is_the_head() -> None:
    from lab.store.migrations import head_revision

    head = head_revision()
    pages = [README, *sorted((README.parent / "docs").glob("*.md"))]
    shown = {
        (page.name, revision)
        for page in pages
        for revision in re.findall(r'"schema":\s*"(\d{4})"', page.read_text(encoding="utf-8"))
    }
    assert shown and shown == {(name, head) for name, _ in shown}
    store = (README.parent / "docs" / "store.md").read_text(encoding="utf-8")
    migrations = store.split("## Migrations", 1)[1].split("\n- ", 1)[0]
    versions = README.parent / "migrations" / "versions"
    revisions = sorted(p.name[:4] for p in versions.glob("[0-9][0-9][0-9][0-9]_*.py"))
    assert revisions[-1] == head
    unnamed = [r for r in revisions if f"`{r}`" not in migrations]
    assert not unnamed, f"say what these revisions add in docs/store.md's Migrations: {unnamed}"


def test_the_readme_names_every_extra_and_what_it_is_for() -> None:
    import tomllib

    pyproject = tomllib.loads((README.parent / "pyproject.toml").read_text(encoding="utf-8"))
    extras = sorted(pyproject["project"]["optional-dependencies"])
    text = README.read_text(encoding="utf-8")
    table = text.split("\n| extra | adds | for |\n|---|---|---|\n", 1)[1].split("\n\n", 1)[0]
    listed = sorted(row.split("`")[1] for row in table.splitlines())
    assert listed == extras, "README.md's extras table lists every extra of pyproject.toml"


#: The first line of a python block that uses what a block above it on its page defines.
CONTINUES = "# continues the blocks above"


def _names(block: str) -> tuple[set[str], set[str]]:
    """The names a block defines, and those it uses without defining (builtins left out)."""
    import ast
    import builtins

    defined: set[str] = set()
    used: set[str] = set()
    for node in ast.walk(ast.parse(block)):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            defined |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
    return defined, used - defined - set(dir(builtins))


@pytest.mark.parametrize(
    "page", [README, *sorted((README.parent / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_a_block_that_continues_the_blocks_above_says_so(page: Path) -> None:
    """A page's python blocks run in order, in one namespace (as the tests above run them);
    one that needs a name an earlier block defines starts with CONTINUES, and one that does
    not runs alone, so it does not say it."""
    earlier: set[str] = set()
    wrong = []
    for number, block in enumerate(_blocks("python", page)):
        defined, free = _names(block)
        says = block.startswith(CONTINUES + "\n")
        if bool(free & earlier) != says:
            wrong.append((number, sorted(free & earlier)))
        unknown = free - earlier
        assert not unknown, f"{page.name}: block {number} uses names no block defines: {unknown}"
        earlier |= defined
    assert not wrong, f"{page.name}: (block, names from blocks above) that say it wrongly: {wrong}"
