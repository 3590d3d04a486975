"""Step-timeline profiler. A leaf package: it imports nothing else of the project."""
