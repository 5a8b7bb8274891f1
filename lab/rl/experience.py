"""What an on-policy learner learns from: `Experience`, a dataclass of tensors, batch on dim 0.

One record serves both shapes of on-policy RL: a vector of environments (observations,
actions, values, returns, advantages, one row per environment step) and RLHF (sequences of
prompt + generation with their attention and action masks, log-probs per generated token,
a KL to a frozen reference). `Episodes` carries the returns and lengths of the environment
episodes that ended while the experience was made; without it, each row is one episode.

The RL hooks hand them over (`on_make_experience_end`, the learn-batch hooks: `lab.rl.hooks`);
torch is imported where they use it, so importing this module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from lab.errors import ConfigError, ExperienceError

if TYPE_CHECKING:
    import torch

__all__ = ["Episodes", "Experience"]

#: Experience's tensor fields, batch on dim 0.
_EXPERIENCE_TENSORS = (
    "action_log_probs",
    "rewards",
    "observations",
    "actions",
    "sequences",
    "attention_mask",
    "action_mask",
    "values",
    "returns",
    "advantages",
    "kl",
)


@dataclass
class Episodes:
    """The returns and lengths of the environment episodes that ended (one entry each)."""

    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.returns) != len(self.lengths):
            raise ExperienceError(
                f"Episodes has {len(self.returns)} returns and {len(self.lengths)} lengths; "
                "give one return and one length per ended episode"
            )


@dataclass
class Experience:
    """One batch of on-policy experience; every tensor field has the batch on dim 0.

    ``experience[idx]`` (an index tensor or a slice) is a minibatch; `minibatches` yields
    them for the learn epochs. torch.Tensor fields and `example_ids` that disagree on the batch
    size are one `ExperienceError` naming each field and its size.
    """

    action_log_probs: torch.Tensor
    rewards: torch.Tensor
    observations: torch.Tensor | None = None
    actions: torch.Tensor | None = None
    sequences: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    action_mask: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    example_ids: Sequence[str] | None = None
    episodes: Episodes | None = None

    def __post_init__(self) -> None:
        from torch import Tensor

        sizes: dict[str, int] = {}
        for name in _EXPERIENCE_TENSORS:
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, Tensor):
                raise ExperienceError(
                    f"Experience.{name} is a {type(value).__name__}; give a torch.Tensor "
                    "with the batch on dim 0 (or None)"
                )
            if value.dim() == 0:
                raise ExperienceError(
                    f"Experience.{name} is a 0-d tensor; give a tensor with the batch on dim 0"
                )
            sizes[name] = value.shape[0]
        if self.example_ids is not None:
            sizes["example_ids"] = len(self.example_ids)
        if len(set(sizes.values())) > 1:
            listed = ", ".join(f"{name}={size}" for name, size in sizes.items())
            raise ExperienceError(
                f"Experience fields disagree in batch size ({listed}); give every tensor "
                "the same size on dim 0"
            )
        if self.episodes is not None and not isinstance(self.episodes, Episodes):
            raise ExperienceError(
                f"Experience.episodes is a {type(self.episodes).__name__}; give "
                "Episodes(returns=[...], lengths=[...]) or None"
            )

    @property
    def size(self) -> int:
        """The batch size B (rows)."""
        return int(self.action_log_probs.shape[0])

    @property
    def reward(self) -> torch.Tensor:
        """`rewards` under ColossalChat's name, so its callbacks read it unchanged."""
        return self.rewards

    def row_returns(self) -> torch.Tensor:
        """Each row's return: its rewards summed over dims >= 1 (masked by `action_mask`
        when given; summed in float64), on the CPU."""
        import torch

        rewards = self.rewards.detach()
        if self.action_mask is not None and rewards.shape == self.action_mask.shape:
            rewards = torch.where(self.action_mask.bool(), rewards, 0.0)  # NaN outside: out
        if rewards.dim() > 1:
            rewards = rewards.flatten(1).sum(1, dtype=torch.float64)
        return rewards.cpu()

    def ended_episodes(self) -> Episodes:
        """The episodes this experience reports: `episodes` when given, else one per row
        (return: `row_returns`, length: ``action_mask.sum(-1)`` when given, else 1)."""
        if self.episodes is not None:
            return self.episodes
        returns = self.row_returns().tolist()
        if self.action_mask is not None:
            lengths = self.action_mask.flatten(1).sum(1).tolist()
        else:
            lengths = [1] * self.size
        return Episodes(returns, lengths)

    def __getitem__(self, index: torch.Tensor | slice) -> Experience:
        """The rows `index` selects, as an Experience (its `episodes` left out)."""
        from torch import Tensor

        if not isinstance(index, (Tensor, slice)):
            raise ConfigError(
                f"Experience[{index!r}]: index with a tensor of row indices or a slice"
            )
        values: dict[str, Any] = {}
        for name in _EXPERIENCE_TENSORS:
            value = getattr(self, name)
            values[name] = None if value is None else value[index]
        ids = self.example_ids
        if ids is not None:
            if isinstance(index, slice):
                values["example_ids"] = list(ids)[index]
            else:
                values["example_ids"] = [ids[i] for i in index.tolist()]
        return Experience(**values, episodes=None)

    def to(self, device: str | torch.device) -> Experience:
        """The same experience with every tensor on `device`."""
        moved: dict[str, Any] = {  # as `__getitem__`'s values: each field's own type
            name: (None if getattr(self, name) is None else getattr(self, name).to(device))
            for name in _EXPERIENCE_TENSORS
        }
        return replace(self, **moved)

    def minibatches(
        self,
        batch_size: int | None,
        *,
        generator: torch.Generator | None = None,
        shuffle: bool = True,
    ) -> Iterator[Experience]:
        """Yield the experience in minibatches of `batch_size` rows (the last may be
        smaller; None: one batch of every row), in an order drawn from `generator` when
        `shuffle`."""
        import torch

        size = self.size
        step = size if batch_size is None else batch_size
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ConfigError(f"batch_size={batch_size!r}: give rows per learn batch, an int >= 1")
        if shuffle:
            order = torch.randperm(size, generator=generator)
            for start in range(0, size, step):
                yield self[order[start : start + step]]
        else:
            for start in range(0, size, step):
                yield self[slice(start, start + step)]

    def num_minibatches(self, batch_size: int | None) -> int:
        """How many minibatches `minibatches(batch_size)` yields."""
        return 1 if batch_size is None else math.ceil(self.size / batch_size)
