"""Request and response schemas (pydantic); ORM rows are converted to these in the services."""
