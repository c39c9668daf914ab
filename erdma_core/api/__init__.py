"""The public API: joining a job (``init``), process groups and their collectives, and ``Work`` handles."""
