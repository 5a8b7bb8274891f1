"""Logger callbacks: each records the lifecycle somewhere."""

from lab.loggers.console import ConsoleLogger
from lab.loggers.sql import SqlLogger

__all__ = ["ConsoleLogger", "SqlLogger"]
