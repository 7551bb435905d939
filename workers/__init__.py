"""Everything that runs inside Celery worker processes."""
