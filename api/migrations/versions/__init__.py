"""The revisions, oldest first: `0001_job_server`, `0002_scheduler_lease`, `0003_file_stored_bytes`,
`0004_webhooks`, `0005_usage`, `0006_dry_run`."""
