"""Helpers shared by the tests and the rank scripts they launch (``tests/`` is on ``sys.path``: pyproject's pytest
``pythonpath`` for the tests, ``PYTHONPATH`` from :func:`_support.launch.cpu_env` for the ranks)."""
