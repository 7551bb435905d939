"""Shared by every process (API, workers, ops worker, CLI): settings, database, job life, queues."""
