"""The revisions, oldest first: `0001_job_server`, `0002_scheduler_lease`."""
