"""Wire schemas: the JSON bodies the job server answers with and the client parses. Owned by neither
side: `api/` and `opd_trainer/client/` both import them from here."""
