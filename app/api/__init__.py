"""The HTTP API process (`inferq api`): FastAPI app, thin routes, auth and the error envelope."""
