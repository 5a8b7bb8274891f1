"""What an on-policy learner learns from: `Experience`, a dataclass of tensors, batch on dim 0.

One record serves both shapes of on-policy RL: a vector of environments (observations,
actions, values, returns, advantages, one row per environment step) and RLHF (sequences of
prompt + generation with their attention and action masks, log-probs per generated token,
a KL to a frozen reference). `Episodes` carries the returns and lengths of the environment
episodes that ended while the experience was made; without it, each row is one episode.

Both live in `lab.records` with the other records that hooks carry (`on_make_experience_end`
and the learn-batch hooks hand them over), and are re-exported here.
"""

from __future__ import annotations

from lab.records import Episodes, Experience

__all__ = ["Episodes", "Experience"]
