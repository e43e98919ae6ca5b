"""The consumer's pure state machines: ``step(state, event) -> (state, commands)``, no I/O."""
