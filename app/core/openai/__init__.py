"""OpenAI's surfaces as jobs (docs/openai.md).

Owns: chat/completions and completions on the wire, request bodies in and job rows back to
responses, shared by the endpoints and batch lines (``openai_format``); embeddings, rerank
and score on the wire (``pooling_format``); the Responses API on the wire
(``responses_format``); stored responses, each a job with a row beside it
(``responses``). May import: ``lifecycle`` and everything below it; nothing of ``observe``.
"""
