-- The SQLite schema `create_all` made in the job server of the 2026-11-30 release (before migrations).
CREATE TABLE tenants (
	id VARCHAR(40) NOT NULL, 
	name VARCHAR(128) NOT NULL, 
	created_at INTEGER NOT NULL, 
	PRIMARY KEY (id)
);
CREATE UNIQUE INDEX ix_tenants_name ON tenants (name);
CREATE TABLE api_keys (
	id VARCHAR(40) NOT NULL, 
	tenant_id VARCHAR(40) NOT NULL, 
	key_hash VARCHAR(64) NOT NULL, 
	prefix VARCHAR(16) NOT NULL, 
	created_at INTEGER NOT NULL, 
	revoked_at INTEGER, 
	PRIMARY KEY (id), 
	FOREIGN KEY(tenant_id) REFERENCES tenants (id)
);
CREATE UNIQUE INDEX ix_api_keys_key_hash ON api_keys (key_hash);
CREATE INDEX ix_api_keys_tenant_id ON api_keys (tenant_id);
CREATE TABLE files (
	id VARCHAR(40) NOT NULL, 
	tenant_id VARCHAR(40) NOT NULL, 
	filename VARCHAR(255) NOT NULL, 
	purpose VARCHAR(16) NOT NULL, 
	bytes BIGINT NOT NULL, 
	path TEXT NOT NULL, 
	samples INTEGER, 
	extracted_dir TEXT, 
	created_at INTEGER NOT NULL, 
	PRIMARY KEY (id), 
	FOREIGN KEY(tenant_id) REFERENCES tenants (id)
);
CREATE INDEX ix_files_tenant_id ON files (tenant_id);
CREATE TABLE jobs (
	pk INTEGER NOT NULL, 
	id VARCHAR(40) NOT NULL, 
	tenant_id VARCHAR(40) NOT NULL, 
	job_name VARCHAR(128) NOT NULL, 
	status VARCHAR(24) NOT NULL, 
	spec JSON NOT NULL, 
	file_ids JSON NOT NULL, 
	run_dir TEXT NOT NULL, 
	created_at INTEGER NOT NULL, 
	queued_at FLOAT NOT NULL, 
	started_at INTEGER, 
	finished_at INTEGER, 
	step INTEGER NOT NULL, 
	total_steps INTEGER, 
	eta_s FLOAT, 
	trained_tokens FLOAT NOT NULL, 
	metrics JSON NOT NULL, 
	error JSON, 
	driver_attempts INTEGER NOT NULL, 
	driver_restarts INTEGER NOT NULL, 
	driver_events_offset INTEGER NOT NULL, 
	driver_event_seq INTEGER NOT NULL, 
	PRIMARY KEY (pk), 
	FOREIGN KEY(tenant_id) REFERENCES tenants (id)
);
CREATE INDEX ix_jobs_status ON jobs (status);
CREATE UNIQUE INDEX ix_jobs_id ON jobs (id);
CREATE INDEX ix_jobs_tenant_id ON jobs (tenant_id);
CREATE TABLE job_events (
	id INTEGER NOT NULL, 
	job_id VARCHAR(40) NOT NULL, 
	time FLOAT NOT NULL, 
	type VARCHAR(32) NOT NULL, 
	message TEXT NOT NULL, 
	data JSON NOT NULL, 
	PRIMARY KEY (id), 
	FOREIGN KEY(job_id) REFERENCES jobs (id) ON DELETE CASCADE
);
CREATE INDEX ix_job_events_job_id ON job_events (job_id);
