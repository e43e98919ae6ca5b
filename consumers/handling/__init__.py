"""Running the application's handler: the workers, retries, parking, dead letters."""
