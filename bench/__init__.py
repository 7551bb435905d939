"""`inferq bench` (`python -m bench`): the scenarios of docs/benchmarks.md, run side by side in
one invocation.

A package of its own beside app/ and workers/: its baselines drive an engine in-process
(workers/engines) and it starts whole stacks (app/cli/stack.py), so it imports both sides, and
no product package imports it (an import contract in pyproject.toml). It is not installed into
the images (the Dockerfile copies app/, workers/ and migrations/ only).
"""
