"""`inferq bench`: the performance scenarios of DESIGN §7, run side by side in one invocation.

It lives with the workers because its baselines drive an engine in-process; the API never
imports it.
"""
