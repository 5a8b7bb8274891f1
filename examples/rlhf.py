"""An RLHF-shaped loop as in ColossalChat's GRPO, recorded by `lab`: 2 arms x 2 repeats.

ColossalChat's GRPO trains a causal language model on prompts: a producer generates several
answers to each prompt with the current policy, a reward function scores them, and a consumer
updates the policy with group-relative advantages (each answer against the other answers to
the same prompt, no critic) and a KL penalty to a frozen reference copy of the starting
policy. This is that loop in miniature, on the CPU in seconds, in pure torch:

- the policy: `Policy`, a causal transformer of two layers (d_model 48, 14 tokens: the
  numbers 0-11, an end token and padding, which it reads but never generates);
- the prompts: the first three terms of an arithmetic sequence mod 12 (start 0-11, step 1-3:
  36 prompts, e.g. ``3 5 7``); each episode takes the next `--prompts` of them in a fixed
  order, the same in every arm and repeat, so `lab.inspect.disagreements` compares arms per
  prompt;
- the answers: `generate` samples `--group-size` answers per prompt, up to four tokens or the
  end token; the Experience holds the sequences (prompt + answer), their attention mask, the
  action mask of the answer's tokens, the per-token log-probs of the policy that acted and
  its per-token KL to the reference;
- the reward, a rule: the fraction of the four answer positions that hold the sequence's next
  three terms and then the end token (``3 5 7`` -> ``9 11 1 <eos>`` scores 1.0);
- the update, `grpo_step`: GRPO's clipped surrogate with `lab.rl.grpo_advantages` and
  `--kl-coef` times `lab.rl.approx_kl` (k3) to the reference, on `lab.rl.OnPolicyLoop`
  (`make_experience` the producer, `learn` the consumer);
- the rollouts: `Rollouts(describe=...)` stores a sample of each episode's answers, decoded
  to text, as prediction rows (prompt as input, answer as output, reward as score);
- arms: two KL coefficients (a loose and a tight leash to the reference), 2 repeats each.

    python examples/rlhf.py                       # into ./lab.db and ./runs
    python examples/rlhf.py --stop-at 150         # SIGKILLed at step 150 of the last run...
    python examples/rlhf.py                       # ...which this resumes; the rest are reused
"""

from __future__ import annotations

import argparse
import copy

import pydantic
import torch
import torch.nn as nn
import torch.nn.functional as F

from lab import Arm, CheckpointConfig
from lab.rl import EpisodeInfo, Experience, OnPolicyLoop, Rollouts, approx_kl, grpo_advantages

from _lab import parse_args, run_experiment

NUMBERS = 12  # tokens 0..11 are the numbers, mod 12
EOS = 12
PAD = 13  # fills an answer after its EOS: read, never generated
VOCAB = 14
ACTIONS = EOS + 1  # the tokens the policy can generate: the numbers and EOS
PROMPT_LEN = 3  # a prompt: the first three terms of the sequence
ANSWER_LEN = 3  # an answer: the next three, then the end token
MAX_NEW = ANSWER_LEN + 1
STEPS = (1, 2, 3)


class Config(pydantic.BaseModel):
    episodes: int = 300
    prompts: int = 8
    group_size: int = 8
    batch_size: int = 32
    learn_epochs: int = 1
    lr: float = 3e-3
    kl_coef: float = 0.04
    clip_range: float = 0.2
    max_grad_norm: float = 1.0
    d_model: int = 48
    layers: int = 2
    heads: int = 4
    rollouts: int = 16
    save_every: int = 50


# -- the task -------------------------------------------------------------------------------


def all_prompts() -> torch.Tensor:
    """The 36 prompts, [36, PROMPT_LEN]: every start 0-11 with every step in STEPS."""
    return torch.tensor(
        [
            [(start + i * step) % NUMBERS for i in range(PROMPT_LEN)]
            for step in STEPS
            for start in range(NUMBERS)
        ]
    )


def episode_prompts(episode: int, count: int) -> torch.Tensor:
    """The `count` prompts of episode `episode`: the next ones in a fixed shuffled order, the
    same in every arm and repeat (a function of the episode alone, so a resume needs no
    state for it)."""
    prompts = all_prompts()
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0))
    return prompts[order[(torch.arange(count) + episode * count) % len(prompts)]]


def answer_key(prompts: torch.Tensor) -> torch.Tensor:
    """The right answer to each prompt, [B, MAX_NEW]: the next ANSWER_LEN terms, then EOS."""
    step = (prompts[:, 1] - prompts[:, 0]) % NUMBERS
    terms = [(prompts[:, -1] + (i + 1) * step) % NUMBERS for i in range(ANSWER_LEN)]
    return torch.cat([torch.stack(terms, dim=1), torch.full((len(prompts), 1), EOS)], dim=1)


