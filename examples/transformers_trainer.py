"""The Hugging Face `Trainer` fine-tuning a classifier, recorded by `lab` (lab[transformers]).

As transformers' `examples/pytorch/text-classification/run_glue.py` does, this builds a
`Trainer` from `TrainingArguments`, trains, evaluates every `--save-every` steps and saves a
`checkpoint-N` folder there, then predicts on the test set. What changes:

- the data and the model: a pretrained BERT and GLUE need a download, so `examples()` makes
  token sequences labelled by the parity of their first token, and the model is a 2-layer
  `BertForSequenceClassification` built from a `BertConfig`, its weights drawn from the run's
  seed;
- the `Trainer` gets `LabCallback(run)`, and `train(trainer, predict=...)` replaces
  `trainer.train()`: the run records the logged metrics at the Trainer's step, each
  evaluation as an eval, each `checkpoint-N` by reference (nothing copied), and the test
  predictions as one row per example (`lab.inspect.disagreements` compares them across
  arms); a rerun resumes from the newest `checkpoint-N` of each unfinished run;
- arms range over `TrainingArguments` fields: `training_args(run, ...)` takes the run's
  `learning_rate`, `max_steps` and `save_steps` from its arm, its `seed` from its repeat and
  its `output_dir` in the run's folder (`runs/transformers_trainer/<run>/trainer`); 2 arms
  (learning rates 5e-5 and 1e-3) x 2 repeats.

    python examples/transformers_trainer.py               # into ./lab.db and ./runs
    python examples/transformers_trainer.py --stop-at 5   # SIGKILLed at step 5 of the last run...
    python examples/transformers_trainer.py               # ...which this resumes from checkpoint-4
"""

from __future__ import annotations

import argparse

import pydantic
import torch
import transformers

from lab import Arm
from lab.integrations.transformers import LabCallback, train, training_args

from _lab import parse_args, run_experiment

SEQUENCE = 8  # tokens per example
VOCAB = 100


class Config(pydantic.BaseModel):
    learning_rate: float = 5e-5
    max_steps: int = 12
    save_steps: int = 4
    per_device_train_batch_size: int = 8
    n_train: int = 128
    n_test: int = 32


def examples(n: int, seed: int) -> list[dict]:
    """`n` sequences labelled by the parity of their first token, each with an `example_id`
    (the Trainer drops the column before the model's forward; the prediction rows keep it)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQUENCE), generator=g)
    return [
        {
            "input_ids": ids[i],
            "attention_mask": torch.ones(SEQUENCE, dtype=torch.long),
            "labels": int(ids[i, 0] % 2),
            "example_id": f"ex{i}",
        }
        for i in range(n)
    ]


def train_run(run):
    """One arm x repeat: a Trainer built from the run's `TrainingArguments`, recorded."""
    config = run.config
    torch.manual_seed(run.seed)
    model = transformers.BertForSequenceClassification(
        transformers.BertConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=37,
            vocab_size=VOCAB,
            num_labels=2,
        )
    )
    args = training_args(
        run,
        use_cpu=True,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=config.save_steps,
        save_total_limit=2,
        metric_for_best_model="loss",
        disable_tqdm=True,
        log_level="warning",
    )
    test = examples(config.n_test, seed=2)
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=examples(config.n_train, seed=1),
        eval_dataset=test,
        callbacks=[LabCallback(run)],
    )
    train(trainer, predict={"test": test})  # trainer.train(), recorded and resumable
    return run.artifacts  # its final metrics rank the arms


def main():
    parser = argparse.ArgumentParser(description="A tiny BERT fine-tuned by the Trainer.")
    parser.add_argument(
        "--max-steps", type=int, default=12, help="optimizer steps a run (default: 12)"
    )
    parser.add_argument(
        "--n-train", type=int, default=128, help="training sequences (default: 128)"
    )
    parser.add_argument(
        "--save-every",
        type=int,
        default=4,
        metavar="N",
        help="evaluate and save a checkpoint-N every N steps (default: 4)",
    )
    parser.add_argument(
        "--seed", type=int, default=42, help="seed of the first repeat (default: 42)"
    )
    args = parse_args(parser)
    base = Config(max_steps=args.max_steps, save_steps=args.save_every, n_train=args.n_train)
    arms = [Arm("lr-5e-5"), Arm("lr-1e-3", learning_rate=1e-3)]
    result = run_experiment(
        "transformers_trainer", train_run, args, base_config=base, arms=arms, seed=args.seed,
        metric="eval/loss", mode="min",
    )  # fmt: skip
    print(result.summary())


if __name__ == "__main__":
    main()
