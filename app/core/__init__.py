"""Shared by every process (API, workers, ops worker, dispatcher, CLI): rooms by concern over
the ground they stand on (docs/architecture.md, "The core's rooms").

From the top floor down; a room imports only from the floors below it, and the rooms of one
floor import nothing of each other (the ``layers`` contract in pyproject.toml):

- ``observe``, ``openai``: what the system shows of itself; OpenAI's surfaces (chat and
  completions, the Responses API) on the wire and its stored responses.
- ``lifecycle``: a job's life, the one owner of its status, the construct every change commits
  through, the job service and a webhook event's redelivery.
- ``scheduling``: who runs next and whether a call is admitted: prompt tokens, fair share,
  limits, which models exist, the backlog.
- ``processes``, ``webhooks``: who is up (presence) and supervisors' children; webhook events
  written in a change's transaction, their rules and a tenant's endpoints.
- ``contract``, ``messaging``, ``storage``, ``tenants``: the jobs API's bodies; what processes
  say to each other through Redis; files and their bytes; API keys.
- the ground, modules of this package: ``queries``, ``status_codes``, ``db`` over ``models``,
  ``errors`` and ``settings``.
"""