def reward(sequences: torch.Tensor) -> torch.Tensor:
    """The rule that scores an answer, [B]: the fraction of its MAX_NEW positions that hold
    the right token (the padding after an early end token holds none)."""
    key = answer_key(sequences[:, :PROMPT_LEN])
    return (sequences[:, PROMPT_LEN:] == key).float().mean(dim=1)


def decode(tokens: torch.Tensor) -> str:
    """Tokens as text: the numbers, then ``<eos>``."""
    return " ".join("<eos>" if t == EOS else str(t) for t in tokens.tolist() if t != PAD)


# -- the policy -----------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer block: masked self-attention, then an MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = (z.transpose(1, 2) for z in qkv.unbind(2))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Policy(nn.Module):
    """A tiny causal language model: token and position embeddings, blocks, a head."""

    def __init__(self, d_model: int = 48, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(PROMPT_LEN + MAX_NEW, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, ACTIONS)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, ACTIONS] of the next token; position t sees the positions <= t that
        attention_mask keeps."""
        t = tokens.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = (causal & attention_mask.bool()[:, None, :])[:, None]
        x = self.tok(tokens) + self.pos.weight[:t]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


@torch.no_grad()
def generate(
    policy: Policy, prompts: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample an answer to each prompt, token by token, until EOS or MAX_NEW tokens.

    Returns the sequences [B, PROMPT_LEN + MAX_NEW] (PAD after an answer's EOS), their
    attention mask (0 on that padding) and the action mask [B, MAX_NEW] (1 on the answer's
    tokens, its EOS included)."""
    sequences, attention = prompts, torch.ones_like(prompts)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    for _ in range(MAX_NEW):
        probs = policy(sequences, attention)[:, -1].softmax(dim=-1)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        token = torch.where(done, PAD, token)
        attention = torch.cat([attention, (~done).long()[:, None]], dim=1)
        sequences = torch.cat([sequences, token[:, None]], dim=1)
        done |= token == EOS
    return sequences, attention, attention[:, PROMPT_LEN:]


