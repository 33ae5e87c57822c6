"""xmark-gateway service: FastAPI app, auth, registry, model backends."""
