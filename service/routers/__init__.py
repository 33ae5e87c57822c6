"""HTTP routers; they translate requests to service calls and hold no SQL."""