def token_log_probs(
    policy: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The log-prob [B, MAX_NEW] the policy gives each answer token it sampled (at the
    padding after EOS, which is no action and which the action mask leaves out: EOS's)."""
    logits = policy(sequences, attention_mask)[:, PROMPT_LEN - 1 : -1]
    answer = sequences[:, PROMPT_LEN:]
    answer = torch.where(answer == PAD, EOS, answer)[..., None]
    return logits.log_softmax(dim=-1).gather(-1, answer).squeeze(-1)


# -- the GRPO loop --------------------------------------------------------------------------


def make_experience(
    policy: Policy, reference: Policy, args: Config, info: EpisodeInfo
) -> Experience:
    """The producer: `args.group_size` answers to each of the episode's prompts, scored,
    with GRPO's advantages and the per-token KL of the acting policy to the reference. The
    answers are drawn from the loop's generator (`info.generator`, saved in each checkpoint),
    so a resumed run draws the ones an uninterrupted run would."""
    prompts = episode_prompts(info.episode, args.prompts)
    sequences, attention, action_mask = generate(
        policy, prompts.repeat_interleave(args.group_size, dim=0), info.generator
    )
    with torch.no_grad():
        log_probs = token_log_probs(policy, sequences, attention)
        ref_log_probs = token_log_probs(reference, sequences, attention)
    rewards = reward(sequences)
    return Experience(
        action_log_probs=log_probs,
        rewards=rewards,
        sequences=sequences,
        attention_mask=attention,
        action_mask=action_mask,
        advantages=grpo_advantages(rewards, args.group_size),
        kl=approx_kl(log_probs, ref_log_probs, action_mask),
        example_ids=[decode(p) for p in prompts.repeat_interleave(args.group_size, dim=0)],
    )


def grpo_step(
    policy: Policy, reference: Policy, args: Config, batch: Experience, info: EpisodeInfo
) -> dict[str, torch.Tensor]:
    """The consumer, one learn batch: GRPO's loss, per token the clipped surrogate of the
    group-relative advantage plus `kl_coef` times the k3 KL to the reference, averaged over
    each answer's tokens and then over the answers (DeepSeekMath's GRPO objective)."""
    assert batch.sequences is not None and batch.attention_mask is not None
    assert batch.action_mask is not None and batch.advantages is not None
    log_probs = token_log_probs(policy, batch.sequences, batch.attention_mask)
    with torch.no_grad():
        ref_log_probs = token_log_probs(reference, batch.sequences, batch.attention_mask)
    mask = batch.action_mask.float()
    ratio = torch.exp(log_probs - batch.action_log_probs)
    advantages = batch.advantages[:, None]
    clipped = ratio.clamp(1 - args.clip_range, 1 + args.clip_range)
    surrogate = torch.min(ratio * advantages, clipped * advantages)
    kl = approx_kl(log_probs, ref_log_probs, batch.action_mask)

    def per_answer(per_token: torch.Tensor) -> torch.Tensor:
        return ((per_token * mask).sum(dim=1) / mask.sum(dim=1)).mean()

    policy_loss = -per_answer(surrogate)
    kl_mean = per_answer(kl)
    return {
        "loss": policy_loss + args.kl_coef * kl_mean,
        "loss/policy": policy_loss.detach(),
        "kl": kl_mean.detach(),
        "clip_fraction": per_answer((ratio != clipped).float()).detach(),
        "solved": (batch.rewards == 1).float().mean(),
    }


def describe(experience: Experience, i: int) -> dict[str, object]:
    """Row i of a rollout sample as text: the prompt, the answer and the right answer."""
    assert experience.sequences is not None and experience.action_mask is not None
    sequence = experience.sequences[i]
    prompt = sequence[:PROMPT_LEN]
    answer = sequence[PROMPT_LEN:][experience.action_mask[i].bool()]
    return {
        "input": decode(prompt),
        "output": decode(answer),
        "extras": {"right_answer": decode(answer_key(prompt[None])[0])},
    }


def train_run(run):
    """One arm x repeat: the policy, its frozen reference (the policy as initialized: the run's
    seed makes the same one again on a resume) and the loop."""
    args = run.config
    policy = Policy(args.d_model, args.layers, args.heads)
    reference = copy.deepcopy(policy).requires_grad_(False)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    loop = OnPolicyLoop(
        policy,
        optimizer,
        num_episodes=args.episodes,
        make_experience=lambda info: make_experience(policy, reference, args, info),
        learn=lambda batch, info: grpo_step(policy, reference, args, batch, info),
        learn_epochs=args.learn_epochs,
        batch_size=args.batch_size,
        max_grad_norm=args.max_grad_norm,
        checkpoint=CheckpointConfig(every=args.save_every, keep_last=1),
        rollouts=Rollouts(size=args.rollouts, describe=describe),
        settings={"prompts": args.prompts, "group_size": args.group_size},
    )
    return loop.fit(run)  # resumes from the run's newest checkpoint, if it has one


def main():
    defaults = Config()
    parser = argparse.ArgumentParser(
        description="GRPO on a tiny causal transformer (ColossalChat's loop), recorded by lab"
    )
    parser.add_argument(
        "--episodes",
        type=int,
        default=defaults.episodes,
        metavar="N",
        help="episodes: generate, score, learn (default: %(default)s)",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=defaults.prompts,
        metavar="N",
        help="prompts per episode (default: %(default)s)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=defaults.group_size,
        metavar="N",
        help="answers sampled per prompt, GRPO's group (default: %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        metavar="N",
        help="answers per learn batch, one optimizer step (default: %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=defaults.lr,
        metavar="LR",
        help="Adam's learning rate (default: %(default)s)",
    )
    parser.add_argument(
        "--kl-coefs",
        type=float,
        nargs=2,
        default=[0.04, 0.4],
        metavar="BETA",
        help="the two arms' KL coefficients (default: %(default)s)",
    )
    parser.add_argument(
        "--rollouts",
        type=int,
        default=defaults.rollouts,
        metavar="N",
        help="answers per episode stored as prediction rows (default: %(default)s)",
    )
    parser.add_argument(
        "--save-every",
        type=int,
        default=defaults.save_every,
        metavar="N",
        help="a checkpoint every N episodes (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=1,
        metavar="S",
        help="random seed of the first repeat (default: %(default)s)",
    )
    args = parse_args(parser)
    if args.group_size < 2:
        parser.error("--group-size: give 2 or more; GRPO scores each answer against the others")
    if not 1 <= args.rollouts <= args.prompts * args.group_size:
        parser.error(
            f"--rollouts: give 1 to {args.prompts * args.group_size} (--prompts x --group-size, "
            "the answers an episode makes)"
        )

    config = Config(
        episodes=args.episodes,
        prompts=args.prompts,
        group_size=args.group_size,
        batch_size=args.batch_size,
        lr=args.lr,
        rollouts=args.rollouts,
        save_every=args.save_every,
    )
    arms = [Arm(f"kl-{beta:g}", kl_coef=beta) for beta in args.kl_coefs]
    result = run_experiment(
        "rlhf", train_run, args, base_config=config, arms=arms, seed=args.seed,
        metric="episode/return_mean", mode="max",  # every door ranks the arms by it
        bounds={"episode/return_mean": (0, 1), "solved": (0, 1)},  # fractions
    )  # fmt: skip
    keys = ["episode/return_mean", "solved", "kl", "loss"]
    print(result.summary(keys=keys))


if __name__ == "__main__":
    main()
