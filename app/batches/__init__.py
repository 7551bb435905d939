"""OpenAI batches: created and read by the API; validated, started, finalized by the ops worker."""
