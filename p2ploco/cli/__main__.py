"""``python -m p2ploco.cli``: the ``p2ploco`` command."""

from p2ploco.cli import main

if __name__ == "__main__":
    main()
