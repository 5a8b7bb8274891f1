"""Logger callbacks: each records the lifecycle somewhere (the store, the console, wandb, a
hook log file)."""

from lab.loggers.console import ConsoleLogger
from lab.loggers.jsonl import JsonlLogger
from lab.loggers.sql import SqlLogger
from lab.loggers.wandb import WandbLogger  # wandb itself is imported only when a run starts

__all__ = ["ConsoleLogger", "JsonlLogger", "SqlLogger", "WandbLogger"]
