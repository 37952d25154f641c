"""The job spec (`job_spec`), the datasets it names (`dataset`), pre-flight checks (`preflight`)."""
