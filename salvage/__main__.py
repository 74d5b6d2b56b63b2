"""``python -m salvage``: the ``salvage`` command (``salvage.commands.cli``)."""

from salvage.commands.cli import main

if __name__ == "__main__":
    main()
