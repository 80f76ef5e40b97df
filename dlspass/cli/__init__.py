"""The ``dlspass`` command line: ``main()`` for the console script, ``run(argv)`` in-process."""

from dlspass.cli.commands import main, run

__all__ = ["main", "run"]
