"""Example handlers and the invariant checker, used by the demo, the tests, benchmarks and
deploy."""
