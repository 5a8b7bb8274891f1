"""Rollouts as prediction rows: a sample of each episode's experience goes into the store.

Each sampled row becomes one prediction of an eval named `Rollouts.name` at the step of the
policy that acted, so `lab.inspect.predictions`, `disagreements` and `breakdown` read rollouts
across arms like any eval's examples. The sample is drawn by a generator of its own, seeded
from the run's seed and the episode, never from the training RNG: sampling never changes
training, and a resumed run samples the same rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lab.errors import ConfigError
from lab.records import EvalResult
from lab.rl.experience import Experience

__all__ = ["Rollouts"]

Describe = Callable[[Experience, int], Mapping[str, Any]]


def _text(values: list[Any]) -> str:
    return " ".join(map(str, values))


def describe_rows(experience: Experience, picked: list[int]) -> list[dict[str, Any]]:
    """The default `Rollouts.describe`, for the rows `picked` at once: the observation (or
    the prompt's tokens, padding left out) as input, the action (or the generated tokens
    that `action_mask` keeps) as output, each as its values space-separated. One `tolist`
    per field, so a large sample costs Python strings, not tensor indexing per row."""
    out: list[dict[str, Any]] = [{"input": None, "output": None} for _ in picked]
    index = torch.tensor(picked, dtype=torch.long)
    seq = experience.sequences
    if seq is not None:
        mask = experience.action_mask
        generated = mask.shape[1] if mask is not None else 0
        width = seq.shape[1] - generated
        prompts = seq[index, :width].tolist()
        attention = experience.attention_mask
        keep = None
        if attention is not None:
            prompt_mask = attention[index, :width].bool()
            keep = None if bool(prompt_mask.all()) else prompt_mask.tolist()
        for n, prompt in enumerate(prompts):
            if keep is not None:
                prompt = [t for t, k in zip(prompt, keep[n], strict=True) if k]
            out[n]["input"] = _text(prompt)
        if mask is not None:
            tokens = seq[index, width:].tolist()
            action_mask = mask[index].bool()
            kept = None if bool(action_mask.all()) else action_mask.tolist()
            for n, row in enumerate(tokens):
                if kept is not None:
                    row = [t for t, k in zip(row, kept[n], strict=True) if k]
                out[n]["output"] = _text(row)
    for field, key in ((experience.observations, "input"), (experience.actions, "output")):
        if field is None:
            continue
        values = field[index].detach().cpu()
        rows = values.flatten(1).tolist() if values.dim() > 1 else values.tolist()
        for n, row in enumerate(rows):
            out[n][key] = _text(row) if isinstance(row, list) else str(row)
    return out


def row_scores(experience: Experience) -> torch.Tensor:
    """Each row's score, its return: `returns` at the row's first step when the experience
    carries `returns` (the first step `action_mask` keeps, for a sequence; the return from
    that step on, as the learner estimated it), else the row's rewards summed
    (`Experience.row_returns`). In float64, on the CPU."""
    returns = experience.returns
    if returns is None:
        return experience.row_returns()
    values = returns.detach().to("cpu", torch.float64)
    if values.dim() == 1:
        return values
    values = values.flatten(1)
    first = torch.zeros(values.shape[0], dtype=torch.long)
    mask = experience.action_mask
    if mask is not None and mask.shape == returns.shape:
        kept = mask.detach().cpu().flatten(1).bool()
        first = torch.where(kept.any(1), kept.int().argmax(1), 0)
    return values.gather(1, first.unsqueeze(1)).squeeze(1)


@dataclass(frozen=True)
class Rollouts:
    """Which rows of each episode's experience the store keeps as predictions.

    `size` rows are sampled every `every` episodes (so the volume is bounded), under the eval
    `name`. `describe(experience, i)` gives row i's ``{"input": ..., "output": ...}`` (a
    decoded prompt and generation; an optional ``"extras"`` dict becomes the row's extras);
    by default the observation or prompt tokens are the input and the action or generated
    tokens the output.
    Each row's score is its return (`row_scores`: ``returns`` at the row's first step when
    the experience carries them, else its rewards summed), its example id
    ``experience.example_ids[i]`` (else ``str(i)``), its target None.
    """

    size: int = 16
    every: int = 1
    name: str = "rollouts"
    describe: Describe | None = None

    def __post_init__(self) -> None:
        for what in ("size", "every"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Rollouts({what}={value!r}): use an int >= 1")
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ConfigError(
                f"Rollouts(name={self.name!r}): use a non-empty eval name without '/'"
            )

    def due(self, episode: int) -> bool:
        """Whether episode `episode` (0-based) gets a sample."""
        return episode % self.every == 0

    def sample(self, experience: Experience, *, seed: int, episode: int) -> EvalResult:
        """The episode's sample as an eval with its prediction rows (step set by the loop).

        A `size` larger than the experience is one ConfigError: the sample would not be the
        volume asked for.
        """
        if self.size > experience.size:
            raise ConfigError(
                f"Rollouts(size={self.size}) is larger than episode {episode}'s experience "
                f"({experience.size} rows); sample at most {experience.size} rows"
            )
        generator = torch.Generator().manual_seed((seed * 1_000_003 + episode) % (2**63))
        picked = sorted(torch.randperm(experience.size, generator=generator)[: self.size].tolist())
        returns = row_scores(experience).tolist()
        if self.describe is None:
            described_rows = describe_rows(experience, picked)
        else:
            described_rows = [dict(self.describe(experience, i)) for i in picked]
        ids = experience.example_ids
        rows = []
        for i, described in zip(picked, described_rows, strict=True):
            score = float(returns[i])
            row = {
                "example_id": str(ids[i]) if ids is not None else str(i),
                "input": described.get("input"),
                "output": described.get("output"),
                "target": None,
                "score": score,
            }
            extras = described.get("extras")
            if extras:  # the row's extras: the store keeps keys beyond its fields there
                clash = sorted(set(extras) & set(row))
                if clash:
                    raise ConfigError(
                        "Rollouts(describe=...) gave extras named like a prediction's own "
                        f"fields: {', '.join(clash)}; rename them"
                    )
                row.update(extras)
            rows.append(row)
        scores = torch.tensor([r["score"] for r in rows], dtype=torch.float64)
        finite = scores[torch.isfinite(scores)]
        mean = float(finite.mean()) if finite.numel() else float("nan")
        metrics = {"return_mean": mean, "rows": float(len(rows))}
        return EvalResult(
            self.name,
            metrics,
            predictions=rows,
            breakdowns={"all": {"return_mean": mean}},
        )
