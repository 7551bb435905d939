"""Who runs next, and whether a call is admitted (docs/scheduling.md).

Owns: prompt tokens as the served model counts them (``tokens``); fair share between tenants
(``fairshare``); admission, rate limits and backpressure (``limits``); which models this
deployment serves (``catalog``); each model's backlog and the workers it needs (``backlog``).
May import: ``processes``, ``webhooks`` and everything below them.
"""
