"""``python -m ckptflow``: the ``ckptflow`` command, for environments whose scripts are not on PATH.

This directory is the ``ckptflow`` package's own (pyproject maps it there: the repository
root holds only the layout the project fixed); ckptflow.storage, .tasks and .flows live in
their own directories.
"""

from ckptflow.flows.launch import main

if __name__ == "__main__":
    main()
