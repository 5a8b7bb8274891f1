"""A tiny BERT classifier built from its config (nothing downloaded) and generated data: what
the Hugging Face `Trainer` tests train on CPU in about a second."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers


def examples(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` sequences of 8 tokens, labelled by the parity of their first token, each with an
    ``example_id`` (the Trainer drops it before the model's forward)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (n, 8), generator=g)
    return [
        {"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.long),
         "labels": int(ids[i, 0] % 2), "example_id": f"ex{i}"}
        for i in range(n)
    ]  # fmt: skip


def model(seed: int = 0) -> transformers.BertForSequenceClassification:
    """A 2-layer BERT of hidden size 32 with two labels, its weights drawn from `seed`."""
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
        vocab_size=100, num_labels=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(config)


def arguments(output_dir: Path, **fields: Any) -> transformers.TrainingArguments:
    """Six steps of 4 examples on CPU, logged every step, evaluated and saved every 2 steps
    (one checkpoint kept), ranked by the eval loss; `fields` override."""
    settings: dict[str, Any] = {
        "output_dir": str(output_dir), "use_cpu": True, "report_to": [], "max_steps": 6,
        "per_device_train_batch_size": 4, "logging_steps": 1, "eval_strategy": "steps",
        "eval_steps": 2, "save_steps": 2, "save_total_limit": 1,
        "metric_for_best_model": "loss", "disable_tqdm": True, "seed": 7,
    }  # fmt: skip
    settings.update(fields)
    return transformers.TrainingArguments(**settings)


def trainer(output_dir: Path, callbacks: list[Any], **fields: Any) -> transformers.Trainer:
    """The tiny model's `Trainer` on 32 training and 8 evaluation examples."""
    return transformers.Trainer(
        model=model(), args=arguments(output_dir, **fields), train_dataset=examples(32, 1),
        eval_dataset=examples(8, 2), callbacks=callbacks,
    )  # fmt: skip


class _Kill(transformers.TrainerCallback):
    """SIGKILLs this process after the Trainer's step `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def recorded_fit(folder: Path, kill_at: int = 0, callbacks: Sequence[Any] = ()) -> None:
    """The tiny fit recorded standalone into ``folder/lab.db`` (checkpoints every 2 steps,
    all kept), through `train` (so a rerun resumes); SIGKILLed after step `kill_at` when it
    is not 0; `callbacks` are lab's. The SIGKILL test runs it in a subprocess and in its
    own process alike."""
    from lab.integrations.transformers import LabCallback, train

    callback = LabCallback(experiment="bert", store=f"sqlite:///{folder / 'lab.db'}",
                           output_dir=folder / "runs", callbacks=callbacks,
                           quiet=True)  # fmt: skip
    added = [callback, _Kill(kill_at)] if kill_at else [callback]
    train(trainer(folder / "out", added, save_total_limit=None, metric_for_best_model=None))
