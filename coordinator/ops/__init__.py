"""Operations: stream administration, status, dead letters and rights."""
