"""`inferq bench`: the scenarios of docs/benchmarks.md, run side by side in one invocation.

It lives with the workers because its baselines drive an engine in-process; the API never
imports it.
"""
