"""The consumer's broker I/O: its connection, the partition channels, acks, fillers."""
