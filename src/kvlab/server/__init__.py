"""The OpenAI-compatible HTTP server over kvlab.engine (FastAPI + uvicorn): `kvlab serve MODEL`."""
