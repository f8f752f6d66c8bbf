"""What every subcommand shares: the one-line error for bad input, and loading its inputs."""

from __future__ import annotations

import argparse
import importlib
import os
from types import ModuleType

from zerostate.model.designs import Design, UnknownDesignError, get_design
from zerostate.model.scenario import Scenario, ScenarioError

DEFAULT_OUT = "zerostate-report"
EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class CliError(Exception):
    """Bad input or a missing piece: ``main`` prints ``zerostate: <message>`` on stderr, exits 2."""


def load_scenario(path: str) -> Scenario:
    if not os.path.exists(path):
        raise CliError(f"{path}: no such scenario file")
    try:
        return Scenario.load(path)
    except ScenarioError as exc:  # already names the file and the field
        raise CliError(str(exc)) from None


def design(name: str) -> Design:
    try:
        return get_design(name)
    except UnknownDesignError as exc:
        raise CliError(str(exc)) from None


def need(module: str, what: str) -> ModuleType:
    """Import a piece another part of zerostate provides, or fail with a message saying which."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise CliError(f"{what} needs {module}, which this installation of zerostate cannot import "
                       f"({exc})") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a bound of 0 would explore nothing and report every design as holding)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0 (seconds; 0 means no limit where the option says so)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def check_world_size(n: int) -> None:
    """One of the deepspeed target's `WORLD_SIZES` (above 1 a rank pool: ``targets/deepspeed/ranks.py``)."""
    from zerostate.targets.deepspeed.kind import WORLD_SIZES
    if n not in WORLD_SIZES:
        raise CliError(f"--world-size {n}: zerostate runs world size {', '.join(map(str, WORLD_SIZES[:-1]))} "
                       f"or {WORLD_SIZES[-1]}")


__all__ = ["CliError", "DEFAULT_OUT", "EXIT_FINDINGS", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE",
           "check_world_size", "design", "load_scenario", "need", "non_negative_float",
           "positive_int"]
