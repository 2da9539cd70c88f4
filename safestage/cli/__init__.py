"""The ``safestage`` command: doctor, run, status, clean, recover, verify, latest, prune, demo,
kit. The only part of the package that prints."""

from ._main import console_main, main

__all__ = ["console_main", "main"]
