"""The run's data: sources read into lanes, mixtures, the grain pipeline, and the run's one entry point."""
