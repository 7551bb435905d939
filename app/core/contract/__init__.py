"""The jobs API's contract: the bodies a caller sends and gets back (docs/api.md, "HTTP API
(v1)"), which the OpenAI surfaces, batch lines and webhook events reuse.

Owns: the rules every body follows (``base``), sampling parameters and structured outputs
(``params``), a chat's messages and tools (``chat``), a pooled job's inputs, options and
packed output (``pooling``), a job's body and the Job object (``jobs``). May import: the
ground only (it uses ``models`` and ``settings``).
"""
