"""Evaluation harness: bit accuracy, perplexity, false-positive test, attribution and robustness of the
watermark on a real model, reported as JSON, markdown tables and plots (python -m benchmarks.evaluation)."""
