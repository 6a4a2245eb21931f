"""One replica over OpenAI-compatible HTTP (FastAPI + uvicorn)."""
