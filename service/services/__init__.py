"""Business logic between the routers and the repositories; returns pydantic schemas only."""
