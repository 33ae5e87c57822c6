"""/trace: the naming policy, the fan-out's plan, the analysis and the report of a text, the
HTTP routes and the offline entry point; every caller traces through :func:`service.trace.service.run_trace`."""
