"""Observability tests: a real Prometheus scraping partq, and the status page in Chromium."""
