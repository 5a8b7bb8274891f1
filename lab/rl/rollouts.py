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


def _tokens(tensor: torch.Tensor, mask: torch.Tensor | None = None) -> str:
    """A row's values as text: a scalar as it is, else the values space-separated."""
    if mask is not None:
        tensor = tensor[mask.bool()]
    values = tensor.detach().cpu().flatten().tolist()
    if len(values) == 1 and tensor.dim() == 0:
        return str(values[0])
    return " ".join(str(v) for v in values)


def describe_row(experience: Experience, i: int) -> dict[str, Any]:
    """The default `Rollouts.describe`: the observation (or the prompt's tokens) as input,
    the action (or the generated tokens) as output."""
    out: dict[str, Any] = {"input": None, "output": None}
    if experience.sequences is not None:
        seq = experience.sequences[i]
        mask = experience.action_mask
        generated = mask.shape[1] if mask is not None else 0
        attention = experience.attention_mask
        prompt_mask = attention[i, : seq.shape[0] - generated] if attention is not None else None
        out["input"] = _tokens(seq[: seq.shape[0] - generated], prompt_mask)
        if generated:
            out["output"] = _tokens(seq[seq.shape[0] - generated :], mask[i])  # type: ignore[index]
    if experience.observations is not None:
        out["input"] = _tokens(experience.observations[i])
    if experience.actions is not None:
        out["output"] = _tokens(experience.actions[i])
    return out


@dataclass(frozen=True)
class Rollouts:
    """Which rows of each episode's experience the store keeps as predictions.

    `size` rows are sampled every `every` episodes (so the volume is bounded), under the eval
    `name`. `describe(experience, i)` gives row i's ``{"input": ..., "output": ...}`` (a
    decoded prompt and generation; an optional ``"extras"`` dict is kept too); by default the
    observation or prompt tokens are the input and the action or generated tokens the output.
    Each row's score is its return, its example id ``experience.example_ids[i]`` (else
    ``str(i)``), its target None.
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
        returns = experience.row_returns()
        describe = self.describe or describe_row
        ids = experience.example_ids
        rows = []
        for i in picked:
            described = dict(describe(experience, i))
            score = float(returns[i])
            row = {
                "example_id": str(ids[i]) if ids is not None else str(i),
                "input": described.get("input"),
                "output": described.get("output"),
                "target": None,
                "score": score,
            }
            if described.get("extras") is not None:
                row["extras"] = described["extras"]
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
